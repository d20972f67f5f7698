"""Sphinx configuration (MyST markdown, furo theme). Build: ``make docs`` (warnings are errors)."""

from __future__ import annotations

import reliable_beat

project = "reliable_beat"
author = "reliable_beat developers"
release = reliable_beat.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.intersphinx"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "furo"
exclude_patterns = ["_build"]
intersphinx_mapping: dict[str, tuple[str, None]] = {}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
suppress_warnings = ["myst.xref_missing", "myst.header", "docutils", "autodoc", "ref.python"]
nitpicky = False
