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
counts, schedules' states, the anchor of :func:`dlion_jax.local_steps`)
is the same on every worker and keeps the first old row. With local
steps each worker also trains params of its own:
:func:`resize_worker_params` maps them as the momenta are mapped.
N' = N returns the state as it is, bit for bit. A pytree that holds the
state (a Linen ``TrainState``, an ``nnx.Optimizer``'s ``nnx.State``) has
it resized in place, and the optimizer's own step counter, the rest kept.
docs/training.md ("Resuming on another number of workers") measures the
policies; ``"mean"`` is the default.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _checks
from dlion_jax import _core
from dlion_jax import _mesh
from dlion_jax import lion
from dlion_jax import rounds
from dlion_jax import _blocks

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
  _checks.check_choice("policy", policy, RESIZE_POLICIES)
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


# States whose ``error`` field holds each worker's error-feedback residual.
_RESIDUAL_STATES = (lion.ErrorFeedbackState, lion.AbstainingErrorFeedbackState,
                    rounds.VotedMeanState)


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
  with_residual = lambda x: isinstance(x, _RESIDUAL_STATES)
  residual = jax.tree.map(
      lambda node: type(node)(*[
          jax.tree.map(lambda _, f=field: f == "error", value)
          for field, value in zip(node._fields, node)])
      if with_residual(node) else jax.tree.map(lambda _: False, node),
      state, is_leaf=with_residual)

  def kind(mapped, is_residual, is_anchor):
    if error == "clear" and is_residual:
      return "clear"
    return "map" if mapped and not is_anchor else "first"
  # Local steps' anchor is the same on every worker: kept as it is.
  return jax.tree.map(kind, param_like, residual, _core.anchor_flags(state))


def _target_shardings(tx, params, mesh, axis_name, shard_axis) -> Any:
  """Where :func:`dlion_jax.parallel.init_worker_states` puts ``tx``'s
  state for ``params`` on ``mesh``."""
  shape = jax.eval_shape(
      lambda p: _core.init_worker_states(tx, p, mesh, axis_name=axis_name,
                                            shard_axis=shard_axis), params)
  try:
    return shape, _core.state_shardings(tx, shape, params, mesh,
                                           axis_name, shard_axis=shard_axis)
  except (ValueError, TypeError):
    return shape, jax.tree.map(
        lambda _: NamedSharding(mesh, P(axis_name)), shape)


def _optimizer_leaves(state: Any) -> dict[int, bool]:
  """Positions among ``state``'s leaves of those an ``nnx.Optimizer``
  holds, each True for its own counter (``step``, an ``nnx.OptState``)
  and False for its optax state (``nnx.OptArray``, ``nnx.OptVariable``)."""
  nnx = sys.modules.get("flax.nnx")
  kind = getattr(nnx, "OptState", None)
  if kind is None:
    return {}
  out, i = {}, 0
  for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)):
    n = len(jax.tree.leaves(node))
    if isinstance(node, kind):
      out.update(dict.fromkeys(range(i, i + n), type(node) is kind))
    i += n
  return out


def _locate(state: Any, shape: Any) -> tuple[list[list[int]], list[int]]:
  """Where ``tx``'s state (``shape``) lies in ``state``: for each copy of
  it, the positions of its leaves among ``state``'s, in the order of
  ``shape``'s leaves; and the positions of the optimizer's counters
  beside it (an ``nnx.Optimizer``'s ``step``). The state itself, or a
  subtree whose leaves have ``shape``'s key paths (a ``TrainState``'s
  ``opt_state``; an ``nnx.Optimizer``'s ``opt_state``, its named tuples
  dicts). Raises a ValueError where an ``nnx.Optimizer`` holds optax
  state besides (a ``tx`` that is a part of the optimizer's)."""
  num = len(jax.tree.leaves(state))
  if jax.tree.structure(state) == jax.tree.structure(shape):
    return [list(range(num))], []
  ours = [_blocks.path_key(p)
          for p, _ in jax.tree_util.tree_leaves_with_path(shape)]
  if not ours or len(set(ours)) != len(ours):
    return [], []
  paths = jax.tree_util.tree_leaves_with_path(state)
  under: dict[tuple, dict[tuple, int]] = {}
  for i, (path, _) in enumerate(paths):
    key = _blocks.path_key(path)
    for cut in range(len(key) + 1):
      under.setdefault(key[:cut], {})[key[cut:]] = i
  found = [[rest[k] for k in ours] for rest in under.values()
           if len(rest) == len(ours) and set(rest) == set(ours)]
  if not found:
    return [], []
  taken = {i for at in found for i in at}
  held = _optimizer_leaves(state)
  other = [i for i, counter in held.items() if not counter and i not in taken]
  if other:
    raise ValueError(
        f"state holds tx's state and more optimizer state: its leaf "
        f"{jax.tree_util.keystr(paths[other[0]][0])} (of {len(other)}) is "
        "none of tx.init(params)'s. Resize with the whole optimizer the "
        "nnx.Optimizer was built with (its tx), not a part of it.")
  return found, sorted(i for i, counter in held.items()
                       if counter and i not in taken)


