"""Elastic runs: a run's per-worker optimizer states, from N workers to N'.

Distributed Lion keeps a momentum per worker (and with error feedback a
residual per worker): the state :func:`dlion_jax.parallel.init_worker_states`
stacks has a row per worker (per node on a hybrid mesh). A run that resumes
on another number of workers needs N' rows made of the N it saved. Each new
row is built from the old rows it takes over:

* ``"mean"``: fewer workers each take the mean of a contiguous group of the
  old ones (8 -> 4: pairs); more workers each take a copy of the old
  worker whose place they fill (4 -> 8: each momentum twice);
* ``"all"``: every new worker takes the mean of all N;
* ``"keep"``: new worker ``j`` takes old worker ``j mod N``'s (8 -> 4: the
  first four kept, the others dropped; 4 -> 8 as ``"mean"``, in a cycle).

Leaves shaped like a param are the momenta (and, with error feedback, the
residuals: ``error="clear"`` zeroes those instead of mapping them, as
DeepSpeed's 1-bit Adam does on every load). Every other leaf (step
counts, schedules' states) is the same on every worker and keeps the
first old row. N' = N returns the state as it is, bit for bit.
docs/training.md ("Resuming on another number of workers") measures the
policies; ``"mean"`` is the default.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import devices
from dlion_jax import lion
from dlion_jax import parallel
from dlion_jax._checks import check_choice

RESIZE_POLICIES = ("mean", "all", "keep")
ERROR_POLICIES = ("map", "clear")


def old_rows(num_old: int, num_new: int, policy: str = "mean"
             ) -> list[list[int]]:
  """For each of ``num_new`` workers, the old workers' rows it takes (the
  mean of them).

  Example:
    >>> from dlion_jax import elastic
    >>> elastic.old_rows(8, 4)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> elastic.old_rows(4, 8)
    [[0], [0], [1], [1], [2], [2], [3], [3]]
    >>> elastic.old_rows(3, 2, "keep")
    [[0], [1]]
  """
  check_choice("policy", policy, RESIZE_POLICIES)
  for name, n in (("num_old", num_old), ("num_new", num_new)):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"{name} must be a positive int (workers), got "
                       f"{name}={n!r}.")
  if policy == "all":
    return [list(range(num_old))] * num_new
  if policy == "keep" or num_new > num_old:
    if policy == "keep":
      return [[j % num_old] for j in range(num_new)]
    return [[j * num_old // num_new] for j in range(num_new)]
  return [list(range(j * num_old // num_new, (j + 1) * num_old // num_new))
          for j in range(num_new)]


def describe(num_old: int, num_new: int, policy: str = "mean",
             error: str = "map", *, unit: str = "worker") -> str:
  """What resizing does, in a few words (the CLI prints it); ``unit``
  names what a row is (``"node"`` on a hybrid mesh).

  Example:
    >>> from dlion_jax import elastic
    >>> elastic.describe(8, 4)
    'momenta averaged in pairs'
    >>> elastic.describe(4, 8)
    'each momentum copied to 2 workers'
    >>> elastic.describe(2, 4, unit="node")
    'each momentum copied to 2 nodes'
  """
  groups = old_rows(num_old, num_new, policy)
  sizes = {len(g) for g in groups}
  units = f"{unit}s"
  if num_old == num_new:
    text = "momenta kept"
  elif policy == "all":
    text = f"every {unit} given the mean of the {num_old} momenta"
  elif sizes == {1}:
    copies = {sum(1 for g in groups if g == [i]) for i in range(num_old)}
    text = (f"momenta of the first {num_new} {units} kept"
            if num_new < num_old else
            f"each momentum copied to {copies.pop()} {units}"
            if len(copies) == 1 else f"momenta copied to the new {units}")
  elif sizes == {2}:
    text = "momenta averaged in pairs"
  elif len(sizes) == 1:
    text = f"momenta averaged in groups of {sizes.pop()}"
  else:
    text = f"momenta averaged in groups of {min(sizes)} or {max(sizes)}"
  if error == "clear":
    text += ", error feedback cleared"
  return text


def _kinds(tx, state: Any, params: Any, error: str) -> Any:
  """For each state leaf: ``"map"`` (a momentum or residual), ``"clear"``
  (an error-feedback residual, cleared) or ``"first"`` (alike on every
  worker)."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  hole = lambda leaf, value: leaf if masked(leaf) else value
  try:
    param_like = optax.tree_utils.tree_map_params(
        tx, lambda leaf, param: hole(leaf, True), state, params,
        transform_non_params=lambda leaf: hole(leaf, False),
        is_leaf=masked)
  except (ValueError, TypeError):
    # A state optax cannot map param-shaped leaves of: by shape and dtype.
    shapes = {np.shape(x) for x in jax.tree.leaves(params)}
    param_like = jax.tree.map(
        lambda leaf: np.shape(leaf)[1:] in shapes and jnp.issubdtype(
            jnp.result_type(leaf), jnp.inexact), state)
  residual = jax.tree.map(
      lambda node: node._replace(
          count=jax.tree.map(lambda _: False, node.count),
          mu=jax.tree.map(lambda _: False, node.mu),
          error=jax.tree.map(lambda _: True, node.error))
      if isinstance(node, lion.ErrorFeedbackState) else
      jax.tree.map(lambda _: False, node), state,
      is_leaf=lambda x: isinstance(x, lion.ErrorFeedbackState))

  def kind(mapped, is_residual):
    if error == "clear" and is_residual:
      return "clear"
    return "map" if mapped else "first"
  return jax.tree.map(kind, param_like, residual)


