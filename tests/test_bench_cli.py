"""The bench modules as commands: each names itself in its usage, and one
that needs the [examples] extra says how to install it before it runs."""

import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys

import pytest

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
