"""benchmarks.convergence's machinery on a seconds-long task (digits)."""

import glob
import json
import os
import sysconfig

import pytest

pytest.importorskip("flax", reason="the study trains with the [examples] "
                    "extra (flax, orbax-checkpoint, pyyaml, scikit-learn)")

import dlion_jax as dl  # noqa: E402  pylint: disable=g-import-not-at-top
from benchmarks import convergence  # noqa: E402  pylint: disable=g-import-not-at-top
from benchmarks import study as study_lib  # noqa: E402  pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.integration

ROWS = ["D-Lion MaVo", "global Lion"]


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
      "--tasks", "digits", "--rows", *ROWS, "--workers", "3",
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
    assert convergence.untried_neighbours(runs, "digits", row) == []
    evals = [r for r in runs if r["row"] == row and r["phase"] == "eval"]
    assert sorted((r["workers"], r["seed"]) for r in evals) == [
        (3, 0), (3, 1)]
    assert {(r["lr"], r["wd"]) for r in evals} == {(best["lr"], best["wd"])}


def test_report_matches_the_runs(study):
  text, runs, tmp = study
  for row in ROWS:
    cells = table(text, row)
    mine = [r["metric"] * 100 for r in runs
            if r["row"] == row and r["phase"] == "eval" and r["workers"] == 3]
    assert cells[1] == (f"{sum(mine) / 2:.2f} ({min(mine):.2f}-"
                        f"{max(mine):.2f})")
  # Sign votes cost ~1.4 bits at N=3, an fp32 all-reduce 2(N-1)/N * 32.
  assert float(table(text, "D-Lion MaVo")[2].split()[0]) < 2
  assert float(table(text, "global Lion")[2].split()[0]) > 40
  assert "D-Lion MaVo is" in text and "than global Lion" in text
  assert (tmp / "conv.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_trains_nothing_twice_and_from_json_rerenders(study, tmp_path,
                                                             monkeypatch):
  text, runs, tmp = study
  copy = tmp_path / "runs.json"
  copy.write_text(json.dumps(runs))
  monkeypatch.setattr(convergence.study, "train", lambda *a: pytest.fail(
      "a saved run was trained again"))
  convergence.main(["--tasks", "digits", "--rows", *ROWS, "--workers", "3",
                    "--seeds", "0", "1", "--tune-workers", "2",
                    "--json", str(copy), "--resume"])
  doc = tmp_path / "doc.md"
  doc.write_text("before\n<!-- bench.convergence: begin -->\n"
                 "<!-- bench.convergence: end -->\nafter\n")
  out = convergence.main(["--from-json", str(tmp / "runs.json"),
                          "--out", str(doc)])
  assert table(out, "global Lion") == table(text, "global Lion")
  body = doc.read_text()
  assert body.startswith("before\n") and body.endswith("after\n")


def test_plot_bits_without_local_steps_runs_says_so(study, tmp_path):
  """Runs with no evaluated local-steps task (a study cut short, or the
  wrong file): a clear error naming the tasks, not matplotlib's."""
  _, runs, _ = study
  saved = tmp_path / "runs.json"
  saved.write_text(json.dumps(runs))
  with pytest.raises(SystemExit) as err:
    convergence.main(["--from-json", str(saved), "--plot-bits",
                      str(tmp_path / "bits.png")])
  assert "--plot-bits" in str(err.value)
  assert "mlp_local_steps" in str(err.value)
  assert not (tmp_path / "bits.png").exists()


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


def fake_train(best_lr, best_b2=0.99):
  """A study.train stand-in for charlm_long (lower is better) whose metric
  is least at (best_lr, best_b2)."""
  import math  # pylint: disable=g-import-not-at-top
  def train(task, overrides, workers, seed):
    lr = overrides["optimizer.learning_rate"]
    b2 = overrides.get("optimizer.b2", 0.99)
    metric = abs(math.log10(lr / best_lr)) + abs(b2 - best_b2)
    return {"workers": workers, "seed": seed, "metric": metric, "bits": 1.0,
            "steps": 1, "seconds": 0.0, "diverged": False, "curve": []}
  return train


