"""The message's layout (message.MessageLayout): each leaf on a
word of its run, read back leaf by leaf."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dlion_jax import _message as message
from dlion_jax import _packing as packing
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies
from messages import assert_names


@pytest.mark.parametrize("comm", message.COMMS)
@pytest.mark.parametrize("n,spec", [
    (2, quantize.BINARY), (7, quantize.TERNARY),
    (8, quantize.vote_spec("pbit_l1", bits=4))])
def test_message_layout_puts_each_leaf_on_a_word(comm, n, spec):
  """The layout's invariant, and that a message of packed runs reads back
  leaf by leaf from its digit planes."""
  from dlion_jax import _packing as packing  # pylint: disable=g-import-not-at-top
  from dlion_jax._message import MessageLayout  # pylint: disable=g-import-not-at-top
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
  from dlion_jax._message import MessageLayout  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"runs=.*increasing leaf indices"):
    MessageLayout(sizes, 3, quantize.BINARY, "mavo", "psum", runs)


@pytest.mark.parametrize("n,aggregation,vote", [
    (8, "mavo", "binary"), (3, "mavo", "binary"), (8, "avg", "binary"),
    (5, "mavo", "ternary")])
def test_result_blocks_pad_the_shards_and_each_places_results(
    n, aggregation, vote):
  """numpy's count of alltoall's bytes with results in blocks: shards of
  whole blocks, each place's results rounded up to whole blocks."""
  from dlion_jax._message import MessageLayout  # pylint: disable=g-import-not-at-top
  spec, block = quantize.vote_spec(vote=vote), 4096
  layout = MessageLayout((100_000, 37), n, spec, aggregation, "alltoall",
                         result_blocks=block)
  per_word = packing.digits_per_word(spec.radix)
  used = -(-100_000 // per_word) + -(-37 // per_word)
  words = -(-used // (n * block)) * n * block
  down_radix = strategies.alltoall_down_radix(n, aggregation=aggregation,
                                                 spec=spec)
  results = -(-(words // n) // packing.digits_per_word(down_radix))
  results = -(-results // block) * block
  down_bytes = np.dtype(packing.word_dtype(down_radix)).itemsize
  up_bytes = np.dtype(layout.word_dtype).itemsize
  assert layout.words == words and layout.result_words == results
  assert layout.sent_bytes() == pytest.approx(
      (n - 1) / n * (words * up_bytes + n * per_word * results * down_bytes))


@pytest.mark.parametrize("blocks", [0, -1, 2.5, True, "4096"])
def test_result_blocks_must_be_a_positive_int(blocks):
  from dlion_jax._message import MessageLayout  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError) as err:
    MessageLayout((10,), 3, quantize.BINARY, "mavo", "alltoall",
                  result_blocks=blocks)
  assert_names(err, f"result_blocks={blocks!r}", "positive int", "None")
