"""Drop-in PyTorch Lightning strategies that keep a direct reference to the LightningModule.

Importing this package registers the strategy names (``ddp_sharded``, ``ddp_sharded_spawn``, ``ddp_sharded_fork``,
``fsdp_fairscale``, ``fsdp_fairscale_spawn``, ``fsdp_fairscale_fork``, ``fsdp_fairscale_offload``, ``fsdp2``,
``fsdp2_spawn``, ``fsdp2_fork``) with Lightning's
``StrategyRegistry``, so ``Trainer(strategy="fsdp_fairscale")`` works.
"""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_strategies.checkpoint import CheckpointMetadata
from lightning_strategies.strategies import (
    DirectReferenceStrategy,
    FairScaleFSDPStrategy,
    ForwardRedirection,
    FSDP2Strategy,
    ShardedDDPStrategy,
)

__version__ = "0.1.0"

for _strategy in (ShardedDDPStrategy, FairScaleFSDPStrategy, FSDP2Strategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "CheckpointMetadata",
    "DirectReferenceStrategy",
    "FSDP2Strategy",
    "FairScaleFSDPStrategy",
    "ForwardRedirection",
    "ShardedDDPStrategy",
    "__version__",
]
