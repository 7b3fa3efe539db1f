"""benchmarks.overlap: the whole step, buckets against one message."""

import pytest

from benchmarks import overlap

pytestmark = pytest.mark.integration


def test_tiny_run_times_every_budget_and_counts_its_collectives(tmp_path):
  out = tmp_path / "overlap.md"
  text = overlap.main(["--params", "tiny", "--rates", "none", "--steps", "2",
                       "--warmup", "1", "--budgets", "0", "1000",
                       "--json", str(tmp_path / "o.json"), "--out",
                       str(out)])
  rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")]
          for line in text.splitlines() if line.startswith("| 2 |")}
  assert set(rows) == {"one message", "buckets of 1,000 B"}
  one, buckets = rows["one message"], rows["buckets of 1,000 B"]
  assert int(buckets[4]) > int(one[4])          # more collectives
  assert float(one[6]) > 0                      # compile s
  assert one[8].startswith("1.000")             # its own ratio
  assert out.read_text().strip() == text.strip()


def test_merge_takes_the_slowest_process_and_pairs_rounds():
  results = [{"runs": [{"budget": None, "times": [9, 1, 2], "sent": 10,
                        "collectives": 2, "compile_s": 1.0},
                       {"budget": 5, "times": [9, 1, 1], "sent": 12,
                        "collectives": 4, "compile_s": 2.0}]},
             {"runs": [{"budget": None, "times": [9, 2, 2], "sent": 10,
                        "collectives": 2, "compile_s": 1.0},
                       {"budget": 5, "times": [9, 1, 3], "sent": 12,
                        "collectives": 4, "compile_s": 2.0}]}]
  one, buckets = overlap.merge(results, warmup=1)
  assert one["median_s"] == 2 and one["ratios"] == [1, 1]
  assert buckets["ratios"] == [0.5, 1.5] and buckets["median_s"] == 2
  assert buckets["compile_s"] == 2.0
