"""Distributed Lion as optax gradient transformations."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from dlion_jax import exchange
from dlion_jax._checks import check_choice
from dlion_jax._checks import check_float_leaves
from dlion_jax._checks import check_same_structure


class DistributedLionState(NamedTuple):
  """State of :func:`scale_by_distributed_lion` on one worker.

  Attributes:
    count: number of updates taken (int32 scalar), the same on every worker.
    mu: this worker's own momentum, ``m_i`` of Algorithm 1. It is never sent;
      it differs from worker to worker.
  """
  count: jax.Array
  mu: optax.Updates


def scale_by_distributed_lion(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    axis_name: exchange.AxisName | None = None,
    aggregation: str = "mavo",
    vote: str = "binary",
    comm: str = "auto",
) -> optax.GradientTransformation:
  r"""Lion's sign update, voted across the workers of a data-parallel axis.

  Worker :math:`i`, with local gradient :math:`g_i` and momentum :math:`m_i`:

  .. math::

    c_i &= \beta_1 m_i + (1 - \beta_1) g_i \\
    d_i &= \mathrm{vote}(c_i) \\
    m_i &\leftarrow \beta_2 m_i + (1 - \beta_2) g_i \\
    D &= \mathrm{sign}\big(\textstyle\sum_i d_i\big) \quad \text{(mavo)}
      \qquad D = \tfrac1N \textstyle\sum_i d_i \quad \text{(avg)}

  ``vote='binary'`` sends one bit, :math:`d = +1` if :math:`c > 0` else
  :math:`-1` (so :math:`\pm 0` and NaN vote :math:`-1`); ``vote='ternary'``
  sends :math:`d = \mathrm{sign}(c)` (NaN votes 0). A majority-vote tie (even
  N) gives :math:`D = 0`. Every worker returns the same :math:`D`, bit for
  bit, so replicas stay identical; the momenta stay local.

  With ``axis_name=None`` or an axis of size 1 there is no vote and no
  collective: the transform is exactly :func:`optax.scale_by_lion`,
  :math:`D = \mathrm{sign}(c)`. With ``b1 == b2`` it is Signum with majority
  vote (Bernstein et al., 2019).

  ``update`` must be called where ``axis_name`` is bound: inside
  :func:`jax.shard_map` or :func:`jax.pmap` (see :mod:`dlion_jax.parallel`).
  :class:`optax.MultiSteps` calls ``update`` on every micro-step (with the
  running mean of the gradients) and keeps the result only on the k-th, so
  the exchange runs every micro-step; to exchange once per k micro-batches use
  ``dlion_jax.parallel.make_train_step(..., micro_batches=k)``. A
  ``should_skip_update_fn`` that can differ between workers would put the
  collectives in a branch some workers skip: they would wait forever.

  Under a hand-written ``shard_map(check_vma=True)`` over an axis of size 1
  the update is typed per-worker (there is no collective to make it
  replicated): use ``check_vma=False`` there.

  Args:
    b1: rate combining the momentum and the current gradient.
    b2: decay rate of the momentum.
    mu_dtype: dtype of the momentum; ``None`` infers it from the params.
    axis_name: name of the data-parallel axis (or a tuple of names) to vote
      over; ``None`` for single-worker Lion.
    aggregation: ``'mavo'`` (majority vote) or ``'avg'`` (mean of the votes).
    vote: ``'binary'`` (1 bit) or ``'ternary'`` (exact sign, 0 abstains).
    comm: how votes travel: ``'alltoall'``, ``'allgather'``, ``'psum'``,
      ``'psum_int8'`` or ``'auto'`` (fewest wire bits for the axis size). All
      give the same result; see :mod:`dlion_jax.exchange`.

  Returns:
    A :class:`optax.GradientTransformation` whose state is a
    :class:`DistributedLionState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import dlion_jax as dl
    >>> tx = dl.scale_by_distributed_lion(axis_name="data")
    >>> grads = jnp.array([[1., -2.], [3., -4.], [-5., 6.]])  # 3 workers
    >>> def step(g):
    ...   state = tx.init(jnp.zeros(2))
    ...   return tx.update(g, state)[0]
    >>> jax.vmap(step, axis_name="data")(grads)[0]
    Array([ 1., -1.], dtype=float32)

  References:
    Liu et al., `Communication Efficient Distributed Training with
    Distributed Lion <https://arxiv.org/abs/2404.00438>`_, NeurIPS 2024.
    Chen et al., `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023.
  """
  check_choice("aggregation", aggregation, exchange.AGGREGATIONS)
  check_choice("vote", vote, exchange.VOTES)
  check_choice("comm", comm, exchange.COMM_CHOICES)
  mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(
      mu_dtype)

  def init_fn(params):
    check_float_leaves(params, "params")
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    return DistributedLionState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update_fn(updates, state, params=None):
    del params
    if getattr(state, "_fields", None) != ("count", "mu"):   # or Lion's own
      raise TypeError(
          "state must be the DistributedLionState made by this transform's "
          f"`init`, got {type(state).__name__}. Re-create the optimizer "
          "state with `tx.init(params)` when switching optimizers.")
    check_same_structure(updates, state.mu)
    check_float_leaves(updates, "gradient")
    pre_sign = jax.tree.map(lambda g, m: (1.0 - b1) * g + b1 * m,
                            updates, state.mu)
    num_workers = exchange.axis_size(axis_name)
    if num_workers == 1:
      new_updates = jax.tree.map(jnp.sign, pre_sign)
    else:
      new_updates = exchange.aggregate_updates(
          pre_sign, axis_name=axis_name, num_workers=num_workers, vote=vote,
          aggregation=aggregation, comm=comm)
    mu = optax.tree.update_moment(updates, state.mu, b2, 1)
    mu = optax.tree.cast(mu, mu_dtype)
    count = optax.safe_increment(state.count)
    return new_updates, DistributedLionState(count=count, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def distributed_lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: Any = None,
    *,
    axis_name: exchange.AxisName | None = None,
    aggregation: str = "mavo",
    vote: str = "binary",
    comm: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  r"""Distributed Lion: a drop-in for :func:`optax.lion` in data parallel.

  ``chain(scale_by_distributed_lion, add_decayed_weights,
  scale_by_learning_rate)``, the same chain as :func:`optax.lion`, so every
  worker applies

  .. math:: x \leftarrow x - \eta\,(D + \lambda x)

  with the voted update :math:`D` of :func:`scale_by_distributed_lion`. Weight
  decay and the learning rate act locally after the vote, and feed each
  worker its *local* gradient: no gradient all-reduce is needed.

  Args:
    learning_rate: a float or an optax schedule.
    b1: rate combining the momentum and the current gradient.
    b2: decay rate of the momentum.
    mu_dtype: dtype of the momentum; ``None`` infers it from the params.
    weight_decay: decoupled weight decay (float or schedule).
    mask: which leaves get weight decay, as in :func:`optax.lion`.
    axis_name: data-parallel axis to vote over; ``None`` is plain Lion.
    aggregation: ``'mavo'`` or ``'avg'``.
    vote: ``'binary'`` or ``'ternary'``.
    comm: ``'auto'``, ``'alltoall'``, ``'allgather'``, ``'psum'`` or
      ``'psum_int8'``.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import dlion_jax as dl
    >>> tx = dl.distributed_lion(1e-3, axis_name="data")
    >>> params = {"w": jnp.ones(3)}
    >>> grads = {"w": jnp.array([[1., -1., 0.], [1., 1., 0.]])}  # 2 workers
    >>> def step(g):
    ...   updates, _ = tx.update(g, tx.init(params), params)
    ...   return optax.apply_updates(params, updates)
    >>> jax.vmap(step, axis_name="data")(grads)["w"][0]
    Array([0.998999, 0.999999, 1.000999], dtype=float32)

  References:
    Liu et al., `Communication Efficient Distributed Training with
    Distributed Lion <https://arxiv.org/abs/2404.00438>`_, NeurIPS 2024.
  """
  return optax.chain(
      scale_by_distributed_lion(
          b1=b1, b2=b2, mu_dtype=mu_dtype, axis_name=axis_name,
          aggregation=aggregation, vote=vote, comm=comm),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
