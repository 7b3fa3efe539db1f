"""Exchanging packed votes over a named axis (``shard_map`` / ``pmap``).

Each worker holds a vector of vote *codes* (one per parameter,
:mod:`dlion_jax.quantize`): ``1`` for a ``+1`` vote and ``0`` for ``-1``
(binary), ``q + L`` for a level ``q`` in ``[-L, L]`` (ternary: ``L = 1``;
Lion Cub's p-bit votes: ``L = 2**(p-1) - 1``). Every strategy returns the same
integer vector on every worker, bit for bit: the sum of levels
``s = sum_i q_i`` (or, for majority vote with ``alltoall``, ``sign(s)``,
which is all the majority needs). :func:`aggregate_updates` turns
that into the update ``D`` of Distributed Lion (Liu et al., 2024, Alg. 1).

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
* ``auto``: the one with the fewest wire bits for the axis size
  (:func:`dlion_jax.accounting.wire_bits`).

The whole pytree goes through one message: each leaf is packed into whole
words and the words are laid end to end, so a step issues a fixed number of
collectives however many leaves the model has.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import accounting
from dlion_jax import packing
from dlion_jax import quantize
from dlion_jax._checks import check_choice

AGGREGATIONS = accounting.AGGREGATIONS
VOTES = accounting.VOTES
COMM_CHOICES = accounting.COMMS + ("auto",)

AxisName = Hashable | tuple[Hashable, ...]


def axis_size(axis_name: AxisName | None) -> int:
  """Number of workers along ``axis_name`` (1 for ``None``).

  Raises:
    NameError: ``axis_name`` is not bound by an enclosing ``shard_map`` or
      ``pmap``, with a message saying how to bind it.
  """
  if axis_name is None:
    return 1
  try:
    return lax.axis_size(axis_name)
  except NameError:
    raise NameError(
        f"axis_name={axis_name!r} is not bound. The distributed Lion update "
        "exchanges votes over that axis, so call `update` inside "
        f"jax.shard_map over a mesh with an axis named {axis_name!r} or inside "
        f"jax.pmap(..., axis_name={axis_name!r}) (dlion_jax.parallel builds "
        "such steps). For single-worker Lion pass axis_name=None.") from None


def resolve_comm(comm: str, num_workers: int, *, aggregation: str,
                 vote: accounting.VoteCode,
                 leaf_sizes: Sequence[int] | None = None,
                 gathers: bool = True) -> str:
  """Maps ``comm='auto'`` to the strategy that sends the fewest bytes.

  With ``leaf_sizes`` the exact message sizes, padding included, decide (on
  a small model padding can outweigh the asymptotic figure); without, the
  bits per parameter of :func:`dlion_jax.accounting.vote_bits`. Ties go to
  the strategy with fewer collectives (less latency). ``gathers=False``
  leaves out the strategies that all_gather (see :func:`can_gather`).
  """
  check_choice("comm", comm, COMM_CHOICES)
  if comm != "auto":
    return comm
  by_latency = ("allgather", "psum", "alltoall", "psum_int8")
  if not gathers:
    by_latency = ("psum", "psum_int8")
  def cost(c):
    if leaf_sizes is not None:
      return accounting.message_bytes(leaf_sizes, num_workers,
                                      aggregation=aggregation, vote=vote,
                                      comm=c)
    return round(accounting.vote_bits(num_workers, aggregation=aggregation,
                                      vote=vote, comm=c), 9)
  return min(by_latency, key=cost)


def can_gather(axis_name: AxisName) -> bool:
  """Whether ``all_gather``/``all_to_all`` run over ``axis_name``: not over a
  tuple of several axes of which some are bound by ``vmap`` (mesh axes
  under ``shard_map`` and a single vmapped axis are fine)."""
  if not isinstance(axis_name, tuple) or len(axis_name) < 2:
    return True
  manual = jax.sharding.get_abstract_mesh().manual_axes
  return all(a in manual for a in axis_name)


def _signed_sum(code_sum: jax.Array, num_workers: int,
                vote: accounting.VoteCode) -> jax.Array:
  """Sum of codes -> sum of levels in [-N L, N L] (int32)."""
  total = code_sum.astype(jnp.int32)
  if vote == "binary":
    return 2 * total - num_workers
  return total - num_workers * accounting.vote_max(vote)


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


def exchange_alltoall(message, *, axis_name, num_workers, vote, aggregation):
  """Reduce-scatter style vote: all_to_all the packed votes, vote a shard,
  all_gather the packed shard results."""
  n = num_workers
  up_radix = accounting.vote_radix(vote)
  down_radix = accounting.alltoall_down_radix(n, aggregation=aggregation,
                                              vote=vote)
  up = message.reshape(n, -1)     # padded by accounting.message_word_multiple
  mine = lax.all_to_all(up, axis_name, 0, 0)
  code_sum = packing.sum_packed(mine, up_radix)
  if aggregation == "avg":
    down = code_sum                    # exact count, radix (levels-1)*N+1
  elif down_radix == 2:
    down = _signed_sum(code_sum, n, vote) > 0      # odd N, binary: no ties
  else:
    down = jnp.sign(_signed_sum(code_sum, n, vote)) + 1
  words = packing.pack_digits(down.astype(packing.digit_dtype(down_radix)),
                              down_radix)
  words = _all_gather(words, axis_name, tiled=True)
  result = packing.unpack_digits(words, down_radix).astype(jnp.int32)
  if aggregation == "avg":
    return _signed_sum(result, n, vote)
  return 2 * result - 1 if down_radix == 2 else result - 1


def exchange_allgather(message, *, axis_name, num_workers, vote, aggregation):
  """Every worker gathers everyone's packed votes and counts them."""
  del aggregation
  everyone = _all_gather(message, axis_name)
  code_sum = packing.sum_packed(everyone, accounting.vote_radix(vote))
  return _signed_sum(code_sum, num_workers, vote)


