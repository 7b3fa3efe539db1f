"""Optimizers selectable in configs, all with the same warmup + decay schedule.

* ``dlion``: :func:`dlion_jax.distributed_lion` (votes, no gradient
  all-reduce), any ``aggregation`` / ``vote`` / ``comm``.
* ``signum``: majority-vote Signum (Bernstein et al., 2019), i.e. D-Lion with
  ``b1 == b2 == momentum``.
* ``lion``, ``adamw``, ``sgd`` (with momentum): global optimizers fed
  gradients averaged over the workers by an fp32 all-reduce
  (:func:`dlion_jax.transforms.pmean_gradients`).

With ``local_steps: H`` above 1 each worker runs the optimizer alone
(``dlion`` as Lion, ``signum`` as Signum: nothing sent) and every ``H``
steps an ``outer`` step of the pseudo-gradients goes over the workers
(:func:`dlion_jax.local_steps`): ``voted``, the workers' mean from
error-fed votes (:func:`dlion_jax.rounds.voted_outer`), ``dlion``,
Distributed Lion's vote with the options above, or ``nesterov``,
DiLoCo's.
"""

from __future__ import annotations

import optax

from dlion_jax.train.config import OptimizerConfig
from dlion_jax.transforms import pmean_gradients
import dlion_jax as dl

# Optimizers whose state is alike on every worker (fed all-reduced grads).
GLOBAL_OPTIMIZERS = ("lion", "adamw", "sgd")
# Where optimizer.outer_learning_rate is null: DiLoCo's for nesterov
# (Douillard et al., 2023); for dlion's sign steps, this many times the
# inner learning rate (docs/training.md, "Local steps").
NESTEROV_OUTER_LEARNING_RATE = 0.7
VOTED_OUTER_LEARNING_RATE = 0.5
DLION_OUTER_LEARNING_RATE_FACTOR = 10


