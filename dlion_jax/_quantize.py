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

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from dlion_jax import _blocks
from dlion_jax._checks import check_choice
from dlion_jax._checks import static_int

Vote = Literal["binary", "ternary"]
Quantizer = Literal["sign", "ternary_l1", "pbit_l1"]
VOTES = get_args(Vote)
QUANTIZERS = get_args(Quantizer)
PBIT_RANGE = (2, 8)

@dataclasses.dataclass(frozen=True)
class VoteSpec:
  """What one worker sends for one parameter: a digit of ``radix`` values.

  Attributes:
    radix: the values a vote takes: 2 (binary sign: -1 or +1, code
      ``(q + 1) / 2``), 3 (ternary sign, or ``ternary_l1``) or ``2 L + 1``
      (``pbit_l1``: levels ``-L .. L``, code ``q + L``).
    scaled: the levels quantize ``c / mean|c|`` (Lion Cub's L1-scaled
      quantizers) rather than take the sign of ``c``.
  """
  radix: int
  scaled: bool = False

  @property
  def max_level(self) -> int:
    """The largest level ``L`` (1 for sign votes)."""
    return 1 if self.radix == 2 else (self.radix - 1) // 2


BINARY = VoteSpec(2)
TERNARY = VoteSpec(3)


def vote_spec(quantizer: Quantizer = "sign", *, vote: Vote = "binary",
              bits: int | None = None) -> VoteSpec:
  """What each worker sends, from the transforms' options.

  ``'sign'`` sends ``vote``; ``'ternary_l1'`` (``'pbit_l1'`` with
  ``bits=2``) sends 3 levels, like ``vote='ternary'`` but with a dead zone;
  ``'pbit_l1'`` with ``bits=p`` sends ``2**p - 1``.

  Raises:
    ValueError: an unknown quantizer or vote, ``bits`` given where it means
      nothing, or ``bits`` outside ``2..8`` for ``'pbit_l1'``.
  """
  check_choice("quantizer", quantizer, QUANTIZERS)
  check_choice("vote", vote, VOTES)
  bits = static_int("bits", bits)
  if quantizer != "pbit_l1":
    if bits is not None:
      raise ValueError(
          f"bits={bits!r} only applies to quantizer='pbit_l1', got "
          f"quantizer={quantizer!r}; drop bits or use quantizer='pbit_l1'.")
    if quantizer == "sign":
      return BINARY if vote == "binary" else TERNARY
    return VoteSpec(3, scaled=True)
  if vote != "binary":
    raise ValueError(
        f"vote={vote!r} applies to quantizer='sign' only; quantizer="
        "'pbit_l1' always sends signed levels. Drop vote.")
  low, high = PBIT_RANGE
  if (not isinstance(bits, int) or isinstance(bits, bool)
      or not low <= bits <= high):
    raise ValueError(
        f"quantizer='pbit_l1' needs bits, an int in {low}..{high} (bits per "
        f"worker vote), got bits={bits!r}.")
  return VoteSpec(2**bits - 1, scaled=True)


def scale_dtype(dtype) -> jnp.dtype:
  """float32, or the leaf's own dtype where that is wider (float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def l1_scale(c: jax.Array, shard: _blocks.LeafShard | None = None) -> jax.Array:
  """Mean absolute value of a leaf, non-finite entries counted as 0 (the
  per-leaf scale ``a``), in :func:`scale_dtype`.

  ``sum |c|`` times the constant ``1 / size``: a fixed rounding that a
  reference can reproduce (a division by the size may or may not be turned
  into that product by the compiler). For a ``shard`` of a leaf (a hybrid
  step) the sum is completed over its axis (zero padding adds nothing) and
  the size is the whole leaf's.
  """
  dtype = scale_dtype(c.dtype)
  x = jnp.abs(c.astype(dtype))
  total = jnp.sum(jnp.where(jnp.isfinite(x), x, 0))
  size = x.size
  if shard is not None:
    total, size = shard.sum(total), shard.size
  return total * dtype.type(1.0 / max(size, 1))


def sign_codes(c: jax.Array, radix: int) -> jax.Array:
  """Encodes Lion's pre-sign update as sign-vote codes (``uint8``).

  Radix 2 (binary): ``1`` if ``c > 0`` else ``0`` (``+-0`` and NaN vote
  ``-1``). Radix 3 (ternary): ``sign(c) + 1`` in ``{0, 1, 2}`` (NaN votes
  ``0``).
  """
  positive = c > 0
  if radix == 2:
    return positive.astype(jnp.uint8)
  negative = c < 0
  return (1 + positive.astype(jnp.int8) - negative.astype(jnp.int8)).astype(
      jnp.uint8)


def l1_levels(c: jax.Array, max_level: int,
              shard: _blocks.LeafShard | None = None) -> jax.Array:
  """``clip(round(L * c / mean|c|), -L, L)`` in :func:`scale_dtype`; 0 where
  undefined (NaN, or a leaf whose finite entries are all 0)."""
  dtype = scale_dtype(c.dtype)
  x = c.astype(dtype)
  scale = l1_scale(x, shard)
  ratio = x * (dtype.type(max_level) / scale)
  q = jnp.clip(jnp.round(ratio), -max_level, max_level)
  return jnp.where(jnp.isnan(q) | ~(scale > 0), 0.0, q)


def encode(c: jax.Array, spec: VoteSpec,
           shard: _blocks.LeafShard | None = None) -> jax.Array:
  """Vote codes (``uint8`` digits in ``[0, spec.radix)``) of one leaf of ``c``.

  Args:
    c: one worker's pre-sign update for one leaf (any float dtype).
    spec: what a worker sends (:func:`vote_spec`): the sign of ``c`` in 2
      or 3 values, or ``c / mean|c|`` quantized to ``L`` levels a side.
    shard: when ``c`` is one device's shard of the leaf (a hybrid step),
      which leaf: the scale is the whole leaf's.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import _quantize
    >>> c = jnp.array([-0.3, -0.01, 0.02, 0.5])     # mean |c| = 0.2075
    >>> _quantize.encode(c, _quantize.TERNARY)         # sign: 0, 1, 2
    Array([0, 0, 2, 2], dtype=uint8)
    >>> _quantize.encode(c, _quantize.vote_spec("ternary_l1"))  # dead zone
    Array([0, 1, 1, 2], dtype=uint8)
    >>> _quantize.encode(c, _quantize.vote_spec("pbit_l1", bits=3))  # L = 3
    Array([0, 3, 3, 6], dtype=uint8)
  """
  if not spec.scaled:
    return sign_codes(c, spec.radix)
  max_level = spec.max_level
  return (l1_levels(c, max_level, shard) + max_level).astype(jnp.uint8)
