"""Bytes over the slow links: a flat data-parallel mesh against hybrid ones.

A job of ``nodes`` machines with ``k`` devices each. Flat, every device is a
voter on one ``data`` axis that spans the slow links between the machines.
Hybrid, only the ``nodes`` devices that hold the same block of a leaf vote
over ``data``, on ``1/k`` of the params; inside a node, either
:func:`dlion_jax.parallel.make_train_step`'s ``shard_axis="fsdp"`` reduces
the gradients (each device differentiates its rows, one reduce-scatter a
leaf; params replicated, ZeRO-2, or sharded at rest, ZeRO-3), or the step
leaves ``fsdp`` to the compiler (no ``shard_axis``) with params and state
replicated, ZeRO-2 or ZeRO-3 (:func:`dlion_jax.devices.shard_params`).
This compiles the train CLI's GPT training step (forward, backward,
optimizer) on 8 simulated CPU devices for each layout and reads off the
compiled HLO what each device sends over each axis
(:func:`dlion_jax.collective_bytes_by_axis`), with the step's memory per
device (``memory_analysis()``), for Distributed Lion (MaVo,
``comm='auto'``) and for global Lion (fp32 gradients averaged, the
baseline). Nothing is run: the figures are exact bytes, not timings.

It compiles the step once per layout and optimizer, 22 times at the default
8 workers: 1 min 23 s on 2 CPU cores (Intel Xeon, a KVM guest; jax 0.10.2),
more on a loaded machine. A progress bar on stderr (tqdm, from the
``[examples]`` extra; else a line per step) counts the compilations.

Usage::

  python -m dlion_jax.bench.hybrid [--workers 8] [--plain] [--out FILE.md]

``--plain`` compiles Distributed Lion's step in plain ``jax.jit`` form
(:mod:`dlion_jax.workers`, given the params' placement) beside
``make_train_step``'s, with and without ``shard_axis="fsdp"``, on the flat
mesh and each placement of the params and state (the plain step compiled
again on what it hands back until that placement holds: 1 min 27 s on 2
CPU cores).
"""

from __future__ import annotations

import argparse

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import transforms
from dlion_jax.bench import aot_models
from dlion_jax.bench import reporting
import dlion_jax as dl

LEARNING_RATE = 1e-3
# How long the default run (--workers 8) took, measured once.
DURATION = ("1 min 23 s on 2 CPU cores (Intel Xeon, a KVM guest; jax 0.10.2), "
            "more on a loaded machine")


def optimizers() -> dict[str, optax.GradientTransformation]:
  return {
      "global lion (fp32 all-reduce)": optax.chain(
          transforms.pmean_gradients("data"), optax.lion(LEARNING_RATE)),
      "dlion mavo auto": dl.distributed_lion(LEARNING_RATE,
                                             axis_name="data"),
  }


# How a layout places the params and the optimizer state, and the step it
# runs: "flat" (one data axis); shard_axis="fsdp" with params replicated
# ("shard_axis", ZeRO-2) or sharded at rest ("shard_axis zero3"); or the
# step that leaves "fsdp" to the compiler, params and state replicated,
# ZeRO-2 (state sharded) or ZeRO-3 (both sharded), placed by
# devices.shard_params.
PLACEMENTS = ("flat", "shard_axis", "shard_axis zero3", "replicated",
              "zero2", "zero3")


def measure(tx, mesh, placement, step_form: str | None = None
            ) -> tuple[dict, dict, int]:
  """Bits per parameter each device sends a step, by axis; the compiled
  step's memory per device (MB); the param count. ``step_form``: None
  for the layout's own ``make_train_step``; ``"shard_axis"`` for
  ``make_train_step(shard_axis="fsdp")`` on it; ``"plain"`` for the step
  of :func:`dlion_jax.bench.plain_train_step`."""
  loss_fn, params, make_batch = aot_models.gpt_problem()
  count = sum(x.size for x in jax.tree.leaves(params))
  shard_axis = ("fsdp" if placement.startswith("shard_axis")
                or step_form == "shard_axis" else None)
  whole = devices.replicate(params, mesh)
  sharded = (devices.shard_params(params, mesh)
             if placement != "flat" and placement != "replicated" else whole)
  states = parallel.init_worker_states(tx, sharded, mesh)
  axes = "data" if placement == "flat" else ("data", "fsdp")
  batch = jax.device_put(make_batch(mesh.devices.size),
                         NamedSharding(mesh, P(axes)))
  step = parallel.make_train_step(loss_fn, tx, mesh, shard_axis=shard_axis)
  params = sharded if placement.endswith("zero3") else whole
  if step_form == "plain":
    step = bench.plain_train_step(
        loss_fn, tx, jax.tree.map(lambda x: x.sharding.spec, params))
  with jax.set_mesh(mesh):
    compiled = bench.steady_compiled(step, params, states, batch)
  sent = dl.collective_bytes_by_axis(compiled, mesh)
  memory = compiled.memory_analysis()
  mb = {"arguments": memory.argument_size_in_bytes / 1e6,
        "temporaries": memory.temp_size_in_bytes / 1e6}
  return {k: 8 * v / count for k, v in sent.items() if k != ()}, mb, count


