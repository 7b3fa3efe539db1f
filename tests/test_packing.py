"""Bit, trit and counter packing against numpy.

Each case runs its packing under ``jax.jit``, as the optimizer does: one
compile a case instead of one per eager operation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from dlion_jax import _packing as packing

RADIXES = [2, 3, 4, 5, 7, 9, 16, 17, 255, 256, 257, 1025]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def round_trip(digits, radix, length, planar=False):
  """(words, digits unpacked from them)."""
  words = packing.pack_digits(digits, radix, planar=planar)
  return words, packing.unpack_digits(words, radix, length, planar=planar)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def summed(codes, radix, length, planar=False):
  """The workers' packed words added up (what psum does), unpacked."""
  words = packing.pack_digits(codes, radix, planar=planar)
  total = jnp.sum(words, axis=0, dtype=words.dtype)
  return packing.unpack_digits(total, radix, length, planar=planar)


def numpy_words(digits, radix, planar):
  """The packing's definition, in numpy: word w holds digit j at place j
  (radix**j); which digit is the order's."""
  m = packing.digits_per_word(radix)
  n_words = -(-len(digits) // m)
  padded = np.zeros(n_words * m, dtype=object)
  padded[:len(digits)] = digits
  places = padded.reshape(m, n_words) if planar else \
      padded.reshape(n_words, m).T
  return sum(places[j] * radix**j for j in range(m)).astype(np.uint64)


@pytest.mark.parametrize("planar", [False, True])
@pytest.mark.parametrize("radix", RADIXES)
@pytest.mark.parametrize("length", [0, 1, 7, 41, 1001])
def test_round_trip_any_length(radix, length, planar):
  rng = np.random.default_rng(radix * 1000 + length)
  digits = rng.integers(0, radix, size=length)
  words, back = round_trip(
      jnp.asarray(digits, packing.digit_dtype(radix)), radix, length, planar)
  per = packing.digits_per_word(radix)
  assert words.dtype == packing.word_dtype(radix)
  assert words.shape == (-(-length // per),)
  np.testing.assert_array_equal(np.asarray(words, np.uint64),
                                numpy_words(digits, radix, planar))
  np.testing.assert_array_equal(np.asarray(back), digits)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), max_size=200))
def test_pack_bits_matches_numpy_packbits(bits):
  bits = np.array(bits, dtype=bool)
  ours = np.asarray(packing.pack_bits(jnp.asarray(bits)))
  np.testing.assert_array_equal(ours, np.packbits(bits, bitorder="little"))
  np.testing.assert_array_equal(
      np.asarray(packing.unpack_bits(jnp.asarray(ours), len(bits))), bits)


