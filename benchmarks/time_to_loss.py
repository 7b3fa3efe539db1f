"""Time to a target loss over a shaped link: local steps with an outer vote
against voting every step, DiLoCo's outer step and global Lion.

``N`` processes of the train CLI (one CPU device each, started by
``python -m dlion_jax.launch``) train the quickstart (scikit-learn's digits;
by default an MLP of two hidden layers of 256, 85,002 parameters, so that
the exchange is a good part of a step) inside a private network namespace whose
loopback is shaped to the rate with ``tc ... tbf``
(:func:`benchmarks.network.namespace`; needs root), so every exchange
crosses the shaped link. Rows:

* ``D-Lion every step``: Distributed Lion, a vote every step;
* ``D-Lion outer, H=...``: Lion alone on each worker, every ``H`` steps an
  outer Distributed Lion vote (``optimizer.local_steps``);
* ``DiLoCo outer, H=...``: the same with DiLoCo's Nesterov step on the
  fp32 mean (``optimizer.outer=nesterov``);
* ``EF vote, H=...`` and ``EF vote, late, H=...``: the error-fed voted
  mean (``optimizer.outer=voted``), on time and one round late;
* ``global Lion``: ``optax.lion`` on the fp32 all-reduced gradient.

The CLI reads the loss every step, so a log interval's wall time holds
each step's exchange; a row's training time is the sum of the intervals
(start-up and compilation left out). Its time to the target is that time at
the first log step where the mean of the last three logged losses is at
most the target; the target is the highest final such mean of the rows, so
every row reaches it. The loss is each worker's on its batch before the
step (with local steps, at its own params within a round, not the anchor's).
The final test accuracy is the model's (the anchor with local steps).

Usage::

  python -m benchmarks.time_to_loss [--procs 2 4] [--rates 10mbit 100mbit]
      [--steps 160] [--every 16] [--set model.hidden=[256,256] ...]
      [--json FILE] [--out docs/training.md] [--plot FILE.png]
      [--rows 'EF vote, H=16' 'EF vote, late, H=16']
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import network
from dlion_jax import bench
from dlion_jax.bench import reporting

MARKER = "bench.time_to_loss"
SMOOTH = 3                       # logged losses averaged


def rows(every: int) -> dict[str, list[str]]:
  """Each row's CLI overrides."""
  local = [f"optimizer.local_steps={every}"]
  voted = local + ["optimizer.outer=voted"]
  return {"D-Lion every step": [],
          f"D-Lion outer, H={every}": local + ["optimizer.outer=dlion"],
          f"DiLoCo outer, H={every}": local + ["optimizer.outer=nesterov"],
          f"EF vote, H={every}": voted,
          f"EF vote, late, H={every}": voted + ["optimizer.outer_late=true"],
          "global Lion": ["optimizer.name=lion"]}


def command(procs: int, run_dir: pathlib.Path, steps: int,
            overrides: list[str]) -> list[str]:
  """The launcher's command line for one row (``overrides`` last)."""
  sets = [f"workers={procs}", f"run_dir={run_dir}", f"train.steps={steps}",
          "train.log_every=10", "train.eval_every=0",
          "train.checkpoint_every=0", *overrides]
  return [sys.executable, "-m", "dlion_jax.launch", "-n", str(procs),
          "--timeout", "1800", "--", sys.executable, "-m", "dlion_jax.train",
          "--no-progress", "--overwrite", "--init-timeout", "120",
          *[a for s in sets for a in ("--set", s)]]


def read_run(run_dir: pathlib.Path) -> dict:
  """The curve ``[(step, seconds of training so far, smoothed loss)]``, the
  final test accuracy and the bits a step sent, from a run directory."""
  config = json.loads((run_dir / "config.json").read_text())
  global_batch = config["data"]["global_batch"]
  logs = [json.loads(line) for line in
          (run_dir / "metrics.jsonl").read_text().splitlines()]
  logs = [r for r in logs if "examples_per_s" in r]
  curve, seconds, last = [], 0.0, 0
  for i, r in enumerate(logs):
    seconds += (r["step"] - last) * global_batch / r["examples_per_s"]
    last = r["step"]
    window = [x["loss"] for x in logs[max(0, i + 1 - SMOOTH):i + 1]]
    curve.append((r["step"], seconds, sum(window) / len(window)))
  summary = json.loads((run_dir / "summary.json").read_text())
  return {"curve": curve, "accuracy": summary["test_accuracy"],
          "bits": summary["sent_bits_per_param"]}


