"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running code from them.

torch's own reader unpickles ``.metadata`` with plain :mod:`pickle` and its load planner unpickles every non-tensor
item with ``weights_only=False``: a crafted directory runs code in both places. Here ``.metadata`` goes through an
unpickler that resolves only the types DCP metadata is made of, and non-tensor items load with ``weights_only=True``.
Every DCP read of this package (strategies and command line) goes through :class:`SafeFileSystemReader` and
:class:`SafeLoadPlanner`.

A save of ours also stamps every rank's ``.distcp`` file with the save id and that rank
(``lightning_strategies.save.rank<r>``), so files of different saves are never mixed: :func:`check_dcp_files`
refuses a missing, truncated, swapped or foreign file by name before anything is loaded.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import pickle
import re
import stat
import warnings
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from lightning_strategies._torch_private import dcp_flatten_state_dict, dcp_set_element
from lightning_strategies.checkpoint.errors import CheckpointFormatError, OptimizerStateMismatchError
from lightning_strategies.checkpoint.paced_writes import open_sliced

DCP_METADATA_FILE: Final = ".metadata"
STAMP_PREFIX: Final = "lightning_strategies.save.rank"
_STAMP_KEY = re.compile(r"^lightning_strategies\.save\.rank(\d+)$")
_RANK_OF_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")

# What DCP's `.metadata` is made of (torch 2.4 .. 2.13): its dataclasses, torch.Size, dtypes, layouts, paths.
_METADATA_TYPES: Final = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata holds; anything else (``os.system``, ``eval``, ...) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        # Resolved here from modules torch already imported, never through pickle's own lookup (which imports any
        # module named in the file, and is what the audit event "pickle.find_class" reports).
        if name in _METADATA_TYPES.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch.distributed.checkpoint metadata")


