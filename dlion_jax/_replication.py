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
from typing import Any, Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from dlion_jax import _core
from dlion_jax import _drift
from dlion_jax import _mesh


class _CheckedOnFirstTrace:
  """A jitted ``shard_map`` step that, when first traced, runs a check on
  its update's region (the last ``shard_map``). It reads the trace jit
  caches anyway, so the check costs no second trace. Called as
  ``step(params, state, batch, **extra_args)`` (optax's), it calls
  ``jitted(params, state, batch, extra_args)``; those ``per_worker_args``
  names differ by worker, the others are one value for all, and each set
  of names given is checked on its first trace."""

  def __init__(self, jitted: Callable, num_workers: int,
               per_worker_args: tuple[str, ...] = ()):
    functools.update_wrapper(self, jitted)
    self._jitted = jitted
    self._checked = set()      # the names of extra arguments checked
    self._one = num_workers == 1
    self._per_worker = per_worker_args

  def _unchecked(self, extra_args) -> bool:
    return not self._one and tuple(sorted(extra_args)) not in self._checked

  def _check_region(self, region, params, state, batch, own) -> None:
    raise NotImplementedError

  def trace(self, params, state, batch, **extra_args):
    # Without extra arguments, three: what ``lower(...).compile()`` is
    # then called with, as a step of ``jax.jit`` is.
    traced = self._jitted.trace(params, state, batch,
                                *((extra_args,) if extra_args else ()))
    if self._unchecked(extra_args):
      region = [e for e in traced.jaxpr.jaxpr.eqns
                if e.primitive.name == "shard_map"][-1]
      own = {k: v for k, v in extra_args.items() if k in self._per_worker}
      self._check_region(region, params, state, batch, own)
      self._checked.add(tuple(sorted(extra_args)))
    return traced

  def lower(self, params, state, batch, **extra_args):
    return self.trace(params, state, batch, **extra_args).lower()

  def __call__(self, params, state, batch, **extra_args):
    if self._unchecked(extra_args):
      self.trace(params, state, batch, **extra_args)
    return self._jitted(params, state, batch,
                        *((extra_args,) if extra_args else ()))

  def __getattr__(self, name):
    return getattr(self._jitted, name)


class ExchangeCheck(_CheckedOnFirstTrace):
  """A step whose new params must be equal on every worker
  (:mod:`dlion_jax._drift`)."""

  def __init__(self, jitted: Callable, axis_name: str, num_workers: int,
               grads_first: bool, per_worker_args: tuple[str, ...] = ()):
    super().__init__(jitted, num_workers, per_worker_args)
    self._axis, self._n, self._grads_first = axis_name, num_workers, grads_first

  def _check_region(self, region, params, state, batch, own) -> None:
    # The region's last inputs differ by worker: the batch, or (a step
    # that differentiates before the region) each worker's loss and float
    # gradients, the loss also among its outputs after the params and
    # state; before them each worker's own extra arguments. (Constants it
    # closes over come first, and the extra arguments one for all.)
    if self._grads_first:
      varying = (len(region.outvars) - len(jax.tree.leaves(params))
                 - len(jax.tree.leaves(state))
                 + len(_core.float_leaves(params)))
    else:
      varying = len(jax.tree.leaves(batch))
    varying += len(jax.tree.leaves(own))
    _core.check_no_drift(region.params["jaxpr"], params, varying, self._axis,
                    self._n, state)


class AnchorCheck(_CheckedOnFirstTrace):
  """A per-worker-params step (local steps) whose new anchor
  (:mod:`dlion_jax.rounds`) must be equal on every worker: the outer step
  must exchange over the workers' axis."""

  def __init__(self, jitted: Callable, axis_name: str, num_workers: int,
               per_worker_args: tuple[str, ...] = ()):
    super().__init__(jitted, num_workers, per_worker_args)
    self._axis = axis_name

  def _check_region(self, region, params, state, batch, own) -> None:
    _core.check_anchor_alike(region.params["jaxpr"], params, state,
                             (batch, own), self._axis)


def require_exchange(fn: Callable, axis_name: str, num_workers: int,
                     *args) -> Any:
  """``fn(*args)``, traced once; raises if its first output (the new
  params) would differ between workers (``args[-1]`` is the batch). For
  ``pmap``, which offers no trace to read: the jaxpr is evaluated in place
  of a second trace."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  if num_workers > 1:
    _core.check_no_drift(closed, out_shape[0], len(jax.tree.leaves(args[-1])),
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
