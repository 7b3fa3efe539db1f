"""Compile time of one optimizer step, however many leaves the model has.

A model without ``scan`` has a leaf per weight: a 48-layer transformer
about 600. Every new shape, restart and sweep point pays the optimizer
step's trace, lowering and compilation again, so they should cost no more
than ``optax.lion``'s. On ``N`` simulated CPU devices (8 by default), for
pytrees of 100, 400 and 1000 float32 leaves of seeded random sizes 1-3000,
this times the jitted ``shard_map`` step of :mod:`dlion_jax.bench.step`
(per-worker gradients and states, replicated params) for:

* ``global lion``: :func:`optax.lion` on ``lax.pmean``-ed fp32 gradients,
  the baseline;
* ``dlion mavo auto`` and ``dlion avg auto``:
  :func:`dlion_jax.distributed_lion`.

``--plain`` also times the two D-Lion steps written as a plain
``jax.jit`` step (:mod:`dlion_jax.workers`).

``--gpt`` also times the whole training step users wait for before their
first step: :func:`dlion_jax.parallel.make_train_step` of the train CLI's
``charlm_gpt`` model (a 4-layer byte-level GPT, forward and backward
included), D-Lion against global Lion (``pmean_gradients`` then
``optax.lion``); it needs the ``[examples]`` extra (flax).

Each variant is traced and lowered (``jit(...).lower``), then compiled
(``.compile()``), in a fresh ``jit`` so that nothing is cached (nor read
from a persistent compilation cache: ``uncached()``), ``--reps``
times (the fastest trace+lower and the fastest compilation are kept); the
variants of one size take turns, so that the ratios compare times taken
under the same load. Also reports the compiled HLO's size (lines, less
the tables of Python stack frames it begins with: ``program_lines``)
and the bytes each worker sends per step, read off it.

Usage::

  python -m dlion_jax.bench.compile [--leaves 100 400 1000] [--reps 2]
      [--gpt] [--workers 8] [--plain] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import transforms
from dlion_jax.bench import aot_models
from dlion_jax.bench import reporting
from dlion_jax.bench import step as step_bench
import dlion_jax as dl

AXIS = step_bench.AXIS
BASELINE = step_bench.BASELINE
LEAF_SIZES = (1, 3000)


@dataclasses.dataclass
class Timing:
  leaves: int
  name: str
  trace_lower_s: float
  compile_s: float
  hlo_lines: int
  sent_bytes: float


def leaf_sizes(num_leaves: int, seed: int = 0) -> list[int]:
  rng = np.random.default_rng(seed)
  low, high = LEAF_SIZES
  return [int(s) for s in rng.integers(low, high + 1, num_leaves)]


def variants(plain: bool = False
             ) -> dict[str, tuple[optax.GradientTransformation, bool]]:
  """name -> (optimizer, whether gradients are pmean-ed first); with
  ``plain`` each D-Lion variant in a plain jitted step too."""
  lr = step_bench.LEARNING_RATE
  out = {
      BASELINE: (optax.lion(lr), True),
      "dlion mavo auto": (dl.distributed_lion(lr, axis_name=AXIS), False),
      "dlion avg auto": (dl.distributed_lion(lr, axis_name=AXIS,
                                             aggregation="avg"), False),
  }
  if plain:
    out.update({name + step_bench.PLAIN: variant
                for name, variant in out.items() if name != BASELINE})
  return out


def time_one(name, tx, pmean_grads, mesh, sizes) -> Timing:
  """Traces, lowers and compiles one variant's step from scratch (a name
  ending in :data:`dlion_jax.bench.step.PLAIN`: its plain jitted step)."""
  params = {f"leaf_{i:04d}": jnp.zeros(s) for i, s in enumerate(sizes)}
  params = devices.replicate(params, mesh)
  states = parallel.init_worker_states(tx, params, mesh, axis_name=AXIS)
  n = mesh.shape[AXIS]
  grads = jax.device_put(
      jax.tree.map(lambda x: jnp.ones((n,) + x.shape, x.dtype), params),
      NamedSharding(mesh, P(AXIS)))
  if name.endswith(step_bench.PLAIN):
    with jax.set_mesh(mesh):
      return _time(step_bench.make_plain_step(tx), (params, states, grads),
                   len(sizes), name)
  step = step_bench.make_step(tx, mesh, pmean_grads=pmean_grads)
  return _time(step, (params, states, grads), len(sizes), name)


def _time(step, args, leaves: int, name: str) -> Timing:
  """``step.lower(*args)`` then ``.compile()``, timed with the garbage
  collector paused (as :mod:`timeit` does): a collection of whatever
  earlier variants left would otherwise land in whichever variant runs."""
  gc.collect()
  gc.disable()
  try:
    tic = time.perf_counter()
    lowered = step.lower(*args)
    traced = time.perf_counter() - tic
    tic = time.perf_counter()
    compiled = lowered.compile()
    compiled_s = time.perf_counter() - tic
  finally:
    gc.enable()
  text = compiled.as_text()
  return Timing(leaves, name, traced, compiled_s, program_lines(text),
                dl.collective_bytes(text))


@contextlib.contextmanager
def uncached():
  """A block that compiles without jax's persistent compilation cache,
  should one be set (``JAX_COMPILATION_CACHE_DIR``): there a second
  compile of a program reads the first's executable, text included, and
  its time is a file read's."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()      # it reads the option once
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


