"""Convergence against the papers' baselines, N simulated workers.

The shape of the Distributed Lion rebuttal table: rows SGD with momentum,
Signum (majority vote), Distributed Lion MaVo and Avg, global Lion and global
AdamW (both on fp32-all-reduced gradients); columns N workers, each with 32
examples per step (8 sequences for the LM), the same epochs and the same
warmup-then-cosine schedule for every row.

Learning rate and weight decay (and Lion's ``b2`` where a task asks) are
picked per row and task by one run per point at ``--tune-workers`` workers
with a seed that is not reported (``--tune-seed``): first every combination
of a small grid, then, while the pick is the largest or smallest value tried
along some setting, one more rung of that setting's ladder (:data:`AXES`)
beyond it, until the pick is interior or at the ladder's end (reported as
such). The pick then runs at every N with every ``--seeds`` seed, and the
report gives the mean and the spread (min-max) over seeds (the plots'
error bars: the half-range), the bits each worker
sent per parameter per step (read off the compiled train step), the pick
and every tuning run.

Tasks: ``fashion_mnist_mlp``, ``fashion_mnist_cnn``, ``fashion_mnist_vit``
(test accuracy, 3 epochs), ``charlm`` (a small byte-level GPT on the GPL-3
text, test bits per byte) and ``charlm_long`` (the same 5x longer on 4.7 MB
of Python's standard library, with test loss curves: ``--curves``),
``mlp_many_workers`` (the MLP from 4 to 64 workers at 3 epochs) and
``mlp_many_workers_steps`` (from 4 to 128 workers at a fixed 352 steps);
``mlp_local_steps`` (the MLP with local steps: each worker trains alone
for H steps, then an outer step: the error-fed voted mean and its levers,
dense, in fragments or sparse, the 1-bit outer vote, and the fp32 mean's
DiLoCo Nesterov step and fair baselines, a plain step and momentum tuned,
against voting every step and the global optimizers; every row judged
against the best fp32 outer row; ``--plot-bits``),
``cnn_local_steps``, ``charlm_local_steps`` and
``charlm_long_local_steps`` (the CNN and the GPTs so, at H = 32, and the
fragmented votes at H = 16 and 8), ``mlp_x4_local_steps``,
``cnn_x4_local_steps``, ``charlm_x4_local_steps`` and
``charlm_long_x4_local_steps`` (each 4x as long);
``digits`` is a seconds-long smoke version for tests (``digits_local_steps``
for local steps). The slower tasks
tune the learning rate only and run fewer N by default (:data:`TASKS`);
``--workers`` and ``--seeds`` ask for more.

Usage::

  python -m benchmarks.convergence [--tasks fashion_mnist_mlp ...]
      [--workers 4 8 16] [--seeds 0 1] [--json runs.json [--resume]]
      [--out docs/benchmarks.md [--section bench.convergence]]
      [--plot docs/img/convergence.png] [--curves docs/img/curves.png]
      [--plot-bits docs/img/local_steps.png]
  python -m benchmarks.convergence --from-json runs.json [--out ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import pathlib
import statistics
import sys
import time

from benchmarks import study
from benchmarks.study import Task
from dlion_jax import bench
from dlion_jax import devices
from dlion_jax.bench import reporting

LOCAL_STEPS = (8, 16, 32, 128)
_VOTED = {"optimizer.outer_momentum": 0.0}
VOTED_ROWS = {
    "EF vote": _VOTED,
    "EF vote, Nesterov": {"optimizer.outer_momentum": 0.9},
    "EF vote, Lion": {"optimizer.outer_step": "lion",
                      "optimizer.outer_momentum": 0.95,
                      "optimizer.outer_b2": 0.98},
    "vote, no EF": {**_VOTED, "optimizer.outer_error_feedback": False},
    "EF vote, late": {**_VOTED, "optimizer.outer_late": True},
    "EF vote, inner schedule": {**_VOTED,
                                "optimizer.outer_schedule": "inner"},
    "EF vote, Avg": {**_VOTED, "optimizer.aggregation": "avg"},
    "EF vote, ternary_l1": {**_VOTED, "optimizer.quantizer": "ternary_l1"},
    "EF sparse 1/128": {**_VOTED, "optimizer.outer_sparse_chunk": 128},
    "EF sparse 1/32": {**_VOTED, "optimizer.outer_sparse_chunk": 32},
    # The low-bit levers: SparseLoCo's decayed residual, a scale a
    # chunk, the outer momentum tuned, the dense vote in fragments (one
    # entry in M a round); SparseLoCo's sparse values.
    "EF vote, decay 0.9": {**_VOTED, "optimizer.outer_error_decay": 0.9},
    "EF vote, chunk scales": {**_VOTED, "optimizer.outer_scale_chunk": 1024},
    # The scales' plain mean, all-reduced, not clipped at twice the
    # median of every worker's, gathered: fewer bits, no defence.
    "EF vote, plain scales": {**_VOTED, "optimizer.outer_scale_clip": None},
    "EF vote, tuned momentum": {},
    "EF vote, 1/4 fragments": {**_VOTED, "optimizer.outer_fragments": 4},
    # The decoded scale fitted to the workers' mean after the vote: U
    # shrinks where they disagree (a leaf's scale, then a chunk's).
    "EF vote, fitted scale": {**_VOTED, "optimizer.outer_fit_scale": True},
    "EF vote, fitted chunk scales": {
        **_VOTED, "optimizer.outer_fit_scale": True,
        "optimizer.outer_scale_chunk": 1024},
    **{f"EF vote, 1/{m} fragments, decay 0.9": {
        **_VOTED, "optimizer.outer_fragments": m,
        "optimizer.outer_error_decay": 0.9} for m in (2, 4, 8, 16)},
    # The mean of the votes (Avg) carries how many workers agree, an
    # entry's magnitude the 1-bit majority drops; in halves, for its bits.
    "EF vote, Avg, 1/2 fragments, decay 0.9": {
        **_VOTED, "optimizer.aggregation": "avg",
        "optimizer.outer_fragments": 2, "optimizer.outer_error_decay": 0.9},
    # ... or Lion Cub's ternary L1 levels, 0 where an entry is small.
    "EF vote, ternary_l1, 1/2 fragments, decay 0.9": {
        **_VOTED, "optimizer.quantizer": "ternary_l1",
        "optimizer.outer_fragments": 2, "optimizer.outer_error_decay": 0.9},
    # The control: the fp32 mean (no vote) on the same quarter a round, so
    # that what the quarter schedule costs is told from what the vote does.
    "fp32 mean, 1/4 fragments, decay 0.9": {
        **_VOTED, "optimizer.outer_fp32_mean": True,
        "optimizer.outer_fragments": 4, "optimizer.outer_error_decay": 0.9},
    "EF sparse 1/128, chunk scales, decay 0.95": {
        **_VOTED, "optimizer.outer_sparse_chunk": 128,
        "optimizer.outer_scale_chunk": 4096,
        "optimizer.outer_error_decay": 0.95},
    # SparseLoCo's way (0.4 % of each chunk at 2 bits, two scales a
    # chunk): the chunk at one density, then the density at one chunk.
    **{f"EF sparse {keep}/{chunk}, 2-bit, decay 0.95": {
        **_VOTED, "optimizer.outer_sparse_chunk": chunk,
        "optimizer.outer_sparse_keep": keep,
        "optimizer.outer_sparse_value_bits": 2,
        "optimizer.outer_scale_chunk": chunk,
        "optimizer.outer_error_decay": 0.95}
       for keep, chunk in ((4, 1024), (16, 4096), (64, 16384), (8, 4096))},
}
FP32_ROWS = {
    "DiLoCo plain outer": {"optimizer.outer_momentum": 0.0},
    "DiLoCo tuned momentum": {},
}
# row -> config overrides on top of the task's config.
ROWS = {
    "SGD momentum": {"optimizer.name": "sgd", "optimizer.momentum": 0.9},
    "Signum (majority vote)": {"optimizer.name": "signum",
                               "optimizer.momentum": 0.9},
    "D-Lion MaVo": {"optimizer.name": "dlion",
                    "optimizer.aggregation": "mavo"},
    "D-Lion Avg": {"optimizer.name": "dlion", "optimizer.aggregation": "avg"},
    "global Lion": {"optimizer.name": "lion"},
    "global AdamW": {"optimizer.name": "adamw"},
    # Lion Cub's best levers at N = 16 (docs/lioncub.md), for the N study.
    "MaVo, 4-bit": {"optimizer.name": "dlion", "optimizer.quantizer":
                    "pbit_l1", "optimizer.bits": 4},
    "MaVo, ternary_l1": {"optimizer.name": "dlion",
                         "optimizer.quantizer": "ternary_l1"},
    # Local steps (dl.local_steps): H steps of Lion on each worker alone,
    # then an outer step: Distributed Lion's 1-bit vote (MaVo) or DiLoCo's
    # Nesterov step on the fp32 mean.
    **{f"{name}, H={h}": {"optimizer.name": "dlion",
                          "optimizer.local_steps": h,
                          "optimizer.outer": outer}
       for name, outer in (("D-Lion outer", "dlion"),
                           ("DiLoCo outer", "nesterov"))
       for h in LOCAL_STEPS},
    # The workers' mean pseudo-gradient from error-fed 1-bit votes
    # (dl.rounds.voted_outer), then an outer step: none, Nesterov's or
    # Lion's; sparse: 1 entry of every 128 (or 32) votes.
    **{f"{name}, H={h}": {"optimizer.name": "dlion",
                          "optimizer.local_steps": h,
                          "optimizer.outer": "voted", **options}
       for name, options in VOTED_ROWS.items() for h in LOCAL_STEPS},
    # The fp32 mean's fair baselines: a plain outer step (momentum 0, the
    # voted mean's) and Nesterov with its momentum tuned, rates tuned on
    # FP32_OUTER_LRS.
    **{f"{name}, H={h}": {"optimizer.name": "dlion",
                          "optimizer.local_steps": h,
                          "optimizer.outer": "nesterov", **options}
       for name, options in FP32_ROWS.items() for h in LOCAL_STEPS},
    # The control of why a damped outer step helps: global Lion (an fp32
    # all-reduce every step) with Lookahead's slow step every H steps.
    **{f"Lookahead on global Lion, H={h}": {
        "optimizer.name": "lion", "optimizer.local_steps": h,
        "optimizer.inner_allreduce": True, "optimizer.outer": "nesterov",
        "optimizer.outer_momentum": 0.0} for h in LOCAL_STEPS},
}
PAPER_ROWS = tuple(ROWS)[:6]
LOCAL_ROWS = tuple(row for row in ROWS if ", H=" in row)
VOTED_LOCAL_ROWS = tuple(row for row in LOCAL_ROWS
                         if row.split(", H=")[0] in VOTED_ROWS)
# The fp32 outer rows: DiLoCo's Nesterov 0.9 and the fair baselines.
FP32_LOCAL_ROWS = tuple(row for row in LOCAL_ROWS
                        if row.startswith("DiLoCo"))
# Rows that tune their outer step alone, at the task's inner_lr.
OUTER_TUNED_ROWS = VOTED_LOCAL_ROWS + tuple(
    row for row in LOCAL_ROWS if row.split(", H=")[0] in FP32_ROWS)
# The values a tuned setting may take, in order. A row's grid starts on a
# slice of each ladder and steps one rung past any edge pick (:func:`tune`);
# a ladder's ends are the bounds a pick may stop at.
SIGN_LRS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
SGD_LRS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
DECAYS = (0.0, 1e-3, 0.01, 0.1, 1.0)     # decoupled: times the lr (optax)
L2S = (0.0, 5e-4, 5e-3, 5e-2)            # SGD: added to the gradient
B2S = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
SIGN_OUTER_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3)
NESTEROV_OUTER_LRS = (0.01, 0.03, 0.1, 0.3, 0.7, 1.0, 1.4)
VOTED_OUTER_LRS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0)
FP32_OUTER_LRS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0)
OUTER_MOMENTA = (0.0, 0.5, 0.9)


@dataclasses.dataclass(frozen=True)
class Axis:
  """One tuned setting: its config key, its ladder and its first values."""
  key: str
  ladder: tuple
  start: tuple

  def next(self, value: float, direction: int) -> float | None:
    """The rung beyond ``value`` (``direction`` +1 or -1), or None."""
    i = self.ladder.index(value) + direction
    return self.ladder[i] if 0 <= i < len(self.ladder) else None

  def fixed(self) -> Axis:
    """This axis held at its first value."""
    return Axis(self.key, self.start[:1], self.start[:1])


LR, WD = "optimizer.learning_rate", "optimizer.weight_decay"
_SIGN = {"lr": Axis(LR, SIGN_LRS, (3e-4, 1e-3, 3e-3)),
         "wd": Axis(WD, DECAYS, (0.01, 0.1))}
# row -> its tuned settings by name (the run records' keys).
OUTER_LR = "optimizer.outer_learning_rate"
OUTER_MOMENTUM = "optimizer.outer_momentum"
AXES = {
    "SGD momentum": {"lr": Axis(LR, SGD_LRS, (0.01, 0.03, 0.1)),
                     "wd": Axis(WD, L2S, (0.0, 5e-4))},
    **{row: _SIGN for row in ROWS if row != "SGD momentum"},
    # The inner learning rate and the outer one (sign steps, or Nesterov's
    # around DiLoCo's 0.7).
    **{row: {**_SIGN, "outer_lr": Axis(OUTER_LR, SIGN_OUTER_LRS,
                                       (0.01, 0.03))}
       for row in LOCAL_ROWS if row.startswith("D-Lion")},
    **{row: {**_SIGN, "outer_lr": Axis(OUTER_LR, NESTEROV_OUTER_LRS,
                                       (0.3, 0.7))}
       for row in LOCAL_ROWS if row.startswith("DiLoCo")},
    # The voted means tune the outer rate alone (:attr:`ConvergenceTask.
    # inner_lr`): a sign step's as D-Lion's outer vote, the others'
    # around SparseLoCo's 1 (DiLoCo's 0.7 with Nesterov).
    **{row: {**_SIGN, "outer_lr": Axis(
        OUTER_LR, SIGN_OUTER_LRS if "Lion" in row else VOTED_OUTER_LRS,
        (0.01, 0.03) if "Lion" in row else (0.3, 0.7) if "Nesterov" in row
        else (0.5, 1.0)), **({"outer_momentum": Axis(
            OUTER_MOMENTUM, OUTER_MOMENTA, OUTER_MOMENTA)}
            if "tuned momentum" in row else {})}
       for row in VOTED_LOCAL_ROWS},
    **{row: {**_SIGN, "outer_lr": Axis(OUTER_LR, FP32_OUTER_LRS, (0.3, 1.0))}
       for row in LOCAL_ROWS if row.startswith("Lookahead")},
    # The fp32 baselines: the outer rate (and Nesterov's momentum, all of
    # OUTER_MOMENTA first) at the inner_lr, as the voted means.
    **{row: {**_SIGN, "outer_lr": Axis(OUTER_LR, FP32_OUTER_LRS, (0.3, 1.0)),
             **({"outer_momentum": Axis(OUTER_MOMENTUM, OUTER_MOMENTA,
                                        OUTER_MOMENTA)}
                if "tuned momentum" in row else {})}
       for row in LOCAL_ROWS if row.split(", H=")[0] in FP32_ROWS},
}
LION_ROWS = ("D-Lion MaVo", "D-Lion Avg", "global Lion")
SETTINGS = ("lr", "wd", "b2", "outer_lr", "outer_momentum")


@dataclasses.dataclass(frozen=True)
class ConvergenceTask:
  """A task, the N and rows it runs by default, and what it tunes."""
  task: Task
  workers: tuple = (4, 8, 16)
  tune_decay: bool = True      # False: the grid's first weight decay only
  start_lrs: tuple | None = None   # sign rows' first learning rates
  b2s: tuple = ()              # Lion rows' first b2 values; (): 0.99 only
  rows: tuple = PAPER_ROWS
  # These rows also run at each of these learning rates (other settings at
  # their picks) at every N: a comparison at equal learning rates.
  matched_lrs: tuple = ()
  matched_rows: tuple = ("global Lion", "D-Lion MaVo")
  # The inner learning rate of the rows that tune their outer step alone
  # (OUTER_TUNED_ROWS): the inner Lion's pick of the D-Lion and DiLoCo
  # outer rows.
  inner_lr: float | None = None
  # Rows evaluated at the picks of this other task's tuning (a longer run
  # of the same model), not tuned here.
  picks_from: str | None = None

  def axes(self, row: str) -> dict[str, Axis]:
    """The settings ``row`` tunes on this task."""
    axes = dict(AXES[row])
    if self.start_lrs and row != "SGD momentum":
      axes["lr"] = dataclasses.replace(axes["lr"], start=self.start_lrs)
    if self.inner_lr and row in OUTER_TUNED_ROWS:
      axes["lr"] = Axis(LR, (self.inner_lr,), (self.inner_lr,))
    if not self.tune_decay:
      axes["wd"] = axes["wd"].fixed()
    if self.b2s and row in LION_ROWS:
      axes["b2"] = Axis("optimizer.b2", B2S, self.b2s)
    return axes


_LONG_LM = ("model.dim=64", "model.depth=2", "data.seq_len=64")
# The local-steps rows of the longer tasks: H = 32, and the fragments at
# shorter H (more rounds at the same bits a step).
_FRAGMENTS_MORE_ROUNDS = tuple(
    f"EF vote, 1/{m} fragments, decay 0.9, H={h}"
    for m, h in ((2, 16), (4, 8), (8, 16), (16, 8)))
_LOCAL_BRIEF = ("D-Lion MaVo", "global Lion", "global AdamW",
                "D-Lion outer, H=32", "DiLoCo outer, H=32",
                "Lookahead on global Lion, H=32",
                *(f"{row}, H=32" for row in (*VOTED_ROWS, *FP32_ROWS)),
                *_FRAGMENTS_MORE_ROUNDS,
                # The fp32 mean's frontier: every H, its bits and metric.
                *(f"DiLoCo plain outer, H={h}" for h in (8, 16, 128)))
# Tasks that more than one study runs (each study its own rows).
_CNN = Task("fashion_mnist_cnn", "test_accuracy", True, epochs=3)
# A 2-block GPT of width 64 on 64-byte windows, 300 steps.
_CHARLM = Task("charlm_gpt", "test_bits_per_byte", False, epochs=None,
               steps=300, local_batch=8, overrides=_LONG_LM)
# The same GPT 5x longer, with test loss curves, on 4.7 MB of Python source
# (GPL-3's 35 KB, read 190 times in 1,500 steps, was memorized: test loss
# rose from step ~500 on), tested on the first 1,024 windows (64 KB) of its
# held-out tail.
_CHARLM_LONG = Task("charlm_gpt", "test_bits_per_byte", False, epochs=None,
                    steps=1500, local_batch=8, curve_points=15,
                    overrides=(*_LONG_LM, "data.limit_test=1024"),
                    text=study.python_stdlib_text)
TASKS = {
    "fashion_mnist_mlp": ConvergenceTask(
        Task("fashion_mnist_mlp", "test_accuracy", True, epochs=3)),
    # About 70 s a run on 2 CPU cores: N = 8 only, learning rate only.
    "fashion_mnist_cnn": ConvergenceTask(_CNN, workers=(8,),
                                         tune_decay=False),
    # The config's ViT at width 64 and depth 2 (the shipped width 128,
    # depth 4 takes 4.5 min a run here); the papers' model family.
    "fashion_mnist_vit": ConvergenceTask(
        Task("fashion_mnist_vit", "test_accuracy", True, epochs=3,
             overrides=("model.dim=64", "model.depth=2")),
        workers=(8,), tune_decay=False, start_lrs=(1e-3, 3e-3),
        rows=PAPER_ROWS[:5]),
    "charlm": ConvergenceTask(_CHARLM, workers=(8,), tune_decay=False),
    # The same GPT 5x longer; Lion rows also tune b2.
    "charlm_long": ConvergenceTask(
        _CHARLM_LONG, workers=(8,), tune_decay=False, start_lrs=(3e-4, 1e-3),
        b2s=(0.95, 0.98, 0.99),
        rows=("global AdamW", "global Lion", "D-Lion MaVo", "D-Lion Avg",
              "Signum (majority vote)")),
    # The MLP from 4 to 64 workers: where does the majority vote break?
    "mlp_many_workers": ConvergenceTask(
        Task("fashion_mnist_mlp", "test_accuracy", True, epochs=3),
        workers=(4, 8, 16, 32, 64), tune_decay=False, matched_lrs=(1e-3, 3e-3),
        rows=("global Lion", "D-Lion MaVo", "D-Lion Avg",
              "Signum (majority vote)", "MaVo, 4-bit", "MaVo, ternary_l1")),
    # ... at a fixed 352 steps (N = 16's above) from 4 to 128 workers: the
    # vote at N apart from the shorter runs of a fixed number of epochs.
    "mlp_many_workers_steps": ConvergenceTask(
        Task("fashion_mnist_mlp", "test_accuracy", True, epochs=None,
             steps=352),
        workers=(4, 8, 16, 32, 64, 128), tune_decay=False,
        matched_lrs=(1e-3, 3e-3),
        rows=("global Lion", "D-Lion MaVo", "D-Lion Avg",
              "Signum (majority vote)", "MaVo, 4-bit", "MaVo, ternary_l1")),
    "digits": ConvergenceTask(
        Task("quickstart", "test_accuracy", True, epochs=None, steps=30,
             overrides=("model.hidden=[32]",)),
        workers=(2, 3), tune_decay=False),
    # Local steps: H in LOCAL_STEPS against voting every step and the
    # global optimizers, at N = 8 (--plot-bits: the metric against bits).
    "mlp_local_steps": ConvergenceTask(
        Task("fashion_mnist_mlp", "test_accuracy", True, epochs=3),
        workers=(8,), tune_decay=False, inner_lr=1e-3,
        rows=("D-Lion MaVo", "global Lion", "global AdamW", *LOCAL_ROWS)),
    # ... the CNN (about 60 s a run here) and the GPT of charlm, at H = 32.
    "cnn_local_steps": ConvergenceTask(_CNN, workers=(8,), tune_decay=False,
                                       inner_lr=0.01, rows=_LOCAL_BRIEF),
    "charlm_local_steps": ConvergenceTask(
        _CHARLM, workers=(8,), tune_decay=False, inner_lr=3e-3,
        rows=_LOCAL_BRIEF),
    # ... and charlm_long's GPT (1,500 steps, 46 rounds), without its b2 grid.
    "charlm_long_local_steps": ConvergenceTask(
        _CHARLM_LONG, workers=(8,), tune_decay=False,
        start_lrs=(3e-4, 1e-3), inner_lr=3e-3, rows=_LOCAL_BRIEF),
    # ... 4x as long (6,000 steps, 187 rounds) at charlm_long's picks: what
    # the number of rounds changes.
    "charlm_long_x4_local_steps": ConvergenceTask(
        dataclasses.replace(_CHARLM_LONG, steps=6000), workers=(8,),
        tune_decay=False, inner_lr=3e-3, rows=_LOCAL_BRIEF,
        picks_from="charlm_long_local_steps"),
    # ... the MLP 4x as long (12 epochs, 87 rounds at H = 32), every row
    # tuned again: what the number of rounds changes.
    "mlp_x4_local_steps": ConvergenceTask(
        Task("fashion_mnist_mlp", "test_accuracy", True, epochs=12),
        workers=(8,), tune_decay=False, inner_lr=1e-3,
        rows=("D-Lion MaVo", *LOCAL_ROWS)),
    # ... the 300-step GPT 4x as long (1,200 steps, 37 rounds at H = 32).
    "charlm_x4_local_steps": ConvergenceTask(
        dataclasses.replace(_CHARLM, steps=1200), workers=(8,),
        tune_decay=False, inner_lr=3e-3, rows=_LOCAL_BRIEF),
    # ... and the CNN 4x as long (12 epochs, 87 rounds at H = 32).
    "cnn_x4_local_steps": ConvergenceTask(
        dataclasses.replace(_CNN, epochs=12), workers=(8,),
        tune_decay=False, inner_lr=0.01, rows=_LOCAL_BRIEF),
    "digits_local_steps": ConvergenceTask(
        Task("quickstart", "test_accuracy", True, epochs=None, steps=32,
             overrides=("model.hidden=[32]",)),
        workers=(4,), tune_decay=False, inner_lr=1e-3,
        rows=("D-Lion MaVo", "D-Lion outer, H=8", "DiLoCo outer, H=8",
              "EF vote, H=8", "EF sparse 1/32, H=8")),
}
DEFAULT_TASKS = ("fashion_mnist_mlp", "fashion_mnist_cnn", "charlm")


def _point(run: dict, axes) -> dict:
  return {name: run.get(name) for name in axes}


def _key(run: dict) -> tuple:
  return (run["task"], run["phase"], run["row"], run["workers"], run["seed"],
          *(run.get(name) for name in SETTINGS))


# What study.train returns of a run.
_RESULTS = ("text", "metric", "bits", "steps", "seconds", "diverged",
            "curve")


def _overrides(spec: dict) -> dict:
  """The config overrides of a run: its row's and its settings'."""
  axes = TASKS[spec["task"]].axes(spec["row"])
  return {**ROWS[spec["row"]], **{axis.key: spec[name]
                                  for name, axis in axes.items()
                                  if spec.get(name) is not None}}


def _config(spec: dict) -> tuple:
  """What a run trains (task, N, seed, every override), whichever row it
  is of: DiLoCo's Nesterov step at momentum 0 is its plain step."""
  return (spec["task"], spec["workers"], spec["seed"], sorted(
      (k, repr(v)) for k, v in _overrides(spec).items()))


