"""Distributed Lion and Lion Cub as optax gradient transformations."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlion_jax import _checks
from dlion_jax import _collectives
from dlion_jax import _drift
from dlion_jax import _exchange
from dlion_jax import _fused
from dlion_jax import _mesh
from dlion_jax import _message
from dlion_jax import _quantize
from dlion_jax import sync

# Leaves smaller than this skip the vote (min_compress_size=None).
DEFAULT_MIN_COMPRESS_SIZE = 0


class DistributedLionState(NamedTuple):
  """State of :func:`scale_by_distributed_lion` on one worker.

  Attributes:
    count: number of updates taken (int32 scalar), the same on every worker.
    mu: this worker's own momentum, ``m_i`` of Algorithm 1. It is never sent
      (except by a ``momentum_sync``); it differs from worker to worker.
  """
  count: jax.Array
  mu: optax.Updates
  # The transform reads its count alike on every worker where it must
  # (dlion_jax.workers.alike_state leaves it be).
  counts_read_alike = True


class ErrorFeedbackState(NamedTuple):
  """State of :func:`scale_by_distributed_lion` with ``error_feedback=True``.

  Attributes:
    count: number of updates taken (int32 scalar), the same on every worker.
    mu: this worker's own momentum.
    error: this worker's residual ``e_i``: what it meant to send minus what
      the vote applied, added to the next step's update before voting.
  """
  count: jax.Array
  mu: optax.Updates
  error: optax.Updates
  counts_read_alike = True


class AbstainingState(NamedTuple):
  """State of :func:`scale_by_distributed_lion` with
  ``abstain_nonfinite=True``.

  Attributes:
    count: number of updates taken (int32 scalar), the same on every worker;
      a step every worker abstained from is not counted.
    mu: this worker's own momentum.
    abstained: how many workers abstained from the last step (int32
      scalar, the same on every worker).
    abstentions: how many times a worker abstained, over every step so
      far (int32 scalar, the same on every worker).
  """
  count: jax.Array
  mu: optax.Updates
  abstained: jax.Array
  abstentions: jax.Array
  counts_read_alike = True


class AbstainingErrorFeedbackState(NamedTuple):
  """State of :func:`scale_by_distributed_lion` with
  ``error_feedback=True`` and ``abstain_nonfinite=True``: the fields of
  :class:`ErrorFeedbackState` and of :class:`AbstainingState`."""
  count: jax.Array
  mu: optax.Updates
  error: optax.Updates
  abstained: jax.Array
  abstentions: jax.Array
  counts_read_alike = True


def _state_type(error_feedback: bool, abstain_nonfinite: bool):
  return {(False, False): DistributedLionState,
          (True, False): ErrorFeedbackState,
          (False, True): AbstainingState,
          (True, True): AbstainingErrorFeedbackState}[
              error_feedback, abstain_nonfinite]


def _check_state(state, state_type):
  # Field names, not the class: optax's ScaleByLionState is accepted too.
  if getattr(state, "_fields", None) == state_type._fields:
    return
  if isinstance(state, dict) and set(state) == set(state_type._fields):
    raise TypeError(
        f"state must be the {state_type.__name__} made by this transform's "
        f"`init`, got a dict of its fields ({', '.join(state)}): a state "
        "restored without its structure (orbax gives plain dicts and lists "
        "when restoring without a target). Restore onto a freshly built "
        "state: checkpointer.restore(path, dl.parallel.init_worker_states("
        "tx, params, mesh)) for the per-worker states of "
        "parallel.make_train_step (parallel.init_pmap_states(tx, params) "
        "for make_pmap_train_step, tx.init(params) for one worker).")
  raise TypeError(
      f"state must be the {state_type.__name__} made by this transform's "
      f"`init`, got {type(state).__name__}. Re-create the optimizer state "
      "with `tx.init(params)` when switching optimizers or options "
      "(error_feedback changes the state).")


def _min_compress_size(value) -> int:
  if value is None:
    return DEFAULT_MIN_COMPRESS_SIZE
  value = _checks.static_int("min_compress_size", value)
  if (not isinstance(value, int) or isinstance(value, bool) or value < 0):
    raise ValueError(
        "min_compress_size must be an int >= 0 (leaves with fewer elements "
        f"skip the vote), got min_compress_size={value!r}.")
  return value


def _residual(p, d, dtype):
  """``p - mean|p| * D``: what the worker meant minus what was applied.

  A non-finite ``p`` leaves a residual of 0 rather than one that would
  feed the NaN back on every later step.
  """
  wide = _quantize.scale_dtype(p.dtype)
  scale = _quantize.l1_scale(p)
  residual = p.astype(wide) - scale * d.astype(wide)
  return jnp.where(jnp.isfinite(residual), residual, 0).astype(dtype)


def scale_by_distributed_lion(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    axis_name: _exchange.AxisName | None = None,
    aggregation: _message.Aggregation = "mavo",
    vote: _quantize.Vote = "binary",
    comm: _message.CommChoice = "auto",
    quantizer: _quantize.Quantizer = "sign",
    bits: int | None = None,
    momentum_sync: int | sync.SyncSchedule | None = None,
    momentum_sync_mask: Any = None,
    min_compress_size: int | None = None,
    error_feedback: bool = False,
    bucket_bytes: int | None = None,
    kernels: _fused.Kernels = "auto",
    abstain_nonfinite: bool = False,
) -> optax.GradientTransformation:
  r"""Lion's sign update, voted across the workers of a data-parallel axis.

  Worker :math:`i`, with local gradient :math:`g_i` and momentum :math:`m_i`:

  .. math::

    c_i &= \beta_1 m_i + (1 - \beta_1) g_i \\
    d_i &= \mathrm{vote}(c_i) \\
    m_i &\leftarrow \beta_2 m_i + (1 - \beta_2) g_i \\
    D &= \mathrm{sign}\big(\textstyle\sum_i d_i\big) \quad \text{(mavo)}
      \qquad D = \tfrac1N \textstyle\sum_i d_i \quad \text{(avg)}

  The workers vote on :math:`c_i` computed in float32 (float64 for
  float64 leaves) from each rate rounded to its operand's dtype: on bf16
  leaves the products are exact and :math:`c_i` rounds once, so every
  step program (``shard_map``, the plain jitted step on Auto or Explicit
  axes) takes the same levels. The update :math:`D` comes back in the
  dtype the gradients and momenta promote to.

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

  Lion Cub's options (Ishikawa et al., 2025) change what is sent and how
  the workers' momenta relate:

  * ``quantizer='ternary_l1'`` / ``'pbit_l1'`` with ``bits=p``: each worker
    sends :math:`q_i = \mathrm{clip}(\mathrm{round}(L c_i / a_i), -L, L)`,
    :math:`L = 2^{p-1} - 1`, :math:`a_i` the mean :math:`|c_i|` of the leaf
    (per leaf and per worker, not sent);
    :math:`D = \mathrm{sign}(\sum_i q_i)` or :math:`\sum_i q_i / (N L)`.
  * ``momentum_sync=k`` (or a :class:`dlion_jax.sync.SyncSchedule`): after
    the updates the schedule names, every worker's momentum (the leaves
    ``momentum_sync_mask`` selects; a pytree of bools or a function of the
    params, like :func:`optax.masked`'s mask) becomes the mean over the
    workers (those present, with ``abstain_nonfinite``): one ``pmean`` in
    ``mu_dtype`` inside :func:`jax.lax.cond`.
  * ``min_compress_size=s``: leaves with fewer than ``s`` elements skip the
    vote and get :math:`D = \mathrm{sign}(\sum_i c_i)`, exactly global
    Lion's update for them, through one float32 ``psum``.
  * ``error_feedback=True``: worker :math:`i` votes on
    :math:`p_i = c_i + e_i` and keeps :math:`e_i \leftarrow p_i - a_i D`
    (:math:`a_i` the mean :math:`|p_i|` of the leaf), one more buffer per
    parameter in the state (:class:`ErrorFeedbackState`).

  With one worker none of them applies (no vote: exact Lion).

  ``abstain_nonfinite=True``: a worker whose gradients are not all finite
  (a NaN or Inf anywhere) abstains. It votes ``c = 0`` on every leaf (a
  binary vote's ``-1``, which every tally takes back out), so :math:`D`
  is the majority (``mavo``) or the mean (``avg``) of the :math:`N - a`
  workers present; its momentum (and residual) stay as they were, and
  every worker applies the same :math:`D`. A momentum sync averages the
  present workers' momenta (their sum times :math:`1 / (N - a)`, as a
  ``pmean`` over :math:`N - a` workers rounds it); an abstainer keeps
  its own. Where one worker alone is present, the step is one worker's
  Lion: :math:`D = \mathrm{sign}(c)` of that worker, 0 where its
  :math:`c` is (which no binary or L1-scaled vote can say), its residual
  kept and no sync; its codes ride in the vote, and binary codes (no
  0) add flags where its :math:`c` is not 0, summed in a
  :func:`jax.lax.cond` (L1-scaled or ``psum_int8``'s binary levels:
  its ternary signs, voted there). Where all abstain,
  :math:`D = 0` and the state is unchanged. The count :math:`a` is in
  the state (:class:`AbstainingState`) with the running total. With
  every gradient finite the update and the state are the default's, bit
  for bit; with :math:`a` abstainers the others' update and state are
  their run alone, bit for bit where the all-reduces sum in the workers'
  order (XLA:CPU's do; in another order a synced momentum may round
  apart in its last bits).

  What it sends: the count, one int32 ``psum`` a step (4 bytes, counted
  ``2 (N - 1) / N`` times as a ring sends it), and the default's message.
  Two kinds of step send more, each in a :func:`jax.lax.cond`: a binary
  MaVo over ``alltoall`` at odd :math:`N` sends its results in radix 3
  where an odd number abstained (the present may tie), and a step one
  worker alone votes in sends the flags of its zeros (or its signs)
  beside the vote.
  :func:`dlion_jax.wire_bits` models the step no worker abstains from,
  :func:`dlion_jax.collective_bytes` reads it with ``conditional=False``
  (by default it counts each conditional's largest branch). The fused
  kernels take the count and whether the worker votes as scalars: an
  abstainer's words are its ``c = 0``'s, its momentum kept in the pass
  (a lone worker's flags written there too).

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
      ``'psum_int8'`` or ``'auto'`` (fewest wire bytes for the model). All
      give the same result, bit for bit (docs/design-notes.md).
    quantizer: ``'sign'`` (Distributed Lion), ``'ternary_l1'`` or
      ``'pbit_l1'`` (Lion Cub's L1-scaled levels).
    bits: bits per vote for ``quantizer='pbit_l1'``, 2 to 8.
    momentum_sync: ``None`` (never, the paper's Distributed Lion), a period
      ``k``, or a schedule from :mod:`dlion_jax.sync`.
    momentum_sync_mask: which momentum leaves a sync averages (``None``:
      all); a pytree of bools or a function of the params returning one,
      e.g. ``dlion_jax.sync.leaves_matching("embed|norm")``.
    min_compress_size: leaves with fewer elements are exchanged exactly;
      ``None`` takes ``DEFAULT_MIN_COMPRESS_SIZE``.
    error_feedback: keep each worker's residual and add it next step.
    bucket_bytes: ``None`` (one message) or a budget in bytes of gradient:
      the voted leaves are split into buckets of at most that many
      gradient bytes (as PyTorch DDP's ``bucket_cap_mb``), from the last
      leaf back (the order a backward pass produces them), each packed and
      exchanged on its own, so that XLA's scheduler may run a bucket's
      collectives while earlier layers still differentiate. The update is
      the same bit for bit; each bucket pads its own message. Off TPU the
      momenta are written once every bucket's vote is in.
    kernels: how big leaves are encoded and tallied: ``'auto'`` (the fused
      Pallas kernels on TPU, XLA elsewhere and
      in the plain jitted step of :mod:`dlion_jax.workers`),
      ``'pallas'`` (the kernels wherever a leaf fits their blocks; on GPU
      through Triton, not yet timed on one; on CPU in Pallas'
      interpreter, slow, for checking) or ``'xla'``. The
      kernels read a leaf's gradient and momentum once instead of twice
      and compute the same arithmetic: the words, tallies and outcomes
      are the XLA path's bit for bit, but where the compiler contracts
      ``b1 m + (1 - b1) g`` or ``b2 m + (1 - b2) g`` into a fused
      multiply-add on another product inside a kernel than in the step's
      fusion (XLA:CPU does, for the interpreter), ``c`` and the new
      momentum round apart in the last bit (a vote on a ``c`` within
      that rounding of zero may then differ).
    abstain_nonfinite: a worker with a non-finite gradient abstains from
      the vote, its state unchanged (see above).

  Options that shape the message (``bits``, ``min_compress_size``, an int
  ``momentum_sync``) must be Python ints: under
  :func:`optax.inject_hyperparams` list them in ``static_args``.

  Returns:
    A :class:`optax.GradientTransformation` whose state is a
    :class:`DistributedLionState` (:class:`ErrorFeedbackState` with
    ``error_feedback=True``).

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
    Ishikawa et al., `Lion Cub: Minimizing Communication Overhead in
    Distributed Lion <https://arxiv.org/abs/2411.16462>`_, ICML 2025.
  """
  _checks.check_choice("aggregation", aggregation, _exchange.AGGREGATIONS)
  _checks.check_choice("comm", comm, _exchange.COMM_CHOICES)
  _checks.check_choice("kernels", kernels, _fused.KERNELS)
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  schedule = sync.as_schedule(momentum_sync)
  min_compress_size = _min_compress_size(min_compress_size)
  if bucket_bytes is not None:
    bucket_bytes = _checks.positive_int("bucket_bytes", bucket_bytes,
                                "a budget of gradient bytes, or None")
  abstain_nonfinite = _checks.flag(
      "abstain_nonfinite", abstain_nonfinite,
      "whether a worker with a non-finite gradient abstains")
  state_type = _state_type(error_feedback, abstain_nonfinite)
  mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(
      mu_dtype)

  def init_fn(params):
    _checks.check_float_leaves(params, "params")
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    count = jnp.zeros([], jnp.int32)
    fields = {}
    if error_feedback:   # a buffer of its own, so the state can be donated
      fields["error"] = optax.tree.zeros_like(params, dtype=mu_dtype)
    if abstain_nonfinite:
      fields.update(abstained=jnp.zeros([], jnp.int32),
                    abstentions=jnp.zeros([], jnp.int32))
    return state_type(count=count, mu=mu, **fields)

  # A traced b1 (optax.inject_hyperparams) enters the vote as an argument:
  # a region manual over the compiler's axes may not close over it.
  constants = () if isinstance(b1, (int, float)) else (b1,)

  def pre_sign(g, m, *traced_b1):
    """``c = (1 - b1) g + b1 m`` for the vote, in float32 at least (float64
    for float64 leaves), each rate first rounded to its operand's dtype (as
    JAX takes a Python scalar).

    bf16 (or f16) operands and rates multiply exactly in float32, so ``c``
    is rounded once, whatever fusions a program makes: computed in bf16,
    XLA keeps or drops the products' roundings by fusion, and the level of
    a value-dependent vote (``ternary_l1``, ``pbit_l1``, error feedback)
    differed between the plain, Explicit and ``shard_map`` steps.
    """
    rate = traced_b1[0] if traced_b1 else b1
    wide = _quantize.scale_dtype(jnp.promote_types(g.dtype, m.dtype))
    new = jnp.asarray(1.0 - rate, g.dtype).astype(wide)
    old = jnp.asarray(rate, m.dtype).astype(wide)
    return new * g.astype(wide) + old * m.astype(wide)

  def lion_pre_sign(g, m, *traced_b1):
    """``c`` with no vote (one worker): :func:`optax.scale_by_lion`'s
    arithmetic, in the dtype ``g`` and ``m`` promote to, ``b1 m`` in the
    wider of the two (as :func:`moment`)."""
    rate = traced_b1[0] if traced_b1 else b1
    wide = jnp.promote_types(g.dtype, m.dtype)
    return (1.0 - rate) * g + jnp.asarray(rate, m.dtype).astype(
        wide) * m.astype(wide)

  def lone_pre_sign(g, m, *constants):
    """One worker's ``c`` (:func:`lion_pre_sign`) where it is the one worker
    present (``ok`` the last constant), 0 on every other."""
    *traced_b1, ok = constants
    return jnp.where(ok, lion_pre_sign(g, m, *traced_b1), 0)

  def moment(g, m):
    """``(1 - b2) g + b2 m`` in the wider dtype of the two, each rate taken
    in its operand's dtype (as JAX takes a Python scalar), rounded once to
    the momentum's: a bf16 product (``b2 m`` of a bf16 momentum, ``(1 - b2)
    g`` of bf16 gradients beside a float32 momentum) must not round on its
    own where one program's fusions split it from the sum and another's
    keep it wide."""
    wide = jnp.promote_types(g.dtype, m.dtype)
    new = jnp.asarray(1.0 - b2, g.dtype).astype(wide)
    decay = jnp.asarray(b2, m.dtype).astype(wide)
    return (new * g.astype(wide) + decay * m.astype(wide)).astype(m.dtype)

  # The fused kernels compute the new momentum in the encoding's pass (an
  # abstainer's kept there); a kernel may not close over a traced b2.
  fused_moment = moment if isinstance(b2, (int, float)) else None
  kept_moment = fused_moment and (
      lambda g, m, ok: jnp.where(ok, moment(g, m), m))

  def present_pre_sign(g, m, *constants):
    """``c``, or 0 on a worker that abstains (``ok`` the last constant)."""
    *constants, ok = constants
    return jnp.where(ok, pre_sign(g, m, *constants), 0)

  def voted_update(combine, num_workers, *trees, constants=(), also=None,
                   **abstention):
    return _exchange.aggregate(
        combine, *trees, axis_name=axis_name, num_workers=num_workers,
        spec=spec, aggregation=aggregation, comm=comm,
        min_compress_size=min_compress_size, constants=constants,
        bucket_bytes=bucket_bytes, with_done=True, kernels=kernels,
        also=also, **abstention)

  def update_fn(updates, state, params=None):
    del params
    _check_state(state, state_type)
    num_workers = _exchange.workers_along(axis_name)
    _checks.check_same_structure(updates, state.mu, num_workers)
    _checks.check_float_leaves(updates, "gradient")
    if num_workers > 1:
      _drift.check_local_gradients(updates, axis_name)
    ok = abstained = None
    if abstain_nonfinite:
      # The test reads the gradients through a barrier: read beside the
      # update's own reads of them, it changed XLA:CPU's fusions and how
      # the update rounds (the plain jitted step's residuals moved by an
      # ulp with every gradient finite).
      ok = _checks.all_finite(lax.optimization_barrier(updates))
      abstained = (~ok).astype(jnp.int32)
      if num_workers > 1:
        abstained = _collectives.psum(abstained, axis_name)
    kept = lambda new, old, ok=ok: new if ok is None else jax.tree.map(
        lambda n, o: jnp.where(ok, n, o), new, old)
    extra, done, fused_mu = {}, None, {}
    if num_workers == 1:
      new_updates = jax.tree.map(lambda g, m: jnp.sign(lion_pre_sign(g, m)),
                                 updates, state.mu)
      new_updates = kept(new_updates, jax.tree.map(jnp.zeros_like,
                                                   new_updates))
      extra = {"error": state.error} if error_feedback else {}
    elif error_feedback:
      corrected = jax.tree.map(lambda g, m, e: pre_sign(g, m) + e, updates,
                               state.mu, state.error)
      if ok is None:
        new_updates, done, _ = voted_update(lambda c: c, num_workers,
                                            corrected)
      else:   # g and m for a lone worker's c (see lone_pre_sign)
        corrected = jax.tree.map(lambda p: jnp.where(ok, p, 0), corrected)
        new_updates, done, _ = voted_update(
            lambda p, g, m, *_: p, num_workers, corrected, updates, state.mu,
            constants=constants, present=ok, abstained=abstained,
            lone=lambda p, *rest: lone_pre_sign(*rest))
      new_updates = _in_dtypes_of(new_updates, updates, state.mu)
      leaves, treedef = jax.tree.flatten(corrected)
      # A lone worker keeps its residual, as one worker's Lion does.
      residual_kept = None if ok is None else ok & (
          abstained < num_workers - 1)
      extra = {"error": kept(treedef.unflatten([
          _residual(p, d, e.dtype) for p, d, e in zip(
              leaves, treedef.flatten_up_to(new_updates),
              treedef.flatten_up_to(state.error))]), state.error,
                             residual_kept)}
    else:   # c computed inside the vote, on the whole message at once
      new_updates, done, fused_mu = voted_update(
          pre_sign if ok is None else present_pre_sign, num_workers,
          updates, state.mu, also=fused_moment if ok is None else kept_moment,
          constants=constants, present=ok, abstained=abstained,
          lone=None if ok is None else lone_pre_sign)
      new_updates = _in_dtypes_of(new_updates, updates, state.mu)
    mu = _moments(moment, updates, state.mu, fused_mu, kept)
    if done is not None and not _mesh.on_tpu():
      mu = _after_vote(mu, done)
    count = optax.safe_increment(state.count)
    voted = True
    if abstained is not None:   # a step no worker voted in is skipped
      voted = abstained < num_workers
      count = jnp.where(voted, count, state.count)
      extra.update(abstained=abstained,
                   abstentions=state.abstentions + abstained)
    if schedule is not None and num_workers > 1:
      flags = sync.resolve_mask(momentum_sync_mask, updates)
      do_sync = schedule(_collectives.alike(count, axis_name))
      if abstained is None:
        mu = sync.sync_momenta(mu, flags, do_sync, axis_name)
      else:   # the present workers' mean, where two or more are
        mu = sync.sync_momenta(
            mu, flags, do_sync & (abstained < num_workers - 1), axis_name,
            present=ok, count=num_workers - abstained)
    return new_updates, state_type(count=count, mu=mu, **extra)

  return optax.GradientTransformation(init_fn, update_fn)


def _in_dtypes_of(voted, updates, mu):
  """The vote's ``D`` (in ``c``'s float32) in the dtype ``g`` and ``m``
  promote to, as :func:`optax.scale_by_lion` returns it: exact for MaVo,
  and for Avg the same rounding as the vote's table of quotients."""
  return jax.tree.map(
      lambda d, g, m: d.astype(jnp.promote_types(g.dtype, m.dtype)),
      voted, updates, mu)


def _moments(moment, updates, mu, fused_mu: dict, kept):
  """``kept(moment(g, m), m)`` leaf by leaf, taken from ``fused_mu`` (by
  leaf index) where the fused kernels computed it (and kept it)."""
  grads, treedef = jax.tree.flatten(updates)
  return treedef.unflatten([
      fused_mu[i] if i in fused_mu else kept(moment(g, m), m)
      for i, (g, m) in enumerate(zip(grads, treedef.flatten_up_to(mu)))])


def _after_vote(mu, done):
  """The new momenta ``mu`` as they are, computed only once the vote is
  ``done`` (:func:`dlion_jax.exchange.aggregate`'s zero), so that XLA does
  not copy the old momenta first.

  The old momentum is read twice, by the vote's encoding of ``c`` and by
  its own update, which XLA writes in place (its buffer donated). XLA
  copies such a buffer before the write (``optax.lion``'s step too; the
  design notes measure it) unless every other read is ordered before
  it, and XLA orders by data. Here the bits of each new momentum are or-ed
  with ``done``, a zero XLA cannot fold, computed from a few of the vote's
  integer outcomes: the same bits, whose fusion now follows the exchange
  that followed the encoding. Or-ed after the arithmetic: ``g`` or ``m``
  tied before it changed which product of ``(1 - b2) g + b2 m`` XLA:CPU
  contracted into a fused multiply-add (one rounding apart from the numpy
  reference, which follows XLA's contraction). Where one program also
  computes the old momentum (``init`` and two updates in one ``jit``), the
  or keeps XLA from folding constants from one update into the next, so
  the momenta may differ in their last bits from that program's without
  it. Leaves exchanged exactly (``min_compress_size``) keep their copies.

  Not on TPU (XLA:TPU makes no copy), nor under the compiler's axes (there
  is no ``done``: the outcomes' first elements live on one device).
  """
  def after(m):
    if not jnp.issubdtype(m.dtype, jnp.floating):   # e.g. a complex mu_dtype
      return m
    bits = jnp.dtype(f"uint{8 * m.dtype.itemsize}")
    return lax.bitcast_convert_type(
        lax.bitcast_convert_type(m, bits) | done.astype(bits), m.dtype)
  return jax.tree.map(after, mu)


def distributed_lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.99,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: Any = None,
    *,
    axis_name: _exchange.AxisName | None = None,
    aggregation: _message.Aggregation = "mavo",
    vote: _quantize.Vote = "binary",
    comm: _message.CommChoice = "auto",
    quantizer: _quantize.Quantizer = "sign",
    bits: int | None = None,
    momentum_sync: int | sync.SyncSchedule | None = None,
    momentum_sync_mask: Any = None,
    min_compress_size: int | None = None,
    error_feedback: bool = False,
    bucket_bytes: int | None = None,
    kernels: _fused.Kernels = "auto",
    abstain_nonfinite: bool = False,
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
    learning_rate: a float or an optax schedule. Under
      ``jax.shard_map(..., check_vma=True)`` a schedule reads the step count
      after one 4-byte ``pmax`` over the workers, so that JAX can tell the
      update is the same on every worker.
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
    quantizer: ``'sign'``, ``'ternary_l1'`` or ``'pbit_l1'``.
    bits: bits per vote for ``quantizer='pbit_l1'``.
    momentum_sync: ``None``, a period ``k`` or a :mod:`dlion_jax.sync`
      schedule.
    momentum_sync_mask: which momentum leaves a sync averages.
    min_compress_size: leaves with fewer elements are exchanged exactly.
    error_feedback: keep each worker's residual and add it next step
      (this and the five above are Lion Cub's options; see
      :func:`scale_by_distributed_lion`).
    bucket_bytes: exchange the votes in buckets of at most this many
      gradient bytes, to overlap them with the backward pass (see
      :func:`scale_by_distributed_lion`).
    kernels: ``'auto'``, ``'pallas'`` or ``'xla'``: fused Pallas kernels
      for the vote (see :func:`scale_by_distributed_lion`).
    abstain_nonfinite: a worker whose gradients are not all finite
      abstains from the vote, its state unchanged; the others' majority
      (or mean) is every worker's update (see
      :func:`scale_by_distributed_lion`). A step where every worker
      abstains is skipped whole, weight decay and the schedules given
      here included, as :func:`dlion_jax.apply_if_finite` skips one;
      :func:`optax.inject_hyperparams` counts its steps outside this
      transform: wrap it in :func:`dlion_jax.skip_if_none_voted`.

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
  tx = optax.chain(
      scale_by_distributed_lion(
          b1=b1, b2=b2, mu_dtype=mu_dtype, axis_name=axis_name,
          aggregation=aggregation, vote=vote, comm=comm, quantizer=quantizer,
          bits=bits, momentum_sync=momentum_sync,
          momentum_sync_mask=momentum_sync_mask,
          min_compress_size=min_compress_size, error_feedback=error_feedback,
          bucket_bytes=bucket_bytes, kernels=kernels,
          abstain_nonfinite=abstain_nonfinite),
      optax.add_decayed_weights(_replicated_schedule(weight_decay, axis_name),
                                mask),
      optax.scale_by_learning_rate(_replicated_schedule(learning_rate,
                                                       axis_name)),
  )
  if abstain_nonfinite:
    return skip_if_none_voted(tx, axis_name=axis_name)
  return tx


def skip_if_none_voted(
    inner: optax.GradientTransformation, *,
    axis_name: _exchange.AxisName | None = "data",
) -> optax.GradientTransformationExtraArgs:
  """``inner`` with every step that no worker voted in skipped whole.

  ``inner`` holds :func:`scale_by_distributed_lion` with
  ``abstain_nonfinite=True`` (an :class:`AbstainingState`, or several).
  On a step every worker abstained from (from each of them) the update
  is 0 and the state stays as it was, schedules' counts included; the
  abstention counts record the step. :func:`distributed_lion` does this
  for its own chain; wrap what counts steps outside it, as
  :func:`optax.inject_hyperparams` does (its schedules read its count):
  ``dl.skip_if_none_voted(optax.inject_hyperparams(dl.distributed_lion)(
  learning_rate=schedule, axis_name="data", abstain_nonfinite=True))``.

  Args:
    inner: the transformation to skip steps of.
    axis_name: the axis its abstaining transforms vote over (``None``: one
      worker).

  Returns:
    An :class:`optax.GradientTransformationExtraArgs`, ``inner``'s state.
  """
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(updates, state, params,
                                          **extra_args)
    counts = [s.abstained for s in jax.tree.leaves(
        new_state, is_leaf=_abstaining) if _abstaining(s)]
    if not counts:
      raise ValueError(
          "skip_if_none_voted(inner): inner's state (a "
          f"{type(state).__name__}) holds no dl.AbstainingState, so nothing "
          "says when every worker abstained. Build the dl.distributed_lion "
          "(or scale_by_distributed_lion) in it with abstain_nonfinite=True, "
          "or drop the wrapper.")
    workers = _exchange.workers_along(axis_name)
    voted = jnp.any(jnp.stack([count < workers for count in counts]))
    new_updates = jax.tree.map(
        lambda u: jnp.where(voted, u, jnp.zeros_like(u)), new_updates)
    new_state = jax.tree.map(
        lambda new, old: new if _abstaining(new) else jnp.where(
            voted, new, old), new_state, state, is_leaf=_abstaining)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _abstaining(state) -> bool:
  return isinstance(state, (AbstainingState, AbstainingErrorFeedbackState))


def _replicated_schedule(value: optax.ScalarOrSchedule, axis_name):
  """A schedule whose step count is typed equal on every worker.

  Inside ``jax.shard_map(..., check_vma=True)`` the per-worker optimizer
  state, and so the step count a schedule reads (or the value
  :func:`optax.inject_hyperparams` passes in), is typed as varying over
  the workers, although every worker holds it alike: the learning rate, and
  with it the new params, would be typed per worker and the step refused
  ("out_specs ... could not infer replication"). There the count takes its
  maximum over those axes, one 4-byte all-reduce a step; so it does under
  a ``jax.vmap`` over the mesh axis ``axis_name`` (:mod:`dlion_jax.workers`),
  where each worker's count is one row of an array. Elsewhere
  (``check_vma=False``, ``pmap``, ``vmap`` alone) the schedule runs
  unchanged.
  """
  alike = lambda x: _collectives.alike(x, axis_name)
  if isinstance(value, jax.Array):    # traced by optax.inject_hyperparams
    return alike(value)
  if not callable(value):
    return value
  return lambda count: value(alike(count))
