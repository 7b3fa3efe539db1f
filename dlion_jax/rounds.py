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
the fp32 mean of the ``Δ_i`` (an all-reduce a round). :func:`voted_outer`
steps on that mean voted in as many bits as Distributed Lion's vote (or a
sparse vote, fewer), each worker carrying what its vote could not say
into the next round (:func:`scale_by_voted_mean`); ``local_steps(...,
late=True)`` applies each outer step one round late.

The params each worker trains differ between outer steps, so a step holds
them per worker (``make_train_step(..., params_per_worker=True)`` with
params placed by :func:`dlion_jax.devices.stack_for_workers`); the anchor,
in the state, is the same on every worker and is the model to evaluate and
keep (:func:`anchor`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlion_jax import _checks
from dlion_jax import _collectives
from dlion_jax import _deprecations
from dlion_jax import _exchange
from dlion_jax import _message
from dlion_jax import _quantize
from dlion_jax import _sparse
from dlion_jax import _voted
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
                every: int, late: bool = False
                ) -> optax.GradientTransformation:
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
  :func:`optax.multi_transform` around both) or vote ``"ternary"``
  (:func:`~dlion_jax.rounds.voted_outer` leaves a wholly frozen leaf as it
  is: its scale is 0). Weight decay belongs to ``inner``: give
  ``dl.distributed_lion`` as ``outer`` ``weight_decay=0.0`` (its default,
  1e-3, would decay the anchor again).

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
      e.g. :func:`~dlion_jax.rounds.voted_outer` (the best low-bit
      outer step measured, level with the best-tuned fp32 one:
      docs/training.md), ``dl.distributed_lion(outer_lr,
      axis_name="data", weight_decay=0.0)`` or
      :func:`~dlion_jax.rounds.nesterov_outer`. Its update must be the same
      on every worker.
    every: ``H``, the steps of a round (1: an outer step every step).
    late: the outer step one round late: the step that ends round ``r``
      sends round ``r - 1``'s pseudo-gradients (kept in the state,
      :class:`~dlion_jax.rounds.OneRoundLateState`, in the params' dtype:
      one more copy of the params) and moves the
      anchor by their outer update, so that the exchange depends on the
      state alone, not on this step's gradients, and may overlap them; the
      first round moves nothing. Streaming DiLoCo's overlap (Douillard et
      al., 2025) at a delay of a whole round; its cost is in
      docs/training.md.

  Returns:
    An optax ``GradientTransformation`` whose ``update`` needs ``params``
    and passes optax's extra arguments (``value=``) on to ``inner``.

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
  late = _checks.flag("late", late, "whether the outer step is one round "
                      "late")
  late_outer = _one_round_late(outer) if late else None

  def init_fn(params):
    inner_state = inner.init(params)
    if has_local_steps(inner_state):
      raise ValueError(
          "local_steps: the inner optimizer runs local steps of its own; "
          "nest none: one local_steps around the whole optimizer.")
    return LocalStepsState(
        count=jnp.zeros([], jnp.int32),
        anchor=jax.tree.map(jnp.asarray, params), inner_state=inner_state,
        outer_state=(late_outer or outer).init(params),
        restart=jnp.zeros([], bool))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "local_steps needs the params: call tx.update(grads, state, "
          "params), with this worker's own params.")
    inner_updates, inner_state = optax.with_extra_args_support(inner).update(
        updates, state.inner_state, params, **extra_args)
    count = optax.safe_int32_increment(state.count)
    restart = count % every == 0
    late_updates = late_state = None
    if late:   # from the state alone, ahead of this step's round
      late_updates, late_state = late_outer.update(
          restart, state.outer_state, state.anchor)

    def outer_step(anchor, outer_state, inner_state):
      trained = optax.apply_updates(params, inner_updates)
      delta = jax.tree.map(jnp.subtract, anchor, trained)
      if late:
        outer_updates, new_state = late_updates, late_state._replace(
            pending=delta, ready=jnp.ones([], bool))
      else:
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

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _one_round_late(outer: optax.GradientTransformation):
  """``outer`` on the pseudo-gradients its state keeps from the last round
  (:class:`OneRoundLateState`). Its ``update(restart, state, anchor)``
  runs ``outer`` where ``restart`` and a pending round are, and returns
  zero updates and the state as it was elsewhere; the caller stores the
  new round's pseudo-gradients."""

  def init_fn(params):
    return OneRoundLateState(
        pending=jax.tree.map(jnp.zeros_like, params),
        ready=jnp.zeros([], bool), outer_state=outer.init(params))

  def update_fn(restart, state, anchor):
    def step(pending, outer_state):
      updates, new_state = outer.update(pending, outer_state, anchor)
      return updates, optax.tree_utils.tree_cast_like(new_state, outer_state)

    def wait(pending, outer_state):
      return jax.tree.map(jnp.zeros_like, pending), outer_state
    updates, outer_state = lax.cond(restart & state.ready, step, wait,
                                    state.pending, state.outer_state)
    return updates, state._replace(outer_state=outer_state)

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
                   momentum: float = 0.9, axis_name: str = "data",
                   abstain_nonfinite: bool = False
                   ) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov SGD on the workers' mean
  pseudo-gradient, an fp32 all-reduce a round (Douillard et al., 2023, use
  ``learning_rate=0.7``, ``momentum=0.9``).

  With ``abstain_nonfinite=True`` a worker whose round ended non-finite
  (its pseudo-gradient not all finite) is left out of the mean
  (:func:`dlion_jax.transforms.pmean_gradients`: the others' mean, where
  the all-reduce sums in the workers' order the present workers' run bit
  for bit; the count in the state, an
  :class:`~dlion_jax.transforms.AbstainingMeanState`); a round every
  worker abstains from moves nothing, the momentum and the learning
  rate's schedule included.

  Example:
    >>> import optax, dlion_jax as dl
    >>> tx = dl.local_steps(
    ...     optax.adamw(1e-3), dl.rounds.nesterov_outer(0.7), every=32)

  Raises:
    ValueError: ``momentum`` outside ``[0, 1)``.
  """
  _checks.decay_rate("momentum", momentum, "the outer step's Nesterov momentum",
                     example="momentum=0.9 (DiLoCo's)")
  mean = transforms.pmean_gradients(axis_name,
                                    abstain_nonfinite=abstain_nonfinite)
  step = optax.sgd(learning_rate, momentum=momentum, nesterov=True)
  if abstain_nonfinite:
    return _skipped_if_none_present(mean, step, axis_name=axis_name)
  return optax.chain(mean, step)


def _skipped_if_none_present(mean: optax.GradientTransformation, *steps,
                             axis_name) -> optax.GradientTransformation:
  """``optax.chain(mean, *steps)``, ``mean`` an abstaining mean (its
  state an :class:`~dlion_jax.transforms.AbstainingMeanState`, or a pair
  of a state and one), with a round every worker abstained
  from skipped: ``steps`` then run from their state's float leaves zeroed
  and return 0 (as Nesterov's trace, Lion's momentum and a learning rate
  do from 0 with the mean's 0), and their state stays as it was (a
  :func:`jax.lax.cond` picks it). Neither is a select: XLA would contract
  the multiply-adds of the update and the momentum otherwise, and a round
  every worker votes in would not be the step without abstention's, bit
  for bit (measured on XLA:CPU)."""
  rest = optax.chain(*steps)

  def init_fn(params):
    return (mean.init(params),) + tuple(rest.init(params))

  def update_fn(updates, state, params=None):
    updates, counted = mean.update(updates, state[0], params)
    count = (counted if isinstance(counted, transforms.AbstainingMeanState)
             else counted[1])   # the voted mean's pair
    voted = count.abstained < _exchange.workers_along(axis_name)
    zeroed = jax.tree.map(
        lambda x: jnp.where(voted, x, jnp.zeros_like(x)) if jnp.issubdtype(
            x.dtype, jnp.inexact) else x, state[1:])
    updates, new = rest.update(updates, zeroed, params)
    new = lax.cond(voted, lambda new, old: new, lambda new, old: old,
                   tuple(new), state[1:])
    return updates, (counted,) + tuple(new)

  return optax.GradientTransformation(init_fn, update_fn)


class VotedMeanState(NamedTuple):
  """State of :func:`scale_by_voted_mean` on one worker.

  Attributes:
    count: outer steps taken (int32 scalar), the same on every worker: it
      names the fragment that votes (``fragments``).
    error: this worker's residual ``e_i``, what its earlier votes could not
      say (float32, float64 for float64 leaves); it differs from worker to
      worker.
  """
  count: jax.Array
  error: optax.Updates


def scale_by_voted_mean(
    *, axis_name: _exchange.AxisName = "data",
    aggregation: _message.Aggregation = "mavo",
    vote: _quantize.Vote = "binary", quantizer: _quantize.Quantizer = "sign",
    bits: int | None = None, comm: _message.CommChoice = "auto",
    error_feedback: bool = True, error_decay: float = 1.0,
    scale_chunk: int | None = None, fragments: int = 1,
    sparse_chunk: int | None = None, sparse_keep: int = 1,
    sparse_value_bits: int = 1, scale_clip: float | None = 2.0,
    fit_scale: bool = False, fp32_mean: bool = False,
    abstain_nonfinite: bool = False) -> optax.GradientTransformation:
  r"""The workers' mean pseudo-gradient, each worker sending a few bits.

  Worker :math:`i`, given :math:`\delta_i` (an outer step's pseudo-gradient),
  says :math:`p_i = \delta_i + \beta e_i` as a code :math:`q_i` of values
  in :math:`[-1, 1]` and scales :math:`s_i` (one a leaf, or one a chunk of
  ``scale_chunk`` entries), keeping what it could not say (error
  feedback; Karimireddy et al., 2019; :math:`\beta` = ``error_decay``,
  SparseLoCo's decay):

  .. math::

    e_i \leftarrow p_i - s_i q_i

  * dense (``sparse_chunk=None``): :math:`q_i` is Distributed Lion's vote
    on :math:`p_i` (``vote``, ``quantizer``, ``bits`` as in
    :func:`dlion_jax.scale_by_distributed_lion`; an L1 level :math:`l`
    counts :math:`l / L`), :math:`s_i` the mean :math:`|p_i|`, and
    :math:`U = \bar s\, V`, with :math:`V = \mathrm{sign}(\sum_i
    q_i)` (``'mavo'``) or :math:`\frac1N \sum_i q_i` (``'avg'``) exchanged
    as Distributed Lion's votes are (``comm``) and :math:`\bar s` the
    workers' mean scale (float32, each :math:`s_i` clipped, below).
    With ``fit_scale=True`` :math:`\bar s` is instead the scale of
    :math:`V` nearest the workers' exact mean in L2, :math:`\frac1N
    \sum_i \langle p_i, V\rangle / \langle V, V\rangle` (of each leaf
    or chunk): every worker sends its :math:`\langle p_i, V\rangle /
    \langle V, V\rangle` after the vote (clipped in magnitude as the
    scales are) in place of its mean magnitude, so where the workers
    disagree :math:`U` shrinks (their mean is small there).
    With ``fragments=M`` only the entries :math:`k, k + M, k + 2M, \dots`
    of each flattened leaf vote in outer step :math:`t`
    (:math:`k = t \bmod M`): the others send nothing and keep all of
    :math:`p_i` as their residual, so every entry votes once every
    :math:`M` steps, at :math:`1/M` of the bits
    (the scales are then the fragment's; its last entries may be zero
    padding);
  * sparse (``sparse_chunk=C``): :math:`q_i` is the sign of the
    ``sparse_keep`` entries of largest :math:`|p_i|` in every chunk of
    :math:`C` and 0 elsewhere (with ``sparse_value_bits=2``, also whether
    each is above its scale's mean magnitude, the two sides decoded as
    their own means), :math:`s_i` their mean magnitude, and
    :math:`U = \frac1N \sum_i s_i q_i` (each :math:`s_i` clipped) from
    every worker's positions and values, one word an entry, gathered
    (``aggregation`` and ``comm`` do not apply): at :math:`C = 128` a
    worker sends 8 bits for 128 entries;
  * no vote (``fp32_mean=True``): :math:`U = \frac1N \sum_i p_i`,
    all-reduced in float32 as DiLoCo's mean is, and :math:`s_i q_i = p_i`
    (the residual is 0, or with ``fragments`` the entries off the
    fragment): the control that tells what a vote's bits cost at the same
    schedule of rounds and fragments (docs/training.md).

  ``scale_clip=c`` bounds what one worker's scale can do to :math:`U`:
  every worker gathers every worker's scales and takes each at most
  :math:`c` times their median, :math:`\min(s_i, c\,
  \mathrm{median}_j s_j)` (of each leaf, chunk or side), summed in the
  workers' order. A worker whose scale is a million times the others'
  then counts as :math:`c` medians (in the plain mean it makes
  :math:`\bar s`, and every entry of :math:`U`, about :math:`10^6 / N`
  times as large, and the run is lost: docs/guides/faulty_workers.md),
  while scales within :math:`c` medians, honest workers', are kept bit
  for bit: where the all-reduce sums in the workers' order (XLA:CPU's),
  the run is the plain mean's (``scale_clip=None``). It holds while
  fewer than half the workers send such scales. The dense vote's scales
  are then gathered, :math:`4 (N - 1)` bytes a scale a worker instead of
  an all-reduce's :math:`8 (N - 1) / N`.

  ``abstain_nonfinite=True``: a worker whose round ended non-finite (its
  pseudo-gradient :math:`\delta_i` not all finite) abstains. It says
  :math:`p_i = 0` (the dense vote's tallies take its codes back out, as
  :func:`dlion_jax.scale_by_distributed_lion`'s abstention does), its
  scales count for nothing and the mean is over the :math:`N - a` workers
  present (the sum times :math:`1 / (N - a)`, as a ``pmean`` over them
  rounds it); its residual stays as it was (what its earlier rounds could
  not say is said in its next finite round; its lost round adds
  nothing), as does everyone's step count where all abstain (then
  :math:`U = 0`). The count :math:`a` (one int32 all-reduce a round) and
  its running total are in the state, an
  :class:`~dlion_jax.transforms.AbstainingMeanState` beside the
  residual's. With :math:`a` abstainers every
  worker's :math:`U`, and the present workers' residuals, are those of a
  run of the present workers alone, bit for bit where the all-reduces
  sum in the workers' order (XLA:CPU's: the sparse vote's sums and the
  clipped scales' are the workers' order everywhere); with every round
  finite, the run without abstention's.

  Every worker returns the same :math:`U`, an estimate of the mean
  :math:`\frac1N \sum_i \delta_i` (what DiLoCo all-reduces in fp32), to
  feed an outer step (:func:`voted_outer`). With ``error_feedback=False``
  there is no residual (:math:`e_i = 0`, no state). The residual costs
  4 bytes a parameter a worker (8 for float64 leaves); a non-finite
  entry of :math:`p_i` leaves 0 there. What each option is worth on the
  study's tasks: docs/training.md.

  Args:
    axis_name: the workers' axis.
    aggregation: ``'mavo'`` or ``'avg'`` (dense only).
    vote: ``'binary'`` or ``'ternary'`` (dense, ``quantizer='sign'``).
    quantizer: ``'sign'``, ``'ternary_l1'`` or ``'pbit_l1'`` (dense only).
    bits: bits a vote for ``quantizer='pbit_l1'``.
    comm: how the dense votes travel, as in
      :func:`dlion_jax.scale_by_distributed_lion`.
    error_feedback: carry each worker's residual into its next vote.
    error_decay: :math:`\beta` in ``(0, 1]``, the residual's weight in the
      next vote (1: all of it).
    scale_chunk: ``None`` (a scale a leaf) or the entries of the flattened
      leaf that share a scale (dense: any size from 2, the last chunk its
      own entries; sparse: a multiple of ``sparse_chunk``). Each costs a
      float32 (two with 2-bit sparse values): dense, all-reduced; sparse,
      gathered.
    fragments: ``M``, the dense vote (or the fp32 mean) on one entry in
      ``M`` a step, in turn (needs ``error_feedback``).
    sparse_chunk: ``None`` (dense), or the chunk, a power of two up to
      32768 (16384 with 2-bit values), of which ``sparse_keep`` entries
      vote.
    sparse_keep: entries of every chunk that vote (sparse only).
    sparse_value_bits: 1 (a kept entry's sign) or 2 (and one bit of its
      magnitude; sparse only).
    scale_clip: :math:`c \ge 1`, each worker's scale at most :math:`c`
      times the workers' median; ``None``: the plain mean of the scales
      (dense: all-reduced).
    fit_scale: the dense vote's :math:`\bar s` fitted to the workers'
      mean after the vote (see above), not their mean magnitude.
    fp32_mean: no vote: the workers' fp32 mean, all-reduced (see above;
      the vote's options stay at their defaults). Without ``fragments``
      the residual is always 0: ``error_feedback=False`` keeps none.
    abstain_nonfinite: a worker whose pseudo-gradient is not all finite
      abstains (see above).

  Returns:
    A :class:`optax.GradientTransformation` whose state is a
    :class:`VotedMeanState` (:class:`optax.EmptyState` without error
    feedback); with ``abstain_nonfinite``, the pair of that state and a
    :class:`~dlion_jax.transforms.AbstainingMeanState`.

  References:
    Karimireddy et al., `Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes <https://arxiv.org/abs/1901.09847>`_, ICML 2019.
    Sarfi et al., `SparseLoCo: Communication-Efficient LLM Training
    <https://arxiv.org/abs/2508.15706>`_, 2025.
  """
  _checks.check_choice("aggregation", aggregation, _exchange.AGGREGATIONS)
  _checks.check_choice("comm", comm, _exchange.COMM_CHOICES)
  fp32_mean = _checks.flag("fp32_mean", fp32_mean,
                           "whether the workers send their fp32 values")
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  error_feedback = _checks.flag("error_feedback", error_feedback,
                                "whether each worker keeps its residual")
  error_decay = _voted.residual_weight(error_decay, error_feedback)
  scale_clip = _voted.clip_factor(scale_clip)
  fit_scale = _checks.flag("fit_scale", fit_scale,
                           "whether the vote's scale is fitted to the mean")
  vote_only = {"aggregation": (aggregation, "mavo"),
               "fit_scale": (fit_scale, False),
               "vote": (vote, "binary"), "quantizer": (quantizer, "sign"),
               "bits": (bits, None), "comm": (comm, "auto")}
  if fp32_mean:
    _voted.check_no_vote({**vote_only, "scale_chunk": (scale_chunk, None),
                          "sparse_chunk": (sparse_chunk, None),
                          "scale_clip": (scale_clip, 2.0)})
  abstain_nonfinite = _checks.flag(
      "abstain_nonfinite", abstain_nonfinite,
      "whether a worker whose round ended non-finite abstains")
  fragments = _checks.positive_int("fragments", fragments,
                                   "the dense vote on one entry in M a step")
  if fragments > 1 and not error_feedback:
    raise ValueError(
        f"fragments={fragments} needs error_feedback=True: the entries "
        "that do not vote in a step keep their pseudo-gradient in the "
        "residual for their turn. Set error_feedback=True, or fragments=1.")
  sparse, scale_chunk = _voted.message_shape(
      sparse_chunk=sparse_chunk, sparse_keep=sparse_keep,
      sparse_value_bits=sparse_value_bits, scale_chunk=scale_chunk,
      dense_only={**vote_only, "fragments": (fragments, 1)})

  def init_fn(params):
    _checks.check_float_leaves(params, "params")
    none = jnp.zeros([], jnp.int32)
    state = optax.EmptyState()
    if error_feedback:
      state = VotedMeanState(none, jax.tree.map(
          lambda p: jnp.zeros(p.shape, _quantize.scale_dtype(p.dtype)),
          params))
    if abstain_nonfinite:
      return state, transforms.AbstainingMeanState(none, none)
    return state

  def update_fn(updates, state, params=None):
    del params
    _checks.check_float_leaves(updates, "pseudo-gradient")
    num_workers = _exchange.workers_along(axis_name)
    leaves, treedef = jax.tree.flatten(updates)
    ok = present = counted = None
    if abstain_nonfinite:
      state, counted = state
      ok, abstained = _collectives.abstainers(leaves, axis_name, num_workers)
      present = ok, abstained
      counted = transforms.AbstainingMeanState(
          abstained, counted.abstentions + abstained)
    wide = [d.astype(_quantize.scale_dtype(d.dtype)) for d in leaves]
    if error_feedback:
      wide = [p + (e if isinstance(error_decay, float) and error_decay == 1
                   else error_decay * e)
              for p, e in zip(wide, treedef.flatten_up_to(state.error))]
    if ok is not None:   # an abstainer votes 0 (the vote takes it out)
      wide = [jnp.where(ok, p, 0) for p in wide]
    if sparse is not None:
      means, said = _sparse.mean_of_votes(
          wide, sparse, axis_name=axis_name, num_workers=num_workers,
          clip=scale_clip, present=present)
    else:
      if fp32_mean:
        vote = functools.partial(_voted.exact_mean, axis_name=axis_name,
                                 num_workers=num_workers, present=present)
      else:
        vote = functools.partial(
            _voted.dense_mean, spec=spec, axis_name=axis_name,
            num_workers=num_workers, aggregation=aggregation, comm=comm,
            scale_chunk=scale_chunk, scale_clip=scale_clip,
            present=present, fit_scale=fit_scale)
      means, said = (vote(wide) if fragments == 1 else _voted.fragment_vote(
          vote, wide, fragments, state.count % fragments))
    means = treedef.unflatten([u.astype(d.dtype)
                               for u, d in zip(means, leaves)])
    if error_feedback:
      error = [jnp.where(jnp.isfinite(r), r, 0) for r in (
          p - s for p, s in zip(wide, said))]
      count = optax.safe_int32_increment(state.count)
      if ok is not None:
        # An abstainer keeps its residual; a step no worker voted in is
        # not counted (the fragments' turn stays).
        error = [jnp.where(ok, new, old) for new, old in zip(
            error, treedef.flatten_up_to(state.error))]
        count = jnp.where(abstained < num_workers, count, state.count)
      state = VotedMeanState(count, treedef.unflatten(error))
    return means, state if counted is None else (state, counted)

  return optax.GradientTransformation(init_fn, update_fn)


def voted_outer(learning_rate: optax.ScalarOrSchedule, *,
                axis_name: _exchange.AxisName = "data",
                momentum: float = 0.0, lion: tuple[float, float] | None = None,
                aggregation: _message.Aggregation = "mavo",
                vote: _quantize.Vote = "binary",
                quantizer: _quantize.Quantizer = "sign",
                bits: int | None = None, comm: _message.CommChoice = "auto",
                error_feedback: bool = True, error_decay: float = 1.0,
                scale_chunk: int | None = None, fragments: int = 1,
                sparse_chunk: int | None = None, sparse_keep: int = 1,
                sparse_value_bits: int = 1, scale_clip: float | None = 2.0,
                fit_scale: bool = False, fp32_mean: bool = False,
                abstain_nonfinite: bool = False
                ) -> optax.GradientTransformation:
  r"""An outer step on the workers' voted mean pseudo-gradient.

  The mean :math:`U` of :func:`scale_by_voted_mean` (error-fed, dense or
  sparse votes) takes the place of DiLoCo's fp32 all-reduce, then one of:

  * ``momentum=0`` (the default; SparseLoCo's, whose error feedback
    stands in for the momentum): :math:`\theta \leftarrow \theta - \eta U`;
  * ``momentum=mu``: Nesterov SGD on :math:`U`, DiLoCo's outer step;
  * ``lion=(b1, b2)``: a Lion step on :math:`U` (DSM-LS uses
    ``(0.95, 0.98)``), :math:`\eta` then the size of a sign step.

  The outer momentum, if any, is the same on every worker (it sees the
  same :math:`U`), in the params' dtype, beside the residual's float32.
  With ``abstain_nonfinite=True`` a worker whose round ended non-finite
  is left out of :math:`U` (:func:`scale_by_voted_mean`: the anchor is
  the present workers' run's), and a round every worker abstains from
  moves nothing: the outer momentum, Lion's and the learning rate's
  schedule skip it too.

  Args:
    learning_rate: the outer learning rate :math:`\eta`, a float or a
      schedule of the outer steps (rounds).
    axis_name: the workers' axis.
    momentum: Nesterov momentum in ``[0, 1)``; 0: none.
    lion: ``None``, or Lion's ``(b1, b2)`` for a sign step (``momentum``
      then 0).
    aggregation: the vote's, as are ``vote``, ``quantizer``, ``bits``,
      ``comm``, ``error_feedback``, ``error_decay``, ``scale_chunk``,
      ``fragments``, ``sparse_chunk``, ``sparse_keep``,
      ``sparse_value_bits``, ``scale_clip``, ``fit_scale``, ``fp32_mean``
      and ``abstain_nonfinite``:
      see :func:`scale_by_voted_mean`.

  Returns:
    An optax ``GradientTransformation``.

  Example:
    >>> import optax, dlion_jax as dl
    >>> tx = dl.local_steps(optax.lion(1e-3), dl.rounds.voted_outer(
    ...     0.5, axis_name="data"), every=32)
  """
  momentum = _checks.decay_rate(
      "momentum", momentum, "the outer step's Nesterov momentum",
      example="momentum=0.9, or momentum=0 for none")
  # A traced momentum (optax.inject_hyperparams) takes Nesterov's trace,
  # which at 0 is the plain step.
  traced = isinstance(momentum, jax.core.Tracer)
  vote_tx = scale_by_voted_mean(
      axis_name=axis_name, aggregation=aggregation, vote=vote,
      quantizer=quantizer, bits=bits, comm=comm,
      error_feedback=error_feedback, error_decay=error_decay,
      scale_chunk=scale_chunk, fragments=fragments,
      sparse_chunk=sparse_chunk, sparse_keep=sparse_keep,
      sparse_value_bits=sparse_value_bits, scale_clip=scale_clip,
      fit_scale=fit_scale, fp32_mean=fp32_mean,
      abstain_nonfinite=abstain_nonfinite)
  if lion is not None:
    if traced or momentum:
      raise ValueError(
          f"voted_outer: momentum={momentum} and lion={lion!r} are two outer "
          "steps; give one (momentum=0 with lion).")
    if not isinstance(lion, (tuple, list)) or len(lion) != 2:
      raise ValueError(
          f"lion must be Lion's (b1, b2), e.g. lion=(0.95, 0.98), or None "
          f"for no Lion step, got lion={lion!r}.")
    b1, b2 = lion
    _checks.decay_rate("lion[0]", b1, "Lion's b1",
                       example="lion=(0.95, 0.98)")
    _checks.decay_rate("lion[1]", b2, "Lion's b2",
                       example="lion=(0.95, 0.98)")
    step = optax.scale_by_lion(b1=b1, b2=b2)
  elif traced or momentum:
    step = optax.trace(decay=momentum, nesterov=True)
  else:
    step = optax.identity()
  rate = optax.scale_by_learning_rate(learning_rate)
  if abstain_nonfinite:
    return _skipped_if_none_present(vote_tx, step, rate, axis_name=axis_name)
  return optax.chain(vote_tx, step, rate)


class OneRoundLateState(NamedTuple):
  """The outer state of :func:`local_steps` with ``late=True``.

  Attributes:
    pending: this worker's pseudo-gradient of the last round, which the
      next outer step sends.
    ready: whether ``pending`` holds one (bool scalar, the same on every
      worker): False until the first round ends.
    outer_state: the outer optimizer's state.
  """
  pending: optax.Updates
  ready: jax.Array
  outer_state: optax.OptState


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
