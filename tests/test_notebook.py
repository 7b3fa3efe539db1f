"""notebooks/quickstart.ipynb runs top to bottom and draws its plots."""

import base64
import importlib.util
import json
import os
import pathlib
import shutil
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
  """Opened outside a clone, as Colab opens it: a copy in a scratch folder,
  dlion_jax importable from the environment's install alone (not from the
  checkout's path), so the install cell finds it and does nothing."""
  # The kernel inherits this environment: a tiny run in a scratch directory.
  monkeypatch.setenv("DLION_NOTEBOOK_STEPS", str(STEPS))
  monkeypatch.setenv("DLION_NOTEBOOK_RUN_DIR", str(tmp_path / "runs"))
  repo = NOTEBOOK.parent.parent.resolve()
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
      if p and pathlib.Path(p).resolve() != repo))
  if importlib.util.find_spec("dlion_jax") is None or not subprocess.run(
      [sys.executable, "-c", "import dlion_jax"], cwd=tmp_path,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}).returncode == 0:
    pytest.skip("dlion_jax is not installed in this environment")
  opened = tmp_path / "content"
  opened.mkdir()
  shutil.copy(NOTEBOOK, opened / NOTEBOOK.name)

  nb = nbformat.read(opened / NOTEBOOK.name, as_version=4)
  nb.cells.append(nbformat.v4.new_code_cell(
      "import sys\nprint('on the path:', [p for p in sys.path if p and "
      f"pathlib.Path(p).resolve() == pathlib.Path({str(repo)!r})])"))
  client = nbclient.NotebookClient(
      nb, kernel_name="python3", timeout=120, allow_errors=False,
      resources={"metadata": {"path": str(opened)}})
  client.execute()          # raises CellExecutionError on any error
  said = [out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
          for out in cell.outputs]
  assert said[0] == "dlion_jax and its [examples] extra are installed\n"
  assert said[-1] == "on the path: []\n"

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


def _missing(monkeypatch, *names):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in names else
                      real(name, *a))


def _in_colab(tmp_path, monkeypatch, repository=""):
  """The install cell as Colab runs it: the notebook alone in /content,
  REPOSITORY as its form was filled in."""
  (tmp_path / "content").mkdir()
  monkeypatch.chdir(tmp_path / "content")
  cell = _install_cell()
  assert cell.count('REPOSITORY = ""  # @param {type:"string"}') == 1
  source = cell.replace('REPOSITORY = ""', f"REPOSITORY = {repository!r}")
  exec(source, {})  # pylint: disable=exec-used


@pytest.mark.parametrize("repository,requirement", [
    ("https://github.com/example/dlion-jax",
     "dlion_jax[examples] @ git+https://github.com/example/dlion-jax"),
    ("git+https://github.com/example/dlion-jax@v0.3.0",
     "dlion_jax[examples] @ git+https://github.com/example/dlion-jax@v0.3.0"),
    ("CLONE", "CLONE[examples]"),
])
def test_install_cell_outside_a_clone_installs_from_the_repository(
    tmp_path, monkeypatch, repository, requirement):
  """Was: outside a clone the cell raised (Colab opens the notebook alone).
  Now it pip-installs dlion_jax from the repository given (no network
  here: pip is not run)."""
  repo = str(NOTEBOOK.parent.parent.resolve())
  _missing(monkeypatch, "dlion_jax", "flax")
  calls = []
  monkeypatch.setattr(subprocess, "check_call", calls.append)
  _in_colab(tmp_path, monkeypatch, repository.replace("CLONE", repo))
  assert calls == [[sys.executable, "-m", "pip", "install", "-q",
                    requirement.replace("CLONE", repo)]]


def test_install_cell_outside_a_clone_says_what_to_do(tmp_path, monkeypatch):
  _missing(monkeypatch, "flax")
  monkeypatch.setattr(subprocess, "check_call", pytest.fail)
  with pytest.raises(RuntimeError, match=r"missing: flax\. Set REPOSITORY "
                     r"above to the URL of the repository this notebook comes "
                     r"from \(its GitHub URL\) or to a clone's path, and run "
                     r"this cell again; or run the notebook from notebooks/ "
                     r"in a clone, or install dlion_jax first: pip install -e "
                     r'"\.\[examples\]" in the clone\.'):
    _in_colab(tmp_path, monkeypatch)


def test_install_cell_does_nothing_where_installed(tmp_path, monkeypatch,
                                                   capsys):
  monkeypatch.setattr(subprocess, "check_call", pytest.fail)
  _in_colab(tmp_path, monkeypatch, "https://github.com/example/dlion-jax")
  assert capsys.readouterr().out == (
      "dlion_jax and its [examples] extra are installed\n")


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
