"""The suite's guard against CUDA builds' unsafe forks (``tests/support/fork_safety.py``), checked on this CPU machine
through the emulation: each case runs in a fresh interpreter, so this session's torch stays unwrapped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support import fork_safety

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.flavour_independent


def _without_this_sessions_choices() -> dict[str, str]:
    """This process's environment without the suite's own variables (an emulated run of the suite, a forced isolation,
    the probe's answer): each case sets what it is about."""
    return {name: value for name, value in os.environ.items() if not name.startswith("LIGHTNING_STRATEGIES_")}


def _python(source: str, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {**_without_this_sessions_choices(), **environment}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


_FORK_AND_BACKWARD = textwrap.dedent("""
    import os, torch
    from tests.support import fork_safety
    fork_safety.emulate_bad_fork()
    def backward_in_a_fork():
        child = os.fork()
        if child == 0:
            try:
                torch.ones(2, requires_grad=True).sum().backward()
            except RuntimeError as error:
                os._exit(3 if "fork-based multiprocessing" in str(error) else 4)
            os._exit(0)
        return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
""")


def test_the_emulation_lets_a_fork_run_backward_while_its_parent_has_not() -> None:
    result = _python(_FORK_AND_BACKWARD + "print(backward_in_a_fork())")

    assert result.stdout.split() == ["0"], result.stderr


def test_the_emulation_refuses_backward_in_a_fork_of_a_process_that_ran_backward() -> None:
    result = _python(
        _FORK_AND_BACKWARD + "torch.ones(2, requires_grad=True).sum().backward(); print(backward_in_a_fork())"
    )

    assert result.stdout.split() == ["3"], result.stderr


def test_the_probe_answers_no_under_the_emulation() -> None:
    result = _python(
        "from tests.support import fork_safety; print(fork_safety.isolating_test_bodies())",
        LIGHTNING_STRATEGIES_EMULATE_BAD_FORK="1",
    )

    assert result.stdout.split() == ["True"], result.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="measured for the CPU wheel; CUDA builds fail the probe")
def test_the_probe_finds_forks_after_backward_safe_with_torchs_cpu_wheel() -> None:
    result = _python("from tests.support import fork_safety; print(fork_safety.fork_after_backward_works())")

    assert result.stdout.split() == ["True"], result.stderr


_TWO_TESTS = """
    import os, pytest, torch

    def test_trains_in_its_own_process(record_property):
        torch.ones(2, requires_grad=True).sum().backward()
        record_property("trained", "yes")

    def test_forks_a_rank_that_trains():
        child = os.fork()
        if child == 0:
            try:
                torch.ones(2, requires_grad=True).sum().backward()
            except BaseException:
                os._exit(3)
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0

    def test_skips_inside_its_body():
        pytest.skip("skipped in the body")
"""


def _pytest_with_the_suites_hooks(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_two.py").write_text(textwrap.dedent(_TWO_TESTS))
    env = {**_without_this_sessions_choices(), "LIGHTNING_STRATEGIES_EMULATE_BAD_FORK": "1", **environment}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-rs", "-p", "no:randomly"]
    return subprocess.run(
        [*command, "--rootdir", str(tmp_path), "-c", os.devnull, "-p", "no:xdist", str(tmp_path / "test_two.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_isolated_test_bodies_keep_the_pytest_process_able_to_fork_ranks_that_train(tmp_path: Path) -> None:
    result = _pytest_with_the_suites_hooks(tmp_path)

    assert "2 passed, 1 skipped" in result.stdout, result.stdout + result.stderr
    assert "skipped in the body" in result.stdout


def test_without_isolation_a_test_that_trained_breaks_the_forks_of_the_next(tmp_path: Path) -> None:
    result = _pytest_with_the_suites_hooks(tmp_path, LIGHTNING_STRATEGIES_FORK_ISOLATION="0")

    assert "1 failed, 1 passed, 1 skipped" in result.stdout, result.stdout + result.stderr


def test_a_failing_body_fails_its_test_with_the_bodys_traceback(tmp_path: Path) -> None:
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 + 1 == 3, 'arithmetic in the fork'\n")
    env = {**_without_this_sessions_choices(), fork_safety.ISOLATION_VARIABLE: "1"}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-p", "no:xdist", "-c", os.devnull]

    result = subprocess.run(
        [*command, "--rootdir", str(tmp_path), str(tmp_path / "test_fails.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert "1 failed" in result.stdout and "arithmetic in the fork" in result.stdout, result.stdout + result.stderr


def test_a_body_whose_fixture_started_a_process_group_runs_where_the_groups_threads_are(tmp_path: Path) -> None:
    (tmp_path / "test_group.py").write_text(
        textwrap.dedent(
            """
            import pytest, torch, torch.distributed as dist
            from tests.conftest import free_loopback_port

            @pytest.fixture
            def group():
                address = f"tcp://127.0.0.1:{free_loopback_port()}"
                dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
                yield
                dist.destroy_process_group()

            def test_all_reduce(group):
                tensor = torch.ones(2)
                dist.all_reduce(tensor)
                assert tensor.tolist() == [1.0, 1.0]
            """
        )
    )
    env = {**_without_this_sessions_choices(), fork_safety.ISOLATION_VARIABLE: "1"}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-p", "no:xdist", "-c", os.devnull]

    result = subprocess.run(
        [*command, "--timeout", "60", "--rootdir", str(tmp_path), str(tmp_path / "test_group.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert "1 passed" in result.stdout, result.stdout + result.stderr
