"""``lightning-strategies inspect``: what wrote a checkpoint, what it holds, and what is wrong with it.

Findings name what a loader would trip over: keys behind a wrapper prefix (repairable with ``convert``), flat
parameter shards and empty model states (Lightning issue 13500: not the model's weights, not repairable), optimizer
states that hold one rank's shard. Nothing here imports Lightning, and files are read with ``weights_only=True``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module

from lightning_strategies.checkpoint import (
    COMPILED_SEGMENT,
    METADATA_KEY,
    WRAPPER_PREFIXES,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMetadata,
    check_model_state,
    read_checkpoint,
    strip_wrapper_segments,
)
from lightning_strategies.checkpoint.dcp import MODEL_PARALLEL_LAYOUT, DcpLayout, dcp_tensor_layout, iter_dcp_items
from lightning_strategies.checkpoint.optimizer_state import PARAM_SHAPED_STATE
from lightning_strategies.checkpoint.sharded import (
    INNER_WRAPPER_SEGMENTS,
    SHARDED_LAYOUT_KEY,
    SHARDED_META_FILE,
    ShardedCheckpoint,
    fairscale_model_layout,
    open_sharded,
    rank_file_paths,
    read_dcp_files,
    read_rank_file,
)
from lightning_strategies.checkpoint.tensors import tensor_defect

from ._common import UsageError, human_bytes
from .model_class import load_model_class, module_optimizer_findings

Severity = Literal["error", "warning", "info"]

# INNER_WRAPPER_SEGMENTS (wrapper attribute names that never name a user's submodule) are removed wherever they occur;
# "module." is a common user name, so it is removed only as a prefix that every key carries.
FLAT_PARAM_KEY = re.compile(r"(^|\.)flat_param(_\d+)?$")


@dataclass(frozen=True)
class Finding:
    """One thing ``inspect`` noticed.

    Attributes:
        severity: ``"error"`` (the checkpoint will not load as it is), ``"warning"`` or ``"info"``.
        code: A stable short name, e.g. ``"wrapper-prefix"`` (see docs/cli.md for the list).
        message: What it is and what to do about it.
        repairable: Whether ``lightning-strategies convert`` repairs it.
    """

    severity: Severity
    code: str
    message: str
    repairable: bool = False


@dataclass
class Inspection:
    """Everything ``inspect`` reports about one checkpoint (``--json`` prints :meth:`to_json`)."""

    path: str
    kind: str
    written_by: dict[str, Any] | None = None
    lightning: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    lr_schedulers: int | None = None
    sharded: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        """The findings of severity ``"error"``."""
        return [finding for finding in self.findings if finding.severity == "error"]

    def add(self, severity: Severity, code: str, message: str, repairable: bool = False) -> None:
        """Records a finding."""
        self.findings.append(Finding(severity, code, message, repairable))

    def to_json(self) -> dict[str, Any]:
        """Plain values for ``json.dumps``; ``ok`` is false when there is an error."""
        data = asdict(self)
        data["ok"] = not self.errors
        return data


# ---------------------------------------------------------------------------------------------- keys


def canonical_key_map(keys: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Maps each key to the name the unwrapped module would use, and lists the wrapper prefixes that were removed.

    Leading prefixes of :data:`WRAPPER_PREFIXES` are removed while every key carries the same one (``module.`` of
    DDP, ``_forward_module.`` of Lightning's wrapper, in any nesting); the ``_``-named wrapper segments
    (``_fsdp_wrapped_module``, ``_fpw_module``, ``_orig_mod``, ``_checkpoint_wrapped_module``) are removed anywhere.

    Args:
        keys: The keys of a model state.

    Returns:
        ``{old key: canonical key}`` and the prefixes found, in the order they were removed.
    """
    current = {key: key for key in keys}
    found: list[str] = []
    stripped = True
    while current and stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(name.startswith(prefix) and len(name) > len(prefix) for name in current.values()):
                current = {key: name.removeprefix(prefix) for key, name in current.items()}
                found.append(prefix)
                stripped = True
    for key, name in current.items():
        segments = [segment for segment in name.split(".") if segment in INNER_WRAPPER_SEGMENTS]
        if segments:
            current[key] = strip_wrapper_segments(name, INNER_WRAPPER_SEGMENTS)
            found.extend(f"{segment}." for segment in segments if f"{segment}." not in found)
    return current, found


