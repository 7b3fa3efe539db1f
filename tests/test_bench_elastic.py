"""benchmarks.elastic's report: gaps to the uninterrupted run, per policy
and seed, and the loss-curve plot, on runs made up here."""

import pytest

from benchmarks import elastic
from dlion_jax.elastic import RESIZE_POLICIES

pytestmark = pytest.mark.integration


def made_up_runs():
  runs = []
  for seed in (0, 1):
    for n in (8, 4):
      runs.append(dict(task="t", seed=seed, old=n, new=n, policy=None,
                       accuracy=0.9 + 0.01 * seed,
                       curve=[(10, 1.0), (20, 0.5)]))
    for old, new in elastic.RESIZES:
      for k, policy in enumerate(RESIZE_POLICIES):
        runs.append(dict(task="t", seed=seed, old=old, new=new,
                         policy=policy, accuracy=0.9 + 0.01 * seed
                         - 0.001 * k, curve=[(10, 1.0), (20, 0.6)]))
  return runs


def test_gaps_are_points_behind_the_uninterrupted_run():
  runs = made_up_runs()
  assert elastic.gaps(runs, "t", 8, 4, "mean") == [0.0, 0.0]
  assert elastic.gaps(runs, "t", 4, 8, "keep") == pytest.approx([-0.2, -0.2])
  table = elastic.table(runs, "t")
  assert "| 8 -> 2 | all | every worker given the mean of the 8 momenta | " \
         "90.50 | -0.10 / -0.10 | -0.10 |" in table


def test_plot_writes_a_png(tmp_path):
  path = tmp_path / "elastic.png"
  elastic.plot(made_up_runs(), str(path))
  assert path.read_bytes()[:4] == b"\x89PNG"
