"""The differential fuzzer: drawn training recipes, run under upstream ``ddp`` and each of our strategies."""