def _run(runs: list[dict], done: dict, spec: dict, json_path) -> dict:
  """Trains ``spec`` (task, phase, row, workers, seed and the row's
  settings) unless a saved run has it, or the same config under another
  row (then copied, ``same_as`` naming that row); appends and saves."""
  key = _key(spec)
  if key in done:
    return done[key]
  conv = TASKS[spec["task"]]
  overrides = _overrides(spec)
  same = next((r for r in runs if _config(r) == _config(spec)), None)
  if same is not None:     # another row's run of the same config
    run = {**spec, **{k: same[k] for k in _RESULTS if k in same},
           "same_as": same["row"]}
  else:
    run = {**spec, **study.train(conv.task, overrides, spec["workers"],
                                 spec["seed"])}
  runs.append(run)
  done[key] = run
  reporting.write_json(json_path, runs, indent=1)
  return run


def _tuning(runs, task, row):
  return [r for r in runs if r["task"] == task and r["row"] == row
          and r["phase"] == "tune"]


def _best(runs: list[dict], task: str) -> dict:
  pick = max if TASKS[task].task.higher_is_better else min
  return pick(runs, key=lambda r: r["metric"])


def best_setting(runs: list[dict], task: str, row: str) -> dict | None:
  """The settings (``{"lr": ..., "wd": ...}``) of the best tuning run of
  ``row`` on ``task`` (on the task it takes its picks from, if any)."""
  task = TASKS[task].picks_from or task
  mine = _tuning(runs, task, row)
  return _point(_best(mine, task), TASKS[task].axes(row)) if mine else None


