"""Orbax checkpoints of a run: params, every worker's optimizer state, step,
and the data iterator's position.

Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a checkpoint interrupted half-way is never the one restored.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


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
    """Writes ``state`` (a pytree of global arrays) and ``meta`` (JSON)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
    """Reads the latest (or given) checkpoint into arrays shaped, typed and
    sharded like ``like``.

    Raises:
      FileNotFoundError: there is no checkpoint to resume from.
      ValueError: the checkpoint does not fit ``like`` (another model, or
        another number of workers).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(
          f"No checkpoint in {self.directory} to resume from; run without "
          "--resume first.")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f"Checkpoint {self.directory}/{step} does not match this run's "
          f"model or worker count (shapes differ): {e}") from e
    return restored.state, restored.meta

  def metadata(self, step: int) -> dict:
    """Only the JSON metadata of checkpoint ``step``."""
    return self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore())).meta

  def close(self) -> None:
    self._manager.close()
