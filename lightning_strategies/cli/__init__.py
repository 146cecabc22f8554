"""The ``lightning-strategies`` command line (also ``python -m lightning_strategies``).

Commands: ``demo`` (train, save, resume with other strategies, report), ``inspect CKPT``, ``convert CKPT OUT``,
``consolidate DIR OUT`` and ``export CKPT OUT``. Exit codes: 0 success, 1 a failed check (a checkpoint with errors, a
refused repair, a refused export, a demo whose resume was not lossless), 2 bad usage. Only ``demo`` needs Lightning; it
is imported when ``demo`` runs, from whichever Lightning package is installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType

from .._flavour import LIGHTNING, PYTORCH_LIGHTNING, flavour_of
from ..checkpoint.errors import CheckpointError
from ..checkpoint.safetensors_export import Export
from ._common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CommandError, UsageError, human_bytes
from .consolidate import consolidate_checkpoint
from .convert import CONVERTED_STRATEGY, convert_checkpoint
from .export import export_checkpoint
from .inspection import format_report, inspect_path
from .stores import checkpoint_input, clean, output

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

PROG = "lightning-strategies"
DEMO_DEFAULT_SAVE_FROM = "fsdp_fairscale"
DEMO_DEFAULT_RESUME_WITH = ("ddp_sharded", "ddp")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (``--help`` on each)."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Train, inspect, repair, consolidate and export checkpoints of lightning_strategies and Lightning."
        ),
        epilog="Exit codes: 0 success, 1 a failed check, 2 bad usage. Run `%(prog)s COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train with one strategy, resume with others, and show that nothing was lost",
        description=(
            "Trains a small model on CPU processes with --save-from, saves a checkpoint, resumes it with each"
            " --resume-with strategy in turn (each trains --steps more steps and saves), and compares every phase with"
            " an uninterrupted run of --save-from: loss at each resume (no spike) and weights (equal). Writes"
            " report.json and loss_curve.png (needs matplotlib) into --out. Plain strategy names run their"
            " '_fork' variant (one process per device, forked)."
        ),
        epilog="Exit code 1 when a resume was not lossless. Default chain: fsdp_fairscale, ddp_sharded, ddp.",
    )
    demo.add_argument(
        "--save-from",
        default=DEMO_DEFAULT_SAVE_FROM,
        metavar="STRATEGY",
        help=f"strategy of the first phase and of the uninterrupted reference run (default {DEMO_DEFAULT_SAVE_FROM})",
    )
    demo.add_argument(
        "--resume-with",
        action="append",
        metavar="STRATEGY",
        help="strategy that resumes the previous phase's checkpoint; repeat for a chain"
        f" (default: {' then '.join(DEMO_DEFAULT_RESUME_WITH)})",
    )
    demo.add_argument("--devices", type=_positive_int, default=2, help="CPU processes per run (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=8, help="training steps per phase (default 8)")
    demo.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (default demo_out/)")
    demo.add_argument(
        "--no-progress", action="store_true", help="no progress bar in a terminal (one line per run is still written)"
    )
    demo.set_defaults(handler=_demo)

    inspect = commands.add_parser(
        "inspect",
        help="what wrote a checkpoint, what it holds, and what is wrong with it",
        description=(
            "Reads a checkpoint file or a sharded checkpoint directory (weights_only=True: nothing in it runs) and"
            " reports its writer (strategy, world size, format version, full or sharded), model and optimizer"
            " state, and findings: wrapper prefixes in keys, flat parameter shards, empty state, optimizer state of"
            " one rank."
        ),
        epilog="Exit code 1 when a finding is an error (the checkpoint will not load as it is).",
    )
    inspect.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint file or sharded directory, local or a URL (s3://...)"
    )
    inspect.add_argument(
        "--module",
        dest="model_class",  # not `args.module`: that reads like unwrapping a wrapper (tests/test_no_unwrapping.py)
        metavar="PKG.MOD:CLASS",
        help="also compare keys and shapes with this model class (instantiated with no arguments)",
    )
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_inspect)

    convert = commands.add_parser(
        "convert",
        help="repair a checkpoint (wrapper prefixes, missing metadata) or explain why it cannot be",
        description=(
            "Writes a repaired copy of CKPT to OUT: keys behind wrapper prefixes ('module.', '_forward_module.',"
            " '_fsdp_wrapped_module.', '_fpw_module.', '_orig_mod.', '_checkpoint_wrapped_module.') become the"
            " module's own, a bare state dict becomes a checkpoint, and a missing metadata block is added"
            f" (strategy {CONVERTED_STRATEGY!r}, world size 1, full). Flat parameter shards, empty model states and"
            " per-rank optimizer states are refused: the weights they need are not in the file."
        ),
        epilog="Exit code 1 when the checkpoint cannot be repaired. CKPT is never changed; OUT is written atomically.",
    )
    convert.add_argument("checkpoint", type=Path, metavar="CKPT", help="checkpoint file to repair")
    convert.add_argument("out", type=Path, metavar="OUT", help="file to write")
    convert.add_argument("--force", action="store_true", help="replace OUT if it exists")
    convert.add_argument(
        "--module", dest="model_class", metavar="PKG.MOD:CLASS", help="also require the result to fit this model class"
    )
    convert.set_defaults(handler=_convert)

    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one full checkpoint",
        description=(
            "Reads a sharded checkpoint of fsdp_fairscale (rank files) or fsdp2 (torch.distributed.checkpoint) on"
            " the CPU, without a process group, one tensor at a time, and writes the full canonical checkpoint the"
            " strategy would have written with state_dict_type='full': every strategy, at any world size, resumes it."
        ),
        epilog="Exit code 1 when the directory is incomplete or not a sharded checkpoint of lightning_strategies.",
    )
    consolidate.add_argument("directory", metavar="DIR", help="sharded checkpoint directory, local or a URL (s3://...)")
    consolidate.add_argument("out", metavar="OUT", help="checkpoint file to write, local or a URL")
    consolidate.add_argument("--force", action="store_true", help="replace OUT if it exists")
    consolidate.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    consolidate.set_defaults(handler=_consolidate)

    export = commands.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors, for inference",
        description=(
            "Reads a checkpoint file or a sharded checkpoint directory (ours or upstream Lightning's; a sharded one is"
            " consolidated on the CPU, model state only) and writes its model state into the directory OUT as"
            " Hugging Face writes it: model.safetensors, or past --max-shard-size model-00001-of-0000N.safetensors"
            " shards and model.safetensors.index.json. Tied weights (one tensor under several keys) are written once,"
            " under their first key, as save_pretrained does; from_pretrained ties them again from the config. Add"
            " the model's config.json to OUT to load it with transformers' from_pretrained."
        ),
        epilog=(
            "Exit code 1 when the checkpoint cannot be exported (its model state would not load: wrapper prefixes,"
            " flat shards, NaN, unloadable tensors; the reason is named). Needs the safetensors package:"
            " pip install 'lightning-strategies[export]'."
        ),
    )
    export.add_argument(
        "checkpoint", metavar="CKPT", help="checkpoint file or sharded directory, local or a URL (s3://...)"
    )
    export.add_argument("out", metavar="OUT", help="directory to write the safetensors files into, local or a URL")
    export.add_argument(
        "--submodule",
        metavar="NAME",
        help="keep only this submodule's keys and strip its prefix (e.g. 'model' for a LightningModule that holds"
        " the Hugging Face model as self.model)",
    )
    export.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "fp32", "fp16", "bf16"],
        help="convert floating-point tensors to this dtype (integer and boolean tensors keep theirs)",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest file, e.g. 5GB (10**9 bytes, as Hugging Face counts), 500MB, 2GiB or bytes (default 5GB)",
    )
    export.add_argument(
        "--module",
        dest="model_class",
        metavar="PKG.MOD:CLASS",
        help="also require the state to fit this model class, and write the parameters it ties once even where the"
        " checkpoint holds copies (torch.distributed.checkpoint directories store each tied name's copy)",
    )
    export.add_argument("--force", action="store_true", help="replace an export already in OUT")
    export.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    export.set_defaults(handler=_export)

    clean = commands.add_parser(
        "clean",
        help="remove the uncommitted leftovers of killed saves of a checkpoint on an object store",
        description=(
            "A save to a URL uploads every rank's files under a fresh prefix and commits them last; a save killed"
            " before its commit leaves that prefix behind (readers ignore it, `inspect` names it, the next save of the"
            " URL removes it). `clean` removes such leftovers now; committed checkpoints are never touched."
        ),
    )
    clean.add_argument("checkpoint", metavar="URL", help="checkpoint URL (s3://bucket/run/last.ckpt)")
    clean.add_argument(
        "--older-than",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="only leftovers last written that long ago (default 60: a younger one may be a save under way)",
    )
    clean.set_defaults(handler=_clean)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    with checkpoint_input(args.checkpoint) as source:
        report = inspect_path(source.path, args.model_class)
    report.path = source.name
    for leftover in source.leftovers:
        report.add(
            "warning",
            "uncommitted-save",
            f"{leftover} holds files of a save that never committed (killed or failed): readers ignore it; the next"
            f" save of the URL removes it, or `lightning-strategies clean {args.checkpoint}`.",
        )
    for older in source.older_saves:
        report.add("info", "older-save", f"{older} is an older committed save kept beside the newest (a resumed-from).")
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return EXIT_FAILED if report.errors else EXIT_OK


def _convert(args: argparse.Namespace) -> int:
    result = convert_checkpoint(args.checkpoint, args.out, force=args.force, module_spec=args.model_class)
    print(f"Wrote {result.out}")
    for repair in result.repairs or ["nothing needed repair: OUT is a copy of CKPT"]:
        print(f"  - {repair}")
    return EXIT_OK


def _consolidate(args: argparse.Namespace) -> int:
    with checkpoint_input(args.directory) as source, output(args.out, force=args.force) as out:
        result = consolidate_checkpoint(source.path, out, force=args.force, show_progress=not args.no_progress)
    block = result.metadata
    print(
        f"Wrote {args.out}: full checkpoint of {block['strategy']!r} (trained at world size {block['world_size']})"
        f" from {result.format}, {result.tensors} model tensors and {result.optimizer_tensors} optimizer-state"
        " tensors. Every strategy resumes it."
    )
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    with (
        checkpoint_input(args.checkpoint) as source,
        output(args.out, force=args.force, directory=True) as out,
    ):
        result = _export_to(source.path, out, args)
    dtype = f", floating point as {str(result.dtype).removeprefix('torch.')}" if result.dtype is not None else ""
    print(
        f"Wrote {args.out}: {', '.join(result.files)} ({result.tensors} tensors,"
        f" {human_bytes(result.total_size)}{dtype})."
    )
    for dropped, kept in result.tied.items():
        print(f"  - tied: {dropped!r} is {kept!r}, written once under {kept!r}")
    return EXIT_OK


def _clean(args: argparse.Namespace) -> int:
    removed = clean(args.checkpoint, timedelta(minutes=args.older_than))
    print(
        f"Removed {len(removed)} uncommitted leftover(s) of {args.checkpoint}"
        + "".join(f"\n  - {url}" for url in removed)
    )
    return EXIT_OK


def _export_to(source: Path, out: Path, args: argparse.Namespace) -> Export:
    return export_checkpoint(
        source,
        out,
        submodule=args.submodule,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        force=args.force,
        show_progress=not args.no_progress,
        module_spec=args.model_class,
    )


def _demo_module() -> ModuleType:
    """The demo of the Lightning package that is installed (it imports Lightning; the other commands do not)."""
    own = flavour_of(__name__)
    for flavour in (own, LIGHTNING if own is PYTORCH_LIGHTNING else PYTORCH_LIGHTNING):
        top = flavour.pytorch.split(".")[0]
        if find_spec(top) is not None and find_spec(flavour.pytorch) is not None:
            return importlib.import_module(f"{flavour.tree}.cli.demo")
    raise UsageError(
        "demo trains with Lightning, which is not installed: pip install 'lightning-strategies[pytorch-lightning]'"
        " (or [lightning])."
    )


def _demo(args: argparse.Namespace) -> int:
    if args.resume_with is None:
        args.resume_with = list(DEMO_DEFAULT_RESUME_WITH)
    code: int = _demo_module().run_from_args(args)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 a failed check, 2 bad usage.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version (0) and usage errors (2), without leaving the interpreter
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.handler(args)
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except CheckpointError as error:  # a checkpoint that cannot be read: named, never a traceback
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    return code
