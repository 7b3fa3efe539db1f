"""Wall time of one optimizer step: Distributed Lion against ``optax.lion``.

On ``N`` simulated CPU devices (8 by default), with a ~4M-parameter MLP-shaped
pytree, times a jitted ``shard_map`` step that takes per-worker gradients
(fixed random arrays, sharded over the workers), per-worker optimizer states
and replicated parameters, and returns the new parameters and states. Only the
optimizer runs: no model forward or backward pass.

Variants:

* ``dlion <aggregation> <comm>``: :func:`dlion_jax.distributed_lion`, which
  votes over the axis and needs no gradient all-reduce.
* ``global lion``: :func:`optax.lion` fed ``lax.pmean``-ed fp32 gradients, what
  data-parallel Lion needs (the baseline).
* ``local lion``: :func:`optax.lion` on each worker's own gradient, no
  exchange at all (the floor; workers drift apart, so not a usable optimizer).

Repetitions are interleaved (every variant once per round) and every step is
blocked on before the next starts (DESIGN.md section 5). Prints medians and
ratios as a markdown table.

Usage::

  python -m dlion_jax.bench.step [--workers 8] [--reps 15] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import accounting
from dlion_jax import bench
from dlion_jax import exchange
from dlion_jax import parallel

AXIS = "data"
LEARNING_RATE = 1e-4
# An MLP 784-2048-1024-256-10: about 3.97M parameters.
SHAPES = {
    "dense_0": {"kernel": (784, 2048), "bias": (2048,)},
    "dense_1": {"kernel": (2048, 1024), "bias": (1024,)},
    "dense_2": {"kernel": (1024, 256), "bias": (256,)},
    "head": {"kernel": (256, 10), "bias": (10,)},
}
BASELINE = "global lion"
FLOOR = "local lion"


def num_params() -> int:
  return sum(math.prod(s) for s in jax.tree.leaves(
      SHAPES, is_leaf=lambda x: isinstance(x, tuple)))


def random_tree(seed: int, lead: tuple[int, ...] = ()) -> dict:
  """float32 normal arrays of :data:`SHAPES` with a leading ``lead`` shape."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: rng.standard_normal(lead + s, dtype=np.float32), SHAPES,
      is_leaf=lambda x: isinstance(x, tuple))


def variants() -> dict[str, tuple[optax.GradientTransformation, bool]]:
  """name -> (optimizer, whether gradients are pmean-ed first)."""
  out = {}
  for aggregation in accounting.AGGREGATIONS:
    for comm in ("auto",) + accounting.COMMS:
      if aggregation == "avg" and comm != "auto":
        continue
      tx = dl.distributed_lion(LEARNING_RATE, axis_name=AXIS,
                               aggregation=aggregation, comm=comm)
      out[f"dlion {aggregation} {comm}"] = (tx, False)
  out[BASELINE] = (optax.lion(LEARNING_RATE), True)
  out[FLOOR] = (optax.lion(LEARNING_RATE), False)
  return out


def make_step(tx: optax.GradientTransformation, mesh, *,
              pmean_grads: bool) -> Callable:
  """Jitted ``step(params, states, grads) -> (params, states)``.

  ``params`` replicated (``P()``); ``states`` and ``grads`` carry a leading
  worker axis sharded over :data:`AXIS`. Parameters and states are donated.
  """

  def local(params, states, grads):
    state = jax.tree.map(lambda x: x[0], states)
    grads = jax.tree.map(lambda x: x[0], grads)
    if pmean_grads:
      grads = lax.pmean(grads, AXIS)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates),
            jax.tree.map(lambda x: x[None], state))

  # The floor's parameters differ per worker, so replication is not checked
  # (for any variant, to compile them all alike); out_specs=P() keeps worker
  # 0's copy.
  step = jax.shard_map(local, mesh=mesh,
                       in_specs=(P(), P(AXIS), P(AXIS)),
                       out_specs=(P(), P(AXIS)), check_vma=False)
  return jax.jit(step, donate_argnums=(0, 1))


