"""Goodput under lost processes: the quickstart under ``python -m
dlion_jax.launch --restarts``, a process SIGKILLed every T seconds.

The quickstart (``configs/quickstart.yaml``, 8 workers) runs as 4 local
processes of 2 devices each, a fixed number of steps with a checkpoint
every few, in the form the multi-host guide gives::

  python -m dlion_jax.launch -n 4 --restarts K [--replace] -- \\
      python -m dlion_jax.train --set data.global_batch=240 \\
      --set train.steps=600 [--set train.checkpoint_every=E] --set run_dir=R

first failure-free, then with a process SIGKILLed every ``T`` seconds of
wall time (``--periods``; a seeded RNG picks the process and each kill's
time: the first at a random phase in ``[0, T]``, then ``T`` apart with a
jitter of up to ``T / 4`` either side). Kills run with ``--replace`` (a
fresh process takes the lost one's place, as a preempted host's
replacement would): every start runs the same 8 workers, so the wall
times compare, and a run survives any number of kills. A kill waits
until the restart of the one before it is under way (one kill, one
restart).

Reported:

* goodput: the failure-free run's wall time over the run's with kills (the
  failure-free run measured in the same invocation, the machine's load
  alike), and the final test accuracy against the failure-free run's;
* what each restart cost, split: *detect* (the kill to the launcher's note
  of it), *stop* (that note to its note of the restart: the others killed,
  their output drained), *start* (the launcher's start of the processes to
  the trainer's start of the restore: python, jax, ``jax.distributed``, the
  data; ``start_s`` in the run directory's ``restarts.jsonl``), *restore*
  (``restore_s``), *compile* (``compile_s``: the step's compile, from jax's
  persistent cache the launcher shares) and *steps redone* (``steps_redone``,
  the steps logged past the checkpoint resumed from, at the failure-free
  run's seconds a step); *other* is what the wall time lost beyond those;
* the checkpoint's cost on the step: the seconds each save took
  (``checkpoint_s``) over the steps between saves;
* with ``--kill-at-step S --kill-process P ...``: one run a process, that
  process SIGKILLed once the run has logged step ``S``, under the launcher
  on the survivors (``--restarts 2``, no ``--replace``): the launcher's exit
  code, the final step, the test accuracy and the wall time over the
  uninterrupted run's (the issue's "done means").

Usage::

  python -m benchmarks.goodput [--periods 30 60 120] [--steps 600]
      [--checkpoint-every 100] [--seed 0] [--kill-at-step 250
      --kill-process 1 0] [--json docs/data/goodput.json]
      [--out docs/reliability.md] [--plot docs/img/goodput.png]
  python -m benchmarks.goodput --from-json docs/data/goodput.json \\
      --out docs/reliability.md --plot docs/img/goodput.png
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from dlion_jax.bench import reporting

PROCESSES = 4
QUICKSTART_EVERY = 100      # configs/quickstart.yaml's train.checkpoint_every
GLOBAL_BATCH = 240          # divisible by every worker count a restart leaves
PARTS = ("detect", "stop", "start", "restore", "compile", "redone")
_FAILED = re.compile(r"launch: process(?:es)? [\d, ]+ (?:was killed|exited|"
                     r"stopped responding)")
_RESTART = re.compile(r"launch: restart (\d+) of")
_POLL_S = 0.05


def command(run_dir, *, steps: int, every: int | None, restarts: int,
            replace: bool, processes: int = PROCESSES,
            python: str = sys.executable) -> list[str]:
  """The launcher's command line for a run of the quickstart in
  ``run_dir``, a checkpoint every ``every`` steps (None: the quickstart's
  own, every 100)."""
  return [python, "-m", "dlion_jax.launch", "-n", str(processes),
          "--restarts", str(restarts), *(["--replace"] if replace else []),
          "--", python, "-m", "dlion_jax.train",
          "--set", f"data.global_batch={GLOBAL_BATCH}",
          "--set", f"train.steps={steps}",
          *(["--set", f"train.checkpoint_every={every}"] if every else []),
          "--set", f"run_dir={run_dir}"]


def kill_times(period: float, seed: int, horizon: float) -> list[float]:
  """Seconds after the launch at which to kill, up to ``horizon``: the
  first at a random phase in ``[0, period]``, then ``period`` apart, each
  with a jitter of up to ``period / 4`` either side."""
  rng = random.Random(seed)
  out, t = [], rng.uniform(0.0, 1.0) * period
  while t < horizon:
    out.append(round(t, 3))
    t += period * (1 + rng.uniform(-0.25, 0.25))
  return out


def _children(pid: int) -> dict[int, int]:
  """The launcher's running children: process index -> pid (read off
  ``/proc``: their ``JAX_PROCESS_ID``)."""
  found = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
        stat = f.read()
      fields = stat[stat.rindex(")") + 2:].split()
      if int(fields[1]) != pid or fields[0] == "Z":
        continue
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0")
                   if b"=" in kv)
      if b"JAX_PROCESS_ID" in env:
        found[int(env[b"JAX_PROCESS_ID"])] = int(entry)
    except (OSError, ValueError, IndexError):
      pass                                 # gone meanwhile
  return found


def _last_step(run_dir: pathlib.Path) -> int:
  """The last step the run logged in its ``metrics.jsonl`` (0: none)."""
  try:
    lines = (run_dir / "metrics.jsonl").read_text(
        encoding="utf-8").splitlines()
  except OSError:
    return 0
  for line in reversed(lines):
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      continue
  return 0


def launch_run(argv: list[str], run_dir: pathlib.Path, *,
               kills_at: list[float] = (), kill_seed: int = 0,
               kill_at_step: int | None = None,
               kill_process: int | None = None,
               timeout: float | None = None) -> dict:
  """Runs the launcher ``argv`` and kills as asked; returns the run's
  record: ``wall_s``, ``exit``, ``kills`` (each ``t``, the seconds after the
  launch, and ``process``), the launcher's ``notes`` (``t``, ``text``), the
  run directory's ``summary`` (None if it wrote none) and the ``log``'s
  last lines.

  Args:
    argv: the launcher's command line (:func:`command`).
    run_dir: the run directory it trains in.
    kills_at: seconds after the launch to SIGKILL a process at, each
      once the previous kill's restart was announced and every process of
      the group runs (one kill, one restart).
    kill_seed: seeds the RNG that picks each kill's process.
    kill_at_step: SIGKILL ``kill_process`` once the run has logged this
      step (at its first start).
    kill_process: the process ``kill_at_step`` kills.
    timeout: seconds after which the launcher is killed (``exit`` None).
  """
  rng = random.Random(kill_seed)
  notes, log, lock = [], [], threading.Lock()
  tic = time.monotonic()
  proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)

  def pump(stream):
    for raw in iter(stream.readline, b""):
      text = raw.decode(errors="replace").rstrip()
      with lock:
        log.append(text)
        del log[:-200]
        # A note may follow a process's progress bar on its line.
        if "launch: " in text:
          notes.append({"t": round(time.monotonic() - tic, 3),
                        "text": text[text.index("launch: "):]})
  pumps = [threading.Thread(target=pump, args=(s,), daemon=True)
           for s in (proc.stdout, proc.stderr)]
  for t in pumps:
    t.start()
  n0 = int(argv[argv.index("-n") + 1])
  replace = "--replace" in argv
  pending = [None] if kill_at_step is not None else list(kills_at)
  kills = []
  code = None
  try:
    code = _watch(proc, tic, run_dir, notes, lock, pending, kills, rng,
                  n0=n0, replace=replace, kill_at_step=kill_at_step,
                  kill_process=kill_process, timeout=timeout)
  finally:
    if proc.poll() is None:          # timed out, or we were interrupted
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  wall = time.monotonic() - tic
  for t in pumps:
    t.join(timeout=5.0)
  summary_path = run_dir / "summary.json"
  summary = (json.loads(summary_path.read_text(encoding="utf-8"))
             if summary_path.is_file() else None)
  return {"wall_s": round(wall, 3), "exit": code, "kills": kills,
          "notes": notes, "summary": summary, "log": log[-40:],
          "starts": _starts(run_dir),
          "last_step": _last_step(run_dir), "step_s": step_seconds(run_dir)}


def _watch(proc, tic, run_dir, notes, lock, pending, kills, rng, *, n0,
           replace, kill_at_step, kill_process, timeout) -> int | None:
  """Polls the launcher ``proc`` until it exits (its code) or ``timeout``
  (None), killing as :func:`launch_run` says."""
  while True:
    code = proc.poll()
    now = time.monotonic() - tic
    if code is not None:
      return code
    if timeout is not None and now > timeout:
      return None
    if pending and _due(pending[0], now, run_dir, kill_at_step):
      with lock:
        restarted = sum(bool(_RESTART.match(n["text"])) for n in notes)
      running = _children(proc.pid)
      whole = len(running) == n0 if replace or not kills else bool(running)
      if restarted == len(kills) and running and whole:
        victim = (kill_process if kill_at_step is not None
                  else rng.choice(sorted(running)))
        if victim in running:
          try:
            os.kill(running[victim], signal.SIGKILL)
            kills.append({"t": round(time.monotonic() - tic, 3),
                          "process": victim,
                          **({"step": _last_step(run_dir)}
                             if kill_at_step is not None else {})})
            pending.pop(0)
          except ProcessLookupError:
            pass
    time.sleep(_POLL_S)


def _starts(run_dir: pathlib.Path) -> list[dict]:
  """The run directory's records of its starts (``restarts.jsonl``), each
  start's lines merged; there even where the run did not finish."""
  from dlion_jax.train import restarts  # pylint: disable=g-import-not-at-top
  return restarts.read(run_dir)


