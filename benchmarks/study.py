"""What the training studies share: tasks, one training run, saved runs.

:mod:`benchmarks.lioncub` and :mod:`benchmarks.convergence` train a
shipped config (``configs/*.yaml``) many times with overrides and report the
test metric against what was sent. A :class:`Task` fixes the config, the
metric and the run length; :func:`train` runs one (overrides, N, seed).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import pathlib
import statistics
import sys
import sysconfig
import tempfile
import time
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Task:
  """A training task: a shipped config, its metric and its length."""
  config: str
  metric: str                # key of the trainer's summary
  higher_is_better: bool
  epochs: float | None       # None: fixed ``steps``
  steps: int = 0
  overrides: tuple = ()
  train_size: int = 60_000
  local_batch: int = 32      # examples (sequences for the LM) per worker
  # Limits for tasks too slow to run every combination (None: no limit).
  only_workers: tuple | None = None
  max_seeds: int | None = None
  only_variants: tuple | None = None
  curve_points: int = 0      # test evaluations in a run (0: at the end)
  text: Callable[[], str] | None = None   # makes the file data.path names

  @property
  def scale(self) -> int:
    """100 for accuracies (reported in %), else 1."""
    return 100 if self.metric == "test_accuracy" else 1

  @property
  def unit(self) -> str:
    return "accuracy %" if self.scale == 100 else "bits/byte"

  def jobs(self, workers, variants, seeds) -> list[tuple[str, int, int]]:
    """The (variant, N, seed) runs of this task among those asked for."""
    workers = [n for n in workers
               if self.only_workers is None or n in self.only_workers]
    variants = [v for v in variants
                if self.only_variants is None or v in self.only_variants]
    seeds = list(seeds)[:self.max_seeds]
    return [(v, n, s) for n in workers for v in variants for s in seeds]

  def overrides_for(self, workers: int, seed: int) -> list[str]:
    """A fixed local batch: the global batch and the step count follow N."""
    batch = self.local_batch * workers
    steps = (self.steps if self.epochs is None
             else max(1, round(self.epochs * self.train_size / batch)))
    return [f"workers={workers}", f"seed={seed}",
            f"data.global_batch={batch}", f"train.steps={steps}",
            f"optimizer.warmup_steps={max(1, steps // 7)}",
            f"train.eval_every={max(1, steps // (self.curve_points or 1))}",
            f"train.checkpoint_every={steps}",
            f"train.log_every={steps}", *self.overrides,
            *([f"data.path={self.text()}"] if self.text else [])]


def python_stdlib_text() -> str:
  """A file of this Python's top-level standard-library modules, sorted by
  name and concatenated (4.7 MB on Python 3.11): text every machine that
  runs the study has, large enough that a long LM run does not memorize it.
  Built once in the temp directory; returns its path."""
  stdlib = sysconfig.get_paths()["stdlib"]
  path = os.path.join(tempfile.gettempdir(), "dlion_jax_stdlib_py"
                      f"{sys.version_info[0]}{sys.version_info[1]}.txt")
  if not os.path.exists(path):
    with open(path + ".part", "wb") as out:
      for name in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(name, "rb") as f:
          out.write(f.read())
    os.replace(path + ".part", path)
  return path


def text_id(path: str) -> str:
  """What identifies a text: its size and SHA-256 (the stdlib differs
  between Python versions and installs, down to its install paths)."""
  with open(path, "rb") as f:
    data = f.read()
  return f"{len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()}"


def settings(overrides: dict) -> list[str]:
  """``{'optimizer.name': 'lion'}`` -> ``['optimizer.name="lion"']``."""
  return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def train(task: Task, overrides: dict, workers: int, seed: int) -> dict:
  """Trains ``task`` once; returns its metric, the bits sent and the time.

  ``metric`` is the task's summary value (bits per byte for the LM: the
  test loss over ln 2), or the worst value (-inf / +inf) when the run
  diverged (``diverged`` is then True); ``bits`` is what each worker sent
  per parameter per step, read off the compiled train step.
  """
  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import cli
  from dlion_jax.train import trainer
  from dlion_jax.train.config import load_config
  with tempfile.TemporaryDirectory() as run_dir:
    cfg = load_config(cli.resolve_config(task.config),
                      task.overrides_for(workers, seed) + settings(overrides)
                      + [f"run_dir={run_dir}"])
    start = time.perf_counter()
    try:
      summary = trainer.train(cfg, progress=False, log=lambda *_: None)[
          "summary"]
    except FloatingPointError:     # the loss became NaN or Inf
      summary = {"test_loss": math.nan, "sent_bits_per_param": math.nan}
    seconds = time.perf_counter() - start
    curve = [[r["step"], _metric(task, r)] for r in _history(run_dir)
             if "test_loss" in r]
  value = _metric(task, summary)
  if not math.isfinite(value):   # a diverged run ranks last, not first
    value = -math.inf if task.higher_is_better else math.inf
  text = {"text": text_id(cfg.data.path)} if task.text else {}
  return {**text, "workers": workers, "seed": seed, "metric": value,
          "bits": summary["sent_bits_per_param"], "steps": cfg.train.steps,
          "seconds": seconds, "diverged": not math.isfinite(value),
          "curve": curve if curve and curve[-1][0] == cfg.train.steps
          else [*curve, [cfg.train.steps, value]]}


def _metric(task: Task, record: dict) -> float:
  """The task's metric in a summary or an evaluation record."""
  return record[task.metric] if task.metric in record else (
      record["test_loss"] / math.log(2))


def _history(run_dir: str) -> list[dict]:
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  return ([json.loads(line) for line in path.read_text().splitlines()]
          if path.is_file() else [])


def mean_spread(values) -> tuple[float, float]:
  """Mean and half the range (the spread over a handful of seeds)."""
  values = list(values)
  return statistics.fmean(values), (max(values) - min(values)) / 2


def load_runs(paths) -> list[dict]:
  """Runs saved as JSON lists (``--json``), concatenated."""
  runs = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      runs += json.load(f)
  return runs
