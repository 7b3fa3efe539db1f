"""Runs that heal themselves: the training CLI under ``python -m
dlion_jax.launch --restarts K``.

When a process dies or hangs, the launcher starts the command again on the
survivors (:func:`dlion_jax.processes.restart_info` says so). The CLI then

* trains on the survivors' devices: ``workers`` (and ``mesh.nodes``) are
  scaled from the first start's process count to this start's, as many a
  process (:func:`on_survivors`), the elastic resize of ``--resume``
  making the new workers' states;
* resumes by itself from the last checkpoint of the run this launcher
  began (:func:`resume_mode`), the step every process agrees on
  (:func:`agreed_step`); orbax never lists a checkpoint cut short;
* records which steps ran on how many workers: each checkpoint carries the
  run's history of layouts (:func:`history`), and ``restarts.jsonl`` in
  the run directory a record of each start, with what it cost.

Only files are read here (and one cross-process gather in
:func:`agreed_step`), so every process decides alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any

from dlion_jax.train import rundir
from dlion_jax.train.config import Config
from dlion_jax.train.config import ConfigError
from dlion_jax.train.config import validate


def _layout(cfg: Config) -> dict:
  """The workers (and nodes, if hybrid) a step runs on."""
  return {"workers": cfg.workers, **({"nodes": cfg.mesh.nodes}
                                     if cfg.mesh.nodes else {})}


def _scaled(cfg: Config, info) -> Config:
  """``cfg`` with ``workers`` and ``mesh.nodes``, set for the first start,
  scaled to ``info.num_processes`` (as many a process); ConfigError where
  they do not scale, or the result is not a valid config."""
  n0, n = info.first_num_processes, info.num_processes
  if cfg.workers % n0:
    raise ConfigError(
        f"workers={cfg.workers} must be divisible by the {n0} processes the "
        "launcher started.", key="workers")
  workers = cfg.workers // n0 * n
  nodes = cfg.mesh.nodes
  if nodes is not None:
    if nodes * n % n0:
      raise ConfigError(
          f"mesh.nodes={nodes} cannot follow the processes from {n0} to "
          f"{n} (the nodes are scaled with them, {nodes} x {n} / {n0} is no "
          "whole number). Set mesh.nodes to a multiple of "
          f"{n0 // math.gcd(nodes, n0)} x ..., or run without --restarts.",
          key="mesh.nodes")
    nodes = nodes * n // n0
  return validate(dataclasses.replace(
      cfg, workers=workers, mesh=dataclasses.replace(cfg.mesh, nodes=nodes)))


def on_survivors(cfg: Config, info) -> Config:
  """``cfg`` on this start's processes: ``workers`` (and ``mesh.nodes``)
  scaled from the first start's process count, as many a process.

  Raises:
    ConfigError: the config does not fit this many workers (e.g.
      ``data.global_batch`` not divisible), said with the restart.
  """
  if info.num_processes == info.first_num_processes:
    return cfg
  try:
    return _scaled(cfg, info)
  except ConfigError as e:
    raise ConfigError(
        f"the launcher restarted the run on {info.num_processes} processes "
        f"(it began on {info.first_num_processes}), which takes "
        f"{_workers_on(cfg, info, info.num_processes)}: {e}",
        key=e.key) from None


def _workers_on(cfg: Config, info, n: int) -> str:
  each = cfg.workers // info.first_num_processes
  return f"{each * n} workers ({each} a process)"


def fragile_counts(cfg: Config, info) -> str | None:
  """At the first start: a warning naming the process counts a restart may
  leave on which ``cfg`` fails, and the fix; None if there is none."""
  if info.restart or cfg.workers % info.first_num_processes:
    return None
  bad = []
  for n in range(info.min_processes, info.first_num_processes):
    try:
      _scaled(cfg, dataclasses.replace(info, num_processes=n))
    except ConfigError as e:
      bad.append((n, str(e)))
  if not bad:
    return None
  each = cfg.workers // info.first_num_processes
  counts = range(info.min_processes, info.first_num_processes + 1)
  multiple = math.lcm(*(each * n for n in counts))
  n, why = bad[0]
  fix = (f" Set data.global_batch to a multiple of {multiple} (it is "
         f"{cfg.data.global_batch}) to survive every restart."
         if "data.global_batch" in why else "")
  listed = ", ".join(str(b[0]) for b in bad)
  return (f"a restart on {listed} processes "
          f"would stop the run with a config error: on {n}, "
          f"{_workers_on(cfg, info, n)}: {why}{fix}")


def began_here(run_path: pathlib.Path, launch_id: str) -> bool:
  """Whether this launcher's run (``launch_id``) wrote in ``run_path``."""
  return any(r.get("launch") == launch_id for r in read(run_path))


