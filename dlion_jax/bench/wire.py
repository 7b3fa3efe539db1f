"""Bits on the wire per parameter and step: compiled HLO against the analytic.

For every axis size ``N``, aggregation, vote and ``comm`` strategy, builds the
update of :func:`dlion_jax.scale_by_distributed_lion` inside
:func:`jax.shard_map` over ``N`` simulated CPU devices, compiles it (nothing
runs), and reads the bytes each worker sends off the HLO with
:func:`dlion_jax.hlo.collectives`. The same is done for the fp32 and
bf16 gradient all-reduce (``lax.pmean``) that data-parallel ``optax.lion``
needs. Prints markdown tables of measured against
:func:`dlion_jax.wire_bits` / :func:`dlion_jax.allreduce_bits`.

``--plot FILE.png`` also draws bits per parameter per step against N for
every strategy, the fp32 / bf16 all-reduce and two analytic floors
(``pattern_floor_bits``, ``information_floor_bits``).

``--local-steps H ...`` instead compiles whole train steps with local steps
(:func:`dlion_jax.local_steps`: Lion alone on each worker, every ``H``
steps an outer step, Distributed Lion's vote or DiLoCo's Nesterov step)
and reads what a step sends averaged over a round: the collectives outside
the outer step's conditional, plus those inside it over ``H``.

Usage::

  python -m dlion_jax.bench.wire [--sizes 2,4,8,16,32,64] [--out FILE.md]
      [--plot FILE.png] [--local-steps 1 8 32 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies
from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import hlo
from dlion_jax import parallel
from dlion_jax.bench import reporting
import dlion_jax as dl

AXIS = "data"
DEFAULT_SIZES = (2, 4, 8, 16, 32, 64)
COMMS = message.COMMS + ("auto",)
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


def dlion_update(mesh, *, aggregation: str, vote: str, comm: str):
  """Jitted ``(grads, mu) -> D`` of one distributed Lion update per worker."""
  tx = dl.scale_by_distributed_lion(
      axis_name=AXIS, aggregation=aggregation, vote=vote, comm=comm)

  def local(grads, mu):
    state = dl.DistributedLionState(count=jnp.zeros([], jnp.int32), mu=mu)
    return tx.update(grads, state)[0]

  return jax.jit(parallel.per_worker(
      local, mesh, axis_name=AXIS, ins=("stacked", "stacked"),
      outs="replicated", check_vma=True))


def gradient_pmean(mesh):
  """Jitted ``grads -> pmean(grads)``: data-parallel Lion's all-reduce."""
  return jax.jit(parallel.per_worker(
      lambda grads: lax.pmean(grads, AXIS), mesh, axis_name=AXIS,
      ins=("stacked",), outs="replicated", check_vma=True))


def hlo_bits(fn, *args) -> tuple[float, float, str]:
  """(compiled bits/param, lowered bits/param, collective ops) of ``fn``."""
  lowered = fn.lower(*args)
  compiled_text = lowered.compile().as_text()
  per_param = lambda text: hlo.collective_bytes(text) * 8 / NUM_PARAMS
  ops = "+".join(c.op for c in hlo.collectives(compiled_text))
  return (per_param(compiled_text),
          per_param(lowered.as_text(dialect="hlo")), ops)


def measure_dlion(num_workers: int, aggregation: str, vote: str,
                  comm: str) -> Measurement:
  """Compiles one configuration and reads its wire bits."""
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  fn = dlion_update(mesh, aggregation=aggregation, vote=vote, comm=comm)
  args = (worker_arrays(num_workers),) * 2
  measured, lowered, ops = hlo_bits(fn, *args)
  picked = exchange.resolve_comm(comm, num_workers, aggregation=aggregation,
                                 spec=quantize.vote_spec(vote=vote))
  analytic = dl.wire_bits(num_workers, aggregation=aggregation, vote=vote,
                          comm=comm)
  return Measurement(num_workers, aggregation, vote, comm, picked, measured,
                     lowered, analytic, ops)


