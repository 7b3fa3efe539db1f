"""Local steps in rounds: each worker trains alone, then one outer step.

Each worker runs ``every`` steps of an inner optimizer on its own copy of
the params and sends nothing; at the end of the round each worker's
pseudo-gradient goes through an outer optimizer over the workers' axis,
and every worker restarts from the new anchor (Douillard et al., *DiLoCo*,
2023). With ``H = every`` and ``θ`` the anchor, on worker ``i``:

.. math::

  θ_i &← θ_i + \\mathrm{inner}(g_i) \\quad \\text{(every step)} \\\\
  Δ_i &= θ - θ_i, \\quad θ ← θ + \\mathrm{outer}(Δ_1, …, Δ_N), \\quad
  θ_i ← θ \\quad \\text{(every } H \\text{ steps)}

With ``outer = dl.distributed_lion(lr, axis_name=...)`` the outer step is
Distributed Lion (Liu et al., NeurIPS 2024) on the pseudo-gradients: each
worker keeps its own outer momentum and the workers exchange 1-bit
majority votes, so a step costs ``wire_bits / H`` bits a parameter on
average. :func:`nesterov_outer` is DiLoCo's own outer step, Nesterov SGD on
the fp32 mean of the ``Δ_i`` (an all-reduce a round).

The params each worker trains differ between outer steps, so a step holds
them per worker (``make_train_step(..., params_per_worker=True)`` with
params placed by :func:`dlion_jax.devices.stack_for_workers`); the anchor,
in the state, is the same on every worker and is the model to evaluate and
keep (:func:`anchor`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlion_jax import _checks
from dlion_jax import _deprecations
from dlion_jax import transforms

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)


class LocalStepsState(NamedTuple):
  """State of :func:`local_steps` on one worker.

  Attributes:
    count: updates taken (int32 scalar), the same on every worker.
    anchor: the params of the last outer step (the initial params before
      the first), the same on every worker.
    inner_state: this worker's inner optimizer state.
    outer_state: this worker's outer optimizer state (Distributed Lion's
      outer momentum differs between workers).
    restart: whether the last update ended a round, so that the new params
      are ``anchor`` (bool scalar; see :func:`restart_at_anchor`).
  """
  count: jax.Array
  anchor: optax.Params
  inner_state: optax.OptState
  outer_state: optax.OptState
  restart: jax.Array


def local_steps(inner: optax.GradientTransformation,
                outer: optax.GradientTransformation, *,
                every: int) -> optax.GradientTransformation:
  """``every`` steps of ``inner`` on each worker alone, then one ``outer``.

  On the steps inside a round the update is ``inner``'s, and nothing is
  sent. On the last step of a round (update ``t = every, 2 every, ...``)
  ``outer`` gets each worker's pseudo-gradient ``anchor - θ_i`` (``θ_i``
  after this step's inner update) with the anchor as its params, the
  anchor moves by its update, and the update returned takes the params to
  the new anchor. ``inner`` keeps its state across rounds (DiLoCo's
  AdamW); ``outer`` steps once a round, so its schedules count rounds.

  The outer optimizer sees only pseudo-gradients: a param the inner one
  never moves (frozen by :func:`optax.masked` or :func:`optax.set_to_zero`)
  has a zero one, which Distributed Lion's binary vote counts as -1 (as it
  counts ``c = 0``), so freeze it in ``outer`` too (the same
  :func:`optax.multi_transform` around both) or vote ``"ternary"``. Weight
  decay belongs to ``inner``: give ``dl.distributed_lion`` as ``outer``
  ``weight_decay=0.0`` (its default, 1e-3, would decay the anchor again).

  A worker whose params turned NaN or Inf in a round restarts at the
  anchor with the float leaves of its inner state fresh, its counts
  kept: with ``dl.distributed_lion(..., abstain_nonfinite=True)`` as
  ``outer`` it abstains from that round's vote and votes again in the
  next.

  ``params + update`` is the new anchor up to the rounding of the
  subtraction that made the update: the steps of
  :func:`dlion_jax.parallel.make_train_step` put every worker exactly on it
  (:func:`~dlion_jax.rounds.restart_at_anchor`); a step of your own should
  too.

  Args:
    inner: the optimizer each worker runs on its own params, e.g.
      ``optax.lion(lr)`` or ``optax.adamw(lr)``: one that sends nothing.
    outer: the optimizer of the pseudo-gradients over the workers' axis,
      e.g. ``dl.distributed_lion(outer_lr, axis_name="data",
      weight_decay=0.0)`` or
      :func:`~dlion_jax.rounds.nesterov_outer`. Its update must be the same
      on every worker.
    every: ``H``, the steps of a round (1: an outer step every step).

  Returns:
    An optax ``GradientTransformation`` whose ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, dlion_jax as dl
    >>> tx = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
    ...     0.5, axis_name="data", weight_decay=0.0), every=2)
    >>> def worker(g, p):                  # one worker's two steps
    ...   state = tx.init(p)
    ...   for _ in range(2):
    ...     u, state = tx.update(g, state, p)
    ...     p = dl.rounds.restart_at_anchor(
    ...         optax.apply_updates(p, u), state)
    ...   return p
    >>> grads = jnp.array([[1.0], [2.0], [-1.0]])   # 3 workers
    >>> jax.vmap(worker, axis_name="data")(grads, jnp.zeros((3, 1)))
    Array([[-0.5],
           [-0.5],
           [-0.5]], dtype=float32)
  """
  every = _checks.positive_int("every", every)

  def init_fn(params):
    inner_state = inner.init(params)
    if has_local_steps(inner_state):
      raise ValueError(
          "local_steps: the inner optimizer runs local steps of its own; "
          "nest none: one local_steps around the whole optimizer.")
    return LocalStepsState(
        count=jnp.zeros([], jnp.int32),
        anchor=jax.tree.map(jnp.asarray, params), inner_state=inner_state,
        outer_state=outer.init(params), restart=jnp.zeros([], bool))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "local_steps needs the params: call tx.update(grads, state, "
          "params), with this worker's own params.")
    inner_updates, inner_state = inner.update(updates, state.inner_state,
                                              params)
    count = optax.safe_int32_increment(state.count)
    restart = count % every == 0

    def outer_step(anchor, outer_state, inner_state):
      trained = optax.apply_updates(params, inner_updates)
      delta = jax.tree.map(jnp.subtract, anchor, trained)
      outer_updates, new_state = outer.update(delta, outer_state, anchor)
      # As it was (a trace of an int leaf would come back float): the
      # state of both branches of the cond.
      outer_state = optax.tree_utils.tree_cast_like(new_state, outer_state)
      anchor = optax.apply_updates(anchor, outer_updates)
      to_anchor = jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype),
                               anchor, params, inner_updates)
      return to_anchor, anchor, outer_state, _fresh_if_lost(
          inner, inner_state, delta, anchor)

    def inner_step(anchor, outer_state, inner_state):
      return inner_updates, anchor, outer_state, inner_state

    new_updates, anchor, outer_state, inner_state = lax.cond(
        restart, outer_step, inner_step, state.anchor, state.outer_state,
        inner_state)
    return new_updates, LocalStepsState(count, anchor, inner_state,
                                        outer_state, restart)

  return optax.GradientTransformation(init_fn, update_fn)


def _fresh_if_lost(inner, inner_state, delta, anchor):
  """``inner_state``, with its float leaves fresh where this worker's round
  ended with a non-finite pseudo-gradient: a NaN or Inf in its params
  would stay in its inner momenta for good, and the worker would send
  nothing of use (or abstain, ``abstain_nonfinite=True``) in every round
  after. Its step counts are kept (a schedule goes on where it was)."""
  finite = _checks.all_finite(delta)
  fresh = optax.tree_utils.tree_cast_like(inner.init(anchor), inner_state)
  return jax.tree.map(
      lambda old, new: jnp.where(finite, old, new) if jnp.issubdtype(
          old.dtype, jnp.inexact) else old, inner_state, fresh)


def nesterov_outer(learning_rate: optax.ScalarOrSchedule, *,
                   momentum: float = 0.9,
                   axis_name: str = "data") -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD on the workers' mean
  pseudo-gradient, an fp32 all-reduce a round (Douillard et al., 2023, use
  ``learning_rate=0.7``, ``momentum=0.9``).

  Example:
    >>> import optax, dlion_jax as dl
    >>> tx = dl.local_steps(
    ...     optax.adamw(1e-3), dl.rounds.nesterov_outer(0.7), every=32)

  Raises:
    ValueError: ``momentum`` outside ``[0, 1)``.
  """
  _checks.decay_rate("momentum", momentum, "the outer step's Nesterov momentum")
  return optax.chain(transforms.pmean_gradients(axis_name),
                     optax.sgd(learning_rate, momentum=momentum,
                               nesterov=True))


