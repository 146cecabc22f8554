"""One zoo run per model per session: every test of a model reads the same report."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.zoo.harness import ModelReport, run_model
from tests.zoo.models import ZooModel

ZOO_TABLES: list[str] = []  # shown at the end of the run, after the resume matrix


@pytest.fixture(scope="session")
def zoo_report(tmp_path_factory: pytest.TempPathFactory) -> Callable[[ZooModel], ModelReport]:
    """Runs a model's whole zoo the first time one of its tests asks, and returns the same report after that."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # "loss_type=None ... Using the default loss", once per model built
    logging.getLogger("transformers").setLevel(logging.ERROR)
    reports: dict[str, ModelReport] = {}

    def report(model: ZooModel) -> ModelReport:
        if model.name not in reports:
            reports[model.name] = run_model(model, tmp_path_factory.mktemp(model.id))
            done = reports[model.name]
            ZOO_TABLES.append(f"{done.table()}\n({done.fits} fits in {done.seconds:.1f} s)")
        return reports[model.name]

    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for table in ZOO_TABLES:
        terminalreporter.write_sep("-", "model zoo")
        terminalreporter.write_line(table)
