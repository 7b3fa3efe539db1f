"""The message's layout (dlion_jax.message.MessageLayout): each leaf on a
word of its run, read back leaf by leaf."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dlion_jax as dl
from dlion_jax import message


@pytest.mark.parametrize("comm", message.COMMS)
@pytest.mark.parametrize("n,spec", [
    (2, dl.quantize.BINARY), (7, dl.quantize.TERNARY),
    (8, dl.quantize.vote_spec("pbit_l1", bits=4))])
def test_message_layout_puts_each_leaf_on_a_word(comm, n, spec):
  """The layout's invariant, and that a message of packed runs reads back
  leaf by leaf from its digit planes."""
  from dlion_jax import packing  # pylint: disable=g-import-not-at-top
  from dlion_jax.message import MessageLayout  # pylint: disable=g-import-not-at-top
  sizes = (1, 37, 0, 64, 5)
  layout = MessageLayout(sizes, n, spec, "mavo", comm, runs=(0, 1, 3))
  per_word = layout.digits_per_word
  assert all(o % per_word == 0 for o in layout.offsets)
  assert all(b - a >= s for a, b, s in zip(
      layout.offsets, layout.offsets[1:] + (layout.digits,), sizes))
  assert layout.words % layout.word_multiple == 0
  assert layout.words * jnp.dtype(layout.word_dtype).itemsize == \
      MessageLayout(sizes, n, spec, "mavo", comm).words * jnp.dtype(
          layout.word_dtype).itemsize       # runs never change the bytes
  radix = layout.radix or 2
  leaves = [jnp.arange(1, s + 1, dtype=jnp.int32) % radix for s in sizes]
  assert layout.concatenate(leaves).shape == (layout.used_words * per_word,)
  runs = list(zip(layout.runs, layout.runs[1:] + (len(sizes),)))
  run_digits = [layout.concatenate(leaves[a:b], a) for a, b in runs]
  for got, want in zip(layout.split(run_digits), leaves):
    np.testing.assert_array_equal(got, want)
  if layout.radix is None:
    return
  words = jnp.zeros(layout.words, layout.word_dtype)
  for (first, _), digits in zip(runs, run_digits):
    words = lax.dynamic_update_slice(words, layout.pack(digits),
                                     (layout.offsets[first] // per_word,))
  unpacked = [packing.digit_planes(words[a:a + w], layout.radix).reshape(-1)
              for a, w in layout.run_words]      # each run's, plane by plane
  for got, want in zip(layout.split(unpacked), leaves):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sizes,runs", [
    ((), (0,)), ((3, 4), (0, 5)), ((3, 4), (0.9, 1.7)), ((3, 4), "01"),
    ((3, 4), (0, True)), ((3, 4), 0), ((3, 4), (0, None)), ((3, 4), (1,)),
    ((3, 4), (0, 0)), ((3, 4), ())])
def test_message_layout_refuses_runs_that_are_not_leaf_starts(sizes, runs):
  """Was: some accepted (floats truncated, a string read digit by digit,
  a run past the last leaf failing later with an IndexError), others a
  raw TypeError."""
  from dlion_jax.message import MessageLayout  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"runs=.*increasing leaf indices"):
    MessageLayout(sizes, 3, dl.quantize.BINARY, "mavo", "psum", runs)
