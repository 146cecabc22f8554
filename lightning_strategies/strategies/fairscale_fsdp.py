"""fairscale FullyShardedDataParallel: parameters, gradients and optimizer state sharded across ranks.

This is the strategy of Lightning issue 13500. Its checkpoints are canonical because state is gathered through the
root wrapper (model) and from the flat shards the optimizer actually steps (optimizer), re-keyed by parameter name
into torch's layout; loading goes the other way. Parameter names come from the flat parameters' own metadata, with
fairscale's path segments removed, and are checked against the canonical keys.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from fairscale.internal.parallel import get_process_group_cached
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies import fairscale_cpu
from lightning_strategies.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMetadata,
    check_model_state,
    check_optimizer_states,
    param_group_shapes,
    strip_wrapper_segments,
    to_cpu_state,
)
from lightning_strategies.checkpoint.flat import gather_full, local_shard, split_full
from lightning_strategies.checkpoint.model_state import tied_parameter_aliases
from lightning_strategies.checkpoint.sharded import (
    SHARDED_LAYOUT_KEY,
    SHARDED_LAYOUT_VERSION,
    SHARDED_RANK_FILE,
    SHARDED_SAVE_KEY,
    fairscale_model_layout,
    open_sharded,
    rank_file_paths,
    read_rank_file,
    save_stamp,
    sharded_directory,
)

from .._lightning import _PATH, CheckpointIO, ClusterEnvironment, Precision, _StrategyRegistry, pl
from .base import DirectReferenceStrategy, StartMethod
from .full_gradients import FairScaleUnitView, full_fairscale_parameters
from .launcher import CanonicalStateLauncher, HandBack
from .optimizers import OptimizerNeed, refuse_unsupported_optimizers, retarget_schedulers, twin_optimizer
from .redirection import SubmoduleCallRouting

FSDP = FullyShardedDataParallel

# Attribute names fairscale puts into module paths: FSDP's wrapped module and the flatten wrapper's module.
FAIRSCALE_SEGMENTS = ("_fsdp_wrapped_module", "_fpw_module")

FSDP_KWARGS = frozenset(inspect.signature(FSDP.__init__).parameters) - {"self", "module", "compute_device"}


# What stepping flat 1-D shards takes away from an optimizer's math (see optimizers.OptimizerNeed).
_REFUSED_OPTIMIZER_NEEDS = {
    OptimizerNeed.WHOLE_PARAMETERS: (
        "fairscale FSDP steps 1-D shards of flat parameters that concatenate the module's parameters (with"
        " flatten_parameters=False still a 1-D shard of each): no shape, no whole tensor"
    ),
    OptimizerNeed.ALL_PARAMETERS_AS_ONE: (
        "each rank steps only its shard, so each rank would compute other directions and run the closure, with"
        " its collectives, a different number of times (a hang)"
    ),
    OptimizerNeed.SPARSE_GRADIENTS: "fairscale FSDP flattens and shards gradients as dense tensors",
}


def _canonical(path: str) -> str:
    return strip_wrapper_segments(path, FAIRSCALE_SEGMENTS)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _persistent_buffers(root: FSDP) -> Iterator[tuple[str, Tensor]]:
    """The buffers a plain module's ``state_dict`` holds, under canonical keys (buffers are never sharded)."""
    for path, submodule in root.named_modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                yield _canonical(_join(path, name)), buffer


def _fsdp_instances(module: Module) -> list[tuple[str, FSDP]]:
    return [(_canonical(path), instance) for path, instance in module.named_modules() if isinstance(instance, FSDP)]


def _parameter_names(module: Module) -> dict[int, list[str]]:
    """Canonical names of the original parameters held by each parameter object of ``module`` (wrapped or not)."""
    names: dict[int, list[str]] = {}
    for prefix, instance in _fsdp_instances(module):
        for param in instance.params:
            if isinstance(param, FlatParameter):
                flat_names = param.metadata()[0]
                names[id(param)] = [_join(prefix, _canonical(name)) for name in flat_names]
    for name, param in module.named_parameters():
        names.setdefault(id(param), [_canonical(name)])
    return names


