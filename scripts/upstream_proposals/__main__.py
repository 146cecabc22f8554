"""``python -m scripts.upstream_proposals --out docs/upstream-proposals.md``."""

from scripts.upstream_proposals import main

main()
