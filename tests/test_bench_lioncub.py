"""The Lion Cub study's machinery, on seconds-long versions of its runs."""

import json

import pytest

pytest.importorskip("flax", reason="the study trains with the [examples] "
                    "extra (flax, orbax-checkpoint, pyyaml, scikit-learn)")

from benchmarks import lioncub  # noqa: E402  pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.integration


def table_rows(text):
  """variant -> its cells, from the markdown tables in ``text``."""
  rows = {}
  for line in text.splitlines():
    if line.startswith("| ") and not line.startswith("|---"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells
  return rows


def test_study_reports_every_variant_and_plots(tmp_path):
  variants = ["global Lion (fp32 all-reduce)", "D-Lion MaVo", "Avg, 4-bit",
              "MaVo + bias momenta synced every step"]
  text = lioncub.main(["--tasks", "digits", "--workers", "2", "3", "--seeds",
                       "0", "--variants", *variants, "--plot",
                       str(tmp_path / "study"), "--json",
                       str(tmp_path / "runs.json")])
  rows = table_rows(text)
  assert set(variants) <= set(rows)
  bits = {v: float(rows[v][6]) for v in variants}       # N=3 bits column
  assert bits["global Lion (fp32 all-reduce)"] > 40     # 2(N-1)/N * 32
  assert bits["D-Lion MaVo"] < 3
  assert bits["D-Lion MaVo"] < bits["MaVo + bias momenta synced every step"]
  assert bits["D-Lion MaVo"] < bits["Avg, 4-bit"] < 16
  assert (tmp_path / "study_digits.png").stat().st_size > 10_000
  assert rows["global Lion (fp32 all-reduce)"][2] == "+0.00"


def test_step_cost_table_reads_bytes_off_hlo():
  text = lioncub.step_cost(2, 2, dim=32, depth=1)
  rows = table_rows(text)
  assert set(lioncub.STEP_VARIANTS) <= set(rows)
  every = {k: float(v[3]) for k, v in rows.items()
           if k in lioncub.STEP_VARIANTS}
  # Exact small leaves cost 64 bits each at N=2 instead of ~1: more bits.
  assert every["MaVo, min_compress_size=1024"] > every[
      "MaVo (min_compress_size=0)"]
  # fp32 pmean at N=2: 2 (N - 1) / N * 32 bits.
  assert float(rows["MaVo + sync every step"][4]) == pytest.approx(
      32.0, rel=0.01)


def test_report_rewrites_only_its_section(tmp_path):
  doc = tmp_path / "lioncub.md"
  doc.write_text("prose before\n<!-- bench.lioncub study: begin -->\nold\n"
                 "<!-- bench.lioncub study: end -->\nprose after\n")
  runs = tmp_path / "runs.json"
  runs.write_text(json.dumps([
      {"task": "digits", "variant": v, "workers": 2, "seed": s,
       "metric": m, "bits": b, "steps": 40, "seconds": 1.0}
      for v, m, b in [("global Lion (fp32 all-reduce)", 0.9, 32.0),
                      ("D-Lion MaVo", 0.8, 1.0)] for s in (0, 1)]))
  lioncub.main(["--from-json", str(runs), "--out", str(doc)])
  text = doc.read_text()
  assert text.startswith("prose before\n") and text.endswith("prose after\n")
  assert "old" not in text
  assert table_rows(text)["D-Lion MaVo"][1:3] == ["80.00 ± 0.00", "-10.00"]
