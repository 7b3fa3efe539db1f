"""The collectives both doors use: a step's exchanges over the workers'
axis, whether the workers are a ``shard_map``'s manual axis or a
``jax.vmap`` axis named after mesh axes (the plain jitted step).

Some collectives do not survive ``vmap`` as they are: batched, an
``all_to_all`` or an ``all_gather`` of the packed votes becomes one
all-reduce of every worker's whole message (14 bits a parameter at 8
workers, against 2.275 and 7). :func:`exchanged` gives such an exchange a
batching rule of its own, which states it as placement instead: the
``[N, W]`` words are resharded so that each device holds its column of
every worker's words (one all-to-all), and the tally resharded whole (one
all-gather). The result is the same on every worker, bit for bit the
``shard_map`` step's; so is what a device sends. On a mesh with more axes
each device votes on its own block of every leaf (:func:`blockwise`): it
sends across the workers' axis only that block's votes.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _checks
from dlion_jax import _drift
from dlion_jax import _mesh


def mapped_over_mesh(axis_name: Hashable | tuple) -> bool:
  """Whether ``axis_name`` is a ``jax.vmap`` axis named after axes of the
  enclosing mesh (``spmd_axis_name``), rather than a ``shard_map``'s
  manual axis, a ``vmap`` on its own or no axis bound at all."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not all(a in mesh.axis_names and a not in mesh.manual_axes
                           for a in _mesh.names(axis_name)):
    return False
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def mapped_mesh_axes() -> tuple[str, ...]:
  """The axes of the enclosing mesh bound as ``jax.vmap`` axes here (the
  workers of :func:`update` or :func:`stacked`), none manual."""
  mesh = jax.sharding.get_abstract_mesh()
  return () if mesh.empty else tuple(
      a for a in mesh.axis_names
      if a not in mesh.manual_axes and mapped_over_mesh(a))


def exchanged(manual: Callable[[Any], Any], stacked: Callable[[Any], Any],
              axis_name) -> Callable[[Any], Any]:
  """``manual``, one worker's exchange of ``x`` (an array or a pytree of
  them) over ``axis_name``, whose result is the same on every worker;
  under ``jax.vmap`` over a mesh axis (:func:`mapped_over_mesh`)
  ``stacked`` instead, given every worker's ``x`` as arrays with a leading
  axis of workers and returning the result once. ``stacked`` says with
  :func:`place` where its arrays lie, so that the compiler moves them
  between the workers' devices.

  Inside :func:`blockwise` (each device of the fast axes voting on its own
  block of the leaves) ``stacked`` runs block by block: every worker's
  words of a block lie on the devices of that block, and move across the
  workers' axis only."""
  if not mapped_over_mesh(axis_name):
    return manual
  n = _mesh.mesh_size(axis_name)
  blocks = _BLOCK_AXES.get()

  def run(rows, blocked):
    lead = (axis_name, blocks) if blocked else (axis_name,)
    fn = jax.vmap(stacked, in_axes=1,
                  spmd_axis_name=blocks) if blocked else stacked
    if _mesh.explicit(P(*lead)):
      return fn(rows)
    # On Auto axes a sharding constraint leaves the compiler free to gather
    # more than the placement asks: the axes are made Explicit for the
    # exchange.
    specs = jax.tree.map(
        lambda r: P(*lead, *(None,) * (r.ndim - len(lead))), rows)
    return jax.sharding.explicit_axes(
        fn, axes=tuple(a for entry in lead for a in _mesh.names(entry)),
        in_sharding=(specs,))(rows)

  def broadcast(x, batched, size):
    return jax.tree.map(
        lambda leaf, b: leaf if b else jnp.broadcast_to(
            leaf, (size,) + leaf.shape), x, batched)

  def over_workers(blocked):
    # Not batched (the same on every worker already), x is every row.
    f = jax.custom_batching.custom_vmap(lambda x: run(
        broadcast(x, jax.tree.map(lambda _: False, x), n), blocked))

    @f.def_vmap
    def _(axis_size, in_batched, x):
      del axis_size
      out = run(broadcast(x, in_batched[0], n), blocked)
      return out, jax.tree.map(lambda _: False, out)
    return f
  if blocks is None:
    return over_workers(False)

  # The block's index, batched over the blocks, makes the innermost batching
  # rule the blocks' even where x is the same for every block: this rule
  # hands every block's x to the workers' rule at once.
  over_blocks = jax.custom_batching.custom_vmap(
      lambda x, index: over_workers(False)(x))

  @over_blocks.def_vmap
  def _(axis_size, in_batched, x, index):
    del index
    out = over_workers(True)(broadcast(x, in_batched[0], axis_size))
    return out, jax.tree.map(lambda _: True, out)
  return lambda x: over_blocks(x, lax.axis_index(BLOCKS))


