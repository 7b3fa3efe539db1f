"""The user guides of docs/guides/ run as written: each guide's ``>>>``
examples, in one namespace per guide, print what the guide says they print.

Code blocks without prompts (commands, scripts for several processes or a
TPU) are not run as examples; the multi-host guide's training scripts run
on 2 processes. The guides need the 8 simulated CPU devices of
tests/conftest.py.
"""

import doctest
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

GUIDES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides"
# Each guide, and the packages beyond jax and optax that its examples import.
REQUIRES = {
    "optax_lion.md": (),
    "flax_nnx.md": ("flax",),
    "linen_train_state.md": ("flax",),
    "pmap.md": (),
    "sharded.md": (),
    "multihost_tpu.md": (),
    "checkpoints.md": ("orbax.checkpoint", "flax"),
    "wire_bytes.md": (),
    "faulty_workers.md": (),
}


def test_the_guides_are_the_nine_expected():
  assert sorted(p.name for p in GUIDES.glob("*.md")) == sorted(REQUIRES)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REQUIRES))
def test_guide_examples_print_what_they_say(name):
  for module in REQUIRES[name]:
    if importlib.util.find_spec(module.split(".")[0]) is None:
      pytest.skip(f"{name} needs {module} (the [examples] extra)")
  result = doctest.testfile(
      str(GUIDES / name), module_relative=False, encoding="utf-8",
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
      raise_on_error=False, verbose=False)
  assert result.attempted > 0, f"{name} runs no example"
  assert result.failed == 0, (
      f"{result.failed} of the {result.attempted} examples of {name} failed "
      "(doctest printed each above)")


def _scripts(name: str) -> dict[str, str]:
  """The guide's scripts without prompts, by the file name their first
  line gives (``# train_multihost.py: ...``)."""
  text = (GUIDES / name).read_text(encoding="utf-8")
  blocks = re.findall(r"```python\n(# (\S+\.py):.*?)```", text, re.S)
  return {file: code for code, file in blocks}


@pytest.mark.integration
def test_the_multihost_scripts_train_alike_on_two_processes(tmp_path):
  """The multi-host guide's two scripts, the shard_axis step and the plain
  jitted step, run as written on 2 processes x 4 CPU devices (the guide's
  launcher line): each prints its loss line, and they end with the same
  params bit for bit."""
  scripts = _scripts("multihost_tpu.md")
  assert sorted(scripts) == ["train_multihost.py", "train_multihost_plain.py"]
  root = GUIDES.parents[1]
  outs, lines = [], []
  for file, code in sorted(scripts.items()):
    out = tmp_path / f"{file}.npy"
    (tmp_path / file).write_text(
        code + "\nfrom jax.experimental import multihost_utils\n"
        "w = multihost_utils.process_allgather(params['w'], tiled=True)\n"
        f"if jax.process_index() == 0:\n  np.save({str(out)!r}, w)\n")
    run = subprocess.run(
        [sys.executable, "-m", "dlion_jax.launch", "-n", "2", "--timeout",
         "150", "--", sys.executable, str(tmp_path / file)],
        capture_output=True, text=True, timeout=180, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.findall(r"2 processes, mesh \{'data': 2, 'fsdp': 4\}, "
                       r"loss (\d+\.\d+)", run.stdout)
    assert len(found) == 1, run.stdout
    lines.append(found[0])
    outs.append(np.load(out))
  assert lines[0] == lines[1]
  np.testing.assert_array_equal(outs[0], outs[1])
  assert np.abs(outs[0]).sum() > 0
