"""Bytes over the slow links: a flat data-parallel mesh against hybrid ones.

A job of ``nodes`` machines with ``k`` devices each. Flat, every device is a
voter on one ``data`` axis that spans the slow links between the machines.
Hybrid (:func:`dlion_jax.parallel.make_train_step` with ``shard_axis``),
each node's gradients are reduced exactly over its fast ``fsdp`` axis and
only the ``nodes`` devices that hold the same shard vote over ``data``, on
``1/k`` of the params. This compiles the train CLI's GPT training step
(forward, backward, optimizer) on 8 simulated CPU devices for each layout
and reads off the compiled HLO what each device sends over each axis
(:func:`dlion_jax.collective_bytes_by_axis`), for Distributed Lion (MaVo,
``comm='auto'``) and for global Lion (fp32 gradients averaged, the
baseline). Nothing is run: the figures are exact bytes, not timings.

Usage::

  python -m dlion_jax.bench.hybrid [--workers 8] [--out FILE.md]
"""

from __future__ import annotations

import argparse

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import bench
from dlion_jax import parallel
from dlion_jax.bench import compile as compile_bench
from dlion_jax.bench import reporting

LEARNING_RATE = 1e-3


def optimizers() -> dict[str, optax.GradientTransformation]:
  return {
      "global lion (fp32 all-reduce)": optax.chain(
          parallel.pmean_gradients("data"), optax.lion(LEARNING_RATE)),
      "dlion mavo auto": dl.distributed_lion(LEARNING_RATE,
                                             axis_name="data"),
  }


def bits_by_axis(tx, mesh, shard_axis) -> tuple[dict, int]:
  """Bits per parameter each device sends a step, by axis; param count."""
  loss_fn, params, make_batch = compile_bench.gpt_problem()
  count = sum(x.size for x in jax.tree.leaves(params))
  params = parallel.replicate(params, mesh)
  states = parallel.init_worker_states(tx, params, mesh,
                                       shard_axis=shard_axis)
  axes = "data" if shard_axis is None else ("data", shard_axis)
  batch = jax.device_put(make_batch(mesh.devices.size),
                         NamedSharding(mesh, P(axes)))
  step = parallel.make_train_step(loss_fn, tx, mesh, shard_axis=shard_axis)
  compiled = step.lower(params, states, batch).compile()
  sent = dl.collective_bytes_by_axis(compiled, mesh)
  return {k: 8 * v / count for k, v in sent.items() if k != ()}, count


def layouts(workers: int) -> list[tuple[str, int | None]]:
  """(name, nodes) for the flat mesh and each hybrid split of workers."""
  out = [(f"flat, {workers} voters", None)]
  for nodes in (2, 4):
    if workers % nodes == 0 and nodes < workers:
      out.append((f"{nodes} nodes x {workers // nodes}", nodes))
  return out


def report(workers: int) -> str:
  rows = []
  for layout, nodes in layouts(workers):
    for name, tx in optimizers().items():
      if nodes is None:
        mesh, shard_axis = parallel.data_mesh(workers), None
      else:
        mesh = parallel.hybrid_mesh(nodes, devices=jax.devices()[:workers])
        shard_axis = "fsdp"
      bits, count = bits_by_axis(tx, mesh, shard_axis)
      rows.append([layout, name, f"{bits['data']:.3f}",
                   f"{bits.get('fsdp', 0.0):.3f}",
                   f"{bits.get(('data', 'fsdp'), 0.0):.4f}"])
  table = reporting.markdown_table(
      ["layout", "optimizer", "bits/param over data (slow)",
       "bits/param over fsdp (fast)", "over both (the loss)"], rows)
  return (f"{bench.machine_line()}\n\nThe CLI's GPT ({count:,} params), "
          f"{workers} devices, each device's sends per step:\n\n{table}")


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m dlion_jax.bench.hybrid",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--out", help="also write the report to this file")
  args = parser.parse_args(argv)
  bench.require_examples(parser, "dlion_jax.train.models",
                         "the train CLI's GPT")
  bench.use_cpu_devices(args.workers)
  return reporting.emit(report(args.workers), args.out)


if __name__ == "__main__":
  main()