def measure_allreduce(num_workers: int, dtype) -> Measurement:
  """Wire bits of ``lax.pmean`` of ``dtype`` gradients."""
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  args = (worker_arrays(num_workers, dtype),)
  measured, lowered, ops = hlo_bits(gradient_pmean(mesh), *args)
  name = jnp.dtype(dtype).name
  return Measurement(num_workers, "-", "-", f"pmean {name}", "-", measured,
                     lowered, dl.allreduce_bits(num_workers, dtype), ops)


# The outer steps of the local-steps table: name -> (the outer optimizer,
# the analytic bits of its exchange as a function of N).
OUTER_CODES = {
    "dlion": (lambda: dl.distributed_lion(1e-2, axis_name=AXIS),
              dl.wire_bits),
    "voted": (lambda: dl.rounds.voted_outer(1.0, axis_name=AXIS),
              dl.wire_bits),
    "sparse 1/32": (lambda: dl.rounds.voted_outer(
        1.0, axis_name=AXIS, sparse_chunk=32), lambda n: dl.sparse_vote_bits(
            n, sparse_chunk=32)),
    "sparse 1/128": (lambda: dl.rounds.voted_outer(
        1.0, axis_name=AXIS, sparse_chunk=128), dl.sparse_vote_bits),
    # One entry in 4 votes a round; SparseLoCo's values: 16 of every
    # 4,096, 2-bit, two scales a chunk.
    "voted 1/4": (lambda: dl.rounds.voted_outer(
        1.0, axis_name=AXIS, fragments=4), lambda n: dl.wire_bits(n) / 4),
    "sparse 16/4096 2-bit": (lambda: dl.rounds.voted_outer(
        1.0, axis_name=AXIS, sparse_chunk=4096, sparse_keep=16,
        sparse_value_bits=2, scale_chunk=4096),
                             lambda n: dl.sparse_vote_bits(
                                 n, sparse_chunk=4096, sparse_keep=16,
                                 sparse_value_bits=2, scale_chunk=4096)),
    "nesterov": (lambda: dl.rounds.nesterov_outer(0.7, axis_name=AXIS),
                 dl.allreduce_bits),
}


def local_steps_bits(num_workers: int, outer: str, every: int
                     ) -> tuple[float, float]:
  """(measured, analytic) bits a worker sends per parameter per step,
  averaged over a round of ``every`` local steps, for the ``outer`` step
  (a key of :data:`OUTER_CODES`)."""
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  make, analytic_bits = OUTER_CODES[outer]
  tx = dl.local_steps(optax.lion(1e-3), make(), every=every)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  loss = lambda p, batch: sum(jnp.sum(p[k] * batch[k][0]) for k in p)
  step = parallel.make_train_step(loss, tx, mesh, params_per_worker=True)
  batch = {k: np.zeros((num_workers,) + s, np.float32)
           for k, s in SHAPES.items()}
  compiled = step.lower(
      devices.stack_for_workers(params, mesh, axis_name=AXIS),
      parallel.init_worker_states(tx, devices.replicate(params, mesh), mesh),
      devices.shard_batch(batch, mesh)).compile()
  always = hlo.collective_bytes(compiled, conditional=False)
  outer_bytes = hlo.collective_bytes(compiled) - always
  return ((always + outer_bytes / every) * 8 / NUM_PARAMS,
          analytic_bits(num_workers) / every)


