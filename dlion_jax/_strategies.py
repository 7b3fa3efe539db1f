"""The ``comm`` strategies: one record each, of what it sends and how.

Each worker holds a vector of vote *codes* (one digit per parameter,
:mod:`dlion_jax.quantize`): ``1`` for a ``+1`` vote and ``0`` for ``-1``
(binary), ``q + L`` for a level ``q`` in ``[-L, L]`` (ternary: ``L = 1``;
Lion Cub's p-bit votes: ``L = 2**(p-1) - 1``). Every strategy gives the
same integers on every worker, bit for bit: the vote's outcome, ``sign(s)``
of the sum of levels ``s = sum_i q_i`` for a majority vote, ``s`` itself for
an average.

Strategies (``N`` workers, wire bits per parameter per worker and step):

* ``alltoall``: pack the votes, ``all_to_all`` so worker ``k`` receives every
  worker's shard ``k``, vote on that shard, ``all_gather`` the packed result:
  ``(N-1)/N * (up + down)``.
* ``allgather``: ``all_gather`` everyone's packed votes and vote locally:
  ``(N-1) * up``.
* ``psum``: counters of radix ``(levels-1)*N+1`` packed into words and summed by
  an integer ``psum`` (Lion Cub, Ishikawa et al., 2025): ``2(N-1)/N * bits``.
* ``psum_int8``: an ``int8`` of the level per parameter, ``psum`` (the
  NeurIPS paper's implementation): ``2(N-1)/N * 8``.

A :class:`Strategy` says what :mod:`dlion_jax.message` counts (its
collectives, the radix it packs in), what ``comm='auto'`` weighs, and runs
the exchange; adding a strategy is adding a record and its function here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _blocks
from dlion_jax import _collectives
from dlion_jax import _mesh
from dlion_jax import _packing
from dlion_jax import _quantize

Comm = Literal["alltoall", "allgather", "psum", "psum_int8"]
COMMS = get_args(Comm)


@dataclasses.dataclass(frozen=True)
class Send:
  """One collective of a strategy: ``share(N)`` of its buffer is what each
  worker sends (the ring conventions of :mod:`dlion_jax.hlo`), the buffer
  the votes (``back=False``) or the results sent back (``alltoall``'s)."""
  op: str
  share: Callable[[int], float]
  back: bool = False


_ALL_REDUCE = Send("all-reduce", lambda n: 2 * (n - 1) / n)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One ``comm`` strategy: what it packs and sends, for the byte model,
  ``'auto'``, the HLO checks and the cluster projection, and how it runs:
  a strategy is this record and its ``exchange`` function.

  Attributes:
    name: the ``comm`` option.
    sends: its collectives, in order.
    latency: ``'auto'`` breaks ties between strategies that send as many
      bytes toward the lower (fewer collectives).
    counts: its digits are counters of ``N`` workers' codes
      (:func:`psum_radix`), which packed words add without carries.
    ints: the votes go as integers, not packed digits (:func:`int_container`).
    returns_sign: its majority vote comes back as the sign itself.
    exchange: ``exchange(message, *, axis_name, num_workers, spec,
      aggregation, abstained=None) -> (planes, decode, words)`` over a
      named axis (``abstained``: see :func:`signed_sum`; the
      ``message`` flat, or where the strategy :attr:`sums`, possibly in
      pieces by their first word, each in its own shape):
      ``planes(first, words)`` the ``[m, words]`` digits of a run of the
      message's words, which read plane after plane are the run's digits
      in order, ``decode`` the vote's outcome from them, and ``words(first,
      words)`` (None where there are none) ``[K, words]`` words of the
      message's radix whose digits, summed over ``K``, are the sums of the
      workers' codes: what :func:`dlion_jax.fused.tally` reads.
  """
  name: str
  sends: tuple[Send, ...]
  latency: int
  exchange: Callable = dataclasses.field(repr=False, default=None)
  counts: bool = False
  ints: bool = False
  returns_sign: bool = False

  @property
  def sends_back(self) -> bool:
    """Whether it sends results back (``alltoall``: a buffer of
    :func:`alltoall_down_radix` digits)."""
    return any(send.back for send in self.sends)

  @property
  def sums(self) -> bool:
    """Whether its collectives are all-reduces, which sum each word of
    the message on its own (so the message may go in pieces)."""
    return all(send.op == "all-reduce" for send in self.sends)

  @property
  def gathers(self) -> bool:
    """Whether it all-gathers or all-to-alls (which jax cannot over a tuple
    of vmapped axes; see :func:`dlion_jax.exchange.can_gather`)."""
    return any(send.op != "all-reduce" for send in self.sends)

  def radix(self, num_workers: int, spec: _quantize.VoteSpec) -> int | None:
    """Radix of the digits it packs the votes in (None: integers)."""
    if self.ints:
      return None
    return psum_radix(num_workers, spec) if self.counts else spec.radix

  def vote_bits(self, num_workers: int, spec: _quantize.VoteSpec) -> float:
    """Bits a vote takes in what it sends: a digit of :meth:`radix`, or an
    integer of :func:`int_container`."""
    radix = self.radix(num_workers, spec)
    if radix is None:
      return jnp.iinfo(int_container(num_workers, spec)).bits
    return _packing.bits_per_digit(radix)


def psum_radix(num_workers: int, spec: _quantize.VoteSpec) -> int:
  """Radix of a counter that can hold the sum of N workers' vote codes."""
  return (spec.radix - 1) * num_workers + 1