def _leaf_list(tree: Any, rows: bool) -> list[tuple[str, str]]:
  """Each leaf's key path and ``shape dtype`` (a row's where ``rows``)."""
  return [(jax.tree_util.keystr(p) or "the state",
           f"{np.shape(x)[1:] if rows else np.shape(x)} "
           f"{jnp.result_type(x)}")
          for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _not_found(state: Any, shape: Any) -> ValueError:
  """The error for a ``state`` that neither is nor holds ``tx``'s state:
  both leaf lists from their first difference (by path, a row's shape
  and dtype)."""
  theirs, ours = _leaf_list(state, False), _leaf_list(shape, True)
  rows = _leaf_list(state, True)
  first = next((i for i, (a, b) in enumerate(zip(rows, ours)) if a != b),
               min(len(theirs), len(ours)))
  show = lambda xs: "; ".join(f"{p}: {s}" for p, s in xs[first:first + 3]) \
      + (" ..." if len(xs) > first + 3 else "") if xs[first:] else "none"
  return ValueError(
      "state is not the state tx makes for params, and holds none: from "
      f"leaf {first} on, state's leaves ({len(theirs)}) are {show(theirs)}; "
      f"those of tx.init(params) ({len(ours)}, each stacked on a leading "
      f"axis of workers) {show(ours)}. Resize with the optimizer (and its "
      "options) and the params of the run that wrote the state; a pytree "
      "holding it (an nnx.Optimizer's nnx.State, a TrainState) must hold "
      "it whole.")


def _check_state(state: Any, shape: Any) -> int:
  """The rows of ``state`` (``tx``'s state); raises a ValueError naming the
  first leaf that differs from the state ``tx`` makes for the params."""
  leaves = jax.tree.leaves(state)
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(rows) != 1 or None in rows:
    raise ValueError(
        f"state must be stacked for its workers, every leaf on a leading "
        f"axis of the same size; its leaves lead with {sorted(rows, key=str)}"
        ". Pass the state init_worker_states (or a checkpoint of one) made.")
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state),
                          jax.tree.leaves(shape)):
    if np.shape(x)[1:] != y.shape[1:] or jnp.result_type(x) != y.dtype:
      raise ValueError(
          "state is not the state tx makes for params: a row of its leaf "
          f"{jax.tree_util.keystr(path)} is {np.shape(x)[1:]} "
          f"{jnp.result_type(x)}, tx's for these params {y.shape[1:]} "
          f"{y.dtype}. Resize with the optimizer (and its options) and the "
          "params of the run that wrote the state.")
  return rows.pop()