def _due(when, now: float, run_dir: pathlib.Path,
         kill_at_step: int | None) -> bool:
  if kill_at_step is not None:
    return _last_step(run_dir) >= kill_at_step
  return now >= when


def step_seconds(run_dir: pathlib.Path) -> float | None:
  """Seconds a step: the median over the run's logged intervals of the
  global batch over ``examples_per_s`` (None without any)."""
  try:
    lines = (run_dir / "metrics.jsonl").read_text(
        encoding="utf-8").splitlines()
  except OSError:
    return None
  rates = []
  for line in lines:
    try:
      rates.append(GLOBAL_BATCH / float(json.loads(line)["examples_per_s"]))
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
      pass
  return statistics.median(rates) if rates else None


def restart_costs(run: dict, step_s: float) -> list[dict]:
  """Each restart's cost in seconds, split (:data:`PARTS`), from the run's
  record (:func:`launch_run`): its kills, the launcher's notes and the
  run directory's records of its starts; ``step_s``: the failure-free
  run's seconds a step (for the steps redone). Each kill is matched with
  the launcher's first note of a failure after it and its first note of a
  restart after that. A restart whose start never recorded (killed before
  it was ready) has the pieces it has."""
  failed = [n["t"] for n in run["notes"] if _FAILED.match(n["text"])]
  restarted = [(int(_RESTART.match(n["text"]).group(1)), n["t"])
               for n in run["notes"] if _RESTART.match(n["text"])]
  starts = {s["restart"]: s for s in run.get("starts") or
            (run["summary"] or {}).get("starts", [])}
  out = []
  for kill in run["kills"]:
    seen = next((t for t in failed if t >= kill["t"]), None)
    then = next(((r, t) for r, t in restarted
                 if seen is not None and t >= seen), None)
    if then is None:
      continue
    r, at = then
    rec = starts.get(r, {})
    cost = {"restart": r, "process": kill["process"],
            "detect": round(seen - kill["t"], 3),
            "stop": round(at - seen, 3)}
    for part, key in (("start", "start_s"), ("restore", "restore_s"),
                      ("compile", "compile_s")):
      if key in rec:
        cost[part] = rec[key]
    if "steps_redone" in rec:
      cost["steps_redone"] = rec["steps_redone"]
      cost["redone"] = round(rec["steps_redone"] * step_s, 3)
    cost["total"] = round(sum(cost.get(p, 0.0) for p in PARTS), 3)
    out.append(cost)
  return out


