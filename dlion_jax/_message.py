"""The vote message: every leaf's votes packed into one buffer per step.

A :class:`MessageLayout` is the wire protocol for one model, worker count,
vote spec (what a worker sends), aggregation and strategy (``comm``). It
owns the radix the votes are packed in, the words, the padding and where
each leaf sits, and so both what :mod:`dlion_jax.exchange` sends and what
the byte model counts:

* each leaf's digits start on a word boundary (``offsets``), so every
  leaf is packed as if alone and a leaf's padding is at most one word;
* the leaves are packed in *runs* (a big leaf alone, small ones laid end to
  end), each run in the planar order of :mod:`dlion_jax.packing`: a run of
  ``W`` words holds its digit ``i`` in word ``i % W``. Votes come back as
  digit planes (``[m, words]``); a run's, read plane after plane, are its
  digits in order, so no step interleaves digits;
* the message holds ``words`` words, a multiple of ``word_multiple``:
  ``alltoall`` cuts it into ``N`` shards of whole words, and each digit
  place of a shard holds whole words of the results it gathers back.

Digits past a leaf's end are padding: sent, never read back.

Radices (``L`` the largest level, ``VoteSpec.max_level``):
a worker's vote is a digit of radix 2 (binary), 3 (ternary) or ``2 L + 1``;
a counter of ``N`` workers' votes one of radix ``(radix - 1) N + 1``
(:func:`psum_radix`), so that packed words of counters add without carries.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Literal, Sequence, get_args

import jax
import jax.numpy as jnp
import numpy as np

from dlion_jax import _packing
from dlion_jax import _quantize
from dlion_jax import _strategies
from dlion_jax._checks import check_choice

Aggregation = Literal["mavo", "avg"]
Comm = _strategies.Comm
CommChoice = Comm | Literal["auto"]
AGGREGATIONS = get_args(Aggregation)
COMMS = _strategies.COMMS
COMM_CHOICES = COMMS + ("auto",)


def message_radix(comm: str, num_workers: int,
                  spec: _quantize.VoteSpec) -> int | None:
  """Radix in which a strategy packs the votes it sends (None: int votes)."""
  return _strategies.STRATEGIES[comm].radix(num_workers, spec)


def message_word_multiple(comm: str, num_workers: int, *, aggregation: str,
                          spec: _quantize.VoteSpec) -> int:
  """The message's word count is padded to a multiple of this.

  A strategy that sends results back (``alltoall``) splits the message
  into N shards of whole words, each a whole number of the result's words
  long: the results of each digit place of a shard then fill whole words
  of what it gathers back, which unpack straight into the message's order
  (a shard that only filled whole words with all its places' results
  together, ternary MaVo's, transposed its unpacked digits: design notes,
  "Planar digits"). With abstention a step whose results go back in
  another radix pads the message for it on that step alone
  (:func:`dlion_jax._strategies.exchange_alltoall`).
  """
  if not _strategies.STRATEGIES[comm].sends_back:
    return 1
  return num_workers * _packing.digits_per_word(
      _strategies.alltoall_down_radix(num_workers, aggregation=aggregation,
                                      spec=spec))


@dataclasses.dataclass(frozen=True)
class MessageLayout:
  """Where every leaf's votes sit in the message, and what it costs.

  Attributes:
    leaf_sizes: elements of each voted leaf, in message order.
    num_workers: N, the size of the axis voted over.
    spec: what each worker sends (:func:`dlion_jax.quantize.vote_spec`).
    aggregation: ``'mavo'`` or ``'avg'``.
    comm: a concrete strategy (not ``'auto'``; see :func:`choose_comm`).
    runs: the first leaf of each packing run, ``0`` first (default: every
      leaf a run of its own). Runs change the order of the digits inside
      the words, never the bytes.
    result_blocks: ``None``, or a number of words ``B``: each worker's
      shard of the message is a multiple of ``B`` words, and for a
      strategy that sends results back (``alltoall``) each digit place of
      its results is padded to whole blocks of ``B`` results, so that
      every block of the gathered results comes from one place of one
      shard (the fused kernels tally or decode the whole message in
      blocks: :func:`dlion_jax.fused.tally`, :func:`dlion_jax.fused.decode`).

  Example:
    >>> from dlion_jax._message import MessageLayout
    >>> from dlion_jax._quantize import BINARY
    >>> layout = MessageLayout((3, 20), 3, BINARY, "mavo", "alltoall")
    >>> layout.offsets      # leaf 1 starts on the second byte (8 bits each)
    (0, 8)
    >>> layout.words        # 4 bytes used, padded to 3 shards of 8 bytes
    24
    >>> layout.sent_bytes() # 2/3 of 24 bytes up and 24 bytes down
    32.0
  """
  leaf_sizes: tuple[int, ...]
  num_workers: int
  spec: _quantize.VoteSpec
  aggregation: str
  comm: str
  runs: tuple[int, ...] | None = None
  result_blocks: int | None = None

  def __post_init__(self):
    check_choice("comm", self.comm, COMMS)
    object.__setattr__(self, "leaf_sizes", tuple(int(s)
                                                 for s in self.leaf_sizes))
    n = len(self.leaf_sizes)
    runs = tuple(range(n)) if self.runs is None else self.runs
    if not (isinstance(runs, (tuple, list)) and all(
        isinstance(r, (int, np.integer)) and not isinstance(r, bool)
        for r in runs) and list(runs) == sorted(set(runs))
            and list(runs[:1]) == [0][:n] and all(r < n for r in runs)):
      raise ValueError(
          f"runs={self.runs!r} must be a tuple of increasing leaf indices, 0 "
          f"first and each below the {n} leaves (e.g. (0, 2) for leaves 0-1 "
          "and 2 onwards), or None for a run a leaf.")
    object.__setattr__(self, "runs", tuple(int(r) for r in runs))
    blocks = self.result_blocks
    if blocks is not None and (not isinstance(blocks, (int, np.integer))
                               or isinstance(blocks, bool) or blocks < 1):
      raise ValueError(
          f"result_blocks={blocks!r} must be a positive int (words a block "
          "of results takes, e.g. dlion_jax.fused.DECODE_BLOCK) or None.")

  @functools.cached_property
  def radix(self) -> int | None:
    """Radix of the packed digits; None for ``psum_int8``'s int votes."""
    return message_radix(self.comm, self.num_workers, self.spec)

  @functools.cached_property
  def digits_per_word(self) -> int:
    return 1 if self.radix is None else _packing.digits_per_word(self.radix)

  @functools.cached_property
  def word_dtype(self):
    """The dtype of the message's words."""
    if self.radix is None:
      return _strategies.int_container(self.num_workers, self.spec)
    return _packing.word_dtype(self.radix)

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    """The digit offset of each leaf (its start, on a word boundary)."""
    starts, offset = [], 0
    for size in self.leaf_sizes:
      starts.append(offset)
      offset += -(-size // self.digits_per_word) * self.digits_per_word
    return tuple(starts)

  @functools.cached_property
  def word_multiple(self) -> int:
    if self.result_blocks:
      return self.num_workers * self.result_blocks
    return message_word_multiple(self.comm, self.num_workers,
                                 aggregation=self.aggregation, spec=self.spec)

  @functools.cached_property
  def down_radix(self) -> int:
    """Radix of the results a strategy sends back (``alltoall``)."""
    return _strategies.alltoall_down_radix(
        self.num_workers, aggregation=self.aggregation, spec=self.spec)

  @functools.cached_property
  def result_words(self) -> int:
    """Words of results each digit place of a worker's shard comes back
    in (``alltoall``)."""
    shard = self.words // self.num_workers
    words = -(-shard // _packing.digits_per_word(self.down_radix))
    if self.result_blocks:
      words = -(-words // self.result_blocks) * self.result_blocks
    return words

  @functools.cached_property
  def words(self) -> int:
    """Words in the message, padding included."""
    return -(-self.used_words // self.word_multiple) * self.word_multiple

  @property
  def digits(self) -> int:
    """Digit positions in the message, padding included."""
    return self.words * self.digits_per_word

  @functools.cached_property
  def used_words(self) -> int:
    """The words the leaves fill (the message less its tail padding)."""
    return sum(-(-size // self.digits_per_word) for size in self.leaf_sizes)

  @functools.cached_property
  def run_words(self) -> tuple[tuple[int, int], ...]:
    """``(first word, words)`` of each run."""
    firsts = [self.offsets[r] // self.digits_per_word for r in self.runs]
    ends = firsts[1:] + [self.used_words]
    return tuple((a, b - a) for a, b in zip(firsts, ends))

  def sent_bytes(self) -> float:
    """Bytes each worker sends for this message (ring conventions of
    :mod:`dlion_jax.hlo`)."""
    n = self.num_workers
    if n == 1 or not self.leaf_sizes:
      return 0.0
    up = self.words * jnp.dtype(self.word_dtype).itemsize
    down_words = n * self.digits_per_word * self.result_words
    down = down_words * jnp.dtype(_packing.word_dtype(
        self.down_radix)).itemsize
    return float(_total(n, _strategies.STRATEGIES[self.comm], up, down))

  def concatenate(self, leaves: Sequence[jax.Array],
                  first: int = 0) -> jax.Array:
    """Flat leaves ``first, first + 1, ...`` at their offsets, zeros in the
    padding up to each one's last word: the run of digits they fill. One
    ``concatenate`` however many leaves: compile time grows with the
    number of operations, not with bytes."""
    ends = self.offsets[1:] + (self.used_words * self.digits_per_word,)
    pieces = []
    for k, x in enumerate(leaves, first):
      pieces.append(x)
      pad = ends[k] - self.offsets[k] - x.shape[0]
      if pad:
        pieces.append(jnp.zeros(pad, x.dtype))
    return jnp.concatenate(pieces)

  def pack(self, digits: jax.Array) -> jax.Array:
    """One run's words from its digits (:meth:`concatenate`, or a leaf's in
    its own shape), planar, flat."""
    if self.radix is None:                 # psum_int8: the levels as ints
      return _strategies.signed_sum(digits, 1, self.spec).astype(
          self.word_dtype).ravel()
    return _packing.pack_planes(_packing.leaf_planes(
        digits.astype(_packing.digit_dtype(self.radix)),
        self.digits_per_word), self.radix).ravel()

  def run_of(self, leaf: int) -> int:
    """The index of the run ``leaf`` is packed in."""
    return bisect.bisect_right(self.runs, leaf) - 1

  def leaf_values(self, run_values: jax.Array, leaf: int) -> jax.Array:
    """A leaf's stretch of its run's per-digit vector (e.g. the vote's
    outcome for every digit of the run, in order)."""
    first = self.offsets[self.runs[self.run_of(leaf)]]
    start = self.offsets[leaf] - first
    return jax.lax.slice(run_values, (start,),
                         (start + self.leaf_sizes[leaf],))

  def split(self, run_values: Sequence[jax.Array]) -> list[jax.Array]:
    """Every leaf's values from its run's per-digit vector."""
    return [self.leaf_values(run_values[self.run_of(k)], k)
            for k in range(len(self.leaf_sizes))]

  def runs_of(self, leaf_values: Sequence[jax.Array]) -> list[jax.Array]:
    """Each run's per-digit vector from every leaf's values (the inverse
    of :meth:`split`; zeros in the padding)."""
    ends = self.runs[1:] + (len(self.leaf_sizes),)
    return [self.concatenate(leaf_values[first:end], first)
            for first, end in zip(self.runs, ends)]


def vote_bits(num_workers: int, *, aggregation: str, spec: _quantize.VoteSpec,
              comm: str) -> float:
  """Bits per parameter a message costs as leaves grow (no padding)."""
  return _total(num_workers, _strategies.STRATEGIES[comm], *_digit_bits(
      num_workers, aggregation=aggregation, spec=spec, comm=comm))


def collective_bits(num_workers: int, *, aggregation: str,
                    spec: _quantize.VoteSpec,
                    comm: str) -> list[tuple[str, float]]:
  """Each collective of a strategy, in order: its HLO op and the bits per
  parameter a worker sends through it as leaves grow (no padding)."""
  up, down = _digit_bits(num_workers, aggregation=aggregation, spec=spec,
                         comm=comm)
  return [(send.op, send.share(num_workers) * (down if send.back else up))
          for send in _strategies.STRATEGIES[comm].sends]


def _digit_bits(num_workers: int, *, aggregation: str,
                spec: _quantize.VoteSpec, comm: str) -> tuple[float, float]:
  """Bits of a vote a strategy sends, and of a result it sends back."""
  up = _strategies.STRATEGIES[comm].vote_bits(num_workers, spec)
  return up, _packing.bits_per_digit(_strategies.alltoall_down_radix(
      num_workers, aggregation=aggregation, spec=spec))


def _total(num_workers: int, strategy: _strategies.Strategy, up, down):
  """What a worker sends through ``strategy``'s collectives, ``up`` a vote
  buffer's size and ``down`` a result buffer's: the buffers of sends that
  share a factor summed first (as ``(N-1)/N (up + down)``, not two
  products, whose sum may round apart)."""
  by_share = {}
  for send in strategy.sends:
    share = send.share(num_workers)
    by_share[share] = by_share.get(share, 0) + (down if send.back else up)
  return sum(share * size for share, size in by_share.items())


def message_bytes(leaf_sizes: Sequence[int], num_workers: int, *,
                  aggregation: str = "mavo",
                  spec: _quantize.VoteSpec = _quantize.BINARY, comm: str,
                  min_compress_size: int = 0) -> float:
  """Exact bytes each worker sends for leaves of ``leaf_sizes``.

  The voted leaves' :class:`MessageLayout`, plus the exact float32
  all-reduce of the leaves smaller than ``min_compress_size``. ``comm``
  must be a concrete strategy, not ``'auto'``.
  """
  n = num_workers
  exact = sum(s for s in leaf_sizes if s < min_compress_size)
  voted = [s for s in leaf_sizes if s >= min_compress_size]
  exact_bytes = 2 * (n - 1) / n * 4 * exact if n > 1 else 0.0
  return exact_bytes + MessageLayout(tuple(voted), n, spec, aggregation,
                                     comm).sent_bytes()


def choose_comm(num_workers: int, *, aggregation: str,
                spec: _quantize.VoteSpec = _quantize.BINARY,
                leaf_sizes: Sequence[int] | None = None,
                gathers: bool = True) -> str:
  """The strategy that sends the fewest bytes (what ``comm='auto'`` means).

  With ``leaf_sizes`` the exact message sizes, padding included, decide (on
  a small model padding can outweigh the asymptotic figure); without, the
  bits per parameter of :func:`vote_bits`. Ties go to the strategy with
  fewer collectives. ``gathers=False`` leaves out the strategies that
  all-gather (see :func:`dlion_jax.exchange.can_gather`).
  """
  candidates = sorted((s for s in _strategies.STRATEGIES.values()
                       if gathers or not s.gathers), key=lambda s: s.latency)
  candidates = [s.name for s in candidates]
  def cost(comm):
    if leaf_sizes is not None:
      return MessageLayout(tuple(leaf_sizes), num_workers, spec, aggregation,
                           comm).sent_bytes()
    return round(vote_bits(num_workers, aggregation=aggregation, spec=spec,
                           comm=comm), 9)
  return min(candidates, key=cost)


def buckets(indices: list[int], nbytes: list[int],
            bucket_bytes: int | None) -> list[list[int]]:
  """The leaves ``indices`` split into buckets of at most ``bucket_bytes``
  of gradient (``nbytes[i]`` a leaf's; a bigger leaf is a bucket alone).

  Taken from the last leaf back, greedily: a backward pass produces the
  gradients of the last layers first, and a pytree of layers (a Flax
  model's) lists them from the input on. ``None`` is one bucket, in order.

  Example:
    >>> from dlion_jax import _message
    >>> _message.buckets([0, 1, 2, 3], [40, 30, 30, 50], 60)
    [[3], [1, 2], [0]]
  """
  if not indices:              # nothing voted: no message at all
    return []
  if bucket_bytes is None:
    return [list(indices)]
  out, total = [], 0
  for i in reversed(indices):
    if out and total + nbytes[i] <= bucket_bytes:
      out[-1].append(i)
      total += nbytes[i]
    else:
      out.append([i])
      total = nbytes[i]
  return [sorted(bucket) for bucket in out]
