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
import numbers
import re
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from dlion_jax import packing
from dlion_jax import sync
from dlion_jax._checks import check_choice
from dlion_jax._checks import static_int

AGGREGATIONS = ("mavo", "avg")
VOTES = ("binary", "ternary")
COMMS = ("alltoall", "allgather", "psum", "psum_int8")
QUANTIZERS = ("sign", "ternary_l1", "pbit_l1")
PBIT_RANGE = (2, 8)

# What one worker's vote on one parameter is: 'binary' (+-1), 'ternary'
# (-1, 0, 1) or an odd number of levels 2L + 1 (-L..L, a quantized vote).
VoteCode = str | int


def vote_code(quantizer: str = "sign", *, vote: str = "binary",
              bits: int | None = None) -> VoteCode:
  """The vote code of a quantizer: ``vote`` for ``'sign'``, else levels.

  ``'ternary_l1'`` (``'pbit_l1'`` with ``bits=2``) sends 3 levels, like
  ``vote='ternary'`` but with a dead zone; ``'pbit_l1'`` with ``bits=p``
  sends ``2**p - 1``.
  """
  check_choice("quantizer", quantizer, QUANTIZERS)
  check_choice("vote", vote, VOTES)
  bits = static_int("bits", bits)
  if quantizer != "pbit_l1":
    if bits is not None:
      raise ValueError(
          f"bits={bits!r} only applies to quantizer='pbit_l1', got "
          f"quantizer={quantizer!r}; drop bits or use quantizer='pbit_l1'.")
    return vote if quantizer == "sign" else 3
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
  return 2**bits - 1


def vote_radix(vote: VoteCode) -> int:
  """Distinct values one worker's vote takes: 2, 3 or the level count."""
  if vote == "binary":
    return 2
  return 3 if vote == "ternary" else int(vote)


def vote_max(vote: VoteCode) -> int:
  """Largest level a vote takes, L (1 for sign votes)."""
  return 1 if vote in VOTES else (vote_radix(vote) - 1) // 2


def psum_radix(num_workers: int, vote: VoteCode) -> int:
  """Radix of a counter that can hold the sum of N workers' vote codes."""
  return (vote_radix(vote) - 1) * num_workers + 1


def mavo_has_ties(num_workers: int, vote: VoteCode) -> bool:
  """Whether a majority vote can end in a tie (sum 0), i.e. D = 0."""
  return vote != "binary" or num_workers % 2 == 0


def alltoall_down_radix(num_workers: int, *, aggregation: str,
                        vote: VoteCode) -> int:
  """Radix of the per-parameter result that ``alltoall`` all-gathers."""
  if aggregation == "avg":
    return psum_radix(num_workers, vote)
  return 3 if mavo_has_ties(num_workers, vote) else 2


def int_container(num_workers: int, vote: VoteCode = "binary"):
  """Signed integer dtype in which ``psum_int8`` sums N workers' levels."""
  largest = num_workers * vote_max(vote)
  for dtype in (jnp.int8, jnp.int16, jnp.int32):
    if largest <= jnp.iinfo(dtype).max:
      return dtype
  raise ValueError(f"num_workers={num_workers} exceeds int32.")


def message_radix(comm: str, num_workers: int, vote: VoteCode) -> int | None:
  """Radix in which a strategy packs the votes it sends (None: int votes)."""
  if comm == "psum":
    return psum_radix(num_workers, vote)
  if comm == "psum_int8":
    return None
  return vote_radix(vote)


