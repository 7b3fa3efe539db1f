"""Sphinx configuration: the API reference from the docstrings, the guides
and the Markdown pages of docs/ through MyST.

Build: ``python -m sphinx -W -n -b html docs docs/_build/html``. Nitpicky:
every cross reference must resolve, to this site or, through intersphinx,
to jax, optax, flax, numpy or Python, whose inventories are kept in
docs/inventories/ (``make.py`` there rewrites them) so that the build
reaches no network.
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
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "data", "inventories"]
root_doc = "index"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Defaults as written (``mu_dtype=jnp.float32``): a default's repr
# (``<class 'jax.numpy.float32'>``) does not parse, and the signature's
# Literal annotations would then be split at their commas.
autodoc_preserve_defaults = True
autodoc_default_options = {"exclude-members": "__init__, __new__"}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3

nitpicky = True
_INVENTORIES = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "inventories")
intersphinx_mapping = {
    name: (url, os.path.join(_INVENTORIES, f"{name}.inv"))
    for name, url in [
        ("python", "https://docs.python.org/3/"),
        ("numpy", "https://numpy.org/doc/stable/"),
        ("jax", "https://docs.jax.dev/en/latest/"),
        ("optax", "https://optax.readthedocs.io/en/latest/"),
        ("flax", "https://flax.readthedocs.io/en/latest/"),
    ]
}

html_theme = "furo"
html_title = f"dlion_jax {release}"


def _resolve(dotted):
  """The object ``dotted`` names, importing its module; None if none."""
  import importlib  # pylint: disable=g-import-not-at-top
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      obj = getattr(obj, part, None)
    return obj
  return None


def _documented_alias(app, env, node, contnode):
  """Resolves a reference to one of the library's objects by another name
  than the one its entry has: a re-export (``dlion_jax.wire_bits`` is
  documented as ``dlion_jax.accounting.wire_bits``, ``dl.parallel``'s
  placement helpers as ``dl.devices``' and the other way round), or a
  name relative to the module a docstring was written in."""
  if node.get("refdomain") != "py":
    return None
  target = node["reftarget"]
  module = node.get("py:module") or ""
  candidates = [target] + ([f"{module}.{target}"] if module else [])
  objects = [o for o in map(_resolve, candidates)
             if o is not None and (getattr(o, "__module__", None) or ""
                                   ).startswith("dlion_jax")]
  if not objects:
    return None
  domain = env.domains["py"]
  for name in domain.objects:
    if name.startswith("dlion_jax") and _resolve(name) is objects[0]:
      return domain.resolve_xref(env, node["refdoc"], app.builder,
                                 node["reftype"], name, node, contnode)
  return None


def setup(app):
  app.connect("missing-reference", _documented_alias)
