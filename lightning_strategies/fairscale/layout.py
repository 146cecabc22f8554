"""Where each canonical parameter lives in a fairscale FSDP model, and how optimizers' param groups map onto it.

fairscale's ``FullyShardedDataParallel`` replaces a module's parameters by flat, sharded ones (or shards them one by
one with ``flatten_parameters=False``). A *unit* is one parameter the optimizer steps: a flat parameter, with the
canonical names and shapes of the parameters it holds, or one sharded original parameter. Tied parameters
(``lm_head.weight is wte.weight``) are stored once; their other names are *aliases* of the name that holds them.
A *layout* says which units each param group of one optimizer steps, so canonical optimizer state (torch's
integer-keyed layout over the plain module's parameters) can be cut from and put into the units' flat state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_strategies.checkpoint.model_state import COMPILED_SEGMENT, strip_wrapper_segments
from lightning_strategies.fairscale._private import (
    FAIRSCALE_SEGMENTS,
    fp32_shard,
    original_size,
    shared_param_infos,
)

FSDP = FullyShardedDataParallel

__all__ = [
    "FAIRSCALE_SEGMENTS",
    "FlatUnit",
    "OptimizerLayout",
    "canonical_name",
    "flat_units",
    "fsdp_instances",
    "join_name",
    "optimizer_layout",
    "parameter_names",
    "persistent_buffers",
    "tied_aliases",
]

_NAMES_SHOWN = 3  # parameters an error message names per param group; the rest are counted


def canonical_name(path: str) -> str:
    """A path seen through fairscale's wrappers, as the plain, uncompiled module names it (no ``_orig_mod`` of a
    submodule compiled with ``torch.compile``: canonical state never holds it)."""
    return strip_wrapper_segments(path, (*FAIRSCALE_SEGMENTS, COMPILED_SEGMENT))


def join_name(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the top level."""
    return f"{prefix}.{name}" if prefix else name


def persistent_buffers(root: Module) -> Iterator[tuple[str, Tensor]]:
    """The buffers a plain module's ``state_dict`` holds, under canonical keys (buffers are never sharded)."""
    for path, submodule in root.named_modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                yield canonical_name(join_name(path, name)), buffer


def fsdp_instances(module: Module) -> list[tuple[str, FSDP]]:
    """Every FSDP instance in ``module`` with its canonical path."""
    return [(canonical_name(path), instance) for path, instance in module.named_modules() if isinstance(instance, FSDP)]


def parameter_names(module: Module) -> dict[int, list[str]]:
    """Canonical names of the original parameters held by each parameter object of ``module`` (wrapped or not).

    A tied parameter is named once, by its first name (as ``named_parameters()`` and optimizers count it).
    """
    names: dict[int, list[str]] = {}
    for prefix, instance in fsdp_instances(module):
        for param in instance.params:
            if isinstance(param, FlatParameter):
                flat_names = param.metadata()[0]
                names[id(param)] = [join_name(prefix, canonical_name(name)) for name in flat_names]
    for name, param in module.named_parameters():
        names.setdefault(id(param), [canonical_name(name)])
    return names


def tied_aliases(module: Module) -> dict[str, str]:
    """The second and further names of tied parameters, each mapped to the name that holds the parameter.

    Works before wrapping (a plain module registers one parameter under several names) and after (a flat parameter
    records the names it shares; an unflattened sharded parameter stays registered under
    each name).
    """
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        canonical = canonical_name(name)
        holder = first_name.setdefault(id(param), canonical)
        if holder != canonical:
            aliases[canonical] = holder
    for prefix, instance in fsdp_instances(module):
        for param in instance.params:
            for alias_module, holder_module, _, alias, _, holder in shared_param_infos(param):
                alias_name = join_name(prefix, canonical_name(join_name(alias_module, alias)))
                aliases[alias_name] = join_name(prefix, canonical_name(join_name(holder_module, holder)))
    return aliases


@dataclass(frozen=True)
class FlatUnit:
    """A parameter the optimizer steps: a flat parameter, or one sharded original parameter.

    Attributes:
        param: The parameter the optimizer steps (this rank's shard).
        names: Canonical names of the original parameters it holds, in order.
        shapes: Their full shapes.
        instance: The FSDP instance that shards it.
    """

    param: Parameter
    names: list[str]
    shapes: list[torch.Size]
    instance: FSDP

    @property
    def numel(self) -> int:
        """Elements of the unpadded full flat tensor."""
        return sum(shape.numel() for shape in self.shapes)

    @property
    def local_shard(self) -> Tensor:
        """This rank's shard of the parameter's values.

        FSDP keeps it as its fp32 shard; ``param.data`` is the same tensor between steps, except for a frozen
        parameter of the root instance: no post-backward hook ever reshards it, so its data stays the full tensor.
        """
        shard = fp32_shard(self.param)
        return shard if shard is not None else self.param.data


