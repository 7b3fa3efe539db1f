"""optax's extra arguments in a step of every worker
(:class:`optax.GradientTransformationExtraArgs`: ``value=`` for
:func:`optax.contrib.reduce_on_plateau`), and the optax states a step
makes one value on every worker.

Every door takes them alike: one value for all the workers, or each
worker's own, a row per worker, where ``per_worker_args`` names it.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from optax import contrib

from dlion_jax import _collectives
from dlion_jax import _mesh


def names(per_worker_args: Any) -> tuple[str, ...]:
  """``per_worker_args`` checked: a tuple (or list) of argument names."""
  if isinstance(per_worker_args, str):
    per_worker_args = (per_worker_args,)
  if not isinstance(per_worker_args, (tuple, list)) or not all(
      isinstance(a, str) for a in per_worker_args):
    raise ValueError(
        f"per_worker_args={per_worker_args!r} must name the extra arguments "
        "of tx.update that are each worker's own, a row per worker: a tuple "
        "of their names, e.g. per_worker_args=('value',); () for none (every "
        "extra argument one value for all the workers).")
  return tuple(per_worker_args)


def split(extra_args: dict, per_worker_args: tuple[str, ...], tx, n: int,
          wants: str = "each worker's own",
          axis_name=None) -> tuple[dict, dict]:
  """``extra_args`` as ``(shared, own)``: one value for all, and those
  ``per_worker_args`` names, each checked for a leading axis of the ``n``
  workers (with ``axis_name``, its rows placed on their workers of the
  enclosing mesh); a ValueError where ``tx`` takes no extra arguments."""
  if not extra_args:
    return {}, {}
  check_takes(tx, list(extra_args))
  own = {k: v for k, v in extra_args.items() if k in per_worker_args}
  for name, value in own.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
      if not np.shape(leaf) or np.shape(leaf)[0] != n:
        raise ValueError(
            f"{name}{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}; "
            f"per_worker_args names {name!r}, so the step wants {wants} on "
            f"a leading axis of the {n} workers (e.g. the losses of "
            "dl.workers.value_and_grad). Give a row per worker, or leave "
            f"{name!r} out of per_worker_args for one value for all.")
  if axis_name is not None:
    own = jax.tree.map(lambda x: _mesh.place(jnp.asarray(x), P(axis_name)),
                       own)
  return {k: v for k, v in extra_args.items() if k not in own}, own


def check_takes(tx, given: list[str]) -> None:
  """Raises a ValueError where extra arguments (``given``, their names) go
  to a ``tx`` whose update takes none."""
  if not given or _takes(tx.update, given):
    return
  named = ", ".join(f"{k}=" for k in given)
  raise ValueError(
      f"The step was given {named}, an extra argument for tx.update, but "
      f"tx ({type(tx).__name__}) takes none: its update is "
      "update(updates, state, params). "
      "Build tx with the transform that takes it chained in (optax.chain("
      "..., optax.contrib.reduce_on_plateau(...)) passes value= on), or "
      "drop the argument.")


def _takes(update, given: list[str]) -> bool:
  """Whether ``update`` takes the keyword arguments ``given``."""
  try:
    params = inspect.signature(update).parameters.values()
  except (TypeError, ValueError):    # no signature to read: let it say
    return True
  return any(p.kind == p.VAR_KEYWORD for p in params) or set(given) <= {
      p.name for p in params}


def with_loss(extra_args: dict, loss: Any, loss_as: str | None, own: bool,
              axis_name) -> dict:
  """``extra_args`` with the step's loss as ``loss_as`` (if any): the
  worker's own where ``own``, else the mean over the workers."""
  if loss_as is None:
    return extra_args
  if not own:   # in float32 at least, as the step's mean loss
    wide = jnp.promote_types(loss.dtype, jnp.float32)
    loss = _collectives.pmean(loss.astype(wide), axis_name).astype(
        loss.dtype)
  return {**extra_args, loss_as: loss}


def check_loss_as(loss_as: Any, tx) -> None:
  """``loss_as`` checked: None, or a name ``tx.update`` takes."""
  if loss_as is None:
    return
  if not isinstance(loss_as, str) or not loss_as.isidentifier():
    raise ValueError(
        f"loss_as={loss_as!r} must be the name of the extra argument of "
        "tx.update that gets the step's loss, e.g. loss_as='value' for "
        "optax.contrib.reduce_on_plateau, or None.")
  check_takes(tx, [loss_as])


def alike_state(state: Any) -> Any:
  """:func:`dlion_jax._collectives.alike_state`, with each
  :func:`optax.contrib.reduce_on_plateau` state made one value whole: its
  scale, best and mean values and counts, alike on every worker given one
  ``value`` for all. Typed alike in part (its counts only), the plateau's
  ``lax.cond`` would see a count typed alike in one branch and varying in
  the other, and JAX refuses it."""
  plateau = lambda x: isinstance(x, contrib.ReduceLROnPlateauState)
  state = jax.tree.map(
      lambda x: jax.tree.map(_collectives.alike, x) if plateau(x) else x,
      state, is_leaf=plateau)
  return _collectives.alike_state(state)
