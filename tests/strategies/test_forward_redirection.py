"""ForwardRedirection runs a step through the wrapper's forward and always restores the module's forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_strategies import ForwardRedirection


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def training_step(self, x: Tensor) -> Tensor:
        return self(x).sum()  # a step that calls the real forward

    def failing_step(self, x: Tensor) -> Tensor:
        raise ValueError("step failed")


class RecordingWrapper(nn.Module):
    def __init__(self, module: nn.Module, fail_before: bool = False) -> None:
        super().__init__()
        self.inner = module
        self.fail_before = fail_before
        self.calls = 0

    def forward(self, *args: Any) -> Any:
        self.calls += 1
        if self.fail_before:
            raise RuntimeError("wrapper failed before reaching the module")
        return self.inner(*args)


def test_step_runs_inside_the_wrappers_forward() -> None:
    module = Module()
    wrapper = RecordingWrapper(module)
    x = torch.ones(1, 2)

    loss = ForwardRedirection()(wrapper, module, "training_step", x)

    assert wrapper.calls == 1
    assert torch.equal(loss, module.layer(x).sum())


def test_forward_is_the_class_method_again_after_the_step() -> None:
    module = Module()
    ForwardRedirection()(RecordingWrapper(module), module, "training_step", torch.ones(1, 2))

    assert "forward" not in vars(module)


def test_forward_is_restored_when_the_wrapper_raises_before_the_module() -> None:
    module = Module()
    with pytest.raises(RuntimeError, match=r"before reaching"):
        ForwardRedirection()(RecordingWrapper(module, fail_before=True), module, "training_step", torch.ones(1, 2))

    assert "forward" not in vars(module)
    assert module(torch.ones(1, 2)).shape == (1, 2)


def test_forward_is_restored_when_the_step_raises() -> None:
    module = Module()
    with pytest.raises(ValueError, match=r"step failed"):
        ForwardRedirection()(RecordingWrapper(module), module, "failing_step", torch.ones(1, 2))

    assert "forward" not in vars(module)


def test_a_forward_set_on_the_instance_is_kept() -> None:
    module = Module()

    def custom_forward(x: Tensor) -> Tensor:
        return x * 3

    vars(module)["forward"] = custom_forward
    ForwardRedirection()(RecordingWrapper(module), module, "training_step", torch.ones(1, 2))

    assert vars(module)["forward"] is custom_forward


def test_redirecting_forward_itself_is_refused() -> None:
    module = Module()
    with pytest.raises(ValueError, match=r"call the wrapper directly"):
        ForwardRedirection()(RecordingWrapper(module), module, "forward", torch.ones(1, 2))