def local_steps_report(sizes, hs) -> str:
  """Markdown: per N and H, what a step with local steps sends with each
  outer step of :data:`OUTER_CODES`."""
  todo = list(itertools.product(sizes, hs))
  body = []
  for n, h in bench.progress(todo, len(todo), "compiling"):
    bits = {outer: local_steps_bits(n, outer, h) for outer in OUTER_CODES}
    body.append([str(n), str(h), *(
        f"{measured:.4f} ({analytic:.4f})"
        for measured, analytic in bits.values()),
                 f"{bits['nesterov'][0] / bits['dlion'][0]:.1f}x"])
  return ("Bits each worker sends per parameter per step with local steps, "
          "averaged over a round, read off the compiled train step "
          f"({NUM_PARAMS:,} parameters; analytic in parentheses): the "
          "1-bit outer vote (`dl.distributed_lion`), the error-fed voted "
          "mean (`dl.rounds.voted_outer`) dense, in fragments (one entry "
          "in 4 a round) and sparse (sign words; SparseLoCo's 2-bit "
          "values), and DiLoCo's fp32 mean:\n\n"
          + reporting.markdown_table(
              ["N", "H", *(OUTER_HEADERS.get(outer, outer)
                           for outer in OUTER_CODES), "DiLoCo / D-Lion"],
              body))


OUTER_HEADERS = {"dlion": "D-Lion outer (1-bit vote)",
                 "voted": "voted mean",
                 "nesterov": "DiLoCo outer (fp32 mean)"}


def configs(sizes):
  """Every (N, aggregation, vote, comm) to measure, in table order."""
  return list(itertools.product(sizes, message.AGGREGATIONS,
                                quantize.VOTES, COMMS))


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
  headers = ["N", "aggregation", "vote"] + list(message.COMMS) + [
      "auto", "auto picks"]
  body = [[n, agg, vote] + [_cell(r[c]) for c in COMMS] + [r["auto"].picked]
          for (n, agg, vote), r in rows.items()]
  return reporting.markdown_table(headers, body)


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
  return reporting.markdown_table(headers, body)


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


def headline_lines(dlion: list[Measurement]) -> list[str]:
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
      *[f"- {line}" for line in headline_lines(dlion)],
      f"- HLO vs analytic mismatches (> 2%, or compiled != lowered, or auto "
      f"!= its pick): {len(problems)}",
      *[f"  - {p}" for p in problems],
      f"- {len(dlion) + len(baselines)} functions compiled in "
      f"{elapsed:.1f} s.",
  ]
  return "\n".join(parts)


def pattern_floor_bits(num_workers: int, aggregation: str,
                       vote: str) -> float:
  """Fewest bits/param of the owner-computes pattern with ideal codes.

  Worker k owns 1/N of the parameters: every worker sends the votes of the
  parameters others own, ``(N-1)/N * log2(vote values)``, and each owner
  sends its result to the others, ``(N-1)/N * log2(result values)`` (MaVo:
  2 values, 3 with ties; Avg: the ``(r-1) N + 1`` possible sums). This is
  ``alltoall`` with fractional-bit codes and no padding to words.
  """
  n = num_workers
  up = math.log2(quantize.vote_spec(vote=vote).radix)
  # The distinct values of D: what alltoall sends back.
  down = math.log2(strategies.alltoall_down_radix(
      n, aggregation=aggregation, spec=quantize.vote_spec(vote=vote)))
  return (n - 1) / n * (up + down)


def _entropy(probs) -> float:
  return -sum(p * math.log2(p) for p in probs if p > 0)


def information_floor_bits(num_workers: int, aggregation: str,
                           vote: str) -> float:
  """Bits/param each worker must receive: ``H(D | its own vote)``.

  For independent votes, uniform over their values (binary: +-1; ternary:
  -1, 0, 1): every worker must end up knowing D, and knows only its own
  vote, so on average each receives, and hence sends, at least this many
  bits, whatever the scheme. Correlated votes (workers mostly agree) need
  less.
  """
  n, r = num_workers, quantize.vote_spec(vote=vote).radix
  values = (-1, 1) if r == 2 else (-1, 0, 1)
  others = {0: 1.0}                      # distribution of the other votes' sum
  for _ in range(n - 1):
    nxt = {}
    for total, p in others.items():
      for v in values:
        nxt[total + v] = nxt.get(total + v, 0.0) + p / len(values)
    others = nxt
  h = 0.0
  for own in values:
    dist = {}
    for total, p in others.items():
      d = own + total
      key = d if aggregation == "avg" else (d > 0) - (d < 0)
      dist[key] = dist.get(key, 0.0) + p
    h += _entropy(dist.values()) / len(values)
  return h