def mavo_has_ties(num_workers: int, spec: _quantize.VoteSpec) -> bool:
  """Whether a majority vote can end in a tie (sum 0), i.e. D = 0."""
  return spec.radix != 2 or num_workers % 2 == 0


def alltoall_down_radix(num_workers: int, *, aggregation: str,
                        spec: _quantize.VoteSpec) -> int:
  """Radix of the per-parameter result that ``alltoall`` all-gathers."""
  if aggregation == "avg":
    return psum_radix(num_workers, spec)
  return 3 if mavo_has_ties(num_workers, spec) else 2


def alltoall_down_radices(num_workers: int, *, aggregation: str,
                          spec: _quantize.VoteSpec,
                          ties: bool = False) -> tuple[int, ...]:
  """The radices ``alltoall``'s results may go back in: with ``ties`` (a
  majority may tie at any N: workers abstain) a binary MaVo at odd N
  sends radix 2 where no tie can occur and 3 where one can."""
  down = alltoall_down_radix(num_workers, aggregation=aggregation, spec=spec)
  return (2, 3) if ties and aggregation == "mavo" and down == 2 else (down,)


def int_container(num_workers: int,
                  spec: _quantize.VoteSpec = _quantize.BINARY):
  """Signed integer dtype in which ``psum_int8`` sums N workers' levels."""
  largest = num_workers * spec.max_level
  for dtype in (jnp.int8, jnp.int16, jnp.int32):
    if largest <= jnp.iinfo(dtype).max:
      return dtype
  raise ValueError(f"num_workers={num_workers} exceeds int32.")


def signed_sum(code_sum: jax.Array, num_workers: int,
               spec: _quantize.VoteSpec,
               abstained: jax.Array | None = None) -> jax.Array:
  """Sum of N workers' codes -> sum of their levels, in [-N L, N L] (int32).

  A binary code is ``(q + 1) / 2``, any other ``q + L``. ``abstained``
  (an int32 scalar, or None) workers sent the code of ``c = 0``: level 0,
  but ``-1`` for a binary vote, which has no 0, so their ``-1`` each are
  taken back out of a binary sum.
  """
  total = code_sum.astype(jnp.int32)
  if spec.radix == 2:
    total = 2 * total - num_workers
    return total if abstained is None else total + abstained
  return total - num_workers * spec.max_level


def abstainers_back(levels: jax.Array, spec: _quantize.VoteSpec,
                    abstained: jax.Array | None) -> jax.Array:
  """Summed levels (``psum_int8``'s) with the abstainers' binary ``-1``
  taken back out (see :func:`signed_sum`)."""
  levels = levels.astype(jnp.int32)
  if abstained is None or spec.radix != 2:
    return levels
  return levels + abstained