def _lead(mesh: Mesh, axis_name: str, num_workers: int) -> str | None:
  """Rows of ``num_workers`` go over ``axis_name`` where its devices divide
  them, else every device of the axis holds them all."""
  return axis_name if num_workers % _mesh.axis_size(mesh, axis_name) == 0 \
      else None


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

  ``state`` may also hold ``tx``'s state: a Linen ``TrainState`` whose
  ``opt_state`` is stacked per worker, the ``nnx.State`` of an
  ``nnx.Optimizer`` stacked with
  :func:`dlion_jax.devices.stack_for_workers`, any pytree with it inside.
  It is found by its leaves' key paths (``tx.init(params)``'s; ``nnx``
  keeps its named tuples as dicts) and its rows resized; the optimizer's
  other stacked leaves (an ``nnx.Optimizer``'s ``step``, an
  ``nnx.OptState``) keep their first row on each of the N' workers, and
  the rest (params, a ``TrainState``'s ``step``) keeps its values, moved
  onto ``mesh``'s devices where it lay on others (an in-memory resize).

  Args:
    tx: the optimizer the state is of.
    state: every leaf with a leading axis of the N old workers, on any
      devices (a checkpoint's restores onto ``mesh`` with
      :func:`restore_target`), or a pytree holding such a state.
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
    ``state`` with N' rows, placed on ``mesh``; at N' = N the same values.

  Raises:
    ValueError: naming ``policy``, ``error`` or ``axis_name`` when not one
      of their choices; a state not stacked, or neither ``tx``'s for
      ``params`` nor holding it.

  Example:
    >>> import jax.numpy as jnp, dlion_jax as dl
    >>> from dlion_jax import devices, elastic, parallel
    >>> tx = dl.distributed_lion(1e-3, axis_name="data")
    >>> big, small = devices.data_mesh(2), devices.data_mesh(1)
    >>> p = devices.replicate({"w": jnp.zeros(3)}, big)
    >>> state = _core.init_worker_states(tx, p, big)
    >>> state = elastic.resize_worker_states(
    ...     tx, state, devices.replicate({"w": jnp.zeros(3)}, small), small)
    >>> state[0].mu["w"].shape
    (1, 3)
  """
  _checks.check_choice("policy", policy, RESIZE_POLICIES)
  _checks.check_choice("error", error, ERROR_POLICIES)
  num_new = _mesh.axis_size(mesh, axis_name)
  shape, shardings = _target_shardings(tx, params, mesh, axis_name,
                                       shard_axis)
  leaves, treedef = jax.tree.flatten(state)
  found, counters = _locate(state, shape)
  if not found:
    raise _not_found(state, shape)
  optax_def = jax.tree.structure(shape)
  states = [jax.tree.unflatten(optax_def, [leaves[i] for i in at])
            for at in found]
  rows = {_check_state(s, shape) for s in states}
  if len(rows) > 1:
    raise ValueError(
        f"state holds tx's state {len(states)} times, stacked for "
        f"{sorted(rows)} workers: resize each copy on its own.")
  num_old = rows.pop()
  counters = [i for i in counters
              if np.ndim(leaves[i]) and np.shape(leaves[i])[0] == num_old]
  groups = old_rows(num_old, num_new, policy)
  # Each leaf to resize: where it is in state, its kind, where its old rows
  # go first (the new mesh's devices; a no-op for a state restored there)
  # and where its new ones go.
  todo = []
  old_at = jax.tree.leaves(restore_target(
      tx, params, mesh, num_old, axis_name=axis_name, shard_axis=shard_axis))
  for at, s in zip(found, states):
    todo += zip(at, jax.tree.leaves(_kinds(tx, s, params, error)),
                [x.sharding for x in old_at], jax.tree.leaves(shardings))
  todo += [(i, "first",
            NamedSharding(mesh, P(_lead(mesh, axis_name, num_old))),
            NamedSharding(mesh, P(axis_name))) for i in counters]

  def one(leaf, kind):
    new = (num_new,) + leaf.shape[1:]
    if kind == "clear":
      return jnp.zeros(new, leaf.dtype)
    if kind == "first":
      return jnp.broadcast_to(leaf[:1], new)
    if num_old == num_new:
      return leaf
    return jnp.stack([_mean(leaf, g) for g in groups])
  kinds = [k for _, k, _, _ in todo]
  new = _rows_mapped(lambda xs: [one(x, k) for x, k in zip(xs, kinds)],
                     [leaves[i] for i, _, _, _ in todo],
                     [s for _, _, s, _ in todo], [s for *_, s in todo], mesh)
  for (i, _, _, _), x in zip(todo, new):
    leaves[i] = x
  resized = {i for i, *_ in todo}
  leaves = [x if i in resized else _kept_on(x, mesh)
            for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, leaves)


def _kept_on(x: Any, mesh: Mesh) -> Any:
  """A leaf the resize keeps, on ``mesh`` where it lay elsewhere (an
  ``nnx.Optimizer``'s unstacked ``step``, a ``TrainState``'s params,
  resized in memory onto fewer devices or another mesh of the same ones):
  sharded as it was where ``mesh`` has its spec's axes and they divide its
  dims, else whole on every device."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(x, jax.Array) or (isinstance(sharding, NamedSharding)
                                      and sharding.mesh == mesh):
    return x
  spec = getattr(x.sharding, "spec", P())
  def fits(dim, entry):
    names = entry if isinstance(entry, tuple) else (entry,)
    return entry is None or (set(names) <= set(mesh.axis_names) and
                             dim % _mesh.axis_size(mesh, names) == 0)
  if not all(fits(d, e) for d, e in zip(x.shape, spec)):
    spec = P()
  return jax.device_put(x, NamedSharding(mesh, spec))


