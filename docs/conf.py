"""Sphinx configuration: the guides (Markdown, through MyST) and the API reference, built from
the docstrings by autodoc. ``make docs`` builds it with warnings as errors."""

from __future__ import annotations

project = "airflow-broker"
author = "airflow-broker"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# The engine's docstrings are reStructuredText with Sphinx roles; the signatures carry the types.
autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Headings of the guides get anchors, so "page.md#a-heading" links resolve.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "airflow-broker"
