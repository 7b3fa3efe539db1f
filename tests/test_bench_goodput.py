"""benchmarks.goodput: the kills' schedule, each restart's cost split from
a run's record (made up here, and the launcher's own notes read as the
benchmark reads them), the report and the plot; a short real run (slow)."""

import io
import json
import sys

import pytest

from benchmarks import goodput
from dlion_jax import launch

pytestmark = pytest.mark.integration


def _start(restart, **more):
  return {"launch": "ab", "restart": restart, "processes": 4, "workers": 8,
          **more}


def made_up_result():
  """A failure-free run and one with a kill at 30 s, restarted once."""
  base = {"wall_s": 60.0, "exit": 0, "kills": [], "notes": [],
          "step_s": 0.05, "last_step": 600,
          "summary": {"step": 600, "test_accuracy": 0.97, "starts": [
              _start(0, step=0, steps_redone=0, start_s=19.0, compile_s=5.0,
                     checkpoint_s=[0.4, 0.6])]}}
  killed = {"wall_s": 80.0, "exit": 0, "period": 60.0, "last_step": 600,
            "step_s": 0.05, "kills": [{"t": 30.0, "process": 2}],
            "notes": [
                {"t": 30.25, "text": "launch: process 2 was killed by "
                 "SIGKILL; killing processes 0, 1, 3"},
                {"t": 31.25, "text": "launch: restart 1 of 50 on 4 "
                 "processes, process 2 replaced (process 2 was killed by "
                 "SIGKILL)"}],
            "summary": {"step": 600, "test_accuracy": 0.96, "starts": [
                _start(0, step=0, steps_redone=0, start_s=19.0,
                       compile_s=5.0),
                _start(1, step=250, steps_redone=20, start_s=15.0,
                       restore_s=3.0, compile_s=1.0,
                       checkpoint_s=[0.5])]}}
  once = {"wall_s": 90.0, "exit": 0, "process": 0, "last_step": 600,
          "kills": [{"t": 40.0, "process": 0, "step": 300}], "notes": [],
          "summary": {"step": 600, "test_accuracy": 0.955}}
  return {"settings": {"processes": 4, "steps": 600, "checkpoint_every": 50,
                       "seed": 0, "kill_at_step": 300,
                       "machine": "2 CPU cores"},
          "baseline": base, "periods": [killed], "kill_at_step": [once]}


def test_kill_times_are_a_period_apart_with_a_quarter_of_jitter_at_a_phase():
  times = goodput.kill_times(60.0, seed=3, horizon=1000.0)
  assert times == goodput.kill_times(60.0, seed=3, horizon=1000.0)
  assert 0.0 <= times[0] <= 60.0
  gaps = [b - a for a, b in zip(times, times[1:])]
  assert all(45.0 <= g <= 75.0 for g in gaps), gaps
  assert times[-1] < 1000.0 and len(times) >= 12


def test_a_restart_cost_is_split_from_the_notes_and_the_starts():
  result = made_up_result()
  [cost] = goodput.restart_costs(result["periods"][0], step_s=0.05)
  assert cost == pytest.approx({
      "restart": 1, "process": 2, "detect": 0.25, "stop": 1.0,
      "start": 15.0, "restore": 3.0, "compile": 1.0, "steps_redone": 20,
      "redone": 1.0, "total": 21.25})
  # 80 s with the kill, 60 without: 20 s lost, 21.25 s of it the restart.
  assert goodput.other_seconds(result["periods"][0],
                               result["baseline"]) == pytest.approx(-1.25)
  assert goodput.goodput(result["periods"][0],
                         result["baseline"]) == pytest.approx(0.75)


def test_a_restart_killed_before_it_was_ready_has_the_pieces_it_has():
  run = made_up_result()["periods"][0]
  run["summary"]["starts"] = run["summary"]["starts"][:1]
  [cost] = goodput.restart_costs(run, step_s=0.05)
  assert set(cost) == {"restart", "process", "detect", "stop", "total"}
  assert cost["total"] == pytest.approx(1.25)


def test_checkpoint_cost_is_a_save_over_the_steps_between_saves():
  cost = goodput.checkpoint_cost(made_up_result()["baseline"], every=50)
  assert cost == pytest.approx({"saves": 2, "save_s": 0.5,
                                "per_step_s": 0.01})


def test_the_report_names_goodput_costs_and_the_kill_at_step_runs():
  text = goodput.report(made_up_result())
  assert "| 60 s | 1 | 80.0 | 75.0 | 0 | 600 | 96.00 | -1.00 |" in text
  assert ("| 60 s | 1 | 2 | 0.2 | 1.0 | 15.0 | 3.0 | 1.0 | 1.0 | 20 | "
          "21.2 |") in text
  assert "| process 0 | 300 | 0 | 600 | 95.50 | 90.0 | 1.50 |" in text
  assert "10.0 ms a step against 50.0 ms" in text


def test_a_run_stopped_at_its_timeout_is_said_so():
  result = made_up_result()
  result["periods"][0].update(exit=None, summary=None, last_step=420)
  assert "< 75.0 (stopped at step 420) | stopped |" in goodput.report(result)


def test_the_report_reads_back_from_json(tmp_path, capsys):
  path = tmp_path / "goodput.json"
  path.write_text(json.dumps(made_up_result()))
  png = tmp_path / "goodput.png"
  text = goodput.main(["--from-json", str(path), "--plot", str(png)])
  assert "goodput" in text.lower() and "| 60 s |" in capsys.readouterr().out
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_launchers_own_notes_are_read_as_a_kill_and_its_restart():
  # Process 1 kills itself at the first start: the launcher's notes, as it
  # words them, must match what restart_costs looks for.
  code = ("import os, signal\n"
          "if os.environ['JAX_PROCESS_ID'] == '1' and "
          "os.environ['DLION_RESTART'] == '0':\n"
          "  os.kill(os.getpid(), signal.SIGKILL)\n")
  err = io.StringIO()
  assert launch.launch(2, [sys.executable, "-c", code], restarts=1,
                       replace=True, watchdog=0, stdout=io.StringIO(),
                       stderr=err) == 0
  notes = [line for line in err.getvalue().splitlines()
           if line.startswith("launch: ")]
  assert [bool(goodput._FAILED.match(n)) for n in notes] == [True, False]
  assert goodput._RESTART.match(notes[1]).group(1) == "1"


def test_bad_arguments_name_the_flag(capsys):
  for argv, flag in ((["--periods", "0"], "--periods"),
                     (["--kill-process", "4"], "--kill-process"),
                     (["--kill-process", "1", "--kill-at-step", "600"],
                      "--kill-at-step")):
    with pytest.raises(SystemExit):
      goodput.main(argv)
    assert flag in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_real_run_with_kills_ends_at_its_last_step(tmp_path):
  result = tmp_path / "goodput.json"
  text = goodput.main(["--steps", "60", "--checkpoint-every", "10",
                       "--periods", "20", "--kill-process", "1",
                       "--kill-at-step", "30", "--json", str(result)])
  runs = json.loads(result.read_text())
  assert runs["baseline"]["exit"] == 0
  assert runs["kill_at_step"][0]["exit"] == 0
  assert runs["kill_at_step"][0]["summary"]["step"] == 60
  assert runs["kill_at_step"][0]["kills"][0]["process"] == 1
  assert "| process 1 |" in text
