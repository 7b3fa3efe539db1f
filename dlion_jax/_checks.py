"""Input checks shared by the transforms: each error names the argument, the
value it got and how to fix it."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
  """Raises a ValueError naming the option, the bad value and valid ones."""
  if not isinstance(value, str) or value not in valid:
    raise ValueError(
        f"Unknown {name}={value!r}. Valid values are: "
        f"{', '.join(repr(v) for v in valid)}.")


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf of ``tree`` is finite: a traced
  bool scalar (True for a tree with no leaves), the test of a worker's
  gradients that :func:`dlion_jax.apply_if_finite`, abstention and local
  steps' restart share."""
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x))
                            for x in jax.tree.leaves(tree)] + [True]))


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


def check_same_structure(updates: Any, mu: Any,
                         num_workers: int | None = None) -> None:
  """Raises a ValueError when gradients and the momentum differ in shape,
  saying how a momentum with an extra leading axis came about (given the
  ``num_workers`` of the vote's axis)."""
  u_def, m_def = jax.tree.structure(updates), jax.tree.structure(mu)
  if u_def != m_def:
    raise ValueError(
        "The gradient pytree does not match the optimizer state's momentum: "
        f"updates have structure {u_def}, state.mu has {m_def}. Call "
        "`init` on the same parameters whose gradients you pass to `update`.")
  for (path, g), m in zip(jax.tree_util.tree_leaves_with_path(updates),
                          jax.tree.leaves(mu)):
    if jnp.shape(g) != jnp.shape(m):
      extra = jnp.shape(m)[1:] == jnp.shape(g)
      raise ValueError(
          f"Gradient leaf {jax.tree_util.keystr(path)} has shape "
          f"{jnp.shape(g)} but its momentum has shape {jnp.shape(m)}. "
          + (_extra_axis(jnp.shape(m)[0], num_workers) if extra else
             "Call `init` on the same parameters whose gradients you pass "
             "to `update`."))


def _extra_axis(rows: int, num_workers: int | None) -> str:
  """Why a momentum has a leading axis of ``rows`` more than its gradient,
  and the fix."""
  if rows == 1 and (num_workers or 1) > 1:
    return ("The momentum has a leading axis of 1: this worker's block of "
            "a state stacked per worker, passed on without taking its row. "
            "In a step you write with jax.shard_map take the worker's own "
            "row before the update and put the axis back after it: state = "
            "jax.tree.map(lambda s: s[0], state), then "
            "jax.tree.map(lambda s: s[None], new_state) (as the README's "
            "step does); parallel.per_worker does it for arguments laid out "
            "\"stacked\".")
  every = (f"every worker's state stacked ({rows} rows, one per worker), "
           "seen whole by each worker" if rows == num_workers else
           f"{rows} rows")
  return (f"The momentum has an extra leading axis: {every}. Either the "
          "state is every worker's but reaches the update unsplit: give it "
          "to jax.shard_map with in_specs P(axis_name) and take the row "
          "s[0], or lay it out \"stacked\" (not \"replicated\") in "
          "parallel.per_worker; or it was built from params already "
          "stacked per worker (e.g. init_pmap_states given "
          "replicate_for_pmap's output): build it from one worker's params, "
          "init_pmap_states(tx, params) or init_worker_states(tx, params, "
          "mesh) with the unstacked params.")


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


def rate_problem(value: Any) -> str | None:
  """Why the number ``value`` is no decay rate of a momentum (outside
  ``[0, 1)``: negative, NaN, 1 or more), or None where it is one."""
  value = float(value)
  if math.isnan(value):
    return "NaN makes the momentum NaN, and every update after it"
  if value < 0:
    return ("a negative rate flips the sign of the momentum it carries over "
            "at every step")
  if value >= 1:
    return "at 1 or more the momentum grows without bound"
  return None