def message_word_multiple(comm: str, num_workers: int, *, aggregation: str,
                          vote: VoteCode) -> int:
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
                  aggregation: str = "mavo", vote: VoteCode = "binary",
                  comm: str, min_compress_size: int = 0) -> float:
  """Exact bytes each worker sends for leaves of ``leaf_sizes``.

  Each leaf is packed into whole words, the words laid end to end and padded
  as the strategy needs (see :func:`dlion_jax.exchange.exchange_votes`);
  ``comm`` must be a concrete strategy, not ``'auto'``. Leaves smaller than
  ``min_compress_size`` go through an exact float32 all-reduce instead.
  """
  n = num_workers
  if n == 1:
    return 0.0
  exact = sum(s for s in leaf_sizes if s < min_compress_size)
  packed = [s for s in leaf_sizes if s >= min_compress_size]
  exact_bytes = 2 * (n - 1) / n * 4 * exact
  if not packed:
    return exact_bytes
  return exact_bytes + _packed_bytes(packed, n, aggregation=aggregation,
                                     vote=vote, comm=comm)


def _packed_bytes(leaf_sizes, n, *, aggregation, vote, comm) -> float:
  radix = message_radix(comm, n, vote)
  if radix is None:
    itemsize = jnp.dtype(int_container(n, vote)).itemsize
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


def vote_bits(num_workers: int, *, aggregation: str, vote: VoteCode,
              comm: str) -> float:
  """Bits per parameter the vote exchange sends (``comm`` concrete)."""
  n = num_workers
  up = packing.bits_per_digit(vote_radix(vote))
  if comm == "alltoall":
    down = packing.bits_per_digit(
        alltoall_down_radix(n, aggregation=aggregation, vote=vote))
    return (n - 1) / n * (up + down)
  if comm == "allgather":
    return float(n - 1) * up
  if comm == "psum":
    return 2 * (n - 1) / n * packing.bits_per_digit(psum_radix(n, vote))
  return 2 * (n - 1) / n * jnp.iinfo(int_container(n, vote)).bits


def cheapest_comm(num_workers: int, *, aggregation: str,
                  vote: VoteCode) -> str:
  """The strategy with the fewest bits per parameter (ties: listed first)."""
  return min(COMMS, key=lambda c: round(vote_bits(
      num_workers, aggregation=aggregation, vote=vote, comm=c), 9))


def _positive_int(name: str, value, fix: str) -> int:
  """``value`` as an int >= 1 (numpy integers too, never bools)."""
  value = static_int(name, value)
  if (not isinstance(value, int) or isinstance(value, bool) or value < 1):
    raise ValueError(
        f"{name} must be a positive int ({fix}), got {name}={value!r}.")
  return value


def _fraction(name: str, value, what: str) -> float:
  """``value`` as a float in [0, 1] (never a bool)."""
  if (not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_))
      or not 0 <= value <= 1):
    raise ValueError(
        f"{name} must be in [0, 1] ({what}), got {name}={value!r}.")
  return float(value)


def max_workers(vote: VoteCode = "binary") -> int:
  """Largest N the vote exchange supports: ``(2**31 - 1) // (2 L)``.

  ``L`` is the largest level of a vote (1 for sign votes). Every strategy
  decodes the votes into int32 values up to ``2 N L`` (counts of codes, or
  sums of levels in ``[-N L, N L]`` offset by ``N L``), so ``2 N L`` must
  fit an int32; the packed ``psum`` counters, of radix at most
  ``2 N L + 1``, then fit their uint32 word too. That is about 1.07e9
  workers for sign votes, 8.45e6 for 255 levels (``bits=8``).

  Example:
    >>> from dlion_jax import accounting
    >>> accounting.max_workers(), accounting.max_workers(255)
    (1073741823, 8454660)
  """
  return (2**31 - 1) // (2 * vote_max(vote))


def _check_workers(num_workers, vote: VoteCode) -> int:
  n = _positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
  if n > max_workers(vote):
    raise ValueError(
        f"num_workers={n} is more than the vote exchange supports: at most "
        f"{max_workers(vote)} workers for {vote_radix(vote)}-level votes "
        "(2 N L, twice the largest sum of levels, must fit an int32; see "
        "dlion_jax.accounting.max_workers). Use fewer workers or fewer "
        "levels.")
  return n