def _wrap_by_param_group(module: Module, group_of: Mapping[int, Any], kwargs: Mapping[str, Any]) -> None:
    """Gives submodules of other param groups than the root's their own FSDP, so no flat parameter mixes groups.

    One flat parameter has one set of hyper-parameters, so param groups by submodule (the usual way to give an
    encoder and a head different learning rates) need those submodules flattened apart. The group of the root's own
    parameters (or else the first group) stays in the root's flat parameter, which must not be empty. Parameters no
    optimizer holds form a group of their own.
    """

    def groups(candidate: Module, recurse: bool = True) -> list[Any]:
        return list(dict.fromkeys(group_of.get(id(param)) for param in candidate.parameters(recurse=recurse)))

    def visit(parent: Module, root_group: Any) -> None:
        for name, child in list(parent.named_children()):
            if isinstance(child, FSDP):
                continue
            child_groups = groups(child)
            if child_groups == [root_group] or not child_groups:
                continue
            if len(child_groups) == 1:
                setattr(parent, name, FSDP(child, **kwargs))
            else:
                visit(child, root_group)

    all_groups = groups(module)
    if len(all_groups) > 1:
        own = groups(module, recurse=False)
        visit(module, own[0] if own else all_groups[0])


def _forget_stale_fairscale_groups() -> None:
    """Drops fairscale's process-group cache when it holds groups of a process group that no longer exists.

    fairscale caches the groups FSDP uses for the life of the process, keyed by name and ranks only. After a process
    group is destroyed and created again (a second run in one process, or a worker forked from a process that ran
    one) the cached groups are dead and every collective on them fails with "Group ... is not registered".
    """
    cache: dict[Any, Any] | None = vars(get_process_group_cached).get("_global_group_cache")
    if not cache:
        return
    try:
        for group in cache.values():
            torch.distributed.get_global_rank(group, 0)
    except (ValueError, RuntimeError):
        del vars(get_process_group_cached)["_global_group_cache"]


@dataclass(frozen=True)
class _Unit:
    """A parameter the optimizer steps: a flat parameter, or one sharded original parameter."""

    param: Parameter
    names: list[str]
    shapes: list[torch.Size]
    instance: FSDP

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)


def _units(root: FSDP) -> list[_Unit]:
    names = _parameter_names(root)
    units = []
    for _, instance in _fsdp_instances(root):
        for param in instance.params:
            # A flat parameter lists what it holds; a sharded original parameter remembers its full size.
            if isinstance(param, FlatParameter):
                shapes = list(param.metadata()[1])
            else:
                shapes = [torch.Size(getattr(param, "_orig_size"))]  # noqa: B009
            units.append(_Unit(param, names[id(param)], shapes, instance))
    return units


def _unit_view(unit: _Unit) -> FairScaleUnitView:
    """What the full-gradients context needs of a unit: where its original parameters live on their modules."""
    param = unit.param
    owners: list[tuple[Module, str]] = []
    shared: list[tuple[Module, str, int]] = []
    if isinstance(param, FlatParameter):
        owners = [(owner, name) for _, owner, name in param._param_infos]
        position = {(id(owner), name): index for index, (owner, name) in enumerate(owners)}
        for _, _, owner, name, source, source_name in param._shared_param_infos:
            shared.append((owner, name, position[(id(source), source_name)]))
    instance = unit.instance
    return FairScaleUnitView(
        param,
        unit.shapes,
        owners,
        shared,
        rank=instance.rank,
        world_size=instance.world_size,
        group=instance.process_group,
        flat=isinstance(param, FlatParameter),
    )


@dataclass
class _Layout:
    """How one optimizer's canonical param groups (by name) map onto the units it steps."""

    group_names: list[list[str]]
    group_units: list[list[_Unit]] = field(default_factory=list)

    @property
    def index(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(name for group in self.group_names for name in group)}

    @property
    def shapes(self) -> list[list[torch.Size]]:
        shape_of = {
            name: shape
            for units in self.group_units
            for unit in units
            for name, shape in zip(unit.names, unit.shapes, strict=True)
        }
        return [[shape_of[name] for name in group] for group in self.group_names]

    @property
    def flat_units(self) -> list[_Unit]:
        return [unit for units in self.group_units for unit in units]