def exchange_psum(message, *, axis_name, num_workers, vote, aggregation):
  """Packed counters summed by an integer psum (Lion Cub's p-bit all-reduce).

  Each code is a digit of radix ``(levels - 1) * N + 1``, so the sum of N
  workers' digits never carries into the next digit of the word.
  """
  del aggregation
  radix = accounting.psum_radix(num_workers, vote)
  code_sum = packing.unpack_digits(lax.psum(message, axis_name), radix)
  return _signed_sum(code_sum, num_workers, vote)


def exchange_psum_int8(message, *, axis_name, num_workers, vote, aggregation):
  """The paper's implementation: psum an int8 container of the +-1 votes.

  The container widens to int16/int32 when N exceeds what int8 can sum.
  """
  del num_workers, vote, aggregation
  return lax.psum(message, axis_name).astype(jnp.int32)


_EXCHANGES = {
    "alltoall": exchange_alltoall,
    "allgather": exchange_allgather,
    "psum": exchange_psum,
    "psum_int8": exchange_psum_int8,
}


def _message_part(codes: jax.Array, comm: str, num_workers: int,
                  vote: accounting.VoteCode) -> jax.Array:
  """One leaf's part of the message: packed codes, or ints for psum_int8."""
  radix = accounting.message_radix(comm, num_workers, vote)
  if radix is None:
    dtype = accounting.int_container(num_workers, vote)
    return _signed_sum(codes, 1, vote).astype(dtype)
  return packing.pack_digits(codes.astype(packing.digit_dtype(radix)), radix)