def alltoall_result(code_sum: jax.Array, num_workers: int,
                    spec: _quantize.VoteSpec, aggregation: str,
                    down_radix: int,
                    abstained: jax.Array | None = None) -> jax.Array:
  """What ``alltoall`` sends back for a digit, from the sum of N workers'
  codes: the count itself (``'avg'``, radix ``(levels - 1) N + 1``), else
  the majority's sign as a digit of ``down_radix``: ``s > 0`` (odd N,
  binary votes: no ties) or ``sign(s) + 1``. XLA's shard tally and
  :func:`dlion_jax.fused.vote_shard` both compute it here. ``abstained``
  as in :func:`signed_sum` (Avg's count is corrected where it is decoded).
  """
  if aggregation == "avg":
    return code_sum
  s = signed_sum(code_sum, num_workers, spec, abstained)
  if down_radix == 2:
    return s > 0
  return jnp.sign(s) + 1


# On TPU a row of gathered words may grow by this fraction of its width to
# whole lanes (see _gather_words).
_ROW_PADDING = 0.01


def _all_gather(x, axis_name, **kwargs):
  """``all_gather`` whose result is typed invariant where the axis is manual.

  Under ``shard_map``/``pmap`` the gathered votes are the same on every
  worker, and saying so lets replicated parameters be updated under
  ``check_vma=True``; ``vmap`` has no such type and takes the default.
  """
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  manual = jax.sharding.get_abstract_mesh().manual_axes
  to = "invarying" if all(a in manual for a in axes) else "varying"
  return lax.all_gather(x, axis_name, to=to, **kwargs)


def exchange_alltoall(message, *, axis_name, num_workers, spec, aggregation,
                      result_words=None, decode_with=None, tally_with=None,
                      abstained=None):
  """Reduce-scatter style vote: all_to_all the packed votes, vote a shard,
  all_gather the packed shard results.

  Under ``jax.vmap`` over a mesh axis the two collectives are stated as
  reshards of every worker's words (:func:`dlion_jax.workers.exchanged`):
  each device's column of all the messages, then every device's results.

  With ``result_words``
  (:attr:`~dlion_jax.message.MessageLayout.result_words` of a layout with
  ``result_blocks``) each place's results
  are packed into that many words, and ``decode_with(words, shard)``
  (of :func:`dlion_jax.fused.decode`) turns the gathered ``[N, m, words]``
  into ``planes(first, size)`` of the outcome of every digit of the
  message; ``tally_with(mine)`` (of :func:`dlion_jax.fused.vote_shard`), if
  given, votes a shard into those words in place of XLA. ``abstained``
  (or None) as in :func:`signed_sum`, the same on every worker: a binary
  majority at odd N can then tie, where an odd number abstained, and the
  results of such a step go back in radix 3 (a ``lax.cond``; the other
  steps' in radix 2, as without abstention). The message is laid out for
  radix 2, so every step but those sends the default's bytes; that step
  pads it to shards of whole words of radix-3 results.
  """
  n = num_workers

  def results(message, abstained, down_radix):
    def tally(mine, abstained=abstained):
      """The packed results of a shard, from every worker's words of it."""
      down = alltoall_result(_packing.sum_planes(mine, spec.radix), n, spec,
                             aggregation, down_radix, abstained).astype(
                                 _packing.digit_dtype(down_radix))
      if result_words:
        down = _packing.pad_to_multiple(down, _packing.digits_per_word(
            down_radix) * result_words)
      # Each place's results of the shard fill whole words of the result's
      # radix (MessageLayout.word_multiple), planar in its own words, the
      # same words as packing them all together: gathered, every worker's
      # words of one place are transposed (a fifth of the digits' bytes
      # for radix 3), not the digits, and unpack straight into the
      # message's order.
      return _packing.pack_digits(down, down_radix, planar=True)

    vote = tally_with or tally

    def manual(x):
      up = _lane_rows(x[0].reshape(n, -1))  # MessageLayout.word_multiple
      mine = lax.all_to_all(up, axis_name, 0, 0).reshape(n, -1)
      return _gather_words(vote(mine), axis_name, n)

    def stacked(x):
      # [worker, shard, words]: each device takes its shard of every
      # worker's (the count, one row a worker, is the same in every row).
      mine = _mesh.place(x[0].reshape(n, n, -1), P(None, axis_name, None))
      count = None if x[1] is None else x[1][0]
      return _mesh.place(jax.vmap(lambda m: vote(m, count) if tally_with is
                                  None else vote(m), in_axes=1)(mine), P())

    return _collectives.exchanged(manual, stacked, axis_name)(
        (message, abstained))

  def unpacked(words, down_radix):
    return _packing.unpack_digits(words.swapaxes(0, 1), down_radix,
                                  planar=True).reshape(words.shape[1], -1)

  def decode_with_radix(down_radix):
    def decode(digits):
      digits = digits.astype(jnp.int32)
      if aggregation == "avg":
        return signed_sum(digits, n, spec, abstained)
      return 2 * digits - 1 if down_radix == 2 else digits - 1
    return decode

  planes_of = lambda outcome: (lambda first, size: lax.slice_in_dim(
      outcome, first, first + size, axis=1))
  if len(alltoall_down_radices(n, aggregation=aggregation, spec=spec,
                               ties=abstained is not None)) > 1:
    width = message.shape[-1]

    def branch(radix):
      def run(message, abstained):
        # The layout's shards are whole words of radix-2 results; the
        # radix-3 step pads the message for its own on that step alone.
        message = _packing.pad_to_multiple(
            message, n * _packing.digits_per_word(radix))
        outcome = decode_with_radix(radix)(unpacked(
            results(message, abstained, radix), radix))
        return outcome[:, :width].astype(jnp.int8)
      return run
    outcome = lax.cond(abstained % 2 == 0, branch(2), branch(3), message,
                       abstained)
    return planes_of(outcome), (lambda outcome: outcome), None
  down_radix = alltoall_down_radix(n, aggregation=aggregation, spec=spec)
  words = results(message, abstained, down_radix)
  if decode_with is not None:
    return decode_with(words, message.shape[-1] // n), (
        lambda outcome: outcome), None
  return (planes_of(unpacked(words, down_radix)),
          decode_with_radix(down_radix), None)


