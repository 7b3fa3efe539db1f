"""Bits on the wire per parameter and step: compiled HLO against the analytic.

For every axis size ``N``, aggregation, vote and ``comm`` strategy, builds the
update of :func:`dlion_jax.scale_by_distributed_lion` inside
:func:`jax.shard_map` over ``N`` simulated CPU devices, compiles it (nothing
runs), and reads the bytes each worker sends off the HLO with
:func:`dlion_jax.accounting.collectives`. The same is done for the fp32 and
bf16 gradient all-reduce (``lax.pmean``) that data-parallel ``optax.lion``
needs. Prints markdown tables of measured against
:func:`dlion_jax.wire_bits` / :func:`dlion_jax.allreduce_bits`.

Usage::

  python -m dlion_jax.bench.wire [--sizes 2,4,8,16,32,64] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import accounting
from dlion_jax import bench
from dlion_jax import exchange
from dlion_jax import parallel

AXIS = "data"
DEFAULT_SIZES = (2, 4, 8, 16, 32, 64)
COMMS = accounting.COMMS + ("auto",)
# About 1.05M parameters in leaves of odd sizes: padding to packing units is
# below 0.3% of the buffer even at N = 64.
SHAPES = {
    "w1": (1023, 517),
    "b1": (517,),
    "w2": (517, 997),
    "b2": (997,),
    "scale": (13,),
}
NUM_PARAMS = sum(math.prod(s) for s in SHAPES.values())


@dataclasses.dataclass(frozen=True)
class Measurement:
  """Bits per parameter per worker and step of one configuration."""
  num_workers: int
  aggregation: str
  vote: str
  comm: str
  picked: str        # what `auto` resolves to (== comm otherwise)
  measured: float    # from the compiled HLO
  lowered: float     # from the HLO before backend passes
  analytic: float    # dl.wire_bits
  ops: str           # the collectives, e.g. "all-to-all+all-gather"


def worker_arrays(num_workers: int, dtype=jnp.float32) -> dict:
  """Abstract per-worker pytree: every leaf gets a leading worker axis."""
  return {k: jax.ShapeDtypeStruct((num_workers,) + s, dtype)
          for k, s in SHAPES.items()}


def _first(tree):
  return jax.tree.map(lambda x: x[0], tree)


def dlion_update(mesh, *, aggregation: str, vote: str, comm: str):
  """Jitted ``(grads, mu) -> D`` of one distributed Lion update per worker."""
  tx = dl.scale_by_distributed_lion(
      axis_name=AXIS, aggregation=aggregation, vote=vote, comm=comm)

  def local(grads, mu):
    state = dl.DistributedLionState(count=jnp.zeros([], jnp.int32),
                                    mu=_first(mu))
    return tx.update(_first(grads), state)[0]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                               out_specs=P()))


def gradient_pmean(mesh):
  """Jitted ``grads -> pmean(grads)``: data-parallel Lion's all-reduce."""
  local = lambda grads: lax.pmean(_first(grads), AXIS)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(AXIS),
                               out_specs=P()))


def hlo_bits(fn, *args) -> tuple[float, float, str]:
  """(compiled bits/param, lowered bits/param, collective ops) of ``fn``."""
  lowered = fn.lower(*args)
  compiled_text = lowered.compile().as_text()
  per_param = lambda text: accounting.collective_bytes(text) * 8 / NUM_PARAMS
  ops = "+".join(c.op for c in accounting.collectives(compiled_text))
  return (per_param(compiled_text),
          per_param(lowered.as_text(dialect="hlo")), ops)


def measure_dlion(num_workers: int, aggregation: str, vote: str,
                  comm: str) -> Measurement:
  """Compiles one configuration and reads its wire bits."""
  mesh = parallel.data_mesh(num_workers, axis_name=AXIS)
  fn = dlion_update(mesh, aggregation=aggregation, vote=vote, comm=comm)
  args = (worker_arrays(num_workers),) * 2
  measured, lowered, ops = hlo_bits(fn, *args)
  picked = exchange.resolve_comm(comm, num_workers, aggregation=aggregation,
                                 vote=vote)
  analytic = dl.wire_bits(num_workers, aggregation=aggregation, vote=vote,
                          comm=comm)
  return Measurement(num_workers, aggregation, vote, comm, picked, measured,
                     lowered, analytic, ops)


def measure_allreduce(num_workers: int, dtype) -> Measurement:
  """Wire bits of ``lax.pmean`` of ``dtype`` gradients."""
  mesh = parallel.data_mesh(num_workers, axis_name=AXIS)
  args = (worker_arrays(num_workers, dtype),)
  measured, lowered, ops = hlo_bits(gradient_pmean(mesh), *args)
  name = jnp.dtype(dtype).name
  return Measurement(num_workers, "-", "-", f"pmean {name}", "-", measured,
                     lowered, dl.allreduce_bits(num_workers, dtype), ops)


