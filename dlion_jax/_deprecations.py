"""Names that moved to another module, kept at their old place for now.

A module lists its moved names and gets a module-level ``__getattr__``
(PEP 562) that imports each from its new module only when asked for, with a
:class:`DeprecationWarning` naming the new path (as optax deprecates its
names): the old module does not import the new one until then.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def moved(module: str, names: dict[str, str]) -> Callable[[str], Any]:
  """The ``__getattr__`` of ``module``, whose ``names`` (name -> the
  module it moved to, or ``"module:new_name"`` where it was renamed too)
  warn and are imported from their new place."""
  def getattr_(name: str) -> Any:
    if name not in names:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, _, new_name = names[name].partition(":")
    new_name = new_name or name
    warnings.warn(
        f"{module}.{name} is deprecated: use {new}.{new_name} (from "
        f"{new.rpartition('.')[0]} import {new.rpartition('.')[2]}).",
        DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(new), new_name)
  return getattr_
