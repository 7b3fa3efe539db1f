"""Training steps compiled ahead of time for TPU topologies, no TPU needed.

``jax.experimental.topologies.get_topology_desc`` describes the chips of a
TPU topology (e.g. ``v5e:2x2``, ``v5p:2x2x1``) over ``--slices`` slices
joined by the data-center network (DCN); libtpu (the ``[tpu-aot]`` extra)
compiles :func:`dlion_jax.parallel.make_train_step` for them on any
machine. For each variant this reads off the TPU executable:

* the bytes a chip sends per step over ICI (inside a slice) and over DCN
  (between slices), :func:`dlion_jax.hlo.collective_bytes_by_link`, with
  the bits per parameter and their ratio to the analytic figure
  (:func:`dlion_jax.wire_bits` for D-Lion, an fp32 ring all-reduce for
  global Lion and AdamW);
* HBM per chip (``memory_analysis()``: arguments, temporaries);
* the compile time;
* the overlap of each asynchronous exchange with compute in the scheduled
  ENTRY computation (``async_pairs``): for every megascale (DCN)
  ``send``/``recv`` and its ``-done``, and every ``*-start``/``*-done``
  collective, the instructions between them and the fusions holding a dot
  or convolution (the matmuls that could hide it). ``--bucket-bytes``
  compiles the D-Lion variants also with their votes in buckets
  (``bucket_bytes=``), each exchanged on its own: how much of the backward
  pass each bucket's exchange spans.

Variants: ``lion`` and ``adamw`` (fp32 gradients ``pmean``-ed over all
chips, then ``optax.lion``/``optax.adamw``), flat D-Lion with each ``comm``
(``dlion-alltoall``, ``-allgather``, ``-psum``, ``-psum_int8``, ``-auto``: one
``data`` axis over every chip), and on a ``(data, fsdp)`` mesh of slices x
chips a slice, votes or fp32 all-reduce over DCN on ``1/k`` of the params:
``shard_axis="fsdp"`` (each slice's gradients reduce-scattered by the
library, the state sharded) with params replicated (``hybrid-dlion``,
``hybrid-adamw``: ZeRO-2) or sharded at rest (``hybrid3-*``: ZeRO-3), and
the step that leaves ``fsdp`` wholly to the compiler, with params and
state replicated (``sharded-*``), the state sharded (``zero2-*``) or both
(``zero3-*``), as :func:`dlion_jax.devices.shard_params` places them.
Models:
``dlion_jax.bench.aot_models``.

Usage::

  JAX_PLATFORMS=cpu python -m dlion_jax.bench.aot [--model gpt]
      [--topology v5e:2x2] [--slices 2] [--variants ...]
      [--bucket-bytes 0 1000000] [--overlap] [--plain]
      [--kernels auto|pallas|xla] [--xla-too] [--json PATH] [--out FILE.md]

Each row also gives the bytes the chip's step reads and writes
(``cost_analysis()``'s ``bytes accessed``) a parameter; ``--xla-too``
compiles each D-Lion variant also with ``kernels='xla'``, without the
fused Pallas kernels that ``'auto'`` takes on TPU,
named ``<variant> (XLA)``.

``--plain`` also compiles each D-Lion variant whose ``fsdp`` axis the
compiler owns (flat, ``sharded``, ``zero2``, ``zero3``) in plain
``jax.jit`` form (:mod:`dlion_jax.workers`), named ``<variant> (plain
jit)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import re
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _fused as fused
from dlion_jax import _mesh
from dlion_jax import accounting
from dlion_jax import bench
from dlion_jax import parallel
from dlion_jax import transforms
from dlion_jax.bench import aot_models
from dlion_jax.bench import reporting
import dlion_jax as dl

LEARNING_RATE = 1e-4
COMMS = ("alltoall", "allgather", "psum", "psum_int8", "auto")
# Layouts of a (data, fsdp) mesh: shard_axis="fsdp" (the gradients reduced
# inside a slice by the library) with params replicated (ZeRO-2) or sharded
# at rest (ZeRO-3), and the
# step manual over data only with params and state replicated, ZeRO-2 or
# ZeRO-3 (devices.shard_params).
LAYOUTS = ("hybrid", "hybrid3", "sharded", "zero2", "zero3")
SHARD_AXIS_LAYOUTS = ("hybrid", "hybrid3")
VARIANTS = (("lion", "adamw") + tuple(f"dlion-{c}" for c in COMMS)
            + tuple(f"{layout}-{opt}" for layout in LAYOUTS
                    for opt in ("dlion", "adamw")))
MiB = 2**20
# A variant's row name with this after it: its step in plain jax.jit form.
PLAIN = " (plain jit)"
# A D-Lion variant's row with kernels='xla' (--xla-too): no fused kernels.
XLA = " (XLA)"


# ----------------------------------------------------------------- devices


def tpu_devices(topology: str, slices: int) -> list:
  """The compile-only chips of ``slices`` slices of ``topology``, ordered
  by slice then id.

  A compile-only client drives no chip, so libtpu's lock on one process a
  machine is lifted (``ALLOW_MULTIPLE_LIBTPU_LOAD``) unless set otherwise.
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  desc = topologies.get_topology_desc(topology, "tpu", num_slices=slices)
  return sorted(desc.devices,
                key=lambda d: (getattr(d, "slice_index", 0), d.id))


