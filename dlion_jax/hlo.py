"""Reading what a compiled function sends off its HLO text.

:func:`collective_bytes` is the figure the benchmarks and the training CLI
report: for every collective instruction of a compiled module, the bytes
each worker sends by the conventions of the usual bandwidth-optimal
algorithms (``N`` workers, a ``B``-byte buffer):

* all-reduce (ring): ``2 (N - 1) / N * B``
* all-gather of a ``B``-byte result, all-to-all of a ``B``-byte buffer:
  ``(N - 1) / N * B``; reduce-scatter of a ``B``-byte result: ``(N - 1) B``

Collectives in loops count once per trip (XLA's ``known_trip_count``);
an async pair (``*-start``/``*-done``) counts once, at its start; a combined
(tuple) collective counts every element.
A conditional runs one of its branches per call, so it counts one: the
branch that sends the most (what a step sends at most: a scheduled momentum
sync), or with ``conditional=False`` the one that sends the least (what
every step sends); collectives in branches are marked ``conditional``.

:func:`collective_bytes_by_axis` splits the same figure by the mesh axes
each collective crosses, read off its replica groups: on a hybrid mesh the
bytes under the slow axis are the ones that cost.

TPU multislice executables (compiled ahead of time for a topology of several
slices, e.g. ``jax.experimental.topologies.get_topology_desc("v5e:2x2",
"tpu", num_slices=2)``) are one program per slice: a collective that crosses
slices becomes collectives inside the slice (over ICI; their device ids are
positions within the slice) and *megascale* transfers between slices over
the data-centre network (DCN): a ``send`` with ``is_host_transfer=true``
whose ``_xla_megascale_transfer_type`` is ``ALL_REDUCE``, ``ALL_GATHER`` or
``ALL_TO_ALL`` and whose ``_xla_megascale_target`` names the devices (``"{1,
2}x{0:3}"``: slices 1 and 2 (1-based) times positions 0 to 3, one group per
position; or ``{{100000, ..., 200003}}``: ``slice * 100000 + position``). Each
counts once (its ``recv`` and ``*-done`` are the same transfer) by the
conventions above, with ``N`` the devices of its group, and is marked
``link="dcn"`` (:func:`collective_bytes_by_link`). A host transfer of
another kind, or an unknown collective opcode, is refused rather than read
as 0.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
import math
import re

import jax
import numpy as np
from dlion_jax import _deprecations

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)

_OPS = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-to-all": "all-to-all",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    # Its result buffer: an upper bound on what the ragged chunks fill.
    "ragged-all-to-all": "all-to-all",
}
# Opcodes of collectives this reader does not know: refused, never read as 0
# (their -done/-update halves belong to a start that is counted).
_COLLECTIVE_LIKE = re.compile(
    r"^(?:all-|reduce-scatter|collective-|ragged-)(?!.*-(?:done|update)$)")
_MEGASCALE_OPS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                  "ALL_TO_ALL": "all-to-all"}
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="(?P<type>\w+)"')
_MEGASCALE_TARGET = re.compile(
    r'_xla_megascale_target=(?:"(?P<product>[^"]*)"|(?P<list>\{\{[^=]*?\}\}))')
# XLA:TPU's reduce-scatter emitters that print as a fusion of an all-reduce.
_SCATTER_FUSION = re.compile(r'"emitter"\s*:\s*"\w*ReduceScatterFusion"')
_HOST_TRANSFER = re.compile(r"\bis_host_transfer=true\b")
_HANDLER = re.compile(r'_xla_host_transfer_handler_name="(?P<name>[^"]*)"')
# Megascale numbers a device ``slice * 100000 + position`` (slices 1-based).
_MEGASCALE_SLICE = 100000
# Async starts (GPU) whose result is the tuple (operands, results, ...): only
# the second element is what the collective produces.
_OPERAND_RESULT_PAIRS = ("all-gather-start", "collective-permute-start")
# An instruction ``%name = shape opcode(operands), attributes``: the opcode
# is the first word right after a space and before a parenthesis (tuple
# shapes hold no such word; TPU layouts' ``T(8,128)`` follow no space).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>[a-z][\w\-]*)\(")
# Every dtype XLA prints: pred, s4 ... s64, u4 ..., f16 ... f64, bf16, c64,
# c128 and the small floats (f8e4m3fn, f8e5m2, f4e2m1fn, f8e8m0fnu, ...).
_ARRAY = re.compile(
    r"\b(?P<dtype>pred|bf16|c64|c128|f\d+e\d+m\d+\w*|[suf]\d+)"
    r"\[(?P<dims>[\d,]*)\]")
# Replica groups in XLA's three printed forms: a list ``{{0,1},{2,3}}`` (or
# ``{}``: every device), an iota ``[groups,size]<=[dims]T(perm)``, and a
# mesh's axes ``mesh['x'=2,'y'=4] {'x'}`` (sub-axes ``'x':(pre)size``; a
# device order ``device_ids=([2,4]T(1,0))`` or a list, where not iota).
_GROUP_LIST = r"\{(?P<groups>(?:\{[\d,\s]*\},?\s*)*)\}"
_GROUPS_LIST = re.compile(r"replica_groups=" + _GROUP_LIST)
_PAIRS = re.compile(r"source_target_pairs=" + _GROUP_LIST)
_IOTA_TEXT = r"\[(?P<dims>[\d,]*)\](?:T\((?P<perm>[\d,]*)\))?"
_IOTA = re.compile(_IOTA_TEXT)
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[(?P<shape>[\d,]+)\]<=" + _IOTA_TEXT)
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]*\](?:T\([\d,]*\))?|[\d,\s]*)\))?"
    r"\s*\{(?P<refs>[^}]*)\}")
_MESH_AXIS = re.compile(r"'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)")
_AXIS_REF = re.compile(
    r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
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
# Text that is not compiled HLO: StableHLO (``Lowered.as_text()``), and HLO
# still carrying the annotations the SPMD partitioner consumes
# (``Lowered.as_text(dialect="hlo")``; Shardy's or GSPMD's).
_MLIR = re.compile(r"\bfunc\.func\b|\bstablehlo\.[a-z]")
_UNPARTITIONED = re.compile(
    r'xla\.sdy\.|custom_call_target="(?:Sharding|SPMDFullToShardShape|'
    r'SPMDShardToFullShape)"')

_DTYPE_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}

_Groups = tuple[tuple[int, ...], ...]
_AxisKey = str | tuple[str, ...]
_Pick = Callable[..., list] | None   # max or min over a conditional's branches


def _shape_bytes(shape: str) -> int:
  total = 0
  for m in _ARRAY.finditer(shape):
    dims = [int(d) for d in m["dims"].split(",") if d]
    dtype = m["dtype"]
    bits = _DTYPE_BITS.get(dtype) or int(re.match(r"\D+(\d+)", dtype)[1])
    total += -(-math.prod(dims) * bits // 8)      # sub-byte types packed
  return total


def _tuple_elements(shape: str) -> list[str]:
  """Top-level elements of a tuple shape ``(a, (b, c))``; ``[shape]`` else."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, char in enumerate(shape):   # layouts hold commas: {1,0:T(8,128)}
    if char in "([{":
      depth += 1
    elif char in ")]}":
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

  ``replica_groups`` holds the device groups, whichever form the HLO wrote
  them in (a collective-permute: its ``(source, target)`` pairs), or None
  for one group of every device. Under ``jit``/``shard_map`` the ids are
  positions in the device assignment (``mesh.devices.flat`` order), not
  ``Device.id``; in a TPU multislice program, positions within a slice,
  and for a megascale transfer (``link="dcn"``) ``slice * 100000 +
  position`` with slices counted from 1.

  ``link`` is ``"dcn"`` for a megascale transfer between TPU slices (over
  the data-centre network) and ``"ici"`` for the collectives a module runs
  among its own devices (on TPU, inside a slice over ICI; on other backends
  over their own links).
  """
  op: str            # all-reduce, all-gather, all-to-all, reduce-scatter, ...
  result_bytes: int  # bytes of the result (all tuple elements)
  group_size: int    # workers taking part
  sent_bytes: float  # bytes each worker sends per run, by the conventions above
  conditional: bool = False  # in a branch of a conditional (cond, switch)
  count: int = 1     # runs per call: trip counts of the enclosing loops
  replica_groups: _Groups | None = None  # None: every device, one group
  instruction: str = ""  # the HLO instruction's name
  link: str = "ici"  # "dcn": a megascale transfer between TPU slices

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


def _ints(text: str | None) -> list[int]:
  return [int(d) for d in re.findall(r"\d+", text or "")]


def _iota(dims: Sequence[int], perm: Sequence[int] = ()) -> np.ndarray:
  """``iota(prod(dims))`` shaped ``dims``, then transposed by ``perm``.

  >>> _iota([2, 4], [1, 0]).reshape(4, 2).tolist()
  [[0, 4], [1, 5], [2, 6], [3, 7]]
  """
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _rows(ids: np.ndarray, grouped: Sequence[int]) -> _Groups:
  """The groups of ``ids`` varying along dims ``grouped`` (major first),
  the other dims fixed: one per value of the others, in order.

  >>> _rows(np.arange(8).reshape(2, 4), [0])
  ((0, 4), (1, 5), (2, 6), (3, 7))
  """
  rest = [d for d in range(ids.ndim) if d not in grouped]
  size = math.prod(ids.shape[d] for d in grouped)
  rows = ids.transpose(rest + list(grouped)).reshape(-1, size)
  return tuple(tuple(row) for row in rows.tolist())


def _split(n: int, subs: list[tuple[int, int]]) -> tuple[list[int], dict]:
  """Dims that cut an axis of size ``n`` so each sub-axis ``(pre, size)``
  (``pre``: the product of the sizes major to it) is one dim: the dims and
  where each sub-axis sits among them."""
  dims, at, prefix = [], {}, 1
  for pre, size in sorted(subs):
    if pre != prefix:
      dims.append(pre // prefix)
      prefix = pre
    at[(pre, size)] = len(dims)
    dims.append(size)
    prefix *= size
  if prefix != n:
    dims.append(n // prefix)
  return dims, at


def _device_order(text: str | None, size: int) -> np.ndarray:
  """A mesh form's ``device_ids``: an iota ``[dims]T(perm)`` or a list;
  absent: ``0 .. size - 1``."""
  iota = _IOTA.fullmatch(text or "")
  if iota:
    return _iota(_ints(iota["dims"]), _ints(iota["perm"])).ravel()
  return np.array(_ints(text)) if text else np.arange(size)


def _mesh_groups(m: re.Match) -> _Groups:
  """The groups of ``replica_groups=mesh[...] {axes}``: the devices that
  differ only along the listed (sub-)axes, listed major first."""
  axes = [(a["name"], int(a["size"])) for a in _MESH_AXIS.finditer(m["axes"])]
  names = [name for name, _ in axes]
  refs = [(names.index(r["name"]), int(r["pre"] or 1),
           int(r["size"] or axes[names.index(r["name"])][1]))
          for r in _AXIS_REF.finditer(m["refs"])]
  dims, where = [], {}
  for d, (_, n) in enumerate(axes):
    split, at = _split(n, [(pre, size) for a, pre, size in refs if a == d])
    where.update({(d, *k): len(dims) + i for k, i in at.items()})
    dims += split
  ids = _device_order(m["ids"], math.prod(n for _, n in axes))
  return _rows(ids.reshape(dims), [where[r] for r in refs])


def _replica_groups(line: str) -> _Groups | None:
  """A collective's device groups in any printed form; None: every device."""
  m = _GROUPS_LIST.search(line) or _PAIRS.search(line)
  if m:
    return tuple(tuple(_ints(g)) for g in re.findall(
        r"\{([^{}]*)\}", m["groups"])) or None
  m = _GROUPS_IOTA.search(line)
  if m:
    ids = _iota(_ints(m["dims"]), _ints(m["perm"])).reshape(_ints(m["shape"]))
    return tuple(tuple(row) for row in ids.tolist())
  m = _GROUPS_MESH.search(line)
  return _mesh_groups(m) if m else None


