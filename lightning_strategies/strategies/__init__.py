"""One strategy per module; ``base`` holds what they share."""

from .base import DirectReferenceStrategy
from .fairscale_fsdp import FairScaleFSDPStrategy
from .fsdp2 import FSDP2Strategy
from .redirection import ForwardRedirection
from .sharded_ddp import ShardedDDPStrategy

__all__ = [
    "DirectReferenceStrategy",
    "FSDP2Strategy",
    "FairScaleFSDPStrategy",
    "ForwardRedirection",
    "ShardedDDPStrategy",
]
