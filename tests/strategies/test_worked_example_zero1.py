"""The worked example of docs/own-strategy.md: a ZeRO-1 strategy on torch's ZeroRedundancyOptimizer.

The page shows ``docs/examples/zero1_strategy.py`` verbatim; these tests check that it does, that the strategy keeps
the contract (conformance kit), that its checkpoints cross with upstream ``ddp`` and with ``fsdp2`` both ways (resume
matrix, Adam: the optimizer state matters), and that its sharded directories hold the same state as its full files.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.sharded import open_sharded
from lightning_strategies.testing import ConformanceModel, max_state_difference
from lightning_strategies.testing.matrix import MatrixStrategy, run_matrix
from tests.conftest import trainer_kwargs

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "zero1_strategy.py"
PAGE = ROOT / "docs" / "own-strategy.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zero1_strategy", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look classes up by module name
    spec.loader.exec_module(module)
    return module


zero1 = _load_example()


def _zero1(state_dict_type: str = "full") -> Any:
    return zero1.Zero1Strategy(start_method="fork", state_dict_type=state_dict_type)


def test_the_page_shows_the_example_file_verbatim() -> None:
    blocks = PYTHON_BLOCK.findall(PAGE.read_text())
    assert EXAMPLE.read_text() in blocks, f"docs/own-strategy.md has no ```python block equal to {EXAMPLE.name}"


def test_the_example_stays_under_150_lines() -> None:
    assert len(EXAMPLE.read_text().splitlines()) < 150


# The conformance kit on the example runs where a user runs it: tests/test_docs_examples.py starts the page's block
# (the file itself) as a script, whose `__main__` calls assert_strategy_conforms and fails on any failed check.


def test_zero1_checkpoints_cross_with_ddp_and_fsdp2_both_ways(tmp_path: Path) -> None:
    zero = MatrixStrategy("zero1", _zero1)
    others = [MatrixStrategy("ddp", lambda: "ddp_fork"), MatrixStrategy("fsdp2", lambda: "fsdp2_fork")]

    saved_by_zero1 = run_matrix([zero, *others], tmp_path / "from-zero1", optimizer="adam", rows=[zero])
    resumed_by_zero1 = run_matrix([zero], tmp_path / "into-zero1", optimizer="adam", rows=others)

    assert len(saved_by_zero1.cells) == 3 and len(resumed_by_zero1.cells) == 2
    assert not saved_by_zero1.failures, saved_by_zero1.table()
    assert not resumed_by_zero1.failures, resumed_by_zero1.table()


def _fit(root: Path, strategy: Any, epochs: int, ckpt_path: Path | None = None) -> None:
    from lightning_strategies._lightning import ModelCheckpoint, pl

    pl.seed_everything(7, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    kwargs = trainer_kwargs(strategy=strategy, max_epochs=epochs, callbacks=[checkpoints], enable_checkpointing=True)
    pl.Trainer(**kwargs).fit(ConformanceModel(optimizer="adam"), ckpt_path=ckpt_path)


def test_sharded_saves_hold_the_full_saves_state_and_resume(tmp_path: Path) -> None:
    _fit(tmp_path / "full", _zero1(), epochs=2)
    _fit(tmp_path / "sharded", _zero1("sharded"), epochs=1)
    directory = tmp_path / "sharded" / "epoch=0.ckpt"
    assert directory.is_dir() and sorted(path.name for path in directory.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # Each rank wrote the optimizer state of its own parameters (its partition), and no other rank did.
    owners: dict[str, set[str]] = {}
    for index, info in FileSystemReader(directory).read_metadata().storage_data.items():
        if index.fqn.startswith("optimizer_0.state."):  # optimizer_0.state.<parameter name>.<key>
            owners.setdefault(index.fqn.removeprefix("optimizer_0.state.").rsplit(".", 1)[0], set()).add(
                str(info.relative_path)
            )
    assert len(owners) == 4 and all(len(files) == 1 for files in owners.values()), owners
    assert set().union(*owners.values()) == {"__0_0.distcp", "__1_0.distcp"}, owners

    full = torch.load(tmp_path / "full" / "epoch=0.ckpt", weights_only=True)
    consolidated = consolidate(open_sharded(directory)).checkpoint
    assert max_state_difference(full["state_dict"], consolidated["state_dict"]) == (0.0, "")
    [saved], [gathered] = full["optimizer_states"], consolidated["optimizer_states"]
    assert saved["param_groups"] == gathered["param_groups"]
    assert saved["state"].keys() == gathered["state"].keys() == {0, 1, 2, 3}
    for index, entries in saved["state"].items():
        assert max_state_difference(entries, gathered["state"][index]) == (0.0, ""), index

    # Resumed from the directory, the uninterrupted run: by zero1 (the base class consolidates it in memory, each rank
    # keeps its partition) and by fsdp2 (its own format: it reads the directory in place).
    uninterrupted = torch.load(tmp_path / "full" / "epoch=1.ckpt", weights_only=True)
    for name, strategy in (("zero1", _zero1()), ("fsdp2", "fsdp2_fork")):
        _fit(tmp_path / name, strategy, epochs=2, ckpt_path=directory)
        resumed = torch.load(tmp_path / name / "epoch=1.ckpt", weights_only=True)
        worst, key = max_state_difference(uninterrupted["state_dict"], resumed["state_dict"])
        assert worst <= 1e-6, f"{name}: {key} differs by {worst:.2e}"