@pytest.mark.parametrize("best_lr, best_b2", [(1e-2, 0.95), (1e-4, 0.999),
                                              (1e-3, 0.98)])
def test_tuning_walks_past_edge_picks_to_an_interior_one(monkeypatch, best_lr,
                                                         best_b2):
  """A synthetic metric surface: the grid starts at lr 3e-4/1e-3 and b2
  0.95/0.98/0.99 and must walk to the optimum, on lr and on b2."""
  monkeypatch.setattr(convergence.study, "train",
                      fake_train(best_lr, best_b2))
  runs = []
  pick = convergence.tune(runs, {}, "charlm_long", "global Lion", 8, 100)
  assert pick == {"lr": best_lr, "wd": 0.01, "b2": best_b2}
  assert convergence.untried_neighbours(runs, "charlm_long",
                                        "global Lion") == []
  lrs = sorted({r["lr"] for r in runs if r["b2"] == best_b2})
  assert lrs[0] < best_lr < lrs[-1]              # tried on both sides
  assert convergence.pick_status(runs, "charlm_long", "global Lion") == (
      "b2 at bound 0.999" if best_b2 == 0.999 else "interior")
  assert len({(r["lr"], r["b2"]) for r in runs}) == len(runs)  # none twice


def table_train(metrics):
  """A study.train stand-in reading the metric of (lr, b2) off a table
  (3.0 where the table has none)."""
  def train(task, overrides, workers, seed):
    key = (overrides["optimizer.learning_rate"], overrides["optimizer.b2"])
    return {"workers": workers, "seed": seed, "metric": metrics.get(key, 3.0),
            "bits": 1.0, "steps": 1, "seconds": 0.0, "diverged": False,
            "curve": []}
  return train


def test_tuning_finds_a_better_point_on_the_diagonal(monkeypatch):
  # charlm_long's global Lion as first run: the pick (1e-3, 0.95) was
  # interior along lr and along b2, but (3e-3, 0.9), one rung on both at
  # once, is better. Checking one setting at a time stops short of it.
  metrics = {(3e-4, 0.95): 2.61, (3e-4, 0.98): 2.85, (3e-4, 0.99): 3.24,
             (1e-3, 0.9): 2.31, (1e-3, 0.95): 2.26, (1e-3, 0.98): 2.68,
             (1e-3, 0.99): 2.91, (3e-3, 0.95): 2.29, (3e-3, 0.9): 2.20}
  monkeypatch.setattr(convergence.study, "train", table_train(metrics))
  runs = []
  pick = convergence.tune(runs, {}, "charlm_long", "global Lion", 8, 100)
  assert pick == {"lr": 3e-3, "wd": 0.01, "b2": 0.9}
  tried = {(r["lr"], r["b2"]) for r in runs}
  assert {(1e-2, 0.9), (1e-2, 0.95), (1e-3, 0.9)} <= tried
  # The best run at each first-grid b2 is tuned in lr as well: at 0.99 the
  # line was still falling at 1e-3, so 3e-3 is tried.
  assert (3e-3, 0.99) in tried
  assert convergence.untried_neighbours(runs, "charlm_long",
                                        "global Lion") == []


def test_a_pick_at_a_ladder_end_stops_there_and_says_so(monkeypatch):
  monkeypatch.setattr(convergence.study, "train", fake_train(10.0))
  runs = []
  pick = convergence.tune(runs, {}, "charlm_long", "Signum (majority vote)",
                          8, 100)
  assert pick["lr"] == convergence.SIGN_LRS[-1]
  assert convergence.pick_status(runs, "charlm_long",
                                 "Signum (majority vote)") == "lr at bound 0.1"
  assert "b2" not in pick                        # Signum's b2 is its b1


