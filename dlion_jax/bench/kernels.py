"""Compute cost of packing and voting on one accelerator.

``python -m dlion_jax.bench.kernels [--workers 8] [--sizes 4e6 16e6]``

All N workers run on one device under ``jax.vmap(..., axis_name='data')``:
``all_to_all``/``all_gather``/``psum`` become on-device transposes and sums,
so the time is the *compute* of N workers' packing, voting and unpacking
(the network is not in it). Per worker it is compared with ``optax.lion``'s
elementwise update (the floor) and with ``optax.lion`` after a ``pmean`` of
fp32 gradients. Repetitions of all variants are interleaved and the medians
reported, so the ratios are measured side by side.

A second table splits each D-Lion step into its stages, each jitted on its
own with the previous stage's output as input, so that a regression shows
where it is: *encode* (``c = (1 - b1) g + b1 m`` to vote codes), *pack*
(codes to the message's words), *exchange* (the collectives and the
vote's tally, to digit planes), *decode* (planes to the update ``D``) and
*apply* (Lion's momentum and parameter update given ``D``). The whole
step fuses stages, so it takes less than their sum.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies
from dlion_jax.bench import reporting
import dlion_jax as dl

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
    for comm in message.COMMS:
      tx = dl.distributed_lion(1e-3, axis_name=AXIS, aggregation=agg,
                               comm=comm)
      out[f"dlion {agg} {comm}"] = (tx, lambda g: g)
  del num_workers
  return out


def _build(tx, gradients, params):
  def worker(g, state):
    updates, state = tx.update(gradients(g), state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(jax.vmap(worker, axis_name=AXIS))


def run(num_workers: int, size: int, repeats: int) -> list[tuple[str, float]]:
  key = jax.random.key(0)
  params = {"w": jnp.zeros((size,), jnp.float32)}
  grads = {"w": jax.random.normal(key, (num_workers, size), jnp.float32)}
  fns, states = {}, {}
  for name, (tx, gradients) in _variants(num_workers).items():
    states[name] = jax.vmap(lambda _: tx.init(params))(jnp.arange(num_workers))
    fns[name] = _build(tx, gradients, params)
    jax.block_until_ready(fns[name](grads, states[name]))   # compile, warm
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(grads, states[name]))
      times[name].append(time.perf_counter() - start)
  return [(name, statistics.median(t)) for name, t in times.items()]


STAGES = ("encode", "pack", "exchange", "decode", "apply")


def stage_functions(num_workers: int, size: int, aggregation: str,
                    comm: str) -> dict:
  """Stage name -> (a jitted function of N workers under ``vmap``, its
  inputs): one D-Lion MaVo/Avg step on a leaf of ``size`` cut where
  :mod:`dlion_jax.exchange` hands one stage's array to the next."""
  spec, b1, b2, lr = quantize.BINARY, 0.9, 0.99, 1e-3
  layout = message.MessageLayout((size,), num_workers, spec, aggregation,
                                 comm)
  strategy = strategies.STRATEGIES[comm]
  options = dict(axis_name=AXIS, num_workers=num_workers, spec=spec,
                 aggregation=aggregation)
  vote = exchange.VoteOptions(comm=comm, **options)
  vmapped = lambda fn: jax.jit(jax.vmap(fn, axis_name=AXIS))

  def encode(g, m):
    return quantize.encode((1 - b1) * g + b1 * m, spec)

  def pack(codes):
    words = layout.pack(codes)
    return jnp.pad(words, (0, layout.words - words.size))

  def exchanged(words):
    planes, _, _ = strategy.exchange(words, **options)
    first, count = layout.run_words[0]
    return planes(first, count)

  def decode(planes, words):
    _, decoder, _ = strategy.exchange(words, **options)   # collectives unused
    outcome = decoder(planes.reshape(-1))[:size]
    if aggregation == "mavo" and not strategy.returns_sign:
      outcome = jnp.sign(outcome)
    return exchange._finalize(   # pylint: disable=protected-access
        outcome, vote, jnp.float32)

  def apply(d, g, m, p):
    return p - lr * d, b2 * m + (1 - b2) * g

  key = jax.random.key(0)
  g, m, p = (jax.random.normal(k, (num_workers, size))
             for k in jax.random.split(key, 3))
  out = {}
  codes = vmapped(encode)(g, m)
  out["encode"] = (vmapped(encode), (g, m))
  words = vmapped(pack)(codes)
  out["pack"] = (vmapped(pack), (codes,))
  planes = vmapped(exchanged)(words)
  out["exchange"] = (vmapped(exchanged), (words,))
  d = vmapped(decode)(planes, words)
  out["decode"] = (vmapped(decode), (planes, words))
  out["apply"] = (vmapped(apply), (d, g, m, p))
  return out


def run_stages(num_workers: int, size: int, repeats: int) -> list[list]:
  """Per D-Lion variant, the median ms of each stage, their sum and the
  whole step's (from :func:`run`'s variants), interleaved."""
  fns = {}
  for aggregation in ("mavo", "avg"):
    for comm in message.COMMS:
      for stage, (fn, args) in stage_functions(num_workers, size,
                                               aggregation, comm).items():
        jax.block_until_ready(fn(*args))     # compile, warm
        fns[(aggregation, comm, stage)] = (fn, args)
  times = {k: [] for k in fns}
  for _ in range(repeats):
    for k, (fn, args) in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - start)
  med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
  return [[f"dlion {a} {c}"] + [f"{med[(a, c, st)]:.3f}" for st in STAGES]
          + [f"{sum(med[(a, c, st)] for st in STAGES):.3f}"]
          for a in ("mavo", "avg") for c in message.COMMS]


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
    print(f"\nThe same steps stage by stage (ms, all workers; each stage "
          f"jitted alone), median of {args.repeats}\n")
    print(reporting.markdown_table(
        ["variant", *STAGES, "sum of stages"],
        run_stages(args.workers, size, args.repeats)))
  print(f"\ntook {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
