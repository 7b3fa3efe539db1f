"""Compute cost of packing and voting on one accelerator.

``python -m dlion_jax.bench.kernels [--workers 8] [--sizes 4e6 16e6]``

All N workers run on one device under ``jax.vmap(..., axis_name='data')``:
``all_to_all``/``all_gather``/``psum`` become on-device transposes and sums,
so the time is the *compute* of N workers' packing, voting and unpacking
(the network is not in it). Per worker it is compared with ``optax.lion``'s
elementwise update (the floor) and with ``optax.lion`` after a ``pmean`` of
fp32 gradients. Repetitions of all variants are interleaved and the medians
reported, so the ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import dlion_jax as dl
from dlion_jax.bench import reporting

AXIS = "data"


def _variants(num_workers):
  def lion_floor():
    tx = optax.lion(1e-3)
    return tx, lambda g: g

  def lion_pmean():
    tx = optax.lion(1e-3)
    return tx, lambda g: jax.lax.pmean(g, AXIS)

  out = {"optax.lion (no exchange)": lion_floor(),
         "optax.lion + fp32 pmean": lion_pmean()}
  for agg in ("mavo", "avg"):
    for comm in dl.accounting.COMMS:
      tx = dl.distributed_lion(1e-3, axis_name=AXIS, aggregation=agg,
                               comm=comm)
      out[f"dlion {agg} {comm}"] = (tx, lambda g: g)
  del num_workers
  return out


def _build(tx, exchange, params):
  def worker(g, state):
    updates, state = tx.update(exchange(g), state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(jax.vmap(worker, axis_name=AXIS))


def run(num_workers: int, size: int, repeats: int) -> list[tuple[str, float]]:
  key = jax.random.key(0)
  params = {"w": jnp.zeros((size,), jnp.float32)}
  grads = {"w": jax.random.normal(key, (num_workers, size), jnp.float32)}
  fns, states = {}, {}
  for name, (tx, exchange) in _variants(num_workers).items():
    states[name] = jax.vmap(lambda _: tx.init(params))(jnp.arange(num_workers))
    fns[name] = _build(tx, exchange, params)
    jax.block_until_ready(fns[name](grads, states[name]))   # compile, warm
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(grads, states[name]))
      times[name].append(time.perf_counter() - start)
  return [(name, statistics.median(t)) for name, t in times.items()]


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m dlion_jax.bench.kernels",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--sizes", type=float, nargs="+", default=[4e6, 16e6])
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, {args.workers} workers vmapped on it")
  for size in map(int, args.sizes):
    rows = run(args.workers, size, args.repeats)
    floor = dict(rows)["optax.lion (no exchange)"]
    print(f"\n{size:,} parameters per worker, median of {args.repeats}\n")
    print(reporting.markdown_table(
        ["variant", "ms (all workers)", "x floor"],
        [(name, f"{t * 1e3:.3f}", f"{t / floor:.2f}") for name, t in rows]))
  print(f"\ntook {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