def _local_steps_states(state: Any) -> list[LocalStepsState]:
  is_state = lambda x: isinstance(x, LocalStepsState)
  return [x for x in jax.tree.leaves(state, is_leaf=is_state)
          if is_state(x)]


def has_local_steps(state: Any) -> bool:
  """Whether ``state`` holds a :class:`LocalStepsState`."""
  return bool(_local_steps_states(state))


def restart_at_anchor(params: Any, state: Any) -> Any:
  """``params``, or the anchor of ``state``'s :class:`LocalStepsState`
  where its last update ended a round: every worker restarts exactly there
  (``params + update`` may differ from it in the last bit, and by a
  different bit on each worker); the same for every worker's params and
  state at once, stacked on a leading axis. ``params`` unchanged where
  ``state`` holds no local steps, and on the leaves a local steps inside
  :func:`optax.masked` or :func:`optax.multi_transform` does not own."""
  masked = lambda x: isinstance(x, optax.MaskedNode)

  def at(restart, a, p):
    if masked(a):
      return p
    # A flag a worker (stacked states: a row of flags for a row of params).
    restart = restart.reshape(restart.shape + (1,) * (p.ndim - restart.ndim))
    return jnp.where(restart, a, p).astype(p.dtype)
  for local in _local_steps_states(state):
    params = jax.tree.map(lambda a, p, r=local.restart: at(r, a, p),
                          local.anchor, params, is_leaf=masked)
  return params


def anchor(state: Any) -> Any:
  """The anchor of ``state``'s :class:`LocalStepsState`: the params of the
  last outer step, the same on every worker (what to evaluate and save).
  For per-worker states (a leading worker axis) it is every worker's row."""
  found = _local_steps_states(state)
  if len(found) != 1:
    raise ValueError(
        f"anchor: the state holds {len(found)} local_steps states, not one; "
        "pass the state of an optimizer built with local_steps.")
  return found[0].anchor
