"""Runs that heal themselves: the train CLI under ``python -m
dlion_jax.launch --restarts K`` resumes by itself on the survivors'
workers after a process is lost (docs/reliability.md, section 3.1).

Real processes are killed as a preempted host would be, and the resumed
run is compared bit for bit with one stopped at the same checkpoint and
resumed by hand on the same process counts. The runs of 3 processes are
``slow``; the CLI's decisions at a restart are tested in this process.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from dlion_jax import processes  # noqa: E402
from dlion_jax.train import checkpoint  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import restarts  # noqa: E402
from dlion_jax.train import rundir  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration

PY = sys.executable
LAUNCH = [PY, "-m", "dlion_jax.launch"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
  return [int(c) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
          for c in (task / "children").read_text().split()]


def process_pid(launcher: int, i: int) -> int | None:
  """The pid of the launcher's process ``i`` (its JAX_PROCESS_ID)."""
  for child in _children(launcher):
    try:
      env = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    except OSError:
      continue
    if f"JAX_PROCESS_ID={i}".encode() in env:
      return child
  return None


def _sets(overrides):
  return [a for s in overrides for a in ("--set", s)]


def killed_run(run_dir, overrides, *, processes_: int, victim: int,
               after: int, restarts_: int = 1, timeout: float = 400):
  """``python -m dlion_jax.launch -n P --restarts K -- python -m
  dlion_jax.train ...``, process ``victim`` SIGKILLed once checkpoint
  ``after`` is written; (exit code, stdout, stderr, seconds)."""
  tic = time.monotonic()
  proc = subprocess.Popen(
      LAUNCH + ["-n", str(processes_), "--restarts", str(restarts_),
                "--timeout", str(timeout), "--", PY, "-m", "dlion_jax.train",
                "--no-progress", *_sets(overrides + [f"run_dir={run_dir}"])],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    while not (run_dir / "checkpoints" / str(after)).is_dir():
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() - tic < timeout, "no checkpoint in time"
      time.sleep(0.02)
    os.kill(process_pid(proc.pid, victim), signal.SIGKILL)
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, out, err, time.monotonic() - tic


def _by_hand(tmp_path, faulted, step, overrides, capsys):
  """The run stopped at checkpoint ``step`` of ``faulted`` and resumed by
  hand with ``overrides`` (here, one process): its final checkpoint."""
  hand = tmp_path / "by_hand"
  (hand / "checkpoints").mkdir(parents=True)
  shutil.copytree(faulted / "checkpoints" / str(step),
                  hand / "checkpoints" / str(step))
  code = cli.main(["--no-progress", "--resume",
                   *_sets(overrides + [f"run_dir={hand}"])])
  assert code == 0, capsys.readouterr().err
  return hand


def _assert_same_checkpoint(a, b, step):
  readers = [checkpoint.Checkpointer(d / "checkpoints") for d in (a, b)]
  (state_a, meta_a), (state_b, meta_b) = [r.read_arrays(step)
                                          for r in readers]
  for r in readers:
    r.close()
  assert meta_a["step"] == meta_b["step"] == step
  assert meta_a["history"] == meta_b["history"]
  jax.tree.map(np.testing.assert_array_equal, state_a, state_b)


STEPS, EVERY = 60, 10
SMALL = ["workers=2", f"train.steps={STEPS}", "model.hidden=[16]",
         "train.log_every=1", "train.eval_every=0",
         f"train.checkpoint_every={EVERY}", "train.keep_checkpoints=10",
         "data.eval_batch=512", "optimizer.warmup_steps=2",
         "optimizer.learning_rate=1e-2"]


def test_a_killed_process_resumes_on_the_survivor_bit_for_bit(
    tmp_path, capsys):
  """2 processes of a worker each; process 1 SIGKILLed after checkpoint 10:
  the launcher restarts on 1 process, the CLI resumes by itself on 1
  worker, and ends on the params of the run stopped at that checkpoint and
  resumed by hand on 1 process, bit for bit."""
  faulted = tmp_path / "faulted"
  code, out, err, _ = killed_run(faulted, SMALL, processes_=2, victim=1,
                                 after=EVERY)
  assert code == 0, out + err
  assert ("launch: restart 1 of 1 on 1 process, was 2 (process 1 was killed "
          "by SIGKILL)") in err
  starts = restarts.read(faulted)
  assert [(s["restart"], s["processes"], s["workers"]) for s in starts] == [
      (0, 2, 2), (1, 1, 1)]
  step = starts[1]["step"]
  assert EVERY <= step < STEPS and step % EVERY == 0
  assert f"[0] resumed from step {step} on 1 worker from 2 workers" in out
  assert (f"[0] restart 1 on 1 process, 1 worker, from step {step}: started "
          "in ") in out
  assert f"[0] steps 0-{step} on 2 workers, {step}-{STEPS} on 1 worker" in out
  summary = json.loads((faulted / "summary.json").read_text())
  assert summary["step"] == STEPS
  assert summary["history"] == [{"steps": [0, step], "workers": 2},
                                {"steps": [step, STEPS], "workers": 1}]
  assert [s["restart"] for s in summary["starts"]] == [0, 1]
  assert all(s["compile_s"] > 0 for s in summary["starts"])
  logged = [json.loads(line) for line in
            (faulted / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged if "loss" in r] == list(
      range(1, STEPS + 1))                  # each step once
  assert {r["workers"] for r in logged if "loss" in r and r["step"] <= step
          } == {2}
  assert {r["workers"] for r in logged if "loss" in r and r["step"] > step
          } == {1}

  hand = _by_hand(tmp_path, faulted, step, SMALL + ["workers=1"], capsys)
  _assert_same_checkpoint(faulted, hand, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("local_steps", [1, 4])
def test_a_killed_coordinator_and_a_round_cut_short(tmp_path, capsys,
                                                    local_steps):
  """3 processes of 2 devices; process 0 (the coordinator's host) SIGKILLed
  past checkpoint 8: the run goes on as 4 workers on 2 processes, bit for
  bit as resumed by hand. With local steps (H = 4, a checkpoint every 8
  steps: at an anchor) the kill lands mid-round and the run resumes at the
  last anchor."""
  overrides = [*SMALL, "workers=6", "data.global_batch=240",
               "train.steps=48", "train.checkpoint_every=8",
               f"optimizer.local_steps={local_steps}"]
  faulted = tmp_path / "faulted"
  code, out, err, _ = killed_run(faulted, overrides, processes_=3, victim=0,
                                 after=8)
  assert code == 0, out + err
  assert "process 0 was killed by SIGKILL" in err
  starts = restarts.read(faulted)
  assert [(s["processes"], s["workers"]) for s in starts] == [(3, 6), (2, 4)]
  step = starts[1]["step"]
  assert step % 8 == 0 and step % local_steps == 0
  assert "warning" not in err, err
  hand = _by_hand(tmp_path, faulted, step, overrides + ["workers=4"], capsys)
  _assert_same_checkpoint(faulted, hand, 48)


def _run_cli(capsys, argv, env, monkeypatch):
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  code = cli.main(argv)
  return code, capsys.readouterr()


def _restart_env(restart, n=1, first=1, launch_id="abc"):
  return {"DLION_LAUNCH_ID": launch_id, "DLION_RESTART": str(restart),
          "DLION_FIRST_NUM_PROCESSES": str(first),
          "DLION_MIN_PROCESSES": "1", "DLION_STARTED_AT": repr(time.time()),
          "JAX_NUM_PROCESSES": str(n)}


TINY = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0",
        "model.hidden=[8]", "workers=1"]


def test_a_restart_after_the_last_checkpoint_only_reports(
    tmp_path, capsys, monkeypatch):
  """Killed after its last checkpoint but before summary.json: the restart
  finds the run at its last step, trains nothing and writes the summary."""
  argv = ["--no-progress", *_sets(TINY + [f"run_dir={tmp_path}"])]
  code, _ = _run_cli(capsys, argv, _restart_env(0), monkeypatch)
  assert code == 0
  first = json.loads((tmp_path / "summary.json").read_text())
  (tmp_path / "summary.json").unlink()
  code, io = _run_cli(capsys, argv, _restart_env(1), monkeypatch)
  assert code == 0, io.err
  assert "resumed from step 4" in io.out
  again = json.loads((tmp_path / "summary.json").read_text())
  assert again["test_accuracy"] == first["test_accuracy"]
  assert [s["restart"] for s in again["starts"]] == [0, 1]
  assert checkpoint.Checkpointer(tmp_path / "checkpoints").all_steps() == [
      2, 4]


def test_a_restart_before_any_checkpoint_starts_afresh(
    tmp_path, capsys, monkeypatch):
  """The launcher's run died before its first checkpoint: the restart
  starts over what it wrote. A run directory of another launch (or none)
  is refused as a fresh run refuses it."""
  argv = ["--no-progress", *_sets(TINY + [f"run_dir={tmp_path}"])]
  restarts.record(tmp_path, {"launch": "abc", "restart": 0})
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
  code, io = _run_cli(capsys, argv, _restart_env(1, launch_id="other"),
                      monkeypatch)
  assert code == 1 and "already holds a run" in io.err
  code, io = _run_cli(capsys, argv, _restart_env(1), monkeypatch)
  assert code == 0, io.err
  assert "resumed" not in io.out
  assert json.loads((tmp_path / "summary.json").read_text())["step"] == 4


def test_a_restart_the_config_does_not_fit_is_a_config_error(
    tmp_path, capsys, monkeypatch):
  argv = ["--no-progress", "--set", f"run_dir={tmp_path}"]
  code, io = _run_cli(capsys, argv, _restart_env(1, n=3, first=4),
                      monkeypatch)
  assert code == 2
  assert io.err.strip() == (
      "config error: the launcher restarted the run on 3 processes (it "
      "began on 4), which takes 6 workers (2 a process): data.global_batch="
      "256 must be divisible by workers=6: each worker takes an equal "
      "share.")


def test_restart_info_reads_the_launchers_environment(monkeypatch):
  assert processes.restart_info() is None
  for key, value in _restart_env(2, n=3, first=4).items():
    monkeypatch.setenv(key, value)
  info = processes.restart_info()
  assert (info.restart, info.num_processes, info.first_num_processes,
          info.launch_id) == (2, 3, 4, "abc")
  assert info.scaled(8) == 6
  with pytest.raises(ValueError, match="not a multiple of the 4 processes"):
    info.scaled(6)
  monkeypatch.setenv("DLION_RESTART", "two")
  with pytest.raises(ValueError, match="DLION_RESTART='two'"):
    processes.restart_info()


def test_the_config_follows_the_processes():
  cfg = load_config(cli.resolve_config("quickstart"),
                    ["data.global_batch=240"])
  info = processes.RestartInfo("abc", 1, 3, 4, 2, 0.0)
  assert restarts.on_survivors(cfg, info).workers == 6
  hybrid = load_config(cli.resolve_config("quickstart"),
                       ["data.global_batch=240", "mesh.nodes=4"])
  scaled = restarts.on_survivors(hybrid, info)
  assert (scaled.workers, scaled.mesh.nodes) == (6, 3)
  with pytest.raises(ConfigError, match="mesh.nodes=2 cannot follow"):
    restarts.on_survivors(load_config(
        cli.resolve_config("quickstart"),
        ["data.global_batch=240", "mesh.nodes=2"]), info)


def test_the_first_start_warns_of_restarts_it_would_not_survive():
  cfg = load_config(cli.resolve_config("quickstart"), [])
  first = processes.RestartInfo("abc", 0, 4, 4, 2, 0.0)
  assert restarts.fragile_counts(cfg, first) == (
      "a restart on 3 processes would stop the run with a config error: on "
      "3, 6 workers (2 a process): data.global_batch=256 must be divisible "
      "by workers=6: each worker takes an equal share. Set data.global_batch "
      "to a multiple of 24 (it is 256) to survive every restart.")
  fit = load_config(cli.resolve_config("quickstart"),
                    ["data.global_batch=240"])
  assert restarts.fragile_counts(fit, first) is None


def test_history_merges_runs_of_one_layout():
  cfg = load_config(cli.resolve_config("quickstart"),
                    ["data.global_batch=240"])
  six = restarts._scaled(cfg, processes.RestartInfo("a", 1, 3, 4, 1, 0.0))
  h = restarts.history([], 0, 200, cfg)
  assert h == [{"steps": [0, 200], "workers": 8}]
  assert restarts.history(h, 200, 300, cfg) == [
      {"steps": [0, 300], "workers": 8}]       # a resume on as many
  assert restarts.history(h, 200, 300, six) == [
      {"steps": [0, 200], "workers": 8}, {"steps": [200, 300], "workers": 6}]


def _guide_script() -> str:
  text = (ROOT / "docs" / "guides" / "multihost_tpu.md").read_text()
  start = text.index("```python\n# On each host, restartable")
  return text[start + len("```python\n"):text.index("```", start + 10)]


def test_the_guides_restartable_script_survives_a_lost_process(tmp_path):
  """The multi-host guide's restartable script, launched as the guide
  says: process 1 killed after step 12 of its first start (a line the test
  adds), the run goes on from its last checkpoint on one process."""
  script = _guide_script()
  line = "  params, state, loss = step(params, state, batch)\n"
  assert line in script
  script = script.replace(line, line + (
      "  if (i == 12 and jax.process_index() == 1\n"
      "      and processes.restart_info().restart == 0):\n"
      "    manager.wait_until_finished(); os.kill(os.getpid(), 9)\n"))
  (tmp_path / "train_restarts.py").write_text(script)
  out = subprocess.run(
      LAUNCH + ["-n", "2", "--restarts", "1", "--timeout", "300", "--", PY,
                "train_restarts.py"], capture_output=True, text=True,
      timeout=330, cwd=tmp_path,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert out.returncode == 0, out.stdout + out.stderr
  assert ("launch: restart 1 of 1 on 1 process, was 2 (process 1 was killed "
          "by SIGKILL)") in out.stderr
  found = re.findall(r"^\[0\] processes 1, resumed at step (\d+): loss",
                     out.stdout, re.M)
  assert found in (["5"], ["10"]), out.stdout


def _logged_step(run_dir) -> int:
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    return 0
  steps = map(rundir.record_step, path.read_text().splitlines())
  return max((s for s in steps if s is not None), default=0)


def readme_run(run_dir, *, victim=None, past=250, timeout=900):
  """The README's restartable run (4 processes, --restarts 2, 600 steps of
  the quickstart at a global batch of 240); with ``victim``, that process
  SIGKILLed once step ``past`` is logged. (exit code, out, err, seconds)."""
  tic = time.monotonic()
  proc = subprocess.Popen(
      LAUNCH + ["-n", "4", "--restarts", "2", "--timeout", str(timeout), "--",
                PY, "-m", "dlion_jax.train", "--no-progress",
                *_sets(["data.global_batch=240", "train.steps=600",
                        f"run_dir={run_dir}"])],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    while victim is not None and _logged_step(run_dir) < past:
      assert proc.poll() is None, proc.communicate()
      time.sleep(0.05)
    if victim is not None:
      os.kill(process_pid(proc.pid, victim), signal.SIGKILL)
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, out, err, time.monotonic() - tic


@pytest.mark.slow
def test_the_readme_run_survives_a_lost_process_and_a_lost_coordinator(
    tmp_path):
  """The issue's bar: process 1, then (another run) process 0 SIGKILLed
  past step 200 of 600; each run ends with exit 0, its summary at step 600,
  test accuracy 0.93 or more, within 2.5x the uninterrupted run's wall time
  (measured back to back)."""
  code, out, err, base = readme_run(tmp_path / "uninterrupted")
  assert code == 0, out + err
  for victim in (1, 0):
    run_dir = tmp_path / f"killed{victim}"
    code, out, err, took = readme_run(run_dir, victim=victim)
    assert code == 0, out + err
    assert (f"launch: restart 1 of 2 on 3 processes, was 4 (process {victim} "
            "was killed by SIGKILL)") in err
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["starts"][1]["step"]
    print(f"process {victim} killed: {took:.0f} s against {base:.0f} s "
          f"uninterrupted ({took / base:.2f}x), test accuracy "
          f"{summary['test_accuracy']:.4f}, resumed at step {step}, "
          f"{summary['starts'][1]['steps_redone']} steps redone")
    assert summary["step"] == 600 and step >= 200
    assert summary["history"] == [{"steps": [0, step], "workers": 8},
                                  {"steps": [step, 600], "workers": 6}]
    assert summary["test_accuracy"] >= 0.93
    assert took <= 2.5 * base


def test_every_process_takes_the_same_view_of_the_run_directory():
  """A restart before any checkpoint: process 0 clears the run directory
  (its restarts.jsonl too) once it has decided; a process that read it
  after would have taken the run for another's and parted ways with the
  others (seen: a sync_global_devices name mismatch, the start lost). The
  views are gathered first: any process that saw the run's record, and a
  checkpoint only where every process found one."""
  assert restarts.combined([(1, 0), (0, 0), (1, 0), (1, 0)]) == (True, False)
  assert restarts.combined([(1, 1), (1, 0)]) == (True, False)
  assert restarts.combined([(1, 1), (1, 1)]) == (True, True)
  assert restarts.combined([(0, 0), (0, 0)]) == (False, False)
  assert restarts.agreed_view(True, False) == (True, False)   # one process
