"""The sparse vote: the largest entries of each chunk, their positions and
signs in one word each, gathered from every worker.

A leaf of ``n`` entries is cut into ``ceil(n / chunk)`` chunks of ``chunk``
entries (the last zero-padded). Each worker keeps the ``keep`` entries of
largest magnitude in every chunk and sends, for each, one word
``2 * position + (value > 0)``: a ``uint8`` where ``chunk <= 128``, else
a ``uint16``. Beside them it sends one float32 per leaf, ``s``, the mean
magnitude of what it kept. Every worker gathers every worker's words and
scales and decodes the same mean

.. math:: U = \\tfrac1N \\textstyle\\sum_j s_j\\, q_j,

with ``q_j`` worker ``j``'s ``+-1`` at its kept positions and 0 elsewhere.
At ``chunk = 128, keep = 1`` a worker sends 8 bits for 128 entries and
receives ``N - 1`` times that. Where worker ``j``'s kept positions
coincide with another's the sum runs in worker order (one scatter a
worker, each to distinct positions), so every worker decodes the same
bits on every backend.

A chunk whose entries are all 0 still sends a word: its first entry at
``-s``, as the binary vote counts 0 as ``-1``; error feedback takes it
back in the next round. Params the inner optimizer never moves are best
frozen in the outer step too (:func:`dlion_jax.local_steps`).

SparseLoCo (Sarfi et al., 2025) sends top-k of 1-3 % of each chunk with
2-bit values and error feedback; this sends the sign alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _blocks
from dlion_jax import _checks
from dlion_jax import _collectives
from dlion_jax import _mesh

MAX_CHUNK = 2**15


class Sparsity(NamedTuple):
  """Which entries vote: ``keep`` of every ``chunk``."""
  chunk: int
  keep: int

  @property
  def word(self) -> jnp.dtype:
    """The dtype of one kept entry's word (position and sign)."""
    return jnp.dtype(jnp.uint8 if self.chunk <= 128 else jnp.uint16)

  def bits_per_entry(self) -> float:
    """Bits one worker sends per entry of a leaf, its scale aside."""
    return self.keep * 8 * self.word.itemsize / self.chunk


def sparsity(chunk: int, keep: int) -> Sparsity:
  """Checked options of the sparse vote."""
  chunk = _checks.positive_int("sparse_chunk", chunk)
  keep = _checks.positive_int("sparse_keep", keep)
  if chunk < 2 or chunk > MAX_CHUNK or chunk & (chunk - 1):
    raise ValueError(
        f"sparse_chunk={chunk} must be a power of two from 2 to {MAX_CHUNK} "
        "(a kept entry's position and sign fit one 8- or 16-bit word): e.g. "
        "128 (1 entry in 128, 0.78 %) or 64.")
  if keep >= chunk:
    raise ValueError(
        f"sparse_keep={keep} must be below sparse_chunk={chunk}: the vote "
        "sends keep entries of every chunk; for all of them use the dense "
        "vote (sparse_chunk=None).")
  return Sparsity(chunk, keep)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
  flat = x.ravel()
  return jnp.pad(flat, (0, -flat.size % chunk)).reshape(-1, chunk)


def encode(p: jax.Array, sparse: Sparsity,
           shard: _blocks.LeafShard | None = None):
  """One worker's words of a leaf, its scale and what they say.

  Args:
    p: the values to vote on, one leaf (or, with ``shard``, this device's
      part of one, cut in chunks of its own).
    sparse: which entries vote.
    shard: the leaf ``p`` is a part of: the scale is the whole leaf's.

  Returns:
    ``(words, scale, said)``: the ``[chunks, keep]`` words, the float32
    mean magnitude ``s`` of the kept entries (non-finite ones count 0)
    and ``s * q`` in ``p``'s shape, what the worker sent as a value
    (the error feedback's residual is ``p - said``).
  """
  wide = jnp.promote_types(p.dtype, jnp.float32)
  x = _chunks(p.astype(wide), sparse.chunk)
  magnitude = jnp.where(jnp.isfinite(x), jnp.abs(x), 0)
  top, where = lax.top_k(magnitude, sparse.keep)
  positive = jnp.take_along_axis(x, where, axis=1) > 0
  words = (2 * where + positive).astype(sparse.word)
  total, kept = jnp.sum(top), top.size
  if shard is not None:
    total, kept = shard.sum(total), shard.sum(jnp.asarray(kept, wide))
    scale = total / kept
  else:
    scale = total * wide.type(1.0 / max(kept, 1))   # an empty leaf: 0
  said = _decoded(words, scale, x.shape)[:p.size].reshape(p.shape)
  return words, scale, said