# The jax.vmap axis of the blocks in blockwise, and the mesh axes they lie
# on while it is traced.
BLOCKS = "dlion_jax.blocks"
_BLOCK_AXES = contextvars.ContextVar("block_axes", default=None)


def blockwise(fn: Callable, axes: tuple[str, ...]) -> Callable:
  """``fn`` mapped over a leading axis of blocks, one block on each device
  of the mesh axes ``axes`` (``jax.vmap`` named :data:`BLOCKS`), where
  the workers are a ``jax.vmap`` axis too: its exchanges
  (:func:`exchanged`) move each block between the workers' devices of
  that block only (see ``dlion_jax._blocks.on_own_shards``)."""
  mapped = jax.vmap(fn, axis_name=BLOCKS, spmd_axis_name=axes)

  def run(*args):
    token = _BLOCK_AXES.set(tuple(axes))
    try:
      return mapped(*args)
    finally:
      _BLOCK_AXES.reset(token)
  return run


def sum_over_blocks(x: jax.Array) -> jax.Array:
  """``x`` summed over the blocks of :func:`blockwise` (inside it), one
  value for every block: the rows of the blocks added in order."""
  add = jax.custom_batching.custom_vmap(lambda x, index: x)

  @add.def_vmap
  def _(axis_size, in_batched, x, index):
    del index
    return x.sum(0) if in_batched[0] else x * axis_size, False
  # The block's index, always batched, brings the blocks' rule first.
  return add(x, lax.axis_index(BLOCKS))


def psum(x: Any, axis_name) -> Any:
  """:func:`jax.lax.psum` of ``x`` (an array or a pytree) over the workers,
  in either form: batched, the sum of every worker's row in its dtype (an
  integer sum wraps as the ``psum`` does), which the compiler all-reduces.
  (JAX's own batching of a ``psum`` over a mesh axis shards its result
  over the axis, and fails where the axis does not divide it.)"""
  return exchanged(
      lambda x: lax.psum(x, axis_name),
      lambda rows: jax.tree.map(
          lambda r: _mesh.place(r.sum(0, dtype=r.dtype), P()), rows),
      axis_name)(x)


def pmean(x: Any, axis_name) -> Any:
  """:func:`jax.lax.pmean` of ``x`` over the workers, in either form (the
  sum, then divided by their number, as ``pmean`` does)."""
  return exchanged(
      lambda x: lax.pmean(x, axis_name),
      lambda rows: jax.tree.map(
          lambda r: _mesh.place(r.sum(0, dtype=r.dtype) / r.shape[0], P()),
          rows),
      axis_name)(x)


def abstainers(tree: Any, axis_name, size: int) -> tuple[jax.Array, jax.Array]:
  """Whether this worker's ``tree`` is all finite (a bool scalar), and how
  many of the ``size`` workers' are not (int32, the same on every worker:
  one :func:`psum`). The test reads ``tree`` through a barrier: fused
  with the reads of what uses the tree, it could change how that rounds
  (XLA:CPU's sibling fusion), and a run with every value finite would
  differ from one without the test."""
  ok = _checks.all_finite(lax.optimization_barrier(tree))
  count = (~ok).astype(jnp.int32)
  return ok, psum(count, axis_name) if size > 1 else count


