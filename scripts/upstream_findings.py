"""Where upstream Lightning's sharded strategies break this package's contract, each with a reproduction that runs.

Every finding runs upstream and ours on the same input and reports what each did; ``tests/test_upstream_findings.py``
runs them all in the suite (so a fixed upstream shows up as a failing test), and ``python -m scripts.upstream_findings
--out docs/upstream-findings.md`` writes the page from their results.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch import Tensor, nn

from lightning_strategies.checkpoint.errors import CheckpointError
from lightning_strategies.checkpoint.sharded import open_sharded, read_dcp_files
from lightning_strategies.testing import ConformanceReport, Launch, check_strategy
from lightning_strategies.testing.matrix import Matrix, MatrixStrategy, run_matrix
from lightning_strategies.testing.models import FEATURES, OUTPUTS
from tests.support.helpers import canonical_checkpoint
from tests.support.ranks import on_ranks
from tests.support.upstream_runs import OURS_SHARDED, FSDPStrategyOnCPU, ShardedByUser, fit, upstream

PYTORCH_LIGHTNING = pl.__version__

#: The page beside this one (in ``docs/``) that proposes each finding's fix upstream (``scripts.upstream_proposals``).
PROPOSALS_PAGE = "upstream-proposals.md"


@dataclass(frozen=True)
class Observation:
    """What upstream and ours did on the same input.

    Attributes:
        upstream: Upstream's behaviour, measured.
        ours: Ours on the same input, measured.
        upstream_breaks: Whether upstream broke the contract point (what the reproduction shows today).
        ours_keeps: Whether ours kept it.
    """

    upstream: str
    ours: str
    upstream_breaks: bool
    ours_keeps: bool


@dataclass(frozen=True)
class Finding:
    """One contract point upstream breaks, and how to see it."""

    slug: str
    title: str
    contract: str
    reproduction: str
    run: Callable[[Path], Observation]


class SameShapeLayers(ShardedByUser):
    """Two layers of one shape, in param groups listed in the other order than the module holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(FEATURES, FEATURES, bias=False)
        self.head = nn.Linear(FEATURES, FEATURES, bias=False)

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.tanh(self.encoder(inputs)))[:, :OUTPUTS] * self.output_scale
        return output

    def configure_optimizers(self) -> Any:
        groups = [{"params": self.head.parameters(), "lr": 0.01}, {"params": self.encoder.parameters(), "lr": 0.02}]
        return torch.optim.Adam(groups)


def _optimizer_difference(saved: Path, restored: Path) -> tuple[float, list[Any], list[Any]]:
    """Largest difference of the per-parameter state (matched through the groups) and both runs' learning rates."""
    before = canonical_checkpoint(saved)["optimizer_states"][0]
    after = canonical_checkpoint(restored)["optimizer_states"][0]
    worst = 0.0
    for index, entries in before["state"].items():
        for key, value in entries.items():
            other = after["state"][index][key]
            if isinstance(value, Tensor) and value.dim() > 0:
                worst = max(worst, float((value - other).abs().max()))
    lrs = ([group["lr"] for group in before["param_groups"]], [group["lr"] for group in after["param_groups"]])
    return worst, lrs[0], lrs[1]


def swapped_optimizer_state(root: Path) -> Observation:
    fit(lambda: "ddp", root / "ddp", epochs=1, model_class=SameShapeLayers)
    saved = root / "ddp" / "epoch=0.ckpt"
    fit(upstream(False), root / "upstream", ckpt_path=saved, model_class=SameShapeLayers)
    fit(lambda: "fsdp2", root / "ours", ckpt_path=saved, model_class=SameShapeLayers)
    upstream_worst, lrs, upstream_lrs = _optimizer_difference(saved, root / "upstream" / "restored.ckpt")
    ours_worst, _, ours_lrs = _optimizer_difference(saved, root / "ours" / "restored.ckpt")
    return Observation(
        upstream=(
            f"resumed without a warning; restored Adam moments differ from the saved ones by up to"
            f" {upstream_worst:.3g}, learning rates per group {upstream_lrs} (saved {lrs})"
        ),
        ours=f"`fsdp2`: moments equal (difference {ours_worst:g}), learning rates {ours_lrs}",
        upstream_breaks=upstream_worst > 0 or upstream_lrs != lrs,
        ours_keeps=ours_worst == 0 and ours_lrs == lrs,
    )


