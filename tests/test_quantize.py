"""What a worker sends (dlion_jax.quantize), leaf by leaf, against numpy:
the sign codes, Lion Cub's L1-scaled levels with their scale, and the
non-finite entries the module docstring promises to keep to their own
coordinates; fp32 and bf16 leaves of sizes no word divides."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dlion_jax import _quantize as quantize

SIZES = [1, 37, 1000]
DTYPES = [np.float32, ml_dtypes.bfloat16]


def _c(size, dtype, seed=0):
  return np.random.default_rng(seed).standard_normal(size).astype(dtype)


def _levels(c, max_level):
  """numpy's L1-scaled levels: clip(round(L c / mean|c|), -L, L), the
  scale in float32 (float64 for float64 leaves), non-finite entries
  counted as 0 in it and abstaining (NaN) or saturating (+-Inf)."""
  wide = np.float64 if c.dtype == np.float64 else np.float32
  x = c.astype(wide)
  finite = np.where(np.isfinite(x), np.abs(x), 0)
  scale = finite.sum(dtype=wide) * wide(1.0 / max(x.size, 1))
  with np.errstate(invalid="ignore", divide="ignore"):
    q = np.clip(np.round(x * (wide(max_level) / scale)), -max_level,
                max_level)
  return np.where(np.isnan(q) | ~(scale > 0), 0, q).astype(int)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_codes(size, dtype):
  c = _c(size, dtype)
  c[0] = 0                                            # +0 votes -1
  binary = np.asarray(quantize.encode(jnp.asarray(c), quantize.BINARY))
  ternary = np.asarray(quantize.encode(jnp.asarray(c), quantize.TERNARY))
  wide = c.astype(np.float32)
  np.testing.assert_array_equal(binary, (wide > 0).astype(np.uint8))
  np.testing.assert_array_equal(ternary, (np.sign(wide) + 1).astype(np.uint8))
  assert binary.dtype == ternary.dtype == np.uint8


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_l1_levels(size, dtype, bits):
  spec = quantize.vote_spec("pbit_l1", bits=bits)
  c = _c(size, dtype, seed=bits)
  codes = np.asarray(quantize.encode(jnp.asarray(c), spec)).astype(int)
  np.testing.assert_array_equal(codes - spec.max_level,
                                _levels(c, spec.max_level))
  assert codes.min() >= 0 and codes.max() < spec.radix


def test_non_finite_entries_stay_on_their_own_coordinates():
  """NaN abstains, +-Inf saturates, and neither moves the scale of the
  finite entries (the binary sign vote sends -1 for NaN)."""
  c = _c(37, np.float32)
  bad = c.copy()
  bad[[0, 1, 2]] = [np.nan, np.inf, -np.inf]
  spec = quantize.vote_spec("pbit_l1", bits=3)
  codes = np.asarray(quantize.encode(jnp.asarray(bad), spec)).astype(int) - 3
  assert list(codes[:3]) == [0, 3, -3]
  clean = c.copy()
  clean[[0, 1, 2]] = 0
  np.testing.assert_array_equal(codes[3:], _levels(clean, 3)[3:])
  assert np.asarray(quantize.encode(jnp.asarray(bad), quantize.BINARY))[0] == 0
  assert float(quantize.l1_scale(jnp.asarray(bad))) == pytest.approx(
      np.abs(clean).sum() / 37, rel=1e-6)


def test_an_all_zero_leaf_abstains():
  spec = quantize.vote_spec("ternary_l1")
  codes = np.asarray(quantize.encode(jnp.zeros(5), spec))
  np.testing.assert_array_equal(codes, np.ones(5, np.uint8))     # level 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantizer="pbit_l1"), "needs bits"),
    (dict(quantizer="pbit_l1", bits=9), "2..8"),
    (dict(quantizer="pbit_l1", bits=True), "bits=True"),
    (dict(quantizer="sign", vote="quaternary"), "vote"),
    (dict(quantizer="l2"), "quantizer"),
])
def test_vote_spec_names_the_option_at_fault(kwargs, match):
  with pytest.raises(ValueError, match=match):
    quantize.vote_spec(**kwargs)


def test_vote_specs():
  assert quantize.vote_spec() == quantize.BINARY
  assert quantize.vote_spec(vote="ternary") == quantize.TERNARY
  assert quantize.vote_spec("ternary_l1") == quantize.vote_spec(
      "pbit_l1", bits=2)
  assert quantize.vote_spec("pbit_l1", bits=4).max_level == 7