def _listing(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def _tensor_summary(state: Mapping[str, Any]) -> dict[str, Any]:
    tensors = [value for value in state.values() if isinstance(value, Tensor)]
    return {
        "keys": len(state),
        "tensors": len(tensors),
        "elements": sum(tensor.numel() for tensor in tensors),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
        "dtypes": sorted({str(tensor.dtype).removeprefix("torch.") for tensor in tensors}),
    }


# ---------------------------------------------------------------------------------------------- model state


def model_state_findings(report: Inspection, state: Any, expected: Mapping[str, Any] | None, source: str) -> None:
    """Adds the findings about a model state: empty, flat shards, wrapper prefixes, and the fit to ``expected``."""
    if not isinstance(state, Mapping):
        report.add("error", "invalid-state-dict", f"'state_dict' should be a dict, found {type(state).__name__}.")
        return
    report.model = _tensor_summary(state)
    _flag_unloadable(report, {str(key): value for key, value in state.items()})
    _flag_non_finite(report, [str(key) for key, value in state.items() if _not_finite(value)])
    if not state:
        report.add(
            "error",
            "empty-state",
            "The model state is empty: it was read from a wrapper that held no parameters in the process that saved"
            " (Lightning issue 13500: fairscale FSDP on other ranks than 0, or below the wrapper). These are not the"
            " model's weights, and nothing can repair them: resume from a checkpoint written by a strategy of this"
            " package, which saves canonical state.",
        )
        return
    key_map, prefixes = canonical_key_map(list(state))
    flat = [key for key, name in key_map.items() if FLAT_PARAM_KEY.search(name)]
    if flat:
        sizes = ", ".join(
            f"{key!r} ({tuple(state[key].shape)})" if isinstance(state[key], Tensor) else repr(key) for key in flat[:3]
        )
        report.add(
            "error",
            "flat-shard",
            f"{len(flat)} key(s) hold flat parameters ({sizes}): FSDP's flattened, padded parameters, or one rank's"
            " shard of them (Lightning issue 13500). They are not the model's tensors and do not say how to cut them"
            " back into its parameters, so this file cannot be repaired. Resume from a checkpoint written by a"
            " strategy of this package (canonical state), or consolidate a sharded checkpoint of ours.",
        )
    elif prefixes:
        renamed = [key for key, name in key_map.items() if key != name]
        collisions = len(set(key_map.values())) < len(key_map)
        example = renamed[0]
        message = (
            f"{len(renamed)} of {len(state)} key(s) carry the wrapper prefix(es) {', '.join(map(repr, prefixes))}"
            f" (e.g. {example!r} for {key_map[example]!r}): the state was read from a wrapper instead of the"
            " LightningModule, so a strict load reports missing and unexpected keys."
        )
        if f"{COMPILED_SEGMENT}." in prefixes:
            message += (
                f" {COMPILED_SEGMENT + '.'!r} is where torch.compile's OptimizedModule keeps the submodule it compiled:"
                " the file was written from a module with submodules compiled with torch.compile (by upstream"
                " Lightning or an older version of this package), and an uncompiled module does not have these keys."
                " This package's strategies read them; the checkpoints they write hold the uncompiled keys."
            )
        if collisions:
            report.add(
                "error",
                "wrapper-prefix",
                message + " Removing the prefixes would give two tensors the same name, so convert cannot repair it.",
            )
        else:
            report.add("error", "wrapper-prefix", message + f" Repair: lightning-strategies convert {source} OUT", True)
    nested = [name for name in key_map.values() if "module" in name.split(".")[1:-1]]
    if not flat and nested and len(nested) == sum(name.count(".") > 1 for name in key_map.values()):
        report.add(
            "warning",
            "nested-wrapper",
            f"Every nested key has a 'module' segment inside its path (e.g. {nested[0]!r}): a wrapper such as DDP"
            " around submodules, below the top of the model. Unless the model has submodules named 'module', a strict"
            " load reports missing and unexpected keys; compare with --module PKG.MOD:CLASS.",
        )
    if expected is not None and not flat:
        # Compared by canonical names: a prefix is already a finding, the question here is whether the tensors fit.
        canonical = {key_map[key]: value for key, value in state.items()}
        checked = canonical if len(canonical) == len(state) else state
        try:
            check_model_state(expected, checked, source="The checkpoint")
        except CheckpointError as error:
            report.add("error", "model-mismatch", str(error) + _flattened_hint(expected, checked))


def _flattened_hint(expected: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    flattened = [
        key
        for key, want in expected.items()
        if isinstance(want, Tensor)
        and want.dim() > 1
        and isinstance(state.get(key), Tensor)
        and state[key].dim() == 1
        and state[key].numel() <= want.numel()
    ]
    if not flattened:
        return ""
    return (
        f"\n  {_listing(flattened)} are 1-D where the model has matrices: flattened (and possibly sharded) parameters,"
        " not the model's weights."
    )


# ---------------------------------------------------------------------------------------------- optimizer state


def _looks_like(entries: set[str]) -> str:
    if {"exp_avg", "exp_avg_sq"} <= entries:
        return "Adam-like"
    if "momentum_buffer" in entries:
        return "SGD with momentum"
    if "square_avg" in entries:
        return "RMSprop/Adadelta-like"
    if "sum" in entries:
        return "Adagrad-like"
    return "no per-parameter state (stateless, or saved before the first step)" if not entries else "unknown"


def optimizer_findings(report: Inspection, states: Any, model_state: Mapping[str, Any] | None) -> None:
    """Adds a summary of each optimizer state and the findings about them (shards, partitions, flat state)."""
    if states is None:
        report.add(
            "warning",
            "no-optimizer-state",
            "No 'optimizer_states': the file holds weights only. Trainer.fit(ckpt_path=...) cannot resume from it;"
            " load the weights (LightningModule.load_from_checkpoint) and start a new optimizer.",
        )
        return
    if not isinstance(states, Sequence):
        report.add("error", "invalid-optimizer-states", f"'optimizer_states' is a {type(states).__name__}, not a list.")
        return
    shapes = {tuple(value.shape) for value in (model_state or {}).values() if isinstance(value, Tensor)}
    for index, state in enumerate(states):
        where = f"optimizer {index}"
        if not isinstance(state, Mapping):
            report.add("error", "invalid-optimizer-state", f"{where} is a {type(state).__name__}, not a dict.")
            continue
        if not state:
            report.add(
                "error",
                "empty-optimizer-state",
                f"{where} is empty: a sharded optimizer saved only the part kept on another rank (Lightning issue"
                " 13500). Its state is lost; resume from a checkpoint written by a strategy of this package.",
            )
            continue
        if "partition" in state or "partitions" in state or isinstance(state.get("state"), list):
            report.add(
                "error",
                "optimizer-partition",
                f"{where} is laid out by rank (fairscale OSS partitions: 'state' per rank or a 'partition' entry),"
                " not torch's layout over the whole model. Load it with the fairscale version and world size that"
                " wrote it and save again with a strategy of this package.",
            )
            continue
        if "state" not in state or "param_groups" not in state:
            report.add(
                "error", "invalid-optimizer-state", f"{where} lacks 'state' or 'param_groups' (has {sorted(state)})."
            )
            continue
        _flag_unloadable(
            report,
            {
                f"{where} state[{param}].{key}": value
                for param, entry in state["state"].items()
                if isinstance(entry, Mapping)
                for key, value in entry.items()
            }
            if isinstance(state["state"], Mapping)
            else {},
        )
        groups = state["param_groups"]
        listed = [param for group in groups for param in group.get("params", [])]
        with_state = list(state["state"])
        entries = sorted({key for entry in state["state"].values() if isinstance(entry, Mapping) for key in entry})
        report.optimizers.append(
            {
                "index": index,
                "looks_like": _looks_like(set(entries)),
                "param_groups": len(groups),
                "parameters": len(listed),
                "parameters_with_state": len(with_state),
                "state_entries": entries,
                "lrs": [group.get("lr") for group in groups],
            }
        )
        unlisted = [key for key in with_state if key not in set(listed)]
        if unlisted:
            report.add(
                "error",
                "optimizer-shard",
                f"{where} has state for parameter index(es) {_listing([str(key) for key in unlisted])} that no param"
                f" group lists (groups list {len(listed)}): one rank's local state, keyed by that rank's own indices.",
            )
        elif listed != list(range(len(listed))) and len(set(listed)) == len(listed):
            report.add(
                "info",
                "optimizer-numbering",
                f"{where} numbers its parameters {_listing([str(p) for p in listed])} through its param groups, not"
                " 0, 1, ... as torch's state_dict() does: upstream Lightning's ModelParallelStrategy and FSDPStrategy"
                " number them in the module's parameter order. It is the same state (torch matches the numbers"
                " through the groups); the strategies here renumber it on load.",
            )
        if not unlisted and 0 < len(with_state) < len(listed):
            report.add(
                "warning",
                "optimizer-partial",
                f"{where} has state for {len(with_state)} of the {len(listed)} parameters its groups list: either"
                " some parameters never had a gradient (frozen, unused), or this is one rank's shard of a sharded"
                " optimizer.",
            )
        flattened = sorted(
            {
                str(param)
                for param, entry in state["state"].items()
                if isinstance(entry, Mapping)
                for key, value in entry.items()
                if key in PARAM_SHAPED_STATE
                and isinstance(value, Tensor)
                and shapes
                and tuple(value.shape) not in shapes
            }
        )
        if flattened:
            report.add(
                "error",
                "optimizer-flat",
                f"{where}: the state of parameter(s) {_listing(flattened)} has shapes that no tensor of the model"
                " state has: flattened or sharded optimizer state (one rank's flat shard), not torch's layout.",
            )


# ---------------------------------------------------------------------------------------------- inputs


def _lightning_details(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    details = {
        "version": checkpoint.get("pytorch-lightning_version"),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
    }
    hyper = checkpoint.get("hyper_parameters")
    if isinstance(hyper, Mapping):
        details["hyper_parameters"] = {str(key): repr(value) for key, value in hyper.items()}
    return {key: value for key, value in details.items() if value is not None}


def _metadata(report: Inspection, checkpoint: Mapping[str, Any], source: str) -> CheckpointMetadata | None:
    try:
        metadata = CheckpointMetadata.read(checkpoint, source=source)
    except CheckpointError as error:
        report.add("error", "invalid-metadata", str(error))
        return None
    report.written_by = metadata.to_dict() if metadata is not None else None
    return metadata


def inspect_file(path: Path, expected: Module | None = None) -> Inspection:
    """Inspects one checkpoint file: a Lightning checkpoint, a bare ``state_dict``, or a rank file of ours."""
    checkpoint = read_checkpoint(path)
    source = str(path)
    is_state_dict = (
        "state_dict" not in checkpoint
        and bool(checkpoint)
        and all(isinstance(value, Tensor) for value in checkpoint.values())
    )
    if is_state_dict:
        report = Inspection(str(path), "state dict")
        report.add(
            "warning",
            "bare-state-dict",
            "The file is a bare model state dict (torch.save(model.state_dict())), not a Lightning checkpoint: it"
            f" loads with LightningModule.load_state_dict; `lightning-strategies convert {source} OUT` wraps it into a"
            " checkpoint that load_from_checkpoint reads.",
            True,
        )
        model_state_findings(report, checkpoint, expected.state_dict() if expected is not None else None, source)
        return report
    kind = "rank file of a sharded checkpoint" if SHARDED_LAYOUT_KEY in checkpoint else "checkpoint"
    report = Inspection(str(path), kind, lightning=_lightning_details(checkpoint))
    metadata = _metadata(report, checkpoint, source)
    if kind != "checkpoint":
        report.add(
            "error",
            "rank-file",
            f"This is one rank's file of a sharded checkpoint directory ({path.parent}), not a checkpoint: give the"
            f" directory to `lightning-strategies consolidate {path.parent} OUT`.",
        )
    elif metadata is None:
        report.add(
            "info",
            "no-metadata",
            f"No {METADATA_KEY!r} block: written by upstream Lightning or by hand. It loads like any full checkpoint"
            " when its keys are canonical; convert adds the block.",
            True,
        )
    elif metadata.state_dict_type != "full":
        report.add("error", "sharded-metadata", "The metadata says 'sharded', but this is a single file.")
    lr_schedulers = checkpoint.get("lr_schedulers")
    report.lr_schedulers = len(lr_schedulers) if isinstance(lr_schedulers, Sequence) else None
    if "state_dict" not in checkpoint:
        report.add(
            "error",
            "no-state-dict",
            f"No 'state_dict' (keys: {', '.join(sorted(map(str, checkpoint)))}): there are no weights to load.",
        )
        return report
    state = checkpoint["state_dict"]
    model_state_findings(report, state, expected.state_dict() if expected is not None else None, source)
    optimizer_findings(report, checkpoint.get("optimizer_states"), state if isinstance(state, Mapping) else None)
    if expected is not None and not report.errors:
        module_optimizer_findings(report, expected, checkpoint.get("optimizer_states"))
    return report


def inspect_directory(path: Path, expected: Module | None = None) -> Inspection:
    """Inspects a sharded checkpoint directory: ``meta.pt`` and every shard, each checked to belong to one save."""
    report = Inspection(str(path), "sharded checkpoint directory")
    if not (path / SHARDED_META_FILE).exists() and not any(path.iterdir()):
        report.add("error", "empty-directory", f"{path} is an empty directory, not a checkpoint.")
        return report
    try:
        sharded = open_sharded(path)
    except CheckpointError as error:
        report.add("error", "incomplete-sharded", str(error))
        return report
    report.written_by = sharded.metadata.to_dict()
    report.lightning = _lightning_details(sharded.meta)
    lr_schedulers = sharded.meta.get("lr_schedulers")
    report.lr_schedulers = len(lr_schedulers) if isinstance(lr_schedulers, Sequence) else None
    strategy = sharded.metadata.strategy
    try:
        if sharded.format == "torch.distributed.checkpoint":
            dcp = read_dcp_files(sharded)  # every .distcp file there, whole, and of this save
            layout = DcpLayout.of(dcp, sharded.source)
            resumes = (
                "fsdp2 at any world size, in place"
                if layout == MODEL_PARALLEL_LAYOUT
                else "fsdp2 and every other strategy of this package (each rank reads it whole)"
            )
            report.sharded = {
                "format": sharded.format,
                "files": len({info.relative_path for info in dcp.storage_data.values()}),
                "layout": f"model under '{layout.model_key}.', optimizer i under 'optimizer_<i>.' keyed by name",
            }
            if sharded.upstream:
                report.add(
                    "info",
                    "upstream-sharded",
                    f"Written by upstream Lightning ({strategy.removeprefix('lightning:')}) at world size"
                    f" {sharded.world_size}: no {METADATA_KEY!r} block and no save ids, so its files are checked to be"
                    " there and whole, not to belong to one save. Optimizer states are keyed by parameter name.",
                )
            canonical = dcp_tensor_layout(dcp, f"{layout.model_key}.")
            # Every item read (one tensor at a time), as a resume or consolidate would: damage shows here.
            non_finite = [key for key, value in iter_dcp_items(sharded.directory, dcp) if _not_finite(value)]
            _flag_non_finite(report, non_finite)
        else:
            resumes = f"{strategy!r} at world size {sharded.world_size} in place, every other strategy reading it whole"
            report.sharded = {"format": sharded.format, "files": len(rank_file_paths(sharded))}
            canonical = _fairscale_shards(report, sharded)
    except CheckpointError as error:
        report.add("error", "bad-shard", str(error))
        return report
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OSError) as error:
        report.add("error", "bad-shard", f"{path}: its shards are damaged ({type(error).__name__}: {error}).")
        return report
    if canonical:
        report.model = _tensor_summary(canonical)
    report.add(
        "info",
        "sharded",
        f"Sharded checkpoint: resumes with {resumes}. `lightning-strategies consolidate {path} OUT` makes one full"
        " checkpoint that every strategy resumes, upstream Lightning's included.",
    )
    if expected is not None and canonical:
        try:
            check_model_state(expected.state_dict(), canonical, source="The checkpoint", shapes_only=True)
        except CheckpointError as error:
            report.add("error", "model-mismatch", str(error))
    return report


def _without_rank(layout: Any) -> Any:
    return {key: value for key, value in layout.items() if key != "rank"} if isinstance(layout, Mapping) else layout


def _not_finite(value: Any) -> bool:
    # A tensor with a defect is flagged as unloadable instead: reading its values could expand a stride-0 view of a
    # few bytes to terabytes.
    return (
        isinstance(value, Tensor)
        and (value.is_floating_point() or value.is_complex())
        and not tensor_defect(value)
        and not bool(torch.isfinite(value).all())
    )


def _flag_unloadable(report: Inspection, tensors: Mapping[str, Any]) -> None:
    """An error naming every tensor whose values cannot be read as a dense tensor (meta, sparse, oversized views)."""
    defects = {
        key: reason for key, value in tensors.items() if isinstance(value, Tensor) and (reason := tensor_defect(value))
    }
    if defects:
        named = "; ".join(f"{key!r} {reason}" for key, reason in list(defects.items())[:3])
        more = f" (and {len(defects) - 3} more)" if len(defects) > 3 else ""
        report.add(
            "error",
            "unloadable-tensor",
            f"{len(defects)} tensor(s) hold no values a model can load: {named}{more}. Such tensors come from a model"
            " that was never materialised (meta), a sparse tensor, or a crafted file; convert cannot rebuild their"
            " values: save the model's dense weights again, or use another checkpoint.",
        )


def _flag_non_finite(report: Inspection, names: Sequence[str]) -> None:
    if names:
        report.add(
            "error",
            "non-finite",
            f"{len(names)} tensor(s) hold NaN or Inf ({_listing(list(names))}): training diverged before this save,"
            " and resuming trains on from there. Resume from an earlier checkpoint.",
        )


def _fairscale_shards(report: Inspection, sharded: ShardedCheckpoint) -> dict[str, Tensor]:
    """Reads every rank file (memory-mapped), checks they share one layout, flags NaN/Inf; the full model's layout."""
    canonical: dict[str, Tensor] = {}
    first_layout: Any = None
    non_finite: list[str] = []
    for rank, _ in enumerate(rank_file_paths(sharded)):
        shard = read_rank_file(sharded, rank, mmap=True)
        state = shard.get("state_dict")
        layout = shard.get(SHARDED_LAYOUT_KEY)
        if not isinstance(state, Mapping):
            raise CheckpointFormatError(f"{sharded.source}: rank{rank}.pt holds no 'state_dict'.")
        _flag_unloadable(report, {f"rank{rank}.pt:{key}": value for key, value in state.items()})
        non_finite += [f"rank{rank}.pt:{key}" for key, value in state.items() if _not_finite(value)]
        if rank == 0:
            first_layout = layout
            if layout is None:
                report.add(
                    "warning",
                    "no-layout",
                    "The rank files hold no layout block (written before lightning-strategies 0.1.0 could"
                    " consolidate): resume with the strategy that wrote it and save with state_dict_type='full'.",
                )
            else:
                canonical = fairscale_model_layout(state, layout)
        elif _without_rank(layout) != _without_rank(first_layout):
            raise CheckpointFormatError(
                f"{sharded.source}: rank{rank}.pt describes another layout than rank0.pt (another model or wrapping)."
            )
    _flag_non_finite(report, non_finite)
    return canonical


def inspect_path(path: Path, module_spec: str | None = None) -> Inspection:
    """Inspects a checkpoint file or a sharded checkpoint directory.

    Args:
        path: The checkpoint.
        module_spec: ``"pkg.module:Class"`` to compare keys and shapes against (instantiated with no arguments).

    Returns:
        The report; its ``errors`` decide the exit code.

    Raises:
        UsageError: ``path`` does not exist, or ``module_spec`` cannot be loaded.
    """
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist.")
    expected = load_model_class(module_spec) if module_spec else None
    if path.is_dir():
        return inspect_directory(path, expected)
    try:
        return inspect_file(path, expected)
    except CheckpointError as error:
        report = Inspection(str(path), "unreadable")
        report.add("error", "unreadable", str(error))
        return report


# ---------------------------------------------------------------------------------------------- output


def format_report(report: Inspection) -> str:
    """The human-readable report."""
    lines = [f"{report.path}  ({report.kind})"]

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<16}{value}")

    if report.written_by:
        block = report.written_by
        row(
            "written by",
            f"{block['strategy']}, world size {block['world_size']}, format version {block['format_version']},"
            f" {block['state_dict_type']}",
        )
    elif report.kind == "checkpoint":
        row("written by", "unknown (no lightning_strategies block: upstream Lightning or by hand)")
    if report.sharded:
        row("shards", f"{report.sharded['format']}, {report.sharded['files']} file(s)")
    details = report.lightning
    if details:
        parts = [f"Lightning {details['version']}" if "version" in details else ""]
        parts += [f"{name.replace('_', ' ')} {details[name]}" for name in ("epoch", "global_step") if name in details]
        row("training", ", ".join(part for part in parts if part))
        if details.get("hyper_parameters"):
            row("hyper-params", ", ".join(f"{k}={v}" for k, v in details["hyper_parameters"].items()))
    if report.model:
        model = report.model
        row(
            "model state",
            f"{model['tensors']} tensors, {model['elements']:,} elements, {human_bytes(model['bytes'])}"
            f" ({', '.join(model['dtypes']) or 'no tensors'})",
        )
    for optimizer in report.optimizers:
        lrs = ", ".join(f"{lr:g}" if isinstance(lr, float | int) else str(lr) for lr in optimizer["lrs"])
        row(
            f"optimizer {optimizer['index']}",
            f"{optimizer['looks_like']}: {optimizer['param_groups']} param group(s), {optimizer['parameters']}"
            f" parameters, state for {optimizer['parameters_with_state']}"
            f" ({', '.join(optimizer['state_entries']) or 'none'}), lr {lrs}",
        )
    if report.lr_schedulers is not None:
        row("lr schedulers", str(report.lr_schedulers))
    if report.findings:
        lines.append("findings:")
        for finding in report.findings:
            lines.append(f"  {finding.severity:<8}{finding.code}: {finding.message}")
    errors = len(report.errors)
    lines.append(f"{errors} error(s): this checkpoint will not load as it is." if errors else "OK: no errors found.")
    return "\n".join(lines)