def libtpu_available() -> str | None:
  """None when TPU topologies can be compiled for, else why not."""
  try:
    tpu_devices("v5e:2x2", 1)
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}".splitlines()[0]
  return None


def mesh_for(devices: list, slices: int, hybrid: bool) -> Mesh:
  """One ``data`` axis over every chip, or ``(data, fsdp)`` = (slices,
  chips a slice)."""
  if hybrid:
    return Mesh(np.array(devices).reshape(slices, -1), ("data", "fsdp"))
  return Mesh(np.array(devices), ("data",))


# ----------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
  """An optimizer and layout (``"flat"`` or one of :data:`LAYOUTS`);
  ``comm`` is D-Lion's strategy (None: fp32)."""
  name: str
  tx: optax.GradientTransformation
  layout: str
  comm: str | None

  @property
  def hybrid(self) -> bool:
    """On a (data, fsdp) mesh: the votes cross DCN on 1/k of the params."""
    return self.layout != "flat"


def variant(name: str, bucket_bytes: int | None = None,
            kernels: str = "auto") -> Variant:
  """The :data:`VARIANTS` entry ``name`` (D-Lion's votes in buckets of
  ``bucket_bytes``, when given, and its ``kernels`` option)."""
  layout, _, base = name.rpartition("-") if name.split("-")[0] in LAYOUTS \
      else ("flat", "", name)
  if base in ("lion", "adamw"):
    opt = optax.lion if base == "lion" else optax.adamw
    tx = optax.chain(transforms.pmean_gradients("data"), opt(LEARNING_RATE))
    return Variant(name, tx, layout, None)
  comm = "auto" if base == "dlion" else base.removeprefix("dlion-")
  return Variant(name, dl.distributed_lion(
      LEARNING_RATE, axis_name="data", comm=comm, bucket_bytes=bucket_bytes,
      kernels=kernels), layout, comm)


def analytic_bits(v: Variant, slices: int, chips: int) -> float:
  """Bits per parameter a chip sends per step by the cost model: over all
  chips flat, over DCN only (on ``1/k`` of the params) for hybrid rows."""
  k = chips // slices
  voters = slices if v.hybrid else chips
  if v.comm is None:
    bits = accounting.allreduce_bits(voters)
  else:
    bits = dl.wire_bits(voters, comm=v.comm, aggregation="mavo")
  return bits / k if v.hybrid else bits


# ----------------------------------------------------------------- overlap