def _line(runs, axes, point, name) -> list[float]:
  """The values of ``name`` tried with every other setting as in ``point``."""
  return [r[name] for r in runs
          if all(r.get(o) == point[o] for o in axes if o != name)]


def _neighbours(axes, point, names) -> list[dict]:
  """The points one rung from ``point`` along any of ``names`` (several at
  once included: the diagonals), within the ladders."""
  values = [[point[n], *(v for d in (-1, 1)
                         if (v := axes[n].next(point[n], d)) is not None)]
            for n in names]
  return [{**point, **dict(zip(names, combo))}
          for combo in itertools.product(*values)][1:]


def untried_neighbours(runs: list[dict], task: str, row: str) -> list[dict]:
  """The points next to the pick that were not tried yet, diagonals
  included, and, on a task that tunes ``b2``, next to the best point of
  each first-grid ``b2`` (a per-``b2`` figure is a tuned one too). None
  once every pick is a local optimum of the ladders' lattice."""
  axes, mine = TASKS[task].axes(row), _tuning(runs, task, row)
  tried = [_point(r, axes) for r in mine]
  centres = [(best_setting(runs, task, row), list(axes))]
  if "b2" in axes:
    others = [n for n in axes if n != "b2"]
    centres += [(_point(_best(line, task), axes), others)
                for b2 in axes["b2"].start
                if (line := [r for r in mine if r["b2"] == b2])]
  new = []
  for centre, names in centres:
    new += [p for p in _neighbours(axes, centre, names)
            if p not in tried and p not in new]
  return new


