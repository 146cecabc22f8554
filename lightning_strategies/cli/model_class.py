"""``--module PKG.MOD:CLASS`` of ``inspect`` and ``convert``: the model a checkpoint is compared with."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_strategies.checkpoint import CheckpointError, check_optimizer_states, param_group_shapes

from ._common import UsageError

if TYPE_CHECKING:
    from .inspection import Inspection


@contextlib.contextmanager
def _working_directory_importable() -> Iterator[None]:
    # `python -m` puts the working directory on sys.path, a console script does not; --module should work in both.
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        if added:
            sys.path.remove(os.getcwd())


def load_model_class(spec: str) -> Module:
    """Imports ``pkg.module:Class`` and instantiates it with no arguments.

    Raises:
        UsageError: A malformed spec, an import that fails, no such class, or a constructor that fails.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--module takes 'package.module:ClassName', got {spec!r}.")
    with _working_directory_importable():
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as error:
            raise UsageError(f"--module: cannot import {module_name!r} ({error}). Is it on PYTHONPATH?") from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--module: {module_name!r} has no attribute {attribute!r}.")
        target = getattr(target, part)
    try:
        instance = target()
    except Exception as error:
        raise UsageError(
            f"--module: {spec}() failed ({type(error).__name__}: {error}); the class is instantiated with no arguments."
        ) from error
    if not isinstance(instance, Module):
        raise UsageError(f"--module: {spec}() is a {type(instance).__name__}, not a torch.nn.Module.")
    return instance


def _optimizers_of(config: Any) -> list[Optimizer]:
    """The optimizers in what ``configure_optimizers()`` returned (the usual forms Lightning accepts)."""
    if isinstance(config, Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return _optimizers_of(config.get("optimizer"))
    if isinstance(config, list | tuple):
        if len(config) == 2 and isinstance(config[0], list | tuple):  # ([optimizers], [schedulers])
            return _optimizers_of(config[0])
        return [optimizer for item in config for optimizer in _optimizers_of(item)]
    return []


def module_optimizer_findings(report: Inspection, module: Module, states: Any) -> None:
    """Checks the optimizer states against the optimizers the module's ``configure_optimizers()`` builds."""
    configure = getattr(module, "configure_optimizers", None)
    if states is None or not callable(configure):
        return
    try:
        optimizers = _optimizers_of(configure())
    except Exception as error:  # user code that needs a Trainer: skip this check, say why
        report.add(
            "info",
            "optimizers-not-built",
            f"configure_optimizers() failed outside a Trainer ({type(error).__name__}: {error}); the optimizer"
            " states were checked without the model's optimizers.",
        )
        return
    shapes = [param_group_shapes(optimizer) for optimizer in optimizers]
    try:
        check_optimizer_states(states, optimizers, shapes, source="The checkpoint")
    except CheckpointError as error:
        report.add("error", "optimizer-mismatch", str(error))
