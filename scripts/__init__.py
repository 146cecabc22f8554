"""Maintainer scripts, run from the repository root: ``python scripts/NAME.py`` or ``python -m scripts.NAME``.

A package so that tests import what a script computes (``tests/test_upstream_findings.py`` runs the reproductions of
``scripts/upstream_findings.py``, the generator of ``docs/upstream-findings.md``) under one unambiguous name.
"""
