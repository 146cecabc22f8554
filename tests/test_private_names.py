"""Lightning's private names are named in one module of the package: ``_lightning.py`` (issue 29).

When Lightning renames a private attribute, method or hook, what breaks must show in one place. Outside
``_lightning.py`` no module of the package reaches into Lightning's objects by a private name: no ``x._name``
attribute, no ``"_name"`` string (``getattr``, ``vars(x)[...]``), no override of a private method that
``_lightning.OVERRIDDEN_PRIVATE_METHODS`` does not list, no private name imported from Lightning. Names imported from
``_lightning`` are named there.

Lightning's private names are those its installed source defines (functions, classes, attributes it assigns). A few
coincide with names of the package's own classes, or with fairscale's and torch's (which have homes of their own);
they are listed below with whose they are.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import lightning_strategies
from lightning_strategies import _lightning

PACKAGE = Path(lightning_strategies.__file__).parent
HOME = PACKAGE / "_lightning.py"
PRIVATE = re.compile(r"_[A-Za-z0-9]\w*\Z")

#: The package's own names that Lightning happens to use too: allowed on ``self``/``super()`` and as methods only.
OWN = {
    "_group": "AsyncSaves' gloo group for background writes",
    "_strategy": "AsyncSaves' reference to its strategy",
    "_after_closure": "DirectReferenceStrategy's hook that runs in place of the precision plugin's",
    "_connector": "RequeueAtStepBoundary's reference to the signal connector",
    "_device_mesh": "FSDP2Strategy's mesh",
    "_fsdp_kwargs": "FairScaleFSDPStrategy's wrapper options",
    "_handles": "the fairscale wrapping's hook handles",
    "_lock": "fairscale_cpu's lock",
    "_num_nodes": "DirectReferenceStrategy's node count (ParallelStrategy has none)",
    "_process_group_backend": "DirectReferenceStrategy's backend (ParallelStrategy has none)",
    "_start_method": "DirectReferenceStrategy's start method",
    "_state_dict_type": "CheckpointFlow's full/sharded choice",
    "_step": "DirectReferenceStrategy's step runner",
    "_timeout": "DirectReferenceStrategy's collective timeout",
}
#: Modules that list the package's own names as strings (own names are allowed there as strings too).
OWN_NAME_LISTS = {"hooks.py": "OVERRIDABLE_HOOKS, the names of DirectReferenceStrategy's hooks"}
#: fairscale's and torch's private names that Lightning also defines: those have homes of their own.
OTHER_LIBRARIES = {
    "_device": "torch's GradScaler",
    "_global_rank": "fairscale's OSS",
}


#: Where Lightning's source is, in either flavour: a package and the parts of it that are Lightning's Trainer.
LIGHTNING_SOURCES = (("pytorch_lightning", ("",)), ("lightning_fabric", ("",)), ("lightning", ("pytorch", "fabric")))


@dataclass(frozen=True)
class Use:
    name: str
    line: int
    kind: str  # "attribute" (x._name), "own" (self._name, super()._name), "string" ("_name"), "method" (def _name),
    # "import" (from pytorch_lightning... import _name)


def _defined_private_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if PRIVATE.match(name) and not name.startswith("__")}


@cache
def lightning_private_names() -> frozenset[str]:
    """Every private name the installed Lightning defines (``pytorch_lightning`` and its fabric, or ``lightning``)."""
    names: set[str] = set()
    for package, parts in LIGHTNING_SOURCES:
        spec = find_spec(package)
        if spec is None or spec.origin is None:
            continue
        for part in parts:
            for path in (Path(spec.origin).parent / part).rglob("*.py"):
                names |= _defined_private_names(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


def _is_lightning(module: str) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package, _ in LIGHTNING_SOURCES)


def _on_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(source: str) -> list[Use]:
    """Private names a module uses as an attribute, a string or a method name."""
    tree = ast.parse(source)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr) and not node.attr.startswith("__"):
            uses.append(Use(node.attr, node.lineno, "own" if _on_self(node.value) else "attribute"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.match(node.value):
            if not node.value.startswith("__"):
                uses.append(Use(node.value, node.lineno, "string"))
        elif isinstance(node, ast.ImportFrom) and _is_lightning(node.module or ""):
            uses.extend(Use(alias.name, node.lineno, "import") for alias in node.names if PRIVATE.match(alias.name))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                is_method = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_method and PRIVATE.match(item.name) and not item.name.startswith("__"):
                    uses.append(Use(item.name, item.lineno, "method"))
    return sorted(uses, key=lambda use: (use.line, use.name))


def _overridden() -> set[str]:
    return {name for names in _lightning.OVERRIDDEN_PRIVATE_METHODS.values() for name in names}


def offences(source: str, file_name: str = "") -> list[str]:
    """Where a module uses one of Lightning's private names outside ``_lightning.py``."""
    lightning = lightning_private_names()
    found = []
    for use in private_uses(source):
        if use.name not in lightning or use.name in OTHER_LIBRARIES:
            continue
        if use.kind in ("own", "method") and (use.name in OWN or use.name in _overridden()):
            continue
        if use.kind == "string" and use.name in OWN and file_name in OWN_NAME_LISTS:
            continue
        found.append(f"line {use.line}: {use.name} ({use.kind})")
    return found


def test_no_module_but_lightning_py_uses_a_private_name_of_lightning() -> None:
    found = {
        str(path.relative_to(PACKAGE)): sites
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME and (sites := offences(path.read_text(encoding="utf-8"), path.name))
    }
    assert found == {}, "name them in _lightning.py (a function or a constant) and use that instead"


def test_the_check_itself_finds_private_names_of_lightning() -> None:
    source = """from lightning.fabric.utilities.distributed import _distributed_is_initialized
class Strategy(Base):
    def _configure_launcher(self):
        self._launcher = None
    def _setup_model(self, model):
        return model._trainer, vars(plugin)["_after_closure"], self._step
"""
    assert offences(source) == [
        "line 1: _distributed_is_initialized (import)",
        "line 4: _launcher (own)",
        "line 5: _setup_model (method)",
        "line 6: _after_closure (string)",
        "line 6: _trainer (attribute)",
    ]


def test_the_lightning_names_are_read_from_the_installed_lightning() -> None:
    names = lightning_private_names()
    assert {"_after_closure", "_clip_gradients", "_trainer", "_checkpoint_connector", "_launcher"} <= names


def test_every_private_method_the_package_overrides_is_still_lightning_s() -> None:
    missing = [
        f"{owner.__qualname__}.{name}"
        for owner, names in _lightning.OVERRIDDEN_PRIVATE_METHODS.items()
        for name in names
        if not callable(getattr(owner, name, None))
    ]
    assert missing == []


def test_every_own_name_is_defined_by_the_package() -> None:
    defined: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        defined |= _defined_private_names(ast.parse(path.read_text(encoding="utf-8")))
    assert set(OWN) - defined == set()
