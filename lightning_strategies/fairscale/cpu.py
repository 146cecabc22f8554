"""Scoped CPU support for fairscale 0.4.13 ``FullyShardedDataParallel`` (gloo), for development and tests.

fairscale FSDP assumes CUDA: it creates its streams only when CUDA exists and then fails with ``KeyError:
'all_gather'``, records tensors on streams, synchronises the device, moves norms to the GPU, uses a collective gloo
rejects, and on CPU its optimizer-state gather silently returns ``exp_avg == exp_avg_sq``. The patches below fix
exactly that. They are applied only where CUDA is absent, only while a strategy runs (``install`` in the worker's
``setup_environment``, ``uninstall`` at teardown), and nested installs are counted so the last ``uninstall`` restores
every original. Each patch has a test that fails without it. The fairscale functions replaced are named in
:mod:`lightning_strategies.fairscale._private`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel

from lightning_strategies.fairscale._private import CPU_PATCH_TARGETS, STREAM_NAMES, is_root, streams


class _HostStream:
    """Plays every CUDA stream on the CPU: waiting and synchronising have nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """No-op: CPU work is already ordered."""

    def synchronize(self) -> None:
        """No-op: CPU work is already complete."""

    def __repr__(self) -> str:
        return "_HostStream()"


HOST_STREAM = _HostStream()