def pick_status(runs: list[dict], task: str, row: str) -> str:
  """``interior``, or which settings stopped at a ladder's end."""
  axes, point = TASKS[task].axes(row), best_setting(runs, task, row)
  line = lambda name: _line(_tuning(runs, task, row), axes, point, name)
  bounds = [f"{name} at bound {_fmt(point[name])}"
            for name, axis in axes.items() if len(axis.ladder) > 1
            and point[name] in (axis.ladder[0], axis.ladder[-1])
            and point[name] in (min(line(name)), max(line(name)))]
  return "; ".join(bounds) or "interior"


def tune(runs, done, task: str, row: str, workers: int, seed: int,
         json_path=None) -> dict:
  """Runs ``row``'s first grid (every combination of its axes' first
  values), then the untried neighbours of the pick until it is a local
  optimum of the ladders' lattice (:func:`untried_neighbours`); returns
  the pick."""
  axes = TASKS[task].axes(row)
  todo = [dict(zip(axes, values))
          for values in itertools.product(*(a.start for a in axes.values()))]
  while todo:
    for point in bench.progress(todo, len(todo), f"{task}: tuning {row}"):
      _run(runs, done, dict(task=task, phase="tune", row=row,
                            workers=workers, seed=seed, **point), json_path)
    todo = untried_neighbours(runs, task, row)
  return best_setting(runs, task, row)


class SavedRunsMismatch(ValueError):
  """Saved runs that were made on other data than this run would use."""


def check_saved_text(saved, tasks) -> None:
  """Saved runs of a task whose text this Python makes (``charlm_long``)
  must have been trained on the same text, else a study would mix two."""
  for name in tasks:
    make = TASKS[name].task.text
    mine = [r for r in saved if r["task"] == name]
    if make and mine:
      here = study.text_id(make())
      other = {r.get("text") for r in mine} - {here}
      if other:
        raise SavedRunsMismatch(
            f"--json holds {name} runs on another text ({other.pop()}); "
            f"this Python's makes {here}. Resume with the Python that made "
            "them, or give another --json to start afresh.")


