"""Callbacks: :class:`SafetensorsExport` writes the trained model as Hugging Face safetensors when ``fit`` ends.

Example::

    from lightning_strategies.callbacks import SafetensorsExport

    trainer = pl.Trainer(strategy="fsdp2", callbacks=[SafetensorsExport("export/", submodule="model")])
    trainer.fit(module)
    module.model.config.save_pretrained("export/")  # then AutoModel.from_pretrained("export/")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_strategies.checkpoint.errors import CheckpointError
from lightning_strategies.checkpoint.model_state import tied_parameter_aliases
from lightning_strategies.checkpoint.safetensors_export import (
    DEFAULT_MAX_SHARD_SIZE,
    Export,
    parse_dtype,
    parse_size,
    require_safetensors,
    write_safetensors,
)

from ._lightning import pl
from .strategies.base import DirectReferenceStrategy

__all__ = ["SafetensorsExport"]


class SafetensorsExport(pl.Callback):
    """Writes the trained model into ``dirpath`` as safetensors at the end of ``fit``, as ``save_pretrained`` does.

    Under every strategy: the canonical model state (full tensors, the module's own keys) is gathered to global rank 0
    by the strategy (``full_model_state()`` for the strategies of this package, whatever their ``state_dict_type``;
    ``lightning_module_state_dict()`` for Lightning's own), and rank 0 writes it shard by shard, converting one shard at
    a time, so no second full copy is held. Every rank learns whether the write succeeded, so a failed export raises
    on every rank instead of leaving the others waiting. An export already in ``dirpath`` is replaced; other files
    there (``config.json``) are kept. Nothing is written when ``fit`` ends with an exception.

    The options are checked on every rank when ``fit`` starts (``safetensors`` installed, ``submodule`` a submodule of
    the LightningModule, ``dirpath`` not a file), before any training.

    Args:
        dirpath: The directory to write ``model.safetensors`` (or its shards and index) into.
        submodule: Keep only this submodule's keys and strip its prefix (``"model"`` for ``self.model``).
        dtype: Convert floating-point tensors (``"bf16"``, ``"float16"``, ``torch.float32`` ...).
        max_shard_size: Largest file (``"5GB"``, ``"500MiB"``, bytes); past it the export is sharded.

    Attributes:
        written: What the last export wrote (on global rank 0; ``None`` elsewhere and before the end of ``fit``).

    Raises:
        ValueError: A bad ``dtype`` or ``max_shard_size`` (at construction).
    """

    def __init__(
        self,
        dirpath: str | Path,
        *,
        submodule: str | None = None,
        dtype: Any = None,
        max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.submodule = submodule
        self.dtype = parse_dtype(dtype)
        self.max_shard_size = parse_size(max_shard_size)
        self.written: Export | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_safetensors()
        if self.dirpath.exists() and not self.dirpath.is_dir():
            raise ValueError(f"SafetensorsExport: dirpath {str(self.dirpath)!r} is a file; give a directory.")
        if self.submodule:
            try:
                pl_module.get_submodule(self.submodule)
            except AttributeError:
                children = [name for name, _ in pl_module.named_children()]
                raise ValueError(
                    f"SafetensorsExport: {type(pl_module).__name__} has no submodule {self.submodule!r}; its"
                    f" submodules are {children}."
                ) from None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, not in on_fit_end: that runs after the strategy's teardown, when the process group may be gone.
        strategy = trainer.strategy
        if isinstance(strategy, DirectReferenceStrategy):
            state = strategy.full_model_state()  # full even when checkpoints are sharded
        else:
            state = strategy.lightning_module_state_dict()
        failure = ""
        if trainer.is_global_zero:
            try:
                self.written = write_safetensors(
                    state,
                    self.dirpath,
                    submodule=self.submodule,
                    dtype=self.dtype,
                    max_shard_size=self.max_shard_size,
                    tied_hints=tied_parameter_aliases(pl_module),
                    force=True,
                )
            except (CheckpointError, OSError, ValueError) as error:
                failure = f"{type(error).__name__}: {error}"
        del state
        failure = strategy.broadcast(failure, src=0)
        if failure:
            raise RuntimeError(f"SafetensorsExport: writing {str(self.dirpath)!r} on global rank 0 failed: {failure}")
