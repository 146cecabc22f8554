"""``python -m tests.zoo [--out docs/resume-matrix.md] [--model NAME]``: runs the zoo and writes its docs tables.

Exit code 1 when a check failed (the tables are written all the same).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import free_loopback_port


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="resume-matrix page whose zoo section to write (default: print)")
    parser.add_argument("--model", action="append", help="only this model (repeatable), e.g. gpt2")
    args = parser.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_loopback_port()), GLOO_SOCKET_IFNAME="lo")
    import transformers

    from tests.zoo.harness import docs_section, run_model, write_docs_section
    from tests.zoo.models import ZOO

    transformers.logging.set_verbosity_error()
    for name in ("pytorch_lightning", "lightning_fabric", ""):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    reports = []
    for model in ZOO:
        if args.model and model.name not in args.model and model.id not in args.model:
            continue
        with tempfile.TemporaryDirectory() as workdir:
            reports.append(run_model(model, Path(workdir)))
        print(f"{reports[-1].table()}\n", flush=True)
    section = docs_section(reports)
    print(section)
    if args.out:
        write_docs_section(args.out, section)
    return 1 if any(report.failures for report in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