def run_study(tasks, rows, workers, seeds, tune_workers, tune_seed,
              json_path=None, saved=()) -> list[dict]:
  """Tunes every row of every task, then runs the picks at every N and
  seed (none: the rows are tuned only)."""
  check_saved_text(saved, tasks)
  runs = list(saved)
  done = {_key(r): r for r in runs}
  for name in tasks:
    conv = TASKS[name]
    mine = [row for row in rows if row in conv.rows]
    picks = {row: best_setting(runs, name, row)
             if conv.picks_from else tune(runs, done, name, row,
                                          tune_workers, tune_seed, json_path)
             for row in mine}
    untuned = [row for row, pick in picks.items() if pick is None]
    if untuned:
      raise ValueError(
          f"{name} evaluates rows at {conv.picks_from}'s picks, which has "
          f"no tuning runs of {', '.join(untuned)} in the runs given: "
          f"tune them there first (--tasks {conv.picks_from}), in the "
          "same --json.")
    evals = [dict(task=name, phase="eval", row=row, workers=n, seed=s,
                  **picks[row])
             for row in mine for n in workers or conv.workers for s in seeds]
    evals += [dict(spec, lr=lr) for lr in conv.matched_lrs
              for spec in evals if spec["row"] in conv.matched_rows
              and spec["lr"] != lr]
    for spec in bench.progress(evals, len(evals), f"{name}: runs"):
      _run(runs, done, spec, json_path)
  return runs


def eval_workers(runs: list[dict], task: str) -> list[int]:
  """The N that ``task``'s evaluation runs used, in order."""
  return sorted({r["workers"] for r in runs
                 if r["task"] == task and r["phase"] == "eval"})


def _evals(runs, task, row, n, point=None):
  """``row``'s runs at ``n`` workers at ``point``, by default its current
  pick (a saved study re-tuned under a wider grid keeps the runs of its
  earlier picks, and matched-lr runs sit beside the pick's)."""
  pick = point or best_setting(runs, task, row)
  return [r for r in runs if r["task"] == task and r["phase"] == "eval"
          and r["row"] == row and r["workers"] == n
          and (pick is None or _point(r, pick) == pick)]


def seed_stats(runs, task, row, n, point=None
               ) -> tuple[float, float, int] | None:
  """Mean and half-range of ``row``'s metric at ``n`` (at ``point``, by
  default the pick) over the seeds that did not diverge (scaled to % for
  accuracies), and how many diverged; None without runs or when every
  seed diverged."""
  mine = _evals(runs, task, row, n, point)
  kept = [r["metric"] * TASKS[task].task.scale for r in mine
          if not r["diverged"]]
  if not kept:
    return None
  return (*study.mean_spread(kept), len(mine) - len(kept))


def seed_range(runs, task, row, n) -> tuple[float, float] | None:
  """The lowest and highest of ``row``'s metric at ``n`` at its pick over
  the seeds that did not diverge (scaled as :func:`seed_stats`)."""
  kept = [r["metric"] * TASKS[task].task.scale
          for r in _evals(runs, task, row, n) if not r["diverged"]]
  return (min(kept), max(kept)) if kept else None


def _mean(runs, task, row, n) -> float | None:
  stats = seed_stats(runs, task, row, n)
  return None if stats is None else stats[0]


def _fmt(value: float) -> str:
  return f"{value:g}"


def _setting_names(runs, task) -> list[str]:
  """The settings any row of ``task`` tunes, in :data:`SETTINGS` order."""
  rows = {r["row"] for r in runs if r["task"] == task}
  return [name for name in SETTINGS
          if any(name in TASKS[task].axes(row) for row in rows)]


def _describe(point: dict) -> str:
  return ", ".join(f"{name} {_fmt(value)}" for name, value in point.items())


def summary_table(runs: list[dict], task: str) -> str:
  """Rows x N: metric mean (min-max), bits sent, the pick and whether it
  is interior; the rows evaluated at their pick (the others are in
  :func:`screen_table`)."""
  conv = TASKS[task]
  workers = eval_workers(runs, task)
  if not workers:
    return "(tuned only: no run at the picked settings yet)"
  rows = [row for row in ROWS if any(_evals(runs, task, row, n)
                                     for n in workers)]
  headers = (["optimizer"] + [f"N={n}: test {conv.task.unit}, mean "
                              "(min-max)" for n in workers]
             + ["bits/param/step", "picked", "pick", "seeds"])
  body = []
  for row in rows:
    cells = [row]
    for n in workers:
      stats = seed_stats(runs, task, row, n)
      diverged = sum(r["diverged"] for r in _evals(runs, task, row, n))
      low, high = seed_range(runs, task, row, n) or (0, 0)
      cells.append("-" if stats is None and not diverged else
                   "diverged" if stats is None else
                   f"{stats[0]:.2f} ({low:.2f}-{high:.2f})"
                   + (f" ({stats[2]} seed diverged)" if stats[2] else ""))
    n_bits = 8 if 8 in workers else workers[-1]
    mine = _evals(runs, task, row, n_bits)
    cells.append(_bits(runs, task, row, workers, n_bits) if mine else "-")
    picked = best_setting(runs, task, row)
    cells += ([_describe(picked), pick_status(runs, task, row)] if picked
              else ["-", "-"])
    cells.append(str(len({r["seed"] for r in mine})))
    body.append(cells)
  return reporting.markdown_table(headers, body)


def _bits(runs, task, row, workers, n_bits) -> str:
  """Bits a worker sent per param per step at ``n_bits``, and their range
  over ``workers`` (they grow with N)."""
  bits = {n: mean for n in workers
          if (mean := _mean_bits(runs, task, row, n)) is not None}
  text = f"{bits[n_bits]:.2f} (N={n_bits})"
  if len(bits) > 1:
    text += (f"; {min(bits.values()):.2f}-{max(bits.values()):.2f} at "
             f"N={min(bits)}-{max(bits)}")
  return text


def matched_table(runs: list[dict], task: str) -> str:
  """The matched rows at each of the task's ``matched_lrs``, every other
  setting at their picks, and the difference between the first two."""
  conv = TASKS[task]
  workers = eval_workers(runs, task)
  body = []
  for lr in conv.matched_lrs:
    means = {}
    for row in conv.matched_rows:
      pick = best_setting(runs, task, row)
      if pick is None:
        continue
      stats = {n: seed_stats(runs, task, row, n, {**pick, "lr": lr})
               for n in workers}
      means[row] = {n: st[0] for n, st in stats.items() if st}
      body.append([_fmt(lr), row] + [
          f"{st[0]:.2f} ± {st[1]:.2f}" if st else "-"
          for st in stats.values()])
    if len(means) >= 2:
      first, second = (means[row] for row in conv.matched_rows[:2])
      body.append([_fmt(lr), f"{conv.matched_rows[1]} - "
                   f"{conv.matched_rows[0]}"] + [
          f"{second[n] - first[n]:+.2f}" if n in first and n in second
          else "-" for n in workers])
  if not body:
    return ""
  return ("At equal learning rates (other settings at each row's pick):\n\n"
          + reporting.markdown_table(
              ["lr", "optimizer"] + [f"N={n}" for n in workers], body))


def grid_table(runs: list[dict], task: str) -> str:
  """Every tuning run, by row and setting; the picks in bold."""
  scale = TASKS[task].task.scale
  tune = [r for r in runs if r["task"] == task and r["phase"] == "tune"]
  if not tune:
    return ""
  names = _setting_names(runs, task)
  body = []
  for row in dict.fromkeys(r["row"] for r in tune):
    pick = best_setting(runs, task, row)
    for r in sorted(_tuning(tune, task, row),
                    key=lambda r: [r.get(n) or 0 for n in names]):
      value = f"{r['metric'] * scale:.2f}"
      best = _point(r, pick) == pick
      body.append([row, *(_fmt(r[n]) if n in r else "-" for n in names),
                   f"**{value}**" if best else value])
  first = tune[0]
  return (f"Grid (N={first['workers']}, seed {first['seed']}; the points "
          "next to a pick, diagonals included, are run until it is the best "
          "of its neighbours):\n\n"
          + reporting.markdown_table(
              ["optimizer", *names, f"test {TASKS[task].task.unit}"], body))