def _layout(optimizer: Optimizer, names_of: Mapping[int, list[str]], units: Sequence[_Unit], index: int) -> _Layout:
    """Assigns each unit to the param group holding its parameters; refuses what a flat parameter cannot represent."""
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
    layout = _Layout(group_names, [[] for _ in group_names])
    for unit in units:
        groups = {group_of.get(name) for name in unit.names}
        if groups == {None}:
            continue  # not optimized (e.g. frozen)
        if len(groups) > 1:
            by_group: dict[str, list[str]] = {}
            for name in unit.names:
                group = group_of.get(name)
                by_group.setdefault("not optimized" if group is None else f"group {group}", []).append(name)
            listing = "; ".join(f"{where}: {', '.join(names)}" for where, names in by_group.items())
            raise ValueError(
                f"Optimizer {index} ({type(optimizer).__name__}) treats parameters differently that fairscale FSDP"
                f" flattened into one tensor ({listing}). One flat parameter can only have one set of"
                " hyper-parameters. Wrap those submodules separately (fairscale.nn.wrap in configure_model, or a"
                " smaller auto_wrap_min_params), or pass flatten_parameters=False."
            )
        group = groups.pop()
        if group is not None:
            layout.group_units[group].append(unit)
    return layout


class FairScaleFSDPStrategy(DirectReferenceStrategy):
    """Fully sharded data parallel training with fairscale ``FullyShardedDataParallel``.

    The LightningModule is wrapped in a root FSDP (large submodules first, by ``auto_wrap_min_params``; submodules the
    user wrapped in ``configure_model`` with ``fairscale.nn.wrap`` are kept). ``configure_optimizers()`` is written as
    usual (``Adam(self.parameters())``, groups by submodule, schedulers): its optimizers are re-created over the
    parameters FSDP trains. Checkpoints are canonical (``state_dict_type="full"``, default) or one file per rank
    (``"sharded"``). With ``accelerator="cpu"`` the scoped patches of :mod:`lightning_strategies.fairscale_cpu` are
    applied while the strategy runs.

    Args:
        accelerator: The accelerator (set by the Trainer when omitted).
        parallel_devices: Devices of this node (set by the Trainer when omitted).
        cluster_environment: Cluster environment (set by the Trainer when omitted).
        checkpoint_io: Checkpoint IO plugin.
        precision_plugin: Precision plugin.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Timeout of collective operations.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        hand_back: After a fork/spawn fit, ``"checkpoint"`` (the main process can save a complete checkpoint) or
            ``"weights"`` (weights only, less memory in the main process).
        auto_wrap_min_params: Submodules with at least this many parameters get their own FSDP; ``None`` wraps only
            the root. Ignored when ``configure_model`` already wrapped submodules.
        state_dict_type: ``"full"`` (one canonical file) or ``"sharded"`` (a directory, one file per rank).
        broadcast_buffers: Give every rank global rank 0's buffers that change in training (BatchNorm running
            statistics) before each forward, as ``ddp`` does; ``False`` keeps each rank's own (no collective).
        **fsdp_kwargs: Passed to every ``FullyShardedDataParallel``: ``flatten_parameters``,
            ``reshard_after_forward``, ``mixed_precision``, ``compute_dtype``, ``fp32_reduce_scatter``,
            ``bucket_cap_mb``, ``cpu_offload``, ``move_grads_to_cpu``, ``state_dict_on_rank_0_only`` (default
            ``True`` here), ...

    Raises:
        TypeError: A keyword argument that ``FullyShardedDataParallel`` does not take.
        ValueError: An unknown ``state_dict_type``.
    """

    strategy_name = "fsdp_fairscale"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        hand_back: HandBack = "checkpoint",
        auto_wrap_min_params: int | None = 100_000_000,
        state_dict_type: Literal["full", "sharded"] = "full",
        broadcast_buffers: bool = True,
        **fsdp_kwargs: Any,
    ) -> None:
        unknown = sorted(set(fsdp_kwargs) - FSDP_KWARGS)
        if unknown:
            raise TypeError(
                f"FairScaleFSDPStrategy got keyword argument(s) {', '.join(unknown)} that fairscale's"
                f" FullyShardedDataParallel does not take. It takes: {', '.join(sorted(FSDP_KWARGS))}"
                " (compute_device is set from the Trainer's device)."
            )
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            hand_back=hand_back,
        )
        self._fsdp_kwargs = {"state_dict_on_rank_0_only": True, **fsdp_kwargs}
        self._auto_wrap_min_params = auto_wrap_min_params
        self._state_dict_type = state_dict_type
        self._broadcast_buffers = broadcast_buffers
        self._cpu_patched = False
        self._units: list[_Unit] = []
        self._layouts: dict[int, _Layout] = {}
        self._loaded_sharded = False
        self._sharded_source = "the rank file"
        self._original_children: list[tuple[Module, str, Module]] = []
        self._state_key_order: list[str] = []
        self._routing: SubmoduleCallRouting | None = None
        self._aliases: dict[str, str] = {}  # the other names of tied parameters -> the name a unit holds them under

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``fsdp_fairscale`` (and ``_spawn``, ``_fork``) and ``fsdp_fairscale_offload``."""
        super().register_strategies(strategy_registry)
        strategy_registry.register(
            "fsdp_fairscale_offload",
            cls,
            description="FairScaleFSDPStrategy with parameters and gradients offloaded to the CPU",
            override=True,
            cpu_offload=True,
            move_grads_to_cpu=True,
        )

    # ------------------------------------------------------------------ environment and wrapping

    @property
    def _offloads(self) -> bool:
        return bool(self._fsdp_kwargs.get("cpu_offload") or self._fsdp_kwargs.get("move_params_to_cpu"))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _forget_stale_fairscale_groups()
        if self.root_device.type == "cpu" and not self._cpu_patched:
            pin_memory = self._offloads or bool(self._fsdp_kwargs.get("move_grads_to_cpu"))
            self._cpu_patched = fairscale_cpu.install(pin_memory=pin_memory)
            if self._cpu_patched:
                rank_zero_warn("fairscale FSDP runs on the CPU through scoped patches: for development and testing.")

    def _wrapper_kwargs(self) -> dict[str, Any]:
        return {**self._fsdp_kwargs, "compute_device": self.root_device}

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Inside ``configure_model``, ``fairscale.nn.wrap(submodule)`` wraps with this strategy's options."""
        with enable_wrap(wrapper_cls=FSDP, **self._wrapper_kwargs()):
            yield

    def _wrap(self, module: pl.LightningModule, group_of: Mapping[int, Any] | None = None) -> FSDP:
        # Remember the module tree as it was, so teardown can put back every child this strategy wrapped.
        self._original_children = [
            (parent, name, child) for parent in module.modules() for name, child in parent.named_children()
        ]
        kwargs = self._wrapper_kwargs()
        user_wrapped = any(isinstance(child, FSDP) for child in module.modules())
        # The order of the plain module's state_dict, for the canonical state gathered unit by unit (references only).
        self._state_key_order = [] if user_wrapped else list(module.state_dict(keep_vars=True))
        # Flat parameters hold a tied parameter once: its other names go into the sharded layout for consolidate.
        self._aliases = {
            _canonical(alias): _canonical(holder) for alias, holder in tied_parameter_aliases(module).items()
        }
        if not user_wrapped and self._auto_wrap_min_params is not None:
            policy = functools.partial(default_auto_wrap_policy, min_num_params=self._auto_wrap_min_params)
            with enable_wrap(wrapper_cls=FSDP, **kwargs):
                for name, child in list(module.named_children()):
                    setattr(module, name, auto_wrap(child, auto_wrap_policy=policy))
        if group_of and self._fsdp_kwargs.get("flatten_parameters", True):
            _wrap_by_param_group(module, group_of, kwargs)
        return FSDP(module, **kwargs)

    @override
    def model_to_device(self) -> None:
        if not self._offloads:  # with offloading FSDP moves what it computes with itself
            super().model_to_device()

    @override
    def configure_for_fit(self, trainer: pl.Trainer) -> None:
        module = self.require_lightning_module()
        names_before = _parameter_names(module)
        self._layouts = {}
        self.setup_optimizers(trainer)  # the user's optimizers, over the parameters as configure_optimizers saw them
        refuse_unsupported_optimizers(self.strategy_name, self.optimizers, module, _REFUSED_OPTIMIZER_NEEDS)
        group_of = {
            id(param): (index, group_index)
            for index, optimizer in enumerate(self.optimizers)
            for group_index, group in enumerate(optimizer.param_groups)
            for param in group["params"]
        }
        root = self._wrap(module, group_of)
        self._units = _units(root)
        optimizers = []
        for index, optimizer in enumerate(self.optimizers):
            layout = _layout(optimizer, names_before, self._units, index)
            groups = [
                {**{key: value for key, value in group.items() if key != "params"}, "params": [u.param for u in units]}
                for group, units in zip(optimizer.param_groups, layout.group_units, strict=True)
            ]
            rebuilt = twin_optimizer(optimizer, groups)
            retarget_schedulers(self.lr_scheduler_configs, optimizer, rebuilt)
            self._layouts[id(rebuilt)] = layout
            if optimizer.state:  # created at construction (Adagrad's sums) or loaded by the user
                self._load_canonical_optimizer_state(rebuilt, optimizer.state_dict())
            optimizers.append(rebuilt)
        self.optimizers = optimizers
        self.model = root

    @override
    def configure_for_evaluation(self, trainer: pl.Trainer) -> None:
        root = self._wrap(self.require_lightning_module())
        self._units = _units(root)
        self.model = root

    def _root(self) -> FSDP:
        if not isinstance(self.model, FSDP):
            raise RuntimeError("FairScaleFSDPStrategy has no FSDP root yet: it is created in Trainer.fit/validate.")
        return self.model

    @override
    def _step(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.require_lightning_module()
        wrapper = self.model
        if method_name != "training_step" or module.automatic_optimization or not isinstance(wrapper, FSDP):
            return super()._step(method_name, *args, **kwargs)
        # Manual optimization runs backward (and optimizer steps) inside the step, which fairscale does not allow
        # inside the root's forward (its backward hooks assert that the forward has ended). The step runs on its own
        # instead, and every module call it makes (`self(...)`, `self.discriminator(x)`) goes through the root's
        # forward: gathered parameters, backward hooks, and parameters that an optimizer step just changed.
        if self._routing is None or self._routing.lightning_module is not module:
            self._routing = SubmoduleCallRouting(wrapper, module)
        wrapper.training = module.training
        with self._routing.routing():
            return getattr(module, method_name)(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except ValueError as error:
            module = self.lightning_module
            if module is None or module.automatic_optimization or "expected to be in states" not in str(error):
                raise
            raise RuntimeError(
                "FairScaleFSDPStrategy: a backward pass in this manual-optimization step left parameters that require"
                " gradients without one, although a module holding them was called (e.g. a GAN's generator, whose"
                " output the discriminator's loss detaches). fairscale FSDP cannot finish such a backward pass. Call"
                " `self.toggle_optimizer(optimizer)` before each optimizer's forward and backward and"
                " `self.untoggle_optimizer(optimizer)` after its step, as Lightning's manual-optimization docs do, so"
                " the other optimizer's parameters do not require gradients meanwhile."
            ) from error

    @contextmanager
    @override
    def complete_gradients(self) -> Generator[None, None, None]:
        # Flattening took the original parameters off their modules: they come back, full, with full gradients.
        if not isinstance(self.model, FSDP):
            yield None
            return
        with full_fairscale_parameters([_unit_view(unit) for unit in self._units]):
            yield None

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, FSDP):
            with self.model.no_sync():
                yield None
        else:
            yield None

    @property
    @override
    def gradients_are_sharded(self) -> bool:
        return isinstance(self.model, FSDP)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        # Each rank holds a shard of every gradient: the root computes the norm across ranks.
        self._root().clip_grad_norm_(clip_val)

    def _unshard_into_module(self) -> None:
        """Gives the LightningModule back its own full parameters and submodules, as before setup.

        The process goes on running the user's script (one script per rank, or a single process), so the module must
        work again: every rank gathers the full parameters once, the original parameters are registered again with
        them, and the children this strategy wrapped replace their wrappers. Submodules the user wrapped in
        ``configure_model`` stay wrapped.
        """
        root = self._root()
        flattened: list[tuple[Module, str, Tensor, bool]] = []
        sharded: list[tuple[Parameter, Tensor]] = []
        with root.summon_full_params(recurse=True, volatile=True):
            for unit in self._units:
                if isinstance(unit.param, FlatParameter):
                    for _, owner, name in unit.param._param_infos:
                        full = getattr(owner, name).detach().clone()
                        flattened.append((owner, name, full, unit.param.requires_grad))
                else:
                    sharded.append((unit.param, unit.param.detach().clone()))
        for owner, name, full, requires_grad in flattened:
            if hasattr(owner, name):
                delattr(owner, name)
            owner.register_parameter(name, Parameter(full, requires_grad=requires_grad))
        for param, full in sharded:
            param.data = full
        for parent, name, child in self._original_children:
            if getattr(parent, name, None) is not child:
                setattr(parent, name, child)
            vars(child).pop("_unflattened_param_views", None)
        vars(self.require_lightning_module()).pop("_unflattened_param_views", None)

    @override
    def teardown(self) -> None:
        in_place = not isinstance(self.launcher, CanonicalStateLauncher)
        # After a failure the process group is gone (see on_exception): the module keeps its shards.
        if in_place and isinstance(self.model, FSDP) and not self.failed:
            self._unshard_into_module()  # before the root goes and while the CPU patches are in place
        super().teardown()  # gathers the final weights for the launcher: the patches must still be in place
        # The layouts stay until the next setup: after an in-place fit the optimizers still hold flat shards, and
        # `trainer.save_checkpoint` after `fit` gathers them into canonical state through these layouts.
        self._units, self._original_children = [], []
        self._routing = None  # it holds the root wrapper, which the run no longer needs
        if self._cpu_patched:
            fairscale_cpu.uninstall()
            self._cpu_patched = False

    # ------------------------------------------------------------------ model state

    def _expected_model_state(self) -> dict[str, Tensor]:
        """Canonical keys with meta tensors of the canonical shapes and dtypes (no memory, no collective)."""
        expected: dict[str, Tensor] = {}
        for unit in self._units:
            for name, shape in zip(unit.names, unit.shapes, strict=True):
                expected[name] = torch.empty(shape, dtype=unit.param.dtype, device="meta")
        for key, buffer in _persistent_buffers(self._root()):
            expected[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
        return expected

    @override
    def _canonical_model_state(self) -> dict[str, Any]:
        if not isinstance(self.model, FSDP):  # before setup or after teardown the module holds its full weights
            return super()._canonical_model_state()
        root = self._root()
        extra_state = any(type(module).get_extra_state is not Module.get_extra_state for module in root.modules())
        sub_groups = any(unit.instance.world_size != self.world_size for unit in self._units)
        if extra_state or sub_groups:
            # Extra state is only known to the modules' own state_dict, and a shard of a smaller group may not reach
            # global rank 0: both are gathered through the root wrapper.
            return to_cpu_state(root.state_dict()) if self.is_global_zero else {}
        # Each flat shard is gathered to rank 0 only and cut into the parameters it holds (fairscale's state_dict
        # would gather every full parameter on every rank); buffers are whole on every rank.
        state: dict[str, Any] = {}
        for unit in self._units:
            full = gather_full(unit.param.data, unit.numel, unit.instance.process_group)
            if full is not None:
                state.update(zip(unit.names, split_full(full.cpu(), unit.shapes, copy=False), strict=True))
        if not self.is_global_zero:
            return {}
        for key, buffer in _persistent_buffers(root):
            state[key] = buffer.detach().cpu().clone()
        if set(self._state_key_order) == set(state):
            state = {key: state[key] for key in self._state_key_order}
        return state

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type == "sharded":  # every rank keeps its own shard: no gather
            return dict(self._root().local_state_dict())
        return super().lightning_module_state_dict()

    @override
    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        root = self._root()
        check_model_state(self._expected_model_state(), state, strict=strict, source=self._checkpoint_source)
        root.load_state_dict(dict(state), strict=strict)

    # ------------------------------------------------------------------ optimizer state

    def _layout_of(self, optimizer: Optimizer) -> _Layout:
        layout = self._layouts.get(id(optimizer))
        if layout is None:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not created by FairScaleFSDPStrategy; optimizers must come from"
                " configure_optimizers()."
            )
        return layout

    @override
    def _canonical_param_shapes(self, optimizer: Optimizer) -> list[list[torch.Size]]:
        return self._layout_of(optimizer).shapes

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            raw = getattr(optimizer, "_optimizer", optimizer)
            return dict(raw.state_dict())
        return super().optimizer_state(optimizer)

    @override
    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if id(optimizer) not in self._layouts:  # not rebuilt over flat parameters (a forked run's main process)
            return super()._canonical_optimizer_state(optimizer)
        layout = self._layout_of(optimizer)
        index = layout.index
        state: dict[int, dict[str, Any]] = {}
        for unit in layout.flat_units:
            for key, value in optimizer.state.get(unit.param, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    full = gather_full(value, unit.numel, unit.instance.process_group)
                    # Views of the gathered buffer: the canonical state adds no second full copy.
                    parts = split_full(full.cpu(), unit.shapes, copy=False) if full is not None else []
                else:  # a scalar such as Adam's step: one independent copy per parameter (steps count in place)
                    parts = [value.detach().cpu().clone() if isinstance(value, Tensor) else value for _ in unit.names]
                for name, part in zip(unit.names, parts, strict=False):
                    state.setdefault(index[name], {})[key] = part
        if not self.is_global_zero:
            return {}
        groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": [index[n] for n in names]}
            for group, names in zip(optimizer.param_groups, layout.group_names, strict=True)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @override
    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        layout = self._layout_of(optimizer)
        index = layout.index
        flat_state: dict[int, dict[str, Any]] = {}
        for flat_index, unit in enumerate(layout.flat_units):
            entries = [state["state"].get(index[name]) for name in unit.names]
            present = [entry for entry in entries if entry]
            if not present:
                continue
            flat_state[flat_index] = {}
            for key in dict.fromkeys(key for entry in present for key in entry):
                sample = next(entry[key] for entry in present if key in entry)
                if isinstance(sample, Tensor) and sample.dim() > 0:
                    # A parameter that never had a gradient has no state in a plain optimizer: zeros stand in.
                    tensors = [
                        entry[key] if entry and key in entry else torch.zeros(shape, dtype=sample.dtype)
                        for entry, shape in zip(entries, unit.shapes, strict=True)
                    ]
                    shard = local_shard(tensors, unit.instance.rank, unit.instance.world_size)
                    flat_state[flat_index][key] = shard.to(unit.param.device)
                else:
                    flat_state[flat_index][key] = sample.clone() if isinstance(sample, Tensor) else sample
        flat_groups = []
        position = 0
        for group, units in zip(state["param_groups"], layout.group_units, strict=True):
            hyper = {key: value for key, value in group.items() if key != "params"}
            flat_groups.append({**hyper, "params": list(range(position, position + len(units)))})
            position += len(units)
        optimizer.load_state_dict({"state": flat_state, "param_groups": flat_groups})

    # ------------------------------------------------------------------ sharded checkpoints

    @override
    def checkpoint_metadata(self) -> CheckpointMetadata:
        metadata = super().checkpoint_metadata()
        return CheckpointMetadata(
            metadata.format_version, metadata.strategy, metadata.world_size, self._state_dict_type
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._state_dict_type == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        directory = Path(filepath)

        def write_rank_file(staging: Path, save_id: str) -> None:
            shard = {
                "state_dict": checkpoint["state_dict"],
                "optimizer_states": checkpoint.get("optimizer_states", []),
                SHARDED_LAYOUT_KEY: self._sharded_layout(),
                SHARDED_SAVE_KEY: save_stamp(save_id, self.world_size, self.global_rank),
            }
            self.checkpoint_io.save_checkpoint(shard, staging / SHARDED_RANK_FILE.format(rank=self.global_rank))

        self.save_sharded(checkpoint, directory, write_rank_file)

    def _sharded_layout(self) -> dict[str, Any]:
        """What a rank file needs to be turned into canonical state offline (plain values, ``weights_only``-safe).

        ``units``: the flat shards in ``local_state_dict()`` (its key, the canonical names and shapes it holds, the
        size of its process group); ``optimizers``: for each optimizer, the canonical names of each param group and
        which unit each index of its flat state is; ``aliases``: the other names of tied parameters, each mapped to
        the name a unit holds it under.
        """
        key_of = {id(param): _canonical(name) for name, param in self._root().named_parameters()}
        position = {id(unit.param): index for index, unit in enumerate(self._units)}
        units = [
            {
                "key": key_of[id(unit.param)],
                "names": list(unit.names),
                "shapes": [list(shape) for shape in unit.shapes],
                "world_size": unit.instance.world_size,
            }
            for unit in self._units
        ]
        optimizers = []
        for optimizer in self._raw_optimizers():
            layout = self._layout_of(optimizer)
            optimizers.append(
                {
                    "group_names": [list(names) for names in layout.group_names],
                    "units": [position[id(unit.param)] for unit in layout.flat_units],
                }
            )
        return {
            "version": SHARDED_LAYOUT_VERSION,
            "rank": self.global_rank,
            "world_size": self.world_size,
            "units": units,
            "optimizers": optimizers,
            "aliases": dict(self._aliases),
        }

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        directory = sharded_directory(checkpoint_path)
        if directory is None:
            self._loaded_sharded = False
            return super().load_checkpoint(checkpoint_path, weights_only)
        sharded = open_sharded(directory)
        metadata, source = sharded.metadata, sharded.source
        self._checkpoint_source = source
        if metadata.strategy != self.strategy_name or metadata.world_size != self.world_size:
            raise CheckpointFormatError(
                f"{source} was written by {metadata.strategy!r} at world size {metadata.world_size}; this run is"
                f" {self.strategy_name!r} at world size {self.world_size}. A sharded checkpoint resumes only where it"
                " was written: consolidate it into a full checkpoint (lightning-strategies consolidate) to move it."
            )
        if sharded.format != "fairscale FSDP local shards":
            raise CheckpointFormatError(f"{source} holds {sharded.format} shards, not fsdp_fairscale rank files.")
        rank_file_paths(sharded)  # every rank's file is there: a missing one is named on every rank
        shard = read_rank_file(sharded, self.global_rank)
        self._loaded_sharded = True
        self._sharded_source = f"{source}: {SHARDED_RANK_FILE.format(rank=self.global_rank)}"
        return {**sharded.meta, **shard}

    def _sharded_problem(self, checkpoint: Mapping[str, Any], strict: bool) -> CheckpointError | None:
        """Why this rank's shard does not fit this run (layout, local flat shards, optimizer states), or ``None``."""
        where = self._sharded_source
        saved, own = checkpoint.get(SHARDED_LAYOUT_KEY), self._sharded_layout()
        try:
            if not isinstance(saved, Mapping):
                raise CheckpointFormatError(f"{where} holds no {SHARDED_LAYOUT_KEY!r} block.")
            if any(saved.get(key) != own[key] for key in ("version", "world_size", "units", "optimizers")):
                # Name the parameters that differ when the model differs; else the wrapping or param groups do.
                described = fairscale_model_layout(checkpoint.get("state_dict", {}), saved)
                check_model_state(self._expected_model_state(), described, source=where, shapes_only=True)
                raise CheckpointFormatError(
                    f"{where} was saved with another wrapping or other param groups (its flat parameters hold other"
                    " parameters); nothing was loaded. Use the same auto_wrap_min_params, flatten_parameters,"
                    " configure_model and configure_optimizers as the run that saved it, or consolidate it."
                )
            local = {
                key: torch.empty(value.shape, dtype=value.dtype, device="meta")
                for key, value in self._root().local_state_dict().items()
                if isinstance(value, Tensor)
            }
            check_model_state(local, checkpoint.get("state_dict", {}), strict=True, source=where)
            if self._restoring_sharded_optimizer_states(checkpoint):
                optimizers = self._raw_optimizers()
                shapes = [param_group_shapes(optimizer) for optimizer in optimizers]
                check_optimizer_states(checkpoint["optimizer_states"], optimizers, shapes, source=where)
        except CheckpointError as error:
            return error
        return None

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._loaded_sharded:
            super().load_model_state_dict(checkpoint, strict)
            return
        root = self._root()
        for _, instance in _fsdp_instances(root):
            instance._lazy_init()  # load_local_state_dict needs every instance initialised
        # Every rank validates its shard (and optimizer states) and the ranks agree, before any weight changes.
        self._refuse_unless_every_rank_fits(self._sharded_problem(checkpoint, strict))
        root.load_local_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._loaded_sharded:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self._raw_optimizers(), checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(dict(state))
