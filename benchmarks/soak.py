"""Soak: many Distributed Lion steps; replicas must stay bit-identical and
memory flat.

``N`` simulated CPU workers (8 by default) run a jitted ``shard_map`` step
laid out as in :func:`dlion_jax.parallel.make_train_step`: parameters
replicated (``P()``, each device keeps its own copy), per-worker optimizer
states, every worker's own random gradient drawn on device from
``fold_in(key, step, worker)``. The pytree has random leaf sizes (seeded,
empty and one-element leaves included, float32 and bfloat16 mixed).

Every ``--check-every`` steps and at the end, each device's copy of every
parameter is read back and compared bit for bit with device 0's; any
difference stops the soak with an error naming the step and the leaf. The
resident set size (``VmRSS`` in ``/proc/self/status``) is sampled at the same
points. Every step is blocked on before the next: steps queued on simulated
CPU devices can deadlock their collectives (README, "Things to know").

Usage::

  python -m benchmarks.soak --steps 10000 [--workers 8] [--seed 0]
      [--leaves 24] [--max-leaf-size 65536] [--check-every 500]
      [--aggregation mavo] [--vote binary] [--comm auto] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax.bench import reporting
from dlion_jax.bench import step as step_bench

AXIS = step_bench.AXIS
LEARNING_RATE = 1e-3


class DriftError(AssertionError):
  """Two workers' copies of a parameter differ."""


@dataclasses.dataclass
class SoakResult:
  """What a soak measured (RSS in MiB, sampled at every check)."""
  steps: int
  workers: int
  num_params: int
  num_leaves: int
  checks: int
  elapsed_s: float
  rss_mib: list[tuple[int, float]]

  @property
  def rss_first(self) -> float:
    return self.rss_mib[0][1]

  @property
  def rss_last(self) -> float:
    return self.rss_mib[-1][1]

  @property
  def rss_max(self) -> float:
    return max(r for _, r in self.rss_mib)

  def text(self) -> str:
    return (f"soak: {self.steps} steps on {self.workers} workers, "
            f"{self.num_params:,} parameters in {self.num_leaves} leaves; "
            f"replicas bit-identical at all {self.checks} checks; "
            f"RSS first {self.rss_first:.1f} MiB, last {self.rss_last:.1f} "
            f"MiB, max {self.rss_max:.1f} MiB; {self.elapsed_s:.1f} s")


def rss_mib() -> float:
  """This process's resident set size in MiB (``VmRSS``; 0 if unknown)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return 0.0


def random_spec(seed: int, num_leaves: int, max_size: int) -> dict:
  """Leaf name -> (shape, dtype): sizes log-uniform, with 0 and 1 forced."""
  rng = np.random.default_rng(seed)
  spec = {}
  for i in range(num_leaves):
    if i == 0:
      size = 0
    elif i == 1:
      size = 1
    else:
      size = int(np.exp(rng.uniform(0, np.log(max_size))))
    shape = (size,) if rng.random() < 0.5 or size < 4 else (2, size // 2)
    dtype = ml_dtypes.bfloat16 if rng.random() < 0.3 else np.float32
    spec[f"leaf_{i:02d}"] = (shape, np.dtype(dtype))
  return spec


def make_step(tx, spec: dict, mesh, seed: int):
  """A jitted step ``(params, states, step) -> (params, states)``."""
  key = jax.random.key(seed)

  def draw(step):
    k = jax.random.fold_in(jax.random.fold_in(key, step),
                           lax.axis_index(AXIS))
    keys = jax.random.split(k, len(spec))
    return {name: jax.random.normal(kk, shape, jnp.float32).astype(dtype)
            for kk, (name, (shape, dtype)) in zip(keys, sorted(spec.items()))}

  return step_bench.make_step(tx, mesh, grads_fn=draw, grads_in="replicated")


def check_replicas(params: Any, step: int) -> None:
  """Raises :class:`DriftError` unless every device's copy is identical."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    copies = [np.asarray(s.data) for s in leaf.addressable_shards]
    for device, copy in enumerate(copies[1:], start=1):
      if not np.array_equal(copy.view(np.uint8), copies[0].view(np.uint8)):
        raise DriftError(
            f"step {step}: worker {device}'s copy of "
            f"{jax.tree_util.keystr(path)} differs from worker 0's.")


def soak(steps: int, *, workers: int = 8, seed: int = 0, leaves: int = 24,
         max_leaf_size: int = 65536, check_every: int = 500,
         progress: bool = True, **options) -> SoakResult:
  """Runs the soak; ``options`` go to :func:`dlion_jax.distributed_lion`.

  Raises:
    DriftError: replicas differ at a check.
  """
  mesh = devices.data_mesh(workers, axis_name=AXIS)
  spec = random_spec(seed, leaves, max_leaf_size)
  rng = np.random.default_rng(seed + 1)
  params = {k: rng.normal(size=s).astype(d) for k, (s, d) in spec.items()}
  tx = dl.distributed_lion(LEARNING_RATE, weight_decay=1e-2, axis_name=AXIS,
                           **options)
  params = devices.replicate(params, mesh)
  states = parallel.init_worker_states(tx, params, mesh, axis_name=AXIS)
  step_fn = make_step(tx, spec, mesh, seed)
  replicated = NamedSharding(mesh, P())
  rss, checks = [], 0
  tic = time.perf_counter()
  items = range(1, steps + 1)
  for step in (bench.progress(items, steps, "soak") if progress else items):
    params, states = step_fn(params, states,
                             jax.device_put(np.int32(step), replicated))
    jax.block_until_ready(params)   # no queued collectives (README)
    if step % check_every == 0 or step == steps:
      check_replicas(params, step)
      checks += 1
      rss.append((step, rss_mib()))
  return SoakResult(steps=steps, workers=workers,
                    num_params=sum(int(np.prod(s)) for s, _ in spec.values()),
                    num_leaves=len(spec), checks=checks,
                    elapsed_s=time.perf_counter() - tic, rss_mib=rss)


def main(argv=None) -> SoakResult:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10_000)
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--leaves", type=int, default=24)
  parser.add_argument("--max-leaf-size", type=int, default=65536)
  parser.add_argument("--check-every", type=int, default=500)
  parser.add_argument("--aggregation", default="mavo")
  parser.add_argument("--vote", default="binary")
  parser.add_argument("--comm", default="auto")
  parser.add_argument("--json", default=None, help="also write figures here")
  args = parser.parse_args(argv)
  for name in ("steps", "workers", "leaves", "max_leaf_size", "check_every"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got "
                   f"{getattr(args, name)}.")
  devices.use_cpu_devices(args.workers)
  result = soak(args.steps, workers=args.workers, seed=args.seed,
                leaves=args.leaves, max_leaf_size=args.max_leaf_size,
                check_every=args.check_every, aggregation=args.aggregation,
                vote=args.vote, comm=args.comm)
  print(bench.machine_line())
  print(result.text())
  reporting.write_json(args.json, {
      **dataclasses.asdict(result), "rss_first": result.rss_first,
      "rss_last": result.rss_last, "rss_max": result.rss_max}, indent=2)
  return result


if __name__ == "__main__":
  main()
