"""Faults in multi-process training (docs/reliability.md, section 3).

Two processes of ``python -m dlion_jax.train`` are started directly (as on
two hosts, no launcher to clean up after them); one is killed or frozen
mid-training. The survivor must exit with a clear error within a bounded
time, a half-written checkpoint must never be restored, and ``--resume``
must end bit-identical to an uninterrupted run.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from dlion_jax import launch  # noqa: E402
from dlion_jax.train import checkpoint  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS, EVERY = 40, 10
CONFIG = ["workers=2", f"train.steps={STEPS}", "model.hidden=[16]",
          "train.log_every=10", "train.eval_every=0",
          f"train.checkpoint_every={EVERY}", "train.keep_checkpoints=10",
          "data.eval_batch=512", "optimizer.warmup_steps=2",
          "optimizer.learning_rate=1e-2"]
HEARTBEAT_S = 10      # --heartbeat-timeout for these runs
HANG_BOUND_S = 90     # generous: a hang fails the test, it does not block CI
TMP = ".orbax-checkpoint-tmp"


class Run:
  """Two train processes on localhost, their output in files."""

  def __init__(self, run_dir: pathlib.Path, *extra: str):
    self.run_dir = run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    port = launch._free_port()
    sets = [a for s in CONFIG + [f"run_dir={run_dir}"] for a in ("--set", s)]
    self.logs = [run_dir / f"process{i}.log" for i in range(2)]
    self.procs = []
    for i, log in enumerate(self.logs):
      env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                 PYTHONUNBUFFERED="1")
      with open(log, "w", encoding="utf-8") as out:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "dlion_jax.train", "--no-progress",
             "--init-timeout", "60", "--heartbeat-timeout", str(HEARTBEAT_S),
             *sets, *extra], env=env, stdout=out, stderr=subprocess.STDOUT,
            cwd=ROOT))

  def output(self, i: int) -> str:
    return self.logs[i].read_text(errors="replace")

  def wait(self, i: int, timeout: float = HANG_BOUND_S) -> int:
    try:
      return self.procs[i].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      pytest.fail(f"process {i} still running after {timeout} s:\n"
                  + self.output(i)[-3000:])

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()

  def wait_until(self, condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if any(p.poll() is not None for p in self.procs):
        self.kill()
        pytest.fail(f"a process ended before {what}:\n" + self.output(0)
                    + self.output(1))
      if time.monotonic() > deadline:
        self.kill()
        pytest.fail(f"no {what} after {timeout} s")
      time.sleep(0.002)


def _steps(run_dir):
  names = [p.name for p in (run_dir / "checkpoints").glob("*")]
  return ({int(n) for n in names if n.isdigit()},
          [n for n in names if TMP in n])


def _finish(run: Run) -> None:
  for i in range(2):
    assert run.wait(i) == 0, run.output(i)[-3000:]


def _killed_mid_save(tmp_path) -> tuple[Run, float]:
  """Kills process 1 while a checkpoint after the first is being written."""
  run = Run(tmp_path / "faulted")
  run.wait_until(lambda: EVERY in _steps(run.run_dir)[0]
                 and _steps(run.run_dir)[1], "checkpoint save in progress")
  run.procs[1].send_signal(signal.SIGKILL)
  tic = time.monotonic()
  code = run.wait(0)
  took = time.monotonic() - tic
  run.kill()
  assert code == 1, run.output(0)[-3000:]
  return run, took


@pytest.mark.parametrize("resume", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_killed_process_survivor_names_the_checkpoint_to_resume(tmp_path,
                                                               resume):
  """The survivor names the last whole checkpoint; -m slow also resumes
  from it and compares with an uninterrupted run (two more 2-process
  runs)."""
  run, took = _killed_mid_save(tmp_path)
  finished, unfinished = _steps(run.run_dir)
  last = max(finished)
  out = run.output(0)
  assert "error: process 0 of 2 lost contact with the other processes" in out
  assert (f"The last checkpoint is step {last} in {run.run_dir}/checkpoints:"
          " restart every process with --resume" in out)
  assert "Traceback" not in out and "Check failure" not in out
  assert took < HANG_BOUND_S
  print(f"survivor exited {took:.2f} s after the kill; finished "
        f"{sorted(finished)}, unfinished {unfinished}")

  # The save cut short is left as a tmp directory (unless the kill landed
  # just after its rename), never the latest step.
  assert last < STEPS
  ckpt = checkpoint.Checkpointer(run.run_dir / "checkpoints")
  assert ckpt.latest_step() == last
  assert all(int(name.split(".")[0]) > last for name in unfinished)
  ckpt.close()
  if not resume:
    return

  resumed = Run(run.run_dir, "--resume")
  _finish(resumed)
  assert f"resumed from step {last}" in resumed.output(0)
  full = Run(tmp_path / "full")
  _finish(full)
  _assert_same_checkpoint(run.run_dir, full.run_dir, STEPS)


def _assert_same_checkpoint(a, b, step):
  readers = [checkpoint.Checkpointer(d / "checkpoints") for d in (a, b)]
  (state_a, meta_a), (state_b, meta_b) = [r.read_arrays(step)
                                          for r in readers]
  for r in readers:
    r.close()
  assert meta_a == meta_b and meta_a["step"] == step
  jax.tree.map(np.testing.assert_array_equal, state_a, state_b)
  mu = jax.tree.leaves(state_a["opt_state"][0]["mu"])[0]
  assert not np.array_equal(mu[0], mu[1])        # both workers' momenta


def test_killed_coordinator_ends_the_other_process(tmp_path):
  """Process 0 serves jax's coordination service: when it dies, jax itself
  terminates process 1 (SIGABRT, its own message) without waiting."""
  run = Run(tmp_path / "run")
  run.wait_until(lambda: EVERY in _steps(run.run_dir)[0], "first checkpoint")
  run.procs[0].send_signal(signal.SIGKILL)
  tic = time.monotonic()
  code = run.wait(1)
  took = time.monotonic() - tic
  run.kill()
  assert code != 0 and took < HANG_BOUND_S
  out = run.output(1)
  assert ("lost contact with the other processes" in out
          or "JAX distributed service detected fatal errors" in out), out
  print(f"process 1 exited with {code} {took:.2f} s after the kill")


def test_frozen_process_is_declared_dead_after_the_heartbeat_timeout(
    tmp_path):
  """SIGSTOP: sockets stay open, so only missed heartbeats reveal it."""
  run = Run(tmp_path / "run")
  run.wait_until(lambda: EVERY in _steps(run.run_dir)[0], "first checkpoint")
  run.procs[1].send_signal(signal.SIGSTOP)
  tic = time.monotonic()
  try:
    code = run.wait(0, timeout=HEARTBEAT_S + HANG_BOUND_S)
  finally:
    run.kill()                       # SIGKILL also ends a stopped process
  took = time.monotonic() - tic
  assert code != 0
  assert took < HEARTBEAT_S + HANG_BOUND_S
  assert "heartbeat" in run.output(0).lower()
  print(f"process 0 exited with {code} {took:.2f} s after the freeze")


def test_half_written_checkpoint_is_never_restored(tmp_path):
  """What a save cut short leaves (a tmp directory with partial files) is
  not a step: latest_step and restore use the last finished one."""
  from dlion_jax.train import cli  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
  from dlion_jax.train.config import load_config  # pylint: disable=g-import-not-at-top
  overrides = ["train.steps=6", "train.checkpoint_every=2",
               "train.keep_checkpoints=3", "train.eval_every=0",
               "model.hidden=[8]", f"run_dir={tmp_path}"]
  cfg = load_config(cli.resolve_config("quickstart"), overrides)
  trainer.train(cfg, progress=False, log=lambda *_: None)
  ckpts = tmp_path / "checkpoints"
  shutil.rmtree(ckpts / "6")            # killed while saving step 6
  partial = ckpts / f"6{TMP}"
  partial.mkdir()
  (partial / "state").mkdir()
  (partial / "state" / "manifest.ocdbt").write_bytes(b"\0" * 7)
  ckpt = checkpoint.Checkpointer(ckpts)
  assert ckpt.latest_step() == 4
  assert ckpt.all_steps() == [2, 4]
  state, meta = ckpt.read_arrays()
  ckpt.close()
  assert meta["step"] == 4 and state["params"]
  lines = []
  trainer.train(cfg, resume=True, progress=False, log=lines.append)
  assert "resumed from step 4" in lines
