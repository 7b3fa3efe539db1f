"""What a run directory holds, and the rules that keep two runs apart.

A fresh run (no ``--resume``) refuses a directory that already holds a run
(checkpoints, ``metrics.jsonl`` or ``summary.json``): orbax never writes a
step at or below one already there, so the old checkpoints would be resumed
later, and the two runs' metrics would mix. ``--overwrite`` deletes the old
run's files first.

``--resume`` refuses a checkpoint written with another config, except in
the keys of :data:`NEUTRAL`, which change when things are logged, evaluated
or saved but not what is computed, and of :data:`ELASTIC`, the layout of
the workers, which a resumed run may change (the trainer resizes the
workers' states, :mod:`dlion_jax.elastic`). ``train.steps`` sets the cosine
schedule's length, hence the learning rate of every step, so it may change
only under ``optimizer.schedule=constant`` (to train a run further).

Only files are read and written here (no jax), so every process of a
multi-process run, which shares the directory, decides alike.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

from dlion_jax.train.config import Config
from dlion_jax.train.config import to_dict

# Under python -m dlion_jax.launch --restarts: a record of each start.
RESTARTS = "restarts.jsonl"
# What a run writes into its directory, besides checkpoints/.
OUTPUTS = ("config.json", "metrics.jsonl", "summary.json", "curves.png",
           RESTARTS)
# Config keys that do not change what a run computes.
NEUTRAL = ("name", "run_dir", "train.log_every", "train.eval_every",
           "train.checkpoint_every", "train.keep_checkpoints",
           "data.eval_batch")
# The layout: a run resumes on another (dlion_jax.elastic resizes the
# workers' states), which its checkpoint's metadata records apart.
ELASTIC = ("workers", "mesh.nodes", "mesh.shard_params")
_UNFINISHED = ".orbax-checkpoint-tmp"


class RunDirError(ValueError):
  """The run directory holds another run, or a checkpoint of another
  config."""


def checkpoint_steps(run_dir: pathlib.Path) -> list[int]:
  """The finished checkpoints' steps, oldest first, read off the directory
  names (orbax renames ``<step>.orbax-checkpoint-tmp-*`` to ``<step>`` once
  every process has written its part)."""
  return sorted(int(p.name) for p in (run_dir / "checkpoints").glob("*")
                if p.is_dir() and p.name.isdigit())


def holdings(run_dir: pathlib.Path) -> list[str]:
  """What of an earlier run ``run_dir`` holds, in words (empty: nothing)."""
  found = []
  steps = checkpoint_steps(run_dir)
  if steps:
    found.append(f"checkpoints up to step {steps[-1]}")
  elif any(_UNFINISHED in p.name for p in (run_dir / "checkpoints").glob("*")):
    found.append("an unfinished checkpoint")
  found += [name for name in ("metrics.jsonl", "summary.json")
            if (run_dir / name).is_file()]
  return found


def check_fresh(run_dir: pathlib.Path, *, overwrite: bool) -> None:
  """Raises RunDirError if a fresh run would mix with one in ``run_dir``."""
  found = holdings(run_dir)
  if found and not overwrite:
    raise RunDirError(
        f"run directory {run_dir} already holds a run ({', '.join(found)}). "
        "Continue it with --resume, delete it with --overwrite, or start "
        f"this run elsewhere with --set run_dir={run_dir}-2.")


def clear(run_dir: pathlib.Path) -> None:
  """Deletes what a run wrote (checkpoints and :data:`OUTPUTS`), nothing
  else: ``run_dir`` may hold the user's own files."""
  shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
  for name in OUTPUTS:
    (run_dir / name).unlink(missing_ok=True)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f"{prefix}{key}."))
    else:
      flat[prefix + key] = value
  return flat


def comparable(cfg: Config) -> dict[str, Any]:
  """What of ``cfg`` decides a run's result, as flat dotted keys (tuples
  read back as lists): what a checkpoint's JSON metadata stores, so that
  two runs computing the same write the same checkpoints."""
  flat = _flatten(json.loads(json.dumps(to_dict(cfg))))
  return {k: v for k, v in flat.items() if k not in NEUTRAL}


def differences(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
  """``(key, value there, value here)`` for every key of ``saved`` (a flat
  config from a checkpoint) and ``cfg`` that changes the result."""
  here = comparable(cfg)
  ignore = set(NEUTRAL) | set(ELASTIC)   # a checkpoint may hold NEUTRAL
  if saved.get("optimizer.schedule") == "constant" == cfg.optimizer.schedule:
    ignore.add("train.steps")
  missing = "(not set)"
  return [(key, saved.get(key, missing), here.get(key, missing))
          for key in sorted(set(saved) | set(here))
          if key not in ignore and saved.get(key, missing)
          != here.get(key, missing)]


def check_resume(saved: dict | None, cfg: Config, step: int,
                 directory: pathlib.Path) -> None:
  """Raises RunDirError if checkpoint ``step`` in ``directory`` was written
  with another config than ``cfg``. ``saved`` is that config, flat (None
  for a checkpoint that stored none)."""
  diff = differences(saved, cfg) if saved is not None else []
  if not diff:
    return
  listed = "; ".join(f"{key}={there!r} there, {here!r} here"
                     for key, there, here in diff)
  steps = ("train.steps may differ only under optimizer.schedule=constant "
           "(the cosine schedule's length sets every step's learning rate). "
           if any(d[0] == "train.steps" for d in diff) else "")
  raise RunDirError(
      f"--resume: checkpoint {directory / str(step)} was written with "
      f"another config: {listed}. {steps}Resume with the checkpoint's "
      "values, or start a new run instead of --resume (--overwrite, or "
      "--set run_dir=...).")


def check_unfinished(cfg: Config, step: int, directory: pathlib.Path) -> None:
  """Raises RunDirError if a run resumed at ``step`` has nothing to train."""
  if step < cfg.train.steps:
    return
  more = (" or raise train.steps (optimizer.schedule=constant allows it)"
          if cfg.optimizer.schedule == "constant" else "")
  raise RunDirError(
      f"--resume: the run in {directory.parent} has already reached step "
      f"{step} of train.steps={cfg.train.steps}; its results are in "
      f"summary.json. To train further, start a new run (--overwrite, or "
      f"--set run_dir=...){more}.")


def trim_metrics(path: pathlib.Path, step: int) -> None:
  """Drops the records past ``step`` (written after the checkpoint that a
  resumed run continues from), so each step is logged once."""
  if not path.is_file():
    return
  kept = [line for line in path.read_text(encoding="utf-8").splitlines()
          if record_step(line) is not None and record_step(line) <= step]
  path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def record_step(line: str) -> int | None:
  """A metrics record's step; None for a line cut short (a process killed
  while writing it, necessarily after its last checkpoint)."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return None
