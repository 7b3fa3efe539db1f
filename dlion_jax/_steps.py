"""The steps :func:`dlion_jax.parallel.make_train_step` builds, and the
worker update they share with
:func:`dlion_jax.parallel.make_pmap_train_step`: where the ``shard_map``
door hands ``tx`` on, and where ``tx.update`` runs.

Three steps, siblings over one worker update (:func:`worker_update`):

* the region step: a region manual over ``axis_name`` that
  differentiates and updates, each worker's :func:`learn`;
* the ``shard_axis`` step: each node's mean gradient reduce-scattered over
  the fast axis (``dlion_jax._core.node_mean_grads``), then the vote in a
  region manual over ``axis_name`` alone (:func:`_voted`);
* the step on a mesh with Explicit axes: each worker's gradients by
  ``jax.vmap`` over its rows, then the same vote.

The last two take the gradients before the vote's region
(:func:`differentiates_first`). Each step is told where the params and
state lie (``placed``: the params' specs and, by key path, the placement
the update cuts each leaf by, from
``dlion_jax._placement.OutputsPlacedLikeInputs``), or reads it off the
arrays' types.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dlion_jax import _blocks
from dlion_jax import _core
from dlion_jax import _extra_args
from dlion_jax import _mesh
from dlion_jax import _per_worker
from dlion_jax import _placement
from dlion_jax import rounds


def differentiates_first(mesh: Mesh, axis_name, shard_axis) -> bool:
  """Whether :func:`train_step` takes the gradients before the vote's
  region: with a ``shard_axis``, or Explicit axes beside ``axis_name``."""
  return shard_axis is not None or bool(_mesh.explicit_axes(mesh, axis_name))


def train_step(loss_fn, tx, mesh: Mesh, placed=None, *, axis_name: str,
               shard_axis: str | None, check_vma: bool, has_aux: bool,
               micro_batches: int, params_per_worker: bool,
               per_worker_args: tuple[str, ...], loss_as) -> Callable:
  """``step(params, state, batch, shared, own) -> (params, state, loss)``:
  :func:`dlion_jax.parallel.make_train_step`'s step for ``placed`` (None:
  the arrays' types say), optax's extra arguments one for all
  (``shared``) or a row a worker (``own``)."""
  own_loss = loss_as in per_worker_args
  # Those that differentiate first need no check_vma: their region is
  # checked on its first trace (dlion_jax._replication.ExchangeCheck).
  if shard_axis is not None:
    return _hybrid_step(loss_fn, tx, mesh, axis_name, shard_axis, placed,
                        has_aux=has_aux, micro_batches=micro_batches,
                        loss_as=loss_as, own_loss=own_loss)
  if _mesh.explicit_axes(mesh, axis_name):
    return _explicit_step(loss_fn, tx, mesh, axis_name, placed,
                          has_aux=has_aux, micro_batches=micro_batches,
                          loss_as=loss_as, own_loss=own_loss)
  auto = any(t == jax.sharding.AxisType.Auto
             for a, t in zip(mesh.axis_names, mesh.axis_types)
             if a not in _mesh.names(axis_name))
  return _region_step(
      loss_fn, tx, mesh, axis_name, placed[1] if placed and auto else None,
      has_aux=has_aux, micro_batches=micro_batches, check_vma=check_vma,
      params_per_worker=params_per_worker, loss_as=loss_as,
      own_loss=own_loss)


def worker_update(tx, placement=None):
  """One worker's optimizer step, ``(grads, state, params, extra_args) ->
  (new params, state)`` (``extra_args``: optax's, a dict), the new params
  typed like the old. With a ``placement`` (Auto axes beside the workers',
  :func:`dlion_jax._placement.placement`) the update knows how each leaf
  is placed (``dlion_jax._blocks.placed``)."""
  def update(grads, state, params, extra_args=None):
    state = _extra_args.alike_state(state)  # check_vma: parallel.typed_alike
    with (contextlib.nullcontext() if placement is None
          else _blocks.placed(placement)):
      updates, state = tx.update(grads, state, params, **extra_args or {})
    # Local steps: a round's end puts every worker exactly on the anchor.
    new = rounds.restart_at_anchor(optax.apply_updates(params, updates),
                                   state)
    return jax.tree.map(_mesh.typed_like, new, params), state
  return update


def learn(loss_fn, tx, has_aux, micro_batches, placement=None, *,
          loss_as=None, own_loss=False, axis_name=None):
  """One worker's loss, gradients and update: what must hold an exchange
  (the loss given to ``tx.update`` as ``loss_as``, the worker's own or
  the workers' mean: ``dlion_jax._extra_args.with_loss``)."""
  update = worker_update(tx, placement)
  def learn(params, local_params, state, batch, extra_args=None):
    loss, grads = _core.loss_and_grads(loss_fn, local_params, batch,
                                       has_aux, micro_batches)
    extra_args = _extra_args.with_loss(extra_args or {}, loss[0] if has_aux
                                       else loss, loss_as, own_loss,
                                       axis_name)
    return *update(grads, state, params, extra_args), loss
  return learn


def _region_step(loss_fn, tx, mesh: Mesh, axis_name: str, placement, *,
                 has_aux: bool, micro_batches: int, check_vma: bool,
                 params_per_worker: bool, loss_as, own_loss: bool
                 ) -> Callable:
  """The step without ``shard_axis`` on a mesh of ``axis_name`` and Auto
  axes: each worker's :func:`learn` in a region manual over ``axis_name``
  (``dlion_jax._per_worker.mapped``), which sees its node's whole batch
  and leaves the other axes to the compiler."""
  one_worker = learn(loss_fn, tx, has_aux, micro_batches, placement,
                     loss_as=loss_as, own_loss=own_loss, axis_name=axis_name)

  # The extra arguments one for all first, among the constants, and each
  # worker's own last: the checks read what differs by worker.
  def local_step(shared, params, state, batch, own):
    local_params = (lax.pcast(params, axis_name, to="varying")
                    if check_vma and not params_per_worker else params)
    params, state, loss = one_worker(params, local_params, state, batch,
                                     {**shared, **own})
    return params, state, _core.mean_of_workers(loss, axis_name)

  params_layout = "stacked" if params_per_worker else "replicated"
  mapped = _per_worker.mapped(
      local_step, mesh, axis_name=axis_name,
      ins=("replicated", params_layout, "stacked", "split", "stacked"),
      outs=(params_layout, "stacked", "replicated"),
      check_vma=check_vma, check_replicated=False)
  return lambda params, state, batch, shared, own: mapped(
      shared, params, state, batch, own)


def _hybrid_step(loss_fn, tx, mesh: Mesh, axis_name: str, shard_axis: str,
                 placed, *, has_aux: bool, micro_batches: int, loss_as,
                 own_loss: bool) -> Callable:
  """The step with a ``shard_axis``: each node's mean gradient by
  ``dlion_jax._core.node_mean_grads`` (manual over both axes), then the
  update of :func:`_voted`, each leaf's gradient and vote in the blocks
  :func:`dlion_jax._placement.blocks` gives it."""
  def step(params, state, batch, shared, own):
    paths, leaves = zip(*[(_blocks.path_key(p), x) for p, x in
                          jax.tree_util.tree_leaves_with_path(params)])
    floats = _core.float_leaves(params)
    param_specs, blocks = _placement.blocks(placed, params, mesh,
                                            shard_axis)

    def device_grads(params, batch):
      value, grads = _core.loss_and_grads(loss_fn, params, batch, has_aux,
                                          micro_batches)
      grads = jax.tree.leaves(grads)
      return (_core.mean_of_workers(value, shard_axis),
              [grads[i] for i in floats])
    value, grads = _core.node_mean_grads(
        device_grads, mesh, axis_name=axis_name, shard_axis=shard_axis,
        param_dims=[_core.axis_dim(
            s, shard_axis, f"params leaf {_blocks.key_name(p)}")
                    for s, p in zip(param_specs, paths)],
        grad_dims=[_core.axis_dim(blocks[paths[i]], shard_axis)
                   for i in floats])(params, batch)
    return _voted(tx, mesh, axis_name, blocks, floats, has_aux, loss_as,
                  own_loss)(shared, params, state, own, value, grads)
  return step


def _explicit_step(loss_fn, tx, mesh: Mesh, axis_name: str, placed, *,
                   has_aux: bool, micro_batches: int, loss_as,
                   own_loss: bool) -> Callable:
  """The step without ``shard_axis`` on a mesh with Explicit axes beside
  ``axis_name``: each worker's gradients by ``jax.vmap(...,
  spmd_axis_name=axis_name)`` over its rows of the batch (the loss sees
  its rows sharded over the other axes as placed, and whole params typed
  as placed, as in a plain ``jax.jit``), then the update of
  :func:`_voted`.

  Not a region manual over ``axis_name``: its edge would all-gather the
  batch over the Explicit axes (jax 0.10), so that each device would
  differentiate all its node's rows.
  """
  n = _mesh.axis_size(mesh, axis_name)

  def step(params, state, batch, shared, own):
    floats = _core.float_leaves(params)
    _, blocks = _placement.blocks(placed, params, mesh, None)

    def worker_grads(rows):
      value, grads = _core.loss_and_grads(loss_fn, params, rows, has_aux,
                                          micro_batches)
      grads = jax.tree.leaves(grads)
      return value, [grads[i] for i in floats]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      rows = jax.tree_util.tree_map_with_path(
          lambda path, x: _core.worker_rows(x, n, axis_name, path), batch)
      value, grads = jax.vmap(worker_grads, spmd_axis_name=axis_name)(rows)
    return _voted(tx, mesh, axis_name, blocks, floats, has_aux, loss_as,
                  own_loss)(shared, params, state, own, value, grads)
  return step


def _voted(tx, mesh: Mesh, axis_name: str, blocks: dict[str, P],
           floats: list[int], has_aux: bool = False, loss_as=None,
           own_loss: bool = False) -> Callable:
  """``(shared, params, state, own, value, grads) -> (params, state,
  loss)``: the update of every worker from its ``grads`` (its float
  leaves' gradients, stacked, each leaf voted in its ``blocks``) and its
  loss ``value``, optax's extra arguments one for all (``shared``) or a
  row a worker (``own``), in a region manual over ``axis_name`` alone
  (``dlion_jax._core.in_region``).
  """
  update = worker_update(tx, blocks)

  def local_update(shared, params, state, own, value, float_grads):
    row = lambda tree: jax.tree.map(lambda x: x[0], tree)
    state, own, value = row(state), row(own), row(value)
    float_grads = row(float_grads)
    whole = [jnp.zeros(np.shape(x), jnp.result_type(x))
             for x in jax.tree.leaves(params)]
    for i, g in zip(floats, float_grads):
      whole[i] = g
    extra = _extra_args.with_loss({**shared, **own}, value[0] if has_aux
                                  else value, loss_as, own_loss, axis_name)
    params, state = update(jax.tree.unflatten(jax.tree.structure(params),
                                              whole), state, params, extra)
    return (params, jax.tree.map(lambda x: x[None], state),
            _core.mean_of_workers(value, axis_name))

  typed = lambda tree: jax.tree.map(lambda x: jax.typeof(x).sharding.spec,
                                    tree)
  # What differs by worker comes last, the gradients last of all: the
  # exchange check reads them as varying; the shared arguments first,
  # among the constants.
  return _core.in_region(
      local_update, mesh, axis_name,
      in_specs=(P(), P(), P(axis_name), P(axis_name), P(axis_name),
                P(axis_name)),
      out_specs=(P(), P(axis_name), P()),
      out_typed=lambda shared, params, state, own, value, grads: (
          typed(params), typed(state), P()))