def _collective(m: re.Match, line: str, default_n: int) -> Collective:
  """The :class:`Collective` of a matched collective instruction line."""
  op = _OPS[m["op"]]
  shape = _result_shape(m["op"], m["shape"])
  groups = _replica_groups(line)
  n = len(groups[0]) if groups and op != "collective-permute" else default_n
  size = _shape_bytes(shape)
  return Collective(op, size, n, _sent(op, size, n), replica_groups=groups,
                    instruction=m["name"])


def _megascale(m: re.Match, line: str) -> Collective:
  """The :class:`Collective` of a megascale ``send`` between TPU slices:
  its operand (the first element of the send's shape) is this device's
  buffer (for ``ALL_GATHER``, its piece of the result)."""
  kind = _MEGASCALE_TYPE.search(line)
  target = _MEGASCALE_TARGET.search(line)
  if not kind or kind["type"] not in _MEGASCALE_OPS or not target:
    handler = _HANDLER.search(line)
    raise ValueError(
        f"Cannot count %{m['name']}, a host transfer "
        f"(handler {handler['name'] if handler else None!r}, transfer type "
        f"{kind['type'] if kind else None!r}): this reader knows megascale "
        f"transfers of the types {sorted(_MEGASCALE_OPS)} with a target, "
        "and would read anything else as 0. Count it by hand from the "
        "instruction's shape.")
  op = _MEGASCALE_OPS[kind["type"]]
  groups = _megascale_groups(target)
  n = len(groups[0])
  piece = _shape_bytes(_tuple_elements(m["shape"])[0])
  size = n * piece if op == "all-gather" else piece
  return Collective(op, size, n, _sent(op, size, n), replica_groups=groups,
                    instruction=m["name"], link="dcn")


