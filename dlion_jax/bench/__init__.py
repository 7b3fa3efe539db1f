"""Benchmark entry points: ``python -m dlion_jax.bench.<name>``.

* :mod:`dlion_jax.bench.wire`: bits each worker sends per parameter per step,
  read off compiled HLO, against :func:`dlion_jax.wire_bits`.
* :mod:`dlion_jax.bench.step`: wall time of one optimizer step on simulated
  CPU devices, Distributed Lion against ``optax.lion``.
* :mod:`dlion_jax.bench.kernels`: compute of packing and voting for N workers
  vmapped on one device (GPU kernel timings where a GPU is present).
* :mod:`dlion_jax.bench.compile`: trace, lowering and compile time of the
  optimizer step for 100 to 1000 leaves (and the CLI's GPT training step),
  against ``optax.lion``.
* ``benchmarks/project.py`` (a checkout's, not installed): step time at
  cluster scale, an alpha-beta model calibrated on the measured network
  rows, and break-even bandwidths.
* :mod:`dlion_jax.bench.aot`: the training step compiled ahead of time for
  TPU topologies of several slices (libtpu, no TPU): bytes a chip sends over
  ICI and DCN, HBM per chip, compile time and the overlap of the DCN
  exchange with compute in the TPU schedule.

Every report is written by :mod:`dlion_jax.bench.reporting`.

Results and the commands that produced them are in ``docs/benchmarks.md``.
This module holds the few helpers they share with the studies and maintainer
runs of a checkout's ``benchmarks/`` (not installed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterable

import jax

from dlion_jax import _deprecations
from dlion_jax import _platforms

# The commands python -m dlion_jax.bench.* start here, before JAX does.
_platforms.quiet_tpu_probe()

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)


def require_examples(parser: argparse.ArgumentParser, module: str,
                     what: str) -> None:
  """Exits through ``parser.error`` (status 2) when ``module``, which
  ``what`` needs and the ``[examples]`` extra installs, does not import;
  call it before any work."""
  try:
    importlib.import_module(module)
  except ImportError as e:
    parser.error(f"{what} needs the [examples] extra, which is not installed "
                 f'({e}): pip install "dlion_jax[examples]"')


def progress(items: Iterable, total: int, desc: str):
  """``tqdm`` progress over ``items`` when tqdm is installed, else prints."""
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return _plain_progress(items, total, desc)
  return tqdm(items, total=total, desc=desc, file=sys.stderr)


def _plain_progress(items, total, desc):
  step = max(1, total // 10)
  for i, item in enumerate(items):
    if i % step == 0:
      print(f"{desc}: {i}/{total}", file=sys.stderr, flush=True)
    yield item
  print(f"{desc}: {total}/{total}", file=sys.stderr, flush=True)


def machine_line() -> str:
  """One line naming the jax version, backend and device count."""
  return (f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.device_count()} devices ({jax.devices()[0].device_kind})")


def plain_train_step(loss_fn, tx, placement=None):
  """A train step in plain ``jax.jit`` form (:mod:`dlion_jax.workers`):
  each worker's gradients of its rows under ``jax.vmap(...,
  spmd_axis_name="data")``, the update vmapped the same way; ``(params,
  state, batch) -> (params, state, loss)`` as ``make_train_step``'s.
  ``placement``: the params' specs, for Auto axes (see
  :func:`dlion_jax.workers.update`). Trace it under
  ``jax.set_mesh(mesh)``."""
  import optax  # pylint: disable=g-import-not-at-top
  from dlion_jax import workers  # pylint: disable=g-import-not-at-top

  def step(params, state, batch):
    loss, grads = workers.value_and_grad(loss_fn, placement=placement)(
        params, batch)
    updates, state = workers.update(tx, placement=placement)(grads, state,
                                                             params)
    return optax.apply_updates(params, updates), state, loss.mean()
  return jax.jit(step)


def steady_compiled(step, params, state, batch, *, limit: int = 3,
                    compiled=None):
  """``step`` compiled for the params and state it hands back: a plain
  step's outputs lie where the compiler put them (on Auto axes it may
  shard replicated params like the vote's blocks), and the next step runs
  on those, compiled again; ``make_train_step``'s come back as they came,
  so its first compile is its steady one. Compiles at most ``limit``
  times, each on abstract arrays placed as the one before returned;
  ``compiled``, the first compile where the caller has it already."""
  if compiled is None:
    compiled = step.lower(params, state, batch).compile()
  for _ in range(limit - 1):
    out_params, out_state = compiled.output_shardings[:2]
    moved = [a for a, b in zip(
        jax.tree.leaves((params, state)),
        jax.tree.leaves((out_params, out_state)))
             if not a.sharding.is_equivalent_to(b, a.ndim)]
    if not moved:
      return compiled
    params, state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        (params, state), (out_params, out_state))
    compiled = step.lower(params, state, batch).compile()
  return compiled
