"""bench.compile: the compile-time table runs and reports what it measured."""

import re

import pytest

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
