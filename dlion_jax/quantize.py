"""What each worker sends: Lion's pre-sign update as a vote code.

A worker's vote on one parameter is a *level* ``q`` and travels as the digit
``code`` in ``[0, levels)``:

* ``quantizer='sign'`` (Distributed Lion): ``vote='binary'`` sends
  ``q = +1 if c > 0 else -1`` (code ``(q + 1) / 2``, 1 bit); ``vote='ternary'``
  sends ``q = sign(c)`` (code ``q + 1``).
* ``quantizer='ternary_l1'`` (Lion Cub): ``q = clip(round(c / a), -1, 1)``
  with ``a`` the mean ``|c|`` of the leaf: a ternary vote with a dead zone
  ``|c| < a / 2`` around 0.
* ``quantizer='pbit_l1'`` with ``bits=p`` (Lion Cub): ``L = 2**(p-1) - 1``
  levels a side, ``q = clip(round(L * c / a), -L, L)`` (so ``bits=2`` is
  ``ternary_l1``): resolution ``a / L``, saturating at ``|c| >= a``.

The scale ``a`` is computed per worker and per leaf and is not sent: the
vote sums levels, ``D = sign(sum_i q_i)`` (MaVo) or
``D = sum_i q_i / (N L)`` (Avg, in ``[-1, 1]`` like Lion's update).
The scale counts non-finite entries as 0, so they touch only their own
coordinates: NaN abstains (``q = 0``; the binary sign vote sends ``-1``),
``+-Inf`` sends ``+-L`` (the sign vote ``+-1``). ``a`` is taken in float32,
or in float64 for float64 leaves.

Reference: Ishikawa, Ben-Nun, Van Essen, Yokota, Dryden, `Lion Cub:
Minimizing Communication Overhead in Distributed Lion
<https://arxiv.org/abs/2411.16462>`_, ICML 2025.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dlion_jax import accounting

QUANTIZERS = accounting.QUANTIZERS
VoteCode = accounting.VoteCode


def vote_code(quantizer: str = "sign", *, vote: str = "binary",
              bits: int | None = None) -> VoteCode:
  """The vote code a quantizer sends: ``'binary'``, ``'ternary'`` or levels.

  Raises:
    ValueError: an unknown quantizer or vote, ``bits`` given where it means
      nothing, or ``bits`` outside ``2..8`` for ``'pbit_l1'``.
  """
  return accounting.vote_code(quantizer, vote=vote, bits=bits)


def scale_dtype(dtype) -> jnp.dtype:
  """float32, or the leaf's own dtype where that is wider (float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def l1_scale(c: jax.Array) -> jax.Array:
  """Mean absolute value of a leaf, non-finite entries counted as 0 (the
  per-leaf scale ``a``), in :func:`scale_dtype`.

  ``sum |c|`` times the constant ``1 / size``: a fixed rounding that a
  reference can reproduce (a division by the size may or may not be turned
  into that product by the compiler).
  """
  dtype = scale_dtype(c.dtype)
  x = jnp.abs(c.astype(dtype))
  x = jnp.where(jnp.isfinite(x), x, 0)
  return jnp.sum(x) * dtype.type(1.0 / max(x.size, 1))


def sign_codes(c: jax.Array, vote: str) -> jax.Array:
  """Encodes Lion's pre-sign update as sign-vote codes (``uint8``).

  ``binary``: ``1`` if ``c > 0`` else ``0`` (``+-0`` and NaN vote ``-1``).
  ``ternary``: ``sign(c) + 1`` in ``{0, 1, 2}`` (NaN votes ``0``).
  """
  positive = c > 0
  if vote == "binary":
    return positive.astype(jnp.uint8)
  negative = c < 0
  return (1 + positive.astype(jnp.int8) - negative.astype(jnp.int8)).astype(
      jnp.uint8)


def l1_levels(c: jax.Array, max_level: int) -> jax.Array:
  """``clip(round(L * c / mean|c|), -L, L)`` in :func:`scale_dtype`; 0 where
  undefined (NaN, or a leaf whose finite entries are all 0)."""
  dtype = scale_dtype(c.dtype)
  x = c.astype(dtype)
  scale = l1_scale(x)
  ratio = x * (dtype.type(max_level) / scale)
  q = jnp.clip(jnp.round(ratio), -max_level, max_level)
  return jnp.where(jnp.isnan(q) | ~(scale > 0), 0.0, q)


def encode(c: jax.Array, code: VoteCode) -> jax.Array:
  """Vote codes (``uint8`` digits in ``[0, levels)``) of one leaf of ``c``.

  Args:
    c: one worker's pre-sign update for one leaf (any float dtype).
    code: the vote code from :func:`vote_code`: ``'binary'`` and
      ``'ternary'`` vote the sign of ``c``, an odd number of levels
      ``2L + 1`` quantizes ``c / mean|c|`` to ``L`` levels a side.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import quantize
    >>> c = jnp.array([-0.3, -0.01, 0.02, 0.5])     # mean |c| = 0.2075
    >>> quantize.encode(c, "ternary")                # sign: 0, 1, 2
    Array([0, 0, 2, 2], dtype=uint8)
    >>> quantize.encode(c, quantize.vote_code("ternary_l1"))  # dead zone
    Array([0, 1, 1, 2], dtype=uint8)
    >>> quantize.encode(c, quantize.vote_code("pbit_l1", bits=3))  # L = 3
    Array([0, 3, 3, 6], dtype=uint8)
  """
  if code in ("binary", "ternary"):
    return sign_codes(c, code)
  max_level = accounting.vote_max(code)
  return (l1_levels(c, max_level) + max_level).astype(jnp.uint8)
