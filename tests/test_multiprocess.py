"""Real multi-process runs on localhost through ``python -m dlion_jax.launch``.

Every child runs under a wall-clock limit (``subprocess.run(timeout=...)``
and the launcher's own ``--timeout``), so a hang fails the test instead of
blocking CI.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.integration

PY = sys.executable
LAUNCH = [PY, "-m", "dlion_jax.launch"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A few steps of the quickstart on a tiny model: 2 workers, a mid-run
# evaluation and checkpoint, then the final ones.
SMALL = ["workers=2", "train.steps=6", "model.hidden=[16]", "train.log_every=2",
         "train.eval_every=3", "train.checkpoint_every=3",
         "data.eval_batch=512", "optimizer.warmup_steps=2",
         "optimizer.learning_rate=1e-2"]


def _run(cmd, timeout, **kwargs):
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT, **kwargs)


def test_two_processes_match_one_process_bit_for_bit(tmp_path):
  """2 processes x 1 CPU device == 1 process x 2 devices, bit for bit.

  The pytest process has XLA_FLAGS=--xla_force_host_platform_device_count=8
  (tests/conftest.py), which the children inherit: the CLI must override it
  with one device per process.
  """
  pytest.importorskip("flax", reason="the train CLI needs the [examples] "
                      "extra (flax, orbax-checkpoint, pyyaml, scikit-learn)")
  from dlion_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import cli  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
  from dlion_jax.train.config import load_config  # pylint: disable=g-import-not-at-top

  assert "xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
  multi = tmp_path / "multi"
  # An earlier run's leftovers, which --overwrite must clear before either
  # process opens the checkpoints.
  (multi / "checkpoints" / "999").mkdir(parents=True)
  (multi / "metrics.jsonl").write_text('{"step": 999, "loss": 0.0}\n')
  sets = [a for s in SMALL + [f"run_dir={multi}"] for a in ("--set", s)]
  out = _run(LAUNCH + ["-n", "2", "--timeout", "150", "--",
                       PY, "-m", "dlion_jax.train", "--no-progress",
                       "--init-timeout", "60", "--overwrite", *sets],
             timeout=180)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[0] quickstart: mlp" in out.stdout
  assert "2 workers (cpu; 2 processes, 1 device each)" in out.stdout
  assert "[0] test accuracy" in out.stdout
  assert "[1] test accuracy" not in out.stdout      # process 0 reports

  # The reference: one process, 2 of this process's devices.
  single = tmp_path / "single"
  cfg = load_config(cli.resolve_config("quickstart"),
                    SMALL + [f"run_dir={single}"])
  ref = trainer.train(cfg, progress=False, log=lambda *_: None)

  # Exact comparison: restore the 2-process run's final orbax checkpoint
  # (written by both processes) with the Checkpointer, into arrays shaped
  # and sharded like the reference's, then compare every bit.
  like = {"params": ref["params"], "opt_state": ref["opt_state"]}
  assert not (multi / "checkpoints" / "999").exists()
  ckpt = checkpoint.Checkpointer(multi / "checkpoints")
  assert ckpt.latest_step() == 6
  state, meta = ckpt.restore(like)
  ckpt.close()
  assert meta["step"] == 6 and meta["workers"] == 2
  jax.tree.map(np.testing.assert_array_equal, ref["params"], state["params"])
  jax.tree.map(np.testing.assert_array_equal, ref["opt_state"],
               state["opt_state"])
  first = jax.tree.leaves(state["opt_state"][0].mu)[0]
  assert not np.array_equal(first[0], first[1])   # each worker's momentum
  leaves = jax.tree.leaves(state["params"])
  assert any(np.any(np.asarray(x) != 0) for x in leaves)

  # Same logged losses and evaluations, only process 0 wrote files.
  def records(run):
    return [{k: v for k, v in json.loads(line).items()
             if k != "examples_per_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert records(multi) == records(single)
  assert [r["step"] for r in records(multi) if "test_loss" in r] == [3, 6]
  summary = json.loads((multi / "summary.json").read_text())
  assert summary == json.loads((single / "summary.json").read_text())
  assert (multi / "curves.png").is_file()


def test_launcher_stops_everything_when_one_process_fails():
  child = textwrap.dedent("""
      import os, sys, time
      i = int(os.environ["JAX_PROCESS_ID"])
      print("hello from", i, os.environ["JAX_NUM_PROCESSES"],
            os.environ["JAX_COORDINATOR_ADDRESS"], flush=True)
      time.sleep(0.5)
      if i == 1:
          print("giving up", file=sys.stderr, flush=True)
          sys.exit(3)
      time.sleep(120)
  """)
  tic = time.monotonic()
  out = _run(LAUNCH + ["-n", "2", "--port", "23999", "--", PY, "-c", child],
             timeout=60)
  took = time.monotonic() - tic
  assert out.returncode == 3, out.stdout + out.stderr
  assert took < 15, took
  assert "[0] hello from 0 2 127.0.0.1:23999" in out.stdout
  assert "[1] hello from 1 2 127.0.0.1:23999" in out.stdout
  assert "[1] giving up" in out.stderr
  assert "process 1 exited with code 3; stopping process 0" in out.stderr


def test_launcher_forwards_ctrl_c():
  child = textwrap.dedent("""
      import time
      print("ready", flush=True)
      try:
          time.sleep(120)
      except KeyboardInterrupt:
          print("interrupted", flush=True)
  """)
  proc = subprocess.Popen(LAUNCH + ["-n", "2", "--", PY, "-c", child],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT)
  try:
    lines = []
    while sum("ready" in seen for seen in lines) < 2:
      line = proc.stdout.readline()
      assert line, "the launcher ended before its processes were ready"
      lines.append(line)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, err
  assert "[0] interrupted" in out and "[1] interrupted" in out
  assert "SIGINT" in err


def test_sigterm_to_the_launcher_saves_a_step_both_processes_agree_on(
    tmp_path):
  """SIGTERM (a scheduler's preemption) to the launcher reaches both
  training processes; jax's preemption service picks one step for both,
  they checkpoint it and each says how to resume (was: killed silently,
  SIGKILL after the launcher's 5 s grace, progress since the last
  checkpoint lost)."""
  pytest.importorskip("flax", reason="the train CLI needs the [examples] "
                      "extra")
  sets = [a for s in ["workers=2", "model.hidden=[8]", "train.steps=100000",
                      "train.checkpoint_every=20", "train.eval_every=0",
                      f"run_dir={tmp_path}"] for a in ("--set", s)]
  proc = subprocess.Popen(
      LAUNCH + ["-n", "2", "--timeout", "150", "--", PY, "-m",
                "dlion_jax.train", "--no-progress", *sets],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  first = tmp_path / "checkpoints" / "20"
  deadline = time.monotonic() + 120
  try:
    while not first.is_dir():
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "no checkpoint after 120 s"
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 143, err
  assert "Traceback" not in err and "was killed by SIGKILL" not in err, err
  lines = {i: [line for line in err.splitlines()
               if line.startswith(f"[{i}] terminated (SIGTERM) at step ")]
           for i in (0, 1)}
  assert len(lines[0]) == 1 and len(lines[1]) == 1, err
  step = int(lines[0][0].split(" at step ")[1].split(" ")[0])
  assert step > 20 and f" at step {step} of " in lines[1][0], err
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert saved[-1] == step, (saved, err)
  assert (f"the last checkpoint is step {step} in {tmp_path}/checkpoints. "
          "Continue on every process with: python -m dlion_jax.train "
          "--no-progress ") in lines[0][0]
  assert lines[0][0].endswith(" --resume")


@pytest.mark.parametrize("argv, message", [
    (["-n", "2", "python", "-c", "1"], "missing '--' before the command"),
    (["-n", "2", "--"], "no command after '--'"),
    (["--", "python"], "-n/--num-processes"),
    (["-n", "0", "--", "python"], "need at least 1 process"),
    (["-n", "2", "--timeout", "0", "--", "python"], "must be positive"),
    (["-n", "2", "--restarts", "-1", "--", "python"],
     "--restarts -1: must be 0 or more"),
    (["-n", "2", "--restarts", "1", "--watchdog", "1", "--", "python"],
     "--watchdog 1: must be 0 (off) or at least 2 seconds"),
    (["-n", "2", "--replace", "--", "python"],
     "--replace needs --restarts K"),
])
def test_launcher_usage_errors(argv, message, capsys):
  from dlion_jax import launch  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    launch.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and "usage:" in err


def test_launcher_help_is_plain_text_with_its_own_run_dir(capsys):
  """--help: no reStructuredText, and its example trains in a run_dir of
  its own (was: the quickstart's runs/quickstart, which then refused the
  quickstart)."""
  from dlion_jax import launch  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as exit_info:
    launch.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  assert "``" not in out and "::" not in out, out
  assert "JAX_PROCESS_ID" in out and "143 on SIGTERM" in out
  example = out.split("examples:\n", 1)[1].split("\n  python", 1)[0]
  assert "dlion_jax.train" in example, out
  assert "--set run_dir=runs/quickstart-2proc" in example, out


def test_launcher_timeout():
  out = _run(LAUNCH + ["-n", "2", "--timeout", "1", "--", PY, "-c",
                       "import time; time.sleep(60)"], timeout=30)
  assert out.returncode == 124
  assert "timed out after 1 s" in out.stderr


def test_unreachable_coordinator_fails_fast_and_names_it():
  """Process 1 alone: nobody serves the coordinator's port."""
  pytest.importorskip("yaml", reason="the train CLI needs the [examples] "
                      "extra")
  from dlion_jax import launch  # pylint: disable=g-import-not-at-top
  address = f"127.0.0.1:{launch._free_port()}"
  tic = time.monotonic()
  out = _run([PY, "-m", "dlion_jax.train", "--no-progress", "--coordinator",
              address, "--num-processes", "2", "--process-id", "1",
              "--init-timeout", "3", "--set", "workers=2"], timeout=60)
  assert out.returncode == 1, out.stderr
  assert time.monotonic() - tic < 30
  assert (f"process 1 of 2 could not reach the coordinator at {address}"
          in out.stderr)


def test_busy_coordinator_port_is_a_clear_error():
  pytest.importorskip("yaml", reason="the train CLI needs the [examples] "
                      "extra")
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    out = _run([PY, "-m", "dlion_jax.train", "--coordinator", address,
                "--num-processes", "2", "--process-id", "0",
                "--set", "workers=2"], timeout=60)
  assert out.returncode == 2, out.stderr
  assert "which is in use on this machine" in out.stderr
  assert address in out.stderr
