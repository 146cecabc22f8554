"""``python -m lightning_strategies``: the ``lightning-strategies`` command line (see ``lightning_strategies.cli``)."""

from .cli import main

raise SystemExit(main())
