"""Sphinx configuration: the API reference from the docstrings, the guides
and the Markdown pages of docs/ through MyST.

Build: ``python -m sphinx -W -b html docs docs/_build/html``.
"""

import importlib.metadata
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "dlion_jax"
author = "the dlion_jax authors"
copyright = "2026, the dlion_jax authors"  # noqa: A001 (Sphinx's name)
release = importlib.metadata.version("dlion_jax")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "data"]
root_doc = "index"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"dlion_jax {release}"