def configs(sizes):
  """Every (N, aggregation, vote, comm) to measure, in table order."""
  return list(itertools.product(sizes, accounting.AGGREGATIONS,
                                accounting.VOTES, COMMS))


def run(sizes) -> tuple[list[Measurement], list[Measurement]]:
  """Measures every configuration and the all-reduce baselines."""
  todo = configs(sizes)
  dlion = [measure_dlion(*c)
           for c in bench.progress(todo, len(todo), "compiling")]
  baselines = [measure_allreduce(n, dtype) for n in sizes
               for dtype in (jnp.float32, jnp.bfloat16)]
  return dlion, baselines


def _cell(m: Measurement) -> str:
  return f"{m.measured:.3f} / {m.analytic:.3f}"


def dlion_table(dlion: list[Measurement]) -> str:
  """One row per (N, aggregation, vote); cells are measured / analytic."""
  rows = {}
  for m in dlion:
    rows.setdefault((m.num_workers, m.aggregation, m.vote), {})[m.comm] = m
  headers = ["N", "aggregation", "vote"] + list(accounting.COMMS) + [
      "auto", "auto picks"]
  body = [[n, agg, vote] + [_cell(r[c]) for c in COMMS] + [r["auto"].picked]
          for (n, agg, vote), r in rows.items()]
  return bench.markdown_table(headers, body)


def allreduce_table(baselines: list[Measurement]) -> str:
  """fp32 / bf16 gradient all-reduce, measured from HLO against analytic."""
  by_n = {}
  for m in baselines:
    by_n.setdefault(m.num_workers, {})[m.comm] = m
  headers = ["N", "fp32 pmean (compiled / analytic)",
             "bf16 pmean (lowered / analytic)", "bf16 pmean as compiled"]
  body = []
  for n, r in by_n.items():
    f32, b16 = r["pmean float32"], r["pmean bfloat16"]
    body.append([n, _cell(f32), f"{b16.lowered:.3f} / {b16.analytic:.3f}",
                 f"{b16.measured:.3f} ({b16.ops})"])
  return bench.markdown_table(headers, body)


def mismatches(dlion: list[Measurement], tol: float = 0.02) -> list[str]:
  """Configurations where HLO and analytic (or lowered, or auto) disagree."""
  picked = {(m.num_workers, m.aggregation, m.vote, m.comm): m for m in dlion}
  out = []
  for m in dlion:
    if abs(m.measured - m.analytic) > tol * max(m.analytic, 1.0):
      out.append(f"{m}: measured != analytic")
    if abs(m.measured - m.lowered) > 1e-9:
      out.append(f"{m}: compiled != lowered")
    if m.comm == "auto":
      twin = picked[(m.num_workers, m.aggregation, m.vote, m.picked)]
      if abs(twin.measured - m.measured) > 1e-9:
        out.append(f"{m}: auto != {m.picked}")
  return out


def target_lines(dlion: list[Measurement]) -> list[str]:
  """The N = 8 headline figures, when N = 8 was measured."""
  auto = {(m.aggregation, m.vote): m for m in dlion
          if m.num_workers == 8 and m.comm == "auto"}
  if not auto:
    return []
  int8 = lambda agg, vote: dl.wire_bits(8, aggregation=agg, vote=vote,
                                       comm="psum_int8")
  return [f"N=8 {agg} {vote} auto ({m.picked}): {m.measured:.3f} bits/param "
          f"(analytic {m.analytic:.3f}; fp32 all-reduce "
          f"{dl.allreduce_bits(8):.0f}, psum_int8 {int8(agg, vote):.0f})"
          for (agg, vote), m in auto.items()]


def report(dlion, baselines, elapsed: float) -> str:
  """The whole markdown report."""
  problems = mismatches(dlion)
  parts = [
      f"Machine: {bench.machine_line()}. Parameters: {NUM_PARAMS:,} in "
      f"{len(SHAPES)} leaves {tuple(SHAPES.values())}.",
      "",
      "### Distributed Lion: bits per parameter per worker and step "
      "(measured from compiled HLO / analytic `dl.wire_bits`)",
      "",
      dlion_table(dlion),
      "",
      "### Gradient all-reduce of data-parallel `optax.lion` (`lax.pmean`)",
      "",
      allreduce_table(baselines),
      "",
      *[f"- {line}" for line in target_lines(dlion)],
      f"- HLO vs analytic mismatches (> 2%, or compiled != lowered, or auto "
      f"!= its pick): {len(problems)}",
      *[f"  - {p}" for p in problems],
      f"- {len(dlion) + len(baselines)} functions compiled in "
      f"{elapsed:.1f} s.",
  ]
  return "\n".join(parts)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                      help="comma-separated axis sizes N")
  parser.add_argument("--out", default=None, help="also write markdown here")
  args = parser.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",") if s]
  bench.use_cpu_devices(max(sizes))
  start = time.perf_counter()
  dlion, baselines = run(sizes)
  return bench.emit(report(dlion, baselines, time.perf_counter() - start),
                    args.out)


if __name__ == "__main__":
  main()
