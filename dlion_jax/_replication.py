"""The checks that what a step returns replicated is equal on every worker.

``shard_map`` returns worker 0's copy of a replicated output without
looking at the others. These read the traced step (:mod:`dlion_jax._drift`)
and refuse, with the cause and the fix, new params that would differ from
worker to worker (the steps of :func:`dlion_jax.parallel.make_train_step`
and :func:`dlion_jax.parallel.make_pmap_train_step`) and ``"replicated"``
outputs of :func:`dlion_jax.parallel.per_worker` that differ.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax

from dlion_jax import _core
from dlion_jax import _drift
from dlion_jax import _mesh


def _drifting_leaves(jaxpr, params: Any, num_batch_leaves: int,
                     axis_name) -> list[tuple[int, str]]:
  """The params leaves (index, key path) whose new value (the first
  outputs of ``jaxpr``, one worker's step) varies over ``axis_name`` (an
  axis or a tuple of them) when the batch (its last ``num_batch_leaves``
  inputs) does; empty leaves cannot drift."""
  axes = frozenset(_mesh.names(axis_name))
  inputs = _drift.open_jaxpr(jaxpr).invars
  fixed = len(inputs) - num_batch_leaves
  new = _drift.varying_outputs(
      jaxpr, [frozenset()] * fixed + [axes] * num_batch_leaves)
  outvars = _drift.open_jaxpr(jaxpr).outvars
  return [(i, jax.tree_util.keystr(path) or "<root>")
          for i, ((path, _), varies, var) in enumerate(zip(
              jax.tree_util.tree_leaves_with_path(params), new, outvars))
          if varies & axes and math.prod(var.aval.shape)]


def _drift_error(jaxpr, params: Any, drifting: list[tuple[int, str]],
                 axis_name, num_workers, state: Any) -> ValueError:
  """Why the new params ``drifting`` differ by worker, and the fix: an
  optimizer that exchanges nothing for them, or one whose update is taken
  per worker after the exchange (:func:`optax.apply_if_finite`'s
  decision)."""
  leaves = [name for _, name in drifting]
  named = ", ".join(leaves[:4]) + (
      f" and {len(leaves) - 4} more" if len(leaves) > 4 else "")
  count = f"{len(leaves)} of {len(jax.tree.leaves(params))}"
  exchanged = _drift.exchanged_outputs(
      jaxpr, frozenset(_mesh.names(axis_name)))
  if not any(exchanged[i] for i, _ in drifting):
    return ValueError(
        f"The optimizer exchanges nothing over axis {axis_name!r} for params "
        f"leaves {named} ({count}): each of its {num_workers} workers would "
        "apply an update to them computed from its own batch alone, and the "
        "replicated params would silently differ from worker to worker. "
        "Build the optimizer that updates them with "
        f"axis_name={axis_name!r} (e.g. dl.distributed_lion(lr, "
        f"axis_name={axis_name!r}), inside optax.masked, "
        "optax.multi_transform and dl.apply_if_finite too), or chain a "
        "global optimizer after "
        f"dl.transforms.pmean_gradients({axis_name!r}). A psum of a scalar (a "
        "global gradient norm, a token count, a finite flag) does not make "
        "the workers' updates equal.")
  what = (f"The optimizer exchanges over axis {axis_name!r}, but params "
          "leaves "
          f"{named} ({count}) would still silently differ between its "
          f"{num_workers} workers")
  if any(isinstance(x, optax.ApplyIfFiniteState) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))):
    return ValueError(
        f"{what}: optax.apply_if_finite decides from each worker's own "
        "gradients whether that worker applies the voted update, so a "
        "non-finite gradient on one worker splits the workers (in a "
        "shard_map it also leaves the vote's collectives to the others). "
        "Wrap the optimizer in dl.apply_if_finite(tx, "
        f"max_consecutive_errors, axis_name={axis_name!r}) instead of "
        "optax.apply_if_finite: it all-reduces the finiteness flag, so "
        "every worker skips a step together.")
  return ValueError(
      f"{what}: their new values depend on each worker's own batch after "
      "the exchange (a value or a decision taken per worker and applied "
      "after the vote, or an exchange among groups of the workers only, "
      "axis_index_groups). Apply after the exchange only what every worker "
      "computes alike, or reduce the per-worker value over all the workers "
      f"first (e.g. jax.lax.pmean over {axis_name!r}).")


def _check_no_drift(jaxpr, params: Any, num_varying: int, axis_name,
                    num_workers, state: Any = None) -> None:
  """Raises unless every new params leaf is equal on all workers: each must
  come from an exchange of its own update (or a reduction of its own
  gradient) over ``axis_name``. The last ``num_varying`` inputs of
  ``jaxpr`` (the batch, or each worker's gradients) differ by worker;
  ``state`` (the optimizer's) names the cause."""
  drifting = _drifting_leaves(jaxpr, params, num_varying, axis_name)
  if drifting:
    raise _drift_error(jaxpr, params, drifting, axis_name, num_workers,
                       state)


class _CheckedOnFirstTrace:
  """A jitted ``shard_map`` step that, when first traced, runs a check on
  its update's region (the last ``shard_map``). It reads the trace jit
  caches anyway, so the check costs no second trace."""

  def __init__(self, jitted: Callable, num_workers: int):
    functools.update_wrapper(self, jitted)
    self._jitted = jitted
    self._checked = num_workers == 1

  def _check_region(self, region, params, state, batch) -> None:
    raise NotImplementedError

  def trace(self, params, state, batch):
    traced = self._jitted.trace(params, state, batch)
    if not self._checked:
      region = [e for e in traced.jaxpr.jaxpr.eqns
                if e.primitive.name == "shard_map"][-1]
      self._check_region(region, params, state, batch)
      self._checked = True
    return traced

  def lower(self, params, state, batch):
    return self.trace(params, state, batch).lower()

  def __call__(self, params, state, batch):
    if not self._checked:
      self.trace(params, state, batch)
    return self._jitted(params, state, batch)

  def __getattr__(self, name):
    return getattr(self._jitted, name)


class ExchangeCheck(_CheckedOnFirstTrace):
  """A step whose new params must be equal on every worker
  (:mod:`dlion_jax._drift`)."""

  def __init__(self, jitted: Callable, axis_name: str, num_workers: int,
               grads_first: bool):
    super().__init__(jitted, num_workers)
    self._axis, self._n, self._grads_first = axis_name, num_workers, grads_first

  def _check_region(self, region, params, state, batch) -> None:
    # The region's last inputs differ by worker: the batch, or (a step
    # that differentiates before the region) each worker's loss and float
    # gradients, the loss also among its outputs after the params and
    # state. (Constants it closes over come first.)
    if self._grads_first:
      varying = (len(region.outvars) - len(jax.tree.leaves(params))
                 - len(jax.tree.leaves(state))
                 + len(_core.float_leaves(params)))
    else:
      varying = len(jax.tree.leaves(batch))
    _check_no_drift(region.params["jaxpr"], params, varying, self._axis,
                    self._n, state)


class AnchorCheck(_CheckedOnFirstTrace):
  """A per-worker-params step (local steps) whose new anchor
  (:mod:`dlion_jax.rounds`) must be equal on every worker: the outer step
  must exchange over the workers' axis."""

  def __init__(self, jitted: Callable, axis_name: str, num_workers: int):
    super().__init__(jitted, num_workers)
    self._axis = axis_name

  def _check_region(self, region, params, state, batch) -> None:
    _check_anchor_alike(region.params["jaxpr"], params, state, batch,
                        self._axis)


def _check_anchor_alike(jaxpr, params, state, batch, axis_name) -> None:
  """Raises unless every anchor leaf of the new state is equal on all
  workers, given per-worker params and batch (the region's last inputs,
  after the constants it closes over) and a state alike on all."""
  axes = frozenset(_mesh.names(axis_name))
  n_params, n_state, n_batch = (len(jax.tree.leaves(t))
                                for t in (params, state, batch))
  consts = len(_drift.open_jaxpr(jaxpr).invars) - n_params - n_state - n_batch
  varying = _drift.varying_outputs(
      jaxpr, [frozenset()] * consts + [axes] * n_params
      + [frozenset()] * n_state + [axes] * n_batch)
  new_state = varying[n_params:n_params + n_state]
  flags = jax.tree.leaves(_core.anchor_flags(state))
  drifting = [jax.tree_util.keystr(path) for (path, _), flag, axes_ in zip(
      jax.tree_util.tree_leaves_with_path(state), flags, new_state)
              if flag and axes_ & axes]
  if not drifting:
    return
  named = ", ".join(drifting[:3]) + (
      f" and {len(drifting) - 3} more" if len(drifting) > 3 else "")
  finite = any(isinstance(x, optax.ApplyIfFiniteState) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState)))
  raise ValueError(
      f"dl.local_steps: the anchor (state leaves {named}) would differ "
      "from worker to worker after a round: "
      + ("optax.apply_if_finite decides from each worker's own gradients "
         "whether it applies the round's outer step. Wrap the optimizer in "
         f"dl.apply_if_finite(tx, max_consecutive_errors, "
         f"axis_name={axis_name!r}) instead, which decides alike."
         if finite else
         f"the outer optimizer exchanges nothing over axis {axis_name!r} "
         "(or applies a per-worker value after its exchange). Build it with "
         f"axis_name={axis_name!r}: dl.distributed_lion(lr, "
         f"axis_name={axis_name!r}, weight_decay=0.0) or "
         f"dl.rounds.nesterov_outer(lr, axis_name={axis_name!r})."))


