"""bench.compile: the compile-time table runs and reports what it measured;
docs/benchmarks.md's table is what the code compiles now."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from dlion_jax import devices
from dlion_jax.bench import compile as compile_bench

pytestmark = pytest.mark.integration


def test_compile_table_has_every_variant_and_its_ratio(tmp_path):
  out = tmp_path / "compile.md"
  text = compile_bench.main(["--leaves", "3", "7", "--reps", "1",
                             "--out", str(out)])
  assert out.read_text().strip() == text.strip()
  rows = [r for r in text.splitlines() if re.match(r"\| \d+ \|", r)]
  assert len(rows) == 6
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    leaves, name, traced, compiled, r_trace, r_compile = cells[:6]
    assert float(traced) > 0 and float(compiled) > 0
    if name == compile_bench.BASELINE:
      assert r_trace == r_compile == "1.00x"
    else:                              # votes send far less than fp32
      assert float(cells[7].replace(",", "")) > 0
  sent = {c[1].strip(): float(c[7].replace(",", ""))
          for c in (r.strip("|").split("|") for r in rows if "| 7 |" in r)}
  assert sent["dlion mavo auto"] < sent[compile_bench.BASELINE] / 10


def test_leaf_sizes_are_seeded_and_in_range():
  sizes = compile_bench.leaf_sizes(50)
  assert sizes == compile_bench.leaf_sizes(50)
  assert min(sizes) >= 1 and max(sizes) <= 3000


def _compiled_text():
  def f(x):                       # a new function: a trace of its own
    return jnp.sin(x) * 2 + jnp.cos(x)
  return jax.jit(f).lower(jnp.ones(8)).compile().as_text()


def _through_two_frames():
  return _through_one_frame()


def _through_one_frame():
  return _compiled_text()


def test_hlo_lines_do_not_depend_on_the_call_stack_that_traced_the_step():
  """XLA heads the compiled text with tables of the Python frames that
  traced it (under pytest, more): the table's HLO lines leave them out."""
  with compile_bench.uncached():     # the tests' cache: one text for both
    shallow, deep = _compiled_text(), _through_two_frames()
  assert shallow.count("\n") < deep.count("\n")
  assert (compile_bench.program_lines(shallow)
          == compile_bench.program_lines(deep))
  tables = re.findall(r"^(?:FileNames|FunctionNames|FileLocations|"
                      r"StackFrames)\n(?:.+\n)*\n", shallow, re.M)
  assert len(tables) == 4
  assert compile_bench.program_lines(shallow) == len(
      shallow.splitlines()) - sum(t.count("\n") for t in tables)


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "docs" / (
    "benchmarks.md")
SECTION = "### Compile time (`dlion_jax.bench.compile`)"


def documented_table() -> tuple[str, dict]:
  """docs/benchmarks.md's bench.compile table: the jax version it names and
  ``{(leaves, step): (compiled HLO lines, bytes sent a step)}``, the
  columns that do not depend on timing."""
  text = BENCHMARKS.read_text()
  section = text[text.index(SECTION):]
  version = re.search(r"jax (\d+\.\d+\.\d+)", section)[1]
  lines = section[section.index("| leaves | step |"):].splitlines()
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  rows = {}
  for line in lines[2:]:
    if not line.startswith("|"):
      break
    cell = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
    rows[cell["leaves"], cell["step"]] = (
        int(cell["compiled HLO lines"].replace(",", "")),
        int(cell["bytes sent a step"].replace(",", "")))
  return version, rows


def compiled_now(leaves: int, step: str) -> tuple[int, int]:
  """What the code compiles for a row of the table, as the bench does."""
  mesh = devices.data_mesh(8, axis_name=compile_bench.AXIS)
  if step.startswith("GPT train step, "):
    pytest.importorskip("flax")
    name = step.removeprefix("GPT train step, ")
    t = compile_bench.time_gpt_step(name, compile_bench.gpt_variants()[name],
                                    mesh)
  else:
    tx, pmean = compile_bench.variants()[step]
    t = compile_bench.time_one(step, tx, pmean, mesh,
                               compile_bench.leaf_sizes(int(leaves)))
  return t.hlo_lines, round(t.sent_bytes)


def _rows(want_leaves):
  version, rows = documented_table()
  if jax.__version__ != version:
    pytest.skip(f"the table is of jax {version}, this is {jax.__version__}")
  picked = [(k, v) for k, v in rows.items() if want_leaves(k[0])]
  assert picked
  return picked


def test_documented_compile_table_matches_what_compiles_now():
  """The 100-leaf D-Lion MaVo row (the cheapest that votes): the HLO lines
  and the bytes each worker sends, read off the step the code compiles
  now, are the table's. A change that moves them must re-measure the
  table (``python -m dlion_jax.bench.compile --leaves 100 400 1000
  --gpt``); ``-m slow`` checks every row."""
  picked = [((leaves, step), want) for (leaves, step), want
            in _rows(lambda n: n == "100") if step == "dlion mavo auto"]
  assert len(picked) == 1
  for (leaves, step), want in picked:
    assert compiled_now(leaves, step) == want, (leaves, step)


@pytest.mark.slow
def test_documented_compile_table_matches_what_compiles_now_every_row():
  for (leaves, step), want in _rows(lambda n: True):
    assert compiled_now(leaves, step) == want, (leaves, step)
