"""Sphinx configuration of durable's documentation (Markdown pages, read by MyST)."""

from __future__ import annotations

import re
from pathlib import Path

_init = (Path(__file__).resolve().parent.parent / "durable" / "__init__.py").read_text()
release = re.search(r'^__version__ = "([^"]+)"', _init, re.M).group(1)  # type: ignore[union-attr]
version = release

project = "durable"
author = "durable contributors"
copyright = "durable contributors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Headings up to level 3 get anchors, so pages can link to a section: page.md#section.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

html_theme = "alabaster"
html_title = f"durable {release}"