def checkpoint_cost(run: dict, every: int) -> dict | None:
  """The checkpoint's cost: the mean seconds a save took, and that over the
  ``every`` steps between saves (seconds a step), from the last start's
  ``checkpoint_s``."""
  starts = (run["summary"] or {}).get("starts", [])
  saves = starts[-1].get("checkpoint_s", []) if starts else []
  if not saves:
    return None
  mean = statistics.mean(saves)
  return {"saves": len(saves), "save_s": mean, "per_step_s": mean / every}


def goodput(run: dict, base: dict) -> float:
  """The failure-free run's wall time over ``run``'s."""
  return base["wall_s"] / run["wall_s"]


def _accuracy(run: dict) -> float | None:
  return (run["summary"] or {}).get("test_accuracy")


def _step(run: dict):
  return (run["summary"] or {}).get("step", "-")


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.2f}"


def goodput_table(result: dict) -> str:
  """Goodput per kill period, beside the failure-free run."""
  base = result["baseline"]
  rows = [["none (failure-free)", 0, f"{base['wall_s']:.1f}", "100.0",
           base["exit"], _step(base), _pct(_accuracy(base)), "-"]]
  for run in result["periods"]:
    acc, base_acc = _accuracy(run), _accuracy(base)
    finished = run["exit"] is not None
    rows.append([
        f"{run['period']:g} s", len(run["kills"]), f"{run['wall_s']:.1f}",
        f"{100 * goodput(run, base):.1f}" if finished else
        f"< {100 * goodput(run, base):.1f} (stopped at step "
        f"{run.get('last_step', '?')})", run["exit"] if finished else
        "stopped", _step(run),
        _pct(acc), "-" if acc is None or base_acc is None else
        f"{100 * (acc - base_acc):+.2f}"])
  return reporting.markdown_table(
      ["kill every", "kills", "wall s", "goodput %", "launcher exit",
       "final step", "test accuracy %", "vs failure-free, points"], rows)


