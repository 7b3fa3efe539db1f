"""Resuming on another number of workers: the resize policies, measured.

For each task and seed: an uninterrupted run on ``N`` workers with a
checkpoint at mid-run, and from that checkpoint the rest of the run on
``N'`` workers under each policy of :mod:`dlion_jax.elastic` (``mean``,
``all``, ``keep``), for the resizes 8 -> 4, 8 -> 2 and 4 -> 8 (the last
from an uninterrupted 4-worker run). The global batch is kept, so the
resumed run sees the same batches, split over ``N'`` workers. Reported: the
final test accuracy of every run against the uninterrupted one's, and the
training loss curves.

Usage::

  python -m benchmarks.elastic [--tasks quickstart fashion_mnist_mlp]
      [--seeds 0 1] [--json runs.json] [--out docs/training.md]
      [--plot docs/img/elastic.png]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import tempfile

from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax.bench import reporting

TASKS = {"quickstart": "quickstart", "fashion_mnist_mlp": "fashion_mnist_mlp"}
RESIZES = ((8, 4), (8, 2), (4, 8))


def _config(task: str, run_dir, workers: int, seed: int, steps_at: int):
  from dlion_jax.train import cli  # pylint: disable=g-import-not-at-top
  from dlion_jax.train.config import load_config  # pylint: disable=g-import-not-at-top
  return load_config(cli.resolve_config(TASKS[task]), [
      f"run_dir={run_dir}", f"workers={workers}", f"seed={seed}",
      f"train.checkpoint_every={steps_at}", "train.keep_checkpoints=10",
      "train.eval_every=0"])


def _train(cfg, **kwargs) -> dict:
  from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
  out = trainer.train(cfg, progress=False, log=lambda *_: None, **kwargs)
  summary = out["summary"]
  losses = [json.loads(line) for line in
            (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
  return {"accuracy": summary["test_accuracy"],
          "curve": [(r["step"], r["loss"]) for r in losses if "loss" in r]}


def _half(task: str) -> int:
  from dlion_jax.train import cli  # pylint: disable=g-import-not-at-top
  from dlion_jax.train.config import load_config  # pylint: disable=g-import-not-at-top
  return load_config(cli.resolve_config(TASKS[task])).train.steps // 2


def run(tasks, seeds, root: pathlib.Path) -> list[dict]:
  """Every run: task, seed, old and new workers (equal: uninterrupted),
  policy, final test accuracy and loss curve."""
  runs = []
  jobs = [(t, s) for t in tasks for s in seeds]
  for task, seed in bench.progress(jobs, len(jobs), "runs"):
    half = _half(task)
    for n in sorted({old for old, _ in RESIZES}):
      base = root / f"{task}-{seed}-{n}"
      result = _train(_config(task, base, n, seed, half))
      runs.append(dict(task=task, seed=seed, old=n, new=n, policy=None,
                       **result))
      for old, new in RESIZES:
        if old != n:
          continue
        for policy in elastic.RESIZE_POLICIES:
          resumed = root / f"{task}-{seed}-{old}-{new}-{policy}"
          shutil.copytree(base, resumed)
          (resumed / "summary.json").unlink()
          for step in (resumed / "checkpoints").iterdir():
            if step.name.isdigit() and int(step.name) > half:
              shutil.rmtree(step)
          result = _train(_config(task, resumed, new, seed, half),
                          resume=True, resize_policy=policy)
          runs.append(dict(task=task, seed=seed, old=old, new=new,
                           policy=policy, **result))
  return runs


def _baseline(runs, task, seed, old) -> float:
  return next(r["accuracy"] for r in runs if r["task"] == task
              and r["seed"] == seed and r["old"] == r["new"] == old)


def gaps(runs, task, old, new, policy) -> list[float]:
  """Per seed: the resized run's accuracy less the uninterrupted run's, in
  points."""
  return [100 * (r["accuracy"] - _baseline(runs, task, r["seed"], old))
          for r in runs if r["task"] == task and (r["old"], r["new"],
                                                  r["policy"]) ==
          (old, new, policy)]


def table(runs: list[dict], task: str) -> str:
  seeds = sorted({r["seed"] for r in runs if r["task"] == task})
  rows = []
  for old, new in RESIZES:
    base = [100 * _baseline(runs, task, s, old) for s in seeds]
    for policy in elastic.RESIZE_POLICIES:
      got = gaps(runs, task, old, new, policy)
      rows.append([f"{old} -> {new}", policy,
                   elastic.describe(old, new, policy),
                   f"{statistics.mean(base):.2f}",
                   " / ".join(f"{g:+.2f}" for g in got),
                   f"{statistics.mean(got):+.2f}"])
  return reporting.markdown_table(
      ["resize", "policy", "what it does",
       f"uninterrupted accuracy % (mean of seeds {seeds})",
       "resized - uninterrupted, points, per seed", "mean"], rows)


def plot(runs: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  tasks = sorted({r["task"] for r in runs})
  fig, axes = plt.subplots(len(tasks), len(RESIZES),
                           figsize=(4.2 * len(RESIZES), 3.2 * len(tasks)),
                           squeeze=False)
  seed = min(r["seed"] for r in runs)
  for i, task in enumerate(tasks):
    for j, (old, new) in enumerate(RESIZES):
      ax = axes[i][j]
      for r in runs:
        if r["task"] != task or r["seed"] != seed:
          continue
        if r["old"] == r["new"] == old:
          label, style = f"{old} workers throughout", "k-"
        elif (r["old"], r["new"]) == (old, new):
          label, style = f"resized, {r['policy']}", "--"
        else:
          continue
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, style, label=label, lw=1)
      ax.set_yscale("log")
      ax.set_title(f"{task}: {old} -> {new} workers at mid-run (seed {seed})",
                   fontsize=8)
      ax.set_xlabel("step")
      ax.set_ylabel("training loss")
      ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def report(runs: list[dict]) -> str:
  parts = []
  for task in sorted({r["task"] for r in runs}):
    parts += [f"#### {task}", "", table(runs, task), ""]
  return "\n".join(parts).strip()


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", nargs="+", default=list(TASKS),
                      choices=sorted(TASKS))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--json", help="also write every run here")
  parser.add_argument("--out", help="also write the tables into this file "
                      "(between its bench.elastic markers)")
  parser.add_argument("--plot", help="write the loss curves here (PNG)")
  args = parser.parse_args(argv)
  bench.require_examples(parser, "dlion_jax.train.trainer", "the train CLI")
  devices.use_cpu_devices(8)
  with tempfile.TemporaryDirectory() as root:
    runs = run(args.tasks, args.seeds, pathlib.Path(root))
  reporting.write_json(args.json, runs, indent=1)
  if args.plot:
    plot(runs, args.plot)
  return reporting.write_section(report(runs), args.out, "bench.elastic")


if __name__ == "__main__":
  main()