def _megascale_groups(target: re.Match) -> _Groups:
  """Device groups of a megascale target, as ``slice * 100000 +
  position``: a list ``{{100000,100001},...}``, or a product ``"{1,2}x{0:3}"``
  (slices by positions, ``a:b`` inclusive): one group per position, across
  the slices."""
  if target["list"]:
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}",
                                                     target["list"]))
  def members(text):
    out = []
    for part in text.strip("{}").split(","):
      lo, _, hi = part.partition(":")
      out += range(int(lo), int(hi or lo) + 1)
    return out
  slices, positions = target["product"].split("x")
  return tuple(tuple(s * _MEGASCALE_SLICE + p for s in members(slices))
               for p in members(positions))


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
    if m["op"] == "fusion" and _SCATTER_FUSION.search(line):
      computations[current].append((m, line))   # read once callees are
      called.add(_CALLEES.search(line)["one"])
      continue
    if m["op"] in _OPS:
      computations[current].append(_collective(m, line, default_n))
    elif m["op"] == "send" and _HOST_TRANSFER.search(line):
      computations[current].append(_megascale(m, line))
    elif _COLLECTIVE_LIKE.match(m["op"]):
      raise ValueError(
          f"Cannot count %{m['name']}: its opcode {m['op']!r} is a collective "
          f"this reader does not know (it knows {sorted(set(_OPS))}, and "
          "megascale host transfers), so its bytes would read as 0. Count it "
          "by hand from the instruction's shape and replica groups.")
    call = _call(m, line)
    if call:
      computations[current].append(call)
      called.update(name for name, _, _ in call.callees)
  for items in computations.values():
    items[:] = [_scatter_fusion(*i, computations) if isinstance(i, tuple)
                else i for i in items]
  return computations, [c for c in computations if c not in called]


