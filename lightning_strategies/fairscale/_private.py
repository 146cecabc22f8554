"""Every name private to fairscale 0.4.13 that the package reads, calls, overrides or replaces, in one place.

fairscale is frozen at 0.4.13, but its private attributes are what the strategies need to get right what its public
API leaves wrong (see ``docs/design.md``, "fairscale traps handled"). Whoever moves to another fairscale release
reads this module to see what may break; ``tests/test_backend_homes.py`` fails when a fairscale-private name is used
anywhere else. Nothing here imports Lightning: both bindings share this module.

- :class:`FSDPHooks` and :class:`FlattenHooks`: fairscale's private steps that the strategy's subclasses change,
  called through public hook methods that default to fairscale's own behaviour.
- Functions and constants: reads and writes of fairscale's private attributes on its wrappers, flat parameters,
  optimizers and process-group cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import fairscale.internal.reduce_scatter_bucketer as bucketer_module
import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
import torch
from fairscale.internal.parallel import get_process_group_cached
from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper
from fairscale.optim import OSS
from torch import Tensor
from torch.nn import Module, Parameter

FSDP = FullyShardedDataParallel

#: Attribute names fairscale puts into module paths: FSDP's wrapped module and the flatten wrapper's module.
FAIRSCALE_SEGMENTS = ("_fsdp_wrapped_module", "_fpw_module")

#: Names of the CUDA streams fairscale FSDP's root creates (the CPU patches fill them with stand-ins).
STREAM_NAMES = ("fp32_to_fp16", "all_gather", "post_backward")


# ---------------------------------------------------------------------------------------------- FSDP's private steps


class FSDPHooks(FullyShardedDataParallel):
    """``FullyShardedDataParallel`` whose private steps, which fairscale calls itself, run through public hooks.

    A subclass overrides a hook and calls ``super()`` for fairscale's behaviour. The other methods are fairscale's
    private helpers of the same instance, under public names.
    """

    def _use_full_params(self) -> None:
        self.use_full_params()

    def use_full_params(self) -> None:
        """Hook: fairscale's pre-backward step that makes the gathered parameters the module's again."""
        FullyShardedDataParallel._use_full_params(self)

    def _wait_for_post_backward(self) -> None:
        self.wait_for_post_backward()

    def wait_for_post_backward(self) -> None:
        """Hook: fairscale's end of a backward pass (waits for reductions, finalises every instance)."""
        FullyShardedDataParallel._wait_for_post_backward(self)

    def _post_reduction_hook(self, param: Parameter, reduced_grad: Tensor) -> None:
        self.post_reduction_hook(param, reduced_grad)

    def post_reduction_hook(self, param: Parameter, reduced_grad: Tensor) -> None:
        """Hook: fairscale stores a parameter's reduced gradient shard."""
        FullyShardedDataParallel._post_reduction_hook(self, param, reduced_grad)

    def rebuild_full_params(self) -> None:
        """Gathers this instance's full parameters (a collective)."""
        self._rebuild_full_params()

    @property
    def syncs_gradients(self) -> bool:
        """Whether the current backward pass reduces gradients (``False`` inside ``no_sync``)."""
        return syncs_gradients(self)


class FlattenHooks(FlattenParamsWrapper):
    """fairscale's ``FlattenParamsWrapper`` whose step that gives the module views of the flat parameters is a hook."""

    def _unflatten_params_as_views(self) -> None:
        self.unflatten_params_as_views()

    def unflatten_params_as_views(self) -> None:
        """Hook: the module's parameter attributes become views of the (gathered) flat parameters."""
        FlattenParamsWrapper._unflatten_params_as_views(self)


def replace_flatten_wrapper(replacement: type[FlattenParamsWrapper] | None) -> type[FlattenParamsWrapper]:
    """Makes FSDP's constructor build ``replacement`` as its flatten wrapper (``None``: fairscale's own again).

    Returns:
        The class that was there.
    """
    namespace = vars(fsdp_module)
    previous: type[FlattenParamsWrapper] = namespace["FlattenParamsWrapper"]
    namespace["FlattenParamsWrapper"] = replacement or FlattenParamsWrapper
    return previous


def syncs_gradients(instance: FSDP) -> bool:
    """Whether ``instance``'s current (or last) backward pass reduces gradients (``False`` inside ``no_sync``)."""
    return bool(instance._require_backward_grad_sync)


def lazy_init(instance: FSDP) -> None:
    """Runs fairscale's lazy initialisation of ``instance`` (streams, buffers, root flag), as its first forward does."""
    instance._lazy_init()


def free_full_params(instance: FSDP, params: list[Parameter] | None = None) -> None:
    """Frees the gathered full parameters of ``instance`` (all of them, or ``params``)."""
    instance._free_full_params(params)


def use_fp32_param_shard(instance: FSDP, params: list[Parameter] | None = None) -> None:
    """Points ``params`` (default: all of ``instance``'s) at their fp32 shard again."""
    instance._use_fp32_param_shard(params)


def reshard(instance: FSDP, params: list[Parameter]) -> None:
    """What fairscale's post-backward hook does to a parameter: full parameters freed, the shard in place again."""
    instance._free_full_params(params)
    if instance.mixed_precision:
        instance._free_fp16_param_shard(params)
    instance._use_fp32_param_shard(params)


