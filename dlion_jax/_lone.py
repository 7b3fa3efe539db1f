"""One worker alone votes: its step rides in the vote.

Where every worker but one abstains (``abstain_nonfinite=True``, the
count ``a = N - 1``), the update is that worker's ``sign(c)``, 0 where
its ``c`` is. Every worker encodes ``where(a = N - 1, lone(c), c)``
(:func:`or_lone`; the fused encoding likewise, :func:`one_alone`), so the
tally is the lone worker's codes, the others' taken back out by the
count. Binary codes have no 0: the worker also packs flags where its
``c`` is not 0, laid out as its codes (:func:`flags`), and on that step
alone they are summed over the workers and zero the vote's outcome
(:func:`zeros`). Used by :mod:`dlion_jax._exchange`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from dlion_jax import _collectives
from dlion_jax import _packing


def one_alone(fusion, lone: Callable, count: jax.Array, num_workers: int,
              spec):
  """``fusion`` (the kernels of a message, ``dlion_jax._exchange``)
  where one worker may vote alone (``count``, the abstainers', a scalar
  more): on that step the encoding codes
  ``lone``'s values (as :func:`or_lone`) and, for binary codes, flags
  where they are not 0 (the step's zeros, see :func:`zeros`)."""
  combine, also, last = fusion.combine, fusion.also, num_workers - 1
  return dataclasses.replace(
      fusion, scalars=fusion.scalars + (count,),
      combine=lambda *a: jnp.where(a[-1] == last, lone(*a[:-1]),
                                   combine(*a[:-1])),
      also=also and (lambda *a: also(*a[:-1])),
      flags=(lambda *a: lone(*a[:-1]) != 0) if spec.radix == 2 else None)


def or_lone(combine: Callable, lone) -> Callable:
  """``combine``, or on the step ``lone[1]`` (one worker votes alone)
  ``lone[0]``: the vote then tallies that worker's codes of its own ``c``
  (its sign, one worker's Lion), the others' ``c = 0`` taken back out.
  Binary codes have no 0: :func:`zeros` puts them back."""
  return lambda *leaves: jnp.where(lone[1], lone[0](*leaves),
                                   combine(*leaves))


def flags(lone, rows, num_alone: int, layout, fusion) -> list:
  """Each run's words of flags where ``lone[0]`` is not 0 (digits 0 and 1
  laid out as the vote's codes): the fused encoding's where it took the
  run, else computed in a :func:`jax.lax.cond` on the step ``lone[1]``
  (zeros on other steps) that reads the leaves before the vote, as
  ``dlion_jax._exchange._lone_outcomes`` does. None for a run the
  kernels take: their flags come with its words (``fusion.flagged``)."""
  ends = layout.runs[1:] + (len(rows),)
  mine = [(first, end) for first, end in zip(layout.runs, ends)
          if not (fusion and fusion.takes(rows, first, num_alone, layout,
                                          layout.spec))]

  def flagged():
    words = []
    for first, end in mine:
      if first < num_alone:
        flags = lone[0](*rows[first])
      else:
        flags = lone[0](*[layout.concatenate(
            [row[j].ravel() for row in rows[first:end]], first)
                          for j in range(len(rows[first]))])
      words.append(layout.pack(flags != 0))
    return words
  words = lax.cond(lone[1], flagged, lambda: [
      _zeros_like(x) for x in jax.eval_shape(flagged)]) if mine else []
  ours = dict(zip((first for first, _ in mine), words))
  return [ours.get(first) for first in layout.runs]


def _zeros_like(x: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros of ``x``'s shape and dtype, varying over the manual axes it
  does (``shard_map(check_vma=True)`` types a branch's outputs so)."""
  varying = getattr(getattr(x, "manual_axis_type", None), "varying", ())
  zeros = jnp.zeros(x.shape, x.dtype)
  return lax.pcast(zeros, tuple(varying), to="varying") if varying else zeros


def zeros(alone_votes: jax.Array, pieces: Callable, flags: list,
          fusion, layout, axis_name) -> dict:
  """``pieces()`` (the vote's outcomes), or on the step ``alone_votes``
  ``pieces(zeros)``: 0 where the lone worker's ``c`` is, ``zeros`` each
  run's flags (:func:`flags`, or the fused encoding's) summed over
  the workers (the others' are 0). Its binary codes tallied the sign
  elsewhere (:func:`or_lone`). The vote's integers are selected in a
  :func:`jax.lax.cond`, so the update's arithmetic is the vote's; both
  branches cut the outcomes into the leaves' shapes, so that the lone
  step's select is in that pass (the large tree's MaVo ``auto`` on TPU:
  41.1 bytes a parameter a chip selected by run, then cut, 38.0 so)."""
  flags = [fusion.flagged[first] if words is None else words
           for first, words in zip(layout.runs, flags)]
  return lax.cond(alone_votes,
                  lambda: pieces(_collectives.psum(flags, axis_name)),
                  pieces)


def unflagged(outcome: jax.Array, words: jax.Array, layout) -> jax.Array:
  """``outcome`` (a run's digits, or a leaf's in its shape) 0 where the
  digit of ``words`` (the run's, laid out as its codes) is 0: digit ``j``
  of every word against plane ``j`` of the outcome, elementwise (a stack
  of the planes would be written out)."""
  m, radix = layout.digits_per_word, layout.radix
  if outcome.size == m * words.size:
    planes = outcome.reshape((m,) + words.shape)
  else:     # a leaf whose last word is not full
    words = words.ravel()
    planes = _packing.pad_to_multiple(outcome.ravel(), m * words.size)
    planes = planes.reshape(m, words.size)
  place = jnp.arange(m, dtype=words.dtype).reshape((m,) + (1,) * words.ndim)
  if radix & (radix - 1) == 0:
    width = radix.bit_length() - 1
    digits = (words[None] >> (place * width)) & (radix - 1)
  else:
    digits = (words[None] // radix ** place) % radix
  kept = jnp.where(digits != 0, planes, 0).astype(outcome.dtype)
  return kept.ravel()[:outcome.size].reshape(outcome.shape)