def _lane_rows(words: jax.Array) -> jax.Array:
  """``words`` with its last axis in rows of 128 lanes on TPU, where it is
  a whole number of them: exchanged in that shape, the words land in the
  tiles their reader takes (a flat buffer is relaid out on the way)."""
  if _mesh.on_tpu() and words.shape[-1] % _blocks.LANES == 0:
    return words.reshape(words.shape[:-1] + (-1, _blocks.LANES))
  return words


def planes_of_rows(outcome: jax.Array):
  """``planes(first, size)`` of an outcome laid out ``[m, rows, 128]`` (the
  fused kernels' for a whole message): a run on whole rows is its rows as
  they lie, any other the rows around it, cut."""
  lanes = outcome.shape[-1]

  def planes(first, size):
    if first % lanes == 0 and size % lanes == 0:
      return lax.slice_in_dim(outcome, first // lanes,
                              (first + size) // lanes, axis=1).reshape(
                                  outcome.shape[0], size)
    low, high = first // lanes, -(-(first + size) // lanes)
    rows = lax.slice_in_dim(outcome, low, high, axis=1).reshape(
        outcome.shape[0], -1)
    return lax.slice_in_dim(rows, first - low * lanes,
                            first - low * lanes + size, axis=1)
  return planes


def _gather_words(words, axis_name, n):
  """Every worker's packed results, ``[n, *words.shape]`` (an ``all_gather``).

  On TPU the gathered buffer is cut into rows of 128 lanes. ``words`` with
  a row a place (``[m, W]``) are gathered row by row, each padded to whole
  lanes: cut out of one flat buffer, the rows of a ``W`` that is not a
  whole number of lanes took XLA:TPU a ``dynamic-update-slice`` a row and
  worker (design notes, "Bytes on TPU"). Where that
  padding would add more than :data:`_ROW_PADDING` of ``W``, and for flat
  ``words``, each worker's words are padded to 4 rows of 128 as a whole:
  across TPU slices XLA:TPU gathers a small buffer that is not whole rows
  of 128 lanes by an all-reduce of a zero-padded one, twice the DCN bytes.
  """
  if not _mesh.on_tpu():
    # Flat: jax gathers an empty [m, 0] stacked in the wrong shape (seen
    # under vmap with lax.scan, and under shard_map).
    return _all_gather(words.reshape(-1), axis_name, tiled=True).reshape(
        (n,) + words.shape)
  width = words.shape[-1]
  pad = -width % _blocks.LANES
  if words.ndim > 1 and 0 < width and pad <= _ROW_PADDING * width:
    if pad:
      lanes = [(0, 0)] * (words.ndim - 1) + [(0, pad)]
      return _all_gather(jnp.pad(words, lanes), axis_name)[..., :width]
    return _all_gather(_lane_rows(words), axis_name).reshape(
        (n,) + words.shape)
  rows = _all_gather(_blocks.lane_rows(words.reshape(-1), 4), axis_name)
  return rows.reshape(n, -1)[:, :words.size].reshape((n,) + words.shape)


