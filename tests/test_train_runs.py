"""Run directories and interruptions of the train CLI: a fresh run never
mixes with an old one, ``--resume`` only continues the run that wrote the
checkpoint, and Ctrl-C ends in one line that says how to continue."""

import errno
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from dlion_jax.train import checkpoint  # noqa: E402
from dlion_jax.train import signals  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import data as data_lib  # noqa: E402
from dlion_jax.train import rundir  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0",
        "train.log_every=1", "model.hidden=[8]", "train.keep_checkpoints=5",
        "optimizer.warmup_steps=0"]


def _argv(run_dir, *overrides):
  return ["--no-progress", *[a for s in TINY + [f"run_dir={run_dir}",
                                                *overrides]
                             for a in ("--set", s)]]


def _cli(capsys, argv):
  """Runs the CLI in this process: (exit code, stderr lines)."""
  code = cli.main(argv)
  return code, capsys.readouterr().err.strip().splitlines()


def _steps_logged(run_dir):
  return [json.loads(line)["step"] for line in
          (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_refuses_a_run_dir_holding_a_run(tmp_path, capsys):
  assert _cli(capsys, _argv(tmp_path))[0] == 0
  saved = (tmp_path / "config.json").read_text()
  code, err = _cli(capsys, _argv(tmp_path, "optimizer.learning_rate=3e-4"))
  assert code == 1
  assert err == [
      f"error: run directory {tmp_path} already holds a run (checkpoints up "
      "to step 4, metrics.jsonl, summary.json). Continue it with --resume, "
      "delete it with --overwrite, or start this run elsewhere with --set "
      f"run_dir={tmp_path}-2."]
  assert (tmp_path / "config.json").read_text() == saved   # untouched
  assert rundir.checkpoint_steps(tmp_path) == [2, 4]


def test_overwrite_starts_afresh_and_keeps_other_files(tmp_path, capsys):
  assert _cli(capsys, _argv(tmp_path, "train.steps=8"))[0] == 0
  (tmp_path / "notes.txt").write_text("mine")
  code, _ = _cli(capsys, _argv(tmp_path, "optimizer.learning_rate=3e-4")
                 + ["--overwrite"])
  assert code == 0
  # Without clearing, orbax would have kept steps 6 and 8 of the old run
  # (it never writes a step at or below the latest).
  assert rundir.checkpoint_steps(tmp_path) == [2, 4]
  assert _steps_logged(tmp_path) == [1, 2, 3, 4, 4]
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["optimizer"]["learning_rate"] == 3e-4
  assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_refuses_another_config_naming_keys_and_values(tmp_path,
                                                              capsys):
  assert _cli(capsys, _argv(tmp_path, "train.steps=6"))[0] == 0
  _crash_after(tmp_path, 4)
  code, err = _cli(capsys, _argv(tmp_path, "train.steps=6",
                                 "optimizer.learning_rate=3e-4",
                                 "optimizer.weight_decay=0")
                   + ["--resume"])
  assert code == 1
  assert err == [
      f"error: --resume: checkpoint {tmp_path}/checkpoints/4 was written "
      "with another config: optimizer.learning_rate=0.003 there, 0.0003 "
      "here; optimizer.weight_decay=0.01 there, 0.0 here. Resume with the "
      "checkpoint's values, or start a new run instead of --resume "
      "(--overwrite, or --set run_dir=...)."]
  # Logging, evaluation and checkpoint cadence do not change the result.
  code, _ = _cli(capsys, _argv(tmp_path, "train.steps=6", "train.log_every=2",
                               "train.eval_every=3", "data.eval_batch=100",
                               "name=renamed") + ["--resume"])
  assert code == 0


def _crash_after(run_dir, step):
  """What a run killed after checkpoint ``step`` leaves: later checkpoints
  gone, its log holding the steps it finished after that checkpoint."""
  for later in rundir.checkpoint_steps(run_dir):
    if later > step:
      shutil.rmtree(run_dir / "checkpoints" / str(later))
  (run_dir / "summary.json").unlink()


def test_resume_changing_train_steps(tmp_path, capsys):
  """The cosine schedule's length sets every step's learning rate; a
  constant schedule lets a run train further."""
  assert _cli(capsys, _argv(tmp_path))[0] == 0
  code, err = _cli(capsys, _argv(tmp_path, "train.steps=6") + ["--resume"])
  assert code == 1
  assert "train.steps=4 there, 6 here. train.steps may differ only under " \
      "optimizer.schedule=constant" in err[-1]
  code, err = _cli(capsys, _argv(tmp_path) + ["--resume"])
  assert code == 1
  assert err == [
      f"error: --resume: the run in {tmp_path} has already reached step 4 "
      "of train.steps=4; its results are in summary.json. To train further, "
      "start a new run (--overwrite, or --set run_dir=...)."]
  constant = tmp_path / "constant"
  assert _cli(capsys, _argv(constant, "optimizer.schedule=constant"))[0] == 0
  code, _ = _cli(capsys, _argv(constant, "optimizer.schedule=constant",
                               "train.steps=6") + ["--resume"])
  assert code == 0
  assert rundir.checkpoint_steps(constant)[-1] == 6
  assert _steps_logged(constant) == [1, 2, 3, 4, 4, 5, 6, 6]


def test_resume_logs_each_step_once(tmp_path, capsys):
  """A run killed after its step-4 checkpoint had logged steps 5 and 6;
  the resumed run logs them again, so the first copies must go."""
  full = tmp_path / "full"
  assert _cli(capsys, _argv(full, "train.steps=8", "train.eval_every=3"))[
      0] == 0
  broken = tmp_path / "broken"
  assert _cli(capsys, _argv(broken, "train.steps=8",
                            "train.eval_every=3"))[0] == 0
  _crash_after(broken, 4)
  lines = (broken / "metrics.jsonl").read_text().splitlines()
  (broken / "metrics.jsonl").write_text("\n".join(lines[:8]) + "\n")
  assert _steps_logged(broken)[-3:] == [5, 6, 6]      # 6 twice: log + eval
  with open(broken / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write(lines[8][:10])                    # killed while writing step 7
  code, _ = _cli(capsys, _argv(broken, "train.steps=8", "train.eval_every=3")
                 + ["--resume"])
  assert code == 0

  def records(run_dir):
    return [{k: v for k, v in json.loads(line).items()
             if k != "examples_per_s"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert records(broken) == records(full)


def test_resume_without_a_checkpoint_after_a_crash(tmp_path, capsys):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.3}\n')
  code, err = _cli(capsys, _argv(tmp_path) + ["--resume"])
  assert code == 1
  assert err == [
      f"error: --resume: no checkpoint in {tmp_path}/checkpoints; the run "
      "there stopped before its first one, so start it again with "
      "--overwrite instead of --resume (checkpoints are written every "
      "train.checkpoint_every steps and at the end)."]
  code, err = _cli(capsys, _argv(tmp_path) + ["--resume", "--overwrite"])
  assert code == 2
  assert err == ["config error: --resume continues the run in the run "
                 "directory, --overwrite deletes it: pass one of them."]


def test_ctrl_c_in_a_step_reports_where_to_resume(tmp_path, capsys,
                                                  monkeypatch):
  """Ctrl-C while step 4 runs: step 3 is the last done, 2 the last
  checkpoint; the command it prints continues the run."""
  real_next, calls = data_lib.Batches.__next__, []

  def interrupted_next(self):
    calls.append(1)
    if len(calls) == 5:          # the compile's example batch, steps 1..3
      raise KeyboardInterrupt
    return real_next(self)
  monkeypatch.setattr(data_lib.Batches, "__next__", interrupted_next)
  argv = _argv(tmp_path)
  code, err = _cli(capsys, argv)
  assert code == 130
  command = shlex.join(["python", "-m", "dlion_jax.train", *argv])
  assert err == [
      f"interrupted at step 3 of 4; the last checkpoint is step 2 in "
      f"{tmp_path}/checkpoints. Continue with: {command} --resume"]
  assert "Traceback" not in capsys.readouterr().out
  monkeypatch.setattr(data_lib.Batches, "__next__", real_next)
  code, _ = _cli(capsys, shlex.split(err[0].rsplit("Continue with: ", 1)[1])[
      3:])
  assert code == 0
  assert _steps_logged(tmp_path) == [1, 2, 3, 4, 4]


def test_ctrl_c_before_a_checkpoint_says_start_again(tmp_path, capsys,
                                                     monkeypatch):
  def interrupted(*_):
    raise KeyboardInterrupt
  monkeypatch.setattr(data_lib.Batches, "__next__", interrupted)
  code, err = _cli(capsys, _argv(tmp_path) + ["--overwrite"])
  assert code == 130
  assert err[-1].startswith("interrupted at step 0 of 4; no checkpoint was "
                            "written yet. Start again with: python -m ")
  assert err[-1].endswith(" --overwrite") and "--overwrite --" not in err[-1]


def _signal_after_first_checkpoint(tmp_path, signum):
  """Trains in a fresh process until its first checkpoint, then sends it
  ``signum``: (exit code, stdout, stderr, CLI arguments, seconds from the
  signal to the exit)."""
  argv = ["--no-progress", "--set", f"run_dir={tmp_path}",
          "--set", "model.hidden=[8]", "--set", "train.steps=100000",
          "--set", "train.checkpoint_every=20", "--set", "train.eval_every=0"]
  proc = subprocess.Popen([sys.executable, "-m", "dlion_jax.train", *argv],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT)
  deadline = time.monotonic() + 120
  try:
    while not rundir.checkpoint_steps(tmp_path):
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "no checkpoint after 120 s"
      time.sleep(0.01)
    proc.send_signal(signum)
    tic = time.monotonic()
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, out, err, argv, time.monotonic() - tic


def test_sigint_ends_in_one_line_and_exit_130(tmp_path):
  """A real Ctrl-C (SIGINT) to a training process, after its first
  checkpoint."""
  code, out, err, argv, _ = _signal_after_first_checkpoint(
      tmp_path, signal.SIGINT)
  assert code == 130, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  last = rundir.checkpoint_steps(tmp_path)[-1]
  step = int(err.split("interrupted at step ", 1)[1].split(" ", 1)[0])
  assert step >= last >= 20
  assert (f"of 100000; the last checkpoint is step {last} in {tmp_path}/"
          "checkpoints. Continue with: python -m dlion_jax.train "
          f"{shlex.join(argv)} --resume") in err
  assert "test accuracy" not in out


def test_ctrl_c_during_a_checkpoint_write_waits_for_it():
  """A SIGINT that lands while orbax writes is held until the write ends
  (seen under load: orbax's threads printed a traceback of their own)."""
  finished = []
  with pytest.raises(KeyboardInterrupt):
    with signals.deferred():
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)                 # the signal is delivered by now
      finished.append(True)
  assert finished == [True]
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_during_a_checkpoint_write_waits_for_it():
  """SIGTERM too is held while orbax writes, then goes to the handler that
  was in place (the CLI's, which raises Terminated)."""
  finished = []
  with pytest.raises(signals.Terminated):
    with signals.raising():
      with signals.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        finished.append(True)
  assert finished == [True]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_in_a_step_saves_that_step(tmp_path, capsys, monkeypatch):
  """SIGTERM while step 3 runs: the step finishes, a checkpoint of it is
  written (the last periodic one was step 2), and the line says so; the
  command it prints continues the run."""
  real_next, calls = data_lib.Batches.__next__, []

  def terminated_next(self):
    calls.append(1)
    if len(calls) == 4:          # the compile's example batch, steps 1..3
      os.kill(os.getpid(), signal.SIGTERM)
    return real_next(self)
  monkeypatch.setattr(data_lib.Batches, "__next__", terminated_next)
  argv = _argv(tmp_path)
  code, err = _cli(capsys, argv)
  assert code == 143
  command = shlex.join(["python", "-m", "dlion_jax.train", *argv])
  assert err == [
      f"terminated (SIGTERM) at step 3 of 4; the last checkpoint is step 3 "
      f"in {tmp_path}/checkpoints. Continue with: {command} --resume"]
  assert rundir.checkpoint_steps(tmp_path) == [2, 3]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  monkeypatch.setattr(data_lib.Batches, "__next__", real_next)
  code, _ = _cli(capsys, shlex.split(err[0].rsplit("Continue with: ", 1)[1])[
      3:])
  assert code == 0
  assert _steps_logged(tmp_path) == [1, 2, 3, 4, 4]


def test_sigterm_ends_in_one_line_and_exit_143(tmp_path):
  """A real SIGTERM (what a scheduler sends on preemption) to a training
  process: it saves the step it reached and says how to resume."""
  code, out, err, argv, seconds = _signal_after_first_checkpoint(
      tmp_path, signal.SIGTERM)
  assert seconds < 5
  assert code == 143, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  step = int(err.split("terminated (SIGTERM) at step ", 1)[1].split(" ")[0])
  assert rundir.checkpoint_steps(tmp_path)[-1] == step > 20
  assert (f"of 100000; the last checkpoint is step {step} in {tmp_path}/"
          "checkpoints. Continue with: python -m dlion_jax.train "
          f"{shlex.join(argv)} --resume") in err
  assert "test accuracy" not in out


def _disk_full_at(tmp_path, monkeypatch, step):
  """Makes orbax fail as it does on a full disk from checkpoint ``step``
  on: a partial tmp directory left, a logged error and a printed
  traceback from its threads, then tensorstore's ValueError."""
  real_save = checkpoint.ocp.CheckpointManager.save

  def full_save(self, at, *args, **kwargs):
    if at < step:
      return real_save(self, at, *args, **kwargs)
    partial = tmp_path / "checkpoints" / f"{at}.orbax-checkpoint-tmp-1"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_sharding").write_bytes(b"\0" * 100)
    logging.getLogger("absl").error("_SignalingThread.run() raised")
    print("Traceback (most recent call last):\nRuntimeError: Event loop "
          "is closed", file=sys.stderr)
    raise ValueError(
        f'RESOURCE_EXHAUSTED: Error writing local file "{partial}/state/'
        '_sharding": Failed to write 3217 bytes to file 4: No space left on '
        "device [os_error_code='28']")
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_save)


def test_disk_full_during_a_checkpoint_is_one_line(tmp_path, capsys,
                                                   monkeypatch):
  """What failed, the last good checkpoint, what to free; the partial
  checkpoint is removed and the run resumes from step 2 once there is
  space (was: 337 lines, 6 tracebacks, then orbax's error)."""
  _disk_full_at(tmp_path, monkeypatch, 4)
  argv = _argv(tmp_path)
  code, err = _cli(capsys, argv)
  assert code == 1
  command = shlex.join(["python", "-m", "dlion_jax.train", *argv])
  assert len(err) == 1, err
  head, size = err[0].split(", each about ")
  assert head == (
      f"error: writing checkpoint step 4 to {tmp_path}/checkpoints failed: "
      f"no space left on the device. Free space on the file system holding "
      f"{tmp_path} (delete runs you no longer need, or keep fewer "
      "checkpoints: train.keep_checkpoints=5")
  assert re.fullmatch(
      r"\d+\.\d KiB\); the last checkpoint is step 2 in "
      + re.escape(f"{tmp_path}/checkpoints. Continue with: {command} "
                  "--resume"), size), size
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
      "2"]
  monkeypatch.undo()
  code, _ = _cli(capsys, argv + ["--resume"])
  assert code == 0 and rundir.checkpoint_steps(tmp_path) == [2, 4]


def test_disk_full_writing_metrics_is_one_line(tmp_path, capsys,
                                               monkeypatch):
  from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
  real_write = trainer._Writer.write  # pylint: disable=protected-access

  def full_write(self, record):
    if record.get("step", 0) >= 3:
      raise OSError(errno.ENOSPC, "No space left on device")
    real_write(self, record)
  monkeypatch.setattr(trainer._Writer, "write", full_write)  # pylint: disable=protected-access
  code, err = _cli(capsys, _argv(tmp_path))
  assert code == 1
  assert len(err) == 1 and err[0].startswith(
      f"error: writing to {tmp_path} failed: no space left on the device. "
      f"Free space on the file system holding {tmp_path} (delete runs you "
      "no longer need, or keep fewer checkpoints: train.keep_checkpoints=5)"
      f"; the last checkpoint is step 2 in {tmp_path}/checkpoints. Continue "
      "with: python -m dlion_jax.train "), err