def cost_table(result: dict) -> str:
  """Each restart's cost, split, and the mean over all."""
  step_s = result["baseline"]["step_s"]
  rows, every = [], []
  labelled = [(f"{r['period']:g} s", r) for r in result["periods"]] + [
      (f"once, past step {result['settings']['kill_at_step']}", r)
      for r in result.get("kill_at_step", [])]
  for label, run in labelled:
    for c in restart_costs(run, step_s):
      every.append(c)
      rows.append([label, c["restart"], c["process"],
                   *(_s(c.get(p)) for p in PARTS),
                   c.get("steps_redone", "-"), _s(c["total"])])
  if every:
    rows.append(["mean", "", "", *(_s(_mean(every, p)) for p in PARTS),
                 _s(_mean(every, "steps_redone"), 0),
                 _s(_mean(every, "total"))])
  return reporting.markdown_table(
      ["kill every", "restart", "process killed",
       *(f"{p} s" for p in PARTS[:-1]), "steps redone s", "steps redone",
       "total s"], rows)


def mean_cost(result: dict) -> float | None:
  """The mean total cost of every restart measured (kills every T seconds
  and once past a step), in seconds; None without any."""
  step_s = result["baseline"]["step_s"]
  costs = [c for run in result["periods"] + result.get("kill_at_step", [])
           for c in restart_costs(run, step_s)]
  return _mean(costs, "total")


def _mean(costs, part):
  got = [c[part] for c in costs if part in c]
  return statistics.mean(got) if got else None


def _s(x, digits: int = 1) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def other_seconds(run: dict, base: dict) -> float:
  """What ``run`` lost beyond its restarts' costs: its wall time less the
  failure-free run's and the restarts' totals."""
  costs = restart_costs(run, base["step_s"])
  return run["wall_s"] - base["wall_s"] - sum(c["total"] for c in costs)


