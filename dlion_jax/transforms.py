"""Optimizer wrappers that data-parallel training needs around a transform.

Both act across the workers of one mesh axis, which is why they are not
optax's own: :func:`pmean_gradients` turns any optax optimizer into the
all-reduce baseline, and :func:`apply_if_finite` skips a step on every
worker at once (``dl.apply_if_finite`` is its short path).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlion_jax import _blocks
from dlion_jax import _checks
from dlion_jax import _collectives


class AbstainingMeanState(NamedTuple):
  """State of a mean that leaves out the workers with non-finite values
  (:func:`pmean_gradients`, ``abstain_nonfinite=True``).

  Attributes:
    abstained: how many workers were left out of the last mean (int32
      scalar, the same on every worker).
    abstentions: the running total of ``abstained``.
  """
  abstained: jax.Array
  abstentions: jax.Array


def pmean_gradients(axis_name: str = "data", *,
                    abstain_nonfinite: bool = False
                    ) -> optax.GradientTransformation:
  """Averages the gradients over ``axis_name``: what global optimizers need.

  ``optax.chain(pmean_gradients("data"), optax.lion(...))`` is the usual
  data-parallel Lion that all-reduces fp32 gradients, the baseline that
  :func:`dlion_jax.distributed_lion` replaces. Where the mesh has axes the
  compiler owns beside ``axis_name``, each device averages only its own
  part of every leaf with its peers (``dlion_jax._blocks.on_own_shards``),
  as the vote does.

  With ``abstain_nonfinite=True`` a worker whose gradients are not all
  finite is left out: the mean is the others' (their sum, the absent
  workers sending zeros, times :math:`1 / (N - a)` as a ``pmean`` over
  :math:`N - a` workers takes it; 0 where all :math:`a = N` are absent),
  the same on every worker, and the count :math:`a` (one more int32
  all-reduce) is in the state, :class:`AbstainingMeanState`. Where the
  all-reduce sums in the workers' order (XLA:CPU's) the mean is the
  present workers' ``pmean`` bit for bit.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from dlion_jax import transforms
    >>> tx = optax.chain(transforms.pmean_gradients("data"), optax.sgd(1.0))
    >>> grads = jnp.array([[1.0], [3.0]])          # two workers' gradients
    >>> jax.vmap(lambda g: tx.update(g, tx.init(g))[0],
    ...          axis_name="data")(grads)
    Array([[-2.],
           [-2.]], dtype=float32)
  """
  abstain_nonfinite = _checks.flag(
      "abstain_nonfinite", abstain_nonfinite,
      "whether a worker with a non-finite gradient is left out")

  def init_fn(params):
    del params
    if not abstain_nonfinite:
      return optax.EmptyState()
    return AbstainingMeanState(jnp.zeros([], jnp.int32),
                               jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    _check_bound(axis_name, "dl.transforms.pmean_gradients",
                 "dl.transforms.pmean_gradients('batch') on a mesh whose "
                 "workers' axis is named 'batch'")
    if not abstain_nonfinite:
      return _blocks.workers_mean(updates, axis_name), state
    size = lax.axis_size(axis_name)
    ok, abstained = _collectives.abstainers(updates, axis_name, size)
    updates = jax.tree.map(lambda g: jnp.where(ok, g, 0), updates)
    state = AbstainingMeanState(abstained, state.abstentions + abstained)
    return _blocks.workers_mean(updates, axis_name, size - abstained,
                                size), state

  return optax.GradientTransformation(init_fn, update_fn)


def apply_if_finite(inner: optax.GradientTransformation,
                    max_consecutive_errors: int, *,
                    axis_name: str = "data") -> optax.GradientTransformation:
  """:func:`optax.apply_if_finite` that skips a step on every worker at once.

  ``optax.apply_if_finite`` checks only the gradients it is given: inside a
  data-parallel step a NaN or Inf on one worker makes that worker alone skip.
  Around :func:`dlion_jax.distributed_lion` that is a hang or a split: under
  ``shard_map`` the skipping worker leaves the vote's collectives inside a
  ``lax.cond`` the others entered (XLA's CPU rendezvous aborts the process
  after 40 s); under ``vmap`` both branches run and the skipping worker keeps
  its old parameters while the others move. Here the finiteness flag is
  all-reduced over ``axis_name`` (one int32 ``psum``) first, so every worker
  decides alike: a step with a non-finite gradient on *any* worker is
  skipped on *every* worker (parameters and every worker's state unchanged,
  ``notfinite_count`` the same everywhere), and after
  ``max_consecutive_errors`` such steps every worker gives up and applies
  the update together. The inner update, its vote included, runs on every
  step and a select keeps it or the old state: its collectives sit in no
  conditional, so :func:`dlion_jax.collective_bytes` counts the vote with
  ``conditional=False`` too (a skipped step sends what an applied one
  does). An applied step is the inner optimizer's, up to the last bit of
  its float arithmetic: the select changes how XLA fuses the step, and with
  it where a multiply and an add contract into one rounding (about 1 ulp on
  a few percent of elements, measured on XLA:CPU); the vote's outcome is
  the same.
  On a mesh with axes beside ``axis_name``
  (:func:`dlion_jax.parallel.make_train_step`, with or without
  ``shard_axis``) the update runs in a region manual over ``axis_name``
  alone, so this check reads whole logical leaves (in a hybrid step, the
  node's mean gradient, each entry a mean over every device's rows) and the
  compiler reduces it over the devices that hold a leaf's blocks: every
  device of a node reads the node's flag, and a NaN or Inf in one
  device's rows, wherever it lands in the leaf, skips the step on every
  device of every node. The only collective of this transform's own is
  the ``psum`` over ``axis_name``.

  Args:
    inner: the optimizer to guard, e.g. ``dl.distributed_lion(...)``.
    max_consecutive_errors: as in :func:`optax.apply_if_finite`.
    axis_name: the data-parallel axis the workers share.

  Returns:
    A transform whose state is :class:`optax.ApplyIfFiniteState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32),
        last_finite=jnp.array(True, jnp.bool_),
        total_notfinite=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    local_ok = _checks.all_finite(updates)
    _check_bound(axis_name, "dl.apply_if_finite",
                 "dl.apply_if_finite(tx, 5, axis_name='batch') for "
                 "dl.distributed_lion(lr, axis_name='batch')")
    bad_workers = _collectives.psum((~local_ok).astype(jnp.int32), axis_name)
    isfinite = bad_workers == 0
    # Equal on every worker, but typed per worker under check_vma.
    count = _collectives.alike(state.notfinite_count, axis_name)
    notfinite_count = jnp.where(isfinite, jnp.zeros([], jnp.int32),
                                optax.safe_increment(count))
    # A select, not a lax.cond: in a branch the vote would read as sent only
    # on some steps, and XLA would fuse the update unlike the inner's own.
    new_updates, new_state = inner.update(updates, state.inner_state, params,
                                          **extra_args)
    apply = isfinite | (notfinite_count > max_consecutive_errors)
    updates = jax.tree.map(
        lambda u: jnp.where(apply, u, jnp.zeros_like(u)), new_updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(apply, new, old),
                               new_state, state.inner_state)
    return updates, optax.ApplyIfFiniteState(
        notfinite_count=notfinite_count, last_finite=isfinite,
        total_notfinite=jnp.where(isfinite, state.total_notfinite,
                                  optax.safe_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_bound(axis_name, where: str, example: str) -> None:
  """Raises a NameError saying which argument names the unbound axis."""
  try:
    lax.axis_size(axis_name)
  except NameError:
    raise NameError(
        f"{where}: axis_name={axis_name!r} is not bound here. It must be the "
        "axis the workers share, bound by jax.shard_map, jax.vmap or "
        "jax.pmap around the update (make_train_step binds it): pass it, "
        f"e.g. {example}."
    ) from None
