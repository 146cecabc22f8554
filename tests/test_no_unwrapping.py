"""The package never finds the LightningModule by walking down a wrapper (design.md, point 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_strategies

PACKAGE = Path(lightning_strategies.__file__).parent
WRAPPER_ATTRIBUTES = {
    "module",
    "_forward_module",
    "_fsdp_wrapped_module",
    "_fpw_module",
    "_orig_mod",
    "_checkpoint_wrapped_module",
}


def _unwrapping_sites(source: str) -> list[str]:
    sites = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in WRAPPER_ATTRIBUTES:
            sites.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if "unwrap" in name.lower():
                sites.append(f"line {node.lineno}: {name}")
    return sites


def test_no_module_of_the_package_reads_a_wrapper_attribute() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sites
        for path in sorted(PACKAGE.rglob("*.py"))
        if (sites := _unwrapping_sites(path.read_text()))
    }
    assert offenders == {}


def test_the_check_itself_finds_unwrapping() -> None:
    assert _unwrapping_sites("model = wrapper.module\nunwrap_lightning_module(m)\nx = m._fsdp_wrapped_module")
