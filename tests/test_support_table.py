"""The support table (README and user guide) says what CI runs: its "tested in CI" cells are ``dev.py``'s legs, at
their exact versions, and its rows and columns cover the ranges ``pyproject.toml`` declares."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", ROOT / "docs" / "user-guide.md")

pytestmark = pytest.mark.flavour_independent


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev_for_the_support_table", ROOT / "dev.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'dev.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _table(page: Path) -> dict[tuple[str, str], str]:
    """The cells of ``page``'s support table by (torch row, Lightning column)."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| torch \\ Lightning |"))
    columns = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    cells = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        row, *values = (cell.strip() for cell in line.strip("|").split("|"))
        cells.update({(row, column): value for column, value in zip(columns, values, strict=True)})
    return cells


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _tested_cells(cells: dict[tuple[str, str], str]) -> set[tuple[str, str]]:
    return {place for place, text in cells.items() if text.startswith("tested in CI")}


def test_the_readme_and_the_user_guide_show_the_same_table() -> None:
    assert _table(PAGES[0]) == _table(PAGES[1])


def test_the_tested_cells_are_the_ci_legs_at_their_exact_versions() -> None:
    dev = _dev()
    legs = [dev.PYTORCH_LIGHTNING_ENV, dev.LIGHTNING_ENV, *dev.VERSION_LEG_TESTS_ENVIRONMENTS]
    cells = _table(PAGES[0])

    assert _tested_cells(cells) == {(_minor(leg.torch), _minor(leg.lightning)) for leg in legs}
    for leg in legs:
        text = cells[(_minor(leg.torch), _minor(leg.lightning))]
        assert f"`{leg.leg}`" in text, f"leg {leg.leg!r} is not named in its cell: {text}"
        assert f"torch {leg.torch}" in text and f"{leg.lightning_package} {leg.lightning}" in text, text


def _declared(requirement: str) -> list[str]:
    """The minor versions a ``>=A.B,<A.C`` requirement admits, lowest first."""
    lowest, below = (version.split(".") for version in re.findall(r"(?:>=|<)([\d.]+)", requirement))
    return [f"{lowest[0]}.{minor}" for minor in range(int(lowest[1]), int(below[1]))]


def _declared_ranges() -> tuple[list[str], list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(requirement for requirement in project["dependencies"] if requirement.startswith("torch"))
    pytorch_lightning = project["optional-dependencies"]["pytorch-lightning"][0]
    assert project["optional-dependencies"]["lightning"][0] == pytorch_lightning.replace(
        "pytorch-lightning", "lightning"
    )
    return _declared(torch), _declared(pytorch_lightning)


def test_the_version_legs_are_the_ends_of_the_declared_ranges() -> None:
    dev = _dev()
    torch_minors, lightning_minors = _declared_ranges()

    assert (_minor(dev.OLDEST_ENV.torch), _minor(dev.OLDEST_ENV.lightning)) == (torch_minors[0], lightning_minors[0])
    assert (_minor(dev.NEWEST_ENV.torch), _minor(dev.NEWEST_ENV.lightning)) == (torch_minors[-1], lightning_minors[-1])


def test_every_version_in_the_declared_ranges_has_a_cell_and_only_those_are_supported() -> None:
    torch_minors, lightning_minors = _declared_ranges()
    cells = _table(PAGES[0])

    assert {(row, column) for row in torch_minors for column in lightning_minors} <= set(cells)
    for (row, column), text in cells.items():
        if row in torch_minors and column in lightning_minors:
            assert text.startswith(("tested in CI", "in range, not run in CI")), (row, column, text)
        else:
            assert text.startswith("not supported, because"), (row, column, text)


def test_the_declared_ranges_admit_the_cpu_and_cuda_wheels_of_each_tested_release() -> None:
    from packaging.requirements import Requirement

    dev = _dev()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = Requirement(next(text for text in project["dependencies"] if text.startswith("torch")))
    lightning = Requirement(project["optional-dependencies"]["pytorch-lightning"][0])

    for leg in (dev.PYTORCH_LIGHTNING_ENV, *dev.VERSION_LEG_TESTS_ENVIRONMENTS):
        # pip keeps an installed torch whose version the range admits: the CPU wheel (+cpu) as well as CUDA builds.
        for build in (leg.torch, f"{leg.torch}+cpu", f"{leg.torch}+cu130"):
            assert torch.specifier.contains(build), (build, str(torch))
        assert lightning.specifier.contains(leg.lightning), (leg.lightning, str(lightning))
