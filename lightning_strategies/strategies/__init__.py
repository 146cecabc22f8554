"""One strategy per module; ``base`` holds what they share."""

from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.strategies.fairscale_fsdp import FairScaleFSDPStrategy
from lightning_strategies.strategies.redirection import ForwardRedirection
from lightning_strategies.strategies.sharded_ddp import ShardedDDPStrategy

__all__ = ["DirectReferenceStrategy", "FairScaleFSDPStrategy", "ForwardRedirection", "ShardedDDPStrategy"]
