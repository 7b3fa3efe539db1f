"""Which Lion Cub options close the gap to global Lion, and what they cost.

Trains the same task with every variant (global Lion with an fp32 gradient
all-reduce, Distributed Lion MaVo/Avg, and Lion Cub's quantizers, momentum
syncs, exact small leaves and error feedback on top) for each worker count
and seed, all with the task's schedule and a local batch of 32, and reports
the test metric against the bits each worker sent per parameter per step,
read off the compiled train step (:func:`dlion_jax.collective_bytes`, syncs
counted at the rate their schedule runs them).

Tasks: ``fashion_mnist`` (the 784-256-256-10 MLP of
``configs/fashion_mnist_mlp.yaml``, 3 epochs, test accuracy) and ``charlm``
(the byte-level GPT of ``configs/charlm_gpt.yaml``, shortened, test bits per
byte); ``digits`` is a seconds-long smoke version for tests.

``--step-cost`` instead times one optimizer step (no model) of each
option on the GPT's parameter pytree (many small leaves: norms, biases) and
reads its bytes off the HLO, which is how the default ``min_compress_size``
was chosen.

Usage::

  python -m benchmarks.lioncub [--tasks fashion_mnist charlm]
      [--workers 8 16] [--seeds 0 1] [--out docs/lioncub.md]
      [--plot docs/img/lioncub.png]
  python -m benchmarks.lioncub --step-cost [--workers 8] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import study
from benchmarks.study import Task
from dlion_jax import bench
from dlion_jax import devices
from dlion_jax.bench import reporting

AVG = {"optimizer.aggregation": "avg"}
PBIT4 = {"optimizer.quantizer": "pbit_l1", "optimizer.bits": 4}
TERNARY = {"optimizer.quantizer": "ternary_l1"}
GROWING = {"optimizer.momentum_sync": 4, "optimizer.sync_schedule": "growing"}

# name -> config overrides on top of the task's D-Lion config.
VARIANTS = {
    "global Lion (fp32 all-reduce)": {"optimizer.name": "lion"},
    "D-Lion MaVo": {},
    "D-Lion Avg": AVG,
    "MaVo, ternary_l1": TERNARY,
    "Avg, ternary_l1": {**AVG, **TERNARY},
    "MaVo, 4-bit": PBIT4,
    "Avg, 4-bit": {**AVG, **PBIT4},
    "MaVo + sync every 10": {"optimizer.momentum_sync": 10},
    "MaVo + sync growing (k=4)": GROWING,
    "MaVo + bias momenta synced every step": {
        "optimizer.momentum_sync": 1, "optimizer.sync_leaves": "bias"},
    "MaVo + exact leaves < 1024": {"optimizer.min_compress_size": 1024},
    "MaVo + error feedback": {"optimizer.error_feedback": True},
    "Avg, 4-bit + sync growing (k=4)": {**AVG, **PBIT4, **GROWING},
}
BASELINE = "global Lion (fp32 all-reduce)"

TASKS = {
    "fashion_mnist": Task("fashion_mnist_mlp", "test_accuracy", True,
                          epochs=3),
    # About 3.3 min a run here: N = 8, one seed, the telling variants.
    "charlm": Task("charlm_gpt", "test_bits_per_byte", False, epochs=None,
                   steps=300, local_batch=8, only_workers=(8,), max_seeds=1,
                   only_variants=(
                       BASELINE, "D-Lion MaVo", "D-Lion Avg",
                       "MaVo, ternary_l1", "MaVo, 4-bit",
                       "MaVo + sync growing (k=4)",
                       "MaVo + bias momenta synced every step",
                       "MaVo + exact leaves < 1024")),
    "digits": Task("quickstart", "test_accuracy", True, epochs=None, steps=40,
                   overrides=("model.hidden=[32]",)),
}


def run_one(task: Task, variant: str, workers: int, seed: int) -> dict:
  """Trains one (variant, N, seed); returns its metric and bits sent."""
  return {"variant": variant,
          **study.train(task, VARIANTS[variant], workers, seed)}


def summarize(results: list[dict], task: Task, workers: list[int],
              variants: list[str]) -> str:
  """Markdown table: metric (mean +- half-range over seeds) and bits."""
  scale, unit = task.scale, task.unit
  headers = ["variant"]
  for n in workers:
    headers += [f"N={n}: test {unit}", f"N={n}: vs global Lion",
                f"N={n}: bits/param/step"]
  rows = []
  for variant in variants:
    row = [variant]
    for n in workers:
      mine = [r for r in results if r["variant"] == variant
              and r["workers"] == n]
      base = [r["metric"] for r in results if r["variant"] == BASELINE
              and r["workers"] == n]
      if not mine:
        row += ["-", "-", "-"]
        continue
      mean, spread = study.mean_spread([r["metric"] * scale for r in mine])
      gap = (f"{mean - statistics.fmean(base) * scale:+.2f}" if base
             else "-")
      row += [f"{mean:.2f} ± {spread:.2f}", gap,
              f"{statistics.fmean(r['bits'] for r in mine):.2f}"]
    rows.append(row)
  return reporting.markdown_table(headers, rows)


def _points(results, variant, workers, scale):
  mine = [r for r in results if r["variant"] == variant
          and r["workers"] == workers]
  if not mine:
    return None
  mean, spread = study.mean_spread([r["metric"] * scale for r in mine])
  return statistics.fmean(r["bits"] for r in mine), mean, spread


def plot(results: list[dict], task: Task, workers: list[int], path: str):
  """Metric against bits sent (log scale), one panel per worker count.

  Variants far worse than global Lion would squash the others into a line:
  they are drawn on the panel's edge with their value written beside.
  """
  # pylint: disable=g-import-not-at-top
  import matplotlib
  from matplotlib import ticker
  from matplotlib.figure import Figure
  scale = task.scale
  worse = -1 if task.higher_is_better else 1
  far = 3.0 if scale == 100 else 0.3      # accuracy points / bits per byte
  fig = Figure(figsize=(5.5 * len(workers) + 3.5, 4.8), layout="constrained")
  axes = fig.subplots(1, len(workers), squeeze=False)[0]
  variants = list(dict.fromkeys(r["variant"] for r in results))
  colors = [matplotlib.colormaps["tab20"](i % 20)
            for i in range(len(variants))]
  markers = "os^vD<>phX*P8d"
  for ax, n in zip(axes, workers):
    points = {v: _points(results, v, n, scale) for v in variants}
    base = points.get(BASELINE)
    edge = None
    if base is not None:
      close = [p[1] for p in points.values()
               if p and abs(p[1] - base[1]) <= far]
      edge = min(close) - far / 10 if worse < 0 else max(close) + far / 10
    for i, variant in enumerate(variants):
      if points[variant] is None:
        continue
      bits, mean, spread = points[variant]
      style = dict(color=colors[i], label=variant)
      if edge is not None and (mean - edge) * worse > 0:
        ax.plot(bits, edge, marker="v" if worse < 0 else "^", ms=9, **style)
        ax.annotate(f"{mean:.1f}", (bits, edge), textcoords="offset points",
                    xytext=(6, 4), fontsize=8, color=colors[i])
        continue
      ax.errorbar(bits, mean, yerr=spread, fmt=markers[i % len(markers)],
                  capsize=3, **style)
    if edge is not None:
      low, high = ax.get_ylim()
      ax.set_ylim(*((edge - far / 15, high) if worse < 0
                    else (low, edge + far / 15)))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.FixedLocator([1, 2, 4, 8, 16, 32, 64]))
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set(xlabel="bits sent per parameter per step (each worker)",
           ylabel="test accuracy %" if scale == 100 else "test bits/byte",
           title=f"{task.config}, N = {n} workers")
    ax.grid(True, which="both", alpha=0.3)
  by_label = dict(zip(*reversed(axes[0].get_legend_handles_labels())))
  labels = [v for v in variants if v in by_label]
  fig.legend([by_label[v] for v in labels], labels,
             loc="outside right center", fontsize=8)
  fig.savefig(path, dpi=110)


# name -> options of dl.distributed_lion, for --step-cost.
STEP_VARIANTS = {
    "MaVo (min_compress_size=0)": {},
    "MaVo, min_compress_size=256": {"min_compress_size": 256},
    "MaVo, min_compress_size=1024": {"min_compress_size": 1024},
    "MaVo, min_compress_size=4096": {"min_compress_size": 4096},
    "MaVo, ternary_l1": {"quantizer": "ternary_l1"},
    "Avg, 4-bit": {"aggregation": "avg", "quantizer": "pbit_l1", "bits": 4},
    "MaVo + error feedback": {"error_feedback": True},
    "MaVo + sync every step": {"momentum_sync": 1},
}


def gpt_shapes(dim: int = 256, depth: int = 6) -> dict:
  """Parameter shapes of the byte-level GPT (``train.models``)."""
  # pylint: disable=g-import-not-at-top
  import jax
  from flax import nnx
  from dlion_jax.train import models
  model = nnx.eval_shape(lambda: models.build_model(
      "gpt", rngs=nnx.Rngs(0), vocab_size=256, context=128, dim=dim,
      depth=depth, heads=4))
  return jax.tree.map(lambda x: tuple(x.shape),
                      models.split_params(model)[1])


def step_cost(workers: int, reps: int, *, dim: int = 256,
              depth: int = 6) -> str:
  """Median optimizer-step time and HLO bytes of each Lion Cub option."""
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import dlion_jax as dl
  from dlion_jax.bench import step as step_bench
  shapes = gpt_shapes(dim, depth)
  rng = np.random.default_rng(0)
  is_shape = lambda x: isinstance(x, tuple)
  params = jax.tree.map(lambda s: rng.standard_normal(s, np.float32), shapes,
                        is_leaf=is_shape)
  mesh = devices.data_mesh(workers, axis_name=step_bench.AXIS)
  grads = jax.device_put(
      jax.tree.map(lambda s: rng.standard_normal((workers,) + s, np.float32),
                   shapes, is_leaf=is_shape),
      NamedSharding(mesh, P(step_bench.AXIS)))
  runners = {}
  for name, options in STEP_VARIANTS.items():
    tx = dl.distributed_lion(1e-4, axis_name=step_bench.AXIS, **options)
    runners[name] = step_bench.Runner(tx, mesh, pmean_grads=False,
                                      params=params, grads=grads)
    runners[name]()
    runners[name]()
  step_bench.time_interleaved(runners, reps)
  leaves = jax.tree.leaves(params)
  size = sum(x.size for x in leaves)
  base = statistics.median(runners["MaVo (min_compress_size=0)"].times)
  rows = []
  for name, runner in runners.items():
    hlo = runner.hlo_text()
    every = dl.collective_bytes(hlo, conditional=False)
    cond = dl.collective_bytes(hlo) - every
    ms = statistics.median(runner.times)
    rows.append([name, f"{ms * 1e3:.1f}", f"{ms / base:.2f}x",
                 f"{8 * every / size:.3f}",
                 f"{8 * cond / size:.1f}" if cond else "-"])
  small = [x.size for x in leaves]
  head = (f"GPT pytree: {size:,} parameters in {len(leaves)} leaves "
          f"({sum(s < 1024 for s in small)} under 1024 elements, "
          f"{sum(s for s in small if s < 1024):,} parameters); {workers} "
          f"workers; median of {reps} interleaved steps.")
  return head + "\n\n" + reporting.markdown_table(
      ["option", "median ms/step", "vs min_compress_size=0",
       "bits/param/step (every step)", "+ bits/param on a sync step"], rows)


def write_report(text: str, path: str | None, section: str) -> str:
  """Prints ``text`` and writes it into ``path``'s ``section`` (between the
  ``<!-- bench.lioncub SECTION: begin/end -->`` markers)."""
  return reporting.write_section(text, path, f"bench.lioncub {section}")


def report(results: list[dict], args, heading: str) -> str:
  """The tables (and plots) of every task in ``results``."""
  parts = [heading]
  for t in dict.fromkeys(r["task"] for r in results):
    mine = [r for r in results if r["task"] == t]
    workers = sorted({r["workers"] for r in mine})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in mine)]
    parts.append(f"#### {t} ({TASKS[t].config}, {TASKS[t].metric})\n\n"
                 + summarize(mine, TASKS[t], workers, variants))
    if args.plot:
      plot(mine, TASKS[t], workers, f"{args.plot}_{t}.png")
  return "\n\n".join(parts)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", nargs="+", default=["fashion_mnist",
                                                     "charlm"],
                      choices=sorted(TASKS))
  parser.add_argument("--workers", nargs="+", type=int, default=[8, 16])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                      choices=list(VARIANTS), metavar="VARIANT")
  parser.add_argument("--out", help="write the markdown report here")
  parser.add_argument("--plot", help="PNG path prefix (one per task)")
  parser.add_argument("--json", help="write every run's figures here")
  parser.add_argument("--from-json", nargs="+", metavar="FILE",
                      help="report runs saved by --json instead of training")
  parser.add_argument("--step-cost", action="store_true",
                      help="time one optimizer step of each option instead")
  parser.add_argument("--reps", type=int, default=15)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  if args.from_json:
    results = study.load_runs(args.from_json)
    return write_report(report(results, args, (
        f"Runs read from {', '.join(args.from_json)} "
        f"({len(results)} runs, {sum(r['seconds'] for r in results) / 60:.0f}"
        " min of training).")), args.out, "study")
  devices.use_cpu_devices(max(args.workers))
  if args.step_cost:
    text = step_cost(max(args.workers), args.reps)
    return write_report(
        f"Measured with `python -m benchmarks.lioncub --step-cost "
        f"--workers {max(args.workers)} --reps {args.reps}` on "
        f"{bench.machine_line()} in {time.perf_counter() - start:.0f} s. "
        + text, args.out, "step-cost")
  jobs = [(t, *job) for t in args.tasks for job in TASKS[t].jobs(
      args.workers, args.variants, args.seeds)]
  results = []
  for t, v, n, s in bench.progress(jobs, len(jobs), "lioncub runs"):
    results.append({"task": t, **run_one(TASKS[t], v, n, s)})
    reporting.write_json(args.json, results, indent=1)
  return write_report(report(results, args, (
      f"Measured with `python -m benchmarks.lioncub --tasks "
      f"{' '.join(args.tasks)} --workers {' '.join(map(str, args.workers))} "
      f"--seeds {' '.join(map(str, args.seeds))}` on {bench.machine_line()}: "
      f"{len(jobs)} runs in {(time.perf_counter() - start) / 60:.1f} min.")),
      args.out, "study")


if __name__ == "__main__":
  main()