# ---------------------------------------------------------------------------------------------- flat parameters


def param_infos(flat: Parameter) -> list[tuple[str, Module, str]]:
    """``(module path, module, attribute)`` of each original parameter a flat parameter holds (empty for others)."""
    return list(getattr(flat, "_param_infos", ()))


def shared_param_infos(flat: Parameter) -> list[tuple[str, str, Module, str, Module, str]]:
    """``(alias path, holder path, alias module, alias attribute, holder module, holder attribute)`` of each tied
    parameter a flat parameter holds under a second name (empty for other parameters)."""
    return list(getattr(flat, "_shared_param_infos", ()))


def fp32_shard(param: Parameter) -> Tensor | None:
    """The fp32 shard FSDP keeps of a parameter, ``None`` before FSDP initialised it."""
    shard = getattr(param, "_fp32_shard", None)
    return shard if isinstance(shard, Tensor) else None


def original_size(param: Parameter) -> torch.Size:
    """The full shape of an original parameter FSDP shards without flattening (``flatten_parameters=False``)."""
    return torch.Size(getattr(param, "_orig_size"))  # noqa: B009


def has_cpu_gradient_buffer(param: Parameter) -> bool:
    """Whether FSDP gives the parameter a CPU gradient buffer (``move_grads_to_cpu``)."""
    return hasattr(param, "_cpu_grad")


def saved_grad_shard(param: Parameter) -> Tensor | None:
    """The gradient shard FSDP set aside before a backward pass (it adds the new reduced gradient to it)."""
    saved = getattr(param, "_saved_grad_shard", None)
    return saved if isinstance(saved, Tensor) else None


def set_saved_grad_shard(param: Parameter, shard: Tensor | None) -> None:
    """Sets aside ``shard`` as FSDP does before a backward pass; ``None`` drops what is set aside."""
    if shard is not None:
        setattr(param, "_saved_grad_shard", shard)  # noqa: B010
    elif hasattr(param, "_saved_grad_shard"):
        delattr(param, "_saved_grad_shard")


def forget_unflattened_views(module: Module) -> None:
    """Drops the parameter views fairscale's flatten wrapper left in ``module``'s ``__dict__``."""
    vars(module).pop("_unflattened_param_views", None)


# ---------------------------------------------------------------------------------------------- process groups


def cached_process_groups() -> list[Any]:
    """The process groups fairscale caches for the life of the process (``get_process_group_cached``)."""
    cache: dict[Any, Any] | None = vars(get_process_group_cached).get("_global_group_cache")
    return list(cache.values()) if cache else []


def drop_cached_process_groups() -> None:
    """Empties fairscale's process-group cache: the next FSDP creates its groups again."""
    vars(get_process_group_cached).pop("_global_group_cache", None)


# ------------------------------------------------------------------------------------------- ShardedDataParallel, OSS


def accumulates_gradients(wrapper: ShardedDataParallel) -> bool:
    """Whether ``wrapper``'s current backward pass runs inside ``no_sync`` (reduces nothing)."""
    return bool(wrapper._should_accumulate_grads)


def reset_reduction_bookkeeping(wrapper: ShardedDataParallel) -> None:
    """Resets what ``wrapper`` reduced in this step (its forward does this, for one backward pass only)."""
    wrapper._clear_counters()


def world_size_scaling(wrapper: ShardedDataParallel) -> float:
    """The factor ``wrapper`` multiplies gradients by before reducing them (``1 / world size``)."""
    return float(wrapper._world_size_scaling)


def owned_trainable_params(wrapper: ShardedDataParallel) -> Iterator[tuple[int, Tensor, bool]]:
    """``(index, parameter, still to be reduced)`` of each trainable parameter whose optimizer state this rank owns."""
    for index, param in enumerate(wrapper._trainable_params):
        if wrapper._trainable_param_to_rank[param] == wrapper._global_rank:
            yield index, param, bool(wrapper._grad_to_be_reduced[index])


def param_owners(optimizer: OSS) -> Mapping[Tensor, int]:
    """The rank whose shard of ``optimizer`` owns each parameter."""
    owners: Mapping[Tensor, int] = optimizer._param_to_rank
    return owners


def param_indices(optimizer: OSS) -> dict[int, int]:
    """The canonical index (over all param groups) of each parameter of ``optimizer``, by ``id``."""
    indices: dict[int, int] = optimizer._param_to_index
    return indices


# ---------------------------------------------------------------------------------------------- CPU patches' targets


def is_root(instance: FSDP) -> bool:
    """Whether ``instance`` is its tree's root (decided at lazy initialisation)."""
    return bool(instance._is_root)


def streams(instance: FSDP) -> dict[str, Any]:
    """The CUDA streams of ``instance`` (the root's dict, shared by its children), by name."""
    found: dict[str, Any] = instance._streams
    return found


#: ``(object, attribute)`` of each fairscale function the CPU patches replace, by the patch's name.
CPU_PATCH_TARGETS: dict[str, tuple[Any, str]] = {
    "setup_streams": (FullyShardedDataParallel, "_setup_streams"),
    "calc_grad_norm": (fsdp_module, "calc_grad_norm"),
    "list_collectives": (bucketer_module, "enable_nccl_base_collectives"),
    "gather_optim_state": (FullyShardedDataParallel, "_gather_optim_state"),
}
