"""The whole training step over a shaped link: votes in buckets or one message.

``bucket_bytes`` splits D-Lion's message into buckets of leaves, each
exchanged on its own, so that a bucket's collectives can start while the
backward pass still computes the gradients of other leaves. Whether they
do is the compiler's and the runtime's business; this measures it on
XLA:CPU, end to end: ``N`` processes (one CPU device each, gloo over TCP)
in a network namespace whose loopback ``tc`` shapes to each ``--rates``
(the machinery of :mod:`benchmarks.network`, whose docstring says what the
shaped loopback is), each timing one jitted
:func:`dlion_jax.parallel.make_train_step` (forward, backward, vote and
update in one program, as users run it) per budget, interleaved round by
round. The model is :mod:`benchmarks.network`'s byte-level GPT.

Reported per rate and budget: the step's median (the slowest process's
time, each step), its ratio to one message's in the same rounds (median
of the per-round ratios, with quartiles), the bytes each worker sends (read
off the compiled step), the number of collectives and the time to lower
and compile the step (the slowest process's).

Usage::

  python -m benchmarks.overlap [--procs 2] [--rates 100mbit 1gbit none]
      [--budgets 0 8000000 2000000] [--params 8M] [--steps 8]
      [--json FILE] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

if __package__ in (None, ""):   # the workers, started by path
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import network  # noqa: E402  pylint: disable=wrong-import-position

AXIS = network.AXIS
LEARNING_RATE = network.LEARNING_RATES["dlion"]


def _label(budget: int | None) -> str:
  return "one message" if budget is None else f"buckets of {budget:,} B"


def worker(spec: dict) -> None:
  """One process: compiles a step per budget, times them interleaved."""
  w = network.lm_worker(spec)
  import dlion_jax as dl  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import models  # pylint: disable=g-import-not-at-top

  def loss_fn(params, batch):
    return models.lm_loss(models.apply(w.graphdef, params, batch["x"]),
                          batch["y"])

  first = w.to_global(next(w.batches))
  runs = []
  # A first compile carries one-time costs (the backend, the loss's
  # kernels); thrown away, so that every budget's compile time compares.
  _compiled_step(dl, parallel, loss_fn, w.mesh, w.params0, first,
                 spec["budgets"][0])
  for budget in spec["budgets"]:
    step, params, state, compiled, compile_s = _compiled_step(
        dl, parallel, loss_fn, w.mesh, w.params0, first, budget)
    runs.append({"budget": budget, "step": step, "params": params,
                 "state": state, "times": [], "compile_s": compile_s,
                 "sent": dl.collective_bytes(compiled),
                 "collectives": len(dl.hlo.collectives(compiled))})
  it = network.step_ticks(spec, len(runs))
  for r in range(spec["warmup"] + spec["steps"]):
    batch = w.to_global(next(w.batches))
    k = r % len(runs)
    for run in runs[k:] + runs[:k]:
      t0 = time.perf_counter()
      run["params"], run["state"], _ = run["step"](run["params"],
                                                   run["state"], batch)
      w.jax.block_until_ready((run["params"], run["state"]))
      run["times"].append(time.perf_counter() - t0)
      next(it, None)
  network.write_process_json(spec, {
      "process": w.jax.process_index(), "num_workers": w.jax.device_count(),
      "num_params": models.count_params(w.params0),
      "runs": [{k: v for k, v in run.items()
                if k in ("budget", "times", "sent", "collectives",
                         "compile_s")}
               for run in runs]})


def _compiled_step(dl, parallel, loss_fn, mesh, params0, batch, budget):
  """(step, params, state, compiled step, seconds to lower and compile)."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  tx = dl.distributed_lion(LEARNING_RATE, axis_name=AXIS,
                           bucket_bytes=budget)
  params = dl.devices.global_array(params0, NamedSharding(mesh, P()))
  state = parallel.init_worker_states(tx, params, mesh, axis_name=AXIS)
  step = parallel.make_train_step(loss_fn, tx, mesh, axis_name=AXIS)
  tic = time.perf_counter()
  compiled = step.lower(params, state, batch).compile()
  return step, params, state, compiled, time.perf_counter() - tic