def flat_units(root: FSDP) -> list[FlatUnit]:
    """Every unit of a wrapped model, instance by instance."""
    names = parameter_names(root)
    units = []
    for _, instance in fsdp_instances(root):
        for param in instance.params:
            # A flat parameter lists what it holds; a sharded original parameter remembers its full size.
            shapes = list(param.metadata()[1]) if isinstance(param, FlatParameter) else [original_size(param)]
            units.append(FlatUnit(param, names[id(param)], shapes, instance))
    return units


@dataclass
class OptimizerLayout:
    """How one optimizer's canonical param groups (by name) map onto the units it steps."""

    group_names: list[list[str]]
    group_units: list[list[FlatUnit]] = field(default_factory=list)

    @property
    def index(self) -> dict[str, int]:
        """The canonical (integer) index of each parameter name."""
        return {name: index for index, name in enumerate(name for group in self.group_names for name in group)}

    @property
    def shapes(self) -> list[list[torch.Size]]:
        """Canonical shapes of each param group's parameters."""
        shape_of = {
            name: shape
            for units in self.group_units
            for unit in units
            for name, shape in zip(unit.names, unit.shapes, strict=True)
        }
        return [[shape_of[name] for name in group] for group in self.group_names]

    @property
    def flat_units(self) -> list[FlatUnit]:
        """The units in the order the optimizer over them holds them."""
        return [unit for units in self.group_units for unit in units]


def _shown(names: list[str]) -> str:
    more = len(names) - _NAMES_SHOWN
    return ", ".join(names[:_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def optimizer_layout(
    optimizer: Optimizer, names_of: Mapping[int, list[str]], units: Sequence[FlatUnit], index: int
) -> OptimizerLayout:
    """Assigns each unit to the param group holding its parameters.

    Args:
        optimizer: The optimizer ``configure_optimizers()`` returned (over the parameters before wrapping).
        names_of: Canonical names of each of those parameter objects (see :func:`parameter_names`).
        units: The units of the wrapped model.
        index: The optimizer's position, for error messages.

    Returns:
        The layout; units no optimizer group holds (frozen and left out) are in none of its groups.

    Raises:
        ValueError: The optimizer holds parameters that are not the module's, or one unit holds parameters of
            several param groups (only when the user flattened submodules before the optimizer existed).
    """
    foreign = [
        position
        for group in optimizer.param_groups
        for position, p in enumerate(group["params"])
        if id(p) not in names_of
    ]
    if foreign:
        raise ValueError(
            f"Optimizer {index} ({type(optimizer).__name__}) holds {len(foreign)} parameter(s) that are not the"
            " LightningModule's. Build it from self.parameters() (or submodules' parameters) in configure_optimizers()."
        )
    group_names = [
        [name for param in group["params"] for name in names_of[id(param)]] for group in optimizer.param_groups
    ]
    group_of = {name: group for group, names in enumerate(group_names) for name in names}
    layout = OptimizerLayout(group_names, [[] for _ in group_names])
    for unit in units:
        groups = {group_of.get(name) for name in unit.names}
        if groups == {None}:
            continue  # not optimized (e.g. frozen and left out)
        if len(groups) > 1:
            by_group: dict[str, list[str]] = {}
            for name in unit.names:
                group = group_of.get(name)
                by_group.setdefault("not optimized" if group is None else f"group {group}", []).append(name)
            listing = "; ".join(f"{where}: {_shown(names)}" for where, names in by_group.items())
            raise ValueError(
                f"Optimizer {index} ({type(optimizer).__name__}) treats parameters differently that were flattened"
                f" into one tensor before the optimizer existed ({listing}). A flat parameter has one set of"
                " hyper-parameters, and this submodule was wrapped in FullyShardedDataParallel before"
                " configure_optimizers() ran. Mark it with fairscale.nn.wrap in configure_model instead (the strategy"
                " wraps it later, one flat parameter per param group), or pass flatten_parameters=False."
            )
        group = groups.pop()
        if group is not None:
            layout.group_units[group].append(unit)
    return layout