def resume_mode(run_path: pathlib.Path, info, *, resume: bool,
                overwrite: bool) -> tuple[bool, bool]:
  """``(resume, overwrite)`` for this start: at a restart of a run this
  launcher began, resume where it has a checkpoint, else start it afresh
  over what it wrote; otherwise the command line's flags. Every process
  decides alike (:func:`agreed_view`)."""
  if info is None or not info.restart:
    return resume, overwrite
  began, found = agreed_view(began_here(run_path, info.launch_id),
                             bool(rundir.checkpoint_steps(run_path)))
  if not began:
    return resume, overwrite
  return found, not found


def agreed_view(began: bool, found: bool) -> tuple[bool, bool]:
  """What every process read of the run directory, alike in each: whether
  this launcher's run began there (any process saw its record) and whether
  a checkpoint is there (every process found one). Gathered before any
  process acts on it, so each has read the directory before process 0
  clears it at a restart that starts afresh (read after, its records gone,
  a process would take the run for another's and part ways with the
  others)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return began, found
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  views = np.asarray(multihost_utils.process_allgather(
      np.array([began, found], np.int32))).reshape(-1, 2)
  return combined(views)


def combined(views) -> tuple[bool, bool]:
  """``(began, found)`` from each process's ``(began, found)``: began where
  any process saw the run's record, found where every process found a
  checkpoint."""
  return bool(any(v[0] for v in views)), bool(all(v[1] for v in views))


def agreed_step(step: int | None) -> int | None:
  """The checkpoint step every process found (the smallest of theirs; they
  differ only where the run directory is not shared alike)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return step
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  found = np.asarray(multihost_utils.process_allgather(
      np.int64(-1 if step is None else step)))
  return None if found.min() < 0 else int(found.min())


def history(before: list[dict], since: int, step: int,
            cfg: Config) -> list[dict]:
  """Which steps ran on how many workers, up to ``step``: ``before`` (the
  history up to ``since``, where this start resumed), then ``since`` to
  ``step`` on ``cfg``'s layout; runs of one layout merged. A run of 8
  workers resumed at step 200 on 6 holds at step 300
  ``[{"steps": [0, 200], "workers": 8}, {"steps": [200, 300], "workers":
  6}]``.
  """
  layout = _layout(cfg)
  out = [dict(h) for h in before]
  if step <= since:
    return out
  last = out[-1] if out else None
  if last and last["steps"][1] == since and {
      k: v for k, v in last.items() if k != "steps"} == layout:
    last["steps"] = [last["steps"][0], step]
  else:
    out.append({"steps": [since, step], **layout})
  return out


def history_in(meta: dict, step: int) -> list[dict]:
  """A checkpoint's history (one written before histories were kept: its
  steps on the workers it records)."""
  if "history" in meta:
    return meta["history"]
  return [{"steps": [0, step], "workers": meta["workers"]}] if step else []


def steps_redone(run_path: pathlib.Path, step: int) -> int:
  """How many steps past checkpoint ``step`` the run had logged before it
  stopped: steps it trains again (at least; it logs every few)."""
  path = run_path / "metrics.jsonl"
  if not path.is_file():
    return 0
  logged = [s for s in map(rundir.record_step, path.read_text(
      encoding="utf-8").splitlines()) if s is not None]
  return max([0] + [s - step for s in logged])


