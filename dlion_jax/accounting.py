"""How many bits each worker puts on the wire: analytic, and read off HLO.

Conventions (per worker, per step), for a buffer of ``B`` bytes and a group of
``N`` workers, as the usual bandwidth-optimal algorithms send:

* all-reduce (ring): ``2 (N - 1) / N * B``
* all-gather of a ``B``-byte result, all-to-all of a ``B``-byte buffer,
  reduce-scatter of a ``B``-byte input: ``(N - 1) / N * B``

:func:`wire_bits` gives the figure a configuration costs per parameter;
:func:`collective_bytes` reads what a compiled function really sends, so the
two can be checked against each other.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax.numpy as jnp

from dlion_jax import packing
from dlion_jax._checks import check_choice

AGGREGATIONS = ("mavo", "avg")
VOTES = ("binary", "ternary")
COMMS = ("alltoall", "allgather", "psum", "psum_int8")


def vote_radix(vote: str) -> int:
  """Distinct values one worker's vote takes: 2 (binary) or 3 (ternary)."""
  return 2 if vote == "binary" else 3


def psum_radix(num_workers: int, vote: str) -> int:
  """Radix of a counter that can hold the sum of N workers' vote codes."""
  return (vote_radix(vote) - 1) * num_workers + 1


def mavo_has_ties(num_workers: int, vote: str) -> bool:
  """Whether a majority vote can end in a tie (sum 0), i.e. D = 0."""
  return vote == "ternary" or num_workers % 2 == 0


def alltoall_down_radix(num_workers: int, *, aggregation: str,
                        vote: str) -> int:
  """Radix of the per-parameter result that ``alltoall`` all-gathers."""
  if aggregation == "avg":
    return psum_radix(num_workers, vote)
  return 3 if mavo_has_ties(num_workers, vote) else 2


def int_container(num_workers: int):
  """Signed integer dtype in which ``psum_int8`` sums N votes of +-1."""
  for dtype in (jnp.int8, jnp.int16, jnp.int32):
    if num_workers <= jnp.iinfo(dtype).max:
      return dtype
  raise ValueError(f"num_workers={num_workers} exceeds int32.")


def message_radix(comm: str, num_workers: int, vote: str) -> int | None:
  """Radix in which a strategy packs the votes it sends (None: int votes)."""
  if comm == "psum":
    return psum_radix(num_workers, vote)
  if comm == "psum_int8":
    return None
  return vote_radix(vote)


def message_word_multiple(comm: str, num_workers: int, *, aggregation: str,
                          vote: str) -> int:
  """The message's word count is padded to a multiple of this.

  ``alltoall`` splits the message into N shards of whole words whose digits
  also fill whole words of the result it gathers back.
  """
  if comm != "alltoall":
    return 1
  up_digits = packing.digits_per_word(vote_radix(vote))
  down_digits = packing.digits_per_word(alltoall_down_radix(
      num_workers, aggregation=aggregation, vote=vote))
  return num_workers * math.lcm(up_digits, down_digits) // up_digits