def layouts(workers: int) -> list[tuple[str, int | None, str]]:
  """(name, nodes, placement) for the flat mesh and each split of
  workers into nodes."""
  out = [(f"flat, {workers} voters", None, "flat")]
  for nodes in (2, 4):
    if workers % nodes == 0 and nodes < workers:
      k = workers // nodes
      for placement in PLACEMENTS[1:]:
        out.append((f"{nodes} nodes x {k}, {placement}", nodes, placement))
  return out


def report(workers: int) -> str:
  """The table: one compiled step a row, each compilation a tick of
  :func:`dlion_jax.bench.progress` on stderr."""
  jobs = [(layout, nodes, placement, name, tx)
          for layout, nodes, placement in layouts(workers)
          for name, tx in optimizers().items()]
  rows = []
  for layout, nodes, placement, name, tx in bench.progress(
      jobs, len(jobs), "compiling"):
    if nodes is None:
      mesh = devices.data_mesh(workers)
    else:
      mesh = devices.hybrid_mesh(nodes, devices=jax.devices()[:workers])
    bits, mb, count = measure(tx, mesh, placement)
    rows.append([layout, name, f"{bits['data']:.3f}",
                 f"{bits.get('fsdp', 0.0):.3f}",
                 f"{bits.get(('data', 'fsdp'), 0.0):.4f}",
                 f"{mb['arguments']:.2f}", f"{mb['temporaries']:.1f}"])
  header = ["layout", "optimizer", "bits/param over data (slow)",
            "bits/param over fsdp (fast)", "over both",
            "arguments MB/device", "temporaries MB/device"]
  if all(float(row[4]) == 0 for row in rows):   # nothing crosses both
    header, rows = header[:4] + header[5:], [r[:4] + r[5:] for r in rows]
  table = reporting.markdown_table(header, rows)
  return (f"{bench.machine_line()}\n\nThe CLI's GPT ({count:,} params), "
          f"{workers} devices, each device's sends per step and the "
          f"compiled step's memory:\n\n{table}")


def plain_report(workers: int) -> str:
  """Distributed Lion's step in plain ``jax.jit`` form beside
  ``make_train_step``'s, with and without ``shard_axis``, on each
  placement of the params and state."""
  tx = optimizers()["dlion mavo auto"]
  jobs = [(layout, nodes, placement, form)
          for layout, nodes, placement in layouts(workers)
          if not placement.startswith("shard_axis")
          for form in ((None, "plain") if nodes is None
                       else (None, "shard_axis", "plain"))]
  names = {None: "make_train_step", "shard_axis":
           "make_train_step(shard_axis)", "plain": "plain jit"}
  rows = []
  for layout, nodes, placement, form in bench.progress(
      jobs, len(jobs), "compiling"):
    if nodes is None:
      mesh = devices.data_mesh(workers)
    else:
      mesh = devices.hybrid_mesh(nodes, devices=jax.devices()[:workers])
    bits, mb, count = measure(tx, mesh, placement, form)
    rows.append([layout, names[form],
                 f"{bits['data']:.3f}", f"{bits.get('fsdp', 0.0):.3f}",
                 f"{mb['arguments']:.2f}", f"{mb['temporaries']:.1f}"])
  header = ["layout", "step", "bits/param over data (slow)",
            "bits/param over fsdp (fast)", "arguments MB/device",
            "temporaries MB/device"]
  table = reporting.markdown_table(header, rows)
  return (f"{bench.machine_line()}\n\nThe CLI's GPT ({count:,} params), "
          f"{workers} devices, D-Lion (MaVo, comm='auto'): each device's "
          f"sends per step and the compiled step's memory, the plain jitted "
          f"step (dl.workers) beside make_train_step's:\n\n{table}")


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(
      prog="python -m dlion_jax.bench.hybrid",
      description=__doc__.split("\n")[0],
      epilog=f"Compiles the step {len(layouts(8)) * len(optimizers())} "
      f"times at --workers 8, once per layout and optimizer: {DURATION}. "
      "stderr shows each compilation as it ends.")
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--out", help="also write the report to this file")
  parser.add_argument(
      "--plain", action="store_true",
      help="D-Lion's plain jitted step (dl.workers) beside make_train_step "
      "on the layouts whose fsdp axis the compiler owns")
  args = parser.parse_args(argv)
  bench.require_examples(parser, "dlion_jax.train.models",
                         "the train CLI's GPT")
  devices.use_cpu_devices(args.workers)
  make = plain_report if args.plain else report
  return reporting.emit(make(args.workers), args.out)


if __name__ == "__main__":
  main()
