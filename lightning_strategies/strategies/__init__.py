"""One strategy per module; ``base`` holds what they share."""

from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.strategies.fairscale_fsdp import FairScaleFSDPStrategy
from lightning_strategies.strategies.fsdp2 import FSDP2Strategy
from lightning_strategies.strategies.redirection import ForwardRedirection
from lightning_strategies.strategies.sharded_ddp import ShardedDDPStrategy

__all__ = [
    "DirectReferenceStrategy",
    "FSDP2Strategy",
    "FairScaleFSDPStrategy",
    "ForwardRedirection",
    "ShardedDDPStrategy",
]
