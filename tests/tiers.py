"""A parametrized test's share of the CI tier: a few cases run in
``-m "not slow"``, the rest in the slow tier (``-m slow`` runs them)."""

import pytest
from _pytest.mark import ParameterSet


def slow_but(cases, *fast: int, one: bool = False) -> list:
  """``cases`` (a parametrize list) with every case whose index is not in
  ``fast`` marked slow; ``one``: a single argument, each case one value."""
  out = []
  for i, case in enumerate(cases):
    marks = () if i in fast else (pytest.mark.slow,)
    if isinstance(case, ParameterSet):
      out.append(pytest.param(*case.values, id=case.id,
                              marks=(*case.marks, *marks)))
    else:
      values = (case,) if one or not isinstance(case, tuple) else case
      out.append(pytest.param(*values, marks=marks))
  return out