def _two_epochs_sharded(strategy: Callable[[], Any], root: Path) -> tuple[Path, Path]:
    fit(strategy, root, epochs=2)
    return root / "epoch=0.ckpt", root / "epoch=1.ckpt"


def _mix(first: Path, second: Path) -> None:
    """Rank 1's file of the second save copied over the first save's (a copy that mixed two runs' files)."""
    shutil.copyfile(second / "__1_0.distcp", first / "__1_0.distcp")


def mixed_saves(root: Path) -> Observation:
    first, second = _two_epochs_sharded(upstream(True), root / "upstream")
    saved_first, saved_second = (canonical_checkpoint(path)["state_dict"] for path in (first, second))
    _mix(first, second)
    fit(upstream(False), root / "upstream-resumed", ckpt_path=first)
    restored = canonical_checkpoint(root / "upstream-resumed" / "restored.ckpt")["state_dict"]
    from_second = sorted(
        key
        for key, value in restored.items()
        if isinstance(value, Tensor) and value.dim() > 0 and not torch.equal(value, saved_first[key])
        if value.shape[0] > 1 and torch.equal(value[value.shape[0] // 2 :], saved_second[key][value.shape[0] // 2 :])
    )
    ours_first, ours_second = _two_epochs_sharded(OURS_SHARDED["fsdp2-sharded"], root / "ours")
    _mix(ours_first, ours_second)
    try:
        read_dcp_files(open_sharded(ours_first))
        ours, keeps = "read the mixed directory", False
    except CheckpointError as error:
        message = re.sub(r"'[0-9a-f]{32}", "'<id>", str(error).split(": ", 1)[-1])
        ours, keeps = f"refused before loading: {message.split(': files of')[0]}", True
    return Observation(
        upstream=(
            f"resumed without a warning: {len(from_second)} tensor(s) ({', '.join(from_second[:4])}) hold rank 1's rows"
            " of the other save"
        ),
        ours=f"`fsdp2`: {ours}",
        upstream_breaks=bool(from_second),
        ours_keeps=keeps,
    )


class _RunsCode:
    """Unpickling this creates ``marker``: proof that a loader ran code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def code_in_metadata(root: Path) -> Observation:
    saved, _ = _two_epochs_sharded(upstream(True), root / "upstream")
    marker = root / "code-ran"
    (saved / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with contextlib.suppress(RuntimeError):  # the load fails after the code ran: the marker is what counts
        fit(upstream(False), root / "upstream-resumed", ckpt_path=saved)
    upstream_ran = marker.exists()
    marker.unlink(missing_ok=True)
    try:
        fit(lambda: "fsdp2", root / "ours-resumed", ckpt_path=saved)
        refused = "resumed"
    except RuntimeError as error:
        refused = "refused" if "refuses" in str(error) or "CheckpointFormatError" in str(error) else "failed"
    return Observation(
        upstream=f"resuming ran the code of the crafted `.metadata` ({'a file was created' if upstream_ran else 'no'})",
        ours=f"`fsdp2`: {refused}, and no code ran ({'a file was created' if marker.exists() else 'no file created'})",
        upstream_breaks=upstream_ran,
        ours_keeps=not marker.exists() and refused == "refused",
    )


class _PastTheAcceleratorCheck(FSDPStrategy):
    """Upstream's ``FSDPStrategy`` with the first CPU fix only (its accelerator check looks for this exact type)."""


def _first_words_of_failure(error: RuntimeError) -> str:
    """How a rank crashed, or else the last line of a rank's traceback up to its first full stop."""
    text = str(error).strip()
    crashed = re.search(r"rank \d+ died of SIG[A-Z]+", text)
    if crashed:
        return crashed.group(0)
    return text.splitlines()[-1].split(". ")[0].rstrip(".")


def fsdp_on_cpu(root: Path) -> Observation:
    runs: list[tuple[Callable[[], Any], type[ShardedByUser]]] = [
        (FSDPStrategy, _Unwrapped),
        (_PastTheAcceleratorCheck, _Unwrapped),
        # Both fixed (the model wraps its layers with device_id=cpu): the full save.
        (lambda: _PastTheAcceleratorCheck(state_dict_type="full"), ShardedByUser),
    ]
    messages = []
    for index, (strategy, model_class) in enumerate(runs):
        try:
            fit(strategy, root / f"run-{index}", epochs=1, model_class=model_class)
            messages.append("trained")
        except RuntimeError as error:
            messages.append(_first_words_of_failure(error))
    return Observation(
        upstream=f"`FSDPStrategy()` on `accelerator='cpu'`: {messages[0]}; past that check: {messages[1]}; with both"
        f" fixed, `state_dict_type='full'` at its first save: {messages[2]}",
        ours="`fsdp2`, `fsdp_fairscale` and `ddp_sharded` train and save on the CPU with gloo (the whole test suite"
        " does)",
        upstream_breaks=all(message != "trained" for message in messages),
        ours_keeps=True,
    )


class _Unwrapped(ShardedByUser):
    """A user who does not wrap anything in ``configure_model`` (upstream's ``FSDPStrategy`` wraps the model itself)."""

    def configure_model(self) -> None:
        pass


FINDINGS = [
    Finding(
        "swapped-optimizer-state",
        "ModelParallelStrategy puts each parameter's optimizer state on another parameter when the param groups list"
        " parameters in another order than the module holds them",
        "Checkpoints are interchangeable: a `ddp` checkpoint (torch's layout, parameters numbered through the param"
        " groups) resumes exactly under every strategy.",
        "Two layers of one shape; Adam with the second layer's group first. Save under upstream `ddp`, resume under"
        " `ModelParallelStrategy` (`fully_shard` in `configure_model`), compare the restored optimizer state with the"
        " saved one. Cause: upstream re-keys torch's numbers as positions in `module.parameters()`"
        " (`FSDP.rekey_optim_state_dict(..., PARAM_NAME, module)`), not through the param groups.",
        swapped_optimizer_state,
    ),
    Finding(
        "mixed-saves",
        "A sharded directory that mixes files of two saves resumes without a word",
        "A checkpoint is one save: shards of another save are refused, naming the file.",
        "`ModelParallelStrategy` saves two epochs as DCP directories; rank 1's `.distcp` of the second is copied"
        " into the first; resume from the first. Nothing in upstream's files says which save a shard belongs to.",
        mixed_saves,
    ),
    Finding(
        "code-in-metadata",
        "Resuming a sharded directory runs code from its `.metadata`",
        "Loading a checkpoint never runs code from it (`weights_only` everywhere).",
        "A `ModelParallelStrategy` DCP directory whose `.metadata` is a pickle that creates a file when unpickled;"
        " resume from it. torch's DCP reader unpickles `.metadata` with `pickle`, and upstream calls it.",
        code_in_metadata,
    ),
    Finding(
        "fsdp-strategy-cpu",
        "FSDPStrategy does not run on the CPU",
        "Every strategy runs on the CPU with gloo, for development and CI.",
        "`Trainer(strategy=FSDPStrategy(), accelerator='cpu', devices=2)`: refused by an accelerator check that"
        " looks for this exact type; a subclass passes it, then torch's FSDP1 refuses `device_id=None` (upstream"
        " passes the device index, `None` on the CPU). With both fixed (the model wraps its layers with"
        " `device_id=torch.device('cpu')`), a full save (`state_dict_type='full'`) crashes the process: upstream"
        " always gathers with `offload_to_cpu=True`, and on the CPU FSDP1's offload 'moves' the gathered flat"
        " parameter to the device it is already on, gets the same storage back and frees it, so the state dict's"
        " clone reads freed memory. `tests/support/upstream_runs.py` gathers without the offload.",
        fsdp_on_cpu,
    ),
]


@dataclass(frozen=True)
class KitRun:
    """A strategy of upstream's through the conformance kit, as users configure it.

    Attributes:
        factory: Returns a fresh strategy per fit.
        launch: Runs the fit on ranks started from outside (``torchrun``'s way), or ``None`` for the strategy's own
            launcher.
    """

    factory: Callable[[], Any]
    launch: Launch | None = on_ranks


#: Upstream's strategies through the conformance kit.
KIT_STRATEGIES: dict[str, KitRun] = {
    "ddp (ranks from torchrun)": KitRun(lambda: "ddp"),
    "ddp_spawn": KitRun(lambda: "ddp_spawn", launch=None),
    "ModelParallelStrategy (default: DCP directories)": KitRun(upstream(True)),
    "ModelParallelStrategy(save_distributed_checkpoint=False)": KitRun(upstream(False)),
    "FSDPStrategy(state_dict_type='full'), CPU fixes": KitRun(lambda: FSDPStrategyOnCPU(state_dict_type="full")),
    "FSDPStrategy(state_dict_type='sharded'), CPU fixes": KitRun(lambda: FSDPStrategyOnCPU(state_dict_type="sharded")),
}


def run_kit(root: Path) -> dict[str, ConformanceReport]:
    """The conformance kit's report for each of :data:`KIT_STRATEGIES`."""
    return {
        label: check_strategy(run.factory, root / f"kit-{index}", model_class=ShardedByUser, launch=run.launch)
        for index, (label, run) in enumerate(KIT_STRATEGIES.items())
    }


#: The cell of a check the kit leaves out when the ranks run in their own processes.
LEFT_OUT = "left out (the ranks ran in their own processes)"


def kit_table(reports: dict[str, ConformanceReport]) -> str:
    """One row per check, one column per strategy: pass, what failed, not reached (an earlier check failed), or left
    out (the check of the calling process's module, for ranks started from outside)."""
    longest = max(reports.values(), key=lambda report: len(report.results))
    checks = list(
        dict.fromkeys(
            [result.name for result in longest.results]
            + [result.name for report in reports.values() for result in report.results]
        )
    )
    lines = ["| check | " + " | ".join(reports) + " |", "|---|" + "---|" * len(reports)]
    for check in checks:
        cells = []
        for label, report in reports.items():
            found = [result for result in report.results if result.name == check]
            if found:
                cell = "pass" if found[0].passed else f"FAIL: {found[0].detail}"
            elif check == "parent_process_weights" and KIT_STRATEGIES[label].launch is not None:
                cell = LEFT_OUT
            else:
                cell = "not reached"
            cell = re.sub(r"'/[^']*/(kit-\d+/)?", "'.../", cell)  # temporary directories
            cells.append(cell.replace("|", "/").replace("\n", " ")[:300])
        lines.append(f"| `{check}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def upstream_matrix_strategies() -> list[MatrixStrategy]:
    """Upstream's ``ddp``, ``ddp_spawn``, ``ModelParallelStrategy`` and ``FSDPStrategy`` (full files: the matrix reads
    files) beside ours."""
    return [
        MatrixStrategy("ddp", lambda: "ddp_fork"),
        MatrixStrategy("ddp_spawn", lambda: "ddp_spawn"),
        MatrixStrategy("ModelParallelStrategy", upstream(False), launch=on_ranks),
        MatrixStrategy("FSDPStrategy", lambda: FSDPStrategyOnCPU(state_dict_type="full"), launch=on_ranks),
        MatrixStrategy("ddp_sharded", lambda: "ddp_sharded_fork"),
        MatrixStrategy("fsdp_fairscale", lambda: "fsdp_fairscale_fork"),
        MatrixStrategy("fsdp2", lambda: "fsdp2_fork"),
    ]


def run_upstream_matrix(root: Path) -> Matrix:
    """The resume matrix over :func:`upstream_matrix_strategies` (every pair, both ways)."""
    return run_matrix(upstream_matrix_strategies(), root / "matrix", model_class=ShardedByUser)


def heading_anchor(title: str) -> str:
    """The anchor GitHub and MyST (``myst_heading_anchors`` in ``docs/conf.py``) give a heading ``## title``: lower
    case, spaces as hyphens, every character but word characters and hyphens dropped."""
    return re.sub(r"[^\w\-]", "", title.lower().replace(" ", "-"))


def proposal_link(slug: str) -> str:
    """A link from finding ``slug`` (of :data:`FINDINGS`, or the resume matrix's ``betas-restored-as-lists``) to the
    section of :data:`PROPOSALS_PAGE` that proposes its fix."""
    from scripts.upstream_proposals import FINDING_PROPOSALS, PROPOSALS  # they import this module: not at the top

    proposal = next(proposal for proposal in PROPOSALS if proposal.slug == FINDING_PROPOSALS[slug])
    return f"[{proposal.title}]({PROPOSALS_PAGE}#{heading_anchor(proposal.title)})"


def run_findings(root: Path) -> dict[str, Observation]:
    """Runs every reproduction in its own directory under ``root``."""
    results = {}
    for finding in FINDINGS:
        directory = root / finding.slug
        directory.mkdir(parents=True)
        results[finding.slug] = finding.run(directory)
    return results


def page(results: dict[str, Observation], reports: dict[str, ConformanceReport], matrix: Matrix) -> str:
    """The docs page: each finding with its contract point, reproduction and what upstream and ours did."""
    lines = [
        "# Upstream findings",
        "",
        f"Measured with pytorch-lightning {PYTORCH_LIGHTNING} and torch {torch.__version__} on 2 CPU processes (gloo),"
        f" {time.strftime('%Y-%m-%d')}. Written by"
        " `python -m scripts.upstream_findings --out docs/upstream-findings.md`; `tests/test_upstream_findings.py`"
        " runs every reproduction in the test suite, so a change upstream fails a test. The reproductions are in"
        " `scripts/upstream_findings.py`; upstream's strategies run as users run them (`fully_shard` in"
        " `configure_model`), with the CPU fixes of `tests/support/upstream_runs.py` for `FSDPStrategy`.",
        "",
        "What upstream keeps, measured in `tests/checkpoint/test_upstream_interop.py`: its `ModelParallelStrategy` and",
        "`FSDPStrategy` checkpoints resume exactly under our strategies, and it resumes our full files and our `fsdp2`",
        "directories.",
        "",
    ]
    lines += [
        "## The conformance kit on upstream's strategies",
        "",
        "`lightning_strategies.testing.check_strategy` (the checks every strategy of this package passes).",
        "`ddp_spawn` starts its ranks itself; the others run on ranks started from outside, the way `torchrun`",
        "starts them (`launch=`; `ModelParallelStrategy` and `FSDPStrategy` launch only by running the script",
        "again), so the check of the calling process's module is left out for them. A check that could not run",
        "because an earlier one failed says *not reached*.",
        "",
        kit_table(reports),
        "",
        "`ddp`, `ddp_spawn`, `ModelParallelStrategy` with full files and `FSDPStrategy` with full files (with the",
        "CPU fixes) keep every point the kit checks, on a model whose param groups list parameters in the module's",
        "order (the first finding below is what other orders do to `ModelParallelStrategy`). The default save of",
        "`ModelParallelStrategy`, and `FSDPStrategy`'s sharded one, are directories that `torch.load`,",
        "`load_from_checkpoint` and `ddp` cannot read; `lightning-strategies consolidate` makes the full file of",
        "either, and every strategy of this package resumes them directly",
        "(`tests/checkpoint/test_upstream_interop.py`).",
        "",
        "## The resume matrix with upstream's strategies",
        "",
        "`lightning_strategies.testing.matrix.run_matrix`: each row saves after the first of two epochs, each column",
        "resumes that checkpoint and trains on; a cell passes when the restore is exact and the final weights equal",
        "the row's uninterrupted run (the conformance model, whose param groups are in the module's order).",
        "",
        re.sub(r"\(world size[^)]*\)", "", matrix.table()),
        "",
        "Every resume under `ModelParallelStrategy` restores Adam's `betas` as a list where the checkpoint holds a",
        "tuple: torch's `set_optimizer_state_dict` re-packs hyper-parameters, and upstream keeps what it returns. The",
        "values are equal and training continues exactly, but the state is not the one saved (`fsdp2` sets the",
        "hyper-parameters back as saved). Everything else crosses exactly, both ways. `FSDPStrategy`'s full files",
        "number the optimizer's parameters in the module's order, not through the param groups as torch does; here",
        "the two agree, and `tests/checkpoint/test_upstream_interop.py` resumes such files with groups in another",
        "order.",
        "",
        f"Proposed fix of the `betas`: {proposal_link('betas-restored-as-lists')}.",
        "",
    ]
    for finding in FINDINGS:
        observed = results[finding.slug]
        lines += [
            f"## {finding.title}",
            "",
            f"- **Contract point:** {finding.contract}",
            f"- **Reproduction:** {finding.reproduction}",
            f"- **Upstream:** {observed.upstream.rstrip('.')}.",
            f"- **This package:** {observed.ours.rstrip('.')}.",
            f"- **Proposed fix:** {proposal_link(finding.slug)}.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        results = run_findings(Path(directory))
        reports = run_kit(Path(directory))
        matrix = run_upstream_matrix(Path(directory))
    arguments.out.write_text(page(results, reports, matrix))
    print(f"Wrote {arguments.out}: {len(results)} findings.")


if __name__ == "__main__":
    main()
