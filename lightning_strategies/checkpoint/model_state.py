"""Canonical model state: the keys and full tensors of the unwrapped module's ``state_dict()``.

A checkpoint's ``"state_dict"`` is checked against what the model expects *before* anything is copied into the
model, so a bad checkpoint raises an error that names every problem and leaves the weights as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_strategies.checkpoint.errors import ModelStateMismatchError

# Prefixes that wrappers put in front of a module's keys when state is read from the wrapper instead of the module.
WRAPPER_PREFIXES = (
    "module.",
    "_forward_module.",
    "_fsdp_wrapped_module.",
    "_fpw_module.",
    "_orig_mod.",
    "_checkpoint_wrapped_module.",
)


def strip_wrapper_segments(name: str, segments: tuple[str, ...]) -> str:
    """Removes the dotted path segments a wrapper inserts, e.g. ``a._fsdp_wrapped_module.b`` -> ``a.b``.

    Args:
        name: A parameter, buffer or module path as seen through wrappers.
        segments: The wrapper's own attribute names (whole segments only, so a user's ``module`` stays).

    Returns:
        The path as the unwrapped module names it.
    """
    return ".".join(part for part in name.split(".") if part not in segments)


#: The child name under which ``torch.compile`` (its ``OptimizedModule``) registers the module it compiled: a compiled
#: submodule's keys are ``<path>._orig_mod.<rest>`` where the uncompiled module's are ``<path>.<rest>``.
COMPILED_SEGMENT = "_orig_mod"


def canonical_key(key: str) -> str:
    """A key of a module with compiled submodules as the uncompiled module names it (``_orig_mod`` segments dropped).

    Canonical state never holds ``_orig_mod``: a checkpoint is the same whether submodules were compiled or not.
    """
    return strip_wrapper_segments(key, (COMPILED_SEGMENT,)) if COMPILED_SEGMENT in key else key


def canonical_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with :func:`canonical_key` keys, in the same order (the values are the same objects).

    Raises:
        ModelStateMismatchError: Two keys name the same entry once ``_orig_mod`` is dropped.
    """
    renamed = {canonical_key(key): value for key, value in state.items()}
    if len(renamed) != len(state):
        clashing = [key for key in state if COMPILED_SEGMENT in key and canonical_key(key) in state]
        raise ModelStateMismatchError(
            f"The model state holds keys with and without the compiled-module segment {COMPILED_SEGMENT!r} for the"
            f" same entry ({_listing(clashing)} and their names without it): it cannot be made canonical."
        )
    return renamed


def to_module_keys(state: Mapping[str, Any], module: Module, hidden: tuple[str, ...] = ()) -> dict[str, Any]:
    """``state`` (canonical keys, or the ``_orig_mod`` keys of older files) under the keys ``module.state_dict()``
    uses: ``<path>._orig_mod.<rest>`` for each submodule compiled with ``torch.compile``.

    The compiled submodules are found by name, from ``module.named_modules()``: a module registered as
    ``_orig_mod`` is the one a compiled submodule holds. Nothing is unwrapped.

    Args:
        state: Model state to load.
        module: The module it is loaded into (or the wrapper whose ``state_dict()`` it is loaded with).
        hidden: Path segments of wrappers that ``module.state_dict()`` leaves out of its keys (fairscale's).

    Returns:
        The renamed state; keys outside every compiled submodule (or unknown to the module) as they were.
    """
    canonical = canonical_keys(state)
    # canonical path of a compiled submodule -> its path in the module's own keys, the deepest first
    compiled: dict[str, str] = {}
    for path, _ in module.named_modules():
        own = strip_wrapper_segments(path, hidden)
        if own.rsplit(".", 1)[-1] == COMPILED_SEGMENT:
            compiled[canonical_key(own)] = own
    if not compiled:
        return canonical
    ordered = sorted(compiled, key=len, reverse=True)

    def own_key(key: str) -> str:
        for path in ordered:
            if not path:  # the module itself is compiled: every key is below it
                return f"{compiled[path]}.{key}"
            if key.startswith(f"{path}."):
                return compiled[path] + key[len(path) :]
        return key

    return {own_key(key): value for key, value in canonical.items()}


def tied_parameter_aliases(module: Module) -> dict[str, str]:
    """The second and further names of parameters registered under several names (tied weights), each mapped to the
    first name, the one ``named_parameters()`` and optimizers count it under.

    Args:
        module: The unwrapped module (its names are the canonical keys).

    Returns:
        ``{alias: holder}``, e.g. ``{"lm_head.weight": "transformer.wte.weight"}``; empty when nothing is tied.
    """
    holder_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in holder_of:
            aliases[name] = holder_of[id(param)]
        else:
            holder_of[id(param)] = name
    return aliases


_LISTED = 10  # names shown per category in an error message; the rest are counted


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating point"
    return "integer"


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_LISTED])
    more = len(names) - _LISTED
    return f"{shown} and {more} more" if more > 0 else shown


_INNER_SEGMENTS = tuple(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES if prefix.startswith("_"))


def _leading_wrapper_prefixes(key: str) -> list[str]:
    """The wrapper prefixes in front of ``key``, each nesting level as one more candidate: ``["module.",
    "module._forward_module."]`` for ``module._forward_module.layer.weight``."""
    candidates: list[str] = []
    prefix = ""
    while True:
        rest = key[len(prefix) :]
        found = next((p for p in WRAPPER_PREFIXES if rest.startswith(p) and len(rest) > len(p)), None)
        if found is None:
            return candidates
        prefix += found
        candidates.append(prefix)