class _NormOnHost(torch.Tensor):
    """A norm tensor whose ``.cuda()`` stays on the host (``FSDP.clip_grad_norm_`` calls it unconditionally)."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


_original_setup_streams = getattr(*CPU_PATCH_TARGETS["setup_streams"])
_original_record_stream = torch.Tensor.record_stream
_original_calc_grad_norm = getattr(*CPU_PATCH_TARGETS["calc_grad_norm"])
_original_gather_optim_state = getattr(*CPU_PATCH_TARGETS["gather_optim_state"])


def _host_streams_too(self: FullyShardedDataParallel) -> None:
    _original_setup_streams(self)
    if is_root(self):  # children share the root's dict, so filling it once serves all of them
        for name in STREAM_NAMES:
            streams(self).setdefault(name, HOST_STREAM)


def _current_stream(device: Any = None) -> _HostStream:
    return HOST_STREAM


def _synchronize(device: Any = None) -> None:
    return None


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    if self.device.type != "cpu":
        _original_record_stream(self, stream)


def _calc_grad_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
    norm: torch.Tensor = _original_calc_grad_norm(*args, **kwargs)
    return norm.as_subclass(_NormOnHost)


def _gather_optim_state_one_key_at_a_time(
    self: FullyShardedDataParallel, sd_state: dict[int, dict[str, Any]]
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    # The original gathers every tensor state of a parameter into one shared buffer and keeps `.cpu()` of it, which
    # on the CPU is the buffer itself: the last key gathered overwrites the others. One key per call keeps them apart.
    gathered: dict[int, dict[str, Any]] = {index: {} for index in sd_state}
    singletons: dict[int, dict[str, Any]] = {index: {} for index in sd_state}
    names = dict.fromkeys(name for state in sd_state.values() for name in state)  # same order on every rank
    for name in names:
        part, part_singletons = _original_gather_optim_state(
            self, {index: {name: state[name]} for index, state in sd_state.items() if name in state}
        )
        for index in part:
            gathered[index].update(part[index])
            singletons[index].update(part_singletons[index])
    return gathered, singletons


def _pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@dataclass(frozen=True)
class Patch:
    """One replacement: ``target.attribute = replacement`` while installed.

    Attributes:
        name: Short name used by tests to leave it out.
        target: Object whose attribute is replaced.
        attribute: Attribute name.
        replacement: The value installed.
        why: What fails without it.
    """

    name: str
    target: Any
    attribute: str
    replacement: Any
    why: str


PATCHES: tuple[Patch, ...] = (
    Patch("setup_streams", *CPU_PATCH_TARGETS["setup_streams"], _host_streams_too, "KeyError: 'all_gather'"),
    Patch("current_stream", torch.cuda, "current_stream", _current_stream, "asserts current stream == post_backward"),
    Patch("record_stream", torch.Tensor, "record_stream", _record_stream, "aten::record_stream has no CPU kernel"),
    Patch("synchronize", torch.cuda, "synchronize", _synchronize, "summon_full_params and local loads need CUDA"),
    Patch(
        "calc_grad_norm",
        *CPU_PATCH_TARGETS["calc_grad_norm"],
        _calc_grad_norm,
        "clip_grad_norm_ moves the norm to CUDA",
    ),
    Patch(
        "list_collectives",
        *CPU_PATCH_TARGETS["list_collectives"],
        False,
        "gloo rejects the reduce-scatter bucket's 2-D input",
    ),
    Patch(
        "gather_optim_state",
        *CPU_PATCH_TARGETS["gather_optim_state"],
        _gather_optim_state_one_key_at_a_time,
        "gathered exp_avg == exp_avg_sq",
    ),
)
PIN_MEMORY_PATCH = Patch("pin_memory", torch.Tensor, "pin_memory", _pin_memory, "pinning needs an accelerator")

_ABSENT = object()


def _replace(patch: Patch) -> Callable[[], None]:
    """Installs one patch; returns what undoes it (an attribute the target only inherited is deleted again)."""
    own = vars(patch.target).get(patch.attribute, _ABSENT)
    setattr(patch.target, patch.attribute, patch.replacement)

    def restore() -> None:
        if own is _ABSENT:
            delattr(patch.target, patch.attribute)
        else:
            setattr(patch.target, patch.attribute, own)

    return restore


class _Installation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._stack: ExitStack | None = None

    def install(self, *, pin_memory: bool = False, skip: frozenset[str] = frozenset()) -> bool:
        with self._lock:
            if torch.cuda.is_available():
                return False
            if self._depth == 0:
                stack = ExitStack()
                chosen = PATCHES + ((PIN_MEMORY_PATCH,) if pin_memory else ())
                for patch in chosen:
                    if patch.name not in skip:
                        stack.callback(_replace(patch))  # undone in reverse order when the stack closes
                self._stack = stack
            self._depth += 1
            return True

    def uninstall(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0 and self._stack is not None:
                self._stack.close()
                self._stack = None

    @property
    def active(self) -> bool:
        return self._depth > 0


_INSTALLATION = _Installation()


def install(*, pin_memory: bool = False, skip: frozenset[str] = frozenset()) -> bool:
    """Applies the CPU patches unless CUDA is available; counts nested installs.

    Args:
        pin_memory: Also make ``Tensor.pin_memory`` an identity (for ``cpu_offload``/``move_grads_to_cpu``).
            Only the first, outermost install chooses the set.
        skip: Names of patches to leave out (for tests that show what each patch fixes).

    Returns:
        Whether the patches are (now) installed; ``False`` on a machine with CUDA.
    """
    return _INSTALLATION.install(pin_memory=pin_memory, skip=skip)


def uninstall() -> None:
    """Undoes one :func:`install`; the last one restores every original."""
    _INSTALLATION.uninstall()


def is_installed() -> bool:
    """Whether the CPU patches are currently applied."""
    return _INSTALLATION.active


@contextmanager
def fairscale_cpu_support(*, pin_memory: bool = False, skip: frozenset[str] = frozenset()) -> Iterator[bool]:
    """Context manager form of :func:`install`/:func:`uninstall`; yields whether patches are applied."""
    installed = install(pin_memory=pin_memory, skip=skip)
    try:
        yield installed
    finally:
        if installed:
            uninstall()


def patch_names() -> list[str]:
    """Names of all patches, the optional pin-memory one last."""
    return [patch.name for patch in PATCHES] + [PIN_MEMORY_PATCH.name]
