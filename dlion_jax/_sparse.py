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

SparseLoCo's values (Sarfi et al., 2025: top-k of 1-3 % of each chunk,
2-bit values, a scale a chunk) are options: ``value_bits=2`` adds a
magnitude bit to each word (below or above the mean magnitude, each side
decoded as its own mean, two scales a group), and a ``group`` of chunks
shares its scales instead of the whole leaf (then every scale is that
device's own part's, on a node too).
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
  """Which entries vote (``keep`` of every ``chunk``), what a kept entry
  says (``value_bits``: 1, its sign; 2, its sign and whether its
  magnitude is above its group's mean) and how many chunks share a scale
  (``group``; 0: the whole leaf)."""
  chunk: int
  keep: int
  value_bits: int = 1
  group: int = 0

  @property
  def word(self) -> jnp.dtype:
    """The dtype of one kept entry's word (position and value)."""
    bits = self.chunk.bit_length() - 1 + self.value_bits
    return jnp.dtype(jnp.uint8 if bits <= 8 else jnp.uint16)

  @property
  def scales(self) -> int:
    """float32 scales a group (or leaf) sends: one a magnitude level."""
    return self.value_bits

  def bits_per_entry(self) -> float:
    """Bits one worker sends per entry of a leaf: its words, and its
    groups' scales (a leaf's scales aside)."""
    words = self.keep * 8 * self.word.itemsize / self.chunk
    if not self.group:
      return words
    return words + 32 * self.scales / (self.group * self.chunk)


def sparsity(chunk: int, keep: int, value_bits: int = 1,
             scale_chunk: int | None = None) -> Sparsity:
  """Checked options of the sparse vote."""
  chunk = _checks.positive_int("sparse_chunk", chunk)
  keep = _checks.positive_int("sparse_keep", keep)
  value_bits = _checks.static_int("sparse_value_bits", value_bits)
  if value_bits not in (1, 2) or isinstance(value_bits, bool):
    raise ValueError(
        f"sparse_value_bits={value_bits!r} must be 1 (a kept entry's sign) "
        "or 2 (its sign and one bit of magnitude).")
  top = MAX_CHUNK >> (value_bits - 1)
  if chunk < 2 or chunk > top or chunk & (chunk - 1):
    raise ValueError(
        f"sparse_chunk={chunk} must be a power of two from 2 to {top} "
        f"(a kept entry's position and {value_bits}-bit value fit one 8- "
        "or 16-bit word): e.g. 128 (1 entry in 128, 0.78 %) or 64.")
  if keep >= chunk:
    raise ValueError(
        f"sparse_keep={keep} must be below sparse_chunk={chunk}: the vote "
        "sends keep entries of every chunk; for all of them use the dense "
        "vote (sparse_chunk=None).")
  group = 0
  if scale_chunk is not None:
    scale_chunk = _checks.positive_int("scale_chunk", scale_chunk)
    if scale_chunk % chunk:
      raise ValueError(
          f"scale_chunk={scale_chunk} must be a multiple of sparse_chunk="
          f"{chunk}: a scale covers whole chunks of the sparse vote. Give "
          f"e.g. scale_chunk={chunk * 32}, or None for a scale a leaf.")
    group = scale_chunk // chunk
  return Sparsity(chunk, keep, value_bits, group)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
  flat = x.ravel()
  return jnp.pad(flat, (0, -flat.size % chunk)).reshape(-1, chunk)


def _per_group(x: jax.Array, group: int) -> jax.Array:
  """The sums over each ``group`` of rows of ``[rows, keep]`` ``x``
  (zero-padded to whole groups): ``[groups]``."""
  rows = jnp.pad(x, ((0, -x.shape[0] % group), (0, 0)))
  return rows.reshape(-1, group * x.shape[1]).sum(1)


def _group_of_chunks(sparse: Sparsity, chunks: int) -> int:
  return sparse.group or max(chunks, 1)