def verdicts(runs: list[dict], task: str) -> list[str]:
  """The papers' claims, checked on this task's numbers."""
  conv = TASKS[task]
  better = 1 if conv.task.higher_is_better else -1
  unit = "points" if conv.task.scale == 100 else "bits/byte"
  lines = []
  for n in eval_workers(runs, task):
    means = {row: mean for row in ROWS
             for mean in [_mean(runs, task, row, n)] if mean is not None}
    if "D-Lion MaVo" not in means or "global Lion" not in means:
      continue
    mavo = means["D-Lion MaVo"]
    gap = (mavo - means["global Lion"]) * better
    parts = [f"N={n}: D-Lion MaVo is {abs(gap):.2f} {unit} "
             f"{'better' if gap >= 0 else 'worse'} than global Lion"]
    for rival in ("Signum (majority vote)", "SGD momentum", "D-Lion Avg"):
      if rival in means:
        ahead = (mavo - means[rival]) * better
        parts.append(f"level with {rival}" if abs(ahead) < 0.005 else
                     f"{'ahead of' if ahead > 0 else 'behind'} {rival} by "
                     f"{abs(ahead):.2f}")
    lines.append("; ".join(parts) + ".")
  return lines + breakdown(runs, task) + local_steps_verdicts(runs, task)


def _mean_bits(runs, task, row, n) -> float | None:
  """The mean bits per param per step of ``row``'s runs at ``n`` at its
  pick (not a NaN run's), or None."""
  sent = [r["bits"] for r in _evals(runs, task, row, n)
          if math.isfinite(r["bits"])]
  return statistics.fmean(sent) if sent else None


def best_fp32_outer(runs, task, n, h: int = 32) -> str | None:
  """The fp32 outer row (:data:`FP32_LOCAL_ROWS`) at H = ``h`` with the best
  mean at ``n`` (at any H where none ran at ``h``), or None where none was
  evaluated: the yardstick of the voted rows, whose 1-bit votes fit the
  0.075-bit budget at H = 32 (the fp32 mean at other H, with more or
  fewer rounds and bits, is :func:`fp32_table`'s)."""
  better = 1 if TASKS[task].task.higher_is_better else -1
  means = {row: mean for row in FP32_LOCAL_ROWS
           if (mean := _mean(runs, task, row, n)) is not None}
  means = {row: mean for row, mean in means.items()
           if row.endswith(f", H={h}")} or means
  return max(means, key=lambda row: better * means[row]) if means else None


def fp32_table(runs, task) -> str:
  """Every fp32 outer row evaluated, and the fp32 mean's fragment control,
  at the largest N: its bits and its mean (min-max) over the seeds, against
  the yardstick (:func:`best_fp32_outer`)."""
  conv = TASKS[task]
  n = max(eval_workers(runs, task), default=None)
  best = n and best_fp32_outer(runs, task, n)
  if not best:
    return ""
  digits = 2 if conv.task.scale == 100 else 3
  sign = 1 if conv.task.higher_is_better else -1
  yardstick = _mean(runs, task, best, n)
  body = []
  for row in [*FP32_LOCAL_ROWS, *(r for r in LOCAL_ROWS
                                  if r.startswith("fp32 mean"))]:
    mean = _mean(runs, task, row, n)
    if mean is None or all(r.get("same_as") == best
                           for r in _evals(runs, task, row, n)):
      continue
    low, high = seed_range(runs, task, row, n)
    body.append([row, f"{_mean_bits(runs, task, row, n):.3f}",
                 f"{mean:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})",
                 "yardstick" if row == best
                 else f"{(mean - yardstick) * sign:+.{digits}f}"])
  return (f"The fp32 mean at every H it ran, and on fragments of the "
          f"entries (N={n}; the yardstick: {best}):\n\n"
          + reporting.markdown_table(
              ["fp32 outer row", "bits/param/step", f"test {conv.task.unit}",
               "against the yardstick"], body))


def compare(runs, task, n, ours, theirs) -> tuple[str, float, int, int]:
  """``ours`` against ``theirs`` at ``n``: ``better``, ``worse`` or
  ``level`` (better only where the gap between the means exceeds the
  larger of the two rows' spreads, max - min over the seeds), the gap
  (positive: ours ahead), and on how many of the seeds both ran ours was
  ahead, of how many."""
  sign = 1 if TASKS[task].task.higher_is_better else -1
  gap = (_mean(runs, task, ours, n) - _mean(runs, task, theirs, n)) * sign
  spread = max(high - low for low, high in (
      seed_range(runs, task, ours, n), seed_range(runs, task, theirs, n)))
  verdict = ("better" if gap > spread else "worse" if -gap > spread
             else "level")
  by_seed = [{r["seed"]: r["metric"] for r in _evals(runs, task, row, n)}
             for row in (ours, theirs)]
  seeds = set(by_seed[0]) & set(by_seed[1])
  ahead = sum((by_seed[0][s] - by_seed[1][s]) * sign > 0 for s in seeds)
  return verdict, gap, ahead, len(seeds)


def local_steps_verdicts(runs: list[dict], task: str) -> list[str]:
  """Every local-steps row against the best fp32 outer row (the best of
  DiLoCo's Nesterov step and the fair baselines, at H = 32) and against
  voting every step, with the bits each sends; a row whose runs are the
  best row's own (``same_as``) is left out."""
  conv = TASKS[task]
  better = 1 if conv.task.higher_is_better else -1
  unit, digits = (("points", 2) if conv.task.scale == 100
                  else ("bits/byte", 3))
  lines = []
  for n in eval_workers(runs, task):
    theirs = best_fp32_outer(runs, task, n)
    if theirs is None:
      continue
    every = _mean(runs, task, "D-Lion MaVo", n)
    m_theirs = _mean(runs, task, theirs, n)
    b_theirs = _mean_bits(runs, task, theirs, n)
    for ours in LOCAL_ROWS:
      m_ours = _mean(runs, task, ours, n)
      if ours == theirs or m_ours is None or all(
          r.get("same_as") == theirs for r in _evals(runs, task, ours, n)):
        continue
      b_ours = _mean_bits(runs, task, ours, n)
      verdict, gap, ahead, seeds = compare(runs, task, n, ours, theirs)
      line = (f"N={n}: {ours} against the best fp32 outer row ({theirs}): "
              f"**{verdict}**, {gap:+.{digits}f} {unit}, ahead at {ahead} "
              f"of {seeds} seeds ({m_ours:.{digits}f} at {b_ours:.3f} "
              f"bits/param/step against {m_theirs:.{digits}f} at "
              f"{b_theirs:.2f}, {_bits_ratio(b_theirs / b_ours)})")
      if every is not None:
        line += (f"; {(m_ours - every) * better:+.{digits}f} {unit} "
                 "against voting every step")
      lines.append(line + ".")
  return lines


def _bits_ratio(ratio: float) -> str:
  """How many times the bits the yardstick sends, said plainly."""
  if 0.95 < ratio < 1.05:
    return "as many bits"
  return (f"which sends {ratio:.0f}x the bits" if ratio > 1
          else f"which sends 1/{1 / ratio:.0f} of the bits")