def _scatter_fusion(m: re.Match, line: str, computations: dict) -> Collective:
  """XLA:TPU's reduce-scatter emitted as a fusion: its computation holds an
  all-reduce of the (padded) buffer and a dynamic-slice, but the emitter
  sends what a reduce-scatter of the fusion's result sends."""
  callee = _CALLEES.search(line)
  inner = [c for c in computations.get(callee["one"], ())
           if isinstance(c, Collective) and c.op == "all-reduce"]
  if len(inner) != 1:
    raise ValueError(
        f"Cannot count %{m['name']}, a reduce-scatter fusion of XLA:TPU: "
        f"its computation %{callee['one']} holds {len(inner)} all-reduces, "
        "not one. Count it by hand from the instruction's shape.")
  size, n = _shape_bytes(m["shape"]), inner[0].group_size
  return Collective("reduce-scatter", size, n, _sent("reduce-scatter", size, n),
                    replica_groups=inner[0].replica_groups,
                    instruction=m["name"])


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


def _branch_bytes(found: list[Collective]) -> float:
  return sum(c.bytes_per_call for c in found)


def _walk(computations: dict, sending: set, name, count: int,
          conditional: bool, seen: frozenset, pick: _Pick):
  """Yields the collectives ``name`` runs, each with its runs per call.

  ``pick`` (``max`` or ``min``) keeps, of a conditional's branches, the one
  sending the most or the least; None keeps every branch.
  """
  for item in computations.get(name, ()):
    if isinstance(item, Collective):
      yield dataclasses.replace(item, conditional=conditional, count=count)
      continue
    branches = []
    for callee, runs, branch in item.callees:
      if callee in seen or callee not in sending:
        branches += [[]] if branch else []
        continue
      if runs is None:
        raise _unknown_trips(item, callee)
      found = _walk(computations, sending, callee, count * runs,
                    conditional or branch, seen | {callee}, pick)
      if branch and pick:
        branches.append(list(found))
      else:
        yield from found
    if branches and pick:
      yield from pick(branches, key=_branch_bytes)


