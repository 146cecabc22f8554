"""Benchmarks of the strategies against hand-written PyTorch loops, on 2 CPU processes.

Run ``python -m benchmarks`` (``--smoke`` for a tiny, fast run; ``--docs`` to copy the plots into the docs). See
``docs/benchmarks.md`` for what each benchmark measures and its goal.
"""
