"""``lightning-strategies convert``: repairs a checkpoint that can be repaired, refuses one that cannot, and says why.

Repairs: keys behind wrapper prefixes become the module's own keys; a bare ``state_dict`` file becomes a checkpoint;
a missing metadata block is added (``strategy="converted"``, ``world_size=1``, ``state_dict_type="full"``: the state
is full, so the world size it was trained at does not matter for loading). Refused: flat parameter shards, empty
model states, optimizer states of one rank (Lightning issue 13500): the weights they would need are not in the file.
The input is never written; the output is written atomically.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_strategies.checkpoint import FORMAT_VERSION, METADATA_KEY, read_checkpoint
from lightning_strategies.checkpoint.atomic import atomic_torch_save

from ._common import CommandError, existing_input, writable_output
from .inspection import Inspection, canonical_key_map, inspect_path

#: The ``strategy`` that ``convert`` writes into the metadata block of a checkpoint that had none.
CONVERTED_STRATEGY = "converted"


@dataclass
class Conversion:
    """What ``convert`` did.

    Attributes:
        out: The file written.
        repairs: One line per repair (empty when the input needed none).
        report: The inspection of the input.
    """

    out: Path
    repairs: list[str] = field(default_factory=list)
    report: Inspection | None = None


def _installed_lightning_version() -> str:
    for distribution in ("pytorch-lightning", "lightning"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return "2.0.0"


def _refusal(source: Path, report: Inspection) -> str:
    reasons = "\n".join(f"  - {finding.code}: {finding.message}" for finding in report.errors if not finding.repairable)
    return f"Refusing to convert {source}: what it lacks cannot be rebuilt from the file.\n{reasons}"


def convert_checkpoint(source: Path, out: Path, *, force: bool = False, module_spec: str | None = None) -> Conversion:
    """Writes a repaired copy of ``source`` to ``out``.

    Args:
        source: The checkpoint file to repair (never modified).
        out: Where to write the repaired checkpoint.
        force: Replace ``out`` if it exists.
        module_spec: ``"pkg.module:Class"``: also require the repaired state to fit that class.

    Returns:
        What was repaired.

    Raises:
        UsageError: Bad paths (missing input, a directory, ``out`` is the input or exists without ``force``).
        CommandError: The checkpoint cannot be repaired; the message gives every reason.
    """
    existing_input(source, directory=False)
    writable_output(out, source, force=force)
    report = inspect_path(source, module_spec)
    if any(not finding.repairable for finding in report.errors):
        raise CommandError(_refusal(source, report))
    checkpoint: dict[str, Any] = read_checkpoint(source)
    result = Conversion(out, report=report)
    if "state_dict" not in checkpoint:  # a bare state dict (inspection refused anything else without one)
        # load_from_checkpoint reads the Lightning version to pick its migrations: the installed one needs none.
        checkpoint = {"pytorch-lightning_version": _installed_lightning_version(), "state_dict": checkpoint}
        result.repairs.append("wrapped the bare state dict into a checkpoint (checkpoint['state_dict'])")
    state = checkpoint["state_dict"]
    key_map, prefixes = canonical_key_map(list(state))
    renamed = sum(key != name for key, name in key_map.items())
    if renamed:
        checkpoint["state_dict"] = {key_map[key]: value for key, value in state.items()}
        result.repairs.append(
            f"removed the wrapper prefix(es) {', '.join(map(repr, prefixes))} from {renamed} of {len(state)} keys"
        )
    if METADATA_KEY not in checkpoint:
        checkpoint[METADATA_KEY] = {
            "format_version": FORMAT_VERSION,
            "strategy": CONVERTED_STRATEGY,
            "world_size": 1,
            "state_dict_type": "full",
        }
        result.repairs.append(f"added the {METADATA_KEY!r} block (strategy {CONVERTED_STRATEGY!r}, world size 1, full)")
    # Written next to OUT and checked there, so a repair that does not hold never replaces anything.
    staging = out.with_name(f".{out.name}.converting-{os.getpid()}")
    atomic_torch_save(checkpoint, staging)
    try:
        written = inspect_path(staging, module_spec)
        if written.errors:
            raise CommandError(
                "The repaired checkpoint still has errors, so nothing was written:\n"
                + "\n".join(f"  - {finding.code}: {finding.message}" for finding in written.errors)
            )
        os.replace(staging, out)
    finally:
        staging.unlink(missing_ok=True)
    return result
