"""What ``FairScaleFSDPStrategy`` accepts: fairscale FSDP's own options, and the optimizers whose math survives
stepping flat 1-D shards."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from fairscale.nn.data_parallel import FullyShardedDataParallel

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