def state_alike_on_every_worker(cfg: OptimizerConfig) -> bool:
  """Whether every worker holds the same optimizer state (a global
  optimizer, every step over the workers)."""
  return cfg.name in GLOBAL_OPTIMIZERS and cfg.local_steps == 1


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``learning_rate``, then cosine (or flat)."""
  peak = cfg.learning_rate
  if cfg.schedule == "constant":
    if not cfg.warmup_steps:
      return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, cfg.warmup_steps),
         optax.constant_schedule(peak)], [cfg.warmup_steps])
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps=cfg.warmup_steps,
      decay_steps=max(total_steps, cfg.warmup_steps + 1),
      end_value=peak * cfg.end_lr_fraction)


def _or(value, default):
  return default if value is None else value


def sync_schedule(cfg: OptimizerConfig) -> dl.sync.SyncSchedule | None:
  """The momentum sync schedule a config names (None: never)."""
  if not cfg.momentum_sync:
    return None
  if cfg.sync_schedule == "growing":
    return dl.sync.growing_intervals(cfg.momentum_sync)
  return dl.sync.every_k_steps(cfg.momentum_sync)


def lion_cub_options(cfg: OptimizerConfig) -> dict:
  """Keyword arguments of :func:`dlion_jax.distributed_lion` for Lion Cub."""
  mask = (None if cfg.sync_leaves is None
          else dl.sync.leaves_matching(cfg.sync_leaves))
  return dict(quantizer=cfg.quantizer, bits=cfg.bits,
              momentum_sync=sync_schedule(cfg), momentum_sync_mask=mask,
              min_compress_size=cfg.min_compress_size,
              error_feedback=cfg.error_feedback,
              abstain_nonfinite=cfg.abstain_nonfinite)


def build_optimizer(cfg: OptimizerConfig, *, total_steps: int,
                    axis_name: str = "data",
                    outer_faults: optax.GradientTransformation | None = None
                    ) -> optax.GradientTransformation:
  """The optimizer a config names, bound to the data-parallel axis;
  ``outer_faults`` (the fault studies') goes first in local steps' outer
  step."""
  lr = make_schedule(cfg, total_steps)
  if cfg.local_steps > 1:
    outer = _outer(cfg, lr, axis_name)
    if outer_faults is not None:
      outer = optax.chain(outer_faults, outer)
    inner = _alone(cfg, lr)
    if cfg.inner_allreduce:    # every worker alike: Lookahead's fast steps
      inner = optax.chain(pmean_gradients(axis_name), inner)
    return dl.local_steps(inner, outer, every=cfg.local_steps,
                          late=cfg.outer_late)
  if cfg.name == "dlion":
    return dl.distributed_lion(
        lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.99),
        weight_decay=cfg.weight_decay, axis_name=axis_name,
        aggregation=cfg.aggregation, vote=cfg.vote, comm=cfg.comm,
        bucket_bytes=cfg.bucket_bytes, **lion_cub_options(cfg))
  if cfg.name == "signum":
    return dl.distributed_lion(
        lr, b1=cfg.momentum, b2=cfg.momentum, weight_decay=cfg.weight_decay,
        axis_name=axis_name, aggregation="mavo", vote=cfg.vote,
        comm=cfg.comm, bucket_bytes=cfg.bucket_bytes,
        abstain_nonfinite=cfg.abstain_nonfinite)
  return optax.chain(pmean_gradients(axis_name), _alone(cfg, lr))


def _alone(cfg: OptimizerConfig, lr) -> optax.GradientTransformation:
  """The optimizer of one worker that sends nothing: Lion for ``dlion``,
  Signum (Lion with ``b1 = b2``) for ``signum``."""
  wd = cfg.weight_decay
  if cfg.name in ("dlion", "lion"):
    return optax.lion(lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.99),
                      weight_decay=wd)
  if cfg.name == "signum":
    return optax.lion(lr, b1=cfg.momentum, b2=cfg.momentum, weight_decay=wd)
  if cfg.name == "adamw":
    return optax.adamw(lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.999),
                       weight_decay=wd)
  if cfg.name == "sgd":
    return optax.chain(optax.add_decayed_weights(wd),
                       optax.sgd(lr, momentum=cfg.momentum))
  raise ValueError(f"Unknown optimizer.name={cfg.name!r}.")


def _outer(cfg: OptimizerConfig, schedule: optax.Schedule,
           axis_name: str) -> optax.GradientTransformation:
  """The outer optimizer of local steps, over ``axis_name``. Nesterov's
  learning rate is constant (DiLoCo's); the vote's sign steps take the
  inner ``schedule``'s shape at each round's last step, their size not
  shrinking with the pseudo-gradients'."""
  peak = cfg.outer_learning_rate
  if cfg.outer == "nesterov":
    return dl.rounds.nesterov_outer(
        _or(peak, NESTEROV_OUTER_LEARNING_RATE),
        momentum=_or(cfg.outer_momentum, 0.9), axis_name=axis_name,
        abstain_nonfinite=cfg.abstain_nonfinite)
  if cfg.outer == "voted":
    peak = _or(peak, VOTED_OUTER_LEARNING_RATE)
    lion = cfg.outer_step == "lion"
    return dl.rounds.voted_outer(
        _shaped(peak, cfg, schedule) if cfg.outer_schedule == "inner"
        else peak, axis_name=axis_name,
        momentum=0.0 if lion else _or(cfg.outer_momentum, 0.0),
        lion=(_or(cfg.outer_momentum, 0.95), _or(cfg.outer_b2, 0.98))
        if lion else None,
        aggregation=cfg.aggregation, vote=cfg.vote, comm=cfg.comm,
        quantizer=cfg.quantizer, bits=cfg.bits,
        error_feedback=cfg.outer_error_feedback,
        error_decay=cfg.outer_error_decay,
        scale_chunk=cfg.outer_scale_chunk, fragments=cfg.outer_fragments,
        sparse_chunk=cfg.outer_sparse_chunk,
        sparse_keep=cfg.outer_sparse_keep,
        sparse_value_bits=cfg.outer_sparse_value_bits,
        scale_clip=cfg.outer_scale_clip, fit_scale=cfg.outer_fit_scale,
        fp32_mean=cfg.outer_fp32_mean,
        abstain_nonfinite=cfg.abstain_nonfinite)
  lr = _shaped(_or(peak, DLION_OUTER_LEARNING_RATE_FACTOR * cfg.learning_rate),
               cfg, schedule)
  # The inner optimizer decays the weights: none in the outer step.
  return dl.distributed_lion(
      lr, b1=_or(cfg.outer_momentum, 0.9), b2=_or(cfg.outer_b2, 0.99),
      weight_decay=0.0,
      axis_name=axis_name, aggregation=cfg.aggregation, vote=cfg.vote,
      comm=cfg.comm, bucket_bytes=cfg.bucket_bytes, **lion_cub_options(cfg))


def _shaped(peak: float, cfg: OptimizerConfig, schedule: optax.Schedule):
  """``peak`` times the inner ``schedule``'s shape at each round's last
  step (a schedule of rounds), or ``peak`` where the inner rate is 0."""
  h = cfg.local_steps
  if not cfg.learning_rate:
    return peak
  return lambda rounds: peak * schedule((rounds + 1) * h - 1) / (
      cfg.learning_rate)


def outer_steps(cfg: OptimizerConfig, steps: int) -> int:
  """How many of the first ``steps`` steps end a round of local steps
  (every step without local steps)."""
  return steps // cfg.local_steps


def analytic_bits_per_param(cfg: OptimizerConfig, num_workers: int, *,
                            steps: int | None = None) -> float:
  """Wire bits per parameter per step each worker sends (analytic; a sync
  is counted as if it covered every parameter), averaged over ``steps``
  with local steps (over a round where ``steps`` is None)."""
  if cfg.local_steps > 1:
    rate = (1 / cfg.local_steps if steps is None
            else outer_steps(cfg, steps) / steps)
    inner = dl.allreduce_bits(num_workers) if cfg.inner_allreduce else 0.0
    if cfg.outer == "nesterov":
      return inner + dl.allreduce_bits(num_workers) * rate
    if cfg.outer == "voted" and cfg.outer_sparse_chunk:
      return inner + rate * dl.sparse_vote_bits(
          num_workers, sparse_chunk=cfg.outer_sparse_chunk,
          sparse_keep=cfg.outer_sparse_keep,
          sparse_value_bits=cfg.outer_sparse_value_bits,
          scale_chunk=cfg.outer_scale_chunk)
    if cfg.outer == "voted":
      rate /= cfg.outer_fragments
    if cfg.outer == "voted" and cfg.outer_fp32_mean:
      return inner + dl.allreduce_bits(num_workers) * rate
    return inner + rate * dl.wire_bits(
        num_workers, aggregation=cfg.aggregation, vote=cfg.vote,
        comm=cfg.comm, quantizer=cfg.quantizer, bits=cfg.bits)
  if cfg.name == "signum":
    return dl.wire_bits(num_workers, vote=cfg.vote, comm=cfg.comm)
  if cfg.name == "dlion":
    return dl.wire_bits(num_workers, aggregation=cfg.aggregation,
                        vote=cfg.vote, comm=cfg.comm, quantizer=cfg.quantizer,
                        bits=cfg.bits, momentum_sync=sync_schedule(cfg),
                        steps=steps)
  return dl.allreduce_bits(num_workers)