def momentum_sync_bits(num_workers: int, momentum_sync, *,
                       steps: int | None = None, mu_dtype=jnp.float32,
                       synced_fraction: float = 1.0) -> float:
  """Bits per parameter per step that momentum syncs add, on average.

  Each sync is a ring all-reduce of the synced momenta in ``mu_dtype``;
  ``synced_fraction`` (in [0, 1]) is the share of parameters its mask
  selects. A period ``k`` costs ``1/k`` of that per step; other schedules
  are averaged over the first ``steps`` updates (a positive int).
  """
  n = _positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
  schedule = sync.as_schedule(momentum_sync)
  if steps is not None:
    steps = _positive_int(
        "steps", steps, "the number of updates to average the sync cost "
        "over, e.g. the length of the run")
  synced_fraction = _fraction("synced_fraction", synced_fraction,
                              "the share of parameters the sync mask selects")
  if schedule is None or n == 1:
    return 0.0
  if schedule.period is not None and steps is None:
    rate = 1 / schedule.period
  elif steps is None:
    raise ValueError(
        f"momentum_sync={schedule.name} syncs less and less often: pass "
        "steps=, the number of updates to average its cost over.")
  else:
    rate = schedule.count(steps) / steps
  return allreduce_bits(n, mu_dtype) * synced_fraction * rate


def wire_bits(num_workers: int, *, aggregation: str = "mavo",
              vote: str = "binary", comm: str = "auto",
              quantizer: str = "sign", bits: int | None = None,
              momentum_sync=None, steps: int | None = None,
              mu_dtype=jnp.float32, synced_fraction: float = 1.0) -> float:
  """Bits each worker sends per parameter per step (ignoring padding).

  Args:
    num_workers: size of the data-parallel axis, N: an int from 1 to
      :func:`max_workers` (about 1.07e9 for sign votes).
    aggregation: ``'mavo'`` or ``'avg'``.
    vote: ``'binary'`` or ``'ternary'`` (for ``quantizer='sign'``).
    comm: a strategy of :mod:`dlion_jax.exchange`, or ``'auto'`` for the
      cheapest.
    quantizer: ``'sign'``, ``'ternary_l1'`` or ``'pbit_l1'`` (see
      :mod:`dlion_jax.quantize`).
    bits: bits per vote for ``quantizer='pbit_l1'``.
    momentum_sync: ``None``, a period ``k`` or a
      :class:`dlion_jax.sync.SyncSchedule`; adds the amortized cost of
      all-reducing the momenta (:func:`momentum_sync_bits`).
    steps: updates to average a non-periodic sync schedule over (a
      positive int).
    mu_dtype: dtype of the synced momenta.
    synced_fraction: share of the parameters the sync mask selects, in
      [0, 1].

  Returns:
    Bits per parameter per step, e.g. ``2.275`` for binary MaVo through
    ``alltoall`` at N = 8, against 56 for an fp32 ring all-reduce.

  Example:
    >>> import dlion_jax as dl
    >>> dl.wire_bits(8)
    2.275
    >>> dl.wire_bits(8, comm="psum_int8")
    14.0
    >>> round(dl.wire_bits(8, quantizer="pbit_l1", bits=4), 3)   # 15 levels
    4.9
    >>> dl.wire_bits(8, momentum_sync=56)       # + fp32 momentum every 56
    3.275
  """
  check_choice("aggregation", aggregation, AGGREGATIONS)
  check_choice("comm", comm, COMMS + ("auto",))
  code = vote_code(quantizer, vote=vote, bits=bits)
  n = _check_workers(num_workers, code)
  sync_bits = momentum_sync_bits(n, momentum_sync, steps=steps,
                                 mu_dtype=mu_dtype,
                                 synced_fraction=synced_fraction)
  if n == 1:
    return 0.0
  if comm == "auto":
    comm = cheapest_comm(n, aggregation=aggregation, vote=code)
  return vote_bits(n, aggregation=aggregation, vote=code, comm=comm) + sync_bits


