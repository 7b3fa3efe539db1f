"""Packing small integers (votes, vote counts) into machine words.

Every exchanged message is a vector of *digits*: integers in ``[0, radix)``.
A binary vote is a radix-2 digit, a ternary vote (``sign + 1``) a radix-3
digit, a count of ``N`` binary votes a radix-``N + 1`` digit. Digits are packed
positionally::

    word = sum_j digit_j * radix**j,      j = 0 .. digits_per_word(radix) - 1

into ``uint8`` or ``uint32`` words, whichever wastes fewer bits. For a power of
two radix this is plain bit-field packing (8 bits a byte, 16 two-bit fields a
``uint32``); for radix 3 it packs 5 trits into a byte (1.6 bits a trit instead
of 2). Because no digit sum overflows its position as long as it stays below
``radix``, words of counters can be added with an integer ``psum`` and still
decode exactly: this is Lion Cub's packed p-bit all-reduce.

Which digits share a word is the *order*. Interleaved (the default, numpy's
``packbits``): word ``w`` holds digits ``w m .. w m + m - 1``. Planar: a run of
``W`` words holds ``m`` planes of ``W`` digits, word ``w`` holds digits
``w, W + w, .., (m - 1) W + w``. Both cost the same words; the planar order
reads and writes every place as one contiguous run, so packing and
unpacking are straight vectorised passes on any backend, where the
interleaved order needs a stride-``m`` gather or scatter (on TPU a digit
array of minor dimension ``m``, padded to 128 lanes). The vote message is
planar (:mod:`dlion_jax.message`).

All functions are pure ``jnp`` and operate on the last axis, so they fuse into
the surrounding jitted step and work under ``shard_map``/``pmap``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_CONTAINERS = (jnp.uint8, jnp.uint32)


def _bits(dtype) -> int:
  return jnp.iinfo(dtype).bits


def _digits_in(radix: int, dtype) -> int:
  """Largest m with radix**m <= 2**bits(dtype)."""
  m, capacity = 0, 2 ** _bits(dtype)
  while radix ** (m + 1) <= capacity:
    m += 1
  return m


def _check_radix(radix: int) -> None:
  if not isinstance(radix, (int, np.integer)) or radix < 2:
    raise ValueError(f"radix must be an integer >= 2, got radix={radix!r}.")
  if radix > 2**32:
    raise ValueError(
        f"radix={radix} does not fit a uint32 word; at most 2**32 levels can "
        "be packed.")


@functools.lru_cache(maxsize=None)
def word_dtype(radix: int):
  """The container (``uint8`` or ``uint32``) that packs ``radix`` densest.

  Ties go to ``uint8``: a finer word keeps padding small.

  Example:
    >>> from dlion_jax import _packing
    >>> _packing.word_dtype(3), _packing.word_dtype(9)
    (<class 'jax.numpy.uint8'>, <class 'jax.numpy.uint32'>)
  """
  _check_radix(radix)
  usable = [d for d in _CONTAINERS if _digits_in(radix, d) > 0]
  return min(usable, key=lambda d: (_bits(d) / _digits_in(radix, d), _bits(d)))


def digits_per_word(radix: int) -> int:
  """How many radix-``radix`` digits one word of :func:`word_dtype` holds."""
  return _digits_in(radix, word_dtype(radix))


def bits_per_digit(radix: int) -> float:
  """Wire bits one packed digit costs: ``bits(word) / digits_per_word``.

  ``bits_per_digit(2) == 1``, ``bits_per_digit(3) == 1.6`` (5 trits a byte),
  ``bits_per_digit(9) == 3.2`` (10 nonary digits a ``uint32``), always at
  most ``ceil(log2(radix))``.
  """
  return _bits(word_dtype(radix)) / digits_per_word(radix)


def digit_dtype(radix: int):
  """Smallest unsigned dtype that holds one digit of ``radix``."""
  _check_radix(radix)
  return jnp.uint8 if radix <= 2**8 else (
      jnp.uint16 if radix <= 2**16 else jnp.uint32)


def _is_power_of_two(radix: int) -> bool:
  return radix & (radix - 1) == 0


def pad_to_multiple(x: jax.Array, multiple: int) -> jax.Array:
  """Zero-pads the last axis of ``x`` up to a multiple of ``multiple``."""
  extra = -x.shape[-1] % multiple
  if extra == 0:
    return x
  widths = [(0, 0)] * (x.ndim - 1) + [(0, extra)]
  return jnp.pad(x, widths)


def _pad_to(x: jax.Array, length: int) -> jax.Array:
  """Zero-pads the last axis of ``x`` to ``length``."""
  extra = length - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1)
                                       + [(0, extra)])


def pack_digits(digits: jax.Array, radix: int, *,
                planar: bool = False) -> jax.Array:
  """Packs digits in ``[0, radix)`` along the last axis into words.

  Args:
    digits: unsigned or non-negative integer array, last axis of any length
      (it is zero-padded to a multiple of :func:`digits_per_word`).
    radix: number of distinct digit values.
    planar: the planar order (see the module docstring): word ``w`` of
      ``W`` holds digits ``w + j W``; default interleaved, ``w m + j``.

  Returns:
    Array of :func:`word_dtype` ``(radix)`` whose last axis is
    ``ceil(n / digits_per_word(radix))``.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import _packing
    >>> _packing.pack_digits(jnp.array([1, 0, 1, 1], jnp.uint8), 2)
    Array([13], dtype=uint8)
    >>> _packing.pack_digits(jnp.arange(10, dtype=jnp.uint8) % 3, 3,
    ...                     planar=True)     # words (0,2,1,0,2), (1,0,2,1,0)
    Array([177,  46], dtype=uint8)
  """
  dtype = word_dtype(radix)
  m = digits_per_word(radix)
  if planar:
    # Plane by plane, only the short last ones zero-padded: XLA:CPU fuses
    # a pad of the whole input with its producer (the vote's encoding) into
    # a loop that checks bounds per digit and is not vectorised.
    w = -(-digits.shape[-1] // m)
    places = [_pad_to(digits[..., j * w:(j + 1) * w].astype(dtype), w)
              for j in range(m)]
  else:
    x = pad_to_multiple(digits, m).astype(dtype)
    x = x.reshape(x.shape[:-1] + (-1, m))
    places = [x[..., j] for j in range(m)]
  return _combine(places, radix)


def planes_in_place(shape: tuple[int, ...], m: int) -> bool:
  """Whether :func:`leaf_planes` cuts an array of ``shape`` into ``m``
  planes without flattening or padding it (``m`` divides its size and, for
  two or more axes, its leading axis)."""
  size = math.prod(shape)
  return size % m == 0 and (len(shape) < 2 or shape[0] % m == 0)


def leaf_planes(x: jax.Array, m: int) -> list[jax.Array]:
  """The ``m`` planes of the planar order of ``x`` flattened: plane ``j``
  holds its elements ``j W .. (j + 1) W - 1`` (``W = ceil(x.size / m)``).

  Where ``m`` divides the leading axis of an ``x`` of two or more axes,
  plane ``j`` is its ``j``-th block of rows, ``[shape[0] // m, *shape[1:]]``:
  ``x`` is never flattened (on TPU, whose arrays are laid out in tiles, a
  flattening is a copy). Otherwise the planes are flat, zero-padded where
  they run past the end of ``x``.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import _packing
    >>> [p.tolist() for p in _packing.leaf_planes(jnp.arange(6), 4)]
    [[0, 1], [2, 3], [4, 5], [0, 0]]
    >>> _packing.leaf_planes(jnp.zeros((8, 3)), 4)[0].shape
    (2, 3)
  """
  if not isinstance(m, (int, np.integer)) or m < 1:
    raise ValueError(f"m={m!r} must be a positive int: the digits a word "
                     "holds, _packing.digits_per_word(radix).")
  if x.ndim > 1 and x.shape[0] % m == 0:
    blocks = x.reshape((m, x.shape[0] // m) + x.shape[1:])
    return [blocks[j] for j in range(m)]
  flat = x.ravel()
  w = -(-flat.size // m)
  return [_pad_to(flat[j * w:(j + 1) * w], w) for j in range(m)]


def pack_planes(planes: list[jax.Array], radix: int, *,
                dtype=None) -> jax.Array:
  """The words whose digit ``j`` is ``planes[j]`` (digits in ``[0, radix)``,
  all of one shape; :func:`leaf_planes` cuts them): ``pack_planes(
  leaf_planes(x, m), radix).ravel()`` is ``pack_digits(x.ravel(), radix,
  planar=True)``. Computed in ``dtype``, an unsigned dtype at least as wide
  as the words (default :func:`word_dtype`; the fused kernels' integer
  vectors are 16 or 32 bits).

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import _packing
    >>> x = jnp.arange(10, dtype=jnp.uint8) % 3
    >>> _packing.pack_planes(_packing.leaf_planes(x, 5), 3)
    Array([177,  46], dtype=uint8)
  """
  if len(planes) != digits_per_word(radix):
    raise ValueError(
        f"radix {radix} packs {digits_per_word(radix)} digits a word, got "
        f"{len(planes)} planes; cut them with leaf_planes(x, "
        f"digits_per_word({radix})).")
  dtype = dtype or word_dtype(radix)
  return _combine([p.astype(dtype) for p in planes], radix)


def _combine(places: list[jax.Array], radix: int) -> jax.Array:
  """The words whose digit ``j`` is ``places[j]``, in the places' own
  unsigned dtype."""
  dtype = places[0].dtype.type
  # Unrolled over the m places with scalar constants, so XLA emits shifts
  # or multiplies it can vectorise. Fields never overlap: the sum is the
  # bitwise or, and it cannot overflow.
  if _is_power_of_two(radix):
    width = radix.bit_length() - 1
    fields = [place << (width * j) for j, place in enumerate(places)]
  else:
    fields = [place * dtype(radix**j) for j, place in enumerate(places)]
  words = fields[0]
  for field in fields[1:]:
    words = words + field
  return words


def digit(words: jax.Array, j: int, radix: int) -> jax.Array:
  """Digit ``j`` of unsigned ``words``, in their own dtype: place ``j`` of
  :func:`digit_planes`.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import _packing
    >>> _packing.digit(jnp.array([177], jnp.uint32), 1, 3).tolist()
    [2]
  """
  dtype = words.dtype.type
  # Scalar constant divisors: XLA turns them into shifts or multiply-shifts;
  # an array of place values would leave real integer divisions.
  if _is_power_of_two(radix):
    width = radix.bit_length() - 1
    return (words >> (width * j)) & dtype(radix - 1)
  return (words // dtype(radix**j)) % dtype(radix)


def digit_planes(words: jax.Array, radix: int) -> jax.Array:
  """Every word's digits, place by place: ``[..., W]`` -> ``[..., m, W]``.

  Plane ``j`` holds digit ``j`` of each word, as :func:`digit_dtype`.
  Reshaped to ``[..., m W]`` it is the planar order's digits, transposed
  to ``[..., W, m]`` the interleaved order's.
  """
  # Narrowed before the stack, which XLA may write out: in the word dtype
  # that is 4 bytes a digit of uint32 words, not 1.
  return jnp.stack([p.astype(digit_dtype(radix))
                    for p in _digit_list(words, radix)], axis=-2)


def _digit_list(words: jax.Array, radix: int) -> list[jax.Array]:
  """:func:`digit_planes` unstacked, in the word dtype."""
  dtype = word_dtype(radix)
  if words.dtype != dtype:
    raise TypeError(
        f"radix {radix} packs into {jnp.dtype(dtype).name} words, got "
        f"{words.dtype.name} words.")
  return [digit(words, j, radix) for j in range(digits_per_word(radix))]


def unpack_digits(words: jax.Array, radix: int, length: int | None = None,
                  *, planar: bool = False) -> jax.Array:
  """Inverse of :func:`pack_digits`: words -> digits along the last axis.

  Args:
    words: output of :func:`pack_digits` (or an exact sum of such outputs
      whose digit sums stay below ``radix``).
    radix: the radix the words were packed with.
    length: keep only the first ``length`` digits (drop the padding).
    planar: the order the words were packed in.

  Returns:
    Digits as :func:`digit_dtype` ``(radix)``.
  """
  planes = digit_planes(words, radix)
  if not planar:
    planes = jnp.swapaxes(planes, -1, -2)
  digits = planes.reshape(words.shape[:-1] + (-1,))
  return digits if length is None else digits[..., :length]


def pack_bits(bits: jax.Array) -> jax.Array:
  """Packs booleans 8 to a ``uint8``, least significant bit first."""
  return pack_digits(bits.astype(jnp.uint8), 2)


def unpack_bits(words: jax.Array, length: int | None = None) -> jax.Array:
  """Inverse of :func:`pack_bits`, as booleans."""
  return unpack_digits(words, 2, length).astype(jnp.bool_)


def count_dtype(max_count: int):
  """Smallest unsigned dtype that holds counts up to ``max_count``."""
  return digit_dtype(max_count + 1)


def sum_planes(words: jax.Array, radix: int) -> jax.Array:
  """Per-digit sums over the leading axis of packed words, place by place.

  With ``words`` of shape ``[N, W]`` holding ``N`` workers' packed votes,
  returns ``[m, W]``: for every digit of every word, the sum of the ``N``
  workers' digits (for radix 2: how many workers voted ``+1``), the
  population count across workers that decides the vote, computed for all
  positions at once by unpacking the digits and summing them.

  Each place's digits are summed on their own and the ``[m, W]`` sums
  stacked: summed out of the ``[N, m, W]`` stack of every worker's digits,
  XLA:TPU wrote that stack out and XLA:CPU took several times as long
  (design notes, "Bytes on TPU").
  """
  acc = count_dtype(words.shape[0] * (radix - 1))
  return jnp.stack([jnp.sum(p, axis=0, dtype=acc)
                    for p in _digit_list(words, radix)])