def breakdown(runs: list[dict], task: str, points: float = 1.0) -> list[str]:
  """The first N at which MaVo trails global Lion by more than ``points``,
  and which rows are within ``points`` of global Lion there."""
  ns = eval_workers(runs, task)
  if TASKS[task].task.scale != 100 or len(ns) < 3:
    return []
  mean = lambda row, n: _mean(runs, task, row, n)
  for n in ns:
    lion, mavo = mean("global Lion", n), mean("D-Lion MaVo", n)
    if lion is not None and mavo is not None and lion - mavo > points:
      close = [f"{row} ({mean(row, n) - lion:+.2f})" for row in ROWS
               if row not in ("global Lion", "D-Lion MaVo")
               and mean(row, n) is not None
               and lion - mean(row, n) <= points]
      return [f"**MaVo first trails global Lion by more than {points:g} "
              f"point at N={n}** ({mavo - lion:+.2f}); within {points:g} "
              f"point of global Lion there: "
              + (", ".join(close) if close else "no other row") + "."]
  return [f"MaVo stays within {points:g} point of global Lion up to "
          f"N={ns[-1]}."]


def plot(runs: list[dict], path: str) -> None:
  """Metric against N per optimizer, one panel per task."""
  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure
  tasks = list(dict.fromkeys(r["task"] for r in runs if r["phase"] == "eval"))
  fig = Figure(figsize=(4.6 * len(tasks) + 2.5, 4.2), layout="constrained")
  axes = fig.subplots(1, len(tasks), squeeze=False)[0]
  for ax, task in zip(axes, tasks):
    all_n = eval_workers(runs, task)
    for row in ROWS:
      pick = best_setting(runs, task, row)
      # The pick (solid), then the matched learning rates it lacks (dashed).
      lrs = [None] + [lr for lr in TASKS[task].matched_lrs if pick
                      and row in TASKS[task].matched_rows and lr != pick["lr"]]
      color = None
      for lr in lrs:
        point = None if lr is None else {**pick, "lr": lr}
        stats = {n: st for n in all_n
                 if (st := seed_stats(runs, task, row, n, point))}
        if not stats:
          continue
        ns = list(stats)
        bars = ax.errorbar(
            ns, [s[0] for s in stats.values()],
            yerr=[s[1] for s in stats.values()],
            marker="o" if lr is None else "x", capsize=3, color=color,
            label=(f"{row}, lr {lr:g}" if lr else
                   f"{row}, lr {pick['lr']:g} (pick)" if len(lrs) > 1
                   else row),
            ls=("-" if lr is None else "--") if len(ns) > 1 else "none")
        color = bars[0].get_color()
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_n)
    ax.get_xaxis().set_major_formatter("{x:g}")
    ax.set(xlabel="workers N (32 examples each)",
           ylabel=f"test {TASKS[task].task.unit}", title=task)
    ax.grid(True, alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside right center", fontsize=8)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def mean_curves(runs: list[dict], task: str, n: int) -> list[tuple]:
  """``(row, steps, mean metric, seeds, twin)`` per row with curves at
  ``n`` workers: the mean over the seeds at the row's pick, and the row
  whose mean is the same to the last digit (D-Lion at ``b2 = b1`` is
  Signum), or None."""
  scale, seen, out = TASKS[task].task.scale, {}, []
  for row in ROWS:
    curves = [r["curve"] for r in _evals(runs, task, row, n)
              if r.get("curve")]
    if curves:
      steps = tuple(step for step, _ in curves[0])
      mean = tuple(statistics.fmean(c[i][1] * scale for c in curves)
                   for i in range(len(steps)))
      out.append((row, steps, mean, len(curves), seen.get((steps, mean))))
      seen.setdefault((steps, mean), row)
  return out


def plot_bits(runs: list[dict], path: str) -> None:
  """Metric against the bits each worker sent per parameter per step
  (log scale), one panel per task with local-steps rows: each outer
  optimizer's rows joined across H, the every-step rows as points."""
  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure
  tasks = [t for t in dict.fromkeys(r["task"] for r in runs
                                    if r["phase"] == "eval")
           if set(LOCAL_ROWS) & set(TASKS[t].rows)]
  if not tasks:
    raise ValueError(
        "--plot-bits: no evaluated runs of a task with local steps among "
        "the runs (tasks " + ", ".join(
            t for t in TASKS if set(LOCAL_ROWS) & set(TASKS[t].rows))
        + "); nothing to plot. Leave it out, or wait for the study's "
        "seeds to run.")
  fig = Figure(figsize=(6.5 * len(tasks) + 1, 6.4), layout="constrained")
  for ax, task in zip(fig.subplots(1, len(tasks), squeeze=False)[0], tasks):
    n = max(eval_workers(runs, task))
    series = {}
    for row in TASKS[task].rows:
      stats, bits = seed_stats(runs, task, row, n), _mean_bits(
          runs, task, row, n)
      if stats is None or bits is None:
        continue
      point = (bits, stats[0], stats[1], row.rpartition("=")[2])
      if row in LOCAL_ROWS:
        series.setdefault(row.rpartition(", H=")[0], []).append(point)
      else:
        ax.errorbar([bits], [stats[0]], yerr=[stats[1]], marker="s",
                    capsize=3, ls="none", label=f"{row} (every step)")
    # The band: the best fp32 outer row.
    best = best_fp32_outer(runs, task, n)
    if best:
      low, high = seed_range(runs, task, best, n)
      ax.axhspan(low, high, color="0.5", alpha=0.2,
                 label=f"best fp32 outer: {best}, its seeds' range")
    for name, points in series.items():
      if points:
        xs, ys, errs, hs = zip(*sorted(points))
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3,
                    label=f"{name}, H = {', '.join(reversed(hs))}")
        for x, y, h in zip(xs, ys, hs):
          ax.annotate(f"H={h}", (x, y), textcoords="offset points",
                      xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.get_xaxis().set_major_formatter("{x:g}")
    ax.set(xlabel="bits each worker sends per parameter per step",
           ylabel=f"test {TASKS[task].task.unit} (N={n})", title=task)
    ax.grid(True, alpha=0.3)
    # Below the axes: inside, it hid the rows at the plot's corners.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13),
              ncol=2)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def plot_curves(runs: list[dict], path: str) -> None:
  """Test metric against step per row, per task whose runs saved curves:
  every step (left) and the second half zoomed in (right). A row equal to
  an earlier one is drawn dashed and named as such, not hidden under it."""
  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure
  tasks = list(dict.fromkeys(r["task"] for r in runs
                             if r["phase"] == "eval" and r.get("curve")))
  fig = Figure(figsize=(11, 4.4 * len(tasks)), layout="constrained")
  for (full, zoom), task in zip(fig.subplots(len(tasks), 2, squeeze=False),
                                tasks):
    n = max(r["workers"] for r in runs if r["task"] == task
            and r["phase"] == "eval" and r.get("curve"))
    lines = mean_curves(runs, task, n)
    for row, steps, mean, seeds, twin in lines:
      label = f"{row} ({seeds} seeds" + (
          f"; = {twin}, the same runs)" if twin else ")")
      for ax in (full, zoom):
        ax.plot(steps, mean, marker=".", ls="--" if twin else "-",
                label=label)
    half = max(line[1][-1] for line in lines) / 2
    tail = [y for _, steps, mean, *_ in lines
            for x, y in zip(steps, mean) if x >= half]
    pad = 0.05 * (max(tail) - min(tail)) or 0.01
    zoom.set(xlim=(half, None), ylim=(min(tail) - pad, max(tail) + pad))
    unit = TASKS[task].task.unit
    full.set(xlabel="step", ylabel=f"test {unit}", title=f"{task}, N={n}")
    zoom.set(xlabel="step", ylabel=f"test {unit}",
             title=f"{task}: the second half")
    if not TASKS[task].task.higher_is_better:
      full.set_ylim(top=min(full.get_ylim()[1], 6.0))
    for ax in (full, zoom):
      ax.grid(True, alpha=0.3)
    # The full view's corner that curves leave once they have settled.
    full.legend(fontsize=8, loc="lower right"
                if TASKS[task].task.higher_is_better else "upper right")
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def screen_table(runs: list[dict], task: str) -> str:
  """Every tuned row at its pick at the tuning seed, best first: the
  screen that chose which rows to evaluate at more seeds."""
  conv = TASKS[task]
  if conv.picks_from:
    return ""
  rows = [row for row in ROWS if _tuning(runs, task, row)]
  if not rows:
    return ""
  best = {row: _best(_tuning(runs, task, row), task) for row in rows}
  sign = -1 if conv.task.higher_is_better else 1
  evaluated = set(r["row"] for r in runs
                  if r["task"] == task and r["phase"] == "eval")
  body = [[row, f"{best[row]['metric'] * conv.task.scale:.2f}",
           f"{best[row]['bits']:.4f}",
           _describe(best_setting(runs, task, row)),
           "yes" if row in evaluated else "no"]
          for row in sorted(rows, key=lambda r: sign * best[r]["metric"])]
  seed = best[rows[0]]["seed"]
  return (f"Every row tuned, at its pick at the tuning seed ({seed}), best "
          "first:\n\n" + reporting.markdown_table(
              ["optimizer", f"test {conv.task.unit}", "bits/param/step",
               "pick", "evaluated"], body))


