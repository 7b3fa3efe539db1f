"""One worker's part of a step: its loss and gradients (averaged over
micro-batches, taken over the float leaves of the params only), its
optimizer update, and the mean of the losses over the workers. Each step of
:mod:`dlion_jax.parallel` is built of these.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _placement
from dlion_jax import rounds
from dlion_jax import shards
from dlion_jax import workers


def _differentiable(leaf) -> bool:
  try:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
  except TypeError:               # not an array: left to jax.grad to name
    return True


def _value_and_grad(loss_fn, has_aux):
  """``jax.value_and_grad`` over the floating-point leaves of the params
  only: the others (an integer step counter, a flag) get zero gradients of
  their own dtype, so that an optimizer can leave them out with
  ``optax.masked`` and they stay unchanged."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
  def value_and_grad(params, batch):
    leaves, treedef = jax.tree.flatten(params)
    floats = [_differentiable(x) for x in leaves]
    if all(floats):
      return grad_fn(params, batch)
    def on_floats(float_leaves, batch):
      it = iter(float_leaves)
      return loss_fn(treedef.unflatten(
          [next(it) if f else x for x, f in zip(leaves, floats)]), batch)
    value, grads = jax.value_and_grad(on_floats, has_aux=has_aux)(
        [x for x, f in zip(leaves, floats) if f], batch)
    it = iter(grads)
    # Constants, not zeros_like: those of per-worker typed (check_vma)
    # params would be typed per worker, and so would the unchanged leaves.
    return value, treedef.unflatten(
        [next(it) if f else jnp.zeros(jnp.shape(x), jnp.result_type(x))
         for x, f in zip(leaves, floats)])
  return value_and_grad


def loss_and_grads(loss_fn, params, batch, has_aux, micro_batches):
  """``value_and_grad``, averaged over ``micro_batches`` slices of batch."""
  grad_fn = _value_and_grad(loss_fn, has_aux)
  if micro_batches == 1:
    return grad_fn(params, batch)
  def split(x):
    rows = x.shape[0]
    if rows % micro_batches:
      raise ValueError(
          f"micro_batches={micro_batches} must divide the batch each call "
          f"of loss_fn sees, which has {rows} rows.")
    spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
    mesh = jax.sharding.get_abstract_mesh()
    if not spec or spec[0] is None:
      if not _placement.auto_axes(mesh):
        return x.reshape((micro_batches, rows // micro_batches) + x.shape[1:])
      # Rows the compiler may have sharded over Auto axes, unseen here: the
      # strided split keeps each device's share of each micro-batch on it.
      x = x.reshape((rows // micro_batches, micro_batches) + x.shape[1:])
      return jnp.moveaxis(x, 1, 0)
    k = math.prod(mesh.shape[a] for a in _placement.names(spec[0]))
    if (rows // micro_batches) % k:
      raise ValueError(
          f"micro_batches={micro_batches} leaves {rows // micro_batches} "
          f"rows of each worker's batch of {rows} a micro-batch, which the "
          f"{k} devices its rows are sharded over ({spec[0]!r}) cannot "
          f"share: each micro-batch must hold a multiple of {k} rows. Use "
          f"a micro_batches that divides {rows // k}, or a larger batch.")
    # Rows sharded over the compiler's axes: micro-batch m takes rows m,
    # m + micro_batches, ..., so that each device keeps its share of each.
    x = x.reshape((rows // micro_batches, micro_batches) + x.shape[1:],
                  out_sharding=P(spec[0], None, *spec[1:]))
    return jnp.moveaxis(x, 1, 0)
  def body(total, micro):
    return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None
  micro = jax.tree.map(split, batch)
  first = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
  (value, grads), _ = lax.scan(body, first,
                               jax.tree.map(lambda x: x[1:], micro))
  mean = lambda x: x / micro_batches
  return jax.tree.map(mean, value), jax.tree.map(
      lambda g: mean(g) if _differentiable(g) else g, grads)


def float_leaves(params: Any) -> list[int]:
  """The indices of the params leaves that get gradients: the others (an
  integer counter) get constant zeros, which would read as differing by
  worker when they come from a per-worker computation."""
  return [i for i, x in enumerate(jax.tree.leaves(params))
          if _differentiable(x)]


def worker_update(tx, placement=None):
  """One worker's optimizer step, ``(grads, state, params) -> (new params,
  state)``, the new params typed like the old. With a ``placement`` (Auto
  axes beside the workers', :func:`dlion_jax._placement.placement`) the
  update knows how each leaf is placed (:func:`dlion_jax.shards.placed`)."""
  def update(grads, state, params):
    state = workers.alike_state(state)  # check_vma: parallel.typed_alike
    with (contextlib.nullcontext() if placement is None
          else shards.placed(placement)):
      updates, state = tx.update(grads, state, params)
    # Local steps: a round's end puts every worker exactly on the anchor.
    new = rounds.restart_at_anchor(optax.apply_updates(params, updates),
                                   state)
    return jax.tree.map(shards.typed_like, new, params), state
  return update


def learn(loss_fn, tx, has_aux, micro_batches, placement=None):
  """One worker's loss, gradients and update: what must hold an exchange."""
  update = worker_update(tx, placement)
  def learn(params, local_params, state, batch):
    loss, grads = loss_and_grads(loss_fn, local_params, batch, has_aux,
                                 micro_batches)
    return *update(grads, state, params), loss
  return learn


def mean_of_workers(tree: Any, axis_name) -> Any:
  """``pmean`` of the losses (and aux) over the workers, floats narrower
  than float32 averaged in float32: a closer mean, and XLA:CPU aborts
  compiling a bfloat16 all-reduce in a ``shard_map`` manual over some of
  the mesh's axes only (jaxlib 0.10: "Invalid binary instruction opcode
  copy")."""
  def mean(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return lax.pmean(x, axis_name)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return lax.pmean(x.astype(wide), axis_name).astype(x.dtype)
  return jax.tree.map(mean, tree)