_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>[a-z][\w\-]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_CALLS = re.compile(r"\b(?:calls|body|to_apply|condition)=%?([\w.\-]+)")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)[\s(].*\{\s*$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="?(\w+)')
_COLLECTIVE_STARTS = ("all-reduce-start", "all-gather-start",
                      "collective-permute-start", "all-to-all-start",
                      "reduce-scatter-start", "async-start")
_COMPUTE = ("convolution", "dot")


@dataclasses.dataclass
class Instruction:
  name: str
  op: str
  operands: list[str]
  attrs: str
  shape: str


@dataclasses.dataclass
class AsyncPair:
  """An asynchronous exchange in the scheduled ENTRY computation."""
  start: str
  done: str
  op: str            # send, recv, all-reduce-start, ...
  link: str          # "dcn" (megascale host transfer) or "ici"
  transfer: str      # megascale transfer type (ALL_REDUCE, ...) or the op
  between: int       # instructions scheduled between start and done
  fusions: list[str]
  compute: list[str]  # fusions / loops between that hold a dot or conv
  cycles: int        # the TPU cost model's cycles between (loops excluded)

  @property
  def overlapped(self) -> bool:
    return bool(self.compute)


def _computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """Each computation's instructions in order, and the ENTRY's name."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    head = None if line[:1].isspace() else _HEADER.match(line)
    if head:
      current = head["name"]
      comps[current] = []
      entry = current if head["entry"] else entry
      continue
    m = _LINE.match(line)
    if m and current is not None:
      comps[current].append(Instruction(
          m["name"], m["op"], re.findall(r"%([\w.\-]+)", m["operands"]),
          m["attrs"], m["shape"]))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text: pass a compiled "
                     "executable's as_text().")
  return comps, entry


def _computes(comps: dict, name: str, memo: dict) -> bool:
  """Whether computation ``name`` (or one it calls) holds a dot or conv."""
  if name not in memo:
    memo[name] = False
    memo[name] = any(
        i.op in _COMPUTE or any(_computes(comps, c, memo)
                                for c in _CALLS.findall(i.attrs))
        for i in comps.get(name, ()))
  return memo[name]


def _is_compute(inst: Instruction, comps: dict, memo: dict) -> bool:
  return inst.op in _COMPUTE or any(
      _computes(comps, c, memo) for c in _CALLS.findall(inst.attrs))


def _pair_kind(inst: Instruction) -> tuple[str, str] | None:
  """(link, transfer) of an async start, None for other instructions."""
  if inst.op in ("send", "recv"):
    if "is_host_transfer=true" in inst.attrs:
      m = _MEGASCALE_TYPE.search(inst.attrs)
      return "dcn", m[1] if m else inst.op
    return "ici", inst.op
  if inst.op in _COLLECTIVE_STARTS:
    return "ici", inst.op.removesuffix("-start")
  return None


def async_pairs(hlo_text: str) -> list[AsyncPair]:
  """Every asynchronous exchange of the ENTRY computation and what is
  scheduled between its start and its done.

  Args:
    hlo_text: a compiled executable's ``as_text()`` (scheduled HLO).

  Returns:
    One :class:`AsyncPair` per megascale ``send``/``recv`` (DCN) and per
    ``*-start`` collective or non-host ``send``/``recv`` (ICI), in schedule
    order. ``async-start`` is kept whatever it wraps (on TPU: collectives).
  """
  comps, entry = _computations(hlo_text)
  order = comps[entry]
  memo: dict = {}
  starts = {i.name: (n, i) for n, i in enumerate(order)}
  pairs = []
  for n, done in enumerate(order):
    if not done.op.endswith("-done") or not done.operands:
      continue
    if done.operands[0] not in starts:
      continue
    first, start = starts[done.operands[0]]
    kind = _pair_kind(start)
    if kind is None:
      continue
    inside = order[first + 1:n]
    pairs.append(AsyncPair(
        start.name, done.name, start.op, kind[0], kind[1], len(inside),
        [i.name for i in inside if i.op == "fusion"],
        [i.name for i in inside if _is_compute(i, comps, memo)],
        sum(int(c) for i in inside for c in _CYCLES.findall(i.attrs)[:1])))
  return sorted(pairs, key=lambda p: starts[p.start][0])


def overlap_summary(pairs: list[AsyncPair], link: str) -> str:
  """``overlapped/pairs`` on ``link``, e.g. ``1/6``; ``-`` when none."""
  mine = [p for p in pairs if p.link == link]
  if not mine:
    return "-"
  return f"{sum(p.overlapped for p in mine)}/{len(mine)}"


# ----------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
  """What one compiled step sends, holds and cost to compile."""
  model: str
  topology: str
  slices: int
  chips: int
  variant: str
  params: int
  bucket_bytes: int | None = None
  lower_s: float = 0.0
  compile_s: float = 0.0
  argument_bytes: int = 0
  temp_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  code_bytes: int = 0
  ici_bytes: float | None = None
  dcn_bytes: float | None = None
  analytic_bits: float | None = None
  pairs: list[AsyncPair] = dataclasses.field(default_factory=list)
  error: str | None = None
  bytes_error: str | None = None
  bytes_accessed: float | None = None

  @property
  def measured_bits(self) -> float | None:
    """Bits per param per step the analytic figure is about: all links
    flat, DCN only for hybrid rows."""
    if self.dcn_bytes is None:
      return None
    hybrid = variant(base_name(self.variant)).hybrid
    sent = self.dcn_bytes if hybrid else self.dcn_bytes + self.ici_bytes
    return 8 * sent / self.params


def _with_sharding(tree: Any, mesh: Mesh, spec: P) -> Any:
  sharding = NamedSharding(mesh, spec)
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      tree)


def _fsdp(tree: Any, mesh: Mesh) -> Any:
  """``tree`` as :func:`dlion_jax.devices.shard_params` places it."""
  k = mesh.shape["fsdp"]
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, _mesh.fsdp_spec(
          x.shape, k))), tree)


def abstract_args(problem: aot_models.Problem, v: Variant, mesh: Mesh):
  """(params, states, batch) as sharded ``ShapeDtypeStruct`` trees."""
  params = _with_sharding(problem.params, mesh, P())
  batch = _with_sharding(problem.batch(mesh.devices.size), mesh,
                         P(("data", "fsdp") if v.hybrid else "data"))
  if v.layout == "flat":
    states = jax.eval_shape(
        lambda p: parallel.init_worker_states(v.tx, p, mesh), params)
    return params, _with_sharding(states, mesh, P("data")), batch
  placed = params if v.layout == "sharded" else _fsdp(problem.params, mesh)
  shapes = jax.eval_shape(
      lambda p: parallel.init_worker_states(v.tx, p, mesh), placed)
  shardings = parallel.state_shardings(v.tx, shapes, placed, mesh)
  states = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), shapes, shardings)
  sharded_at_rest = v.layout in ("zero3", "hybrid3")
  return (placed if sharded_at_rest else params), states, batch


def _read_bytes(row: Row, compiled) -> None:
  try:
    sent = dl.hlo.collective_bytes_by_link(compiled, conditional=True)
  except Exception as e:  # pylint: disable=broad-except
    row.bytes_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return
  row.ici_bytes, row.dcn_bytes = sent.get("ici", 0.0), sent.get("dcn", 0.0)


def base_name(name: str) -> str:
  """A row's variant without :data:`XLA` and :data:`PLAIN`."""
  return name.removesuffix(PLAIN).removesuffix(XLA)


def compile_step(problem: aot_models.Problem, topology: str, slices: int,
                 name: str, bucket_bytes: int | None = None,
                 plain: bool = False, kernels: str = "auto"
                 ) -> tuple[Row, str]:
  """Compiles one variant's training step and reads its executable: the
  row and the scheduled HLO text (empty when the compile failed).
  ``plain``: the step in plain ``jax.jit`` form
  (:func:`dlion_jax.bench.plain_train_step`), its row named
  ``name + PLAIN``; ``kernels='xla'``: named ``name + XLA``."""
  devices = tpu_devices(topology, slices)
  v = variant(name, bucket_bytes, kernels)
  mesh = mesh_for(devices, slices, v.hybrid)
  row = Row(problem.name, topology, slices, len(devices),
            name + (XLA if kernels == "xla" else "")
            + (PLAIN if plain else ""), problem.count,
            bucket_bytes=bucket_bytes,
            analytic_bits=analytic_bits(v, slices, len(devices)))
  step = parallel.make_train_step(
      problem.loss_fn, v.tx, mesh,
      shard_axis="fsdp" if v.layout in SHARD_AXIS_LAYOUTS else None)
  args = abstract_args(problem, v, mesh)
  if plain:
    step = bench.plain_train_step(
        problem.loss_fn, v.tx,
        jax.tree.map(lambda x: x.sharding.spec, args[0]))
  gc.collect()
  try:
    tic = time.perf_counter()
    # dl.workers reads the mesh's axes; jax.set_mesh would ask the
    # compile-only chips for their local devices.
    with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if plain
          else contextlib.nullcontext()):
      lowered = step.lower(*args)
    row.lower_s = time.perf_counter() - tic
    tic = time.perf_counter()
    compiled = lowered.compile()
    row.compile_s = time.perf_counter() - tic
    if plain:     # what it sends on the params and state it hands back
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = bench.steady_compiled(step, *args, compiled=compiled)
  except Exception as e:  # pylint: disable=broad-except
    row.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return row, ""
  _read_memory(row, compiled.memory_analysis())
  _read_bytes(row, compiled)
  cost = compiled.cost_analysis()
  row.bytes_accessed = (cost[0] if isinstance(cost, list) else cost).get(
      "bytes accessed")
  text = compiled.as_text()
  row.pairs = async_pairs(text)
  return row, text


def compile_row(problem: aot_models.Problem, topology: str, slices: int,
                name: str, bucket_bytes: int | None = None,
                plain: bool = False, kernels: str = "auto") -> Row:
  """:func:`compile_step`'s row alone."""
  return compile_step(problem, topology, slices, name, bucket_bytes,
                      plain, kernels)[0]


def has_plain_form(name: str) -> bool:
  """Whether variant ``name`` runs in plain ``jax.jit`` form: D-Lion,
  flat or with ``fsdp`` left to the compiler (not ``shard_axis``)."""
  v = variant(name)
  return v.comm is not None and v.layout not in SHARD_AXIS_LAYOUTS


def warm_up(topology: str, slices: int) -> None:
  """Compiles a one-op step once: libtpu's first compile in a process
  carries its start-up, which would land in the first row's time."""
  mesh = mesh_for(tpu_devices(topology, slices), slices, hybrid=False)
  x = jax.ShapeDtypeStruct((mesh.devices.size, 128), np.float32,
                           sharding=NamedSharding(mesh, P("data")))
  jax.jit(lambda a: a.sum(0)).lower(x).compile()


def _read_memory(row: Row, mem) -> None:
  row.argument_bytes = mem.argument_size_in_bytes
  row.temp_bytes = mem.temp_size_in_bytes
  row.output_bytes = mem.output_size_in_bytes
  row.alias_bytes = mem.alias_size_in_bytes
  row.code_bytes = mem.generated_code_size_in_bytes


# ----------------------------------------------------------------- report


def _bytes(x: float | None) -> str:
  return "n/a" if x is None else f"{x:,.0f}"


def _ratio(row: Row) -> str:
  measured = row.measured_bits
  if measured is None or not row.analytic_bits:
    return "n/a"
  return f"{measured:.3f} / {row.analytic_bits:.3f} = " \
         f"{measured / row.analytic_bits:.2f}"


def _name(row: Row) -> str:
  return row.variant + (f", buckets of {row.bucket_bytes:,} B"
                        if row.bucket_bytes else "")


def table_row(row: Row) -> list:
  where = f"{row.topology} x{row.slices} ({row.chips} chips)"
  if row.error:
    return [where, _name(row)] + ["-"] * 9 + [row.error]
  accessed = ("-" if row.bytes_accessed is None
              else f"{row.bytes_accessed / row.params:.1f}")
  return [where, _name(row), _bytes(row.ici_bytes), _bytes(row.dcn_bytes),
          _ratio(row), f"{row.argument_bytes / MiB:,.1f}",
          f"{row.temp_bytes / MiB:,.1f}", accessed, f"{row.compile_s:.1f}",
          overlap_summary(row.pairs, "dcn"),
          overlap_summary(row.pairs, "ici"), ""]


HEADERS = ["topology", "variant", "ICI bytes/chip", "DCN bytes/chip",
           "bits/param measured / analytic = ratio", "HBM args MiB",
           "HBM temp MiB", "bytes accessed/param", "compile s",
           "DCN pairs over a dot",
           "ICI pairs over a dot", "note"]


def overlap_lines(row: Row) -> list[str]:
  """One line per async pair: what lies between its start and done."""
  lines = [f"{row.model} {row.topology} x{row.slices} {_name(row)}:"]
  for p in row.pairs:
    shown = ", ".join(p.compute[:4]) + (
        f" (+{len(p.compute) - 4})" if len(p.compute) > 4 else "")
    lines.append(
        f"  {p.link} {p.transfer:<14} {p.start} .. {p.done}: {p.between} "
        f"instructions, {len(p.fusions)} fusions, {len(p.compute)} with a "
        f"dot/conv{': ' + shown if shown else ''}, ~{p.cycles:,} cycles")
  return lines


def report(rows: list[Row], overlap: bool) -> str:
  parts = [_versions()]
  for model in dict.fromkeys(r.model for r in rows):
    mine = [r for r in rows if r.model == model]
    parts.append(f"Model `{model}`, {mine[0].params:,} params; per chip "
                 "and step:\n\n" + reporting.markdown_table(
                     HEADERS, [table_row(r) for r in mine]))
  notes = [f"- {r.model} {r.topology} x{r.slices} {r.variant}: bytes not "
           f"read: {r.bytes_error}" for r in rows if r.bytes_error]
  if notes:
    parts.append("\n".join(notes))
  if overlap:
    parts.append("```\n" + "\n".join(
        line for r in rows if not r.error for line in overlap_lines(r))
        + "\n```")
  return "\n\n".join(parts)


def _versions() -> str:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    libtpu = metadata.version("libtpu")
  except Exception:  # pylint: disable=broad-except
    libtpu = "?"
  return f"jax {jax.__version__}, libtpu {libtpu}, compiled on " \
         f"{os.cpu_count()} CPU cores (backend {jax.default_backend()})"


def row_json(row: Row) -> dict:
  out = dataclasses.asdict(row)
  out["measured_bits"] = row.measured_bits
  return out


# ----------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m dlion_jax.bench.aot",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--model", nargs="+", default=["gpt"],
                      choices=sorted(aot_models.PROBLEMS))
  parser.add_argument("--topology", nargs="+", default=["v5e:2x2"],
                      help="TPU topologies, e.g. v5e:2x2 v5p:2x2x1")
  parser.add_argument("--slices", type=int, nargs="+", default=[2])
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                      choices=VARIANTS)
  parser.add_argument("--bucket-bytes", type=int, nargs="+", default=[0],
                      help="D-Lion variants also with bucket_bytes= each of "
                      "these (0: one message, the default)")
  parser.add_argument("--overlap", action="store_true",
                      help="also list every async pair and what lies "
                      "between its start and done")
  parser.add_argument("--plain", action="store_true",
                      help="also compile each D-Lion variant whose fsdp "
                      "axis the compiler owns in plain jax.jit form "
                      "(dl.workers), named '<variant> (plain jit)'")
  parser.add_argument("--kernels", choices=fused.KERNELS, default="auto",
                      help="the D-Lion variants' kernels option (the fused "
                      "Pallas kernels: 'auto' takes them on TPU)")
  parser.add_argument("--xla-too", action="store_true",
                      help="also compile each D-Lion variant with "
                      "kernels='xla', named '<variant> (XLA)'")
  parser.add_argument("--json", help="also write the rows to this file")
  parser.add_argument("--out", help="also write the report to this file")
  return parser


