"""``lightning_strategies`` for users of the unified ``lightning`` package (``import lightning as L``).

``lightning.pytorch`` and ``pytorch_lightning`` are the same Trainer under two names with distinct classes, so a
strategy built on one is refused by the other's Trainer. This package is the whole of ``lightning_strategies``
imported a second time under this name: its search path is the parent package's directory, so
``lightning_strategies.lightning.strategies.fsdp2`` runs the same source as ``lightning_strategies.strategies.fsdp2``,
and the one module that imports Lightning (``_lightning``) reads from its name that it must import
``lightning.pytorch`` and ``lightning.fabric``. One implementation, two bindings, no copy of the logic.

Shared by both bindings (they never import Lightning): ``lightning_strategies.checkpoint`` (formats, checks and the
errors they raise), ``lightning_strategies._torch_private`` and ``lightning_strategies.fairscale``'s ``_private``,
``cpu`` and ``layout``.

Example::

    import lightning as L
    from lightning_strategies.lightning import FairScaleFSDPStrategy  # also registers "fsdp_fairscale" etc.

    trainer = L.Trainer(strategy=FairScaleFSDPStrategy(), accelerator="cpu", devices=2)
"""

from pathlib import Path
from typing import TYPE_CHECKING

if __name__ != "lightning_strategies.lightning":
    raise ImportError(f"{__name__} is not a package; import lightning_strategies.lightning")

if TYPE_CHECKING:
    from lightning_strategies import *  # noqa: F403  (the same names, typed against pytorch_lightning)
    from lightning_strategies import __all__ as __all__
else:
    __path__ = [str(Path(__file__).resolve().parent.parent)]
    _package_init = Path(__path__[0]) / "__init__.py"
    exec(compile(_package_init.read_text(), str(_package_init), "exec"))
