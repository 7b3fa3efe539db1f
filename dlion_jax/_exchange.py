"""Exchanging packed votes over a named axis (``shard_map`` / ``pmap``).

Each worker's votes travel as codes, and every strategy (``comm``, the
records of :mod:`dlion_jax.strategies`; ``auto`` the one that sends the
fewest bytes for the model, :func:`dlion_jax.message.choose_comm`) gives
the same outcome on every worker, bit for bit: :func:`aggregate_updates`
turns it into the update ``D`` of Distributed Lion (Liu et al., 2024,
Alg. 1). The whole pytree goes through one message
(:class:`dlion_jax.message.MessageLayout`): each leaf starts on a word, the
leaves are packed in one pass, and a step issues a fixed number of
collectives however many leaves the model has.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlion_jax import _blocks
from dlion_jax import _collectives
from dlion_jax import _fused
from dlion_jax import _lone
from dlion_jax import _mesh
from dlion_jax import _message as message_lib
from dlion_jax import _quantize
from dlion_jax import _sending
from dlion_jax import _strategies
from dlion_jax._checks import check_choice

AGGREGATIONS = message_lib.AGGREGATIONS
VOTES = _quantize.VOTES
COMM_CHOICES = message_lib.COMM_CHOICES

AxisName = Hashable | tuple[Hashable, ...]

#: Leaves of sign votes with this many elements or more are packed on their
#: own; smaller ones share one pass (see ``dlion_jax._sending.packed_message``).
OWN_PACKING = 2**14


@dataclasses.dataclass(frozen=True)
class VoteOptions:
  """How a vote runs: the options :func:`aggregate` takes, passed inward as
  one value. ``comm`` may be ``'auto'`` (resolved per message)."""
  axis_name: AxisName
  num_workers: int
  spec: _quantize.VoteSpec
  aggregation: str
  comm: str
  min_compress_size: int = 0
  bucket_bytes: int | None = None
  kernels: str = "auto"


@dataclasses.dataclass
class _Fusion:
  """The fused kernels of a message (:mod:`dlion_jax.fused`): whether they
  run in Pallas' interpreter, the ``also`` their encoding computes beside
  the words, its value for each run they encoded, and the runs whose
  outcome :func:`dlion_jax.fused.tally` wrote in the leaf's shape
  (``decoded``); ``combine``, ``also`` and ``flags`` take the traced
  ``scalars`` after the leaves, the kernels' inputs. ``flags`` (or None):
  what the encoding also packs, its words by run (``flagged``, by the
  run's first row; see :func:`dlion_jax._lone.one_alone`)."""
  interpret: bool
  also: Callable | None
  forced: bool = False
  combine: Callable | None = None
  scalars: tuple = ()
  values: dict = dataclasses.field(default_factory=dict)
  decoded: set = dataclasses.field(default_factory=set)
  flags: Callable | None = None
  flagged: dict = dataclasses.field(default_factory=dict)

  @staticmethod
  def takes(rows, first: int, num_alone: int, layout, spec) -> bool:
    """Whether run ``first`` (a row of leaves alone) runs the kernels."""
    return first < num_alone and _Fusion.fits_row(rows[first], layout.radix,
                                                  spec)

  @staticmethod
  def radix_of(rows, options: VoteOptions) -> int | None:
    """The radix of the message ``rows`` will be voted in (None:
    ``psum_int8``'s levels)."""
    comm = resolve_comm(options.comm, options.num_workers,
                        aggregation=options.aggregation, spec=options.spec,
                        leaf_sizes=[r[0].size for r in rows],
                        gathers=can_gather(options.axis_name))
    return message_lib.message_radix(comm, options.num_workers,
                                     options.spec)

  @staticmethod
  def fits_row(row, radix: int | None, spec) -> bool:
    """Whether ``row`` fits the kernels in ``radix``. The leaves that fit
    go first in a message of digits: each then gets a decoding or tally
    call of its own (:func:`dlion_jax._fused.planes_in_blocks`), where a
    run before them that is not whole blocks (a stack of biases) would
    send them through the one call for the rest of the message, cut leaf
    by leaf (copies on TPU: the 1B GPT's MaVo ``auto`` step, 44.6 -> 43.3
    bytes a parameter a chip on one v5e 2x4 slice). ``psum_int8``'s
    levels keep the tree's order (nothing is decoded in blocks; the MLP's
    step moved 1.7 bytes a parameter more reordered)."""
    return not spec.scaled and _fused.fits(row[0].shape,
                                          [x.dtype for x in row], radix)

  @classmethod
  def apart(cls, rows, first: int, num_alone: int, layout, spec) -> bool:
    """Whether run ``first`` takes the kernels and its words are not rows
    of 128 lanes (a flat message would relay them out)."""
    shape = rows[first][0].shape
    return (cls.takes(rows, first, num_alone, layout, spec)
            and len(shape) > 1 and shape[-1] != _blocks.LANES)

  def decoding(self, rows, num_alone: int, layout):
    """``layout`` in blocks of :data:`dlion_jax.fused.DECODE_BLOCK` words,
    where the whole message's outcome comes from one kernel: the results
    ``alltoall`` sends back (:func:`dlion_jax.fused.decode`, where a run
    takes the kernels) or every worker's words or their summed counters
    (:func:`dlion_jax.fused.tally` of the message); forced
    (``kernels='pallas'``), or where the blocks' padding adds at most 1%
    to what a worker sends. Else None."""
    back = _strategies.STRATEGIES[layout.comm].sends_back
    if layout.radix is None or (back and not any(
        self.takes(rows, r, num_alone, layout, layout.spec)
        for r in layout.runs)):
      return None
    blocked = dataclasses.replace(layout, result_blocks=_fused.DECODE_BLOCK)
    if self.forced or blocked.sent_bytes() <= 1.01 * layout.sent_bytes():
      return blocked
    return None


def workers_along(axis_name: AxisName | None) -> int:
  """Number of workers along ``axis_name`` (1 for ``None``).

  Raises:
    NameError: ``axis_name`` is not bound by an enclosing ``shard_map`` or
      ``pmap``, with a message saying how to bind it.
    ValueError: it names a mesh axis the compiler owns
      (``dlion_jax._blocks.compiler_axes``).
  """
  if axis_name is None:
    return 1
  try:
    return lax.axis_size(axis_name)
  except NameError:
    # Names an axis the compiler owns, or none of the step's mesh.
    _blocks.compiler_axes(axis_name)
    raise NameError(
        f"axis_name={axis_name!r} is not bound. The distributed Lion update "
        "exchanges votes over that axis, so call `update` inside "
        f"jax.shard_map over a mesh with an axis named {axis_name!r} or inside "
        f"jax.pmap(..., axis_name={axis_name!r}) (dlion_jax.parallel builds "
        "such steps). For single-worker Lion pass axis_name=None.") from None


def resolve_comm(comm: str, num_workers: int, *, aggregation: str,
                 spec: _quantize.VoteSpec = _quantize.BINARY,
                 leaf_sizes: Sequence[int] | None = None,
                 gathers: bool = True) -> str:
  """``comm``, with ``'auto'`` mapped to the strategy that sends the fewest
  bytes (:func:`dlion_jax.message.choose_comm`, whose arguments these are).
  """
  check_choice("comm", comm, COMM_CHOICES)
  if comm != "auto":
    return comm
  return message_lib.choose_comm(num_workers, aggregation=aggregation,
                                 spec=spec, leaf_sizes=leaf_sizes,
                                 gathers=gathers)


def can_gather(axis_name: AxisName) -> bool:
  """Whether ``all_gather``/``all_to_all`` run over ``axis_name``: not over a
  tuple of several axes of which some are bound by ``vmap`` (mesh axes
  under ``shard_map`` and a single vmapped axis are fine)."""
  if not isinstance(axis_name, tuple) or len(axis_name) < 2:
    return True
  manual = jax.sharding.get_abstract_mesh().manual_axes
  return all(a in manual for a in axis_name)


def exchange_votes(codes: list[jax.Array], *, axis_name: AxisName,
                   num_workers: int, spec: _quantize.VoteSpec,
                   aggregation: str, comm: str) -> list[jax.Array]:
  """Votes on a list of flat vectors through one strategy, in one message.

  Each is encoded (:func:`dlion_jax.quantize.encode`), laid out by a
  :class:`dlion_jax.message.MessageLayout` (each leaf on a word boundary)
  and packed in one pass.

  Args:
    codes: one flat float vector per leaf of the values to vote on (Lion's
      pre-sign update ``c``), not codes already encoded.
    axis_name: the axis to vote over.
    num_workers: its size, N.
    spec: what each worker sends (:func:`dlion_jax.quantize.vote_spec`).
    aggregation: ``'mavo'`` or ``'avg'``.
    comm: a strategy or ``'auto'``.

  Returns:
    One int32 vector per input, the same on every worker and through every
    strategy: the outcome of the vote on each parameter, ``sign(s)``
    (``'mavo'``) or the sum of levels ``s`` in ``[-N L, N L]`` (``'avg'``).
  """
  options = VoteOptions(axis_name, num_workers, spec, aggregation, comm)
  layout, result = _exchange([(c,) for c in codes], lambda c: c,
                             [None] * len(codes), options)
  return [x.astype(jnp.int32) for x in layout.split(result)]


def _exchange(rows, combine, alone, options: VoteOptions,
              fusion: _Fusion | None = None, abstained=None, layout=None):
  """The layout and the result of voting on ``combine(*row)`` for each row
  of leaves (see :func:`aggregate`): one integer vector per packing run
  (int32; over a TPU mesh the narrowest that holds it), the outcome for
  each of its digits in order (:meth:`MessageLayout.split`).
  ``alone`` holds a shard (or None) for each of the first rows, encoded one
  by one; ``fusion`` (or None) runs the fused kernels where they fit;
  ``abstained`` (or None) is the count of workers who sent ``c = 0``
  (:func:`dlion_jax._strategies.signed_sum`); ``layout`` (or None) the
  message's, :func:`_layout`'s, where the caller has it."""
  n, spec, aggregation = options.num_workers, options.spec, options.aggregation
  comm, axis_name = options.comm, options.axis_name
  gathers = can_gather(axis_name)
  if not gathers and comm != "auto" and _strategies.STRATEGIES[comm].gathers:
    raise ValueError(
        f"comm={comm!r} cannot vote over axis_name={axis_name!r}, a tuple of "
        "axes bound by nested jax.vmap: jax's all_gather and all_to_all take "
        "one vmapped axis at a time (they fail with 'axis size doesn't "
        "match'). Use comm='psum' or comm='auto' (which picks a psum here), "
        "or vote over mesh axes inside jax.shard_map.")
  if layout is None:
    layout = _layout(rows, len(alone), options)
  comm = layout.comm
  # Where abstainers may tie a binary majority at odd N, alltoall's
  # results go back in radix 2 or 3 (a lax.cond), which XLA decodes.
  ties = abstained is not None and _strategies.STRATEGIES[comm].sends_back \
      and len(_strategies.alltoall_down_radices(
          n, aggregation=aggregation, spec=spec, ties=True)) > 1
  blocked = fusion and not ties and fusion.decoding(rows, len(alone), layout)
  extra = {}
  if blocked:
    layout = blocked
  if blocked and _strategies.STRATEGIES[comm].sends_back:
    decode_blocks = functools.partial(
        _fused.decode, radix=layout.down_radix, num_workers=n, spec=spec,
        aggregation=aggregation, abstained=abstained,
        interpret=fusion.interpret)
    extra = dict(result_words=layout.result_words,
                 decode_with=lambda results, shard: _fused.planes_in_blocks(
                     lambda first, count: decode_blocks(
                         results, shard, blocks=(first, count)), layout))
    if fusion.interpret or _fused.platform() == "tpu":
      # Not through Triton: N rows of words and m sums a block would not
      # fit a GPU program's registers (unchecked; see gpu_warps).
      extra["tally_with"] = functools.partial(
          _fused.vote_shard, result_words=layout.result_words,
          radix=layout.radix, down_radix=layout.down_radix, num_workers=n,
          spec=spec, aggregation=aggregation, abstained=abstained,
          interpret=fusion.interpret)
  strategy = _strategies.STRATEGIES[comm]
  if fusion and strategy.sums and not blocked and any(
      fusion.apart(rows, row, len(alone), layout, spec)
      for row in layout.runs):
    message = _sending.message_by_run(rows, combine, alone, layout, spec,
                                      fusion)
  else:
    message = _sending.packed_message(
        rows, combine, alone, layout, spec, fusion,
        batched=_collectives.mapped_over_mesh(axis_name))
  if abstained is not None:
    extra["abstained"] = abstained
  planes, decode, words = strategy.exchange(message, axis_name=axis_name,
                                            num_workers=n, spec=spec,
                                            aggregation=aggregation, **extra)
  if blocked and words is not None:
    # The message tallied in blocks, its outcome in rows of 128 lanes.
    m, everyone = layout.digits_per_word, words(0, layout.words)

    def tally_blocks(first, count):
      rows = count * _fused.BLOCK_ROWS
      return _fused.tally(
          everyone, (m * rows, _blocks.LANES), radix=layout.radix,
          num_workers=n, spec=spec, aggregation=aggregation,
          first_row=first * _fused.BLOCK_ROWS, abstained=abstained,
          interpret=fusion.interpret).reshape(m, rows, _blocks.LANES)
    planes = _fused.planes_in_blocks(tally_blocks, layout)
    decode, words = (lambda outcome: outcome), None
  # Each run's digits from its own words: read off planes of the whole
  # message, a leaf's update would index them through a division and a
  # select of the place per element (design notes, "Planar digits").
  results = []
  for run, (first, size) in enumerate(layout.run_words):
    row = layout.runs[run]
    if words is not None and fusion and fusion.takes(rows, row, len(alone),
                                                     layout, spec):
      results.append(_fused.tally(
          words(first, size), rows[row][0].shape, radix=layout.radix,
          num_workers=n, spec=spec, aggregation=aggregation,
          abstained=abstained, interpret=fusion.interpret).reshape(-1))
      fusion.decoded.add(run)
      continue
    outcome = decode(planes(first, size).reshape(-1))
    if aggregation == "mavo" and not (strategy.returns_sign or blocked):
      outcome = jnp.sign(outcome)
    if _mesh.on_tpu():
      # XLA:TPU lays a leaf out in tiles, so the outcome's reshape to the
      # leaf's shape is a copy: of 1 byte a parameter rather than 4.
      outcome = outcome.astype(_strategies.int_container(
          n if aggregation == "avg" else 1, spec))
    results.append(outcome)
  return layout, results


def _layout(rows, num_alone: int,
            options: VoteOptions) -> message_lib.MessageLayout:
  """The message of ``rows`` (its first ``num_alone`` each a run), its
  ``comm`` resolved (see :func:`_exchange`)."""
  sizes = [row[0].size for row in rows]
  comm = resolve_comm(options.comm, options.num_workers,
                      aggregation=options.aggregation, spec=options.spec,
                      leaf_sizes=sizes,
                      gathers=can_gather(options.axis_name))
  return message_lib.MessageLayout(
      tuple(sizes), options.num_workers, options.spec, options.aggregation,
      comm, _sending.run_starts(rows, num_alone))


def _finalize(outcome: jax.Array, options: VoteOptions, dtype,
              abstained: jax.Array | None = None) -> jax.Array:
  """``D`` from the vote's outcome (see :func:`exchange_votes`); Avg's over
  the workers present where ``abstained`` of them abstained."""
  if options.aggregation == "mavo":
    return outcome.astype(dtype)
  # s / (N L) read from a table of correctly rounded quotients: XLA would
  # turn a division by a constant into a multiplication by its inverse and
  # fuse it with the consumers in a strategy-dependent order, breaking
  # bit-identity.
  n, level = options.num_workers, options.spec.max_level
  top = n * level
  wide = np.float64 if jnp.dtype(dtype).itemsize > 4 else np.float32
  quotients = np.arange(-top, top + 1, dtype=wide) / wide(top)
  if abstained is not None:
    # A row for each count of abstainers: s / ((N - a) L), the quotients
    # of N - a workers' own table; none present, D = 0.
    present = np.arange(n, 0, -1, dtype=wide)[:, None] * wide(level)
    quotients = np.concatenate([
        np.arange(-top, top + 1, dtype=wide)[None] / present,
        np.zeros((1, 2 * top + 1), wide)])
    quotients = jnp.asarray(quotients, dtype)[abstained]
  index = outcome.astype(jnp.int32) + top
  # Typed on Explicit axes (blocks of sharded leaves), the gather must be
  # told its result lies as its indices do (under a mesh: a spec is
  # refused without one).
  spec = getattr(jax.typeof(index).sharding, "spec", None)
  if jax.sharding.get_abstract_mesh().empty:
    spec = None
  return jnp.asarray(quotients, dtype).at[index].get(out_sharding=spec)


def sign_of_mean(leaves: list[jax.Array], *,
                 axis_name: AxisName) -> list[jax.Array]:
  """``sign(sum_i c_i)`` per leaf through one ``psum``: exact Lion.

  Used for leaves too small for packing to pay (``min_compress_size``).
  Summed in float32, float64 leaves in float64 (a second ``psum``).
  """
  out = [None] * len(leaves)
  wide = {_quantize.scale_dtype(x.dtype) for x in leaves}
  for dtype in sorted(wide, key=str):
    group = [i for i, x in enumerate(leaves)
             if _quantize.scale_dtype(x.dtype) == dtype]
    flat = jnp.concatenate([leaves[i].astype(dtype).ravel() for i in group])
    total = jnp.sign(_collectives.psum(flat, axis_name))
    offset = 0
    for i in group:
      x = leaves[i]
      out[i] = total[offset:offset + x.size].reshape(x.shape).astype(x.dtype)
      offset += x.size
  return out


def aggregate_updates(pre_sign, *, axis_name: AxisName, num_workers: int,
                      spec: _quantize.VoteSpec, aggregation: str, comm: str,
                      min_compress_size: int = 0):
  """Votes on every leaf of ``pre_sign`` and returns the aggregated update.

  Leaves are quantized (:func:`dlion_jax.quantize.encode`), packed into one
  message, exchanged once and split back: ``sign(s)`` (``mavo``) or
  ``s / (N L)`` (``avg``) in each leaf's dtype. Leaves with fewer than
  ``min_compress_size`` elements skip the vote: ``sign(sum_i c_i)``
  through one ``psum`` (:func:`sign_of_mean`).
  """
  return aggregate(lambda c: c, pre_sign, axis_name=axis_name,
                   num_workers=num_workers, spec=spec,
                   aggregation=aggregation, comm=comm,
                   min_compress_size=min_compress_size)


def aggregate(combine: Callable[..., jax.Array], *trees, axis_name: AxisName,
              num_workers: int, spec: _quantize.VoteSpec, aggregation: str,
              comm: str, min_compress_size: int = 0, constants: tuple = (),
              bucket_bytes: int | None = None, with_done: bool = False,
              kernels: _fused.Kernels = "auto",
              also: Callable[..., jax.Array] | None = None,
              present: jax.Array | None = None,
              abstained: jax.Array | None = None,
              lone: Callable[..., jax.Array] | None = None):
  """:func:`aggregate_updates` of ``combine(*leaves)``, leaf by leaf of
  ``trees`` (Lion passes the gradients, the momenta and
  ``c = (1 - b1) g + b1 m``). ``combine`` must be elementwise: it may be
  given leaves laid end to end, or cut into pieces.

  For sign votes the leaves under :data:`OWN_PACKING` elements of each
  dtype are laid end to end first and ``combine`` and the encoding run once
  on all of them: a handful of operations however many small leaves there
  are, where computing ``c`` leaf by leaf would cost XLA a kernel a leaf to
  compile. Bigger leaves, and every leaf of Lion Cub's L1-scaled votes
  (each needs its own scale), are encoded and packed one by one.

  Where the mesh has axes the compiler owns beside ``axis_name`` (a
  ``shard_map`` manual over the data axis only), each device votes on its
  own part of every leaf (``dlion_jax._blocks.on_own_shards``): it
  sends only that part's votes, to its peers across ``axis_name``, and
  the L1 scales and the ``min_compress_size`` test see whole leaves.
  ``combine`` gets ``constants`` after the leaves (traced
  hyperparameters: see ``dlion_jax._blocks.on_own_shards``).

  ``bucket_bytes`` splits the voted leaves into buckets (:func:`buckets`),
  each packed into a message of its own and exchanged on its own, so that
  a bucket's collectives depend on its leaves' gradients only and XLA may
  schedule them while the rest of the backward pass runs.

  ``kernels`` picks how a big leaf is encoded and tallied: ``'pallas'`` through
  the fused kernels of :mod:`dlion_jax.fused` wherever the leaf fits their
  blocks (off TPU in Pallas' interpreter), ``'xla'`` never, ``'auto'`` on TPU
  only. Not in the plain jitted step (:mod:`dlion_jax.workers`), which XLA
  partitions: it cannot partition a Pallas kernel. The encoding kernel also
  computes ``also`` (an elementwise function of the leaves, Lion's momentum
  update) in its pass. With traced ``constants`` the kernels are not used.

  ``with_done`` also returns ``done``, a ``uint8`` zero that XLA can only
  compute once every bucket's outcome is in (see ``_after_every_outcome``), or
  None where the compiler's axes share the vote, and a dict of ``also``'s values
  by leaf (in ``jax.tree.leaves`` order) for the leaves the kernels encoded.

  ``abstained``, an int32 scalar the same on every worker, counts the
  workers whose ``combine`` gave 0 on every leaf: their codes are taken
  back out of every tally, MaVo is the majority of the workers present
  and Avg their mean (0 where none is). ``present`` (a bool scalar, or
  None) says whether this worker votes: ``combine``, ``also`` and
  ``lone`` take it after ``constants``, and so do the kernels. Where
  one worker alone is present (``abstained`` is N - 1) the update is
  ``sign(lone(*leaves))`` (``lone`` elementwise, 0 on every other worker;
  see :func:`_lone_outcomes`), exact leaves the sign of its sum.
  """
  check_choice("kernels", kernels, _fused.KERNELS)
  options = VoteOptions(axis_name, num_workers, spec, aggregation, comm,
                        min_compress_size, bucket_bytes, kernels)
  axes = _blocks.compiler_axes(axis_name, jax.tree.leaves(trees[0]))
  fuse = _uses_kernels(kernels, constants, axis_name)
  # Traced values enter a region as constants; the kernels take these.
  constants += tuple(x for x in (present, abstained) if x is not None)
  def run(*trees, leaf_shards=None, constants):
    count = None
    if abstained is not None:
      *constants, count = constants
    return _aggregate(combine, *trees, constants=tuple(constants),
                      options=options, leaf_shards=leaf_shards, fuse=fuse,
                      also=None if axes else also, abstained=count,
                      lone=lone)
  if axes:
    updates, done, also_values = _blocks.on_own_shards(
        lambda *a, **k: run(*a, **k)[0], trees, axes, constants), None, {}
  else:
    updates, done, also_values = run(*trees, constants=constants)
  return (updates, done, also_values) if with_done else updates


def _uses_kernels(kernels: str, constants: tuple, axis_name) -> bool:
  """Whether :func:`aggregate` takes the fused kernels (see there; not
  with traced ``constants`` of the caller's, such as ``b1``)."""
  if constants or kernels == "xla" or (
      kernels == "auto" and not _mesh.on_tpu()):
    return False
  if _collectives.mapped_over_mesh(axis_name):
    if kernels == "pallas":
      raise ValueError(
          "kernels='pallas' cannot run in a plain jitted step "
          "(dl.workers): XLA partitions that step, and cannot partition a "
          "Pallas kernel on TPU or GPU (nor its interpreter's on Explicit "
          "axes elsewhere). Use kernels='auto' (the XLA path there) or a "
          "step built by dl.parallel.make_train_step.")
    return False
  return True


def _aggregate(combine, *trees, options: VoteOptions, leaf_shards,
               constants: tuple = (), fuse: bool = False,
               also: Callable | None = None, abstained=None,
               lone: Callable | None = None):
  """:func:`aggregate` on leaves each device holds whole (or the shards
  ``leaf_shards`` names), its ``done``, and the value of ``also`` by leaf
  where the fused kernels (``fuse``) computed it; ``combine``, ``also``
  and ``lone`` take ``constants`` after the leaves."""
  kernel_combine, kernel_lone = combine, lone
  combine = lambda *leaves: kernel_combine(*leaves, *constants)
  leaves, treedef = jax.tree.flatten(trees[0])
  columns = [leaves] + [treedef.flatten_up_to(t) for t in trees[1:]]
  rows = list(zip(*columns))
  leaf_shards = leaf_shards or [None] * len(leaves)
  sizes = [x.size if s is None else s.size
           for x, s in zip(leaves, leaf_shards)]
  # An empty leaf's update: a constant, one for all workers (not its
  # gradient, a row per worker where the workers are a vmapped axis).
  out = [jnp.zeros(x.shape, x.dtype) if x.size == 0 else None
         for x in leaves]
  exact = [i for i, x in enumerate(leaves)
           if x.size > 0 and sizes[i] < options.min_compress_size]
  voted = [i for i, x in enumerate(leaves)
           if x.size > 0 and sizes[i] >= options.min_compress_size]
  lone = lone and (lambda *leaves: kernel_lone(*leaves, *constants),
                   abstained == options.num_workers - 1)
  if exact:
    values = [jnp.where(lone[1], lone[0](*rows[i]), combine(*rows[i]))
              if lone else combine(*rows[i]) for i in exact]
    for i, d in zip(exact, sign_of_mean(values,
                                        axis_name=options.axis_name)):
      out[i] = d
  nbytes = [sizes[i] * x.dtype.itemsize for i, x in enumerate(leaves)]
  done, also_values = [], {}
  for bucket in message_lib.buckets(voted, nbytes, options.bucket_bytes):
    run = fuse and _Fusion(_fused.interpreted(), also,
                           forced=options.kernels == "pallas",
                           combine=kernel_combine, scalars=constants)
    if run and lone and not options.spec.scaled:
      run = _lone.one_alone(run, kernel_lone, abstained,
                            options.num_workers, options.spec)
    updates, outcomes = _vote_in_one_message(
        [rows[i] for i in bucket], [leaf_shards[i] for i in bucket], combine,
        options, run, abstained, lone)
    for i, d in zip(bucket, updates):
      out[i] = d
    also_values.update({bucket[k]: v for k, v in (run.values.items()
                                                  if run else ())})
    if outcomes:
      done.append(_after_every_outcome(
          outcomes, options.num_workers * options.spec.max_level))
  done = functools.reduce(jnp.maximum, done) if done else None
  return jax.tree.unflatten(treedef, out), done, also_values


def _after_every_outcome(outcomes: list[jax.Array], top: int) -> jax.Array:
  """A ``uint8`` zero XLA cannot fold, computed from the vote's ``outcomes``
  (integers in ``[-top, top]``): ``max((o[:8] > top) >> 1)`` over every
  run's.

  A value that waits for the vote, for whatever must not be scheduled before it
  (``lion._after_vote``). Read off the integers rather than the update: Avg's
  update, a gather from a table, would be written out whole to be read. Every
  run's, so that XLA:CPU writes out every run's tally: fused instead into the
  leaf's update, a run's tally of ternary votes (radix-3 digits) unpacked every
  worker's digit with a division by the place value of each element's place
  (measured in the design notes, "The momentum's update waits for the vote").
  """
  firsts = jnp.concatenate([o[:8].astype(jnp.int32) for o in outcomes])
  # A flag shifted out: 0 whatever the compare gives (XLA:CPU once computed
  # it true of outcomes in range, in a program of two optimizers).
  return jnp.max((firsts > top).astype(jnp.uint8) >> 1, initial=0)


def _vote_in_one_message(rows, leaf_shards, combine, options: VoteOptions,
                         fusion: _Fusion | None = None, abstained=None,
                         lone=None) -> tuple[list[jax.Array], list[jax.Array]]:
  """The update of each row of leaves, voted in one message, and the vote's
  outcome for each packing run. ``fusion.values`` comes back by row."""
  # Big leaves first, each packed alone; then the small ones of sign votes,
  # grouped by dtypes so that each group concatenates (see
  # _sending.packed_message).
  alone = [k for k, row in enumerate(rows)
           if options.spec.scaled or row[0].size >= OWN_PACKING]
  if fusion and (radix := fusion.radix_of(rows, options)) is not None:
    alone.sort(key=lambda k: not fusion.fits_row(rows[k], radix,
                                                 options.spec))
  grouped = sorted(set(range(len(rows))) - set(alone),
                   key=lambda k: (str(_sending.dtypes_of(rows[k])), k))
  order = alone + grouped
  ordered, shards = [rows[k] for k in order], [leaf_shards[k] for k in alone]
  voted, flags, layout = combine, None, None
  if lone and not options.spec.scaled:
    voted = _lone.or_lone(combine, lone)
    layout = _layout(ordered, len(alone), options)
    if options.spec.radix == 2 and layout.radix is not None:
      flags = _lone.flags(lone, ordered, len(alone), layout, fusion)
  layout, results = _exchange(ordered, voted, shards, options, fusion,
                              abstained, layout)
  if lone and (options.spec.scaled or layout.radix is None
               and options.spec.radix == 2):
    # L1-scaled levels are not signs, and psum_int8's binary levels no 0.
    results = _lone_outcomes(lone, ordered, shards, options, layout, results)
  if fusion:
    fusion.values = {order[j]: v for j, v in fusion.values.items()
                     if v is not None}
  # On TPU a leaf alone in its run gets D from its narrow outcome reshaped
  # to the leaf (see _exchange). Otherwise D once per run and dtype (that
  # of c), then each leaf's stretch of it (an operation a run, not a leaf).
  leafwise = len(alone) if _mesh.on_tpu() else 0

  def pieces(zeros=None):
    """Each leaf's outcome in its shape (the first ``leafwise``), else
    each run's; 0 where ``zeros`` (each run's summed flags) says."""
    out = {}
    for j, row in enumerate(ordered):
      run = layout.run_of(j)
      if j >= leafwise:
        if ("run", run) not in out:
          out["run", run] = results[run] if zeros is None else _lone.unflagged(
              results[run], zeros[run], layout)
        continue
      outcome = layout.leaf_values(results[run], j).reshape(row[0].shape)
      if zeros is not None:
        outcome = _lone.unflagged(outcome, zeros[run], layout)
      if layout.radix is not None and not (fusion and run in fusion.decoded):
        # Digits decoded from words: XLA:TPU would fuse their decoding with
        # the leaf's float update and lay out floats in the leaf's tiles
        # (psum_int8's outcome is the summed integers themselves, a tally
        # kernel's already in the leaf's shape). _fused.decode's rows keep
        # it: without, XLA:TPU relaid out floats (MaVo auto, large tree:
        # 32.1 -> 42.1 bytes a parameter).
        outcome = lax.optimization_barrier(outcome)
      out["leaf", j] = outcome
    return out
  if flags is None:
    outcomes = pieces()
  else:
    outcomes = _lone.zeros(lone[1], pieces, flags, fusion, layout,
                           options.axis_name)
  dtypes, updates, out = {}, {}, [None] * len(rows)
  for j, k in enumerate(order):
    key = _sending.dtypes_of(rows[k])
    if key not in dtypes:
      dtypes[key] = jax.eval_shape(
          combine, *[jax.ShapeDtypeStruct((), d) for d in key]).dtype
    run = (layout.run_of(j), dtypes[key])
    shape = rows[k][0].shape
    if j < leafwise:
      out[k] = _finalize(outcomes["leaf", j], options, run[1], abstained)
      continue
    if run not in updates:
      updates[run] = _finalize(outcomes["run", run[0]], options, run[1],
                               abstained)
    out[k] = layout.leaf_values(updates[run], j).reshape(shape)
  return out, results


def _lone_outcomes(lone, rows, alone, options, layout, results):
  """``results``, or on the step ``lone[1]`` each run's outcome of the
  signs of ``lone[0](*row)`` (Avg's sum of levels: the sign times L),
  voted as ternary MaVo through the vote's strategy in a
  :func:`jax.lax.cond` (zeros on other steps) and selected as integers,
  so the update's arithmetic is the vote's (a select of the floats
  changed XLA:CPU's rounding after it). The cond reads the leaves, not
  the vote: XLA runs it before the encoding kernel writes the new
  momentum over the old (read after it, the old was copied every step)."""
  ternary = dataclasses.replace(options, spec=_quantize.TERNARY,
                                aggregation="mavo", comm=layout.comm)
  unit = 1 if options.aggregation == "mavo" else options.spec.max_level

  def signs():
    signs_layout, outcomes = _exchange(rows, lone[0], alone, ternary)
    runs = layout.runs_of([x.astype(jnp.int32) * unit
                           for x in signs_layout.split(outcomes)])
    return [x.astype(r.dtype) for x, r in zip(runs, results)]
  voted = lax.cond(lone[1], signs,
                   lambda: [jnp.zeros(r.shape, r.dtype) for r in results])
  return lax.cond(lone[1], lambda: voted, lambda: list(results))
