"""``python -m lightning_strategies.demo [options]``: an alias of ``lightning-strategies demo [options]``.

The demo itself lives with the command line, in ``lightning_strategies/cli/demo.py``; this module only keeps the
documented alias working.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``lightning-strategies demo`` with ``argv`` (default: this process's arguments)."""
    from .cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