def reciprocal_of_count(count, size: int, dtype) -> jax.Array:
  """``1 / count`` in ``dtype`` for ``count`` in ``0 .. size`` (an int, or
  a traced int32 scalar), 0 for 0: the constant a :func:`pmean` over
  ``count`` workers multiplies their sum by (XLA folds its division by the
  workers' number into that product), so a mean over the workers present
  rounds as the ``pmean`` of those workers alone."""
  wide = np.float64 if jnp.dtype(dtype).itemsize > 4 else np.float32
  table = np.concatenate([[0], wide(1) / np.arange(1, size + 1, dtype=wide)])
  return jnp.asarray(table.astype(dtype))[count]


def present_mean(x: Any, axis_name, count, size: int) -> Any:
  """:func:`pmean` of ``x`` (a pytree) over the ``count`` workers present of
  ``size``, ``x`` zero on every worker absent: the :func:`psum`, times
  :func:`reciprocal_of_count` (0 where none is present). Where the
  all-reduce sums in the workers' order (XLA:CPU's) the zeros add
  nothing, and the mean is the ``pmean`` of the present workers alone, bit
  for bit."""
  return jax.tree.map(
      lambda total: total * reciprocal_of_count(count, size, total.dtype),
      psum(x, axis_name))


def alike(x: jax.Array, axis_name=None) -> jax.Array:
  """``x``, a value every worker holds alike (a step count in per-worker
  state), as one value.

  Inside ``shard_map(check_vma=True)`` JAX types it per worker, and so
  anything computed from it after the vote (a learning rate, the new
  params); there it takes its ``pmax`` over the axes it is typed varying
  over, one small all-reduce. In the batched form over ``axis_name``
  (:func:`mapped_over_mesh`) it is a row per worker, and the same
  maximum makes it one. Elsewhere it is returned as it is.
  """
  if axis_name is not None and mapped_over_mesh(axis_name):
    return exchanged(lambda x: lax.pmax(x, axis_name),
                     lambda rows: rows.max(0), axis_name)(x)
  axes = tuple(sorted(_drift.typed_varying_axes(x), key=str))
  return lax.pmax(x, axes) if axes else x


def alike_state(state: Any, axis_name=None) -> Any:
  """``state`` with what every worker's optimizer state holds alike made
  one value by :func:`alike`: its integer scalars (step counts: an optax
  schedule's, :class:`optax.MultiSteps`') and the hyperparameters of
  :func:`optax.inject_hyperparams`. A state whose class says
  ``counts_read_alike`` (Distributed Lion's, whose transform does it where
  it reads its count) is left as it is: that would cost an all-reduce for
  nothing."""
  def walk(x):
    if getattr(x, "counts_read_alike", False):
      return x
    if isinstance(x, optax.ApplyIfFiniteState):
      return x._replace(inner_state=alike_state(x.inner_state, axis_name))
    if isinstance(x, _INJECTED):
      return type(x)(*[
          jax.tree.map(lambda h: alike(h, axis_name), value)
          if field == "hyperparams" else alike_state(value, axis_name)
          for field, value in zip(x._fields, x)])
    if (isinstance(x, jax.Array) and not x.ndim
        and jnp.issubdtype(x.dtype, jnp.integer)):
      return alike(x, axis_name)
    return x
  return jax.tree.map(walk, state, is_leaf=lambda x: isinstance(
      x, _INJECTED + (optax.ApplyIfFiniteState,)) or getattr(
          x, "counts_read_alike", False))

_INJECTED = (optax.InjectHyperparamsState,
             optax.InjectStatefulHyperparamsState)
