"""Faulty and hostile workers: what f of 8 do to each aggregation.

``f`` of the 8 workers send faulty gradients (:mod:`dlion_jax.train.faults`:
sign-flipped, random, scaled by 1e6, or NaN on half the steps) into D-Lion
MaVo and Avg (``abstain_nonfinite=True``), global Lion and AdamW (fp32
all-reduce), and local steps at H = 32 with DiLoCo's Nesterov outer step,
the 1-bit outer vote or the voted mean ("EF vote", ``dl.rounds.voted_outer``,
the CLI's default, with ``abstain_nonfinite=True``); "outer_scale" scales
what a faulty worker sends the outer step (its pseudo-gradient, so the
voted mean's scale) by 1e6 instead. Each row runs at the settings the
convergence study tuned at f = 0 (``docs/data``: ``convergence.json``,
``local_steps.json``, ``cnn_local_steps.json``), at 2 seeds; "D-Lion
MaVo, no abstention" shows NaN votes counted as votes, "EF vote, H=32,
plain scale mean" the voted mean with ``scale_clip=None``.

Usage::

  python -m benchmarks.faults [--tasks mlp cnn] [--json docs/data/faults.json
      [--resume]] [--out docs/guides/faulty_workers.md]
      [--plot docs/img/faults.png]
  python -m benchmarks.faults --from-json docs/data/faults.json --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys

from benchmarks import convergence
from benchmarks import study
from dlion_jax import devices
from dlion_jax.bench import reporting

KINDS = ("sign_flip", "random", "scale", "nonfinite", "outer_scale")
# A kind -> the faults.* overrides that inject it: "outer_scale" scales
# what a faulty worker sends the outer step (its pseudo-gradient), the
# others its gradients.
INJECTED = {kind: {"faults.kind": kind} for kind in KINDS}
INJECTED["outer_scale"] = {"faults.kind": "scale",
                           "faults.on": "pseudo_gradients"}
FAULTY = (1, 2, 3)
WORKERS = 8
ROWS = ("D-Lion MaVo", "D-Lion Avg", "global Lion", "global AdamW",
        "DiLoCo outer, H=32", "D-Lion outer, H=32", "EF vote, H=32")
NO_ABSTENTION = "D-Lion MaVo, no abstention"
# The voted mean with its scales' plain mean (scale_clip=None), which one
# worker's huge scale moves; its own f = 0.
PLAIN_SCALES = "EF vote, H=32, plain scale mean"
EXTRA = (NO_ABSTENTION, PLAIN_SCALES)
# task -> (the convergence study's task, and where each row's tuned
# settings were saved: docs/data file, the study's task name).
TASKS = {
    "mlp": ("fashion_mnist_mlp", {
        "D-Lion Avg": ("convergence.json", "fashion_mnist_mlp"),
        None: ("local_steps.json", "mlp_local_steps")}),
    "cnn": ("fashion_mnist_cnn", {
        "D-Lion Avg": ("convergence.json", "fashion_mnist_cnn"),
        None: ("cnn_local_steps.json", "cnn_local_steps")}),
    # Seconds a run, untuned: the smoke version the tests run.
    "digits": ("digits", {}),
}
DATA = pathlib.Path(__file__).resolve().parents[1] / "docs" / "data"


def tuned(task: str, row: str) -> dict:
  """The config overrides of ``row`` at its f = 0 pick on ``task``."""
  sources = TASKS[task][1]
  if row == PLAIN_SCALES:
    return {**tuned(task, "EF vote, H=32"),
            "optimizer.outer_scale_clip": None}
  base = "D-Lion MaVo" if row == NO_ABSTENTION else row
  overrides = dict(convergence.ROWS[base])
  if sources:
    name, study_task = sources.get(row, sources[None])
    runs = json.loads((DATA / name).read_text())
    point = convergence.best_setting(runs, study_task, base)
    axes = convergence.TASKS[study_task].axes(base)
    overrides.update({axis.key: point[n] for n, axis in axes.items()})
  if row.startswith(("D-Lion", "EF vote")) and row != NO_ABSTENTION:
    overrides["optimizer.abstain_nonfinite"] = True
  return overrides


def rows_of(kind: str, rows=ROWS + EXTRA) -> tuple[str, ...]:
  """The rows of ``rows`` a fault applies to: "no abstention" NaN's only,
  a scaled pseudo-gradient the local steps' only (the plain scale mean
  that alone)."""
  if kind == "outer_scale":
    return tuple(r for r in rows if ", H=" in r)
  return tuple(r for r in rows if r not in EXTRA or (
      r == NO_ABSTENTION and kind == "nonfinite"))


def jobs(tasks, seeds, *, rows=ROWS + EXTRA, kinds=KINDS,
         faulty=(1, 3, 2)) -> list[dict]:
  """Every run of a task: f = 0 first, then a seed at a time every fault
  at f = 1, 3 and 2 (a study stopped early has the ends at one seed)."""
  out = []
  clean = [r for r in ROWS + (PLAIN_SCALES,) if r in rows or (
      r == ROWS[0] and NO_ABSTENTION in rows)]
  for task in tasks:
    for seed in seeds:
      out += [dict(task=task, row=row, kind="none", faulty=0, seed=seed)
              for row in clean]
    for seed in seeds:
      for f in faulty:
        for kind in kinds:
          out += [dict(task=task, row=row, kind=kind, faulty=f, seed=seed)
                  for row in rows_of(kind, rows)]
  return out


def _key(run) -> tuple:
  return tuple(run[k] for k in ("task", "row", "kind", "faulty", "seed"))


def run_all(tasks, seeds, json_path, runs, **which) -> list[dict]:
  done = {_key(r) for r in runs}
  todo = [j for j in jobs(tasks, seeds, **which) if _key(j) not in done]
  try:
    from tqdm import tqdm   # pylint: disable=g-import-not-at-top
    todo_iter = tqdm(todo, desc="fault study", unit="run")
  except ImportError:
    todo_iter = todo
  for job in todo_iter:
    conv_task = convergence.TASKS[TASKS[job["task"]][0]].task
    if job["task"] == "digits":
      conv_task = dataclasses.replace(conv_task, local_batch=8)
    overrides = tuned(job["task"], job["row"])
    if job["faulty"]:
      overrides.update({**INJECTED[job["kind"]],
                        "faults.workers": job["faulty"]})
    run = {**job, **study.train(conv_task, overrides, WORKERS, job["seed"])}
    run.pop("curve", None)
    runs.append(run)
    if json_path:
      reporting.write_json(json_path, runs, indent=1)
  return runs


def _cell(runs, task, row, kind, f) -> str:
  mine = [r for r in runs if (r["task"], r["row"], r["faulty"]) == (
      task, row, f) and (f == 0 or r["kind"] == kind)]
  if not mine:
    return ""
  if any(r["diverged"] for r in mine):
    good = sum(not r["diverged"] for r in mine)
    return f"diverged ({len(mine) - good}/{len(mine)})"
  values = [100 * r["metric"] for r in mine]
  mean, spread = study.mean_spread(values)
  return f"{mean:.2f} ± {spread:.2f}"


def table(runs, task: str) -> str:
  """Rows x (f = 0, each fault at f = 1, 2, 3): test accuracy %, mean
  ± half-range over seeds; a row no fault was run on left out."""
  lines = []
  for kind in KINDS:
    body = []
    for row in rows_of(kind):
      cells = [_cell(runs, task, row, kind, f) for f in FAULTY]
      if any(cells):
        body.append(f"| {row} | " + " | ".join([_cell(
            runs, task, ROWS[0] if row == NO_ABSTENTION else row, kind, 0),
                                               *cells]) + " |")
    if not body:
      continue
    head = ["row", "f = 0", *(f"f = {f}" for f in FAULTY)]
    lines += [f"**{task}, {kind.replace('_', ' ')}**", "",
              "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head), *body, ""]
  return "\n".join(lines)


def plot(runs, path: str) -> None:
  import matplotlib   # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt   # pylint: disable=g-import-not-at-top
  tasks = sorted({r["task"] for r in runs}, key=list(TASKS).index)
  colors = {row: f"C{i}" for i, row in enumerate(ROWS + EXTRA)}
  fig, axes = plt.subplots(len(tasks), len(KINDS), squeeze=False,
                           figsize=(4 * len(KINDS), 3.4 * len(tasks)))
  for i, task in enumerate(tasks):
    for j, kind in enumerate(KINDS):
      ax = axes[i][j]
      for row in rows_of(kind):
        xs, ys = [], []
        for f in (0, *FAULTY):
          base = ROWS[0] if (row == NO_ABSTENTION and f == 0) else row
          mine = [r for r in runs if (r["task"], r["row"], r["faulty"]) == (
              task, base, f) and (f == 0 or r["kind"] == kind)]
          if mine:
            xs.append(f)
            ys.append(statistics.fmean(
                10.0 if r["diverged"] else 100 * r["metric"] for r in mine))
        if len(xs) > 1:      # a fault run beside f = 0
          ax.plot(xs, ys, marker="o", label=row, color=colors[row],
                  linestyle="--" if row in EXTRA else "-")
      if not ax.lines:
        ax.set_axis_off()
      ax.set_title(f"{task}: {kind.replace('_', ' ')}")
      ax.set_xlabel("faulty workers of 8")
      ax.set_xticks([0, *FAULTY])
      if j == 0:
        ax.set_ylabel("test accuracy % (diverged: 10)")
  legend = {}    # every row's line, once
  for ax in axes.flat:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      legend.setdefault(label, handle)
  fig.legend(legend.values(), legend.keys(), loc="lower center",
             ncol=max(len(legend), 1), fontsize=8)
  fig.tight_layout(rect=(0, 0.05, 1, 1))
  fig.savefig(path, dpi=110)


def report(runs) -> str:
  tasks = sorted({r["task"] for r in runs}, key=list(TASKS).index)
  seconds = sum(r["seconds"] for r in runs)
  return "\n".join([
      f"{len(runs)} runs, {seconds / 3600:.1f} h of training on 2 CPU "
      "cores; test accuracy %, mean ± half the range over seeds "
      f"({sorted({r['seed'] for r in runs})}); 'diverged (k/n)': k of n "
      "seeds' loss became NaN or Inf.", "",
      *(table(runs, task) for task in tasks)])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", nargs="+", default=["mlp", "cnn"],
                      choices=list(TASKS))
  parser.add_argument("--rows", nargs="+", default=ROWS + EXTRA,
                      choices=ROWS + EXTRA)
  parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
  parser.add_argument("--faulty", nargs="+", type=int, default=[1, 3, 2],
                      choices=FAULTY, help="f: faulty workers of 8")
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
  parser.add_argument("--json", help="save every run here (after each run)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the runs saved in --json, run the rest")
  parser.add_argument("--from-json", metavar="FILE",
                      help="report saved runs, train nothing")
  parser.add_argument("--out", help="write the report into this markdown "
                      "file's 'bench.faults' section")
  parser.add_argument("--plot", help="write the PNG here")
  args = parser.parse_args(argv)
  if args.from_json:
    runs = json.loads(pathlib.Path(args.from_json).read_text())
  else:
    runs = (json.loads(pathlib.Path(args.json).read_text())
            if args.resume and args.json and pathlib.Path(args.json).exists()
            else [])
    devices.use_cpu_devices(WORKERS)
    runs = run_all(args.tasks, args.seeds, args.json, runs,
                   rows=tuple(args.rows), kinds=tuple(args.kinds),
                   faulty=tuple(args.faulty))
  text = report(runs)
  print(text)
  if args.out:
    reporting.write_section(text, args.out, "bench.faults")
  if args.plot:
    plot(runs, args.plot)
  if not all(math.isfinite(r["bits"]) or r["diverged"] for r in runs):
    sys.exit("a run sent a non-finite number of bits")


if __name__ == "__main__":
  main()