def kill_table(result: dict) -> str:
  """The kill-at-step runs beside the uninterrupted one."""
  base = result["baseline"]
  rows = [["none (uninterrupted)", "-", base["exit"], _step(base),
           _pct(_accuracy(base)), f"{base['wall_s']:.1f}", "1.00"]]
  for run in result.get("kill_at_step", []):
    k = run["kills"][0] if run["kills"] else {}
    rows.append([f"process {run['process']}", k.get("step", "-"),
                 run["exit"], _step(run), _pct(_accuracy(run)),
                 f"{run['wall_s']:.1f}",
                 f"{run['wall_s'] / base['wall_s']:.2f}"])
  return reporting.markdown_table(
      ["killed", "at step (logged)", "launcher exit", "final step",
       "test accuracy %", "wall s", "wall / uninterrupted"], rows)


def report(result: dict) -> str:
  """The section's text: settings, goodput, restart costs, checkpoint cost
  and the kill-at-step runs."""
  cfg = result["settings"]
  base = result["baseline"]
  parts = [f"{cfg['processes']} processes, {cfg['steps']} steps, a "
           f"checkpoint every {cfg['checkpoint_every']} steps, kill seed "
           f"{cfg['seed']}; {cfg['machine']}.", ""]
  if result["periods"]:
    parts += ["Goodput (failure-free wall time over the run's; kills with "
              "`--replace`):", "", goodput_table(result), "",
              "What each restart cost, seconds (steps redone at the "
              f"failure-free run's {1000 * base['step_s']:.1f} ms a step):",
              "", cost_table(result), ""]
    mean = mean_cost(result)
    if mean:
      parts += [f"A run long against T loses about the mean restart cost, "
                f"{mean:.1f} s, every T seconds: goodput about 1 - "
                f"{mean:.1f} / T, " + ", ".join(
                    f"{100 * max(0.0, 1 - mean / r['period']):.0f} % at "
                    f"{r['period']:g} s" for r in result["periods"])
                + " (an estimate from the costs above, not a run).", ""]
    others = [f"{run['period']:g} s: {other_seconds(run, base):+.1f} s"
              for run in result["periods"]]
    parts += ["Wall time lost beyond the restarts' costs (slower steps, "
              "noise; negative: the run with kills went faster between "
              "them): " + ", ".join(others) + ".", ""]
  ckpt = checkpoint_cost(base, cfg["checkpoint_every"])
  if ckpt:
    parts += [f"Checkpoint cost (failure-free run): {ckpt['saves']} saves "
              f"of {1000 * ckpt['save_s']:.0f} ms on average, "
              f"{1000 * ckpt['per_step_s']:.1f} ms a step against "
              f"{1000 * base['step_s']:.1f} ms for the step itself.", ""]
  if result.get("kill_at_step"):
    parts += ["A process killed once, past step "
              f"{cfg['kill_at_step']} of {cfg['steps']} (`--restarts 2`, on "
              "the survivors):", "", kill_table(result), ""]
  return "\n".join(parts).strip()