def _module_text(value, where: tuple[str, str]) -> str:
  """The HLO text of a ``Compiled`` or a string; refuses earlier stages,
  whose collectives XLA has not all inserted yet."""
  if isinstance(value, str):
    return value
  if isinstance(value, jax.stages.Compiled):
    return value.as_text()
  if isinstance(getattr(value, "compiled", None), jax.stages.Compiled):
    return value.compiled.as_text()       # nnx.jit(f).lower(...).compile()
  function, arg = where
  if isinstance(value, jax.stages.Lowered):
    name, fix = "a jax.stages.Lowered", "lowered.compile()"
  elif isinstance(value, jax.stages.Traced):
    name, fix = "a jax.stages.Traced", "traced.lower().compile()"
  elif callable(value) and hasattr(value, "lower"):
    name, fix = "a jitted function", "jit(f).lower(*args).compile()"
  else:
    raise TypeError(
        f"{function}: {arg} must be a jax.stages.Compiled "
        "(jit(f).lower(*args).compile()) or its HLO text (.as_text()), got "
        f"{type(value).__name__}: {_short(value)}.")
  raise TypeError(
      f"{function}: {arg} is {name}, not a compiled function. The reader "
      "counts the collectives of the compiled HLO; before compiling, those "
      "the SPMD partitioner inserts for jit's shardings are missing and "
      f"loops carry no trip count. Pass {fix} (or its .as_text()).")


def _uncompiled(text: str, where: tuple[str, str], sending: set) -> None:
  """Refuses text that is not compiled HLO where it would read too little:
  StableHLO, and unpartitioned HLO without any collective."""
  function, arg = where
  fix = "Pass jit(f).lower(...).compile() or its .as_text()."
  if _MLIR.search(text) and not text.lstrip().startswith("HloModule"):
    raise ValueError(
        f"{function}: {arg} is StableHLO (MLIR) text, which this reader "
        f"cannot read. {fix}")
  if not sending and _UNPARTITIONED.search(text):
    raise ValueError(
        f"{function}: {arg} is HLO that XLA has not partitioned (it still "
        "carries jit's sharding annotations) and holds no collective: those "
        f"the partitioner inserts are not in it yet. {fix}")


def _collectives(value, where: tuple[str, str],
                 pick: _Pick = None) -> list[Collective]:
  text = _module_text(value, where)
  computations, roots = _parse(text)
  sending = _sending(computations)
  _uncompiled(text, where, sending)
  return [c for root in roots
          for c in _walk(computations, sending, root, 1, False,
                         frozenset([root]), pick)]