def _wrapper_prefix_hint(unexpected: list[str], expected: Mapping[str, Any]) -> str:
    # Each unexpected key is tried behind each nesting level of leading wrapper prefixes, then with the fairscale
    # segments that FSDP inserts inside paths (`a._fsdp_wrapped_module.b`) removed: the expected key behind a
    # wrapper, or not.
    prefixes: list[str] = []
    inner = False
    for key in unexpected:
        candidates = ["", *_leading_wrapper_prefixes(key)]
        prefix = next((p for p in candidates if p and key[len(p) :] in expected), None)
        if prefix is None:
            prefix = next(
                (p for p in candidates if strip_wrapper_segments(key[len(p) :], _INNER_SEGMENTS) in expected), None
            )
            if prefix is None:
                continue
            inner = inner or strip_wrapper_segments(key[len(prefix) :], _INNER_SEGMENTS) != key[len(prefix) :]
        if prefix and prefix not in prefixes:
            prefixes.append(prefix)
    parts = [f"the wrapper prefix {', '.join(map(repr, prefixes))}"] if prefixes else []
    if inner:
        parts.append(f"wrapper segments ({', '.join(map(repr, _INNER_SEGMENTS))}) inside their paths")
    if not parts:
        return ""
    return (
        f" The unexpected keys are the expected ones behind {' and '.join(parts)}: the state was read from a wrapper"
        " instead of the LightningModule. Repair the file with `lightning-strategies convert CKPT OUT` (it removes"
        " wrapper prefixes, nested ones included) and resume from OUT."
    )


def unusable_tensor(tensor: Tensor) -> str:
    """Why ``tensor`` cannot be copied into a parameter (a meta tensor holds no data, a sparse one no dense layout).

    Returns:
        The reason, or ``""`` when it is a dense tensor with data.
    """
    if tensor.device.type == "meta":
        return "is a meta-device tensor (shape only, no data)"
    if tensor.layout != torch.strided:
        return f"has the {str(tensor.layout).removeprefix('torch.')} layout, not a dense (strided) tensor"
    return ""


def check_model_state(
    expected: Mapping[str, Any],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    source: str = "the checkpoint",
    shapes_only: bool = False,
) -> None:
    """Checks that ``state`` fits a model whose canonical state looks like ``expected``.

    Args:
        expected: The model's canonical state, or any mapping from key to a tensor of the expected shape and dtype.
        state: The state to load, e.g. ``checkpoint["state_dict"]``.
        strict: Whether missing and unexpected keys are errors (as in ``Module.load_state_dict``).
        source: How to name the state in error messages (usually the checkpoint path).
        shapes_only: ``state`` describes tensors (meta tensors of a sharded checkpoint's layout) rather than holding
            them: their data is not required.

    Raises:
        ModelStateMismatchError: Naming the missing keys, unexpected keys, shape and dtype mismatches.
    """
    if not isinstance(state, Mapping):
        raise ModelStateMismatchError(f"{source}: the model state should be a dict, found {type(state).__name__}.")
    problems: list[str] = []
    unexpected = [key for key in state if key not in expected]
    missing = [key for key in expected if key not in state]
    if strict and missing:
        problems.append(f"missing keys ({len(missing)}): {_listing(missing)}")
    if strict and unexpected:
        problems.append(
            f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}" + _wrapper_prefix_hint(unexpected, expected)
        )
    mismatched: list[str] = []
    for key, want in expected.items():
        got = state.get(key)
        if not isinstance(want, Tensor) or got is None:
            continue
        if not isinstance(got, Tensor):
            mismatched.append(f"{key!r}: expected a tensor of shape {tuple(want.shape)}, found {type(got).__name__}")
        elif not shapes_only and unusable_tensor(got):
            mismatched.append(f"{key!r}: {unusable_tensor(got)}")
        elif got.shape != want.shape:
            mismatched.append(f"{key!r}: checkpoint has shape {tuple(got.shape)}, model expects {tuple(want.shape)}")
        elif _dtype_kind(got.dtype) != _dtype_kind(want.dtype):
            mismatched.append(f"{key!r}: checkpoint has dtype {got.dtype}, model expects {want.dtype}")
    if mismatched:
        problems.append(f"mismatched tensors ({len(mismatched)}): " + "; ".join(mismatched[:_LISTED]))
    if problems:
        raise ModelStateMismatchError(
            f"{source} does not fit the model; nothing was loaded.\n  " + "\n  ".join(problems)
        )


def load_model_state(module: Module, state: Mapping[str, Any], *, strict: bool = True, source: str = "") -> None:
    """Loads canonical ``state`` into a module whose parameters are whole tensors (no sharding).

    The state is validated first, so on error the module is left unchanged. Compiled submodules take canonical keys
    and the ``_orig_mod`` keys of older files alike (see :func:`to_module_keys`).

    Args:
        module: The LightningModule (or any module) to load into.
        state: Canonical model state.
        strict: Whether missing and unexpected keys are errors.
        source: How to name the state in error messages.

    Raises:
        ModelStateMismatchError: The state does not fit the module.
    """
    state = canonical_keys(state)
    check_model_state(canonical_keys(module.state_dict()), state, strict=strict, source=source or "the checkpoint")
    module.load_state_dict(to_module_keys(state, module), strict=strict)


def to_cpu_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Returns ``state`` with every tensor detached and on the CPU (same dtypes and shapes)."""
    return {key: value.detach().cpu() if isinstance(value, Tensor) else value for key, value in state.items()}
