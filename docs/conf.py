"""Sphinx configuration of the docs site: the Markdown pages of docs/ with MyST, generated reference pages."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

from kernelmgr import __version__  # noqa: E402

project = "jupyter-elastic-kernels"
author = "The jupyter-elastic-kernels developers"
copyright = "2026, The jupyter-elastic-kernels developers"
release = __version__
version = __version__

extensions = ["myst_parser", "reference_pages"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# pypi.md is the package's long description on PyPI (absolute links), not a page of the site.
exclude_patterns = ["_build", "images/*.md", "pypi.md"]
# GitHub-style anchors, so links written for GitHub (`page.md#a-heading`) work on the site too.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

html_theme = "pydata_sphinx_theme"
html_title = "jupyter-elastic-kernels"
# The project URL, as in pyproject.toml and the chart's Chart.yaml (tests/test_project_urls.py).
REPOSITORY = "https://github.com/jupyter-elastic-kernels/jupyter-elastic-kernels"
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2, "github_url": REPOSITORY}
html_extra_path = ["openapi.yaml"]
# Links from a page to files outside docs/ (the chart's README, the examples) are for readers on
# GitHub; the site renders them as text. Links between pages are checked by tests/test_docs_map.py.
suppress_warnings = ["myst.xref_missing"]
