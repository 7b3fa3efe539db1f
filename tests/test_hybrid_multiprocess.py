"""A hybrid step on 2 real processes x 4 CPU devices (gloo across them)
equals the single-process (2, 4) mesh bit for bit: params and every
node's momentum; with shard_axis (params replicated or sharded at rest)
for params sharded at rest with the step leaving "fsdp" to the
compiler; and for the plain jax.jit step of dl.workers (params replicated
or sharded at rest), which also equals the shard_axis step."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dlion_jax import devices
from tests import hybrid_worker
from tiers import slow_but

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layout", slow_but(
    ["shard_axis", "shard_axis_zero3", "zero3", "plain", "plain_zero3"], 1, 3))
def test_two_processes_equal_one_process(tmp_path, layout):
  out = tmp_path / "multi.npz"
  run = subprocess.run(
      [sys.executable, "-m", "dlion_jax.launch", "-n", "2", "--timeout",
       "150", "--", sys.executable, "-m", "tests.hybrid_worker", str(out),
       layout],
      capture_output=True, text=True, timeout=180, cwd=ROOT)
  assert run.returncode == 0, run.stdout + run.stderr
  multi = np.load(out)
  mesh = devices.hybrid_mesh(hybrid_worker.NODES,
                             devices=jax.devices()[:8])
  params, mu = hybrid_worker.run(mesh, layout)
  for k in hybrid_worker.SHAPES:
    np.testing.assert_array_equal(multi[f"p_{k}"], params[k])
    np.testing.assert_array_equal(multi[f"mu_{k}"], mu[k])
  assert not np.array_equal(params["w"], hybrid_worker.inputs()[0]["w"])
  if layout.startswith("plain"):
    theirs, _ = hybrid_worker.run(mesh, layout.replace("plain", "shard_axis"))
    for k in hybrid_worker.SHAPES:
      np.testing.assert_array_equal(params[k], theirs[k])
