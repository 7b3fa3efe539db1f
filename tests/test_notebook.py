"""notebooks/quickstart.ipynb runs top to bottom and draws its plots."""

import base64
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

nbformat = pytest.importorskip(
    "nbformat", reason="needs nbformat, nbclient and ipykernel (the [test] "
    "extra) to execute the notebook")
nbclient = pytest.importorskip(
    "nbclient", reason="needs nbclient (the [test] extra) to execute the "
    "notebook")
pytest.importorskip("ipykernel", reason="needs ipykernel (the [test] extra) "
                    "for the notebook's python3 kernel")
pytest.importorskip("flax", reason="the notebook trains with the [examples] "
                    "extra (flax, orbax-checkpoint, matplotlib, ...)")
pytest.importorskip("matplotlib", reason="the notebook plots with matplotlib "
                    "(the [examples] extra)")

NOTEBOOK = (pathlib.Path(__file__).parent.parent / "notebooks" /
            "quickstart.ipynb")
STEPS = 4


def test_committed_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, cell.source


def test_notebook_runs_and_plots(tmp_path, monkeypatch):
  # The kernel inherits this environment: a tiny run in a scratch directory.
  monkeypatch.setenv("DLION_NOTEBOOK_STEPS", str(STEPS))
  monkeypatch.setenv("DLION_NOTEBOOK_RUN_DIR", str(tmp_path / "runs"))
  # The kernel starts in tmp_path: make this checkout importable there.
  repo = str(NOTEBOOK.parent.parent)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (repo, os.environ.get("PYTHONPATH")) if p))

  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
      nb, kernel_name="python3", timeout=120, allow_errors=False,
      resources={"metadata": {"path": str(tmp_path)}})
  client.execute()          # raises CellExecutionError on any error

  pngs = [base64.b64decode(out["data"]["image/png"])
          for cell in nb.cells if cell.cell_type == "code"
          for out in cell.get("outputs", [])
          if "image/png" in out.get("data", {})]
  assert len(pngs) == 2, "expected the curves figure and the bytes bar chart"
  assert all(png.startswith(b"\x89PNG") and len(png) > 5_000 for png in pngs)
  text = "".join(out.get("text", "") for cell in nb.cells
                 if cell.cell_type == "code" for out in cell.outputs)
  assert "fewer bytes per step than global Lion" in text

  for name in ("dlion", "lion"):
    run = tmp_path / "runs" / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == STEPS
    records = [json.loads(line)
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == STEPS
  dlion = json.loads((tmp_path / "runs" / "dlion" / "summary.json").read_text())
  lion = json.loads((tmp_path / "runs" / "lion" / "summary.json").read_text())
  assert dlion["sent_bytes_per_step"] * 10 < lion["sent_bytes_per_step"]


def _install_cell() -> str:
  nb = nbformat.read(NOTEBOOK, as_version=4)
  return next(c.source for c in nb.cells if c.cell_type == "code"
              and "pip" in c.source)


def test_install_cell_installs_this_clone(monkeypatch):
  """The install cell, run with flax missing, installs the clone the
  notebook is in (was: `pip install dlion_jax[examples]` from a package
  index that does not have it, and a URL with an <owner> placeholder)."""
  assert "<owner>" not in NOTEBOOK.read_text()
  repo = NOTEBOOK.parent.parent
  calls = []
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "flax" else
                      real(name, *a))
  monkeypatch.setattr(subprocess, "check_call", calls.append)
  monkeypatch.chdir(NOTEBOOK.parent)
  exec(_install_cell(), {})  # pylint: disable=exec-used
  assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e",
                    f"{repo}[examples]"]]
  project = (repo / "pyproject.toml").read_text()
  assert 'name = "dlion_jax"' in project and "examples = [" in project


def test_install_cell_outside_a_clone_says_what_to_do(tmp_path, monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "flax" else
                      real(name, *a))
  monkeypatch.setattr(subprocess, "check_call", pytest.fail)
  (tmp_path / "notebooks").mkdir()
  monkeypatch.chdir(tmp_path / "notebooks")
  with pytest.raises(RuntimeError, match=r"missing: flax\. Run this notebook "
                     r"from notebooks/ in a clone of the repository, or "
                     r'install dlion_jax first: pip install -e "\.\[examples'
                     r'\]" in the clone\.'):
    exec(_install_cell(), {})  # pylint: disable=exec-used


def test_notebook_runs_are_ignored_by_git():
  """The notebook's default run_dir, runs/notebook next to it, is not
  offered for a commit (was: only the repository's own runs/ was
  ignored)."""
  repo = NOTEBOOK.parent.parent
  if not (repo / ".git").exists():
    pytest.skip("not a git checkout")
  ignored = subprocess.run(
      ["git", "check-ignore", "-q", "notebooks/runs/notebook/dlion/"
       "metrics.jsonl"], cwd=repo, check=False)
  assert ignored.returncode == 0
