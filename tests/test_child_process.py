"""``in_a_child_process``: one-process fits of the resume matrix train in a child, so the caller never runs backward
(a CUDA build of torch refuses backward in a fork of a process that ran one; tests/support/fork_safety.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_strategies.testing.child import ChildProcessError, in_a_child_process
from lightning_strategies.testing.matrix import default_strategies, run_matrix

pytestmark = pytest.mark.flavour_independent


def test_returns_what_the_function_returned_in_the_child() -> None:
    assert in_a_child_process(lambda: (os.getpid(), {"loss": 0.5}))[1] == {"loss": 0.5}
    assert in_a_child_process(os.getpid) != os.getpid()


def test_a_result_json_cannot_carry_is_an_error_naming_it() -> None:
    with pytest.raises(ChildProcessError, match="not JSON serializable"):
        in_a_child_process(lambda: torch.ones(2))


def test_an_error_in_the_child_is_raised_here_ending_with_the_original_error() -> None:
    def fails() -> None:
        raise ValueError("key 'layer.weight' has shape (2, 3), expected (3, 2)")

    with pytest.raises(ChildProcessError) as raised:
        in_a_child_process(fails)

    assert str(raised.value).splitlines()[-1] == "ValueError: key 'layer.weight' has shape (2, 3), expected (3, 2)"
    assert "in fails" in str(raised.value)  # the child's traceback comes along


def test_a_child_that_dies_without_a_result_is_named_with_its_exit_code() -> None:
    with pytest.raises(ChildProcessError, match="exit code 7"):
        in_a_child_process(lambda: os._exit(7))


def test_the_resume_matrix_never_runs_backward_in_the_calling_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = os.getpid()
    backward_here = []
    original = torch.autograd.backward

    def counting(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() == pid:
            backward_here.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", counting)
    single = [strategy for strategy in default_strategies() if strategy.label == "single_device"]

    matrix = run_matrix(single, tmp_path)

    assert not matrix.failures, matrix.table()
    assert backward_here == []
    assert (tmp_path / "single_device" / "uninterrupted" / "epoch=1.ckpt").is_file()  # it did train, in the child