def test_breakdown_names_the_first_n_and_the_rows_that_hold():
  def run(row, n, metric):
    return dict(task="mlp_many_workers", phase="eval", row=row, workers=n,
                seed=0, metric=metric, diverged=False)
  runs = [run("global Lion", n, 0.88) for n in (4, 8, 16, 32)]
  runs += [run("D-Lion MaVo", n, m) for n, m in ((4, 0.88), (8, 0.875),
                                                 (16, 0.865), (32, 0.85))]
  runs += [run("MaVo, 4-bit", n, 0.875) for n in (4, 8, 16, 32)]
  line, = convergence.breakdown(runs, "mlp_many_workers")
  assert "N=16** (-1.50)" in line and "MaVo, 4-bit (-0.50)" in line
  assert "stays within" in convergence.breakdown(runs[:4] + runs[4:6] + [
      run("global Lion", 2, 0.9), run("D-Lion MaVo", 2, 0.9)],
      "mlp_many_workers")[0]


def test_a_run_keeps_its_test_curve_and_the_curves_plot(tmp_path):
  import dataclasses  # pylint: disable=g-import-not-at-top
  task = dataclasses.replace(convergence.TASKS["digits"].task, curve_points=3)
  run = convergence.study.train(task, {"optimizer.name": "lion",
                                       "optimizer.learning_rate": 0.03}, 2, 0)
  assert [step for step, _ in run["curve"]] == [10, 20, 30]
  assert run["curve"][-1][1] == run["metric"]
  runs = [dict(task="digits", phase="eval", row=row, workers=2, seed=0,
               curve=run["curve"]) for row in ("global Lion", "D-Lion MaVo")]
  runs.append(dict(runs[0], row="D-Lion Avg",
                   curve=[[s, m / 2] for s, m in run["curve"]]))
  lines = {row: (seeds, twin) for row, _, _, seeds, twin
           in convergence.mean_curves(runs, "digits", 2)}
  # The second of two equal rows names the first; the halved one is its own.
  assert lines == {"D-Lion MaVo": (1, None), "D-Lion Avg": (1, None),
                   "global Lion": (1, "D-Lion MaVo")}
  convergence.plot_curves(runs, str(tmp_path / "curves.png"))
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_long_lm_reads_python_sources_and_tests_on_a_slice(
    tmp_path, monkeypatch):
  monkeypatch.setattr(study_lib.tempfile, "gettempdir", lambda: str(tmp_path))
  task = convergence.TASKS["charlm_long"].task
  overrides = task.overrides_for(8, 0)
  path = overrides[-1].removeprefix("data.path=")
  sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"],
                                          "*.py")))
  assert path.startswith(str(tmp_path))
  with open(path, "rb") as f:
    corpus = f.read()
  assert corpus == b"".join(open(s, "rb").read() for s in sources)
  assert len(corpus) > 1_000_000       # not memorized in 1,500 steps
  assert "data.limit_test=1024" in overrides