def collectives(hlo_text) -> list[Collective]:
  """Lists the collectives of an HLO module's text.

  Collectives in a while loop (``lax.scan``, ``lax.fori_loop``) run once
  per trip (its condition: trips + 1 times): their ``count`` is the product
  of the trip counts of the loops around them, which XLA writes into each
  compiled loop's ``backend_config`` (``"known_trip_count":{"n":"10"}``).

  Every branch of a conditional is listed, though a call runs only one: to
  total them, use :func:`collective_bytes`, which counts one branch.

  Args:
    hlo_text: ``jitted.lower(*args).compile().as_text()``, or the
      ``jax.stages.Compiled`` itself.

  Returns:
    One :class:`Collective` per instruction and way to reach it from the
    entry, in program order; those in a branch of a conditional (e.g. a
    scheduled momentum sync), also inside loops, are marked
    ``conditional``: they run only on the steps that take that branch.

  Raises:
    ValueError: a while loop whose trip count XLA does not know (a
      ``lax.while_loop`` with a data-dependent bound) runs collectives; or
      the text is StableHLO, or HLO not yet partitioned that holds no
      collective (``Lowered.as_text()``: compile it first).
    TypeError: ``hlo_text`` is a ``Lowered``, a ``Traced`` or a function.
  """
  return _collectives(hlo_text, ("collectives", "hlo_text"))


def collective_bytes(compiled_or_text, *, conditional: bool = True) -> float:
  """Bytes each worker sends per call of a compiled function.

  A collective in a loop counts once per trip (``lax.scan`` over 10 steps:
  10 steps' bytes); a loop whose trip count is not static is refused. A
  conditional (``lax.cond``, ``lax.switch``) runs one branch per call, so it
  counts one branch: the one that sends the most bytes in all (the first
  such), or with ``conditional=False`` the least. Branches are picked
  inside out: a conditional in a branch counts its own pick.

  Args:
    compiled_or_text: a ``jax.stages.Compiled``
      (``jit(f).lower(...).compile()``) or its HLO text. A ``Lowered`` is
      refused: its collectives are not all in it yet.
    conditional: ``True`` counts each conditional's largest branch: what a
      step sends at most (a step that syncs momenta). ``False`` counts its
      smallest: what every step sends (a step without a sync; 0 for a
      branch that sends nothing). Collectives outside conditionals count
      the same either way.

  Returns:
    The sum of :attr:`Collective.bytes_per_call` over the collectives
    counted.

  Raises:
    ValueError: collectives in a while loop of unknown trip count, or text
      that is not compiled HLO (see :func:`collectives`).
    TypeError: ``compiled_or_text`` is a ``Lowered``, a ``Traced`` or a
      function: compile it.
  """
  return sum(c.bytes_per_call for c in _counted(
      compiled_or_text, conditional, "collective_bytes"))


def _counted(compiled_or_text, conditional: bool,
             function: str) -> list[Collective]:
  """The collectives :func:`collective_bytes` counts."""
  return _collectives(compiled_or_text, (function, "compiled_or_text"),
                      max if conditional else min)