def require_exchange(fn: Callable, axis_name: str, num_workers: int,
                     *args) -> Any:
  """``fn(*args)``, traced once; raises if its first output (the new
  params) would differ between workers (``args[-1]`` is the batch). For
  ``pmap``, which offers no trace to read: the jaxpr is evaluated in place
  of a second trace."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  if num_workers > 1:
    _check_no_drift(closed, out_shape[0], len(jax.tree.leaves(args[-1])),
                    axis_name, num_workers, args[-2])
  flat = jex.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), flat)


def replication_checked(fn, ins, outs, single, axis_name) -> Callable:
  """``fn``, traced once to check that its ``"replicated"`` outputs are
  equal on every worker (:mod:`dlion_jax._drift`)."""
  axes = frozenset(_mesh.names(axis_name))
  def checked(*args):
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    shapes = (shape,) if single else outputs(shape, outs)
    flags = _varying_outputs(closed, args, ins, shapes, outs, axes)
    flat_outs = [(i, path, layout) for i, (out, k) in enumerate(
        zip(shapes, outs)) for (path, _), layout in zip(
            jax.tree_util.tree_leaves_with_path(out), _leaf_layouts(k, out))]
    for (i, path, layout), varies in zip(flat_outs, flags):
      if varies & axes and layout == "replicated":
        raise _replicated_error(closed, i, path, axis_name, axes)
    flat = jex.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shape), flat)
  return checked


def _varying_outputs(closed, args, ins, shapes, outs, axes) -> list:
  """The axes each output leaf of ``closed`` (one worker's ``fn``) varies
  over. ``"split"`` arguments vary. A ``"stacked"`` leaf that ``fn``
  returns updated, at the same place of a ``"stacked"`` output of the
  same structure (a state), varies only where its new value does, to a
  fixed point: every worker's rows start alike
  (:func:`dlion_jax.parallel.init_worker_states`,
  :func:`dlion_jax.devices.stack_for_workers`), so a state that every
  worker updates alike (the moments of a global optimizer, an injected
  hyperparameter) stays alike. Other ``"stacked"`` leaves vary but for
  integer scalars (step counts), and so do PRNG keys, typed or raw,
  carried or not: per-worker keys differ from the start."""
  leaves = [(leaf, layout) for a, k in zip(args, ins)
            for leaf, layout in zip(jax.tree.leaves(a), _leaf_layouts(k, a))]
  carried = dict(_carried(args, ins, shapes, outs))
  def start(index, leaf, layout):
    if layout == "split" or (layout == "stacked" and _key(leaf)):
      return axes
    if layout == "stacked" and not _counter(leaf) and index not in carried:
      return axes
    return frozenset()
  varying = [start(i, leaf, k) for i, (leaf, k) in enumerate(leaves)]
  while True:
    flags = _drift.varying_outputs(closed, varying)
    grown = [i for i, o in carried.items()
             if flags[o] & axes and not varying[i] & axes]
    if not grown:
      return flags
    for i in grown:
      varying[i] = varying[i] | axes


def _carried(args, ins, shapes, outs) -> list[tuple[int, int]]:
  """``(input leaf, output leaf)`` index pairs, in flat order, of the
  ``"stacked"`` leaves ``fn`` returns at the same place of a
  ``"stacked"`` output of the same structure and leaf shape."""
  def flat(trees, layouts):
    out, offset = [], 0
    for tree, k in zip(trees, layouts):
      leaves = jax.tree.leaves(tree)
      out.append((jax.tree.structure(tree), offset, leaves,
                  _leaf_layouts(k, tree)))
      offset += len(leaves)
    return out
  inputs, pairs = flat(args, ins), []
  for treedef, o_offset, o_leaves, o_layouts in flat(shapes, outs):
    for i_treedef, i_offset, i_leaves, i_layouts in inputs:
      if i_treedef != treedef:
        continue
      pairs += [(i_offset + j, o_offset + j) for j, (x, y, kx, ky) in
                enumerate(zip(i_leaves, o_leaves, i_layouts, o_layouts))
                if kx == ky == "stacked" and np.shape(x) == np.shape(y)]
      break
  return pairs


def _replicated_error(closed, index, path, axis_name, axes) -> ValueError:
  where = (f"per_worker: output {index} is laid out \"replicated\" but "
           f"its leaf {jax.tree_util.keystr(path) or '<root>'} differs from "
           "worker to worker")
  fixes = (f"reduce it in fn (e.g. jax.lax.pmean(x, {axis_name!r})), lay "
           "it out \"stacked\" to get every worker's, or pass "
           "check_replicated=False if it is equal on every worker by "
           "construction.")
  if not _drift.exchanges_over(closed, axes):
    return ValueError(
        f"{where}: fn exchanges nothing over {axis_name!r}, so each "
        "worker's result is its own. If fn runs an optimizer, build it "
        f"with axis_name={axis_name!r} (e.g. dl.distributed_lion(lr, "
        f"axis_name={axis_name!r})) so that the workers vote. Otherwise "
        f"{fixes}")
  return ValueError(
      f"{where} (it comes from a \"split\" or \"stacked\" argument, "
      "or a per-worker PRNG key, without a reduction over "
      f"{axis_name!r}): shard_map would return worker 0's. "
      f"{fixes[0].upper()}{fixes[1:]}")


def _counter(leaf) -> bool:
  """An integer or bool scalar: a count every worker keeps alike. A PRNG
  key is not one, typed or raw (``jax.random.PRNGKey``'s two uint32
  words): per-worker keys differ by construction."""
  dtype = jnp.result_type(leaf)
  return not np.ndim(leaf) and (jnp.issubdtype(dtype, jnp.integer)
                                or dtype == jnp.bool_)


def _key(leaf) -> bool:
  """A PRNG key, typed or raw (integers with a trailing axis: the raw
  key's words), of one worker."""
  dtype = jnp.result_type(leaf)
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (
      np.ndim(leaf) > 0 and jnp.issubdtype(dtype, jnp.unsignedinteger))


def _leaf_layouts(layout: Any, tree: Any) -> list[str]:
  """The layout of each leaf of ``tree``, in ``jax.tree.leaves`` order."""
  out = []
  jax.tree.map(lambda k, sub: out.extend([k] * len(jax.tree.leaves(sub))),
               layout, tree)
  return out


def outputs(out, outs: tuple[str, ...]) -> tuple:
  """``out``, what ``fn`` returned, as a tuple of one output per layout of
  ``outs``; a ValueError naming both counts where they differ."""
  if not isinstance(out, (tuple, list)) or len(out) != len(outs):
    got = (f"{len(out)} outputs" if isinstance(out, (tuple, list))
           else f"one {type(out).__name__}")
    raise ValueError(
        f"per_worker: fn returned {got} but outs gives {len(outs)} layouts "
        f"{outs}; return a tuple with one output per layout, or pass one "
        "layout as a string for a single output.")
  return tuple(out)