def read(run_path: pathlib.Path) -> list[dict]:
  """The run directory's records of its starts, oldest first, each
  start's lines (its start, then its compile) merged into one."""
  path = run_path / rundir.RESTARTS
  if not path.is_file():
    return []
  merged: dict[tuple, dict] = {}
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      rec = json.loads(line)
      merged.setdefault((rec["launch"], rec["restart"]), {}).update(rec)
    except (ValueError, KeyError, TypeError):
      pass                       # cut short by a kill
  return list(merged.values())


def record(run_path: pathlib.Path, entry: dict[str, Any]) -> None:
  """Appends ``entry`` to the run directory's records of its starts."""
  run_path.mkdir(parents=True, exist_ok=True)
  with open(run_path / rundir.RESTARTS, "a", encoding="utf-8") as f:
    f.write(json.dumps(entry) + "\n")


def entry(info, cfg: Config, *, step: int, resumed: bool,
          ready: float) -> dict[str, Any]:
  """A start's record, made once it resumed (or, afresh, was ready to):
  which restart, on what, the ``step`` it began at, the steps past it the
  run had logged (trained again), and seconds from the launcher's start of
  the processes to ``ready`` (``time.time()``, the trainer's start of the
  restore: ``start_s``) and to restore (``restore_s``)."""
  now = time.time()
  return {"launch": info.launch_id, "restart": info.restart,
          "processes": info.num_processes, **_layout(cfg), "step": step,
          "steps_redone": steps_redone(cfg.run_path, step) if resumed else 0,
          "start_s": round(ready - info.started_at, 3),
          **({"restore_s": round(now - ready, 3)} if resumed else {})}


def compiled(run_path: pathlib.Path, started: dict, seconds: float, *, say,
             main_process: bool) -> None:
  """Records (process 0) that the start ``started`` compiled its step in
  ``seconds``; after a restart, ``say`` s what the restart cost."""
  if main_process:
    record(run_path, {"launch": started["launch"],
                      "restart": started["restart"],
                      "compile_s": round(seconds, 3)})
  if started["restart"]:
    say(report_line({**started, "compile_s": seconds}))


def summary(cfg: Config, before: list[dict], since: int,
            started: dict | None, *, say, saving: list[float],
            main_process: bool) -> dict[str, Any]:
  """The summary's ``history`` (which steps ran on how many workers; said
  where there were several layouts) and, under the launcher's restarts,
  ``starts``: this launch's records of its starts, the last one's with the
  seconds each of its checkpoints took (``checkpoint_s``; process 0
  records them)."""
  steps = history(before, since, cfg.train.steps, cfg)
  if len(steps) > 1:
    say("steps " + ", ".join(f"{h['steps'][0]}-{h['steps'][1]} on "
                             f"{_plural(h['workers'], 'worker')}"
                             for h in steps))
  if started is None:
    return {"history": steps}
  if main_process:
    record(cfg.run_path, {"launch": started["launch"],
                          "restart": started["restart"],
                          "checkpoint_s": [round(s, 4) for s in saving]})
  starts = [r for r in read(cfg.run_path)
            if r.get("launch") == started["launch"]]
  return {"history": steps, "starts": starts}


def report_line(rec: dict) -> str:
  """What a restart cost, in one line."""
  parts = [f"started in {rec['start_s']:.1f} s"]
  if "restore_s" in rec:
    parts.append(f"restored in {rec['restore_s']:.1f} s")
  parts.append(f"compiled in {rec['compile_s']:.1f} s")
  redone = rec["steps_redone"]
  tail = (f"; {redone} steps past the checkpoint trained again"
          if redone else "")
  return (f"restart {rec['restart']} on {_plural(rec['processes'], 'process')}"
          f", {_plural(rec['workers'], 'worker')}, from step {rec['step']}: "
          f"{', '.join(parts)}{tail}")


def _plural(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"
