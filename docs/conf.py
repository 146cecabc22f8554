"""Sphinx configuration: MyST Markdown pages plus autodoc from the Google-style docstrings.

Built with warnings as errors by ``python3 dev.py test`` (``sphinx-build -W``), so a broken reference fails CI.
"""

from __future__ import annotations

import lightning_strategies

project = "lightning_strategies"
author = "lightning_strategies developers"
copyright = "2026, lightning_strategies developers"
release = lightning_strategies.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Overridden Lightning hooks would otherwise show Lightning's own docstrings (with roles only its docs define).
autodoc_inherit_docstrings = False
# Lightning's and torch's own classes are not documented here: references to them stay plain text.
autodoc_mock_imports: list[str] = []
html_theme = "alabaster"
html_static_path = ["_static"]