def _group_means(top, chosen, group, shard, wide):
  """The mean of ``top``'s entries (those ``chosen``; None: all) in each
  group of ``group`` chunks, 0 where none is; a leaf's over its shards.
  One group of every kept entry: their sum times a constant reciprocal, a
  rounding the reference can reproduce."""
  values = top if chosen is None else jnp.where(chosen, top, 0)
  total = _per_group(values, group)
  if chosen is None and shard is None and group * top.shape[1] >= top.size:
    return total * wide.type(1.0 / max(top.size, 1))
  count = _per_group(jnp.ones_like(top) if chosen is None
                     else chosen.astype(wide), group)
  if shard is not None:
    total, count = shard.sum(total), shard.sum(count)
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0)


def encode(p: jax.Array, sparse: Sparsity,
           shard: _blocks.LeafShard | None = None):
  """One worker's words of a leaf, its scales and what they say.

  Args:
    p: the values to vote on, one leaf (or, with ``shard``, this device's
      part of one, cut in chunks of its own).
    sparse: which entries vote, and what each says.
    shard: the leaf ``p`` is a part of: a leaf's scale is the whole leaf's
      (a group's is its part's own).

  Returns:
    ``(words, scales, said)``: the ``[chunks, keep]`` words
    (``position``, then with 2-bit values whether the magnitude is above
    the group's mean, then the sign, lowest bit last); the float32
    ``[groups, value_bits]`` scales (the mean magnitude of the kept
    entries of each group, non-finite ones counting 0; with 2-bit values
    the means of those at or below it and of those above it); and
    ``s * q`` in ``p``'s shape, what the worker sent as a value (the error
    feedback's residual is ``p - said``).
  """
  wide = jnp.promote_types(p.dtype, jnp.float32)
  x = _chunks(p.astype(wide), sparse.chunk)
  magnitude = jnp.where(jnp.isfinite(x), jnp.abs(x), 0)
  top, where = lax.top_k(magnitude, sparse.keep)
  positive = jnp.take_along_axis(x, where, axis=1) > 0
  group = _group_of_chunks(sparse, x.shape[0])
  shard = None if sparse.group else shard
  mean = _group_means(top, None, group, shard, wide)
  words = where
  if sparse.value_bits == 1:
    scales = mean[:, None]
  else:
    chunk_mean = jnp.repeat(mean, group)[:x.shape[0], None]
    above = top > chunk_mean
    scales = jnp.stack([_group_means(top, side, group, shard, wide)
                        for side in (~above, above)], axis=1)
    scales = jnp.where(scales > 0, scales, mean[:, None])
    words = 2 * words + above
  words = (2 * words + positive).astype(sparse.word)
  said = _decoded(words, scales, sparse, x.shape)[:p.size].reshape(p.shape)
  return words, scales, said


def _values(words: jax.Array, scales: jax.Array, sparse: Sparsity,
            group: int) -> jax.Array:
  """The ``[chunks, keep]`` values the words of ``[groups, value_bits]``
  scales say."""
  level = (words >> 1) & 1 if sparse.value_bits == 2 else jnp.zeros_like(
      words)
  of_chunk = jnp.arange(words.shape[0]) // group
  size = scales[of_chunk[:, None], level.astype(jnp.int32)]
  return jnp.where(words & 1, size, -size)


def _decoded(words: jax.Array, scales: jax.Array, sparse: Sparsity,
             shape) -> jax.Array:
  """``s q`` as a flat vector of ``shape[0] * shape[1]`` entries."""
  chunks, chunk = shape
  position = (words >> sparse.value_bits).astype(jnp.int32)
  flat = jnp.arange(chunks, dtype=jnp.int32)[:, None] * chunk + position
  values = _values(words, scales, sparse, _group_of_chunks(sparse, chunks))
  return jnp.zeros(chunks * chunk, scales.dtype).at[flat.ravel()].set(
      values.ravel(), unique_indices=True)


def gathered(x: jax.Array, axis_name) -> jax.Array:
  """Every worker's ``x``, stacked on a leading axis, on every worker."""
  return _collectives.exchanged(
      lambda x: lax.all_gather(x, axis_name),
      lambda rows: _mesh.place(rows, P()), axis_name)(x)