def merge(results: list[dict], warmup: int) -> list[dict]:
  """Per budget: each step's time as the slowest process saw it, the
  median, and the per-round ratios to the first budget's (one message)."""
  per_step = []
  for k, run in enumerate(results[0]["runs"]):
    steps = list(zip(*(r["runs"][k]["times"][warmup:] for r in results)))
    per_step.append([max(s) for s in steps])
  merged = []
  for k, (run, times) in enumerate(zip(results[0]["runs"], per_step)):
    ratios = [t / t0 for t, t0 in zip(times, per_step[0])]
    merged.append(dict(budget=run["budget"], sent=run["sent"],
                       collectives=run["collectives"],
                       compile_s=max(r["runs"][k]["compile_s"]
                                     for r in results),
                       median_s=statistics.median(times), ratios=ratios))
  return merged


def run_config(procs: int, rate: str, spec: dict, *, shaped: bool,
               timeout: float) -> dict:
  """Launches ``procs`` workers (in a shaped namespace when ``shaped``)."""
  results = network.launch_workers(__file__, procs, rate, spec,
                                   shaped=shaped, timeout=timeout)
  return {"procs": procs, "rate": rate, "num_params":
          results[0]["num_params"], "runs": merge(results, spec["warmup"])}


def _quartiles(xs: list[float]) -> str:
  q = (statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1
       else [xs[0]] * 3)
  return f"{statistics.median(xs):.3f} ({q[0]:.3f}-{q[2]:.3f})"


def report(configs: list[dict], spec: dict, notes: list[str]) -> str:
  from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
  rows = []
  for c in configs:
    for run in c["runs"]:
      rows.append([c["procs"], c["rate"], _label(run["budget"]),
                   run["collectives"], f"{run['sent']:,.0f}",
                   f"{run['compile_s']:.1f}",
                   f"{run['median_s'] * 1e3:.1f}", _quartiles(run["ratios"])])
  size = spec["size"]
  return "\n".join([
      f"Byte-level GPT dim {size['dim']}, depth {size['depth']}, heads "
      f"{size['heads']}: {configs[0]['num_params']:,} parameters; "
      f"{size['batch']} sequences of {size['seq_len']} bytes a worker. "
      f"{spec['steps']} rounds after {spec['warmup']} warm-up, budgets "
      "interleaved (rotating order) in each round.",
      "",
      reporting.markdown_table(
          ["procs", "rate", "D-Lion's message", "collectives",
           "bytes sent / worker", "compile s", "step ms (median)",
           "step / one message's, per round: median (quartiles)"], rows),
      "",
      *[f"- {note}" for note in notes]])


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--procs", type=int, nargs="+", default=[2])
  parser.add_argument("--rates", nargs="+",
                      default=["100mbit", "1gbit", "none"])
  parser.add_argument("--budgets", type=int, nargs="+",
                      default=[0, 8_000_000, 2_000_000],
                      help="bucket_bytes of each timed step; 0 is one "
                      "message (always timed, first)")
  parser.add_argument("--params", default="8M", choices=list(network.PRESETS))
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--text", default=network.TEXT)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--json", default=None)
  parser.add_argument("--out", default=None)
  parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None) -> str:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(pathlib.Path(args.worker).read_text()))
    return ""
  budgets = [None] + [b for b in args.budgets if b]
  spec = {"size": dataclasses.asdict(network.PRESETS[args.params]),
          "text": args.text, "steps": args.steps, "warmup": args.warmup,
          "seed": args.seed, "init_timeout": 120, "budgets": budgets}
  rates, shaped, notes = network.plan(args)
  configs = []
  for procs in args.procs:
    for rate in rates:
      t = time.perf_counter()
      configs.append(run_config(procs, rate, spec, shaped=shaped,
                                timeout=args.timeout))
      notes.append(f"{procs} procs, {rate}: {time.perf_counter() - t:.0f} s")
  if args.json:
    from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
    reporting.write_json(args.json, {"configs": configs, "spec": spec,
                                     "notes": notes}, indent=1)
  text = report(configs, spec, notes)
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text + "\n")
  return text


if __name__ == "__main__":
  main()