def regular_file(path: Path, source: str) -> int:
    """The size of ``path``, which must be a regular file (not a link, a FIFO, a device or a directory).

    Raises:
        CheckpointFormatError: ``path`` is missing or not a regular file.
    """
    try:
        status = path.lstat()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{source} lacks {path.name}: the save that wrote it did not finish.") from None
    if not stat.S_ISREG(status.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(status.st_mode) else "not a regular file"
        raise CheckpointFormatError(
            f"{source}: {path.name} is {kind}. A checkpoint's files are written by its save; use another checkpoint."
        )
    return status.st_size


def read_dcp_metadata(directory: Path, source: str) -> Metadata:
    """Reads ``directory/.metadata`` without running code from it.

    Raises:
        CheckpointFormatError: It is missing, not a regular file, damaged, or names other types than DCP metadata's.
    """
    path = directory / DCP_METADATA_FILE
    regular_file(path, source)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as error:
        raise CheckpointFormatError(
            f"{source}: {DCP_METADATA_FILE} holds objects that only unpickle by running code, which this package"
            f" refuses ({error})."
        ) from error
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OSError) as error:
        raise CheckpointFormatError(
            f"{source}: {DCP_METADATA_FILE} could not be read: truncated or corrupted"
            f" ({type(error).__name__}: {error})."
        ) from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointFormatError(f"{source}: {DCP_METADATA_FILE} is not torch.distributed.checkpoint metadata.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is read by :func:`read_dcp_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The directory's metadata, read safely (then completed as torch's reader does)."""
        directory = Path(self.path)
        metadata = read_dcp_metadata(directory, f"Sharded checkpoint {str(directory)!r}")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch's reading, with damage in a file reported by the file's name."""
        try:
            return super().read_data(plan, planner)
        except _UnsafeItemError as error:  # damaged bytes read the same as a crafted pickle: both named, with the file
            file = self.storage_data[error.read_item.storage_index].relative_path
            raise CheckpointFormatError(
                f"Sharded checkpoint {str(self.path)!r}: {file} is damaged, or crafted to run code ({error}). Use"
                " another checkpoint."
            ) from error
        except CheckpointFormatError:
            raise
        except Exception as error:  # whatever torch.load raises on damaged bytes
            files = sorted({str(self.storage_data[item.storage_index].relative_path) for item in plan.items})
            first_line = (str(error).splitlines() or [""])[0]
            raise CheckpointFormatError(
                f"Sharded checkpoint {str(self.path)!r}: {', '.join(files)} is damaged ({type(error).__name__}:"
                f" {first_line}). Use another checkpoint."
            ) from error


class _UnsafeItemError(CheckpointFormatError):
    """A non-tensor item that torch's weights-only unpickler refuses (:class:`SafeFileSystemReader` names its file)."""

    def __init__(self, message: str, read_item: ReadItem) -> None:
        super().__init__(message)
        self.read_item = read_item


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` with non-tensor items loaded ``weights_only=True`` (torch uses ``False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Loads one non-tensor item (hyper-parameters, names) without running code from it."""
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            # torch's message is long; the line that names the refused opcode or global says what happened.
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if line.startswith("Unsupported")), lines[0] if lines else "")
            raise _UnsafeItemError(
                f"item {read_item.dest_index.fqn!r} only unpickles by running code, which this package refuses:"
                f" {reason}",
                read_item,
            ) from error
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SlicedFileSystem(FileSystem):
    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_sliced(path) as stream:
            yield stream


def sliced_file_system_writer(directory: Path) -> FileSystemWriter:
    """torch's ``FileSystemWriter`` of ``directory`` whose files are written in slices, and paced in a background write
    (:mod:`~lightning_strategies.checkpoint.paced_writes`), like this package's full checkpoint files."""
    writer = FileSystemWriter(directory)
    writer.fs = _SlicedFileSystem()
    return writer


def rank_zero_save_planner() -> DefaultSavePlanner:
    """torch's default save planner, with each item that several ranks hold whole written from the lowest of them.

    DCP writes one copy of an item every rank holds as a plain tensor (a buffer, an optimizer's ``step``) and by default
    takes it from the rank that has written the least so far. Under fsdp2 each rank keeps its own buffers (BatchNorm's
    running statistics, until the next step broadcasts rank 0's), so a directory held another rank's statistics for
    some buffers; ``ddp``'s checkpoints, which rank 0 writes, hold rank 0's.
    """
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def dcp_stamps(save_id: str, rank: int) -> dict[str, Tensor]:
    """The item this rank adds to a DCP save: the save id and its rank, as bytes in a plain tensor (saved per rank)."""
    return {f"{STAMP_PREFIX}{rank}": torch.frombuffer(bytearray(f"{save_id}:{rank}".encode()), dtype=torch.uint8)}


def _read_item(directory: Path, info: Any, source: str) -> Any:
    with open(directory / info.relative_path, "rb") as file:
        file.seek(info.offset)
        data = file.read(info.length)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # any damage in the item's bytes: named, never a traceback
        raise CheckpointFormatError(
            f"{source}: {info.relative_path} is damaged ({type(error).__name__}: {error})."
        ) from error


def check_dcp_files(directory: Path, metadata: Metadata, save_id: str | None, world_size: int, source: str) -> None:
    """Checks that ``directory``'s ``.distcp`` files are all there, whole, and of the save ``save_id``.

    Every file ``.metadata`` points into must be a regular file long enough for its items, and each rank's stamp must
    lie in that rank's own file and name this save and rank. Reads only the stamps (a few bytes per rank). Upstream
    Lightning's directories carry no stamps (``save_id=None``): their files are checked to be there and whole only.

    Raises:
        CheckpointFormatError: Naming the missing, truncated, swapped or foreign file.
    """
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if "/" in name or name.startswith("."):
            raise CheckpointFormatError(f"{source}: {DCP_METADATA_FILE} points outside the directory ({name!r}).")
        if name not in sizes:
            sizes[name] = regular_file(directory / name, source)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            raise CheckpointFormatError(
                f"{source}: {name} is truncated ({sizes[name]} bytes; {DCP_METADATA_FILE} expects at least"
                f" {info.offset + info.length})."
            )
    # Memory is bounded by the files: a tensor may not claim more bytes than its stored chunks hold.
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            declared = math.prod(item.size) * item.properties.dtype.itemsize
            if declared > stored.get(key, 0):
                raise CheckpointFormatError(
                    f"{source}: {DCP_METADATA_FILE} declares {key!r} as {tuple(item.size)} ({declared:,} bytes), more"
                    f" than its files hold ({stored.get(key, 0):,} bytes): damaged or crafted. Refused."
                )
    if save_id is None:
        return
    stamps = {int(match[1]): key for key in metadata.state_dict_metadata if (match := _STAMP_KEY.match(key))}
    if len(stamps) != world_size or not all(0 <= rank < world_size for rank in stamps):
        raise CheckpointFormatError(
            f"{source}: {DCP_METADATA_FILE} lists {len(stamps)} rank stamp(s) for a save at world size {world_size}:"
            f" it belongs to another save than meta.pt (or was written by an older lightning_strategies)."
        )
    by_key = {index.fqn: info for index, info in (metadata.storage_data or {}).items()}
    for rank, key in sorted(stamps.items()):
        info = by_key.get(key)
        if info is None:
            raise CheckpointFormatError(f"{source}: {DCP_METADATA_FILE} does not say where rank {rank}'s stamp is.")
        file_rank = _RANK_OF_FILE.match(str(info.relative_path))
        value = _read_item(directory, info, source)
        expected = f"{save_id}:{rank}"
        found = bytes(value.tolist()).decode(errors="replace") if isinstance(value, Tensor) else repr(value)
        if file_rank is None or int(file_rank[1]) != rank or found != expected:
            raise CheckpointFormatError(
                f"{source}: {info.relative_path} is not rank {rank}'s file of this save (its stamp reads"
                f" {found!r}, meta.pt's save is {save_id!r}): files of different saves were mixed. Use another"
                " checkpoint."
            )


_OPTIMIZER_KEY = re.compile(r"^optimizer_(\d+)$")


@dataclass(frozen=True)
class DcpLayout:
    """Where a DCP directory keeps the model's state and each optimizer's.

    ``fsdp2`` writes the layout of upstream Lightning's ``ModelParallelStrategy``, so that each reads the other's
    directories: ``state_dict.<name>`` for the model, ``optimizer_<i>.state.<name>.<key>`` and
    ``optimizer_<i>.param_groups.<j>.<key>`` for optimizer ``i`` (keyed by parameter name, as torch's
    distributed state-dict API gives it). Upstream's ``FSDPStrategy`` keeps the model under ``model.`` instead.

    Attributes:
        model_key: The top-level key of the model's state.
        writer: Who writes this layout, for messages.
    """

    model_key: str
    writer: str

    @staticmethod
    def optimizer_key(index: int) -> str:
        """The top-level key of optimizer ``index``'s state."""
        return f"optimizer_{index}"

    @staticmethod
    def optimizer_index(key: str) -> int | None:
        """Which optimizer a top-level key holds, or ``None`` for another key."""
        match = _OPTIMIZER_KEY.match(key)
        return int(match[1]) if match else None

    @classmethod
    def of(cls, metadata: Metadata, source: str) -> DcpLayout:
        """The layout of a directory, from its metadata.

        Raises:
            CheckpointFormatError: It holds no model state under a key this package knows.
        """
        for layout in (MODEL_PARALLEL_LAYOUT, FSDP1_LAYOUT):
            if any(key.startswith(f"{layout.model_key}.") for key in metadata.state_dict_metadata):
                return layout
        keys = sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
        raise CheckpointFormatError(
            f"{source}: its {DCP_METADATA_FILE} holds no model state under 'state_dict.'"
            f" ({MODEL_PARALLEL_LAYOUT.writer}) or 'model.' ({FSDP1_LAYOUT.writer}); its top-level keys are"
            f" {keys[:6]}. It is not a Lightning checkpoint."
        )


#: ``fsdp2``'s directories and upstream Lightning's ``ModelParallelStrategy``'s.
MODEL_PARALLEL_LAYOUT: Final = DcpLayout("state_dict", "fsdp2 or Lightning's ModelParallelStrategy")
#: Upstream Lightning's ``FSDPStrategy`` (torch FSDP1) with ``state_dict_type="sharded"``.
FSDP1_LAYOUT: Final = DcpLayout("model", "Lightning's FSDPStrategy")


def dcp_tensor_layout(metadata: Metadata, prefix: str) -> dict[str, Tensor]:
    """The tensors under ``prefix`` (e.g. ``"model."``) as meta tensors of their global shapes and dtypes."""
    return {
        key.removeprefix(prefix): torch.empty(tuple(item.size), dtype=item.properties.dtype, device="meta")
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def dcp_model_layout(metadata: Metadata, model_key: str) -> dict[str, Any]:
    """Every entry of the model state under ``model_key``: its tensors as :func:`dcp_tensor_layout` gives them, and
    each entry stored as objects (a module's ``get_extra_state``) as the string ``"<object>"``.

    DCP flattens an object entry that is a dict into one item per leaf (``"counter._extra_state.seen"``); the
    planner data of the metadata maps each item back to its path, whose second element is the model state's key.
    """
    prefix = f"{model_key}."
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    objects: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or isinstance(item, TensorStorageMetadata):
            continue
        path = paths.get(key)
        name = path[1] if isinstance(path, tuple) and len(path) > 1 and path[0] == model_key else None
        objects[name if isinstance(name, str) else key.removeprefix(prefix)] = "<object>"
    return {**objects, **dcp_tensor_layout(metadata, prefix)}


def safe_dcp_load(state: dict[str, Any], directory: Path, *, flatten: bool = True, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` through :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`.

    Args:
        state: What to load into (DCP's template), changed in place.
        directory: The DCP directory, already checked (``read_dcp_files``).
        flatten: Whether ``state`` is nested (DCP flattens it); ``False`` for a flat ``{key: value}`` dict.
        no_dist: Read without a process group (offline tools).

    Raises:
        CheckpointFormatError: DCP failed on some rank; its first cause is named (DCP's own exception does not survive
            the trip to the launching process).
    """
    planner = SafeLoadPlanner(flatten_state_dict=flatten, flatten_sharded_tensors=flatten)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # offline: intended
            dcp_load(state, storage_reader=SafeFileSystemReader(directory), planner=planner, no_dist=no_dist)
    except CheckpointException as error:
        failures = list(error.failures.values())
        first = failures[0] if failures else error
        cause: BaseException = first[0] if isinstance(first, tuple) else first  # DCP keeps (exception, traceback)
        if isinstance(cause, CheckpointFormatError):
            raise CheckpointFormatError(str(cause)) from None
        raise CheckpointFormatError(
            f"Sharded checkpoint {str(directory)!r} could not be read ({type(cause).__name__}: {cause})."
        ) from None


def load_dcp_items(items: dict[str, Any], directory: Path) -> None:
    """Loads ``items`` (a flat ``{key: tensor or placeholder}`` dict) from a DCP directory, without a process group."""
    safe_dcp_load(items, directory, flatten=False, no_dist=True)


def dcp_world_size(metadata: Metadata) -> int:
    """How many ranks wrote a DCP directory: the ranks of its ``__<rank>_<n>.distcp`` files."""
    ranks = {
        int(match[1])
        for info in (metadata.storage_data or {}).values()
        if (match := _RANK_OF_FILE.match(str(info.relative_path)))
    }
    return max(len(ranks), 1)


def dcp_tensor_count(metadata: Metadata) -> int:
    """How many tensors :func:`iter_dcp_items` yields."""
    return sum(
        isinstance(item, TensorStorageMetadata) and not key.startswith(STAMP_PREFIX)
        for key, item in metadata.state_dict_metadata.items()
    )


def iter_dcp_items(directory: Path, metadata: Metadata) -> Iterator[tuple[str, Any]]:
    """Every item of a checked DCP directory but the stamps, read safely: the small non-tensor items together, then
    each tensor whole, one at a time (memory: one tensor; sizes were checked against the files)."""
    items = {key: item for key, item in metadata.state_dict_metadata.items() if not key.startswith(STAMP_PREFIX)}
    others: dict[str, Any] = {key: None for key, item in items.items() if not isinstance(item, TensorStorageMetadata)}
    if others:  # hyper-parameters and parameter names
        load_dcp_items(others, directory)
        yield from others.items()
    for key, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            target = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)}
            load_dcp_items(target, directory)
            yield key, target[key]


def saved_parameters_only(templates: list[dict[str, Any]], stored: Metadata, layout: DcpLayout) -> list[dict[str, Any]]:
    """Each optimizer's load template without the state of parameters the directory holds no state for.

    torch's template (``get_optimizer_state_dict``) steps a fresh optimizer once, so it has state for every parameter;
    a parameter that had none when the directory was saved (it never received a gradient: a submodule the steps never
    call) keeps none after the load, as under ``ddp``. A parameter whose state is only partly saved stays in the
    template, for :func:`check_dcp_optimizer_states` to name what is missing.

    Args:
        templates: Each optimizer's state as torch's distributed state-dict API gives it.
        stored: The directory's metadata.
        layout: Where the directory keeps each optimizer.
    """
    paths = stored.planner_data if isinstance(stored.planner_data, dict) else {}
    kept = []
    for index, template in enumerate(templates):
        key_of_optimizer = layout.optimizer_key(index)
        saved = {str(path[2]) for path in paths.values() if len(path) > 2 and path[:2] == (key_of_optimizer, "state")}
        state = {name: entries for name, entries in template["state"].items() if name in saved}
        kept.append({**template, "state": state})
    return kept


def check_dcp_optimizer_states(
    templates: list[dict[str, Any]], stored: Metadata, layout: DcpLayout, *, source: str
) -> None:
    """Refuses a DCP directory's optimizer states when they do not fit the optimizers, before anything is loaded.

    Args:
        templates: Each optimizer's state as torch's distributed state-dict API gives it (DCP's load template).
        stored: The directory's metadata.
        layout: Where the directory keeps each optimizer.
        source: How error messages name the directory.

    Raises:
        OptimizerStateMismatchError: Another number of optimizers or param groups, entries the template needs that are
            missing or of another shape, or state for parameters the model does not have.
    """
    paths = stored.planner_data if isinstance(stored.planner_data, dict) else {}
    saved_count = len({path[0] for path in paths.values() if path and layout.optimizer_index(str(path[0])) is not None})
    if saved_count != len(templates):
        raise OptimizerStateMismatchError(
            f"{source} holds {saved_count} optimizer state(s), but configure_optimizers() returned"
            f" {len(templates)}; nothing was loaded. Return the same optimizers as the run that saved it."
        )
    items = stored.state_dict_metadata
    for index, template in enumerate(templates):
        key_of_optimizer = layout.optimizer_key(index)
        flat, _ = dcp_flatten_state_dict({key_of_optimizer: template})
        problems: list[str] = []
        groups = {
            str(path[2])
            for path in paths.values()
            if len(path) > 2 and path[0] == key_of_optimizer and path[1] == "param_groups"
        }
        if len(groups) != len(template["param_groups"]):
            problems.append(f"{len(groups)} param group(s) saved, the optimizer has {len(template['param_groups'])}")
        for key, value in flat.items():
            item = items.get(key)
            if item is None:
                problems.append(f"{key!r} is missing")
            elif isinstance(value, Tensor) and (
                not isinstance(item, TensorStorageMetadata) or tuple(item.size) != tuple(value.shape)
            ):
                size = tuple(item.size) if isinstance(item, TensorStorageMetadata) else "not a tensor"
                problems.append(f"{key!r} has shape {size}, the optimizer's is {tuple(value.shape)}")
        prefix = f"{key_of_optimizer}.state."
        extra = [key for key in items if key.startswith(prefix) and key not in flat]
        problems += [f"{key!r} belongs to no parameter of this model" for key in extra[:3]]
        if problems:
            raise OptimizerStateMismatchError(
                f"{source}, optimizer {index}: the saved state does not fit; nothing was loaded.\n  "
                + "\n  ".join(problems[:10])
            )


def dcp_optimizer_count(stored: Metadata, layout: DcpLayout) -> int:
    """How many optimizers' states a DCP directory holds (0: a weights-only save)."""
    paths = stored.planner_data if isinstance(stored.planner_data, dict) else {}
    return len({path[0] for path in paths.values() if path and layout.optimizer_index(str(path[0])) is not None})
