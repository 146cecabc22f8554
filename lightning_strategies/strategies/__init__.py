"""One strategy per module; ``base`` holds what they share. fairscale's strategies live in
:mod:`lightning_strategies.fairscale` with everything else that needs fairscale, and are exported here too."""

from ..fairscale.fsdp import FairScaleFSDPStrategy
from ..fairscale.sharded_ddp import ShardedDDPStrategy
from .base import DirectReferenceStrategy
from .fsdp2 import FSDP2Strategy
from .redirection import ForwardRedirection

__all__ = [
    "DirectReferenceStrategy",
    "FSDP2Strategy",
    "FairScaleFSDPStrategy",
    "ForwardRedirection",
    "ShardedDDPStrategy",
]