def allreduce_bits(num_workers: int, dtype=jnp.float32) -> float:
  """Bits per parameter a ring all-reduce of ``dtype`` gradients sends."""
  n = _positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
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
# An instruction ``%name = shape opcode(operands), attributes``: the opcode
# is the first word right after a space and before a parenthesis (tuple
# shapes hold no such word; TPU layouts' ``T(8,128)`` follow no space).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16|c64|c128)\[(?P<dims>[\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]")
_NUM_DEVICES = re.compile(r"(?:num_partitions|replica_count)=(\d+)")
# ``%name (params) -> result {`` compiled, ``name {`` in lowered HLO text.
_COMPUTATION = re.compile(
    r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*)?\{\s*$")
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# Attributes naming the computations an instruction runs.
_CALLEES = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|true_computation|"
    r"false_computation)=%?(?P<one>[\w.\-]+)|"
    r"\b(?P<keys>branch_computations|called_computations)="
    r"\{(?P<many>[^}]*)\}")
_BRANCH_KEYS = ("branch_computations", "true_computation", "false_computation")
# XLA's while loop analysis writes this into a compiled while's backend_config.
_TRIP_COUNT = re.compile(
    r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(?P<n>\d+)')
# These name the computation their async-start already ran.
_NOT_CALLING = ("async-update", "async-done")

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
  """One collective instruction of a compiled module.

  ``sent_bytes`` is what one run of the instruction sends; ``count`` how
  often it runs per call of the module (the product of the trip counts of
  the loops around it), so it sends ``bytes_per_call`` in all.
  """
  op: str            # all-reduce, all-gather, all-to-all, reduce-scatter, ...
  result_bytes: int  # bytes of the result (all tuple elements)
  group_size: int    # workers taking part
  sent_bytes: float  # bytes each worker sends per run, by the conventions above
  conditional: bool = False  # in a branch of a conditional (lax.cond)
  count: int = 1     # runs per call: trip counts of the enclosing loops

  @property
  def bytes_per_call(self) -> float:
    """``sent_bytes * count``: what it sends per call of the module."""
    return self.sent_bytes * self.count


@dataclasses.dataclass(frozen=True)
class _Call:
  """An instruction that runs other computations (while, call, fusion, ...).

  ``callees`` holds ``(computation, runs per run of the instruction or None
  when unknown, whether it is a branch of a conditional)``.
  """
  instruction: str
  op: str
  callees: tuple[tuple[str, int | None, bool], ...]


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


def _collective(m: re.Match, line: str, default_n: int) -> Collective:
  """The :class:`Collective` of a matched collective instruction line."""
  op = _OPS[m["op"]]
  shape = _result_shape(m["op"], m["shape"])
  g = _GROUPS_LIST.search(line)
  if g:
    n = len([d for d in g["first"].split(",") if d])
  else:
    iota = _GROUPS_IOTA.search(line)
    n = int(iota["size"]) if iota else default_n
  size = _shape_bytes(shape)
  return Collective(op, size, n, _sent(op, size, n))


def _call(m: re.Match, line: str) -> _Call | None:
  """The computations an instruction runs, and how often (None: none)."""
  if m["op"] in _NOT_CALLING:
    return None
  trips = _TRIP_COUNT.search(line) if m["op"] == "while" else None
  trips = int(trips["n"]) if trips else None
  callees = []
  for c in _CALLEES.finditer(line):
    if c["one"]:
      named = [(c["key"], c["one"])]
    else:
      named = [(c["keys"], n.strip().lstrip("%"))
               for n in c["many"].split(",") if n.strip()]
    for key, name in named:
      runs = 1
      if m["op"] == "while" and key == "body":
        runs = trips
      elif m["op"] == "while" and key == "condition":
        runs = None if trips is None else trips + 1
      callees.append((name, runs, key in _BRANCH_KEYS))
  return _Call(m["name"], m["op"], tuple(callees)) if callees else None


def _parse(hlo_text: str) -> tuple[dict, list]:
  """Computations (name -> its collectives and calls, in order) and roots.

  Lines before any computation header (a snippet) form computation None.
  The roots are the computations nothing calls: ENTRY, and None.
  """
  devices = _NUM_DEVICES.findall(hlo_text)
  default_n = max((int(d) for d in devices), default=1)
  computations, current, called = {None: []}, None, set()
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header["name"]
      computations[current] = []
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    line = _METADATA.sub("", line)
    if m["op"] in _OPS:
      computations[current].append(_collective(m, line, default_n))
    call = _call(m, line)
    if call:
      computations[current].append(call)
      called.update(name for name, _, _ in call.callees)
  return computations, [c for c in computations if c not in called]


def _sending(computations: dict) -> set:
  """Computations that run a collective, themselves or through callees."""
  sending = {name for name, items in computations.items()
             if any(isinstance(i, Collective) for i in items)}
  grew = True
  while grew:
    grew = False
    for name, items in computations.items():
      if name not in sending and any(
          callee in sending for i in items if isinstance(i, _Call)
          for callee, _, _ in i.callees):
        sending.add(name)
        grew = True
  return sending


def _unknown_trips(call: _Call, callee: str) -> ValueError:
  return ValueError(
      f"Cannot count the collectives in %{callee}, run by while loop "
      f"%{call.instruction}: the HLO gives no known_trip_count for it, so how "
      "often they run depends on data (a lax.while_loop with a traced bound) "
      "or the text was not compiled. Pass the compiled HLO "
      "(jit(f).lower(...).compile()), loop with lax.scan or lax.fori_loop "
      "over static bounds, or compile one step without the loop and multiply "
      "its bytes by the number of steps.")


def _walk(computations: dict, sending: set, name, count: int,
          conditional: bool, seen: frozenset):
  """Yields the collectives ``name`` runs, each with its runs per call."""
  for item in computations.get(name, ()):
    if isinstance(item, Collective):
      yield dataclasses.replace(item, conditional=conditional, count=count)
      continue
    for callee, runs, branch in item.callees:
      if callee in seen or callee not in sending:
        continue
      if runs is None:
        raise _unknown_trips(item, callee)
      yield from _walk(computations, sending, callee, count * runs,
                       conditional or branch, seen | {callee})


def collectives(hlo_text: str) -> list[Collective]:
  """Lists the collectives of an HLO module's text.

  Collectives in a while loop (``lax.scan``, ``lax.fori_loop``) run once
  per trip (its condition: trips + 1 times): their ``count`` is the product
  of the trip counts of the loops around them, which XLA writes into each
  compiled loop's ``backend_config`` (``"known_trip_count":{"n":"10"}``).

  Args:
    hlo_text: ``jitted.lower(*args).compile().as_text()``.

  Returns:
    One :class:`Collective` per instruction and way to reach it from the
    entry, in program order; those in a branch of a conditional (e.g. a
    scheduled momentum sync), also inside loops, are marked
    ``conditional``: they run only on the steps that take that branch.

  Raises:
    ValueError: a while loop whose trip count XLA does not know (a
      ``lax.while_loop`` with a data-dependent bound) runs collectives.
  """
  computations, roots = _parse(hlo_text)
  sending = _sending(computations)
  return [c for root in roots
          for c in _walk(computations, sending, root, 1, False,
                         frozenset([root]))]


def collective_bytes(compiled_or_text, *, conditional: bool = True) -> float:
  """Bytes each worker sends per call of a compiled function.

  A collective in a loop counts once per trip (``lax.scan`` over 10 steps:
  10 steps' bytes); a loop whose trip count is not static is refused.

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)
      or its HLO text.
    conditional: count the collectives in branches of conditionals too (an
      upper bound: a step that syncs momenta); ``False`` gives what a step
      taking no such branch sends.

  Returns:
    The sum of :attr:`Collective.bytes_per_call` over the module.

  Raises:
    ValueError: collectives in a while loop of unknown trip count (see
      :func:`collectives`).
  """
  text = compiled_or_text if isinstance(compiled_or_text, str) else (
      compiled_or_text.as_text())
  return sum(c.bytes_per_call for c in collectives(text)
             if conditional or not c.conditional)
