"""``python -m benchmarks``: runs every benchmark and writes JSON and plots."""

from benchmarks.run import main

if __name__ == "__main__":
    main()