def _target_shardings(tx, params, mesh, axis_name, shard_axis) -> Any:
  """Where :func:`dlion_jax.parallel.init_worker_states` puts ``tx``'s
  state for ``params`` on ``mesh``."""
  shape = jax.eval_shape(
      lambda p: parallel.init_worker_states(tx, p, mesh, axis_name=axis_name,
                                            shard_axis=shard_axis), params)
  try:
    return shape, parallel.state_shardings(tx, shape, params, mesh,
                                           axis_name, shard_axis=shard_axis)
  except (ValueError, TypeError):
    return shape, jax.tree.map(
        lambda _: NamedSharding(mesh, P(axis_name)), shape)


def _check_state(state: Any, shape: Any) -> int:
  """The rows of ``state``; raises a ValueError naming what differs from
  the state ``tx`` makes for the params."""
  leaves = jax.tree.leaves(state)
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(rows) != 1 or None in rows:
    raise ValueError(
        f"state must be stacked for its workers, every leaf on a leading "
        f"axis of the same size; its leaves lead with {sorted(rows, key=str)}"
        ". Pass the state init_worker_states (or a checkpoint of one) made.")
  if jax.tree.structure(state) != jax.tree.structure(shape) or any(
      np.shape(x)[1:] != y.shape[1:] or jnp.result_type(x) != y.dtype
      for x, y in zip(leaves, jax.tree.leaves(shape))):
    theirs = [(np.shape(x)[1:], str(jnp.result_type(x))) for x in leaves]
    ours = [(y.shape[1:], str(y.dtype)) for y in jax.tree.leaves(shape)]
    raise ValueError(
        "state is not the state tx makes for params: its rows' leaves are "
        f"{theirs[:4]}{' ...' if len(theirs) > 4 else ''}, tx's for these "
        f"params {ours[:4]}{' ...' if len(ours) > 4 else ''}. Resize with "
        "the optimizer (and its options) and the params of the run that "
        "wrote the state.")
  return rows.pop()


