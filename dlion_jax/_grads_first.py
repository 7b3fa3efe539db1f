"""The steps that take each worker's gradients before the vote: the
``shard_axis`` step and the step on a mesh with Explicit axes.

:func:`dlion_jax.parallel.make_train_step` builds one of three steps: the
plain one, a region manual over ``axis_name`` that differentiates and
updates (in ``parallel.py``), and the two here, which take the gradients
outside such a region (with ``shard_axis``, each node's mean gradient
reduce-scattered over the fast axis by
``dlion_jax._grads_first.node_mean_grads``; on Explicit axes, ``jax.vmap``
over the workers' rows) and then vote in a region manual over
``axis_name`` alone.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dlion_jax import _core
from dlion_jax import _extra_args
from dlion_jax import _placement
from dlion_jax._mesh import axis_size
from dlion_jax import _blocks


def hybrid_step(loss_fn, tx, mesh: Mesh, axis_name: str, shard_axis: str,
                specs, *, has_aux: bool, micro_batches: int,
                check_vma: bool, loss_as=None,
                per_worker_args=()) -> Callable:
  """:func:`dlion_jax.parallel.make_train_step`'s step with a
  ``shard_axis``: each node's mean gradient by
  ``dlion_jax._grads_first.node_mean_grads`` (manual over both axes), then
  the update of :func:`_voted`, each leaf's gradient and vote in the
  blocks :func:`dlion_jax._placement.blocks` gives it."""
  def step(params, state, batch, shared, own):
    paths, leaves = zip(*[(_blocks.path_key(p), x) for p, x in
                          jax.tree_util.tree_leaves_with_path(params)])
    floats = _core.float_leaves(params)
    param_specs, blocks = _placement.blocks(tx, specs, params, mesh,
                                            shard_axis)

    def device_grads(params, batch):
      value, grads = _core.loss_and_grads(loss_fn, params, batch,
                                                 has_aux, micro_batches)
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
    return _voted(tx, mesh, axis_name, blocks, floats, check_vma, has_aux,
                  loss_as, loss_as in per_worker_args)(
                      shared, params, state, own, value, grads)
  return step


def explicit_step(loss_fn, tx, mesh: Mesh, axis_name: str, specs, *,
                  has_aux: bool, micro_batches: int,
                  check_vma: bool, loss_as=None,
                  per_worker_args=()) -> Callable:
  """:func:`dlion_jax.parallel.make_train_step`'s step without
  ``shard_axis`` on a mesh with Explicit axes beside ``axis_name``: each
  worker's gradients by ``jax.vmap(..., spmd_axis_name=axis_name)`` over
  its rows of the batch (the loss sees its rows sharded over the other
  axes as placed, and whole params typed as placed, as in a plain
  ``jax.jit``), then the update of :func:`_voted`.

  Not a region manual over ``axis_name``: its edge would all-gather the
  batch over the Explicit axes (jax 0.10), so that each device would
  differentiate all its node's rows.
  """
  n = axis_size(mesh, axis_name)

  def step(params, state, batch, shared, own):
    floats = _core.float_leaves(params)
    _, blocks = _placement.blocks(tx, specs, params, mesh, None)

    def worker_grads(rows):
      value, grads = _core.loss_and_grads(loss_fn, params, rows,
                                                 has_aux, micro_batches)
      grads = jax.tree.leaves(grads)
      return value, [grads[i] for i in floats]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      rows = jax.tree_util.tree_map_with_path(
          lambda path, x: _core.worker_rows(x, n, axis_name, path), batch)
      value, grads = jax.vmap(worker_grads, spmd_axis_name=axis_name)(rows)
    return _voted(tx, mesh, axis_name, blocks, floats, check_vma, has_aux,
                  loss_as, loss_as in per_worker_args)(
                      shared, params, state, own, value, grads)
  return step


def _voted(tx, mesh: Mesh, axis_name: str, blocks: dict[str, P],
           floats: list[int], check_vma: bool, has_aux: bool = False,
           loss_as=None, own_loss: bool = False) -> Callable:
  """``(shared, params, state, own, value, grads) -> (params, state,
  loss)``: the update of every worker from its ``grads`` (its float
  leaves' gradients, stacked, each leaf voted in its ``blocks``) and its
  loss ``value``, optax's extra arguments one for all (``shared``) or a
  row a worker (``own``), in a region manual over ``axis_name`` alone
  (``dlion_jax._core.in_region``).
  """
  del check_vma    # the region is checked on its first trace (ExchangeCheck)
  update = _core.worker_update(tx, blocks)

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