def test_matched_learning_rates_run_beside_the_picks_and_are_reported(
    monkeypatch, tmp_path):
  # global Lion picks 1e-3 and MaVo 3e-3; each also runs at the other's.
  def train(task, overrides, workers, seed):
    lr = overrides["optimizer.learning_rate"]
    mavo = overrides.get("optimizer.aggregation") == "mavo"
    metric = 0.85 + (0.01 if lr == (3e-3 if mavo else 1e-3) else 0) + (
        0.001 * workers) + 0.002 * mavo
    return {"workers": workers, "seed": seed, "metric": metric, "bits": 2.0,
            "steps": 1, "seconds": 0.0, "diverged": False, "curve": []}
  monkeypatch.setattr(convergence.study, "train", train)
  runs = convergence.run_study(["mlp_many_workers"], ["global Lion",
                                                      "D-Lion MaVo"],
                               [4, 8], [0], 8, 100)
  evals = {(r["row"], r["lr"], r["workers"]) for r in runs
           if r["phase"] == "eval"}
  assert evals == {(row, lr, n) for row in ("global Lion", "D-Lion MaVo")
                   for lr in (1e-3, 3e-3) for n in (4, 8)}
  text = convergence.matched_table(runs, "mlp_many_workers")
  rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
          [c.strip() for c in line.strip("|").split("|")[2:]]
          for line in text.splitlines() if line.startswith("| 0.00")}
  assert rows[("0.001", "global Lion")] == ["86.40 ± 0.00", "86.80 ± 0.00"]
  assert rows[("0.001", "D-Lion MaVo - global Lion")] == ["-0.80", "-0.80"]
  assert rows[("0.003", "D-Lion MaVo - global Lion")] == ["+1.20", "+1.20"]
  # The main table reports each row at its own pick only.
  summary = convergence.summary_table(runs, "mlp_many_workers")
  assert ("| global Lion | 86.40 (86.40-86.40) | 86.80 (86.80-86.80) |"
          in summary)
  assert ("| D-Lion MaVo | 86.60 (86.60-86.60) | 87.00 (87.00-87.00) |"
          in summary)
  convergence.plot(runs, str(tmp_path / "n.png"))   # picks and matched lrs
  assert (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"


def test_saved_runs_on_another_text_are_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(study_lib.tempfile, "gettempdir", lambda: str(tmp_path))
  here = study_lib.text_id(study_lib.python_stdlib_text())
  assert here.endswith(tuple("0123456789abcdef")) and "bytes" in here
  same = [dict(task="charlm_long", text=here)]
  convergence.check_saved_text(same, ["charlm_long"])
  for other in ("4,700,000 bytes, sha256 00", None):
    with pytest.raises(convergence.SavedRunsMismatch,
                       match="another text .* another --json"):
      convergence.check_saved_text(same + [dict(same[0], text=other)],
                                   ["charlm_long", "digits"])
  convergence.check_saved_text([dict(task="digits")], ["digits"])


# One task of each (config, overrides, text): the others differ in length.
DISTINCT_TASKS = list({(t.task.config, t.task.overrides, t.task.text): name
                       for name, t in sorted(convergence.TASKS.items())
                       }.values())


# The quick tasks in CI, the others (the same code on bigger models) slow.
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in (
        "digits_local_steps", "charlm_long_x4_local_steps")
                 else pytest.mark.slow) for name in DISTINCT_TASKS])
