"""The voted mean's dense vote (:func:`dlion_jax.rounds.scale_by_voted_mean`):
each worker's code and scales of what it says, the workers' combined
scale (clipped at a multiple of their median, or their plain mean), the
fp32 mean in its place, the vote in fragments, and the checks of the
vote's options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlion_jax import _blocks
from dlion_jax import _checks
from dlion_jax import _collectives
from dlion_jax import _exchange
from dlion_jax import _quantize
from dlion_jax import _sparse


def clip_factor(scale_clip) -> float | None:
  """``scale_clip``, checked: None, or a number of 1 or more (a traced one,
  from :func:`optax.inject_hyperparams`, as it is)."""
  if scale_clip is None or isinstance(scale_clip, jax.core.Tracer):
    return scale_clip
  if isinstance(scale_clip, (jax.Array, np.ndarray)) and not np.ndim(
      scale_clip):
    scale_clip = scale_clip.item()
  if isinstance(scale_clip, bool) or not isinstance(
      scale_clip, (int, float)) or not 1 <= scale_clip < float("inf"):
    raise ValueError(
        f"scale_clip={scale_clip!r} must be a number of 1 or more (each "
        "worker's scale is clipped at that many times the workers' median "
        "scale; e.g. 2.0), or None for the plain mean of the scales.")
  return float(scale_clip)


def residual_weight(error_decay, error_feedback: bool) -> float:
  """``error_decay``, checked: a number in ``(0, 1]`` (a traced one,
  from :func:`optax.inject_hyperparams`, as it is)."""
  if isinstance(error_decay, jax.core.Tracer):
    return error_decay
  if isinstance(error_decay, (jax.Array, np.ndarray)) and not np.ndim(
      error_decay):
    error_decay = error_decay.item()
  if isinstance(error_decay, bool) or not isinstance(
      error_decay, (int, float)) or not 0 < error_decay <= 1:
    raise ValueError(
        f"error_decay={error_decay!r} must be a number in (0, 1]: the "
        "weight of each worker's residual in its next vote (1: all of it; "
        "SparseLoCo decays it by e.g. 0.95).")
  if error_decay != 1 and not error_feedback:
    raise ValueError(
        f"error_decay={error_decay} needs error_feedback=True: there is no "
        "residual to decay. Set error_feedback=True, or leave error_decay "
        "at 1.")
  return float(error_decay)


def message_shape(*, sparse_chunk, sparse_keep, sparse_value_bits,
                  scale_chunk, dense_only: dict):
  """The sparse vote's shape (:func:`dlion_jax._sparse.sparsity`), or None
  for the dense vote, and ``scale_chunk`` checked: each vote's options
  refused with the other (``dense_only``: name -> (value, default))."""
  if sparse_chunk is not None:
    shape = _sparse.sparsity(sparse_chunk, sparse_keep, sparse_value_bits,
                             scale_chunk)
    for name, (value, default) in dense_only.items():
      if value != default:
        raise ValueError(
            f"{name}={value!r} does not apply to the sparse vote "
            f"(sparse_chunk={sparse_chunk}), which sends positions and "
            f"values, every worker's gathered: leave {name} at "
            f"{default!r}, or set sparse_chunk=None for the dense vote.")
    return shape, scale_chunk
  for name, value, default in (("sparse_keep", sparse_keep, 1),
                               ("sparse_value_bits", sparse_value_bits, 1)):
    if _checks.static_int(name, value) != default:
      raise ValueError(
          f"{name}={value!r} needs sparse_chunk: it is an option of the "
          "sparse vote. Give sparse_chunk (e.g. 128), or leave "
          f"{name} at {default} for the dense vote.")
  if scale_chunk is not None:
    scale_chunk = _checks.positive_int("scale_chunk", scale_chunk)
    if scale_chunk < 2:
      raise ValueError(
          "scale_chunk=1 would send a float32 scale for every entry, "
          "more than the fp32 mean: give a chunk of 2 or more entries "
          "(e.g. 1024), or None for a scale a leaf.")
  return None, scale_chunk


def _own_values(p: jax.Array, spec: _quantize.VoteSpec) -> jax.Array:
  """A worker's vote on ``p`` as values in ``[-1, 1]``: what the vote's
  codes say (:func:`dlion_jax._quantize.encode`)."""
  if spec.scaled:
    return _quantize.l1_levels(p, spec.max_level) / spec.max_level
  if spec.radix == 2:
    return jnp.where(p > 0, 1.0, -1.0).astype(p.dtype)
  return jnp.sign(p)


def _finite(x: jax.Array) -> jax.Array:
  return jnp.where(jnp.isfinite(x), x, 0)


def _chunk_sums(x: jax.Array, chunk: int) -> jax.Array:
  """The sum of each chunk of ``chunk`` entries of the flattened ``x``."""
  x = x.ravel()
  return jnp.pad(x, (0, -x.size % chunk)).reshape(-1, chunk).sum(1)


def _chunk_scales(p: jax.Array, chunk: int) -> jax.Array:
  """The mean ``|p|`` of each chunk of ``chunk`` entries of the flattened
  leaf (the last over its own entries), non-finite entries counting 0;
  each chunk's sum times the constant reciprocal of its size."""
  sizes = np.full(-(-p.size // chunk), chunk)
  if sizes.size:
    sizes[-1] = p.size - chunk * (sizes.size - 1)
  return _chunk_sums(_finite(jnp.abs(p)), chunk) * jnp.asarray(
      1.0 / sizes, p.dtype)


def _fitted_scale(p: jax.Array, v: jax.Array, chunk: int | None):
  """The scale of ``v`` nearest ``p`` in L2, ``<p, v> / <v, v>``, of the
  leaf or of each chunk (0 where ``v`` is), non-finite entries of ``p``
  counting 0."""
  v = v.astype(p.dtype)
  if chunk is None:
    dot, norm = jnp.sum(_finite(p) * v), jnp.sum(v * v)
  else:
    dot, norm = _chunk_sums(_finite(p) * v, chunk), _chunk_sums(v * v, chunk)
  return jnp.where(norm > 0, dot / jnp.where(norm > 0, norm, 1), 0)


def _per_entry(scale: jax.Array, p: jax.Array, chunk: int | None):
  """A leaf's scale (a scalar), or its chunks', for each entry of ``p``."""
  if chunk is None:
    return scale
  return jnp.repeat(scale, chunk)[:p.size].reshape(p.shape)


def mean_scale(scales: list[jax.Array], *, axis_name, num_workers: int,
               clip: float | None, present=None) -> list[jax.Array]:
  """The workers' mean of each of ``scales`` (one worker's, float32),
  the same on every worker: with ``clip``, of every worker's gathered
  scales, :func:`dlion_jax._sparse.clipped` in magnitude (a fitted scale
  may be negative), summed in the workers' order; without, a ``pmean``.
  ``present`` (or None): ``(ok, abstained)``, whether this worker takes
  part and how many do not; an absent worker's scales must be 0, and the
  mean is the present workers'."""
  ok, abstained = present or (None, 0)
  count = num_workers - abstained
  if not scales:
    return []
  if clip is None:
    if present is None:
      return _collectives.pmean(scales, axis_name)
    return _collectives.present_mean(scales, axis_name, count, num_workers)
  flat = jnp.concatenate([x.ravel() for x in scales])
  if ok is not None:
    flat = jnp.where(ok, flat, jnp.nan)
  rows = _sparse.gathered(flat, axis_name)
  # A signed scale (a fitted one) is clipped in magnitude.
  clipped = _sparse.clipped(jnp.abs(rows), clip, count)
  rows = jnp.where(rows < 0, -clipped, clipped)
  total = lax.fori_loop(1, num_workers, lambda j, t: t + rows[j], rows[0])
  total = total * _collectives.reciprocal_of_count(count, num_workers,
                                                   total.dtype)
  out, start = [], 0
  for x in scales:
    out.append(total[start:start + x.size].reshape(x.shape))
    start += x.size
  return out


def dense_mean(leaves, *, spec, axis_name, num_workers, aggregation, comm,
               scale_chunk=None, scale_clip=None, present=None,
               fit_scale=False):
  """:func:`dlion_jax.rounds.scale_by_voted_mean`'s dense ``U`` of each
  leaf, and what this worker said (``s_i q_i``). ``present``: ``(ok,
  abstained)``, or None (every worker votes); an abstainer's leaves are
  0. ``fit_scale``: ``U``'s scales are the workers' mean of
  :func:`_fitted_scale`, exchanged after the vote, not their mean
  ``|p|``."""
  scales = [_quantize.l1_scale(p) if scale_chunk is None
            else _chunk_scales(p, scale_chunk) for p in leaves]
  options = dict(axis_name=axis_name, num_workers=num_workers,
                 clip=scale_clip, present=present)
  if not fit_scale:
    mean_scales = mean_scale(scales, **options)
  votes = _exchange.aggregate(
      lambda p: p, leaves, axis_name=axis_name, num_workers=num_workers,
      spec=spec, aggregation=aggregation, comm=comm,
      abstained=None if present is None else present[1])
  if fit_scale:
    mean_scales = mean_scale([_fitted_scale(p, v, scale_chunk)
                              for p, v in zip(leaves, votes)], **options)
  means = [_per_entry(s, v, scale_chunk) * v.astype(s.dtype)
           for s, v in zip(mean_scales, votes)]
  said = [_per_entry(s, p, scale_chunk) * _own_values(p, spec)
          for s, p in zip(scales, leaves)]
  return means, said


def exact_mean(leaves, *, axis_name, num_workers, present=None):
  """No vote: the workers' fp32 mean of each leaf, as DiLoCo's
  (:func:`dlion_jax._blocks.workers_mean`; the present workers' where
  ``present`` is ``(ok, abstained)``), and what this worker said, its
  leaves as they are."""
  if present is None:
    return _blocks.workers_mean(leaves, axis_name), leaves
  return _blocks.workers_mean(leaves, axis_name, num_workers - present[1],
                              num_workers), leaves


def check_no_vote(options: dict) -> None:
  """``fp32_mean=True``'s checks: the vote's ``options`` (name -> (value,
  default)) at their defaults (it sends no vote)."""
  for name, (value, default) in options.items():
    if not isinstance(value, jax.core.Tracer) and value != default:
      raise ValueError(
          f"{name}={value!r} does not apply with fp32_mean=True, which "
          "sends each worker's fp32 values, all-reduced, and no vote: "
          f"leave {name} at {default!r}, or set fp32_mean=False.")


def fragment_vote(vote, leaves, fragments: int, k: jax.Array):
  """``vote`` on fragment ``k`` of each leaf (its flat entries ``k, k + M,
  ...``, zero-padded to whole rows of ``M``): the means and what was said,
  in the leaves' shapes, 0 off the fragment."""
  rows = [jnp.pad(p.ravel(), (0, -p.size % fragments)).reshape(
      -1, fragments) for p in leaves]
  picked = [lax.dynamic_index_in_dim(r, k, axis=1, keepdims=False)
            for r in rows]
  means, said = vote(picked)

  def spread(x, r, p):
    full = lax.dynamic_update_index_in_dim(
        jnp.zeros_like(r), x.astype(r.dtype), k, axis=1)
    return full.ravel()[:p.size].reshape(p.shape)
  return ([spread(u, r, p) for u, r, p in zip(means, rows, leaves)],
          [spread(s, r, p) for s, r, p in zip(said, rows, leaves)])
