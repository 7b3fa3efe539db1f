"""How many bits each worker puts on the wire per parameter: the cost model.

:func:`wire_bits` gives the figure a configuration costs per parameter per
step, by the ring conventions of :mod:`dlion_jax.hlo`, whose
:func:`~dlion_jax.hlo.collective_bytes` reads what a compiled function
really sends, so the two can be checked against each other. The exact
bytes of one model's message are :class:`dlion_jax.message.MessageLayout`'s.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from dlion_jax import _checks
from dlion_jax import _deprecations
from dlion_jax import _message
from dlion_jax import _quantize
from dlion_jax import _sparse
from dlion_jax import sync

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)

def cheapest_comm(num_workers: int, *, aggregation: str = "mavo",
                  vote: str = "binary", quantizer: str = "sign",
                  bits: int | None = None,
                  leaf_sizes: Sequence[int] | None = None,
                  abstain_nonfinite: bool = False) -> str:
  """The strategy ``comm='auto'`` takes: the one a worker sends the fewest
  bytes with, ties to the one with fewer collectives.

  Without ``leaf_sizes`` by the bits a parameter of :func:`wire_bits` (a
  large model); with a model's leaf sizes by its exact message, padding
  included (on a small model padding can outweigh the asymptotic figure).
  ``abstain_nonfinite`` as the transform's option: ``'auto'`` weighs the
  step no worker abstains from, whose message is the default's (see
  :func:`wire_bits`), so the pick is the same.

  Example:
    >>> from dlion_jax import accounting
    >>> accounting.cheapest_comm(8), accounting.cheapest_comm(
    ...     8, aggregation="avg")
    ('alltoall', 'alltoall')
  """
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  _checks.check_choice("aggregation", aggregation, _message.AGGREGATIONS)
  n = _check_workers(num_workers, spec)
  _abstains(abstain_nonfinite)
  return _message.choose_comm(n, aggregation=aggregation, spec=spec,
                              leaf_sizes=leaf_sizes)


def _abstains(value) -> bool:
  return _checks.flag("abstain_nonfinite", value,
                      "whether a worker with a non-finite gradient abstains")


def _fraction(name: str, value, what: str) -> float:
  """``value`` as a float in [0, 1] (never a bool)."""
  if (not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_))
      or not 0 <= value <= 1):
    raise ValueError(
        f"{name} must be in [0, 1] ({what}), got {name}={value!r}.")
  return float(value)


def max_workers(*, quantizer: str = "sign", bits: int | None = None) -> int:
  """Largest N the vote exchange supports: ``(2**31 - 1) // (2 L)``.

  ``L`` is the largest level of a vote (1 for sign votes). Every strategy
  decodes the votes into int32 values up to ``2 N L`` (counts of codes, or
  sums of levels in ``[-N L, N L]`` offset by ``N L``), so ``2 N L`` must
  fit an int32; the packed ``psum`` counters, of radix at most
  ``2 N L + 1``, then fit their uint32 word too. That is about 1.07e9
  workers for sign votes, 8.45e6 for 255 levels (``bits=8``).

  Example:
    >>> from dlion_jax import accounting
    >>> accounting.max_workers(), accounting.max_workers(
    ...     quantizer="pbit_l1", bits=8)                  # 255 levels
    (1073741823, 8454660)
  """
  return _max_workers(_quantize.vote_spec(quantizer, bits=bits))


def _max_workers(spec: _quantize.VoteSpec) -> int:
  return (2**31 - 1) // (2 * spec.max_level)


def _check_workers(num_workers, spec: _quantize.VoteSpec) -> int:
  n = _checks.positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
  if n > _max_workers(spec):
    raise ValueError(
        f"num_workers={n} is more than the vote exchange supports: at most "
        f"{_max_workers(spec)} workers for {spec.radix}-level votes "
        "(2 N L, twice the largest sum of levels, must fit an int32; see "
        "dlion_jax.accounting.max_workers). Use fewer workers or fewer "
        "levels.")
  return n


def momentum_sync_bits(num_workers: int, momentum_sync, *,
                       steps: int | None = None, mu_dtype=jnp.float32,
                       synced_fraction: float = 1.0) -> float:
  """Bits per parameter per step that momentum syncs add, on average.

  Each sync is a ring all-reduce of the synced momenta in ``mu_dtype``;
  ``synced_fraction`` (in [0, 1]) is the share of parameters its mask
  selects. A period ``k`` costs ``1/k`` of that per step; other schedules
  are averaged over the first ``steps`` updates (a positive int).
  """
  n = _checks.positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
  schedule = sync.as_schedule(momentum_sync)
  if steps is not None:
    steps = _checks.positive_int(
        "steps", steps, "the number of updates to average the sync cost "
        "over, e.g. the length of the run")
  synced_fraction = _fraction("synced_fraction", synced_fraction,
                              "the share of parameters the sync mask selects")
  if schedule is None or n == 1:
    return 0.0
  if schedule.period is not None and steps is None:
    rate = 1 / schedule.period
  elif steps is None:
    raise ValueError(
        f"momentum_sync={schedule.name} syncs less and less often: pass "
        "steps=, the number of updates to average its cost over.")
  else:
    rate = schedule.count(steps) / steps
  return allreduce_bits(n, mu_dtype) * synced_fraction * rate


def wire_bits(num_workers: int, *,
              aggregation: _message.Aggregation = "mavo",
              vote: _quantize.Vote = "binary",
              comm: _message.CommChoice = "auto",
              quantizer: _quantize.Quantizer = "sign",
              bits: int | None = None,
              momentum_sync=None, steps: int | None = None,
              mu_dtype=jnp.float32, synced_fraction: float = 1.0,
              leaf_sizes: Sequence[int] | None = None,
              abstain_nonfinite: bool = False) -> float:
  """Bits each worker sends per parameter per step.

  Without ``leaf_sizes`` the figure of a large model (padding to whole
  words and equal shards ignored); with a model's leaf sizes its exact
  message, padding included, what :func:`dlion_jax.collective_bytes`
  reads off its compiled step's vote.

  Args:
    num_workers: size of the data-parallel axis, N: an int from 1 to
      :func:`max_workers` (about 1.07e9 for sign votes).
    aggregation: ``'mavo'`` or ``'avg'``.
    vote: ``'binary'`` or ``'ternary'`` (for ``quantizer='sign'``).
    comm: a strategy (``'alltoall'``, ``'allgather'``, ``'psum'``,
      ``'psum_int8'``), or ``'auto'`` for the cheapest
      (:func:`cheapest_comm`).
    quantizer: ``'sign'``, ``'ternary_l1'`` or ``'pbit_l1'`` (see
      :func:`dlion_jax.scale_by_distributed_lion`).
    bits: bits per vote for ``quantizer='pbit_l1'``.
    momentum_sync: ``None``, a period ``k`` or a
      :class:`dlion_jax.sync.SyncSchedule`; adds the amortized cost of
      all-reducing the momenta (:func:`momentum_sync_bits`).
    steps: updates to average a non-periodic sync schedule over (a
      positive int).
    mu_dtype: dtype of the synced momenta.
    synced_fraction: share of the parameters the sync mask selects, in
      [0, 1].
    leaf_sizes: the number of entries of each leaf of the model, for its
      exact figure (``comm='auto'`` then takes the strategy that sends the
      fewest bytes for these sizes, as the transform does).
    abstain_nonfinite: as the transform's option: a step no worker
      abstains from, the default's message and the abstainers' count (an
      int32 all-reduce, counted with ``leaf_sizes``). Two kinds of step
      send more, in conditionals: a binary MaVo over ``alltoall`` at odd
      N sends radix-3 results where an odd number abstained, and a step
      one worker alone votes in sends the flags of its zeros (binary
      codes; its ternary signs where the levels are L1-scaled or
      ``psum_int8``'s) beside the vote
      (:func:`dlion_jax.collective_bytes` counts each conditional's
      largest branch; with ``conditional=False`` it reads this figure).

  Returns:
    Bits per parameter per step, e.g. ``2.275`` for binary MaVo through
    ``alltoall`` at N = 8, against 56 for an fp32 ring all-reduce.

  Example:
    >>> import dlion_jax as dl
    >>> dl.wire_bits(8)
    2.275
    >>> dl.wire_bits(8, comm="psum_int8")
    14.0
    >>> round(dl.wire_bits(8, quantizer="pbit_l1", bits=4), 3)   # 15 levels
    4.9
    >>> dl.wire_bits(8, momentum_sync=56)       # + fp32 momentum every 56
    3.275
    >>> round(dl.wire_bits(8, leaf_sizes=[64]), 3)   # one 64-entry leaf
    6.125
  """
  _checks.check_choice("aggregation", aggregation, _message.AGGREGATIONS)
  _checks.check_choice("comm", comm, _message.COMMS + ("auto",))
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  n = _check_workers(num_workers, spec)
  sync_bits = momentum_sync_bits(n, momentum_sync, steps=steps,
                                 mu_dtype=mu_dtype,
                                 synced_fraction=synced_fraction)
  if n == 1:
    return 0.0
  abstains = _abstains(abstain_nonfinite)
  if comm == "auto":
    comm = _message.choose_comm(n, aggregation=aggregation, spec=spec,
                                leaf_sizes=leaf_sizes)
  if leaf_sizes is not None:
    size = sum(leaf_sizes)
    count = 2 * (n - 1) / n * 4 if abstains else 0.0   # the int32 psum
    sent = count + _message.message_bytes(
        leaf_sizes, n, aggregation=aggregation, spec=spec, comm=comm)
    return (8 * sent / size if size else 0.0) + sync_bits
  return (_message.vote_bits(n, aggregation=aggregation, spec=spec, comm=comm)
          + sync_bits)


def sparse_vote_bits(num_workers: int, *, sparse_chunk: int = 128,
                     sparse_keep: int = 1, sparse_value_bits: int = 1,
                     scale_chunk: int | None = None) -> float:
  """Bits each worker receives per parameter in one sparse vote
  (:func:`dlion_jax.rounds.scale_by_voted_mean` with ``sparse_chunk``):
  the words of the ``N - 1`` others, one a kept entry (8 bits where its
  position and ``sparse_value_bits`` fit, else 16), and with
  ``scale_chunk`` their float32 scales (one a scale chunk, two with 2-bit
  values); a leaf's scales aside. Divide by ``H`` for an outer step every
  ``H`` steps.

  Example:
    >>> import dlion_jax as dl
    >>> dl.sparse_vote_bits(8)               # 7 x 8 bits / 128
    0.4375
    >>> dl.sparse_vote_bits(8) / 32          # a round of 32 steps
    0.013671875
  """
  n = _checks.positive_int("num_workers", num_workers)
  return (n - 1) * _sparse.sparsity(
      sparse_chunk, sparse_keep, sparse_value_bits,
      scale_chunk).bits_per_entry()


def allreduce_bits(num_workers: int, dtype=jnp.float32) -> float:
  """Bits per parameter a ring all-reduce of ``dtype`` gradients sends."""
  n = _checks.positive_int("num_workers", num_workers,
                    "the size of the data-parallel axis")
  return 2 * (n - 1) / n * jnp.dtype(dtype).itemsize * 8
