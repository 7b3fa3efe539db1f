"""The user guides of docs/guides/ run as written: each guide's ``>>>``
examples, in one namespace per guide, print what the guide says they print.

Code blocks without prompts (commands, scripts for several processes or a
TPU) are not run as examples; the multi-host guide's training scripts run
on 2 processes. The guides need the 8 simulated CPU devices of
tests/conftest.py. A guide's pointer to a section of the README or of
another page names a heading that is there.
"""

import doctest
import importlib.util
import itertools
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


# A guide's pointer to another page's section: the README's "Title" (or
# *Title*), or docs/page.md (or [page](../page.md)), section N[, "Title"].
README_REF = re.compile(r"README's\s+(?:\"([^\"]+)\"|\*([^*]+)\*)")
SECTION_REF = re.compile(
    r"(?:docs/|\]\(\.\./)([\w/]+\.md)`?\)?[,;]?\s*\(?section\s+"
    r"(\d+(?:\.\d+)*)(?:[,;]?\s*\(?\"([^\"]+)\")?")


def _headings(page: pathlib.Path) -> list[tuple[int, str]]:
  """Each heading of ``page``: its level and its text."""
  return [(len(m[1]), m[2].strip()) for m in re.finditer(
      r"^(#+) (.*)$", page.read_text(encoding="utf-8"), re.M)]


def _section(headings: list[tuple[int, str]], number: str) -> list[str]:
  """The headings of section ``number`` (``5.1``): its own, then those
  under it until the next of its level or above; empty where none is."""
  for i, (level, text) in enumerate(headings):
    if re.match(rf"{re.escape(number)}\.?\s", text):
      rest = [t for _, t in itertools.takewhile(
          lambda h: h[0] > level, headings[i + 1:])]
      return [text, *rest]
  return []


def _dangling(text: str, root: pathlib.Path) -> list[str]:
  """The references of ``text`` (whitespace folded) to a section of the
  README or of a page of docs/ that names no heading there."""
  readme = [t for _, t in _headings(root / "README.md")]
  bad = [f"README's {title!r}" for m in README_REF.finditer(text)
         for title in [m[1] or m[2]] if title not in readme]
  for page, number, title in SECTION_REF.findall(text):
    found = _section(_headings(root / "docs" / page), number)
    if not found or (title and not any(title in h for h in found)):
      bad.append(f"{page}, section {number}"
                 + (f" {title!r}" if title else ""))
  return bad


def test_the_guides_cite_sections_that_exist():
  """Every guide's reference to a section of the README or of a page of
  docs/ names a heading there, by its number and title (was: the optax
  guide cited the README's "Tune `b2`", a section the README's rewrite
  removed)."""
  root = GUIDES.parents[1]
  texts = {p.name: re.sub(r"\s+", " ", p.read_text(encoding="utf-8"))
           for p in sorted(GUIDES.glob("*.md"))}
  cited = sum(len(SECTION_REF.findall(t)) + len(README_REF.findall(t))
              for t in texts.values())
  assert cited >= 5
  assert {name: bad for name, text in texts.items()
          if (bad := _dangling(text, root))} == {}
  stale = ('beaten by `b2 = 0.9` (the README\'s "Tune `b2`"); see '
           "docs/benchmarks.md, section 5.9")
  assert _dangling(stale, root) == ["README's 'Tune `b2`'",
                                    "benchmarks.md, section 5.9"]