def decay_rate(name: str, value: Any, what: str, *, example: str) -> Any:
  """``value``, a number in ``[0, 1)``, as it is; a traced value
  (``optax.inject_hyperparams``) unchecked.

  Args:
    name: the argument, as the caller typed it.
    value: its value.
    what: what the rate is, for the message.
    example: a valid call, the fix the message gives (``"momentum=0.9"``).

  Raises:
    ValueError: naming the argument, the value, what it means, why it is
      no rate (a bool or a non-scalar is none either) and ``example``.
  """
  if isinstance(value, jax.core.Tracer):
    return value
  fix = f"Pass a number in [0, 1), e.g. {example}."
  try:
    number = value is not None and not isinstance(
        value, (bool, np.bool_, str)) and not np.ndim(
        value) and np.issubdtype(jnp.result_type(value), np.number)
  except TypeError:   # None, or an object with no dtype
    number = False
  if not number:
    raise ValueError(f"{name} must be a number in [0, 1) ({what}), got "
                     f"{name}={value!r}. {fix}")
  why = rate_problem(value)
  if why:
    raise ValueError(f"{name} must be in [0, 1) ({what}), got "
                     f"{name}={value!r}: {why}. {fix}")
  return value


def flag(name: str, value: Any, what: str) -> bool:
  """``value``, a Python or numpy bool, as a bool.

  Raises:
    ValueError: naming the argument, the value and what the flag does (a
      traced value or a string is no flag: the option shapes the program).
  """
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(f"{name} must be True or False ({what}), got "
                   f"{name}={value!r}.")


def masked_out(params: Any, state: Any) -> list[str] | None:
  """The leaves of ``params`` (key paths) that an ``optax.masked`` in
  ``state``, their optimizer's state, leaves out: ``optax.masked`` passes
  their updates through unchanged. None where ``state`` holds no
  ``optax.masked`` but those of ``optax.multi_transform`` (which gives every
  leaf a transform); empty where the masked state does not say which
  leaves (one around ``optax.sgd``, which keeps no state a leaf)."""
  partitions = tuple(getattr(optax, name) for name in (
      "PartitionState", "MultiTransformState") if hasattr(optax, name))
  masks = []

  def mask_or_partition(x):
    if isinstance(x, optax.MaskedState):
      masks.append(x)
    return isinstance(x, (optax.MaskedState, *partitions))
  jax.tree.leaves(state, is_leaf=mask_or_partition)
  if not masks:
    return None
  node = lambda x: isinstance(x, optax.MaskedNode)
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in
           jax.tree_util.tree_leaves_with_path(params, is_leaf=node)]
  like = jax.tree.structure(params, is_leaf=node)
  out = [False] * len(paths)

  def mark(x):    # a tree of params' structure, MaskedNode where left out
    if jax.tree.structure(x, is_leaf=node) != like:
      return False
    for i, leaf in enumerate(jax.tree.leaves(x, is_leaf=node)):
      out[i] = out[i] or node(leaf)
    return True
  for mask in masks:
    jax.tree.leaves(mask.inner_state, is_leaf=mark)
  return [path for path, left in zip(paths, out) if left]


def masked_note(params: Any, state: Any, drifting: list[str]) -> str:
  """Where an ``optax.masked`` in ``state`` leaves some of the ``drifting``
  params leaves out, what it does to them and how to freeze them."""
  left_out = [path for path in masked_out(params, state) or ()
              if path in drifting]
  if not left_out:
    return ""
  return (f" optax.masked leaves {', '.join(left_out)} out and passes each "
          "worker's own gradient for them through unchanged: it does not "
          "freeze them. To freeze them, give them optax.set_to_zero(): "
          "optax.multi_transform({'train': tx, 'frozen': "
          "optax.set_to_zero()}, labels).")


def masked_cause(left_out: list[str], axis_name) -> str:
  """Why an anchor differs by worker where ``optax.masked`` leaves the
  leaves ``left_out`` (key paths of the params) out of an outer optimizer
  that exchanges over ``axis_name``, and the fix."""
  leaves = ", ".join(left_out) if left_out else "some leaves"
  return (
      f"the outer optimizer exchanges over axis {axis_name!r}, but "
      f"optax.masked leaves {leaves} out of it and passes each worker's own "
      "pseudo-gradient for them through unchanged (as it passes each "
      "worker's own gradient in an inner optimizer): optax.masked does not "
      "freeze what it leaves out. To freeze them, give them "
      "optax.set_to_zero() in the inner and the outer optimizer: "
      "optax.multi_transform({'train': tx, 'frozen': optax.set_to_zero()}, "
      "labels), or optax.chain(optax.masked(tx, mask), optax.masked("
      "optax.set_to_zero(), frozen_mask)); to train them, give them an "
      f"outer optimizer that exchanges over {axis_name!r}.")