def main(argv=None) -> str:
  parser = _parser()
  args = parser.parse_args(argv)
  if "gpt" in args.model:
    bench.require_examples(parser, "dlion_jax.train.models",
                           "--model gpt (the train CLI's GPT)")
  if os.environ.get("JAX_PLATFORMS") is None:
    jax.config.update("jax_platforms", "cpu")    # compile-only: no TPU used
  why = libtpu_available()
  if why:
    parser.error(f"cannot compile for TPU topologies ({why}); install "
                 'libtpu: pip install "dlion_jax[tpu-aot]"')
  if args.plain and args.kernels == "pallas":
    parser.error("--kernels pallas cannot run in --plain's plain jitted "
                 "steps (XLA partitions them, and not a Pallas kernel); "
                 "leave out one of them")
  if args.xla_too and args.kernels == "xla":
    parser.error("--xla-too adds kernels='xla' rows beside --kernels auto "
                 "or pallas; leave out one of them")
  budgets = [b or None for b in args.bucket_bytes]
  dlion = {v: variant(v).comm is not None for v in args.variants}
  jobs = [(m, t, s, v, b, plain, k)
          for m in args.model for t in args.topology
          for s in args.slices for v in args.variants for b in budgets
          for plain in ((False, True) if args.plain and has_plain_form(v)
                        else (False,))
          for k in ((args.kernels, "xla") if args.xla_too and dlion[v]
                    else (args.kernels,))
          if b is None or dlion[v]]
  problems = {m: aot_models.PROBLEMS[m]() for m in args.model}
  warm_up(args.topology[0], args.slices[0])
  rows = []
  for m, t, s, v, b, plain, k in bench.progress(jobs, len(jobs),
                                               "compiling"):
    rows.append(compile_row(problems[m], t, s, v, b, plain, k))
    reporting.write_json(args.json, [row_json(r) for r in rows], indent=1)
  return reporting.emit(report(rows, args.overlap), args.out)


if __name__ == "__main__":
  main()