def test_every_task_trains_a_few_steps(name, tmp_path, monkeypatch):
  """The fast version of each study: its task's config and overrides train
  2 steps at N = 2 (Fashion-MNIST tested on 500 images)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import data  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(study_lib.tempfile, "gettempdir", lambda: str(tmp_path))
  task = convergence.TASKS[name].task
  if task.config.startswith("fashion") and not os.path.isdir(
      data.FASHION_MNIST_PATH):
    pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
  limit = ("data.limit_test=500",) if task.config.startswith("fashion") else ()
  fast = dataclasses.replace(task, epochs=None, steps=2,
                             overrides=task.overrides + limit)
  row = convergence.ROWS["D-Lion MaVo"]
  run = study_lib.train(fast, {**row, "optimizer.learning_rate": 1e-3}, 2, 0)
  assert run["steps"] == 2 and not run["diverged"]
  assert 0 < run["bits"] < 4                     # a vote, not fp32
  assert ("text" in run) == (task.text is not None)


def test_local_steps_rows_report_the_vote_against_diloco(monkeypatch,
                                                          tmp_path):
  """The local-steps task's rows train, send what their H says, and the
  report and plot compare them (each row at one point: its first values)."""
  rows = ["D-Lion MaVo", "D-Lion outer, H=8", "DiLoCo outer, H=8",
          "EF sparse 1/32, H=8"]
  for row in rows:
    monkeypatch.setitem(convergence.AXES, row, {
        name: axis.fixed() for name, axis in convergence.AXES[row].items()})
  text = convergence.main([
      "--tasks", "digits_local_steps", "--rows", *rows, "--seeds", "0",
      "--tune-workers", "4", "--plot-bits", str(tmp_path / "bits.png")])
  every = float(table(text, "D-Lion MaVo")[2].split()[0])
  vote = float(table(text, "D-Lion outer, H=8")[2].split()[0])
  mean = float(table(text, "DiLoCo outer, H=8")[2].split()[0])
  # 32 steps, 4 outer steps: an eighth of what a step would send (and the
  # loss's mean and padding of the 2,442-parameter message).
  assert every / 8 < vote < every / 6
  assert mean == pytest.approx(dl.allreduce_bits(4) / 8, rel=0.02)
  sparse = float(table(text, "EF sparse 1/32, H=8")[2].split()[0])
  # The words, and on this 2,442-parameter model the leaves' scales and
  # the loss's mean weigh as much again.
  words = dl.sparse_vote_bits(4, sparse_chunk=32) / 8
  assert words < sparse < 2 * words
  assert ("N=4: D-Lion outer, H=8 against the best fp32 outer row "
          "(DiLoCo outer, H=8): **" in text)
  assert "N=4: EF sparse 1/32, H=8 against the best fp32 outer row" in text
  assert (tmp_path / "bits.png").stat().st_size > 10_000


def synthetic_runs(task, metrics: dict, bits=1.0) -> list[dict]:
  """Evaluation runs of ``task`` at N = 8: row -> {seed: metric}."""
  return [dict(task=task, phase="eval", row=row, workers=8, seed=seed,
               metric=metric, bits=bits, steps=1, seconds=0.0,
               diverged=False, curve=[])
          for row, by_seed in metrics.items()
          for seed, metric in by_seed.items()]


def test_local_steps_rows_are_judged_against_the_best_fp32_outer_row():
  """The best of the fp32 outer rows is the yardstick; "better" only
  where the gap exceeds the larger spread, else "level"; the protocol
  line names the seeds."""
  task = "charlm_local_steps"      # lower is better
  runs = synthetic_runs(task, {
      "DiLoCo outer, H=32": {0: 3.20, 1: 3.22, 2: 3.21, 3: 3.19},
      "DiLoCo plain outer, H=32": {0: 2.95, 1: 2.99, 2: 2.97, 3: 2.93},
      "EF vote, H=32": {0: 2.90, 1: 2.97, 2: 2.95, 3: 2.92},   # in spread
      "EF vote, decay 0.9, H=32": {0: 2.80, 1: 2.84, 2: 2.81, 3: 2.83},
      "EF sparse 1/128, H=32": {0: 3.30, 1: 3.40, 2: 3.35, 3: 3.33},
      # At another H: judged against the best fp32 row at H = 32.
      "EF vote, 1/2 fragments, decay 0.9, H=16": {
          0: 3.10, 1: 3.12, 2: 3.11, 3: 3.13},
      # The fp32 mean with 4x the rounds and bits is not the yardstick.
      "DiLoCo plain outer, H=8": {0: 2.70, 1: 2.72, 2: 2.71, 3: 2.73},
  })
  plain = [r for r in runs if r["row"] == "DiLoCo plain outer, H=32"]
  runs += [dict(r, row="DiLoCo tuned momentum, H=32",
                same_as="DiLoCo plain outer, H=32") for r in plain]
  runs += [dict(r, phase="tune", seed=100) for r in runs[:1]]
  assert convergence.best_fp32_outer(runs, task, 8) == (
      "DiLoCo plain outer, H=32")
  verdict, gap, ahead, seeds = convergence.compare(
      runs, task, 8, "EF vote, H=32", "DiLoCo plain outer, H=32")
  assert verdict == "level" and gap == pytest.approx(0.025) and (
      ahead, seeds) == (4, 4)
  assert convergence.compare(runs, task, 8, "EF vote, decay 0.9, H=32",
                             "DiLoCo plain outer, H=32")[0] == "better"
  assert convergence.compare(runs, task, 8, "EF sparse 1/128, H=32",
                             "DiLoCo plain outer, H=32")[0] == "worse"
  lines = convergence.local_steps_verdicts(runs, task)
  assert any(line.startswith(
      "N=8: EF vote, decay 0.9, H=32 against the best fp32 outer row "
      "(DiLoCo plain outer, H=32): **better**, +0.140 bits/byte, ahead at "
      "4 of 4") for line in lines)
  assert any(line.startswith(
      "N=8: EF vote, 1/2 fragments, decay 0.9, H=16 against the best fp32 "
      "outer row (DiLoCo plain outer, H=32): **worse**, -0.155")
      for line in lines)
  assert not any(line.startswith(("N=8: DiLoCo plain outer, H=32",
                                  "N=8: DiLoCo tuned momentum"))
                 for line in lines)
  table = convergence.fp32_table(runs, task)
  assert "yardstick: DiLoCo plain outer, H=32" in table
  assert "| DiLoCo plain outer, H=8 | " in table and "| +0.245 |" in table
  assert "DiLoCo tuned momentum" not in table    # the yardstick's own runs
  text = convergence.protocol(runs, task)
  assert "tuned at seed 100 and evaluated at seeds 0, 1, 2, 3, never" in text
  assert "evaluated at seed 0, never" in convergence.protocol(
      convergence.at_seeds(runs, [0]), task)
  assert "(seed 100 also tuned)" in convergence.protocol(
      runs + [dict(runs[0], seed=100)], task)


def test_at_seeds_keeps_the_tuning_runs():
  runs = synthetic_runs("digits", {"global Lion": {0: 0.5, 7: 0.6}})
  runs.append(dict(runs[0], phase="tune", seed=100))
  kept = convergence.at_seeds(runs, [7])
  assert sorted((r["phase"], r["seed"]) for r in kept) == [
      ("eval", 7), ("tune", 100)]


def test_a_longer_task_runs_the_rows_at_the_shorter_ones_picks(monkeypatch):
  """charlm_long_x4_local_steps: 4x the steps, no tuning of its own; each
  row at charlm_long_local_steps' pick, or refused, naming what to run."""
  steps = []

  def train(task, overrides, workers, seed):
    steps.append(task.steps)
    return {"workers": workers, "seed": seed, "bits": 0.1, "steps": 1,
            "seconds": 0.0, "diverged": False, "curve": [],
            "metric": 3.0 - overrides[convergence.OUTER_LR]}
  monkeypatch.setattr(convergence.study, "train", train)
  row = "DiLoCo plain outer, H=32"
  tuned = [dict(task="charlm_long_local_steps", phase="tune", row=row,
                workers=8, seed=100, lr=3e-3, wd=0.01, outer_lr=lr,
                metric=3.0 - lr, bits=0.1, steps=1, seconds=0.0,
                diverged=False, curve=[]) for lr in (0.2, 0.3, 0.5)]
  monkeypatch.setattr(convergence, "check_saved_text", lambda *a: None)
  runs = convergence.run_study(["charlm_long_x4_local_steps"], [row], None,
                               [7], 8, 100, saved=tuned)
  new = runs[len(tuned):]
  assert [(r["phase"], r["outer_lr"], r["seed"]) for r in new] == [
      ("eval", 0.5, 7)] and steps == [6000]
  assert "tuned at seed 100 (on charlm_long_local_steps)" in (
      convergence.protocol(runs, "charlm_long_x4_local_steps"))
  with pytest.raises(ValueError, match="tune them there first"):
    convergence.run_study(["charlm_long_x4_local_steps"],
                          ["DiLoCo outer, H=32"], None, [7], 8, 100)