def _rows_mapped(fn, tree: Any, old: Any, new: Any, mesh: Mesh) -> Any:
  """``fn(tree)``, ``tree`` placed by ``old`` and the result by ``new``
  (shardings on ``mesh``), computed on ``mesh``'s devices with every axis
  Auto.

  Explicit axes type the rows' axis as sharded over the workers' and refuse
  to slice it ("slicing on sharded dims"); the same devices and specs on
  Auto axes, so both moves are free and the values are the Auto mesh's,
  bit for bit, then typed as ``new`` types them. Under the caller's
  ``jax.set_mesh`` (the plain jitted step's style) the Auto mesh is set
  for the computation, whose every value must be typed on the context
  mesh.
  """
  auto = Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  on_auto = lambda shardings: jax.tree.map(
      lambda s: NamedSharding(auto, s.spec), shardings)
  with jax.set_mesh(auto):
    values = jax.device_put(tree, on_auto(old))
    values = jax.jit(fn, out_shardings=on_auto(new))(values)
  return jax.device_put(values, new)


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
                   shard_axis: str | None = None, state: Any = None) -> Any:
  """Abstract arrays of ``tx``'s state stacked for ``num_workers`` workers,
  on ``mesh``: what a checkpoint of a run on that many workers restores
  into before :func:`resize_worker_states` maps it to the mesh's. Each row
  is placed as the new run places its own (a momentum sharded like its
  param); the rows go over ``axis_name`` where its devices divide them,
  else every device of the axis holds all of them while resizing (e.g.
  8 -> 3 workers: 8 rows a device, 8 times a worker's state).

  With ``state``, a pytree holding ``tx``'s state stacked for ``mesh`` as
  the new run builds it (an ``nnx.Optimizer``'s stacked ``nnx.State``, a
  ``TrainState``; :func:`resize_worker_states` says what it finds there):
  that pytree, its stacked leaves with ``num_workers`` rows and its others
  as they are.

  Raises:
    ValueError: ``state`` holds no state of ``tx`` for ``params``.
  """
  shape, shardings = _target_shardings(tx, params, mesh, axis_name,
                                       shard_axis)
  lead = _lead(mesh, axis_name, num_workers)
  target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          (num_workers,) + x.shape[1:], x.dtype,
          sharding=NamedSharding(mesh, P(lead, *tuple(s.spec)[1:]))),
      shape, shardings)
  if state is None:
    return target
  leaves, treedef = jax.tree.flatten(state)
  found, counters = _locate(state, shape)
  if not found:
    raise _not_found(state, shape)
  for at in found:
    for i, x in zip(at, jax.tree.leaves(target)):
      leaves[i] = x
  rows = _mesh.axis_size(mesh, axis_name)
  for i in counters:
    x = leaves[i]
    if np.ndim(x) and np.shape(x)[0] == rows:
      leaves[i] = jax.ShapeDtypeStruct(
          (num_workers,) + np.shape(x)[1:], jnp.result_type(x),
          sharding=NamedSharding(mesh, P(lead)))
  return jax.tree.unflatten(treedef, leaves)


