"""``lightning-strategies export``: a checkpoint's model as Hugging Face safetensors, for inference.

The input is any checkpoint ``inspect`` reads: a full file (ours, upstream Lightning's, a bare ``state_dict``) or a
sharded directory (``fsdp_fairscale`` rank files, ``fsdp2``'s and upstream's ``torch.distributed.checkpoint``
directories), whose model state is consolidated on the CPU without its optimizer state. The model state is checked as
``inspect`` checks it (wrapper prefixes, flat shards, NaN, unloadable tensors refuse the export), then written by
:func:`~lightning_strategies.checkpoint.safetensors_export.write_safetensors`. A full file is memory-mapped, so the
shards are written from the file's pages; a sharded directory's model state is assembled once in memory.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from lightning_strategies.checkpoint import CheckpointError, read_checkpoint
from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.model_state import tied_parameter_aliases
from lightning_strategies.checkpoint.safetensors_export import (
    Export,
    ExportError,
    check_output_directory,
    parse_dtype,
    parse_size,
    require_safetensors,
    write_safetensors,
)
from lightning_strategies.checkpoint.sharded import open_sharded

from ._common import CommandError, Progress, UsageError, existing_input
from .inspection import Inspection, model_state_findings
from .model_class import load_model_class


def _model_state(source: Path) -> dict[str, Any]:
    """The canonical model state of a checkpoint file (memory-mapped) or a sharded directory (consolidated)."""
    if source.is_dir():
        sharded = open_sharded(source)
        state: dict[str, Any] = consolidate(sharded, model_only=True).checkpoint["state_dict"]
        return state
    # torch memory-maps only its zip format; a file in the legacy format (torch < 1.6) is read whole.
    checkpoint = read_checkpoint(source, mmap=zipfile.is_zipfile(source))
    if "state_dict" in checkpoint:
        model: dict[str, Any] = checkpoint["state_dict"]
        return model
    if checkpoint and all(hasattr(value, "shape") for value in checkpoint.values()):
        return checkpoint  # a bare state dict (torch.save(model.state_dict()))
    raise ExportError(
        f"{source} holds no 'state_dict' (keys: {', '.join(sorted(map(str, checkpoint))[:6])}): there are no weights"
        " to export."
    )


def _check_paths(source: Path, out: Path) -> None:
    resolved, resolved_source = out.resolve(), source.resolve()
    if resolved == resolved_source or resolved_source in resolved.parents:
        raise UsageError(f"OUT {str(out)!r} is or lies inside the input {str(source)!r}; write it somewhere else.")
    if resolved in resolved_source.parents:
        return  # the checkpoint inside the output directory: allowed, it is only read
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {str(out)!r} is a file; the export is a directory (model.safetensors and more).")


def export_checkpoint(
    source: Path,
    out: Path,
    *,
    submodule: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    force: bool = False,
    show_progress: bool = True,
    module_spec: str | None = None,
) -> Export:
    """Writes the model of a checkpoint as safetensors into the directory ``out``.

    Args:
        source: A checkpoint file or a sharded checkpoint directory.
        out: The output directory (created; files other than an earlier export are kept).
        submodule: Keep only this submodule's keys and strip its prefix (``"model"`` for ``self.model``).
        dtype: Convert floating-point tensors (``float32``, ``float16``, ``bfloat16``; ``fp16``, ``bf16``).
        max_shard_size: Largest file (``5GB``, ``500MB``, ``2GiB``, bytes); past it the export is sharded.
        force: Replace an export already in ``out``.
        show_progress: Show a progress bar over tensors on stderr.
        module_spec: ``"pkg.module:Class"``: require the state to fit that class, and write the parameters it ties
            once even when the checkpoint holds them as copies (``torch.distributed.checkpoint`` directories).

    Returns:
        What was written.

    Raises:
        UsageError: Bad paths or options, an export already in ``out`` without ``force``, or no ``safetensors``.
        CommandError: The checkpoint cannot be read or exported; the message names the keys and the reason.
    """
    existing_input(source)
    _check_paths(source, out)
    expected = load_model_class(module_spec) if module_spec else None
    try:
        parse_dtype(dtype)
        parse_size(max_shard_size)
        require_safetensors()
        check_output_directory(out, force=force)
    except (ValueError, ImportError, ExportError) as error:
        raise UsageError(str(error)) from error
    try:
        state = _model_state(source)
    except (CheckpointError, FileNotFoundError) as error:
        raise CommandError(f"{error} Nothing was written.") from error
    report = Inspection(str(source), "export")
    model_state_findings(report, state, expected.state_dict() if expected is not None else None, str(source))
    if report.errors:
        reasons = "\n".join(f"  - {finding.code}: {finding.message}" for finding in report.errors)
        raise CommandError(
            f"Refusing to export {source}: its model state would not load. Nothing was written.\n{reasons}"
        )
    try:
        return write_safetensors(
            state,
            out,
            submodule=submodule,
            dtype=dtype,
            max_shard_size=max_shard_size,
            force=force,
            tied_hints=tied_parameter_aliases(expected) if expected is not None else None,
            tally=lambda total: Progress(total, "exporting", show_progress),
        )
    except (CheckpointError, OSError) as error:
        raise CommandError(f"{error} Nothing was written.") from error
