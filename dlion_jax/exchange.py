"""Exchanging packed votes over a named axis (``shard_map`` / ``pmap``).

Each worker holds a vector of vote *codes* (one per parameter): ``1`` for a
``+1`` vote and ``0`` for ``-1`` (binary), or ``sign(c) + 1`` (ternary). Every
strategy returns the same integer vector on every worker, bit for bit: the
signed vote sum ``s = sum_i d_i`` (or, for majority vote with ``alltoall``,
``sign(s)``, which is all the majority needs). :func:`aggregate_updates` turns
that into the update ``D`` of Distributed Lion (Liu et al., 2024, Alg. 1).

Strategies (``N`` workers, wire bits per parameter per worker and step):

* ``alltoall``: pack the votes, ``all_to_all`` so worker ``k`` receives every
  worker's shard ``k``, vote on that shard, ``all_gather`` the packed result:
  ``(N-1)/N * (up + down)``.
* ``allgather``: ``all_gather`` everyone's packed votes and vote locally:
  ``(N-1) * up``.
* ``psum``: counters of radix ``levels*N+1`` packed into words and summed by
  an integer ``psum`` (Lion Cub, Ishikawa et al., 2025): ``2(N-1)/N * bits``.
* ``psum_int8``: an ``int8`` of ``+-1`` per parameter, ``psum`` (the NeurIPS
  paper's implementation): ``2(N-1)/N * 8``.
* ``auto``: the one with the fewest wire bits for the axis size
  (:func:`dlion_jax.accounting.wire_bits`).

The whole pytree goes through one flat buffer, so a step issues a fixed number
of collectives however many leaves the model has.
"""

from __future__ import annotations

from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlion_jax import accounting
from dlion_jax._checks import check_choice
from dlion_jax import packing

AGGREGATIONS = accounting.AGGREGATIONS
VOTES = accounting.VOTES
COMMS = accounting.COMMS + ("auto",)

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
                 vote: str) -> str:
  """Maps ``comm='auto'`` to the cheapest strategy on the wire for N workers."""
  check_choice("comm", comm, COMMS)
  if comm != "auto":
    return comm
  # Ties go to the strategy with fewer collectives (less latency).
  by_latency = ("allgather", "psum", "alltoall", "psum_int8")
  return min(
      by_latency,
      key=lambda c: round(accounting.wire_bits(
          num_workers, aggregation=aggregation, vote=vote, comm=c), 9))


def vote_codes(c: jax.Array, vote: str) -> jax.Array:
  """Encodes Lion's pre-sign update as vote codes (``uint8``).

  ``binary``: ``1`` if ``c > 0`` else ``0`` (``+-0`` and NaN vote ``-1``).
  ``ternary``: ``sign(c) + 1`` in ``{0, 1, 2}`` (NaN votes ``0``).
  """
  positive = c > 0
  if vote == "binary":
    return positive.astype(jnp.uint8)
  negative = c < 0
  return (1 + positive.astype(jnp.int8) - negative.astype(jnp.int8)).astype(
      jnp.uint8)


def _signed_sum(code_sum: jax.Array, num_workers: int, vote: str) -> jax.Array:
  """Sum of codes -> sum of votes in [-N, N] (int32)."""
  total = code_sum.astype(jnp.int32)
  return 2 * total - num_workers if vote == "binary" else total - num_workers


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


def exchange_alltoall(codes, *, axis_name, num_workers, vote, aggregation):
  """Reduce-scatter style vote: all_to_all the packed votes, vote a shard,
  all_gather the packed shard results."""
  n = num_workers
  up_radix = accounting.vote_radix(vote)
  down_radix = accounting.alltoall_down_radix(n, aggregation=aggregation,
                                              vote=vote)
  unit = n * packing.lcm(packing.digits_per_word(up_radix),
                         packing.digits_per_word(down_radix))
  length = codes.shape[0]
  codes = packing.pad_to_multiple(codes, unit)
  up = packing.pack_digits(codes, up_radix).reshape(n, -1)
  mine = lax.all_to_all(up, axis_name, 0, 0)
  code_sum = packing.sum_packed(mine, up_radix)
  if aggregation == "avg":
    down = code_sum                    # the exact count, radix levels*N+1
  elif down_radix == 2:
    down = _signed_sum(code_sum, n, vote) > 0      # odd N, binary: no ties
  else:
    down = jnp.sign(_signed_sum(code_sum, n, vote)) + 1
  words = packing.pack_digits(down.astype(packing.digit_dtype(down_radix)),
                              down_radix)
  words = _all_gather(words, axis_name, tiled=True)
  result = packing.unpack_digits(words, down_radix, length).astype(jnp.int32)
  if aggregation == "avg":
    return _signed_sum(result, n, vote)
  return 2 * result - 1 if down_radix == 2 else result - 1