def time_to(curve, target: float) -> tuple[int, float] | None:
  """(step, seconds) of the first point at or below ``target``."""
  return next(((s, t) for s, t, loss in curve if loss <= target), None)


def measure(procs: int, rate: str, steps: int, every: int, root,
            common: list[str], only=None) -> dict:
  """Every row (of ``only``, where given; global Lion always) on ``procs``
  processes over a link shaped to ``rate``, each with the ``common``
  overrides."""
  out = {}
  with network.namespace(rate) as inside:
    for name, overrides in rows(every).items():
      if only and name not in only and name != "global Lion":
        continue
      run_dir = pathlib.Path(root) / f"{procs}-{rate}-{len(out)}"
      done = subprocess.run(inside + command(procs, run_dir, steps,
                                             common + overrides),
                            capture_output=True, text=True, check=False)
      if done.returncode:
        raise RuntimeError(f"{name} on {procs} processes at {rate} exited "
                           f"{done.returncode}:\n{done.stderr[-3000:]}")
      out[name] = read_run(run_dir)
  return out


def report(results: list[dict]) -> str:
  """A table per (processes, rate): time to the target, the speedup over
  global Lion, bits sent a step and the final accuracy."""
  parts = []
  for r in results:
    runs = r["rows"]
    target = max(run["curve"][-1][2] for run in runs.values())
    base = time_to(runs["global Lion"]["curve"], target)
    table = []
    for name, run in runs.items():
      hit = time_to(run["curve"], target)
      table.append([name, f"{run['bits']:.3f}", f"{hit[1]:.2f}",
                    str(hit[0]), f"{base[1] / hit[1]:.1f}x",
                    f"{run['curve'][-1][1]:.2f}",
                    f"{100 * run['accuracy']:.2f}"])
    parts.append(
        f"{r['procs']} processes, {r['rate']} (target loss {target:.4f}):"
        "\n\n" + reporting.markdown_table(
            ["row", "bits/param/step", "s to target", "step", "vs global "
             "Lion", f"s for {r['steps']} steps", "test accuracy %"], table))
  return "\n\n".join(parts)


def plot(results: list[dict], path: str) -> None:
  """Loss against training time, a panel per (processes, rate)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6),
                           squeeze=False)
  for ax, r in zip(axes[0], results):
    for name, run in r["rows"].items():
      _, t, loss = zip(*run["curve"])
      ax.plot(t, loss, label=name)
    ax.set(xscale="log", yscale="log", xlabel="training seconds",
           ylabel="loss (mean of 3 logs)",
           title=f"{r['procs']} processes, {r['rate']}")
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_loss",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--rates", nargs="+", default=["10mbit", "100mbit"])
  parser.add_argument("--steps", type=int, default=160)
  parser.add_argument("--every", type=int, default=16,
                      help="H, the steps of a round of the local-steps rows")
  parser.add_argument("--set", dest="common", action="append",
                      default=None, metavar="KEY=VALUE",
                      help="a config override for every row (default: "
                      "model.hidden=[256,256])")
  parser.add_argument("--json", help="write the runs here")
  parser.add_argument("--from-json", help="report the runs of this file")
  parser.add_argument("--out", help="write the report here (between its "
                      f"<!-- {MARKER} --> markers, if it has them)")
  parser.add_argument("--plot", help="loss against time, as a PNG")
  parser.add_argument("--rows", nargs="+", metavar="ROW",
                      help="only these rows (and global Lion, the "
                      "baseline), e.g. 'EF vote, H=16'")
  args = parser.parse_args(argv)
  if args.from_json:
    results = json.loads(pathlib.Path(args.from_json).read_text())
  else:
    why = network.can_shape()
    if why:
      parser.error(f"shaping the link {why}")
    common = args.common or ["model.hidden=[256,256]"]
    jobs = [(p, r) for p in args.procs for r in args.rates]
    results = []
    with tempfile.TemporaryDirectory() as root:
      for procs, rate in bench.progress(jobs, len(jobs), "links"):
        results.append({"procs": procs, "rate": rate, "steps": args.steps,
                        "rows": measure(procs, rate, args.steps, args.every,
                                        root, common, args.rows)})
    reporting.write_json(args.json, results, indent=1)
  if args.plot:
    plot(results, args.plot)
  return reporting.write_section(report(results), args.out, MARKER)


if __name__ == "__main__":
  main()