class Runner:
  """One variant's compiled step and its current params and states."""

  def __init__(self, tx, mesh, *, pmean_grads: bool, params, grads):
    n = mesh.shape[AXIS]
    self.step = make_step(tx, mesh, pmean_grads=pmean_grads)
    self.params = parallel.replicate(params, mesh)
    self.states = parallel.init_worker_states(tx, self.params, mesh,
                                              axis_name=AXIS)
    self.grads = grads
    self.times = []
    del n

  def __call__(self) -> float:
    """Runs one step, blocked on; returns its wall time in seconds."""
    start = time.perf_counter()
    self.params, self.states = self.step(self.params, self.states,
                                         self.grads)
    jax.block_until_ready((self.params, self.states))
    return time.perf_counter() - start


def build(num_workers: int) -> dict[str, Runner]:
  """A compiled, warmed-up :class:`Runner` per variant."""
  mesh = parallel.data_mesh(num_workers, axis_name=AXIS)
  params = random_tree(0)
  grads = jax.device_put(random_tree(1, (num_workers,)),
                         NamedSharding(mesh, P(AXIS)))
  runners = {}
  for name, (tx, pmean_grads) in variants().items():
    runners[name] = Runner(tx, mesh, pmean_grads=pmean_grads, params=params,
                           grads=grads)
    runners[name]()   # compile
    runners[name]()   # warm
  return runners


def time_interleaved(runners: dict[str, Runner], reps: int) -> None:
  """``reps`` rounds, each stepping every variant once, in rotating order."""
  names = list(runners)
  for r in bench.progress(range(reps), reps, "timing"):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      runners[name].times.append(runners[name]())


def table(runners: dict[str, Runner], num_workers: int) -> str:
  """Markdown: variant, comm picked, wire bits, median ms, ratios."""
  med = {k: statistics.median(r.times) * 1e3 for k, r in runners.items()}
  rows = []
  for name, ms in med.items():
    spread = (f"{np.percentile(runners[name].times, 25) * 1e3:.1f}-"
              f"{np.percentile(runners[name].times, 75) * 1e3:.1f}")
    rows.append([name, _comm_bits(name, num_workers), f"{ms:.1f}", spread,
                 f"{ms / med[BASELINE]:.2f}x", f"{ms / med[FLOOR]:.2f}x"])
  return bench.markdown_table(
      ["variant", "wire bits/param", "median ms", "IQR ms",
       "vs global lion", "vs local lion (floor)"], rows)


def _comm_bits(name: str, n: int) -> str:
  if name == BASELINE:
    return f"{dl.allreduce_bits(n):.3g} (fp32 all-reduce)"
  if name == FLOOR:
    return "0"
  _, aggregation, comm = name.split()
  picked = exchange.resolve_comm(comm, n, aggregation=aggregation,
                                 vote="binary")
  bits = dl.wire_bits(n, aggregation=aggregation, comm=picked)
  return f"{bits:.3g} ({picked})" if comm == "auto" else f"{bits:.3g}"


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--reps", type=int, default=15)
  parser.add_argument("--out", default=None, help="also write markdown here")
  args = parser.parse_args(argv)
  bench.use_cpu_devices(args.workers)
  start = time.perf_counter()
  runners = build(args.workers)
  compiled = time.perf_counter()
  time_interleaved(runners, args.reps)
  text = "\n".join([
      f"Machine: {bench.machine_line()}; {args.workers} workers. "
      f"Parameters: {num_params():,} in {len(jax.tree.leaves(random_tree(0)))}"
      f" leaves. {args.reps} interleaved repetitions after 2 warm-up steps.",
      "",
      table(runners, args.workers),
      "",
      f"- Compile + warm-up {compiled - start:.1f} s, timing "
      f"{time.perf_counter() - compiled:.1f} s, total "
      f"{time.perf_counter() - start:.1f} s.",
  ])
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return text


if __name__ == "__main__":
  main()
