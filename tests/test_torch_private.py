"""torch's private names used by the package: a torch release that moves one costs one feature with a clear error."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from lightning_strategies import FSDP2Strategy
from lightning_strategies._torch_private import abort_process_group, composable_activation_checkpoint

MODULE = "torch.distributed._composable.checkpoint_activation"


def test_fsdp2_refuses_activation_checkpointing_with_the_fix_where_torch_moved_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, MODULE, None)  # `import` raises ImportError, as on a torch without the module

    assert composable_activation_checkpoint() is None
    with pytest.raises(ValueError, match=r"activation_checkpointing needs .*torch\.utils\.checkpoint"):
        FSDP2Strategy(activation_checkpointing=[torch.nn.Linear])
    FSDP2Strategy()  # the rest of the strategy is unaffected


def test_the_process_group_is_destroyed_where_torch_has_no_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed: list[bool] = []
    monkeypatch.delattr(c10d, "_abort_process_group", raising=False)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: destroyed.append(True))

    abort_process_group()

    assert destroyed == [True]


def test_the_process_group_is_aborted_where_torch_has_the_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    aborted: list[bool] = []
    monkeypatch.setattr(c10d, "_abort_process_group", lambda: aborted.append(True), raising=False)

    abort_process_group()

    assert aborted == [True]
