"""Orbax checkpoints of a run: params, every worker's optimizer state, step,
and the data iterator's position.

On a hybrid mesh (``mesh.nodes``) the state saved is every device's shard
of its node's state, restored onto the same layout: a resumed run continues
bit for bit (the run's config, ``mesh.nodes`` included, must match).

Orbax writes each checkpoint to a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it to ``<step>`` when every
process has finished writing, so a checkpoint interrupted half-way (a process
killed mid-save) is never listed by :meth:`Checkpointer.latest_step` nor
restored. A finished checkpoint damaged later (truncated or overwritten
files) is detected on restore and reported as a :class:`CheckpointError`
naming the step directory and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import pathlib
import re
import shutil
import signal
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dlion_jax.train import signals


class CheckpointError(ValueError):
  """A checkpoint is unreadable (corrupt, truncated) or does not fit the
  run that restores it."""


class DiskFullError(OSError):
  """A checkpoint could not be written: no space left on the device (or the
  disk quota is used up).

  Attributes:
    step: the checkpoint that failed (its partial files are removed).
    directory: where the checkpoints are.
    last_good: the newest finished checkpoint's step, or None.
    checkpoint_bytes: what that checkpoint takes on disk, or None.
  """

  def __init__(self, message: str, *, step: int, directory: pathlib.Path,
               last_good: int | None, checkpoint_bytes: int | None):
    super().__init__(errno.ENOSPC, message)
    self.step, self.directory = step, directory
    self.last_good, self.checkpoint_bytes = last_good, checkpoint_bytes

  def __str__(self) -> str:
    return self.strerror


# How tensorstore (under orbax) and the OS say it, e.g. "RESOURCE_EXHAUSTED:
# Error writing local file ...: No space left on device [os_error_code='28']".
_DISK_FULL = re.compile(r"no space left on device|disk quota exceeded|"
                        r"os_error_code='(?:28|122)'", re.IGNORECASE)


def disk_full(error: BaseException | None) -> bool:
  """Whether ``error``, or an error it was raised from, says the disk (or
  the disk quota) is full."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC,
                                                      errno.EDQUOT):
      return True
    if _DISK_FULL.search(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


class _Collect(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []

  def emit(self, record):
    self.records.append(record)


@contextlib.contextmanager
def _quiet_orbax():
  """Collects absl's log records (where orbax logs) and what is printed to
  ``sys.stderr`` instead of printing them: a failed save logs each of its
  threads' tracebacks, and its callbacks into closed event loops print
  theirs."""
  absl = logging.getLogger("absl")
  collect, propagate = _Collect(), absl.propagate
  handlers, stderr = absl.handlers[:], sys.stderr
  absl.handlers, absl.propagate = [collect], False
  sys.stderr = io.StringIO()
  try:
    yield collect.records, sys.stderr
  finally:
    absl.handlers, absl.propagate = handlers, propagate
    sys.stderr = stderr


def _replay(logged) -> None:
  """Logs and prints what :func:`_quiet_orbax` collected, where it would
  have gone; not orbax's note that a SIGTERM's checkpoint is being written
  (the CLI reports that checkpoint)."""
  records, printed = logged
  absl = logging.getLogger("absl")
  for record in records:
    if "preemption sync point" not in record.getMessage():
      absl.handle(record)
  if printed.getvalue():
    sys.stderr.write(printed.getvalue())


# Orbax's refusal to restore an array into another shape.
_ORBAX_SHAPES = re.compile(r"Requested shape: (\([\d, ]*\)) is not "
                           r"compatible with the stored shape: (\([\d, ]*\))")


def _size(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _array_name(path) -> str:
  """Orbax's name of a leaf: its keys joined by dots."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(parts)


def _short(error: BaseException | str, limit: int = 300) -> str:
  text = (error if isinstance(error, str) else
          f"{type(error).__name__}: {error}").splitlines()[0]
  return text if len(text) <= limit else text[:limit] + " ..."


class Checkpointer:
  """Saves and restores ``{'params', 'opt_state'}`` plus JSON metadata.

  Args:
    directory: where the step directories go (created if missing).
    keep: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str | pathlib.Path, *, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Writes ``state`` (a pytree of global arrays) and ``meta`` (JSON).

    A Ctrl-C (or SIGTERM) during the write takes effect once it is
    finished: the checkpoint is complete, and orbax's writer threads are not
    torn down mid-save (they would print a traceback of their own).

    Raises:
      DiskFullError: no space left for it; its partial files are removed
        (orbax's own log of the failure is not printed).
    """
    held = ((signal.SIGINT,) if jax.process_count() > 1 else
            (signal.SIGINT, signal.SIGTERM))   # jax's own, multi-process
    with signals.deferred(held), _quiet_orbax() as logged:
      try:
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        if not disk_full(e):
          _replay(logged)
          raise
        raise self._disk_full(step, e) from e
    _replay(logged)

  def _disk_full(self, step: int, error: BaseException) -> DiskFullError:
    """Removes the partial checkpoint ``step``; says what is left."""
    for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)
    self._manager.reload()
    last = self.latest_step()
    size = None if last is None else _size(self.directory / str(last))
    full = ("the disk quota is used up" if "quota" in str(error).lower()
            else "no space left on the device")
    return DiskFullError(
        f"writing checkpoint step {step} to {self.directory} failed: {full}",
        step=step,
        directory=self.directory, last_good=last, checkpoint_bytes=size)

  def latest_step(self) -> int | None:
    """The newest finished checkpoint's step (None if there is none)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every finished checkpoint's step, oldest first."""
    return sorted(self._manager.all_steps())

  def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
    """Reads the latest (or given) checkpoint into arrays shaped, typed and
    sharded like ``like``.

    Raises:
      FileNotFoundError: there is no checkpoint to resume from.
      ValueError: the checkpoint does not fit ``like`` (another model, or
        another number of workers).
    """
    step = self._step(step)
    self._check_fits(like, step)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      shapes = _ORBAX_SHAPES.search(str(e))
      if shapes:      # orbax's own check, should ours have missed it
        here, there = (tuple(int(n) for n in re.findall(r"\d+", g))
                       for g in shapes.groups())
        raise self._does_not_fit(step, None, there, here) from None
      raise self._unreadable(step, e) from e
    return restored.state, restored.meta

  def read_arrays(self, step: int | None = None) -> tuple[Any, dict]:
    """The latest (or given) checkpoint as numpy arrays, whatever the mesh
    or process count that wrote it (for inspection and comparisons)."""
    step = self._step(step)
    tree = self._array_metadata(step)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                        tree)
    try:
      with ocp.PyTreeCheckpointer() as reader:
        state = reader.restore(self.directory / str(step) / "state",
                               args=ocp.args.PyTreeRestore(restore_args=args))
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e
    return state, self.metadata(step)

  def metadata(self, step: int) -> dict:
    """Only the JSON metadata of checkpoint ``step``."""
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e

  def _step(self, step: int | None) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(
          f"No checkpoint in {self.directory} to resume from; run without "
          "--resume first.")
    return step

  def _array_metadata(self, step: int) -> Any:
    """The checkpoint's tree of array metadata (names, shapes, dtypes)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)   # "Metadata file does not exist" is benign
    try:
      with ocp.PyTreeCheckpointer() as reader:
        meta = reader.metadata(self.directory / str(step) / "state")
    except Exception as e:  # pylint: disable=broad-except
      raise self._unreadable(step, e) from e
    finally:
      absl.setLevel(level)
    if getattr(meta, "item_metadata", None) is None:
      raise self._unreadable(step, "no readable array metadata")
    return meta.item_metadata.tree

  def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """Array name -> shape, from the checkpoint's own metadata."""
    return {_array_name(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_leaves_with_path(self._array_metadata(step))}

  def _check_fits(self, like: Any, step: int) -> None:
    """Raises CheckpointError naming the first array whose shape differs
    (or, where only the stacked state's rows differ, both worker counts
    and :mod:`dlion_jax.elastic`)."""
    saved = self._saved_shapes(step)
    wanted = {_array_name(p): tuple(np.shape(x))
              for p, x in jax.tree_util.tree_leaves_with_path(like)}
    differ = [(name, saved.get(name), wanted.get(name))
              for name in sorted(set(saved) | set(wanted))
              if saved.get(name) != wanted.get(name)]
    if not differ:
      return
    counts = {(there[:1], here[:1]) for _, there, here in differ
              if there and here and there[1:] == here[1:]}
    if len(counts) == 1 and all(there and here and there[1:] == here[1:]
                                for _, there, here in differ):
      raise self._does_not_fit(step, *differ[0])
    raise self._does_not_fit(step, *differ[0], rows=False)

  def _does_not_fit(self, step: int, name: str | None,
                    there: tuple[int, ...] | None,
                    here: tuple[int, ...] | None, *,
                    rows: bool = True) -> CheckpointError:
    """The CheckpointError for array ``name`` of shape ``there`` in the
    checkpoint and ``here`` in the target. Where only the leading axis
    differs (``rows``), a state stacked for another number of workers:
    it says both and how to resize."""
    where = self.directory / str(step)
    array = "an array" if name is None else f"array {name!r}"
    if rows and there and here and there[1:] == here[1:]:
      return CheckpointError(
          f"Checkpoint {where} holds a state stacked for {there[0]} workers "
          f"(or nodes) and the target for {here[0]}: {array} has shape "
          f"{there} there and {here} here. To resume on {here[0]}, restore "
          f"it onto dl.elastic.restore_target(tx, params, mesh, {there[0]})"
          " in place of the optimizer state (the saved rows placed on this "
          "mesh), then make the new rows with "
          "dl.elastic.resize_worker_states(tx, state, params, mesh) (the "
          "training CLI's --resume does both); or resume on "
          f"{there[0]}.")
    if here is None:
      what = f"{array} (shape {there}) is not in this run's state"
    elif there is None:
      what = f"this run's {array} (shape {here}) is not in it"
    else:
      what = f"{array} has shape {there} there and {here} here"
    return CheckpointError(
        f"Checkpoint {where} does not fit this run: {what}. Resume with "
        "the config that wrote it (same model, optimizer, workers and "
        "mesh), or use another run_dir.")

  def _unreadable(self, step: int, error: BaseException | str
                  ) -> CheckpointError:
    others = sorted(s for s in self._manager.all_steps() if s != step)
    hint = (f"delete that directory to resume from step {others[-1]}"
            if others else "delete it and start again without --resume")
    return CheckpointError(
        f"Checkpoint {self.directory / str(step)} is unreadable: it is "
        f"corrupt or truncated ({_short(error)}). Orbax never finalizes a "
        f"half-written checkpoint, so its files were damaged afterwards; "
        f"{hint}.")

  def close(self) -> None:
    self._manager.close()
