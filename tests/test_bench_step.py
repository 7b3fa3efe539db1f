"""bench.step's table: the ratios of medians and of each round's pair."""

import types

import numpy as np

from dlion_jax.bench import step


def runners(**times):
  return {name.replace("_", " "): types.SimpleNamespace(times=t)
          for name, t in times.items()}


def test_per_round_ratios_pair_each_round_with_the_floors():
  """Each round's pair gives one ratio; their median and quartiles are not
  the ratio of the medians (5x here, where no round is above 5x)."""
  r = runners(dlion_mavo_psum=[0.002, 0.010, 0.011],
              global_lion=[0.0015, 0.003, 0.015],
              local_lion=[0.001, 0.002, 0.010])
  np.testing.assert_allclose(
      step.paired_ratios(r, "dlion mavo psum", step.FLOOR), [2.0, 5.0, 1.1])
  cells = {line.split("|")[1].strip(): [c.strip() for c in
                                        line.split("|")[2:-1]]
           for line in step.table(r, 8).splitlines()[2:]}
  assert cells["dlion mavo psum"][-2:] == ["5.00x", "2.00x (1.55-3.50)"]
  assert cells["global lion"][-1] == "1.50x (1.50-1.50)"
  assert cells["local lion"][-1] == "1.00x (1.00-1.00)"