def momentum_table(runs: list[dict], task: str, h: int = 32) -> str:
  """The fp32 mean's outer step at the tuning seed, by momentum: the best
  rate ``eta`` tried with each momentum ``mu`` (every fp32 outer row's
  tuning runs at the task's inner rate), its metric, the step a constant
  pseudo-gradient gets once the momentum has built up (Nesterov's
  ``eta / (1 - mu)``) and the rounds it takes to build 90 % of it
  (``ln 0.1 / ln mu``), against the rounds the run has."""
  inner = TASKS[task].inner_lr
  mine = [r for row in FP32_LOCAL_ROWS if row.endswith(f", H={h}")
          for r in _tuning(runs, task, row)
          if inner is None or r.get("lr") == inner]
  if not mine:
    return ""
  momentum = lambda r: _overrides(r).get(OUTER_MOMENTUM, 0.9)
  scale, steps = TASKS[task].task.scale, mine[0]["steps"]
  body = []
  for mu in sorted({momentum(r) for r in mine}):
    best = _best([r for r in mine if momentum(r) == mu], task)
    eta = best["outer_lr"]
    build = math.log(0.1) / math.log(mu) if mu else 0
    body.append([_fmt(mu), _fmt(eta), f"{eta / (1 - mu):.3g}",
                 f"{build:.0f}", f"{best['metric'] * scale:.3f}"])
  return (f"The fp32 mean's outer step by momentum (H = {h}, the tuning "
          f"seed; the run has {steps // h} rounds):\n\n"
          + reporting.markdown_table(
              ["momentum", "best rate", "built-up step", "rounds to 90 %",
               f"test {TASKS[task].task.unit}"], body))


def protocol(runs: list[dict], task: str) -> str:
  """How ``task``'s rows were tuned and evaluated, and what "better"
  means in its verdicts."""
  source = TASKS[task].picks_from or task
  tuned = sorted({r["seed"] for r in runs
                  if r["task"] == source and r["phase"] == "tune"})
  evals = sorted({r["seed"] for r in runs
                  if r["task"] == task and r["phase"] == "eval"})
  if not evals:
    return ""
  reused = sorted(set(tuned) & set(evals))
  where = f" (on {source})" if source != task else ""
  return (f"Every row tuned at seed {', '.join(map(str, tuned))}{where} and "
          f"evaluated at seed{'s' * (len(evals) > 1)} "
          f"{', '.join(map(str, evals))}"
          + (f" (seed {', '.join(map(str, reused))} also tuned)" if reused
             else ", never used for tuning")
          + "; a row is **better** than another only where the gap "
          "between their means exceeds the larger of their spreads "
          "(max - min over the seeds), else **level**.")


def report(runs: list[dict], heading: str) -> str:
  parts = [heading]
  for task in dict.fromkeys(r["task"] for r in runs):
    conv = TASKS[task]
    parts.append(f"#### {task} ({conv.task.config}, test "
                 f"{conv.task.unit})\n\n" + summary_table(runs, task))
    parts.append(protocol(runs, task))
    parts += ["\n".join(f"- {line}" for line in verdicts(runs, task)),
              fp32_table(runs, task),
              screen_table(runs, task), momentum_table(runs, task),
              matched_table(runs, task),
              grid_table(runs, task)]
  minutes = sum(r["seconds"] for r in runs) / 60
  parts.append(f"{len(runs)} runs, {minutes:.0f} min of training.")
  return "\n\n".join(p for p in parts if p)


def at_seeds(runs: list[dict], seeds) -> list[dict]:
  """The tuning runs and the evaluation runs at ``seeds``."""
  return [r for r in runs if r["phase"] != "eval" or r["seed"] in seeds]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS),
                      choices=list(TASKS))
  parser.add_argument("--rows", nargs="+", default=list(ROWS),
                      choices=list(ROWS), metavar="ROW")
  parser.add_argument("--workers", nargs="+", type=int, default=None,
                      help="N to report (default: each task's own)")
  parser.add_argument("--seeds", nargs="+", type=int, default=None,
                      help="the evaluation seeds (default 0 1); with "
                      "--from-json or --resume, the report shows these "
                      "seeds' runs alone")
  parser.add_argument("--tune-only", action="store_true",
                      help="tune the rows, evaluate none (a screening: "
                      "evaluate the picks later with --seeds)")
  parser.add_argument("--tune-workers", type=int, default=8)
  parser.add_argument("--tune-seed", type=int, default=100)
  parser.add_argument("--json", help="save every run here (after each run)")
  parser.add_argument("--resume", action="store_true",
                      help="keep the runs already saved in --json")
  parser.add_argument("--from-json", nargs="+", metavar="FILE",
                      help="report saved runs instead of training")
  parser.add_argument("--out", help="write the report into this markdown "
                      "file (between its bench.convergence markers)")
  parser.add_argument("--section", default="bench.convergence",
                      help="the markers in --out to write between")
  parser.add_argument("--plot", help="write the PNG here")
  parser.add_argument("--curves", help="write the test-curve PNG here")
  parser.add_argument("--plot-bits", help="write the PNG of the metric "
                      "against bits sent here (tasks with local steps)")
  args = parser.parse_args(argv)
  if args.resume and not args.json:
    parser.error("--resume needs --json FILE (the runs to keep)")
  return args


def main(argv=None) -> str:
  args = parse_args(argv)
  start = time.perf_counter()
  if args.from_json:
    runs = study.load_runs(args.from_json)
    heading = f"Runs read from {', '.join(args.from_json)}."
  else:
    saved = (study.load_runs([args.json]) if args.resume
             and pathlib.Path(args.json).exists() else [])
    devices.use_cpu_devices(max([args.tune_workers, *(args.workers or []),
                                 *(n for t in args.tasks
                                   for n in TASKS[t].workers)]))
    try:
      runs = run_study(args.tasks, args.rows, args.workers,
                       [] if args.tune_only else args.seeds or [0, 1],
                       args.tune_workers, args.tune_seed, args.json, saved)
    except SavedRunsMismatch as e:
      sys.exit(f"error: {e}")
    heading = (f"Measured with `python -m benchmarks.convergence "
               f"--tasks {' '.join(args.tasks)}"
               + (f" --workers {' '.join(map(str, args.workers))}"
                  if args.workers else "")
               + f" --seeds {' '.join(map(str, args.seeds or [0, 1]))}` on "
               f"{bench.machine_line()}; this invocation took "
               f"{(time.perf_counter() - start) / 60:.0f} min.")
  if args.seeds:
    runs = at_seeds(runs, args.seeds)
  if args.plot:
    plot(runs, args.plot)
  if args.curves:
    plot_curves(runs, args.curves)
  if args.plot_bits:
    try:
      plot_bits(runs, args.plot_bits)
    except ValueError as e:
      sys.exit(f"error: {e}")
  return reporting.write_section(report(runs, heading), args.out,
                                 args.section)


if __name__ == "__main__":
  main()