# The tables of Python source locations that head the compiled HLO's text,
# which its instructions' metadata point into.
STACK_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_lines(hlo_text: str) -> int:
  """Lines of a compiled HLO module's text less its tables of Python stack
  frames (``FileNames`` ... ``StackFrames``, each up to a blank line),
  whose length depends on the call stack that traced the step (the same
  step traced under pytest has more frames): the program's size."""
  count, skipping = 0, False
  for line in hlo_text.splitlines():
    if line in STACK_TABLES:
      skipping = True
    elif skipping and not line.strip():
      skipping = False
    elif not skipping:
      count += 1
  return count


def time_gpt_step(name, tx, mesh) -> Timing:
  """Traces, lowers and compiles the train CLI's step for its GPT."""
  loss_fn, params, make_batch = aot_models.gpt_problem()
  params = devices.replicate(params, mesh)
  states = parallel.init_worker_states(tx, params, mesh, axis_name=AXIS)
  batch = devices.shard_batch(make_batch(mesh.shape[AXIS]), mesh,
                              axis_name=AXIS)
  step = parallel.make_train_step(loss_fn, tx, mesh, axis_name=AXIS)
  return _time(step, (params, states, batch), len(jax.tree.leaves(params)),
               f"GPT train step, {name}")


def gpt_variants() -> dict[str, optax.GradientTransformation]:
  lr = step_bench.LEARNING_RATE
  return {
      BASELINE: optax.chain(transforms.pmean_gradients(AXIS), optax.lion(lr)),
      "dlion mavo auto": dl.distributed_lion(lr, axis_name=AXIS),
  }


def report(timings: list[Timing]) -> str:
  def kind(t):
    return t.name.startswith("GPT"), t.leaves
  base = {kind(t): t for t in timings if t.name.endswith(BASELINE)}
  rows = []
  for t in timings:
    b = base[kind(t)]
    rows.append([
        t.leaves, t.name, f"{t.trace_lower_s:.2f}", f"{t.compile_s:.2f}",
        f"{t.trace_lower_s / b.trace_lower_s:.2f}x",
        f"{t.compile_s / b.compile_s:.2f}x", f"{t.hlo_lines:,}",
        f"{t.sent_bytes:,.0f}"])
  table = reporting.markdown_table(
      ["leaves", "step", "trace+lower s", "compile s",
       f"trace+lower / {BASELINE}", f"compile / {BASELINE}",
       "compiled HLO lines", "bytes sent a step"], rows)
  return f"{bench.machine_line()}\n\n{table}"


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(
      prog="python -m dlion_jax.bench.compile",
      description=__doc__.split("\n")[0])
  parser.add_argument("--leaves", type=int, nargs="+", default=[100, 400, 1000])
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--gpt", action="store_true",
                      help="also time the train CLI's GPT training step")
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--plain", action="store_true",
                      help="also the D-Lion steps in a plain jax.jit step "
                      "(dl.workers)")
  parser.add_argument("--out", help="also write the report to this file")
  args = parser.parse_args(argv)
  if args.gpt:
    bench.require_examples(parser, "dlion_jax.train.models",
                           "--gpt (the train CLI's GPT)")
  devices.use_cpu_devices(args.workers)
  mesh = devices.data_mesh(args.workers, axis_name=AXIS)
  jobs = [((n, name), functools.partial(time_one, name, tx, pmean, mesh,
                                        leaf_sizes(n)))
          for n in args.leaves for _ in range(args.reps)
          for name, (tx, pmean) in variants(args.plain).items()]
  if args.gpt:
    jobs += [(("gpt", name), functools.partial(time_gpt_step, name, tx, mesh))
             for _ in range(args.reps)
             for name, tx in gpt_variants().items()]
  best = {}
  with uncached():
    for key, run in bench.progress(jobs, len(jobs), "compiling"):
      t = run()
      old = best.setdefault(key, t)
      old.trace_lower_s = min(old.trace_lower_s, t.trace_lower_s)
      old.compile_s = min(old.compile_s, t.compile_s)
  return reporting.emit(report(list(best.values())), args.out)


if __name__ == "__main__":
  main()