def plot(dlion: list[Measurement], baselines: list[Measurement],
         path: str) -> None:
  """Bits/param/step against N: every strategy, all-reduces, the floors."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  panels = list(dict.fromkeys((m.aggregation, m.vote) for m in dlion))
  fig = Figure(figsize=(11, 4.2 * math.ceil(len(panels) / 2)),
               layout="constrained")
  axes = fig.subplots(math.ceil(len(panels) / 2), 2, squeeze=False).ravel()
  sizes = sorted({m.num_workers for m in baselines + dlion})
  for ax, (agg, vote) in zip(axes, panels):
    for comm in message.COMMS:
      pts = sorted((m.num_workers, m.measured) for m in dlion
                   if (m.aggregation, m.vote, m.comm) == (agg, vote, comm))
      ax.plot(*zip(*pts), marker="o", label=f"{comm} (measured)")
    for dtype, style in (("float32", "-"), ("bfloat16", "--")):
      pts = sorted((m.num_workers, m.analytic) for m in baselines
                   if m.comm == f"pmean {dtype}")
      ax.plot(*zip(*pts), style, color="black", label=f"{dtype} all-reduce")
    for floor, style, label in (
        (pattern_floor_bits, ":", "pattern floor"),
        (information_floor_bits, "-.", "information floor")):
      ax.plot(sizes, [floor(n, agg, vote) for n in sizes], style,
              color="gray", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("workers N")
    ax.set_ylabel("bits / parameter / step (per worker)")
    ax.set_title(f"{agg}, {vote} votes")
    ax.grid(True, which="both", alpha=0.3)
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  axes[0].legend(fontsize=7)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def floor_lines(sizes) -> list[str]:
  """The two floors next to auto's analytic bits, binary votes."""
  out = []
  for agg in message.AGGREGATIONS:
    cells = [f"N={n}: auto {dl.wire_bits(n, aggregation=agg):.3f}, pattern "
             f"{pattern_floor_bits(n, agg, 'binary'):.3f}, information "
             f"{information_floor_bits(n, agg, 'binary'):.3f}"
             for n in sizes]
    out.append(f"{agg} binary floors (bits/param): " + "; ".join(cells))
  return out


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m dlion_jax.bench.wire",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                      help="comma-separated axis sizes N")
  parser.add_argument("--out", default=None, help="also write markdown here")
  parser.add_argument("--plot", default=None,
                      help="write the bits-vs-N PNG here")
  parser.add_argument("--local-steps", type=int, nargs="+", metavar="H",
                      help="instead, the steps with local steps: every H "
                      "steps an outer step (dl.local_steps)")
  args = parser.parse_args(argv)
  if args.plot:
    bench.require_examples(parser, "matplotlib", "--plot")
  sizes = [int(s) for s in args.sizes.split(",") if s]
  devices.use_cpu_devices(max(sizes))
  start = time.perf_counter()
  if args.local_steps:
    text = local_steps_report(sizes, args.local_steps)
    return reporting.emit(
        text + f"\n\ntook {time.perf_counter() - start:.0f} s", args.out)
  dlion, baselines = run(sizes)
  text = report(dlion, baselines, time.perf_counter() - start)
  text += "".join(f"\n- {line}" for line in floor_lines(sizes))
  if args.plot:
    plot(dlion, baselines, args.plot)
    text += f"\n- plot: {args.plot}"
  return reporting.emit(text, args.out)


if __name__ == "__main__":
  main()