def test_densities():
  assert packing.bits_per_digit(2) == 1.0
  assert packing.bits_per_digit(3) == 1.6          # 5 trits in a byte
  assert packing.digits_per_word(3) == 5
  assert packing.word_dtype(3) == jnp.uint8
  assert packing.bits_per_digit(9) == 3.2          # 10 nonary digits a word
  assert packing.word_dtype(9) == jnp.uint32
  for radix in RADIXES:
    # Never worse than ceil(log2(radix))-bit fields in a uint32 word.
    field_bits = int(np.ceil(np.log2(radix)))
    assert packing.bits_per_digit(radix) <= 32 / (32 // field_bits)
    assert radix ** packing.digits_per_word(radix) <= 2 ** (
        8 * jnp.dtype(packing.word_dtype(radix)).itemsize)


@pytest.mark.parametrize("planar", [False, True])
@pytest.mark.parametrize("num_workers,levels", [(2, 2), (3, 2), (7, 3),
                                                (8, 2), (8, 3), (64, 3)])
def test_word_sums_do_not_carry(num_workers, levels, planar):
  """Adding packed words (what psum does) adds every digit exactly."""
  radix = (levels - 1) * num_workers + 1
  rng = np.random.default_rng(num_workers)
  codes = rng.integers(0, levels, size=(num_workers, 333))
  # Adversarial: make some positions all maximal.
  codes[:, :17] = levels - 1
  total = summed(jnp.asarray(codes, packing.digit_dtype(radix)), radix, 333,
                 planar)
  np.testing.assert_array_equal(np.asarray(total), codes.sum(0))


@pytest.mark.parametrize("radix", [2, 3])
@pytest.mark.parametrize("num_workers", [1, 2, 5, 8])
def test_sum_planes_counts_votes(radix, num_workers):
  rng = np.random.default_rng(radix + num_workers)
  codes = rng.integers(0, radix, size=(num_workers, 123))
  counts = jax.jit(lambda c: packing.sum_planes(
      packing.pack_digits(c, radix, planar=True), radix))(
          jnp.asarray(codes, jnp.uint8))
  np.testing.assert_array_equal(
      np.asarray(counts).reshape(-1)[:123], codes.sum(0))


@pytest.mark.parametrize("planar", [False, True])
def test_pads_leading_dims_independently(planar):
  digits = jnp.asarray(np.arange(2 * 13).reshape(2, 13) % 3, jnp.uint8)
  words = packing.pack_digits(digits, 3, planar=planar)
  assert words.shape == (2, 3)
  np.testing.assert_array_equal(
      np.asarray(packing.unpack_digits(words, 3, 13, planar=planar)),
      np.asarray(digits))
  np.testing.assert_array_equal(
      np.asarray(words[1]), np.asarray(packing.pack_digits(
          digits[1], 3, planar=planar)))


@pytest.mark.parametrize("radix", [0, 1, -3, 2.0, 2**32 + 1])
def test_bad_radix_is_named(radix):
  with pytest.raises(ValueError, match="radix"):
    packing.word_dtype(radix)


def test_unpack_rejects_wrong_word_dtype():
  with pytest.raises(TypeError, match="uint32"):
    packing.unpack_digits(jnp.zeros(3, jnp.uint8), 9)


@pytest.mark.parametrize("radix", RADIXES)
@pytest.mark.parametrize("shape", ["rows", "flat", "odd rows"])
def test_leaf_planes_pack_to_the_flat_planar_words(radix, shape):
  """A leaf cut into planes in its own shape (blocks of rows where the
  digits of a word divide its leading axis, flat and zero-padded
  otherwise) packs to the words of its flattened digits (the message's
  planar order), against numpy's own arithmetic."""
  m = packing.digits_per_word(radix)
  dims = {"rows": (3 * m, 7, 2), "flat": (5 * m + 3,),
          "odd rows": (3 * m + 1, 4)}[shape]
  rng = np.random.default_rng(radix)
  digits = rng.integers(0, radix, size=dims).astype(
      packing.digit_dtype(radix))
  planes = packing.leaf_planes(jnp.asarray(digits), m)
  if shape == "rows":
    assert planes[0].shape == (3, 7, 2)
  words = np.asarray(packing.pack_planes(planes, radix)).ravel()
  np.testing.assert_array_equal(words, numpy_words(digits.ravel(), radix,
                                                   planar=True))
  np.testing.assert_array_equal(words, packing.pack_digits(
      jnp.asarray(digits.ravel()), radix, planar=True))


def test_pack_planes_names_a_wrong_number_of_planes():
  with pytest.raises(ValueError, match=r"radix 2 packs 8 .* got 3 planes"):
    packing.pack_planes([jnp.zeros(4, jnp.uint8)] * 3, 2)


@pytest.mark.parametrize("radix", [2, 3, 9])
def test_sum_planes_counts_each_place(radix):
  """``[m, W]``: place ``j`` of word ``w`` sums the workers' digit ``j`` of
  ``w`` (planar order: digit ``j W + w``)."""
  rng = np.random.default_rng(radix)
  digits = rng.integers(0, radix, size=(5, 203))
  words = packing.pack_digits(jnp.asarray(digits, packing.digit_dtype(
      radix)), radix, planar=True)
  sums = np.asarray(packing.sum_planes(words, radix))
  m, width = sums.shape
  assert m == packing.digits_per_word(radix)
  padded = np.zeros((5, m * width), np.int64)
  padded[:, :203] = digits
  np.testing.assert_array_equal(sums.reshape(-1), padded.sum(0))


@pytest.mark.parametrize("shape,m,in_place", [
    ((16, 3), 8, True), ((16,), 8, True), ((12, 4), 8, False),
    ((9,), 8, False), ((40, 7), 5, True), ((), 1, True)])
def test_planes_in_place_says_when_leaf_planes_keep_the_shape(shape, m,
                                                            in_place):
  x = jnp.zeros(shape, jnp.uint8)
  assert packing.planes_in_place(shape, m) == in_place
  planes = packing.leaf_planes(x, m)
  assert sum(p.size for p in planes) == (x.size if in_place
                                         else m * -(-x.size // m))


@pytest.mark.parametrize("m", [0, -2, 2.0])
def test_leaf_planes_names_a_bad_m(m):
  with pytest.raises(ValueError, match=rf"m={m!r} must be a positive int"):
    packing.leaf_planes(jnp.zeros(8, jnp.uint8), m)
