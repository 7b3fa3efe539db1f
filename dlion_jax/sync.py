"""When the workers average their momenta (Lion Cub's momentum sync).

Distributed Lion keeps one momentum per worker and never sends it; the
momenta drift apart, each following its own data. Lion Cub (Ishikawa et al.,
ICML 2025) averages them now and then: at the steps of a schedule, every
worker replaces (some of) its momentum leaves by their mean over the workers,
a ``pmean`` in ``mu_dtype``. Non-finite entries count as 0 in that mean, so a
sync repairs a worker whose momentum a NaN or Inf gradient has spoiled
instead of spreading it to every worker. A schedule says at which steps
``t = 1, 2, ...`` (the t-th update, counted on every worker alike) that
happens:

* :func:`every_k_steps` ``(k)``: ``t = k, 2k, 3k, ...``
* :func:`growing_intervals` ``(k)``: ``T_0 = 1``,
  ``T_{j+1} = floor(T_j + 2**(j / k))``: intervals that double every ``k``
  syncs, so ``~k log2(t)`` syncs in ``t`` steps, few late in training.

:func:`leaves_matching` builds the mask that restricts syncing to some leaves
(say embeddings and norms), like the mask of :func:`optax.masked`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dlion_jax import _blocks
from dlion_jax import _checks
from dlion_jax import _collectives
from dlion_jax import _drift

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SyncSchedule:
  """Steps at which momenta are averaged.

  Attributes:
    name: a short description, e.g. ``'every 10 steps'``.
    period: ``k`` for :func:`every_k_steps`, else ``None``.
    steps: the sync steps in increasing order (``None`` for a period).
  """
  name: str
  period: int | None = None
  steps: tuple[int, ...] | None = None

  def __call__(self, step: jax.Array) -> jax.Array:
    """Whether update number ``step`` (1-based, int32) ends with a sync."""
    if self.period is not None:
      return step % self.period == 0
    return jnp.any(jnp.asarray(self.steps, jnp.int32) == step)

  def count(self, num_steps: int) -> int:
    """How many syncs the first ``num_steps`` updates do."""
    if self.period is not None:
      return num_steps // self.period
    return int(np.searchsorted(self.steps, num_steps, side="right"))


def every_k_steps(k: int) -> SyncSchedule:
  """Averages the momenta after every ``k``-th update.

  Example:
    >>> from dlion_jax import sync
    >>> sync.every_k_steps(4).count(10)     # after updates 4 and 8
    2
  """
  k = _checks.positive_int("k", k)
  return SyncSchedule(name=f"every {k} steps", period=k)


def growing_intervals(k: int, first: int = 1) -> SyncSchedule:
  """Syncs at ``T_0 = first``, ``T_{j+1} = floor(T_j + 2**(j / k))``.

  Example:
    >>> from dlion_jax import sync
    >>> sync.growing_intervals(2).steps[:8]
    (1, 2, 3, 5, 7, 11, 16, 24)
  """
  k = _checks.positive_int("k", k)
  step = _checks.positive_int("first", first)
  steps, j = [], 0
  while step <= _INT32_MAX:
    steps.append(step)
    step = math.floor(step + 2.0 ** (j / k))
    j += 1
  return SyncSchedule(name=f"growing intervals (k={k})", steps=tuple(steps))


def as_schedule(momentum_sync: Any) -> SyncSchedule | None:
  """``None`` -> no sync, an int ``k`` -> :func:`every_k_steps`, a schedule
  -> itself; anything else raises a ValueError saying what is accepted."""
  if momentum_sync is None or isinstance(momentum_sync, SyncSchedule):
    return momentum_sync
  momentum_sync = _checks.static_int("momentum_sync", momentum_sync)
  if isinstance(momentum_sync, (int, np.integer)) and not isinstance(
      momentum_sync, bool) and momentum_sync >= 1:
    return every_k_steps(momentum_sync)
  raise ValueError(
      f"momentum_sync={momentum_sync!r} is not a schedule. Pass None (never "
      "sync, the default), a positive int k (every k steps), or "
      "dlion_jax.sync.every_k_steps(k) / growing_intervals(k).")


def leaves_matching(pattern: str) -> Callable[[Any], Any]:
  """A mask function: True for leaves whose key path matches ``pattern``.

  The path is :func:`jax.tree_util.keystr` of the leaf, e.g.
  ``"['embed']['embedding']"``; ``re.search`` decides.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import sync
    >>> params = {"embed": jnp.zeros(3), "dense": {"w": jnp.zeros(2),
    ...           "norm": jnp.zeros(2)}}
    >>> sync.leaves_matching("embed|norm")(params)
    {'dense': {'norm': True, 'w': False}, 'embed': True}
  """
  regex = re.compile(pattern)
  def mask(tree):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: bool(regex.search(jax.tree_util.keystr(path))), tree)
  return mask


def resolve_mask(mask: Any, tree: Any) -> list[bool]:
  """The mask, one Python bool per leaf of ``tree`` (None: every leaf)."""
  leaves, treedef = jax.tree.flatten(tree)
  if mask is None:
    return [True] * len(leaves)
  if callable(mask):
    mask = mask(tree)
  try:
    flags = treedef.flatten_up_to(mask)
  except (ValueError, TypeError) as e:
    single = jax.tree_util.treedef_is_leaf(jax.tree.structure(mask))
    hint = (" Under optax.inject_hyperparams a function is taken for a "
            "schedule and called with the step count: list it in "
            "static_args, e.g. static_args=('momentum_sync_mask',)."
            if single else "")
    raise ValueError(
        "momentum_sync_mask must have the structure of the params (or be a "
        f"function of the params returning one): {e}{hint}") from None
  for flag in flags:
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(
          "momentum_sync_mask leaves must be Python bools (decided when the "
          f"step is traced), got {flag!r} of type {type(flag).__name__}.")
  return [bool(f) for f in flags]


def _mean_over(xs: list[jax.Array], axis_name, present=None,
               count=None) -> list[jax.Array]:
  """``pmean`` with non-finite entries counted as 0, typed like its inputs
  (per-worker under ``check_vma``).

  A worker whose momentum went NaN or Inf (a bad gradient) would otherwise
  hand it to every worker for good; this way the sync repairs it.

  With ``present`` (whether this worker takes part, a bool scalar) and
  ``count`` (how many do, an int32 scalar the same on every worker) the
  mean is the present workers' (the others send zeros) and a worker not
  present keeps its own.
  """
  finite = [jnp.where(jnp.isfinite(x), x, 0) for x in xs]
  if present is None:
    return _typed_like(_collectives.pmean(finite, axis_name), xs)
  sums = _collectives.psum([jnp.where(present, x, 0) for x in finite],
                           axis_name)
  size = jax.lax.axis_size(axis_name)
  means = [jnp.where(present, total * _collectives.reciprocal_of_count(
      count, size, total.dtype), x) for total, x in zip(sums, xs)]
  return _typed_like(means, xs)


def _typed_like(means: list[jax.Array], xs: list[jax.Array]
                ) -> list[jax.Array]:
  """Each mean typed per worker where its input is (``check_vma``): the
  ``lax.cond`` that skips a sync returns the inputs, and its branches must
  have one type."""
  out = []
  for x, m in zip(xs, means):
    lost = tuple(_drift.typed_varying_axes(x)
                 - _drift.typed_varying_axes(m))
    out.append(jax.lax.pcast(m, lost, to="varying") if lost else m)
  return out


def sync_momenta(mu: Any, flags: list[bool], do_sync: jax.Array,
                 axis_name, *, present: jax.Array | None = None,
                 count: jax.Array | None = None) -> Any:
  """Replaces the flagged leaves of ``mu`` by their mean over the workers
  when ``do_sync`` (a scalar bool, the same on every worker) holds.

  One ``pmean`` of all flagged leaves, inside :func:`jax.lax.cond`, so steps
  without a sync send nothing. Where the mesh has axes the compiler owns,
  each device averages its own part of each leaf with its peers
  (``dlion_jax._blocks.on_own_shards``).

  With ``present`` (whether this worker takes part in the step, a bool
  scalar) and ``count`` (how many workers do, an int32 scalar the same on
  every worker): the mean of the present workers' momenta alone (one
  ``psum`` of theirs, the others' zeros, divided by ``count``), which a
  worker not present does not take: its momenta stay as they were
  (``abstain_nonfinite`` of :func:`dlion_jax.scale_by_distributed_lion`).
  """
  leaves, treedef = jax.tree.flatten(mu)
  chosen = [x for x, f in zip(leaves, flags) if f]
  if not chosen:
    return mu
  axes = _blocks.compiler_axes(axis_name)
  constants = () if present is None else (present, count)
  mean = lambda xs: _mean_over(xs, axis_name, *constants)
  if axes:
    # The region is check_vma=False inside, so its means come out typed
    # alike on every worker: typed back as the momenta are. The traced
    # present and count enter it as constants.
    mean = lambda xs: _typed_like(_blocks.on_own_shards(
        lambda ys, constants, **_: _mean_over(ys, axis_name, *constants),
        (xs,), axes, constants), xs)
  synced = iter(jax.lax.cond(do_sync, mean, lambda xs: xs, chosen))
  return jax.tree.unflatten(
      treedef, [next(synced) if f else x for x, f in zip(leaves, flags)])