def _short(value, limit: int = 120) -> str:
  """``value``'s repr on one line, cut to ``limit`` characters."""
  text = " ".join(repr(value).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _no_axis(c: Collective, shape: dict, why: str) -> ValueError:
  groups = _short(c.replica_groups) if c.replica_groups else (
      "{} (every device)")
  return ValueError(
      f"collective_bytes_by_axis: %{c.instruction} ({c.op}) runs over the "
      f"device groups {groups}, which {why} of mesh={shape} (ids are "
      "positions in mesh.devices.flat). Pass the mesh the function was "
      "compiled on; a collective over part of an axis (axis_index_groups) "
      "crosses no whole axis: attribute it by hand from "
      "hlo.collectives(text), each Collective's replica_groups.")


def _axis_key(c: Collective, shape: dict, part: bool = False) -> _AxisKey:
  """The mesh axis (or axes, in mesh order) whose groups are ``c``'s; with
  ``part``, along which its groups' devices differ (a TPU multislice
  program runs a collective over an axis as pieces inside and across
  slices)."""
  sizes, size = tuple(shape.values()), math.prod(shape.values())
  groups = c.replica_groups or (tuple(range(c.group_size)),)
  if len({len(g) for g in groups}) != 1 or not all(groups) or (
      max(map(max, groups)) >= size):
    raise _no_axis(c, shape, f"do not split the {size} devices")
  coords = np.unravel_index(np.array(groups), sizes)
  crossed = [d for d, x in enumerate(coords) if (x != x[:, :1]).any()]
  want = _rows(np.arange(size).reshape(sizes), crossed)
  if c.op != "collective-permute" and not part and (
      {frozenset(g) for g in groups} != {frozenset(g) for g in want}):
    raise _no_axis(c, shape, "are not the groups of any axes")
  key = tuple(tuple(shape)[d] for d in crossed)
  return key[0] if len(key) == 1 else key


def collective_bytes_by_axis(compiled_or_text, mesh, *,
                             conditional: bool = True) -> dict[_AxisKey, float]:
  """:func:`collective_bytes` split by the mesh axes each collective crosses.

  A collective crosses the axes along which the devices of its replica
  groups differ, and its groups must be exactly those axes' groups (every
  device with the others fixed). On a hybrid mesh the bytes under the slow
  axis (``"data"``) are what the links between nodes carry. On a mesh of
  TPU chips of several slices (devices with a ``slice_index``), the pieces
  the compiler splits a collective into (inside each slice, and megascale
  transfers across) count under the axes their devices differ along: on
  ``("data", "fsdp")`` = (slices, chips) a vote's megascale transfer counts
  under ``"data"``; on one flat axis over all chips, every piece under it
  (:func:`collective_bytes_by_link` tells the links apart).

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` or its HLO text.
      Each conditional counts one branch, picked by its bytes in all (as
      :func:`collective_bytes`), so the values add up to that figure.
    mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the function was
      compiled on: the HLO's device ids are positions in
      ``mesh.devices.flat``, so its device order must be the module's.
    conditional: as for :func:`collective_bytes`.

  Returns:
    ``{key: bytes each device sends per call}``: a key is an axis name, or
    a tuple of names in mesh order for a collective over several axes
    (``("data", "fsdp")``: a loss ``pmean`` over both), or ``()`` for
    groups of one device (they send nothing). Every axis name is a key
    (0.0 when nothing crosses it). The values add up to
    :func:`collective_bytes` of the same module.

  Raises:
    ValueError: a collective whose groups are not those of any axes of
      ``mesh`` (a subset of an axis, or another mesh); or, as
      :func:`collective_bytes`, a loop of unknown trip count or text that
      is not compiled HLO.
    TypeError: ``compiled_or_text`` is not compiled (as
      :func:`collective_bytes`), or ``mesh`` is not a mesh.

  Example:
    >>> from jax.sharding import AbstractMesh
    >>> text = ("HloModule m, num_partitions=8\\n"
    ...         "  %a = f32[8] all-reduce(%p), replica_groups=[4,2]<=[2,4]"
    ...         "T(1,0), to_apply=%add\\n"
    ...         "  %b = f32[8] all-reduce(%p), replica_groups=[2,4]<=[8], "
    ...         "to_apply=%add\\n")
    >>> collective_bytes_by_axis(text, AbstractMesh((2, 4), ("data", "fsdp")))
    {'data': 32.0, 'fsdp': 48.0}
  """
  shape = getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise TypeError(
        f"collective_bytes_by_axis: mesh={_short(mesh)} is not a "
        "jax.sharding.Mesh (no axis names and sizes). Pass the mesh the "
        "function was compiled on, e.g. dl.devices.hybrid_mesh(nodes).")
  shape = dict(shape)
  out = {name: 0.0 for name in shape}
  found = _counted(compiled_or_text, conditional, "collective_bytes_by_axis")
  place = _slice_positions(mesh, found)
  for c in found:
    placed = place(c)
    key = _axis_key(placed, shape, part=placed is not c)
    out[key] = out.get(key, 0.0) + c.bytes_per_call
  return out


def _slice_positions(mesh, found: list[Collective]) -> Callable:
  """Maps a collective of a TPU multislice program onto mesh positions:
  its groups in ``mesh.devices.flat`` order, one per slice for a group
  inside a slice. Identity for a mesh within one slice."""
  try:
    devices = np.asarray(mesh.devices).flat
  except (AttributeError, ValueError):     # an AbstractMesh has no devices
    devices = []
  slice_of = [getattr(d, "slice_index", None) for d in devices]
  if len({s for s in slice_of if s is not None}) < 2 or None in slice_of:
    dcn = next((c for c in found if c.link == "dcn"), None)
    if dcn is not None:
      raise ValueError(
          f"collective_bytes_by_axis: %{dcn.instruction} is a megascale "
          "transfer between TPU slices, but the mesh's devices do not span "
          "several slices (their slice_index). Pass the mesh of the devices "
          "the executable was compiled for, e.g. a Mesh of "
          "jax.experimental.topologies.get_topology_desc(..., num_slices=2)"
          ".devices.")
    return lambda c: c
  at, seen = {}, {}
  for i, s in enumerate(slice_of):
    at[(s + 1, seen.setdefault(s, 0))] = i      # megascale slices from 1
    seen[s] += 1
  slices = sorted(seen)
  def place(c: Collective) -> Collective:
    if c.link == "dcn":
      groups = tuple(tuple(at[divmod(d, _MEGASCALE_SLICE)] for d in g)
                     for g in c.replica_groups)
    else:
      inside = c.replica_groups or (tuple(range(seen[slices[0]])),)
      groups = tuple(tuple(at[(s + 1, p)] for p in g)
                     for s in slices for g in inside)
    return dataclasses.replace(c, replica_groups=groups)
  return place


def collective_bytes_by_link(compiled_or_text, *,
                             conditional: bool = True) -> dict[str, float]:
  """:func:`collective_bytes` split by the links it crosses on TPU
  multislice: ``"dcn"`` (megascale transfers between slices) and ``"ici"``
  (collectives within a slice).

  A megascale all-to-all over devices of several slices sends its chunks for
  the devices of its own slice within the slice: that share,
  ``(m - 1) / (N - 1)`` of its bytes with ``m`` of its ``N`` devices in each
  slice, counts as ICI. On other backends everything is ``"ici"`` (the
  module's own links).

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` or its HLO text.
    conditional: as for :func:`collective_bytes`.

  Returns:
    ``{"ici": bytes, "dcn": bytes}`` each device sends per call; they add
    up to :func:`collective_bytes`.

  Example:
    >>> text = ("  %s = (f32[64]{0}, u32[], token[]) send(%x, %t), "
    ...         "is_host_transfer=true, frontend_attributes={"
    ...         '_xla_megascale_target="{1,2}x{0:3}",'
    ...         '_xla_megascale_transfer_type="ALL_REDUCE"}\\n'
    ...         "  %a = f32[64] all-reduce(%y), replica_groups={{0,1,2,3}}, "
    ...         "to_apply=%add\\n")
    >>> collective_bytes_by_link(text)
    {'ici': 384.0, 'dcn': 256.0}
  """
  out = {"ici": 0.0, "dcn": 0.0}
  for c in _counted(compiled_or_text, conditional, "collective_bytes_by_link"):
    dcn = c.bytes_per_call * _dcn_share(c)
    out["dcn"] += dcn
    out["ici"] += c.bytes_per_call - dcn
  return out


def _dcn_share(c: Collective) -> float:
  """The share of a collective's bytes that crosses slices."""
  if c.link != "dcn" or c.group_size <= 1:
    return 0.0
  group = c.replica_groups[0]
  mine = sum(d // _MEGASCALE_SLICE == group[0] // _MEGASCALE_SLICE
             for d in group)
  return (len(group) - mine) / (len(group) - 1)