def exchange_allgather(message, *, axis_name, num_workers, spec, aggregation,
                       abstained=None):
  """Every worker gathers everyone's packed votes and counts them."""
  del aggregation
  everyone = _collectives.exchanged(
      lambda m: _all_gather(_lane_rows(m), axis_name).reshape(num_workers, -1),
      lambda messages: _mesh.place(messages, P()), axis_name)(message)
  words = lambda first, size: lax.slice_in_dim(everyone, first, first + size,
                                               axis=1)
  planes = lambda first, size: _packing.sum_planes(words(first, size),
                                                 spec.radix)
  return planes, functools.partial(signed_sum, num_workers=num_workers,
                                   spec=spec, abstained=abstained), words


def exchange_psum(message, *, axis_name, num_workers, spec, aggregation,
                  abstained=None):
  """Packed counters summed by an integer psum (Lion Cub's p-bit all-reduce).

  Each code is a digit of radix ``(levels - 1) * N + 1``, so the sum of N
  workers' digits never carries into the next digit of the word.
  """
  del aggregation
  radix = psum_radix(num_workers, spec)
  words = _summed(message, axis_name)
  return (lambda first, size: _packing.digit_planes(words(first, size)[0],
                                                   radix)), functools.partial(
      signed_sum, num_workers=num_workers, spec=spec,
      abstained=abstained), words


def exchange_psum_int8(message, *, axis_name, num_workers, spec, aggregation,
                       abstained=None):
  """The paper's implementation: psum an int8 container of the +-1 votes.

  The container widens to int16/int32 when N exceeds what int8 can sum.
  """
  del num_workers, aggregation
  return _summed(message, axis_name), functools.partial(
      abstainers_back, spec=spec, abstained=abstained), None


def _summed(message, axis_name):
  """``words(first, size)``, ``[1, size]``, of the workers' messages summed
  by one ``psum``: a flat message, or one given in pieces by their first
  word (``{first: words}``), each summed in its own shape."""
  total = _collectives.psum(message, axis_name)
  if not isinstance(total, dict):
    total = {0: total}

  def words(first, size):
    at = max(word for word in total if word <= first)
    piece = total[at]
    if piece.ndim > 1:     # a run in its own shape, whole
      if (first, size) != (at, piece.size):
        raise ValueError(f"words({first}, {size}) cuts the piece of "
                         f"{piece.size} words at {at}, summed in its shape.")
      return piece.reshape(1, size)
    return lax.slice(piece, (first - at,), (first - at + size,))[None]
  return words


# How each strategy of dlion_jax.message.STRATEGIES runs.


STRATEGIES = {s.name: s for s in (
    Strategy("allgather", (Send("all-gather", lambda n: n - 1),), latency=0,
             exchange=exchange_allgather),
    Strategy("psum", (_ALL_REDUCE,), latency=1, counts=True,
             exchange=exchange_psum),
    Strategy("alltoall", (Send("all-to-all", lambda n: (n - 1) / n),
                          Send("all-gather", lambda n: (n - 1) / n,
                               back=True)),
             latency=2, returns_sign=True, exchange=exchange_alltoall),
    Strategy("psum_int8", (_ALL_REDUCE,), latency=3, ints=True,
             exchange=exchange_psum_int8),
)}
assert set(STRATEGIES) == set(COMMS)
