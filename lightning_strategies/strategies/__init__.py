"""One strategy per module; ``base`` holds what they share."""

from lightning_strategies.strategies.base import DirectReferenceStrategy
from lightning_strategies.strategies.redirection import ForwardRedirection
from lightning_strategies.strategies.sharded_ddp import ShardedDDPStrategy

__all__ = ["DirectReferenceStrategy", "ForwardRedirection", "ShardedDDPStrategy"]
