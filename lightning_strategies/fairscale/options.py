"""What ``FairScaleFSDPStrategy`` accepts: fairscale FSDP's own options, and the optimizers whose math survives
stepping flat 1-D shards."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from fairscale.nn.data_parallel import FullyShardedDataParallel
from torch.nn import Module

from ..strategies.optimizers import OptimizerNeed

#: The keyword arguments of ``FullyShardedDataParallel`` the strategy passes on (it sets ``compute_device`` itself).
FSDP_KWARGS = frozenset(inspect.signature(FullyShardedDataParallel.__init__).parameters) - {
    "self",
    "module",
    "compute_device",
}

#: What stepping flat 1-D shards takes away from an optimizer's math (see ``optimizers.OptimizerNeed``).
REFUSED_OPTIMIZER_NEEDS = {
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


def refuse_unknown_fsdp_kwargs(fsdp_kwargs: Mapping[str, Any]) -> None:
    """Refuses keyword arguments that fairscale's ``FullyShardedDataParallel`` does not take.

    Raises:
        TypeError: Naming them and the ones it takes.
    """
    unknown = sorted(set(fsdp_kwargs) - FSDP_KWARGS)
    if unknown:
        raise TypeError(
            f"FairScaleFSDPStrategy got keyword argument(s) {', '.join(unknown)} that fairscale's"
            f" FullyShardedDataParallel does not take. It takes: {', '.join(sorted(FSDP_KWARGS))}"
            " (compute_device is set from the Trainer's device)."
        )


class FlattenedUnderCachedAutocastError(ValueError):
    """``flatten_parameters=True`` under a precision plugin whose autocast caches the casts of parameters."""


def unflattened_by_default(fsdp_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``fsdp_kwargs`` with ``flatten_parameters=False`` unless they name it: what trains as ``ddp`` does under an
    autocast that caches the casts of parameters (see :func:`refuse_flattening`)."""
    return {"flatten_parameters": False, **fsdp_kwargs}


def refuse_flattening(root: Module) -> None:
    """Refuses flattened parameters (``flatten_parameters=True`` given to the strategy or to ``fairscale.nn.wrap``)
    under a training autocast that caches its casts of parameters (Lightning's ``MixedPrecision`` before 2.6).

    Such an autocast casts a leaf parameter once per step: under ``ddp`` the low-precision gradients of all the uses of
    a parameter (a layer called twice, a weight tied to another layer's) are summed in low precision, then cast to
    float32. A flattened module's parameters are views of its flat parameter, which torch's autocast never caches:
    each use is cast, and its gradient cast back to float32, on its own, so training ends elsewhere than ``ddp``'s
    (by 1e-2 after a few Adam steps). Without flattening the module's parameters stay leaves and are cached as under
    ``ddp``.

    Raises:
        FlattenedUnderCachedAutocastError: An FSDP instance in ``root`` flattens its parameters.
    """
    flattening = [
        name or "the root"
        for name, instance in root.named_modules()
        if isinstance(instance, FullyShardedDataParallel) and instance.flatten_parameters and instance.params
    ]
    if flattening:
        raise FlattenedUnderCachedAutocastError(
            f"FairScaleFSDPStrategy cannot train flattened parameters (flatten_parameters=True, in"
            f" {', '.join(flattening)}) as ddp does under this precision plugin: its autocast caches the low-precision"
            " cast of each parameter (Lightning's MixedPrecision before 2.6), which torch never does for the views a"
            " flat parameter gives the module, so a parameter used twice in a step gets a different gradient. Pass"
            " flatten_parameters=False (the default under such a plugin), or use Lightning 2.6 or newer (its autocast"
            " does not cache)."
        )
