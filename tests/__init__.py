"""The test suite, laid out as the package is (``docs/design.md``, "Layout"). Where a new test file goes:

- ``tests/strategies/``: how the strategies behave when they run: training against upstream ``ddp``, recipes,
  optimizers, precision, launchers, ranks that fail or disagree, preemption, hand-back, each strategy's own tests.
- ``tests/checkpoint/``: what is saved and loaded: the format, canonical model and optimizer state, atomic and sharded
  saves and their safety, bad and unsafe checkpoints, interop with upstream's checkpoints, checkpoint I/O plugins.
- ``tests/cli/``: the ``lightning-strategies`` command (``inspect``, ``convert``, ``consolidate``, ``export``, the
  demo).
- Here, at the top: only tests that span the rooms: the docs' examples and pages, ``dev.py``, the scripts, the
  differential fuzzer, the benchmarks' smoke run, and the greps over the whole package (private names, backend homes,
  no unwrapping).
- ``tests/support/``: shared code that is not a test (helpers, forked ranks, deliberately broken strategies, the
  flavour of Lightning, upstream runs, hypothesis settings); imported as ``tests.support.NAME``. Fixtures stay in
  ``conftest.py``, which pytest needs here.
- ``tests/both_packages`` (run under both Lightning packages), ``tests/fuzz`` (the fuzzer), ``tests/gpu``,
  ``tests/zoo`` and ``tests/scripts`` (scripts the tests start as processes) keep their own purpose.

A test that fits two rooms goes where what it asserts lives: a strategy's training result -> ``strategies``; bytes on
disk or a refused load -> ``checkpoint``. Generators of docs pages are not tests: they live in ``scripts/`` (the zoo's
tables stay with ``tests/zoo``, which is both). Every folder is a package (``__init__.py``): spawned ranks import
test modules by dotted name.
"""

import os

# Forked workers must not inherit a busy OpenMP pool (libgomp is not fork-safe: a one-process fork run then hangs in
# its first parallel op). Set here, before anything of the suite imports torch, so OpenMP starts with one thread and
# torch's thread pools are never resized in the process the ranks fork from (tests/conftest.py). Also the fastest on
# 2 cores.
os.environ["OMP_NUM_THREADS"] = "1"
