"""The soak (docs/reliability.md, section 6): replicas never drift, memory
stays flat. CI runs 200 steps; ``-m slow`` runs the 10k-step command."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import soak
from dlion_jax import devices

pytestmark = pytest.mark.integration

# RSS may wobble by allocator pages; a leak of one pytree copy a step would
# grow it by gigabytes over 10k steps.
FLAT_MIB = 64


def test_short_soak_keeps_replicas_identical():
  result = soak.soak(200, workers=8, leaves=12, max_leaf_size=65536,
                     check_every=50, progress=False, comm="allgather",
                     vote="ternary")
  assert result.checks == 4 and result.steps == 200
  assert [s for s, _ in result.rss_mib] == [50, 100, 150, 200]
  # After the first check (compiles done) RSS stays flat (it grew 0.0-3.1
  # MiB in four runs): a leak of one copy of the params (124 kB) a step
  # would add 17.8 MiB by the last check, of the 8 workers' momenta 142.
  assert result.rss_mib[-1][1] - result.rss_mib[0][1] < 12, result.rss_mib
  assert "replicas bit-identical at all 4 checks" in result.text()


def test_random_spec_has_empty_one_element_and_bf16_leaves():
  spec = soak.random_spec(0, 24, 65536)
  sizes = [int(np.prod(s)) for s, _ in spec.values()]
  assert 0 in sizes and 1 in sizes and max(sizes) > 1000
  assert {d.name for _, d in spec.values()} == {"float32", "bfloat16"}
  assert soak.random_spec(0, 24, 65536) == spec          # seeded


def test_drift_is_detected():
  """The check can fail: one device's copy differs in one bit."""
  mesh = devices.data_mesh(4)
  copies = [np.zeros(3, np.float32) for _ in range(4)]
  copies[2] = copies[2].copy()
  copies[2][1] = np.float32(-0.0)                      # == 0.0, other bits
  arrays = [jax.device_put(c, d) for c, d in zip(copies, mesh.devices)]
  leaf = jax.make_array_from_single_device_arrays(
      (3,), NamedSharding(mesh, P()), arrays)
  with pytest.raises(soak.DriftError,
                     match=r"step 7: worker 2's copy of \['w'\] differs"):
    soak.check_replicas({"w": leaf}, 7)


def test_usage_errors():
  with pytest.raises(SystemExit) as e:
    soak.main(["--steps", "0"])
  assert e.value.code == 2


@pytest.mark.slow
def test_ten_thousand_steps(tmp_path):
  out = tmp_path / "soak.json"
  root = pathlib.Path(__file__).resolve().parents[1]   # has benchmarks/
  run = subprocess.run([sys.executable, "-m", "benchmarks.soak",
                        "--steps", "10000", "--json", str(out)], cwd=root,
                       capture_output=True, text=True, timeout=1800)
  assert run.returncode == 0, run.stderr[-3000:]
  figures = json.loads(out.read_text())
  assert figures["steps"] == 10000 and figures["checks"] == 20
  assert figures["rss_last"] - figures["rss_first"] < FLAT_MIB, figures
  print(run.stdout)
