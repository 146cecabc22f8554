"""Which Lightning package this copy of the code is bound to, read from the module's own import name.

Lightning ships one Trainer under two names whose classes are distinct: ``pytorch_lightning`` (with
``lightning_fabric``) and ``lightning.pytorch`` (with ``lightning.fabric``). This source tree is imported once per
name: as ``lightning_strategies`` it is bound to ``pytorch_lightning``; as ``lightning_strategies.lightning`` to
``lightning.pytorch``. Nothing here imports Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

LIGHTNING_TREE = "lightning_strategies.lightning"


@dataclass(frozen=True)
class Flavour:
    """The Lightning packages one copy of the code imports.

    Attributes:
        pytorch: The Trainer package, ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        fabric: Its Fabric package, ``"lightning_fabric"`` or ``"lightning.fabric"``.
        distribution: The pip distribution that provides them.
        tree: Where our classes for this flavour live.
    """

    pytorch: str
    fabric: str
    distribution: str
    tree: str


PYTORCH_LIGHTNING = Flavour("pytorch_lightning", "lightning_fabric", "pytorch-lightning", "lightning_strategies")
LIGHTNING = Flavour("lightning.pytorch", "lightning.fabric", "lightning", LIGHTNING_TREE)


def flavour_of(module_name: str) -> Flavour:
    """The flavour of the copy that a module of ``lightning_strategies`` belongs to.

    Args:
        module_name: A module's ``__name__``, e.g. ``"lightning_strategies.lightning.strategies.base"``.

    Returns:
        ``LIGHTNING`` for modules under ``lightning_strategies.lightning``, else ``PYTORCH_LIGHTNING``.
    """
    in_lightning_tree = module_name == LIGHTNING_TREE or module_name.startswith(LIGHTNING_TREE + ".")
    return LIGHTNING if in_lightning_tree else PYTORCH_LIGHTNING
