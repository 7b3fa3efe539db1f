"""The bench modules as commands: each names itself in its usage, and one
that needs the [examples] extra says how to install it before it runs."""

import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys

import numpy as np
import pytest


from dlion_jax import _message as message
from dlion_jax import bench

pytestmark = pytest.mark.integration      # the benchmarks' commands
ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = sorted(m.name for m in pkgutil.iter_modules(bench.__path__)
                  if hasattr(importlib.import_module(
                      f"dlion_jax.bench.{m.name}"), "main"))


def test_every_bench_command_is_listed():
  assert COMMANDS == ["aot", "compile", "hybrid", "kernels", "step", "wire"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_bench_command_names_itself_in_its_usage(name, capsys):
  module = importlib.import_module(f"dlion_jax.bench.{name}")
  with pytest.raises(SystemExit) as exit_:
    module.main(["--help"])
  assert exit_.value.code == 0
  assert capsys.readouterr().out.startswith(
      f"usage: python -m dlion_jax.bench.{name} ")


# (module the extra installs, command, arguments): each would otherwise
# fail with ModuleNotFoundError, some after minutes of work.
WITHOUT_EXTRA = [
    ("flax", "hybrid", []),
    ("yaml", "hybrid", []),          # flax imports it
    ("flax", "compile", ["--gpt", "--leaves", "3", "--reps", "1"]),
    ("matplotlib", "wire", ["--sizes", "2", "--plot", "p.png"]),
]


@pytest.mark.parametrize("missing,name,args", WITHOUT_EXTRA)
def test_a_command_without_the_examples_extra_says_how_to_install_it(
    missing, name, args, tmp_path):
  # None in sys.modules makes the import fail as if it were not installed.
  code = (f"import sys; sys.modules[{missing!r}] = None\n"
          f"from dlion_jax.bench import {name}\n"
          f"{name}.main({args!r})")
  # It starts in tmp_path: make this checkout importable there.
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                         if p)
  run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=path),
                       capture_output=True, text=True, timeout=120)
  assert run.returncode == 2, run.stderr
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith(f"python -m dlion_jax.bench.{name}: error: ")
  assert f"import of {missing} halted" in last
  assert last.endswith('pip install "dlion_jax[examples]"')
  assert not list(tmp_path.iterdir())      # exited before writing anything


@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
@pytest.mark.parametrize("num_workers", [3, 4])
def test_bench_kernels_stages_chain_to_the_vote_of_every_comm(
    aggregation, num_workers):
  from dlion_jax.bench import kernels    # pylint: disable=import-outside-toplevel
  size = 1001                            # not a multiple of 8 N
  for comm in message.COMMS:
    stages = kernels.stage_functions(num_workers, size, aggregation, comm)
    assert list(stages) == list(kernels.STAGES)
    g, m = map(np.asarray, stages["encode"][1])
    votes = np.sign(0.1 * g + 0.9 * m).sum(axis=0)
    want = np.sign(votes) if aggregation == "mavo" else votes / num_workers
    d = np.asarray(stages["apply"][1][0])   # decode's output, apply's input
    np.testing.assert_array_equal(d, np.broadcast_to(want, d.shape),
                                  err_msg=comm)


def test_bench_kernels_prints_both_tables_for_every_variant(capsys):
  from dlion_jax.bench import kernels    # pylint: disable=import-outside-toplevel
  kernels.main(["--workers", "3", "--sizes", "1001", "--repeats", "1"])
  out = capsys.readouterr().out
  for aggregation in ("mavo", "avg"):
    for comm in message.COMMS:
      assert out.count(f"| dlion {aggregation} {comm} |") == 2, comm
