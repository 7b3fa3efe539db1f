"""benchmarks.convergence's machinery on a seconds-long task (digits)."""

import json

import pytest

pytest.importorskip("flax", reason="the study trains with the [examples] "
                    "extra (flax, orbax-checkpoint, pyyaml, scikit-learn)")

from benchmarks import convergence  # noqa: E402  pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.integration

ROWS = ["SGD momentum", "D-Lion MaVo", "global Lion"]


def table(text, first_cell):
  """The cells of the markdown row starting with ``first_cell``."""
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and cells[0] == first_cell:
      return cells
  raise AssertionError(f"no row {first_cell!r} in:\n{text}")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("convergence")
  raw = tmp / "runs.json"
  text = convergence.main([
      "--tasks", "digits", "--rows", *ROWS, "--workers", "2", "3",
      "--seeds", "0", "1", "--tune-workers", "2", "--json", str(raw),
      "--plot", str(tmp / "conv.png")])
  return text, json.loads(raw.read_text()), tmp


def test_every_row_is_tuned_until_its_pick_is_interior(study):
  _, runs, _ = study
  for row in ROWS:
    tune = [r for r in runs if r["row"] == row and r["phase"] == "tune"]
    axes = convergence.TASKS["digits"].axes(row)
    assert {r["lr"] for r in tune} >= set(axes["lr"].start)
    assert {r["wd"] for r in tune} == {axes["wd"].start[0]}  # not tuned here
    assert {r["seed"] for r in tune} == {100}      # not a reported seed
    best = max(tune, key=lambda r: r["metric"])
    lrs = sorted(r["lr"] for r in tune)
    # Interior: tried on both sides, or at the ladder's end (a bound).
    assert (lrs[0] < best["lr"] < lrs[-1]
            or best["lr"] in (axes["lr"].ladder[0], axes["lr"].ladder[-1]))
    assert convergence.beyond_edges(runs, "digits", row) == []
    evals = [r for r in runs if r["row"] == row and r["phase"] == "eval"]
    assert sorted((r["workers"], r["seed"]) for r in evals) == [
        (2, 0), (2, 1), (3, 0), (3, 1)]
    assert {(r["lr"], r["wd"]) for r in evals} == {(best["lr"], best["wd"])}


def test_report_matches_the_runs(study):
  text, runs, tmp = study
  for row in ROWS:
    cells = table(text, row)
    mine = [r["metric"] * 100 for r in runs
            if r["row"] == row and r["phase"] == "eval" and r["workers"] == 3]
    assert cells[2] == (f"{sum(mine) / 2:.2f} ± "
                        f"{(max(mine) - min(mine)) / 2:.2f}")
  # Sign votes cost ~1.4 bits at N=3, an fp32 all-reduce 2(N-1)/N * 32.
  assert float(table(text, "D-Lion MaVo")[3].split()[0]) < 2
  assert float(table(text, "global Lion")[3].split()[0]) > 40
  assert "D-Lion MaVo is" in text and "than global Lion" in text
  assert (tmp / "conv.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_trains_nothing_twice_and_from_json_rerenders(study, tmp_path,
                                                             monkeypatch):
  text, runs, tmp = study
  copy = tmp_path / "runs.json"
  copy.write_text(json.dumps(runs))
  monkeypatch.setattr(convergence.study, "train", lambda *a: pytest.fail(
      "a saved run was trained again"))
  convergence.main(["--tasks", "digits", "--rows", *ROWS, "--workers", "2",
                    "3", "--seeds", "0", "1", "--tune-workers", "2",
                    "--json", str(copy), "--resume"])
  doc = tmp_path / "doc.md"
  doc.write_text("before\n<!-- bench.convergence: begin -->\n"
                 "<!-- bench.convergence: end -->\nafter\n")
  out = convergence.main(["--from-json", str(tmp / "runs.json"),
                          "--out", str(doc)])
  assert table(out, "global Lion") == table(text, "global Lion")
  body = doc.read_text()
  assert body.startswith("before\n") and body.endswith("after\n")


def test_a_study_cut_short_still_reports(study):
  _, runs, _ = study
  tuned_only = [r for r in runs if r["phase"] == "tune"][:4]
  text = convergence.report(tuned_only, "partial")
  assert "tuned only" in text and "Grid (N=2, seed 100;" in text


def test_a_diverged_run_ranks_last():
  task = convergence.TASKS["digits"].task
  run = convergence.study.train(task, {"optimizer.name": "sgd",
                                       "optimizer.learning_rate": 1e12}, 2, 0)
  assert run["diverged"] and run["metric"] == float("-inf")
  runs = [dict(task="digits", phase="tune", row="SGD momentum", lr=lr, wd=0,
               metric=m) for lr, m in ((1e12, run["metric"]), (0.1, 0.1))]
  assert convergence.best_setting(runs, "digits", "SGD momentum") == {
      "lr": 0.1, "wd": 0}


def test_resume_needs_json():
  with pytest.raises(SystemExit):
    convergence.parse_args(["--resume"])
