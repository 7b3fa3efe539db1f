"""What a worker sends: the packed words of a message's runs.

The message of :class:`dlion_jax.message.MessageLayout`, built from rows
of leaves (a gradient, a momentum, ...) whose ``combine`` is voted on,
run by run: the big leaves alone, each encoded and packed on its own
(through the fused kernels where they take it), the small ones of each
dtype laid end to end and encoded once. Used by
:mod:`dlion_jax._exchange`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dlion_jax import _fused
from dlion_jax import _mesh
from dlion_jax import _packing
from dlion_jax import _quantize


def run_starts(rows, num_alone: int) -> tuple[int, ...]:
  """First row of each packing run: each of the first ``num_alone`` rows
  alone, then one run per dtype of the rest (see :func:`packed_message`)."""
  return tuple(k for k in range(len(rows)) if k <= num_alone
               or dtypes_of(rows[k]) != dtypes_of(rows[k - 1]))


def packed_message(rows, combine, alone, layout, spec, fusion, *,
                    batched: bool = False) -> jax.Array:
  """The packed message: ``combine(*row)``'s vote codes at each row's offset.

  The first ``len(alone)`` rows (big leaves, or every leaf of an L1-scaled vote;
  ``alone`` holds their shards, see :func:`aggregate`) are encoded and packed
  one by one and written in place: XLA:CPU fuses a concatenate of a few big
  operands into the packing loop that reads it, several times slower. The
  others, small leaves of a sign vote, are laid end to end per dtype (one
  ``concatenate`` of the gradients, one of the momenta) and ``combine``, the
  encoding and the packing run once on each run: a few operations however many
  leaves there are, since compile time grows with the number of operations. Each
  run is packed planar (:meth:`MessageLayout.pack`).

  ``batched`` (the workers a ``jax.vmap`` axis over the mesh: a row each of the
  message) concatenates the runs and their padding instead: the partitioned
  in-place write of each run into the batched message cost XLA:CPU a pass over
  the whole message a run (design notes, "The workers as a leading axis").
  """
  if batched:
    return jnp.concatenate(_laid_end_to_end(rows, combine, alone, layout,
                                            spec, fusion))
  # Behind a barrier XLA cannot rewrite the first write into these zeros
  # as a pad of that run, which XLA:CPU fuses with the run's encoding and
  # packing into one loop over the whole message, a bounds check per word
  # and not vectorised (design notes, "Straight passes").
  message = lax.optimization_barrier(
      jnp.zeros(layout.words, layout.word_dtype))
  for first, end in zip(layout.runs, layout.runs[1:] + (len(rows),)):
    message = lax.dynamic_update_slice(
        message, run_words(rows, first, end, combine, alone, layout, spec,
                            fusion),
        (layout.offsets[first] // layout.digits_per_word,))
  return message


def message_by_run(rows, combine, alone, layout, spec, fusion) -> dict:
  """The message in pieces by their first word, for a strategy that sums
  them where they lie (:attr:`dlion_jax.strategies.Strategy.sums`): a
  fused kernel's words of a leaf whose rows are not 128 lanes in the
  shape it wrote them, each other stretch of runs laid end to end. Laid
  into one flat message, such a leaf's words were relaid out on the way
  in and out (XLA:TPU, ``psum_int8``, the 1B GPT's training step of
  :mod:`dlion_jax.bench.aot`: 68.7 bytes a parameter a chip, 50.9 so)."""
  pieces, flat = {}, []
  ends = layout.runs[1:] + (len(rows),)
  for first, end, (word, _) in zip(layout.runs, ends, layout.run_words):
    apart = fusion.apart(rows, first, len(alone), layout, spec)
    words = run_words(rows, first, end, combine, alone, layout, spec, fusion,
                       flat=not apart)
    if apart:
      pieces[word] = words
      flat = []
      continue
    if not flat:
      pieces[word] = flat
    flat.append(words)
  return {word: jnp.concatenate(piece) if isinstance(piece, list) else piece
          for word, piece in pieces.items()}


def _laid_end_to_end(rows, combine, alone, layout, spec,
                     fusion) -> list[jax.Array]:
  """Each run's packed words, and zero words for the padding around them:
  the message in order."""
  parts, at = [], 0
  for first, end in zip(layout.runs, layout.runs[1:] + (len(rows),)):
    offset = layout.offsets[first] // layout.digits_per_word
    if offset > at:
      parts.append(jnp.zeros(offset - at, layout.word_dtype))
    parts.append(run_words(rows, first, end, combine, alone, layout, spec,
                            fusion))
    at = offset + parts[-1].shape[0]
  if layout.words > at:
    parts.append(jnp.zeros(layout.words - at, layout.word_dtype))
  return parts


def run_words(rows, first, end, combine, alone, layout, spec,
               fusion, *, flat: bool = True) -> jax.Array:
  """The packed words of the run of rows ``first .. end - 1`` (a fused
  kernel's, unless ``flat``, in the shape it wrote them)."""
  m = layout.digits_per_word
  if fusion and fusion.takes(rows, first, len(alone), layout, spec):
    flags = fusion.flags if layout.radix is not None else None
    words, fusion.values[first], *flagged = _fused.encode(
        fusion.combine, rows[first], spec=spec, radix=layout.radix,
        also=fusion.also, levels_dtype=layout.word_dtype,
        scalars=fusion.scalars, flags=flags, interpret=fusion.interpret)
    if flagged:
      fusion.flagged[first] = flagged[0]
    return words.ravel() if flat else words
  if (first < len(alone) and not spec.scaled and layout.radix is not None
      and _packing.planes_in_place(rows[first][0].shape, m)
      and _mesh.on_tpu()):
    # Plane by plane from the inputs' own planes: XLA:TPU writes out the
    # codes of a whole leaf before packing them (XLA:CPU fuses the two,
    # and m copies of the encoding a leaf would lengthen its compile).
    cut = [_packing.leaf_planes(y, m) for y in rows[first]]
    return _packing.pack_planes(
        [_quantize.encode(combine(*[p[j] for p in cut]), spec)
         for j in range(m)], layout.radix).ravel()
  if first < len(alone):
    codes = _quantize.encode(combine(*rows[first]), spec, alone[first])
  else:
    inputs = [layout.concatenate([row[j].ravel() for row in rows[first:end]],
                                 first) for j in range(len(rows[first]))]
    codes = _quantize.encode(combine(*inputs), spec)
  return layout.pack(codes)


def dtypes_of(row) -> tuple:
  return tuple(x.dtype for x in row)