def message_bytes(leaf_sizes: Sequence[int], num_workers: int, *,
                  aggregation: str = "mavo", vote: str = "binary",
                  comm: str) -> float:
  """Exact bytes each worker sends for leaves of ``leaf_sizes``.

  Each leaf is packed into whole words, the words laid end to end and padded
  as the strategy needs (see :func:`dlion_jax.exchange.exchange_votes`);
  ``comm`` must be a concrete strategy, not ``'auto'``.
  """
  n = num_workers
  if n == 1:
    return 0.0
  radix = message_radix(comm, n, vote)
  if radix is None:
    itemsize = jnp.dtype(int_container(n)).itemsize
    return 2 * (n - 1) / n * sum(leaf_sizes) * itemsize
  per_word = packing.digits_per_word(radix)
  word_bytes = jnp.dtype(packing.word_dtype(radix)).itemsize
  words = sum(-(-size // per_word) for size in leaf_sizes)
  if comm == "psum":
    return 2 * (n - 1) / n * words * word_bytes
  if comm == "allgather":
    return float((n - 1) * words * word_bytes)
  multiple = message_word_multiple(comm, n, aggregation=aggregation, vote=vote)
  words = -(-words // multiple) * multiple
  down = alltoall_down_radix(n, aggregation=aggregation, vote=vote)
  down_words = -(-words * per_word // packing.digits_per_word(down))
  down_bytes = down_words * jnp.dtype(packing.word_dtype(down)).itemsize
  return (n - 1) / n * (words * word_bytes + down_bytes)


def wire_bits(num_workers: int, *, aggregation: str = "mavo",
              vote: str = "binary", comm: str = "auto") -> float:
  """Bits each worker sends per parameter per step (ignoring padding).

  Args:
    num_workers: size of the data-parallel axis, N.
    aggregation: ``'mavo'`` or ``'avg'``.
    vote: ``'binary'`` or ``'ternary'``.
    comm: a strategy of :mod:`dlion_jax.exchange`, or ``'auto'`` for the
      cheapest.

  Returns:
    Bits per parameter per step, e.g. ``2.275`` for binary MaVo through
    ``alltoall`` at N = 8, against 56 for an fp32 ring all-reduce.

  Example:
    >>> import dlion_jax as dl
    >>> dl.wire_bits(8)
    2.275
    >>> dl.wire_bits(8, comm="psum_int8")
    14.0
  """
  check_choice("aggregation", aggregation, AGGREGATIONS)
  check_choice("vote", vote, VOTES)
  check_choice("comm", comm, COMMS + ("auto",))
  if (not isinstance(num_workers, int) or isinstance(num_workers, bool)
      or num_workers < 1):
    raise ValueError(
        f"num_workers must be a positive int, got num_workers={num_workers!r}.")
  n = num_workers
  if n == 1:
    return 0.0
  if comm == "auto":
    return min(wire_bits(n, aggregation=aggregation, vote=vote, comm=c)
               for c in COMMS)
  up = packing.bits_per_digit(vote_radix(vote))
  if comm == "alltoall":
    down = packing.bits_per_digit(
        alltoall_down_radix(n, aggregation=aggregation, vote=vote))
    return (n - 1) / n * (up + down)
  if comm == "allgather":
    return float(n - 1) * up
  if comm == "psum":
    return 2 * (n - 1) / n * packing.bits_per_digit(psum_radix(n, vote))
  bits = jnp.iinfo(int_container(n)).bits
  return 2 * (n - 1) / n * bits


def allreduce_bits(num_workers: int, dtype=jnp.float32) -> float:
  """Bits per parameter a ring all-reduce of ``dtype`` gradients sends."""
  n = num_workers
  return 2 * (n - 1) / n * jnp.dtype(dtype).itemsize * 8


# --- Reading collectives off compiled HLO ----------------------------------

_OPS = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-to-all": "all-to-all",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
# Async starts (GPU) whose result is the tuple (operands, results, ...): only
# the second element is what the collective produces.
_OPERAND_RESULT_PAIRS = ("all-gather-start", "collective-permute-start")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce-start|all-reduce|all-gather-start|all-gather|"
    r"all-to-all|reduce-scatter|collective-permute-start|"
    r"collective-permute)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16|c64|c128)\[(?P<dims>[\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]")
_NUM_DEVICES = re.compile(r"(?:num_partitions|replica_count)=(\d+)")

_DTYPE_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def _shape_bytes(shape: str) -> int:
  total = 0
  for m in _ARRAY.finditer(shape):
    dims = [int(d) for d in m["dims"].split(",") if d]
    bits = _DTYPE_BITS.get(m["dtype"]) or int(m["dtype"][1:])
    total += math.prod(dims) * bits // 8
  return total


def _tuple_elements(shape: str) -> list[str]:
  """Top-level elements of a tuple shape ``(a, (b, c))``; ``[shape]`` else."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, char in enumerate(shape):
    if char == "(":
      depth += 1
    elif char == ")":
      depth -= 1
    if (char == "," and depth == 1) or depth == 0:
      parts.append(shape[start:i])
      start = i + 1
    if depth == 0:
      break
  return parts


def _result_shape(op: str, shape: str) -> str:
  """The part of an instruction's shape that the collective produces."""
  parts = _tuple_elements(shape)
  if op in _OPERAND_RESULT_PAIRS and len(parts) >= 2:
    return parts[1]
  return shape


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled module."""
  op: str            # all-reduce, all-gather, all-to-all, reduce-scatter, ...
  result_bytes: int  # bytes of the result (all tuple elements)
  group_size: int    # workers taking part
  sent_bytes: float  # bytes each worker sends, by the conventions above


def _sent(op: str, result_bytes: int, n: int) -> float:
  if n <= 1:
    return 0.0
  if op == "all-reduce":
    return 2 * (n - 1) / n * result_bytes
  if op == "reduce-scatter":
    return (n - 1) * result_bytes
  if op == "collective-permute":
    return float(result_bytes)
  return (n - 1) / n * result_bytes


def collectives(hlo_text: str) -> list[Collective]:
  """Lists the collectives of an HLO module's text.

  Args:
    hlo_text: ``jitted.lower(*args).compile().as_text()``.

  Returns:
    One :class:`Collective` per instruction, in program order.
  """
  devices = _NUM_DEVICES.findall(hlo_text)
  default_n = max((int(d) for d in devices), default=1)
  found = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    op = _OPS[m["op"]]
    shape = _result_shape(m["op"], m["shape"])
    g = _GROUPS_LIST.search(line)
    if g:
      n = len([d for d in g["first"].split(",") if d])
    else:
      iota = _GROUPS_IOTA.search(line)
      n = int(iota["size"]) if iota else default_n
    size = _shape_bytes(shape)
    found.append(Collective(op, size, n, _sent(op, size, n)))
  return found


def collective_bytes(compiled_or_text) -> float:
  """Bytes each worker sends per call of a compiled function.

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)
      or its HLO text.

  Returns:
    The sum of :attr:`Collective.sent_bytes` over the module.
  """
  text = compiled_or_text if isinstance(compiled_or_text, str) else (
      compiled_or_text.as_text())
  return sum(c.sent_bytes for c in collectives(text))