def resize_worker_states(tx: optax.GradientTransformation, state: Any,
                         params: Any, mesh: Mesh, *,
                         axis_name: str = "data",
                         shard_axis: str | None = None,
                         policy: str = "mean", error: str = "map") -> Any:
  """``state``, stacked for N workers, as the stacked state of the workers
  of ``axis_name`` on ``mesh`` (N'), placed as
  :func:`dlion_jax.parallel.init_worker_states` places it.

  A group's mean is its rows summed in order in float32 (or wider), times
  ``1/k``, rounded once to the rows' dtype; where every row of a group
  holds the same value (a global optimizer's state, a schedule's step),
  that value is kept, bit for bit.

  Args:
    tx: the optimizer the state is of.
    state: every leaf with a leading axis of the N old workers, on any
      devices (a checkpoint's restores onto ``mesh`` with
      :func:`restore_target`).
    params: the params, placed on ``mesh`` as the new run places them.
    mesh: the new mesh.
    axis_name: the workers' axis (the vote's) on ``mesh``.
    shard_axis: the fast axis of a hybrid step (its state is sharded over
      it), as given to ``init_worker_states``.
    policy: how each new worker's momentum is made of the old ones (the
      module docstring): ``"mean"``, ``"all"`` or ``"keep"``.
    error: ``"map"`` error-feedback residuals like the momenta, or
      ``"clear"`` them (also when N' = N).

  Returns:
    The state with N' rows, placed on ``mesh``; at N' = N the same values.

  Raises:
    ValueError: naming ``policy``, ``error`` or ``axis_name`` when not one
      of their choices; a state not stacked, or not of ``tx`` for
      ``params``.

  Example:
    >>> import jax.numpy as jnp, dlion_jax as dl
    >>> from dlion_jax import elastic, parallel
    >>> tx = dl.distributed_lion(1e-3, axis_name="data")
    >>> big, small = parallel.data_mesh(2), parallel.data_mesh(1)
    >>> p = parallel.replicate({"w": jnp.zeros(3)}, big)
    >>> state = parallel.init_worker_states(tx, p, big)
    >>> state = elastic.resize_worker_states(
    ...     tx, state, parallel.replicate({"w": jnp.zeros(3)}, small), small)
    >>> state[0].mu["w"].shape
    (1, 3)
  """
  check_choice("policy", policy, RESIZE_POLICIES)
  check_choice("error", error, ERROR_POLICIES)
  num_new = devices.axis_size(mesh, axis_name)
  shape, shardings = _target_shardings(tx, params, mesh, axis_name,
                                       shard_axis)
  num_old = _check_state(state, shape)
  groups = old_rows(num_old, num_new, policy)
  kinds = _kinds(tx, state, params, error)
  # Onto the new mesh's devices first (a no-op for a state restored there).
  state = jax.device_put(state, jax.tree.map(
      lambda x: x.sharding, restore_target(
          tx, params, mesh, num_old, axis_name=axis_name,
          shard_axis=shard_axis)))

  def one(leaf, kind):
    new = (num_new,) + leaf.shape[1:]
    if kind == "clear":
      return jnp.zeros(new, leaf.dtype)
    if kind == "first":
      return jnp.broadcast_to(leaf[:1], new)
    if num_old == num_new:
      return leaf
    return jnp.stack([_mean(leaf, g) for g in groups])
  return jax.jit(lambda s: jax.tree.map(one, s, kinds),
                 out_shardings=shardings)(state)


def _mean(rows: jax.Array, group: list[int]) -> jax.Array:
  """The mean of ``rows[group]``: summed in order in float32 (or wider),
  times ``1/k``, rounded once to the rows' dtype; one row as it is, and
  where the group's rows agree, their value."""
  first = rows[group[0]]
  if len(group) == 1:
    return first
  wide = jnp.promote_types(rows.dtype, jnp.float32)
  total, alike = first.astype(wide), True
  for i in group[1:]:
    total = total + rows[i].astype(wide)
    alike = alike & (rows[i] == first)
  mean = (total * np.dtype(wide).type(1 / len(group))).astype(rows.dtype)
  return jnp.where(alike, first, mean)


def restore_target(tx: optax.GradientTransformation, params: Any,
                   mesh: Mesh, num_workers: int, *, axis_name: str = "data",
                   shard_axis: str | None = None) -> Any:
  """Abstract arrays of ``tx``'s state stacked for ``num_workers`` workers,
  on ``mesh``: what a checkpoint of a run on that many workers restores
  into before :func:`resize_worker_states` maps it to the mesh's. Each row
  is placed as the new run places its own (a momentum sharded like its
  param); the rows go over ``axis_name`` where its devices divide them,
  else every device of the axis holds all of them while resizing (e.g.
  8 -> 3 workers: 8 rows a device, 8 times a worker's state)."""
  shape, shardings = _target_shardings(tx, params, mesh, axis_name,
                                       shard_axis)
  lead = axis_name if num_workers % devices.axis_size(mesh, axis_name) == 0 \
      else None
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          (num_workers,) + x.shape[1:], x.dtype,
          sharding=NamedSharding(mesh, P(lead, *tuple(s.spec)[1:]))),
      shape, shardings)