def test_a_config_another_row_ran_is_copied_not_trained(monkeypatch):
  """DiLoCo's Nesterov step at momentum 0 is its plain step: the tuned-
  momentum row takes the plain row's runs of the same config."""
  trained = []

  def train(task, overrides, workers, seed):
    trained.append((seed, *sorted(overrides.items())))
    return {"workers": workers, "seed": seed, "bits": 1.0, "steps": 1,
            "seconds": 0.0, "diverged": False, "curve": [],
            "metric": 0.5 + overrides[convergence.OUTER_LR] / 10
            - overrides.get(convergence.OUTER_MOMENTUM, 0) / 100}
  monkeypatch.setattr(convergence.study, "train", train)
  runs = convergence.run_study(
      ["mlp_local_steps"], ["DiLoCo plain outer, H=32",
                            "DiLoCo tuned momentum, H=32"], None, [0], 8, 100)
  copies = [r for r in runs if r.get("same_as")]
  assert copies and all(
      r["row"] == "DiLoCo tuned momentum, H=32" and r["outer_momentum"] == 0
      and r["same_as"] == "DiLoCo plain outer, H=32" for r in copies)
  assert len(trained) == len(set(trained))       # nothing trained twice
  assert len(runs) == len(trained) + len(copies)


def test_the_momentum_table_takes_every_fp32_rows_tuning():
  """DiLoCo's Nesterov row is momentum 0.9, the plain row 0, the tuned
  row its own; each momentum's best rate, its built-up step, the rounds
  to build it."""
  task = "mlp_local_steps"
  base = dict(task=task, phase="tune", workers=8, seed=100, lr=1e-3,
              wd=0.01, bits=1.0, steps=703, seconds=0.0, diverged=False,
              curve=[])
  runs = [dict(base, row="DiLoCo outer, H=32", outer_lr=0.1, metric=0.84),
          dict(base, row="DiLoCo outer, H=32", outer_lr=0.3, metric=0.83),
          dict(base, row="DiLoCo outer, H=32", outer_lr=0.1, lr=3e-3,
               metric=0.99),                      # another inner rate
          dict(base, row="DiLoCo plain outer, H=32", outer_lr=1.0,
               metric=0.86),
          dict(base, row="DiLoCo tuned momentum, H=32", outer_lr=0.7,
               outer_momentum=0.5, metric=0.859)]
  text = convergence.momentum_table(runs, task)
  assert "the run has 21 rounds" in text
  assert "| 0 | 1 | 1 | 0 | 86.000 |" in text
  assert "| 0.5 | 0.7 | 1.4 | 3 | 85.900 |" in text
  assert "| 0.9 | 0.1 | 1 | 22 | 84.000 |" in text