def resize_worker_params(params: Any, mesh: Mesh, *,
                         axis_name: str = "data",
                         policy: str = "mean") -> Any:
  """Per-worker params, stacked for N workers, as those of the N' workers
  of ``axis_name`` on ``mesh``: what a run of
  :func:`dlion_jax.local_steps` needs besides its state, since each of its
  workers trains a copy of its own between outer steps.

  New worker ``j`` takes the mean of the old workers' params that
  :func:`old_rows` gives it (an average of their copies partway through a
  round, as its momenta are averaged), or a copy of one. The anchor, in the
  state, is the same on every worker and :func:`resize_worker_states`
  keeps it as it is, so the round goes on from the same outer step;
  a resume at a round's end (every copy on the anchor) changes nothing.
  Integer leaves take the first of their rows. N' = N returns the params
  as they are, bit for bit.

  Args:
    params: every leaf with a leading axis of the N old workers
      (:func:`dlion_jax.devices.stack_for_workers`' layout; a checkpoint's
      restores onto ``mesh`` with :func:`worker_params_target`).
    mesh: the new mesh.
    axis_name: the workers' axis on ``mesh``.
    policy: ``"mean"``, ``"all"`` or ``"keep"``, as for the state.

  Returns:
    ``params`` with N' rows over ``axis_name``, each row sharded over the
    other axes as ``params``' rows are on ``mesh`` (as
    ``stack_for_workers`` places them).

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import devices, elastic
    >>> mesh = devices.data_mesh(1)
    >>> params = {"w": jnp.array([[1.0, 2.0], [3.0, 6.0]])}   # 2 workers
    >>> elastic.resize_worker_params(params, mesh)["w"]
    Array([[2., 4.]], dtype=float32)
  """
  _checks.check_choice("policy", policy, RESIZE_POLICIES)
  num_new = _mesh.axis_size(mesh, axis_name)
  leaves = jax.tree.leaves(params)
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(rows) != 1 or None in rows:
    raise ValueError(
        "params must be stacked for their workers, every leaf on a leading "
        f"axis of the same size; its leaves lead with "
        f"{sorted(rows, key=str)}. Pass the per-worker params of a "
        "local-steps run (dl.devices.stack_for_workers), or a checkpoint "
        "of them restored with elastic.worker_params_target.")
  num_old = rows.pop()
  groups = old_rows(num_old, num_new, policy)

  def one(leaf):
    if num_old == num_new:
      return leaf
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      return jnp.stack([leaf[g[0]] for g in groups])
    return jnp.stack([_mean(leaf, g) for g in groups])
  # A row stays sharded over the other axes as it is (FSDP params). The
  # old rows onto the new mesh first (a no-op for params restored there),
  # over axis_name where its devices divide them, as the state's.
  rows_as = lambda x, lead: NamedSharding(mesh, P(lead, *_row_spec(x, mesh)))
  old = jax.tree.map(lambda x: rows_as(x, _lead(mesh, axis_name, num_old)),
                     params)
  if num_old == num_new:       # placed as the new run holds them already
    return jax.device_put(params, old)
  return _rows_mapped(lambda t: jax.tree.map(one, t), params, old,
                      jax.tree.map(lambda x: rows_as(x, axis_name), params),
                      mesh)


def _row_spec(x: Any, mesh: Mesh) -> tuple:
  """How a row of stacked ``x`` is sharded on ``mesh`` (nothing where
  ``x`` is not placed there)."""
  return tuple(_mesh.spec_on(x, mesh))[1:]


def worker_row(params: Any, mesh: Mesh) -> Any:
  """Abstract arrays of one worker's row of stacked ``params``, placed as
  the row is on ``mesh``: what :func:`restore_target` and
  :func:`resize_worker_states` read of a local-steps run's params (shapes
  and placement), without slicing a row out."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          np.shape(x)[1:], jnp.result_type(x),
          sharding=NamedSharding(mesh, P(*_row_spec(x, mesh)))), params)


def worker_params_target(params: Any, mesh: Mesh, num_workers: int, *,
                         axis_name: str = "data") -> Any:
  """Abstract arrays of per-worker ``params`` (stacked, as the new run
  holds them) with ``num_workers`` rows on ``mesh``: what a checkpoint of
  a local-steps run on that many workers restores into before
  :func:`resize_worker_params`."""
  lead = _lead(mesh, axis_name, num_workers)
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          (num_workers,) + np.shape(x)[1:], jnp.result_type(x),
          sharding=NamedSharding(mesh, P(lead, *_row_spec(x, mesh)))),
      params)
