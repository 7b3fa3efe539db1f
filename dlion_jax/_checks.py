"""Input checks shared by the transforms: each error names the argument, the
value it got and how to fix it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
  """Raises a ValueError naming the option, the bad value and valid ones."""
  if not isinstance(value, str) or value not in valid:
    raise ValueError(
        f"Unknown {name}={value!r}. Valid values are: "
        f"{', '.join(repr(v) for v in valid)}.")


def check_float_leaves(tree: Any, what: str) -> None:
  """Raises a TypeError naming the first leaf that is not floating point."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    try:
      dtype = jnp.result_type(leaf)
    except TypeError:
      dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      name = jax.tree_util.keystr(path) or "<root>"
      kind = dtype if dtype is not None else type(leaf).__name__
      raise TypeError(
          f"{what} leaf {name} has dtype {kind}; distributed Lion only "
          "updates floating-point leaves. Keep integer/bool state out of the "
          "optimized pytree, or exclude it with optax.masked / "
          "optax.partition.")


def check_same_structure(updates: Any, mu: Any) -> None:
  """Raises a ValueError when gradients and the momentum differ in shape."""
  u_def, m_def = jax.tree.structure(updates), jax.tree.structure(mu)
  if u_def != m_def:
    raise ValueError(
        "The gradient pytree does not match the optimizer state's momentum: "
        f"updates have structure {u_def}, state.mu has {m_def}. Call "
        "`init` on the same parameters whose gradients you pass to `update`.")
  for (path, g), m in zip(jax.tree_util.tree_leaves_with_path(updates),
                          jax.tree.leaves(mu)):
    if jnp.shape(g) != jnp.shape(m):
      stacked = jnp.shape(m)[1:] == jnp.shape(g)
      raise ValueError(
          f"Gradient leaf {jax.tree_util.keystr(path)} has shape "
          f"{jnp.shape(g)} but its momentum has shape {jnp.shape(m)}. "
          + ("The momentum has an extra leading axis: the state was built "
             "from params already stacked per worker (e.g. init_pmap_states "
             "given replicate_for_pmap's output). Build it from one "
             "worker's params: init_pmap_states(tx, params) or "
             "init_worker_states(tx, params, mesh) with the unstacked "
             "params." if stacked else
             "Call `init` on the same parameters whose gradients you pass "
             "to `update`."))


def static_int(name: str, value: Any) -> Any:
  """``value`` as a Python int when it is a concrete integer, else as is.

  Options such as ``bits`` shape the message, so they must be known when
  the step is traced. :func:`optax.inject_hyperparams` turns numeric
  options into arrays (traced inside ``jit``): say how to keep them static.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a Python int known when the step is traced, got a "
        f"traced {value.dtype} array. Under optax.inject_hyperparams list it "
        f"in static_args, e.g. static_args=({name!r},).")
  if (isinstance(value, (jax.Array, np.ndarray, np.integer)) and
      jnp.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value),
                                              jnp.integer)):
    return int(value)
  return value


def positive_int(name: str, value: Any, what: str | None = None) -> int:
  """``value`` as an int >= 1 (numpy integers too, never a bool).

  Raises:
    ValueError: naming the argument and the value (and, given ``what``,
      what the number means).
  """
  value = static_int(name, value)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    meaning = f" ({what})" if what else ""
    raise ValueError(
        f"{name} must be a positive int{meaning}, got {name}={value!r}.")
  return value