def plot(result: dict, path: str) -> None:
  """Goodput per kill period, and each period's mean restart cost split."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  base = result["baseline"]
  runs = result["periods"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.6))
  periods = [r["period"] for r in runs]
  left.plot(periods, [100 * goodput(r, base) for r in runs], "o-",
            label="measured")
  left.axhline(80, color="grey", ls="--", lw=1, label="target, T = 120 s")
  left.set_xlabel("a process killed every T seconds")
  left.set_ylabel("goodput %")
  left.set_ylim(0, 105)
  left.set_xticks(periods)
  left.legend(fontsize=7)
  left.set_title("quickstart, 4 processes", fontsize=9)
  bottom = [0.0] * len(runs)
  labels = [f"{p:g} s" for p in periods]
  for part in PARTS:
    got = [_mean(restart_costs(r, base["step_s"]), part) or 0.0
           for r in runs]
    right.bar(labels, got, bottom=bottom, label=part)
    bottom = [b + g for b, g in zip(bottom, got)]
  right.set_xlabel("kill period")
  right.set_ylabel("seconds a restart (mean)")
  right.legend(fontsize=7)
  right.set_title("what a restart costs", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def run_all(args, root: pathlib.Path) -> dict:
  """The failure-free run, one run a kill period, and the kill-at-step
  runs."""
  from dlion_jax import bench  # pylint: disable=g-import-not-at-top
  every = (None if args.checkpoint_every == QUICKSTART_EVERY
           else args.checkpoint_every)
  result = {"settings": {
      "processes": PROCESSES, "steps": args.steps,
      "checkpoint_every": args.checkpoint_every, "seed": args.seed,
      "kill_at_step": args.kill_at_step, "machine": _machine()},
            "periods": [], "kill_at_step": []}
  jobs = [("baseline", None)] + [("period", p) for p in args.periods] + [
      ("kill_at_step", p) for p in (args.kill_process or [])]
  for kind, value in bench.progress(jobs, len(jobs), "goodput runs"):
    run_dir = root / f"{kind}-{value}"
    if kind == "baseline":
      run = launch_run(command(run_dir, steps=args.steps,
                               every=every, restarts=2,
                               replace=False), run_dir)
      result["baseline"] = run
      horizon = args.timeout_factor * run["wall_s"]
    elif kind == "period":
      run = launch_run(
          command(run_dir, steps=args.steps, every=every,
                  restarts=args.max_restarts, replace=True), run_dir,
          kills_at=kill_times(value, args.seed, horizon),
          kill_seed=args.seed, timeout=horizon)
      run["period"] = value
      result["periods"].append(run)
    else:
      run = launch_run(
          command(run_dir, steps=args.steps, every=every,
                  restarts=2, replace=False), run_dir,
          kill_at_step=args.kill_at_step, kill_process=value,
          timeout=horizon)
      run["process"] = value
      result["kill_at_step"].append(run)
    shutil.rmtree(run_dir, ignore_errors=True)
  return result


def _machine() -> str:
  return f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} " \
         "at the start"


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--periods", type=float, nargs="*",
                      default=[30, 60, 120],
                      help="kill a process every T seconds, one run each")
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--checkpoint-every", type=int,
                      default=QUICKSTART_EVERY,
                      help="steps between checkpoints (default: the "
                      f"quickstart's, {QUICKSTART_EVERY})")
  parser.add_argument("--seed", type=int, default=0,
                      help="seeds the kills' processes and times")
  parser.add_argument("--max-restarts", type=int, default=50,
                      help="the launcher's --restarts in the runs with kills")
  parser.add_argument("--timeout-factor", type=float, default=6.0,
                      help="stop a run after this many failure-free wall "
                      "times")
  parser.add_argument("--kill-at-step", type=int, default=250,
                      help="where --kill-process kills")
  parser.add_argument("--kill-process", type=int, nargs="*", default=[],
                      help="one run each: this process killed once, past "
                      "--kill-at-step")
  parser.add_argument("--json", help="also write every run here")
  parser.add_argument("--from-json", help="report these runs (a --json "
                      "file) instead of running")
  parser.add_argument("--out", help="also write the report into this "
                      "markdown file's 'bench.goodput' section")
  parser.add_argument("--plot", help="write the goodput plot here (PNG)")
  args = parser.parse_args(argv)
  for name in ("steps", "checkpoint_every"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must "
                   "be at least 1.")
  if any(p <= 0 for p in args.periods):
    parser.error(f"--periods {args.periods}: each must be positive "
                 "(seconds between kills).")
  if any(not 0 <= p < PROCESSES for p in args.kill_process):
    parser.error(f"--kill-process {args.kill_process}: each must be a "
                 f"process index, 0 to {PROCESSES - 1}.")
  if args.kill_process and not 0 < args.kill_at_step < args.steps:
    parser.error(f"--kill-at-step {args.kill_at_step}: must lie between 0 "
                 f"and --steps {args.steps}.")
  if args.from_json:
    result = json.loads(pathlib.Path(args.from_json).read_text(
        encoding="utf-8"))
  else:
    from dlion_jax import bench  # pylint: disable=g-import-not-at-top
    bench.require_examples(parser, "dlion_jax.train.trainer", "the train CLI")
    with tempfile.TemporaryDirectory(prefix="dlion-goodput-") as root:
      result = run_all(args, pathlib.Path(root))
    reporting.write_json(args.json, result, indent=1)
  if args.plot and result["periods"]:
    plot(result, args.plot)
  return reporting.write_section(report(result), args.out, "bench.goodput")


if __name__ == "__main__":
  main()
