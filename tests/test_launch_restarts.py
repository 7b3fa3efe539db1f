"""``python -m dlion_jax.launch --restarts K``: a process that dies or
hangs costs a restart on the survivors, not the run (docs/reliability.md,
section 3.1). Small Python children (no jax: seconds each) do what the
tests ask at their first start; tests/test_restarts.py runs the train CLI
so.
"""

import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration

PY = sys.executable
LAUNCH = [PY, "-m", "dlion_jax.launch"]
ROOT = pathlib.Path(__file__).resolve().parent.parent

# A child that reports what the launcher told it, then does what the test
# asks at its first start (process 1 by default): the launcher restarts it.
CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    e = os.environ
    i, restart = int(e["JAX_PROCESS_ID"]), e.get("DLION_RESTART")
    print("start", i, e["JAX_NUM_PROCESSES"], restart,
          e.get("DLION_FIRST_NUM_PROCESSES"), e.get("DLION_MIN_PROCESSES"),
          e.get("DLION_LAUNCH_ID"), flush=True)
    beat = e.get("DLION_HEARTBEAT_FILE")
    def go():
      while True:
        open(beat, "a").close(); os.utime(beat); time.sleep(0.3)
    if beat:
      threading.Thread(target=go, daemon=True).start()
    time.sleep(0.5)
    mode, victim = sys.argv[1], int(sys.argv[2])
    if restart == "0" and i == victim:
      if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
      if mode == "usage":
        sys.exit(2)
    if mode == "fail":
      sys.exit(3)
    if restart == "0":
      time.sleep(60)
    print("done", i, flush=True)
""")


def _run(cmd, timeout=60, **kwargs):
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT, **kwargs)


def _launch(*options, mode="kill", victim=1):
  return _run(LAUNCH + [*options, "--", PY, "-c", CHILD, mode, str(victim)])


def _starts(out):
  """Each ``start`` line: (process, processes, restart, first, min, id)."""
  return [tuple(line.split()[2:]) for line in out.splitlines()
          if line.split()[1:2] == ["start"]]


def test_a_killed_process_costs_a_restart_on_the_survivors():
  out = _launch("-n", "3", "--restarts", "2")
  assert out.returncode == 0, out.stdout + out.stderr
  notes = [line for line in out.stderr.splitlines()
           if line.startswith("launch:")]
  assert notes == [
      "launch: process 1 was killed by SIGKILL; killing processes 0, 2",
      "launch: restart 1 of 2 on 2 processes, was 3 (process 1 was killed "
      "by SIGKILL)"], out.stderr
  starts = _starts(out.stdout)
  first = sorted(s for s in starts if s[2] == "0")
  again = sorted(s for s in starts if s[2] == "1")
  launch_id = first[0][5]
  assert first == [(str(i), "3", "0", "3", "1", launch_id) for i in range(3)]
  assert again == [(str(i), "2", "1", "3", "1", launch_id) for i in range(2)]
  assert "[0] done 0" in out.stdout and "[1] done 1" in out.stdout


def test_a_hung_process_is_killed_and_the_run_restarted():
  """SIGSTOP: the process is there, its sockets open, but its heartbeat
  stops; the watchdog declares it hung."""
  tic = time.monotonic()
  out = _launch("-n", "2", "--restarts", "1", "--watchdog", "2", mode="stop")
  took = time.monotonic() - tic
  assert out.returncode == 0, out.stdout + out.stderr
  assert ("launch: process 1 stopped responding: no heartbeat for 2 s; "
          "killing it and process 0") in out.stderr
  assert ("launch: restart 1 of 1 on 1 process, was 2 (process 1 stopped "
          "responding: no heartbeat for 2 s)") in out.stderr
  assert took < 30, took


def test_replace_restarts_on_as_many_processes():
  out = _launch("-n", "2", "--restarts", "1", "--replace", victim=0)
  assert out.returncode == 0, out.stdout + out.stderr
  assert ("launch: restart 1 of 1 on 2 processes, process 0 replaced "
          "(process 0 was killed by SIGKILL)") in out.stderr
  assert sorted(s[:4] for s in _starts(out.stdout) if s[2] == "1") == [
      ("0", "2", "1", "2"), ("1", "2", "1", "2")]
  assert {s[4] for s in _starts(out.stdout)} == {"2"}   # never fewer


def test_a_usage_error_is_not_restarted():
  out = _launch("-n", "2", "--restarts", "3", mode="usage")
  assert out.returncode == 2, out.stderr
  assert ("launch: not restarting: exit code 2 is a usage or config error, "
          "which a restart would repeat") in out.stderr
  assert "restart 1" not in out.stderr


def test_restarts_run_out():
  out = _launch("-n", "3", "--restarts", "2", mode="fail")
  assert out.returncode == 3, out.stderr
  assert out.stderr.count("launch: restart ") == 2
  assert "restart 2 of 2 on 1 process, was 2" in out.stderr
  assert out.stderr.rstrip().endswith(
      "launch: no restart left (--restarts 2 used)")


def test_the_timeout_counts_every_start():
  tic = time.monotonic()
  out = _launch("-n", "1", "--restarts", "100", "--replace", "--timeout",
                "3", mode="fail")
  assert out.returncode == 124, out.stderr
  assert "timed out after 3 s" in out.stderr
  assert time.monotonic() - tic < 30


def test_ctrl_c_stops_everything_without_a_restart():
  proc = subprocess.Popen(
      LAUNCH + ["-n", "2", "--restarts", "2", "--", PY, "-c", CHILD, "none",
                "9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, cwd=ROOT)
  try:
    seen = 0
    while seen < 2:
      line = proc.stdout.readline()
      assert line, "the launcher ended before its processes started"
      seen += " start " in line
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, err
  assert "restart" not in err


def test_start_processes_beats_the_watchdog():
  """A process of dlion_jax.processes.start_processes is alive past the
  watchdog's limit (its thread beats), and hung once frozen."""
  child = textwrap.dedent("""
      import os, signal, time
      from dlion_jax import processes
      processes.start_processes(1)
      print("restart", os.environ["DLION_RESTART"], flush=True)
      if os.environ["DLION_RESTART"] == "0":
        time.sleep(6)                         # twice the watchdog's limit
        print("still here", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
  """)
  out = _run(LAUNCH + ["-n", "1", "--restarts", "1", "--replace",
                       "--watchdog", "3", "--", PY, "-c", child], timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[0] still here" in out.stdout
  assert ("process 0 stopped responding: no heartbeat for 3 s"
          in out.stderr)
  assert "[0] restart 1" in out.stdout