def test_tune_only_evaluates_nothing(monkeypatch, tmp_path):
  phases = []

  def train(task, overrides, workers, seed):
    phases.append(seed)
    return {"workers": workers, "seed": seed, "bits": 1.0, "steps": 1,
            "seconds": 0.0, "diverged": False, "curve": [],
            "metric": 0.5 + overrides["optimizer.learning_rate"]}
  monkeypatch.setattr(convergence.study, "train", train)
  convergence.main(["--tasks", "digits", "--rows", "global Lion",
                    "--tune-only", "--json", str(tmp_path / "r.json")])
  runs = json.loads((tmp_path / "r.json").read_text())
  assert phases and set(phases) == {100}
  assert {r["phase"] for r in runs} == {"tune"}


def test_the_screen_lists_every_tuned_row_best_first():
  task = "charlm_local_steps"
  base = dict(task=task, phase="tune", workers=8, seed=100, lr=3e-3,
              wd=0.01, bits=0.07, steps=300, seconds=0.0, diverged=False,
              curve=[])
  runs = [dict(base, row="EF vote, H=32", outer_lr=0.5, metric=4.48),
          dict(base, row="EF vote, H=32", outer_lr=1.0, metric=4.57),
          dict(base, row="EF vote, decay 0.9, H=32", outer_lr=0.5,
               metric=4.50),
          dict(base, row="EF vote, H=32", outer_lr=0.5, metric=4.51,
               phase="eval", seed=200)]
  text = convergence.screen_table(runs, task)
  lines = [line for line in text.splitlines() if line.startswith("| EF")]
  assert lines == [
      "| EF vote, H=32 | 4.48 | 0.0700 | lr 0.003, wd 0.01, outer_lr 0.5 "
      "| yes |",
      "| EF vote, decay 0.9, H=32 | 4.50 | 0.0700 | lr 0.003, wd 0.01, "
      "outer_lr 0.5 | no |"]
  # The summary lists the evaluated row alone.
  summary = convergence.summary_table(runs, task)
  assert "| EF vote, H=32 |" in summary and "decay" not in summary