def exchange_allgather(codes, *, axis_name, num_workers, vote, aggregation):
  """Every worker gathers everyone's packed votes and counts them."""
  del aggregation
  radix = accounting.vote_radix(vote)
  words = packing.pack_digits(codes, radix)
  everyone = _all_gather(words, axis_name)
  code_sum = packing.sum_packed(everyone, radix, codes.shape[0])
  return _signed_sum(code_sum, num_workers, vote)


def exchange_psum(codes, *, axis_name, num_workers, vote, aggregation):
  """Packed counters summed by an integer psum (Lion Cub's p-bit all-reduce).

  Each code is a digit of radix ``(levels - 1) * N + 1``, so the sum of N
  workers' digits never carries into the next digit of the word.
  """
  del aggregation
  radix = accounting.psum_radix(num_workers, vote)
  words = packing.pack_digits(codes.astype(packing.digit_dtype(radix)), radix)
  total = lax.psum(words, axis_name)
  code_sum = packing.unpack_digits(total, radix, codes.shape[0])
  return _signed_sum(code_sum, num_workers, vote)


def exchange_psum_int8(codes, *, axis_name, num_workers, vote, aggregation):
  """The paper's implementation: psum an int8 container of the +-1 votes.

  The container widens to int16/int32 when N exceeds what int8 can sum.
  """
  del aggregation
  dtype = accounting.int_container(num_workers)
  votes = _signed_sum(codes, 1, vote).astype(dtype)
  return lax.psum(votes, axis_name).astype(jnp.int32)


_EXCHANGES = {
    "alltoall": exchange_alltoall,
    "allgather": exchange_allgather,
    "psum": exchange_psum,
    "psum_int8": exchange_psum_int8,
}


def exchange_votes(codes: jax.Array, *, axis_name: AxisName, num_workers: int,
                   vote: str, aggregation: str, comm: str) -> jax.Array:
  """Runs one strategy on a flat vector of vote codes.

  Returns:
    int32 vector, same on every worker: the vote sum ``s`` in ``[-N, N]``, or
    ``sign(s)`` (majority vote through ``alltoall``).
  """
  comm = resolve_comm(comm, num_workers, aggregation=aggregation, vote=vote)
  return _EXCHANGES[comm](codes, axis_name=axis_name, num_workers=num_workers,
                          vote=vote, aggregation=aggregation)


def _finalize(vote_sum: jax.Array, num_workers: int, aggregation: str, dtype):
  if aggregation == "mavo":
    return jnp.sign(vote_sum).astype(dtype)
  # s / N read from a table of correctly rounded quotients: XLA would turn a
  # division by the constant N into a multiplication by 1/N and fuse it with
  # the consumers in a strategy-dependent order, breaking bit-identity.
  quotients = (np.arange(-num_workers, num_workers + 1, dtype=np.float32)
               / np.float32(num_workers))
  return jnp.asarray(quotients, dtype)[vote_sum + num_workers]


def aggregate_updates(pre_sign, *, axis_name: AxisName, num_workers: int,
                      vote: str, aggregation: str, comm: str):
  """Votes on every leaf of ``pre_sign`` and returns the aggregated update.

  All leaves are flattened into one buffer of codes, exchanged once, and split
  back: ``sign(s)`` (``mavo``) or ``s / N`` (``avg``) in each leaf's dtype.
  """
  leaves, treedef = jax.tree.flatten(pre_sign)
  if not leaves:
    return pre_sign
  codes = jnp.concatenate([vote_codes(x.ravel(), vote) for x in leaves])
  if codes.shape[0] == 0:
    return jax.tree.map(jnp.zeros_like, pre_sign)
  vote_sum = exchange_votes(codes, axis_name=axis_name,
                            num_workers=num_workers, vote=vote,
                            aggregation=aggregation, comm=comm)
  out, offset = [], 0
  for x in leaves:
    part = vote_sum[offset:offset + x.size].reshape(x.shape)
    out.append(_finalize(part, num_workers, aggregation, x.dtype))
    offset += x.size
  return jax.tree.unflatten(treedef, out)
