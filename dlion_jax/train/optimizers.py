"""Optimizers selectable in configs, all with the same warmup + decay schedule.

* ``dlion``: :func:`dlion_jax.distributed_lion` (votes, no gradient
  all-reduce), any ``aggregation`` / ``vote`` / ``comm``.
* ``signum``: majority-vote Signum (Bernstein et al., 2019), i.e. D-Lion with
  ``b1 == b2 == momentum``.
* ``lion``, ``adamw``, ``sgd`` (with momentum): global optimizers fed
  gradients averaged over the workers by an fp32 all-reduce
  (:func:`dlion_jax.transforms.pmean_gradients`).
"""

from __future__ import annotations

import optax

import dlion_jax as dl
from dlion_jax.transforms import pmean_gradients
from dlion_jax.train.config import OptimizerConfig

# Optimizers whose state is alike on every worker (fed all-reduced grads).
GLOBAL_OPTIMIZERS = ("lion", "adamw", "sgd")


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
              error_feedback=cfg.error_feedback)


def build_optimizer(cfg: OptimizerConfig, *, total_steps: int,
                    axis_name: str = "data") -> optax.GradientTransformation:
  """The optimizer a config names, bound to the data-parallel axis."""
  lr = make_schedule(cfg, total_steps)
  wd = cfg.weight_decay
  if cfg.name == "dlion":
    return dl.distributed_lion(
        lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.99), weight_decay=wd,
        axis_name=axis_name, aggregation=cfg.aggregation, vote=cfg.vote,
        comm=cfg.comm, bucket_bytes=cfg.bucket_bytes,
        **lion_cub_options(cfg))
  if cfg.name == "signum":
    return dl.distributed_lion(
        lr, b1=cfg.momentum, b2=cfg.momentum, weight_decay=wd,
        axis_name=axis_name, aggregation="mavo", vote=cfg.vote,
        comm=cfg.comm, bucket_bytes=cfg.bucket_bytes)
  if cfg.name == "lion":
    inner = optax.lion(lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.99),
                       weight_decay=wd)
  elif cfg.name == "adamw":
    inner = optax.adamw(lr, b1=_or(cfg.b1, 0.9), b2=_or(cfg.b2, 0.999),
                        weight_decay=wd)
  elif cfg.name == "sgd":
    inner = optax.chain(optax.add_decayed_weights(wd),
                        optax.sgd(lr, momentum=cfg.momentum))
  else:
    raise ValueError(f"Unknown optimizer.name={cfg.name!r}.")
  return optax.chain(pmean_gradients(axis_name), inner)


def analytic_bits_per_param(cfg: OptimizerConfig, num_workers: int, *,
                            steps: int | None = None) -> float:
  """Wire bits per parameter per step each worker sends (analytic; a sync
  is counted as if it covered every parameter)."""
  if cfg.name == "signum":
    return dl.wire_bits(num_workers, vote=cfg.vote, comm=cfg.comm)
  if cfg.name == "dlion":
    return dl.wire_bits(num_workers, aggregation=cfg.aggregation,
                        vote=cfg.vote, comm=cfg.comm, quantizer=cfg.quantizer,
                        bits=cfg.bits, momentum_sync=sync_schedule(cfg),
                        steps=steps)
  return dl.allreduce_bits(num_workers)