def exchange_votes(codes: list[jax.Array], *, axis_name: AxisName,
                   num_workers: int, vote: accounting.VoteCode,
                   aggregation: str, comm: str) -> list[jax.Array]:
  """Votes on a list of code vectors through one strategy, in one message.

  Each leaf is packed on its own (padded to whole words) and the packed
  words are concatenated: packing before concatenating keeps the packing
  vectorised and the copy small.

  Args:
    codes: one flat ``uint8`` vector of vote codes per leaf
      (:func:`dlion_jax.quantize.encode`).
    axis_name: the axis to vote over.
    num_workers: its size, N.
    vote: the vote code (``'binary'``, ``'ternary'`` or a level count).
    aggregation: ``'mavo'`` or ``'avg'``.
    comm: a strategy or ``'auto'``.

  Returns:
    One int32 vector per input, same on every worker: the sum of levels
    ``s`` in ``[-N L, N L]``, or ``sign(s)`` (majority vote through
    ``alltoall``).
  """
  gathers = can_gather(axis_name)
  if not gathers and comm in ("alltoall", "allgather"):
    raise ValueError(
        f"comm={comm!r} cannot vote over axis_name={axis_name!r}, a tuple of "
        "axes bound by nested jax.vmap: jax's all_gather and all_to_all take "
        "one vmapped axis at a time (they fail with 'axis size doesn't "
        "match'). Use comm='psum' or comm='auto' (which picks a psum here), "
        "or vote over mesh axes inside jax.shard_map.")
  comm = resolve_comm(comm, num_workers, aggregation=aggregation, vote=vote,
                      leaf_sizes=[c.size for c in codes], gathers=gathers)
  parts = [_message_part(c, comm, num_workers, vote) for c in codes]
  # Written in place into a zero (padded) buffer rather than concatenated:
  # XLA:CPU fuses a concatenate with the packing into one slow loop.
  length = sum(p.shape[0] for p in parts)
  multiple = accounting.message_word_multiple(
      comm, num_workers, aggregation=aggregation, vote=vote)
  message = jnp.zeros(-(-length // multiple) * multiple, parts[0].dtype)
  offset = 0
  for part in parts:
    message = lax.dynamic_update_slice(message, part, (offset,))
    offset += part.shape[0]
  result = _EXCHANGES[comm](message, axis_name=axis_name,
                            num_workers=num_workers, vote=vote,
                            aggregation=aggregation)
  radix = accounting.message_radix(comm, num_workers, vote)
  per_word = 1 if radix is None else packing.digits_per_word(radix)
  out, offset = [], 0
  for c in codes:
    out.append(result[offset:offset + c.size])
    offset += -(-c.size // per_word) * per_word
  return out


def _finalize(vote_sum: jax.Array, num_workers: int, aggregation: str,
              vote: accounting.VoteCode, dtype) -> jax.Array:
  if aggregation == "mavo":
    return jnp.sign(vote_sum).astype(dtype)
  # s / (N L) read from a table of correctly rounded quotients: XLA would
  # turn a division by a constant into a multiplication by its inverse and
  # fuse it with the consumers in a strategy-dependent order, breaking
  # bit-identity.
  top = num_workers * accounting.vote_max(vote)
  wide = np.float64 if jnp.dtype(dtype).itemsize > 4 else np.float32
  quotients = np.arange(-top, top + 1, dtype=wide) / wide(top)
  return jnp.asarray(quotients, dtype)[vote_sum + top]


def sign_of_mean(leaves: list[jax.Array], *,
                 axis_name: AxisName) -> list[jax.Array]:
  """``sign(sum_i c_i)`` per leaf through one ``psum``: exact Lion.

  Used for leaves too small for packing to pay (``min_compress_size``).
  Summed in float32, float64 leaves in float64 (a second ``psum``).
  """
  out = [None] * len(leaves)
  for dtype in sorted({quantize.scale_dtype(x.dtype) for x in leaves}, key=str):
    group = [i for i, x in enumerate(leaves)
             if quantize.scale_dtype(x.dtype) == dtype]
    flat = jnp.concatenate([leaves[i].astype(dtype).ravel() for i in group])
    total = jnp.sign(lax.psum(flat, axis_name))
    offset = 0
    for i in group:
      x = leaves[i]
      out[i] = total[offset:offset + x.size].reshape(x.shape).astype(x.dtype)
      offset += x.size
  return out


def aggregate_updates(pre_sign, *, axis_name: AxisName, num_workers: int,
                      vote: accounting.VoteCode, aggregation: str, comm: str,
                      min_compress_size: int = 0):
  """Votes on every leaf of ``pre_sign`` and returns the aggregated update.

  Leaves are quantized (:func:`dlion_jax.quantize.encode`), packed into one
  message, exchanged once and split back: ``sign(s)`` (``mavo``) or
  ``s / (N L)`` (``avg``) in each leaf's dtype. Leaves with fewer than
  ``min_compress_size`` elements skip the vote: ``sign(sum_i c_i)``
  through one float32 ``psum`` (:func:`sign_of_mean`).
  """
  leaves, treedef = jax.tree.flatten(pre_sign)
  out = [jnp.zeros_like(x) for x in leaves]
  exact = [i for i, x in enumerate(leaves) if 0 < x.size < min_compress_size]
  voted = [i for i, x in enumerate(leaves)
           if x.size > 0 and x.size >= min_compress_size]
  if exact:
    for i, d in zip(exact, sign_of_mean([_whole(leaves[i]) for i in exact],
                                        axis_name=axis_name)):
      out[i] = _like(d, leaves[i])
  if voted:
    codes = [_whole(quantize.encode(leaves[i], vote)).ravel() for i in voted]
    sums = exchange_votes(codes, axis_name=axis_name, num_workers=num_workers,
                          vote=vote, aggregation=aggregation, comm=comm)
    for i, s in zip(voted, sums):
      x = leaves[i]
      out[i] = _like(_finalize(s, num_workers, aggregation, vote,
                               x.dtype).reshape(x.shape), x)
  return jax.tree.unflatten(treedef, out)


def _explicit_spec(x: jax.Array):
  """The leaf's partition over explicitly sharded mesh axes, or None."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  return spec if spec is not None and any(p is not None for p in spec) else None


def _whole(x: jax.Array) -> jax.Array:
  """``x`` gathered over the explicit mesh axes it is sharded on (a model
  axis beside the data axis): a worker votes on whole leaves. Codes are
  gathered rather than gradients, at a byte per parameter."""
  return x if _explicit_spec(x) is None else jax.sharding.reshard(x, P())


def _like(d: jax.Array, x: jax.Array) -> jax.Array:
  """The update ``d`` sharded as its leaf ``x`` (see :func:`_whole`)."""
  spec = _explicit_spec(x)
  return d if spec is None else jax.sharding.reshard(d, spec)