def _signs(words: jax.Array, scale: jax.Array) -> jax.Array:
  return jnp.where(words & 1, scale, -scale)


def _decoded(words: jax.Array, scale: jax.Array, shape) -> jax.Array:
  """``s q`` as a flat vector of ``shape[0] * shape[1]`` entries."""
  chunks, chunk = shape
  flat = (jnp.arange(chunks, dtype=jnp.int32)[:, None] * chunk
          + (words >> 1).astype(jnp.int32))
  return jnp.zeros(chunks * chunk, scale.dtype).at[flat.ravel()].set(
      _signs(words, scale).ravel(), unique_indices=True)


def _gathered(x: jax.Array, axis_name) -> jax.Array:
  """Every worker's ``x``, stacked on a leading axis, on every worker."""
  return _collectives.exchanged(
      lambda x: lax.all_gather(x, axis_name),
      lambda rows: _mesh.place(rows, P()), axis_name)(x)


def mean_of_votes(leaves: list[jax.Array], sparse: Sparsity, *,
                  axis_name, num_workers: int):
  """The sparse vote of one worker's ``leaves`` over ``axis_name``.

  Every leaf's words travel in one ``all_gather`` and the scales in a
  second. Where the mesh has axes the compiler owns beside ``axis_name``
  (a hybrid or sharded step), each device votes on its own part of every
  leaf, in chunks of its own, as the dense vote does
  (``dlion_jax._blocks.on_own_shards``): it sends only that part's words.

  Returns:
    ``(means, said)``: per leaf, the decoded mean ``U`` (float32, the
    same on every worker) and this worker's own ``s q``.
  """
  axes = _blocks.compiler_axes(axis_name, leaves)
  if not axes:
    return _mean_of_votes(leaves, sparse, axis_name=axis_name,
                          num_workers=num_workers)

  def own_part(both, *, leaf_shards, constants):
    del constants
    return list(_mean_of_votes(both[0], sparse, axis_name=axis_name,
                               num_workers=num_workers,
                               shards=leaf_shards[:len(leaves)]))
  # Two outputs a leaf, so the leaves twice: the mean and what was said.
  means, said = _blocks.on_own_shards(own_part, ([leaves, leaves],), axes)
  return means, said


def _mean_of_votes(leaves, sparse, *, axis_name, num_workers, shards=None):
  coded = [encode(p, sparse, shard) for p, shard in zip(
      leaves, shards or [None] * len(leaves))]
  sizes = [w.size for w, _, _ in coded]
  words = _gathered(jnp.concatenate([w.ravel() for w, _, _ in coded]),
                    axis_name)
  scales = _gathered(jnp.stack([s for _, s, _ in coded]), axis_name)
  means, start = [], 0
  for k, (p, size) in enumerate(zip(leaves, sizes)):
    shape = (size // sparse.keep, sparse.chunk)
    mine = lax.slice_in_dim(words, start, start + size, axis=1).reshape(
        num_workers, shape[0], sparse.keep)
    start += size

    def add(j, total, mine=mine, k=k, shape=shape):
      return total + _decoded(mine[j], scales[j, k], shape)
    total = lax.fori_loop(0, num_workers, add,
                          jnp.zeros(shape[0] * shape[1], scales.dtype))
    mean = total * scales.dtype.type(1.0 / num_workers)
    means.append(mean[:p.size].reshape(p.shape))
  return means, [said for _, _, said in coded]