def clipped(scales: jax.Array, clip: float, count) -> jax.Array:
  """Every worker's ``scales`` (stacked on a leading axis, NaN where a
  worker is absent), each at most ``clip`` times the median of the
  ``count`` present workers' (the mean of the middle two where ``count``
  is even), 0 where absent. A scale within that of the median is kept
  bit for bit; fewer than half the present workers can move the median
  only within the others' range."""
  ordered = jnp.sort(scales, axis=0)          # NaN (the absent) last
  low = jnp.take(ordered, jnp.maximum(count - 1, 0) // 2, axis=0)
  high = jnp.take(ordered, count // 2, axis=0)
  limit = clip * (low * 0.5 + high * 0.5)
  return jnp.where(jnp.isnan(scales), 0, jnp.minimum(scales, limit))


def mean_of_votes(leaves: list[jax.Array], sparse: Sparsity, *,
                  axis_name, num_workers: int, clip: float | None = None,
                  present=None):
  """The sparse vote of one worker's ``leaves`` over ``axis_name``.

  Every leaf's words travel in one ``all_gather`` and the scales in a
  second. Where the mesh has axes the compiler owns beside ``axis_name``
  (a hybrid or sharded step), each device votes on its own part of every
  leaf, in chunks of its own, as the dense vote does
  (``dlion_jax._blocks.on_own_shards``): it sends only that part's words.
  With ``clip`` every worker's scales are :func:`clipped` before the
  decode. ``present`` (or None): ``(ok, abstained)``, whether this
  worker takes part (its leaves then 0) and how many do not: an absent
  worker's scales go out as NaN and decode as 0, and the sum is divided
  by the present workers' count.

  Returns:
    ``(means, said)``: per leaf, the decoded mean ``U`` (float32, the
    same on every worker) and this worker's own ``s q``.
  """
  axes = _blocks.compiler_axes(axis_name, leaves)
  options = dict(axis_name=axis_name, num_workers=num_workers, clip=clip)
  if not axes:
    return _mean_of_votes(leaves, sparse, present=present, **options)

  def own_part(both, *, leaf_shards, constants):
    return list(_mean_of_votes(both[0], sparse,
                               shards=leaf_shards[:len(leaves)],
                               present=constants or None, **options))
  # Two outputs a leaf, so the leaves twice: the mean and what was said.
  means, said = _blocks.on_own_shards(own_part, ([leaves, leaves],), axes,
                                      tuple(present or ()))
  return means, said


def _mean_of_votes(leaves, sparse, *, axis_name, num_workers, clip=None,
                   present=None, shards=None):
  coded = [encode(p, sparse, shard) for p, shard in zip(
      leaves, shards or [None] * len(leaves))]
  words = gathered(jnp.concatenate([w.ravel() for w, _, _ in coded]),
                   axis_name)
  scales = jnp.concatenate([s.ravel() for _, s, _ in coded])
  count = num_workers
  if present is not None:
    ok, abstained = present
    count = num_workers - abstained
    scales = jnp.where(ok, scales, jnp.nan)
  scales = gathered(scales, axis_name)
  if clip is not None:
    scales = clipped(scales, clip, count)
  elif present is not None:
    scales = jnp.where(jnp.isnan(scales), 0, scales)
  means, start, scale_start = [], 0, 0
  for p, (mine, own, _) in zip(leaves, coded):
    shape = (mine.shape[0], sparse.chunk)
    theirs = lax.slice_in_dim(words, start, start + mine.size, axis=1
                              ).reshape((num_workers,) + mine.shape)
    their_scales = lax.slice_in_dim(
        scales, scale_start, scale_start + own.size, axis=1).reshape(
            (num_workers,) + own.shape)
    start, scale_start = start + mine.size, scale_start + own.size

    def add(j, total, theirs=theirs, their_scales=their_scales,
            shape=shape):
      return total + _decoded(theirs[j], their_scales[j], sparse, shape)
    total = lax.fori_loop(0, num_workers, add,
                          jnp.zeros(shape[0] * shape[1], scales.dtype))
    mean = total * _collectives.reciprocal_of_count(count, num_workers,
                                                    scales.dtype)
    means.append(mean[:p.size].reshape(p.shape))
  return means, [said for _, _, said in coded]
