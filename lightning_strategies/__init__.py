"""Drop-in PyTorch Lightning strategies that keep a direct reference to the LightningModule.

Importing this package registers the strategy names (``ddp_sharded``, ``ddp_sharded_spawn``, ``ddp_sharded_fork``,
``fsdp_fairscale``, ``fsdp_fairscale_spawn``, ``fsdp_fairscale_fork``, ``fsdp_fairscale_offload``, ``fsdp2``,
``fsdp2_spawn``, ``fsdp2_fork``) with Lightning's ``StrategyRegistry``, so ``Trainer(strategy="fsdp_fairscale")``
works.

The classes here are built on ``pytorch_lightning``. Users of the unified package (``import lightning``) import the
same classes, bound to ``lightning.pytorch``, from ``lightning_strategies.lightning``. Importing either never imports
a Lightning package that is not installed.
"""

from importlib.util import find_spec

from ._flavour import LIGHTNING, PYTORCH_LIGHTNING, flavour_of

__version__ = "0.1.0"

_FLAVOUR = flavour_of(__name__)
_OTHER = PYTORCH_LIGHTNING if _FLAVOUR is LIGHTNING else LIGHTNING

__all__ = [
    "AsyncSaveError",
    "CheckpointMetadata",
    "CheckpointRefusedError",
    "DirectReferenceStrategy",
    "FSDP2Strategy",
    "FairScaleFSDPStrategy",
    "ForwardRedirection",
    "RanksDisagreeError",
    "ShardedDDPStrategy",
    "ShardedFormat",
    "__version__",
]

if find_spec(_FLAVOUR.pytorch.split(".")[0]) is not None and find_spec(_FLAVOUR.pytorch) is not None:
    from lightning_strategies.checkpoint import CheckpointMetadata

    from ._lightning import StrategyRegistry
    from .strategies import (
        DirectReferenceStrategy,
        FairScaleFSDPStrategy,
        ForwardRedirection,
        FSDP2Strategy,
        ShardedDDPStrategy,
    )
    from .strategies.agreement import RanksDisagreeError
    from .strategies.async_saves import AsyncSaveError
    from .strategies.sharded_format import ShardedFormat
    from .strategies.stops import CheckpointRefusedError

    for _strategy in (ShardedDDPStrategy, FairScaleFSDPStrategy, FSDP2Strategy):
        _strategy.register_strategies(StrategyRegistry)
else:

    def __getattr__(name: str) -> object:
        if name in __all__:
            raise ImportError(
                f"{__name__}.{name} is built on `{_FLAVOUR.pytorch}`, which is not installed: install it with"
                f" `pip install {_FLAVOUR.distribution}`, or, if you use `{_OTHER.pytorch}`, import {name} from"
                f" `{_OTHER.tree}`."
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
