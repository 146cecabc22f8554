"""Every path under ``tests/`` or ``scripts/`` that the docs and the README name exists.

The docs point readers at the test that shows a statement; when a test moves (``tests/__init__.py`` says where each
kind goes), the pages must follow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: A path as the pages write it: `tests/strategies/test_fsdp2.py`, `tests/zoo`, `scripts/gpu_check.py`.
PATH = re.compile(r"(?<![\w/.])((?:tests|scripts)(?:/[\w.-]+)*/?)")


def _named_paths(page: Path) -> set[str]:
    return {match.rstrip("/.") for match in PATH.findall(page.read_text()) if "/" in match}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_path_a_page_names_exists(page: Path) -> None:
    missing = sorted(path for path in _named_paths(page) if not (ROOT / path).exists())
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_the_pages_name_test_paths() -> None:
    assert any(path.startswith("tests/") for page in PAGES for path in _named_paths(page))
