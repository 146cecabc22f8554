"""fairscale sharded DDP: optimizer state (OSS) and gradients sharded across ranks, parameters replicated."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_strategies.checkpoint import shallow_copy_state
from lightning_strategies.fairscale._private import (
    accumulates_gradients,
    owned_trainable_params,
    param_indices,
    param_owners,
    reset_reduction_bookkeeping,
    world_size_scaling,
)

from .._lightning import CheckpointIO, ClusterEnvironment, Precision, pl
from ..strategies.base import DirectReferenceStrategy, StartMethod
from ..strategies.full_gradients import owners_gradients_on_every_rank
from ..strategies.gather import TensorSpec, gather_owned_to_rank0
from ..strategies.launcher import HandBack
from ..strategies.optimizers import OptimizerNeed, refuse_unsupported_optimizers, retarget_schedulers, twin_optimizer
from .gradients import AGREEING_SCALERS

# Keyword arguments ShardedDataParallel accepts besides the module and the optimizers it builds from.
SHARDED_DDP_KWARGS = frozenset(inspect.signature(ShardedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "sharded_optimizer",
}


# What OSS's sharding of the optimizer takes away from an optimizer's math (see optimizers.OptimizerNeed).
_REFUSED_OPTIMIZER_NEEDS = {
    OptimizerNeed.ALL_PARAMETERS_AS_ONE: (
        "OSS gives each rank only the parameters of its shard to step, so each rank would compute other directions"
        " and run the closure, with its collectives, a different number of times (a hang)"
    ),
    OptimizerNeed.SPARSE_GRADIENTS: "ShardedDataParallel reduces gradients as dense tensors",
}


def _to_oss(optimizer: Optimizer) -> OSS:
    """Re-creates a plain optimizer as an OSS whose shard optimizer is a twin of it (same class and attributes).

    State the optimizer held already (``Adagrad``'s initial sums) is not carried here: the strategy loads it after
    the OSS exists, in canonical form, like a checkpoint's.
    """
    if isinstance(optimizer, OSS):
        return optimizer
    groups = [dict(group) for group in optimizer.param_groups]  # copies: OSS adopts and edits the dicts it gets

    def shard_optimizer(params: Any, **_defaults: Any) -> Optimizer:
        return twin_optimizer(optimizer, params)

    return OSS(params=groups, optim=shard_optimizer, **optimizer.defaults)  # type: ignore[arg-type]


def _keep_gradient_views(optimizer: OSS) -> None:
    """Makes ``optimizer.zero_grad`` zero gradients in place instead of dropping them.

    ShardedDataParallel's reduce buckets make each small gradient a view into a bucket buffer. torch 2's default
    ``zero_grad(set_to_none=True)`` drops those views; the next backward allocates fresh gradients, and the bucket
    reduces stale values: training silently diverges from DDP. Zeroing in place keeps the views.
    """

    def zero_grad_in_place(set_to_none: bool = True) -> None:
        type(optimizer).zero_grad(optimizer, set_to_none=False)

    vars(optimizer)["zero_grad"] = zero_grad_in_place


def _tensor_keys(entries: Mapping[str, Any]) -> list[str]:
    """The keys of one parameter's described state whose values are tensors (sent apart from the descriptions)."""
    return [key for key, value in entries.items() if isinstance(value, TensorSpec)]


@torch.no_grad()
def _broadcast_tensors_from_rank0(module: Module, group: Any = None) -> None:
    """Gives every rank of ``group`` (default: all) its first rank's parameters and buffers (a collective)."""
    source = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    for tensor in module.state_dict().values():
        if isinstance(tensor, Tensor):
            torch.distributed.broadcast(tensor, src=source, group=group)


class ShardedDDPStrategy(DirectReferenceStrategy):
    """Data parallel training with fairscale ``ShardedDataParallel`` and ``OSS`` (ZeRO stages 1 and 2).

    The LightningModule is wrapped directly. The optimizers that ``configure_optimizers()`` returns become OSS
    optimizers of the same type, param groups and defaults, and the LR schedulers follow them. Checkpoints hold the
    optimizer state consolidated on rank 0 in torch's canonical layout, so they resume under any strategy.

    It also takes the arguments every strategy of this package shares (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
    ``start_method``, ``hand_back``, ``async_save``), with the same defaults and meaning as
    :class:`~lightning_strategies.DirectReferenceStrategy`, which documents them.

    Args:
        **sharded_ddp_kwargs: Passed to ``fairscale.nn.ShardedDataParallel`` (``broadcast_buffers``,
            ``reduce_buffer_size``, ``auto_refresh_trainable``, ``reduce_fp16``, ...). ``reduce_buffer_size``
            defaults to 0 here (fairscale: 2**23): with buckets, gradients must be zeroed in place, so the
            optimizers' ``zero_grad`` then ignores ``set_to_none``, and manual optimization is refused (it trains
            wrong with buckets).

    Raises:
        TypeError: A keyword argument that ``ShardedDataParallel`` does not take.
    """

    agreeing_scalers = AGREEING_SCALERS

    strategy_name = "ddp_sharded"

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
        async_save: bool = False,
        **sharded_ddp_kwargs: Any,
    ) -> None:
        unknown = sorted(set(sharded_ddp_kwargs) - SHARDED_DDP_KWARGS)
        if unknown:
            hint = (
                " ShardedDataParallel reduces the gradients of unused parameters by itself; drop"
                " find_unused_parameters."
                if "find_unused_parameters" in unknown
                else ""
            )
            raise TypeError(
                f"ShardedDDPStrategy got keyword argument(s) {', '.join(unknown)} that fairscale's ShardedDataParallel"
                f" does not take. It takes: {', '.join(sorted(SHARDED_DDP_KWARGS))}.{hint}"
            )
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
            async_save=async_save,
        )
        self._sharded_ddp_kwargs = {"reduce_buffer_size": 0, **sharded_ddp_kwargs}
        self._prescaled_gradients: list[Tensor] = []
        # Weak references: a gradient that zero_grad dropped is freed, not kept alive here.
        self._averaged_gradients: dict[Tensor, weakref.ref[Tensor]] = {}
        # With gradient buckets (see _hide_gradients_no_rank_computed): the parameters whose gradient backward
        # accumulated on this rank since the last synchronised pass, and the bucket views set aside for a step.
        self._reached: set[Tensor] = set()
        self._reached_hooks: list[RemovableHandle] = []
        self._hidden_gradients: list[tuple[Tensor, Tensor]] = []

    @override
    def configure_for_fit(self, trainer: pl.Trainer) -> None:
        module = self.require_lightning_module()
        if self._sharded_ddp_kwargs["reduce_buffer_size"] > 0 and not module.automatic_optimization:
            # Measured: one optimizer stepped by hand ends 7.7e-2 away from ddp with buckets, a GAN too. Refused here,
            # on every rank before any collective, not at the first backward pass.
            raise RuntimeError(
                "ShardedDDPStrategy: manual optimization (backward inside training_step) trains wrong with"
                f" fairscale's gradient buckets (reduce_buffer_size={self._sharded_ddp_kwargs['reduce_buffer_size']})."
                " Pass reduce_buffer_size=0 (the default of this strategy) to ShardedDDPStrategy."
            )
        # The module keeps whole parameters under ShardedDataParallel, so configure_optimizers() sees the
        # parameters that train; only the optimizer objects are swapped for sharded ones.
        self.setup_optimizers(trainer)
        refuse_unsupported_optimizers(self.strategy_name, self.optimizers, module, _REFUSED_OPTIMIZER_NEEDS)
        sharded = [_to_oss(optimizer) for optimizer in self.optimizers]
        for old, new in zip(self.optimizers, sharded, strict=True):
            retarget_schedulers(self.lr_scheduler_configs, old, new)
            if old is not new and old.state:  # created at construction (Adagrad's sums) or loaded by the user
                self._load_canonical_optimizer_state(new, old.state_dict())
        if self._sharded_ddp_kwargs["reduce_buffer_size"] > 0:
            for optimizer in sharded:
                _keep_gradient_views(optimizer)
        self.optimizers = list(sharded)
        kwargs = dict(self._sharded_ddp_kwargs)
        if kwargs.get("sync_models_at_startup", True):
            # fairscale's own start-up sync broadcasts every value of the module's state_dict and fails on one that is
            # not a tensor (a module's get_extra_state); parameters and buffers are what torch's DDP syncs too.
            _broadcast_tensors_from_rank0(module, kwargs.get("process_group"))
        kwargs["sync_models_at_startup"] = False
        self.model = ShardedDataParallel(module, sharded_optimizer=sharded, **kwargs)
        self._track_reached_parameters(module)

    def _track_reached_parameters(self, module: Module) -> None:
        """With buckets, records which parameters each backward pass gives a gradient (their post-accumulate hook).

        fairscale's gradient buckets make every bucketed parameter's gradient a view into the bucket, from the start and
        through every ``zero_grad``: a parameter that no rank's backward reached (a submodule the step never calls)
        has a zero gradient instead of ``None``, and the optimizer moved it (weight decay, momentum, Adam's state) where
        ``ddp`` leaves it alone. Without buckets such a gradient stays ``None``.
        """
        for handle in self._reached_hooks:
            handle.remove()
        self._reached_hooks, self._reached, self._hidden_gradients = [], set(), []
        if self._sharded_ddp_kwargs["reduce_buffer_size"] <= 0:
            return
        reached = self._reached
        record: Callable[[Tensor], None] = reached.add
        self._reached_hooks = [
            param.register_post_accumulate_grad_hook(record)  # type: ignore[no-untyped-call]  # untyped in torch
            for param in module.parameters()
            if param.requires_grad
        ]

    def _hide_gradients_no_rank_computed(self, module: Module) -> None:
        """Sets aside, until the optimizer has stepped, the gradients of parameters that no rank's backward reached
        since the last synchronised pass, so the optimizer skips them as under ``ddp`` (``find_unused_parameters``: a
        parameter is unused when it is unused on every rank; one that a rank used keeps its averaged gradient). One
        all-reduce of a flag per parameter, with buckets only."""
        params = [param for param in module.parameters() if param.requires_grad]
        if not params:
            return
        flags = torch.tensor([param in self._reached for param in params], dtype=torch.int32, device=self.root_device)
        self._reached.clear()
        torch.distributed.all_reduce(flags, op=ReduceOp.MAX, group=self._sharded_ddp_kwargs.get("process_group"))
        for param, reached_somewhere in zip(params, flags.tolist(), strict=True):
            grad = param.grad
            if not reached_somewhere and grad is not None:
                self._hidden_gradients.append((param, grad))
                param.grad = None

    def _restore_hidden_gradients(self) -> None:
        """Gives the parameters back the bucket views set aside (zero: no backward wrote into them); the next backward
        accumulates into the bucket through them."""
        for param, grad in self._hidden_gradients:
            param.grad = grad
        self._hidden_gradients = []

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Module | None = None, **kwargs: Any
    ) -> Any:
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._restore_hidden_gradients()

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Prepares ``ShardedDataParallel`` for one more backward pass in the same step.

        ``ShardedDataParallel`` resets its reduction bookkeeping in ``forward`` only, for the one backward pass it
        expects to follow; a step that runs two (a GAN's generator and discriminator losses, or gradients accumulated
        with ``manual_backward``) trained silently wrong: the second pass neither reduced the gradients the first had
        reduced nor waited for its own reductions before the optimizer stepped. Each synchronised pass now starts with
        the bookkeeping reset. And a reduction averages what the ranks hold: a gradient the owner rank kept from an
        earlier pass is an average already and would be divided by the world size again, so it is multiplied by the
        world size before more is added to it (and divided again after a synchronised pass that did not reduce it).
        """
        super().pre_backward(closure_loss)
        self._restore_hidden_gradients()  # a backward without an optimizer step after the last one
        wrapper = self.model
        self._prescaled_gradients = []
        if not isinstance(wrapper, ShardedDataParallel) or not wrapper.training:
            return
        if not accumulates_gradients(wrapper):
            reset_reduction_bookkeeping(wrapper)
        for param, averaged in self._averaged_gradients.items():
            grad = param.grad
            if grad is not None and grad is averaged():  # not dropped or replaced by zero_grad since it was reduced
                grad.div_(world_size_scaling(wrapper))
                self._prescaled_gradients.append(param)
        self._averaged_gradients = {}

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        wrapper = self.model
        if not isinstance(wrapper, ShardedDataParallel) or not wrapper.training or accumulates_gradients(wrapper):
            return
        prescaled = {id(param) for param in self._prescaled_gradients}
        for _, param, to_be_reduced in owned_trainable_params(wrapper):
            if param.grad is None:
                continue
            if not to_be_reduced:  # reduced in this pass: an average from now on
                self._averaged_gradients[param] = weakref.ref(param.grad)
            elif id(param) in prescaled:  # not reduced in this pass: back to the average it was
                param.grad.mul_(world_size_scaling(wrapper))
                self._averaged_gradients[param] = weakref.ref(param.grad)
        self._prescaled_gradients = []
        if self._reached_hooks:
            self._hide_gradients_no_rank_computed(self.require_lightning_module())

    @override
    def teardown(self) -> None:
        self._restore_hidden_gradients()
        for handle in self._reached_hooks:
            handle.remove()
        self._reached_hooks, self._reached = [], set()
        super().teardown()

    @contextmanager
    @override
    def complete_gradients(self) -> Generator[None, None, None]:
        # Each parameter's reduced gradient lives on the rank that owns its optimizer state only.
        oss = [optimizer for optimizer in self.optimizers if isinstance(optimizer, OSS)]
        if not isinstance(self.model, ShardedDataParallel) or not oss:
            yield None
            return
        owner_of: dict[Tensor, int] = {}
        for optimizer in oss:
            owner_of.update(param_owners(optimizer))
        params = list(
            dict.fromkeys(
                param
                for optimizer in oss
                for group in optimizer.param_groups
                for param in group["params"]
                if param.requires_grad
            )
        )
        with owners_gradients_on_every_rank(params, owner_of, oss[0].rank):
            yield None

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, ShardedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    @property
    @override
    def gradients_are_sharded(self) -> bool:
        return isinstance(self.model, ShardedDataParallel)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not isinstance(optimizer, OSS):
            raise TypeError(
                f"ShardedDDPStrategy clips gradients through fairscale OSS, but got {type(optimizer).__name__}."
            )
        # Each rank only holds the gradients of its shard: OSS computes the total norm with an all-reduce.
        optimizer.clip_grad_norm(clip_val)

    @override
    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not isinstance(optimizer, OSS):
            return super()._canonical_optimizer_state(optimizer)
        # Each rank owns the whole state of some parameters. The owners send it to rank 0, many tensors of one dtype
        # per transfer (OSS's own consolidation broadcasts every rank's pickled shard to every rank: N-fold copies),
        # keyed by the parameter's index over all groups, which is the canonical layout.
        index_of = param_indices(optimizer)
        owned = {index_of[id(param)]: entries for param, entries in optimizer.optim.state.items()}
        described = {
            index: {
                key: TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v for key, v in entries.items()
            }
            for index, entries in sorted(owned.items())
        }
        descriptions: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
        torch.distributed.gather_object(described, descriptions, dst=0)
        # The tensors travel in the order the descriptions list them; other values travelled in the descriptions.
        tensors = [owned[index][key] for index, entries in described.items() for key in _tensor_keys(entries)]
        specs = (
            [[entries[key] for entries in ranks.values() for key in _tensor_keys(entries)] for ranks in descriptions]
            if descriptions is not None
            else None
        )
        gathered = gather_owned_to_rank0(tensors, specs, self.root_device)
        if descriptions is None or gathered is None:
            return {}
        state: dict[int, dict[str, Any]] = {}
        for ranks_entries, ranks_tensors in zip(descriptions, gathered, strict=True):
            received = iter(ranks_tensors)
            for index, entries in ranks_entries.items():
                state[index] = {
                    key: next(received) if isinstance(value, TensorSpec) else value for key, value in entries.items()
                }
        groups = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]  # torch's packing, numbering and all
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @override
    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        # OSS.load_state_dict empties the entries of other ranks' parameters in the dict it is given: pass a copy so
        # the loaded checkpoint stays intact.
        optimizer.load_state_dict(shallow_copy_state(state))
