"""Wall time of one optimizer step: Distributed Lion against ``optax.lion``.

On ``N`` simulated CPU devices (8 by default), with a ~4M-parameter pytree
(``--tree``: an MLP's 8 leaves, a 1024x3072 matrix and a 1M vector, or 100
leaves of 40,960; ``large``, 50.3M parameters, for an accelerator), times a
jitted ``shard_map`` step that takes per-worker gradients (fixed random
arrays, sharded over the workers), per-worker optimizer states
and replicated parameters, and returns the new parameters and states. Only the
optimizer runs: no model forward or backward pass.

Variants:

* ``dlion <aggregation> <comm>``: :func:`dlion_jax.distributed_lion`, which
  votes over the axis and needs no gradient all-reduce: MaVo with every
  ``comm``, Avg with ``auto``, binary votes; ``--grid`` adds Avg with every
  ``comm`` and the same with ternary votes (``dlion mavo psum ternary``).
* ``global lion``: :func:`optax.lion` fed ``lax.pmean``-ed fp32 gradients, what
  data-parallel Lion needs (the baseline).
* ``local lion``: :func:`optax.lion` on each worker's own gradient, no
  exchange at all (the floor; workers drift apart, so not a usable optimizer).
* ``local lion + 1 psum``: the floor with one all-reduce of a scalar, the
  least any optimizer that exchanges pays: on simulated CPU devices each
  device thread waits there for the slowest.

``--vmap`` runs the same step with the N workers under ``jax.vmap(...,
axis_name='data')`` on the default device instead (one GPU, say): every
worker keeps its own copy of the parameters, as on N devices, and the
collectives become on-device transposes and sums, so the time is the
compute of N workers' steps with no network in it.

Repetitions are interleaved (every variant once per round) and every step is
blocked on before the next starts, so that each time is one step's and no
collectives queue up on the simulated devices (README, "Things to know").
Prints medians and ratios as a markdown table, with the spread of the
per-round ratios to the floor (each round runs every variant back to back,
so the ratio of a pair is steadier than the ratio of two medians on a
loaded machine).

``--profile`` also traces a few steps of D-Lion (auto, MaVo) and the two
``optax.lion`` variants with :func:`jax.profiler.trace` and lists the HLO
instructions that take the most thread time.

``--plain`` also runs each D-Lion variant in a plain ``jax.jit`` step
(:mod:`dlion_jax.workers`: each worker's state and gradients one row of a
leading axis on the mesh's devices, the update ``jax.vmap``-ed over it),
named ``<variant> (plain jit)``, beside its ``shard_map`` step.

``--tpu v5e:2x4`` times nothing: it compiles every variant for that many
TPU chips with libtpu (no TPU needed) and reports the bytes each chip's step
reads and writes a parameter, XLA:TPU's own cost analysis, against the
floor's: the memory traffic a memory-bound step's time follows, with no
noise in it.

Usage::

  python -m dlion_jax.bench.step [--workers 8] [--reps 15]
      [--tree mlp|two|many|large] [--grid] [--vmap] [--profile]
      [--tpu TOPOLOGY] [--kernels auto|pallas|xla [--xla-too]] [--plain]
      [--out FILE.md]

On TPU the D-Lion steps take the fused Pallas kernels of
fused Pallas kernels where a leaf fits them (``kernels='auto'``);
``--kernels pallas`` takes them on a GPU too (Triton), and ``--xla-too``
adds each variant without them: on a GPU, ``--vmap --kernels pallas
--xla-too`` times both side by side.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import math
import os
import re
import statistics
import tempfile
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _exchange as exchange
from dlion_jax import _fused as fused
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import bench
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import workers
from dlion_jax.bench import aot
from dlion_jax.bench import reporting
import dlion_jax as dl

AXIS = "data"
LEARNING_RATE = 1e-4
TREES = {
    # An MLP 784-2048-1024-256-10: about 3.97M parameters in 8 leaves.
    "mlp": {
        "dense_0": {"kernel": (784, 2048), "bias": (2048,)},
        "dense_1": {"kernel": (2048, 1024), "bias": (1024,)},
        "dense_2": {"kernel": (1024, 256), "bias": (256,)},
        "head": {"kernel": (256, 10), "bias": (10,)},
    },
    # 4.19M parameters in a 1024x3072 matrix and a 1M vector.
    "two": {"w": (1024, 3072), "v": (1 << 20,)},
    # 4.10M parameters in 100 leaves of 40,960.
    "many": {f"leaf_{i:03d}": (40_960,) for i in range(100)},
    # "two" x 12: 50.3M parameters, so that a GPU's step is well past its
    # launch and timer overhead (about 10 GB a variant with 8 workers).
    "large": {"w": (4096, 8192), "v": (1 << 24,)},
}
BASELINE = "global lion"
FLOOR = "local lion"
RENDEZVOUS = "local lion + 1 psum"
# A D-Lion variant's name with this after it: the same optimizer in a plain
# jax.jit step (dlion_jax.workers), not a shard_map.
PLAIN = " (plain jit)"
XLA = " (XLA)"
# ... with abstain_nonfinite=True.
ABSTAIN = " (abstain)"


def num_params(shapes: dict) -> int:
  return sum(math.prod(s) for s in jax.tree.leaves(
      shapes, is_leaf=lambda x: isinstance(x, tuple)))


def random_tree(seed: int, shapes: dict, lead: tuple[int, ...] = ()) -> dict:
  """float32 normal arrays of ``shapes`` with a leading ``lead`` shape."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: rng.standard_normal(lead + s, dtype=np.float32), shapes,
      is_leaf=lambda x: isinstance(x, tuple))


def variants(grid: bool = False, kernels: str = "auto", abstain: bool = False
             ) -> dict[str, tuple[optax.GradientTransformation, bool]]:
  """name -> (optimizer, whether gradients are pmean-ed first).

  D-Lion: MaVo with every ``comm`` and Avg with ``auto``, binary votes; with
  ``grid``, every aggregation x comm x vote (ternary named as such); its
  ``kernels`` and ``abstain_nonfinite`` (``abstain``) options as given."""
  out = {}
  for vote in quantize.VOTES if grid else ("binary",):
    for aggregation in message.AGGREGATIONS:
      for comm in ("auto",) + message.COMMS:
        if aggregation == "avg" and comm != "auto" and not grid:
          continue
        tx = dl.distributed_lion(LEARNING_RATE, axis_name=AXIS, vote=vote,
                                 aggregation=aggregation, comm=comm,
                                 kernels=kernels, abstain_nonfinite=abstain)
        name = f"dlion {aggregation} {comm}"
        out[name if vote == "binary" else f"{name} {vote}"] = (tx, False)
  out[BASELINE] = (optax.lion(LEARNING_RATE), True)
  out[FLOOR] = (optax.lion(LEARNING_RATE), False)
  out[RENDEZVOUS] = (optax.chain(_rendezvous(), optax.lion(LEARNING_RATE)),
                     False)
  return out


class RendezvousState(NamedTuple):
  """The all-reduced scalar, kept so that XLA keeps its all-reduce."""
  total: jax.Array


def _rendezvous() -> optax.GradientTransformation:
  """Passes the updates through and all-reduces one of their elements into
  its state: the one rendezvous every exchanging optimizer has (on
  simulated CPU devices each device thread waits there for the slowest),
  with no bytes of the step's arrays depending on it."""

  def update_fn(updates, state, params=None):
    del params, state
    first = jax.tree.leaves(updates)[0].ravel()[0]
    return updates, RendezvousState(lax.psum(first.astype(jnp.float32), AXIS))

  return optax.GradientTransformation(
      lambda params: RendezvousState(jnp.zeros((), jnp.float32)), update_fn)


def make_step(tx: optax.GradientTransformation, mesh, *,
              pmean_grads: bool = False, grads_fn: Callable | None = None,
              grads_in: str = "stacked") -> Callable:
  """Jitted ``step(params, states, grads) -> (params, states)``.

  ``params`` replicated (``P()``); ``states`` and ``grads`` carry a leading
  worker axis sharded over :data:`AXIS`. Parameters and states are donated.

  Args:
    tx: the optimizer.
    mesh: the mesh of :data:`AXIS`.
    pmean_grads: average the gradients over the workers first
      (``grads_fn = lax.pmean`` over the axis).
    grads_fn: makes each worker's gradients of the step's third argument
      (e.g. an all-reduce of them); default: that argument as it is.
    grads_in: the :func:`dlion_jax.parallel.per_worker` layout of the third
      argument, ``"replicated"`` for one value every worker sees (e.g. a
      step count from which each draws its gradients).
  """
  if pmean_grads:
    grads_fn = _pmean
  local = _worker_step(tx, grads_fn)
  # The floor's parameters differ per worker, so replication is not checked
  # (for any variant, to compile them all alike); a replicated output keeps
  # worker 0's copy.
  step = parallel.per_worker(local, mesh, axis_name=AXIS,
                             ins=("replicated", "stacked", grads_in),
                             outs=("replicated", "stacked"),
                             check_replicated=False)
  return jax.jit(step, donate_argnums=(0, 1))


def make_vmapped_step(tx: optax.GradientTransformation, *,
                      pmean_grads: bool = False) -> Callable:
  """Like :func:`make_step` with the workers under ``jax.vmap`` on one
  device: every argument, ``params`` too, carries the leading worker axis."""

  local = _worker_step(tx, _pmean if pmean_grads else None)
  return jax.jit(jax.vmap(local, axis_name=AXIS), donate_argnums=(0, 1))


def make_plain_step(tx: optax.GradientTransformation) -> Callable:
  """Like :func:`make_step` as a plain ``jax.jit`` step: the workers'
  gradients and states one row each of a leading axis, the update mapped
  over it (:func:`dlion_jax.workers.update`). Trace and call it under
  ``jax.set_mesh`` of the workers' mesh."""

  def step(params, states, grads):
    updates, states = workers.update(tx, axis_name=AXIS)(grads, states,
                                                         params)
    return optax.apply_updates(params, updates), states

  return jax.jit(step, donate_argnums=(0, 1))


def _pmean(grads):
  return lax.pmean(grads, AXIS)


def _worker_step(tx, grads_fn: Callable | None) -> Callable:
  """One worker's ``(params, state, grads) -> (params, state)``."""

  def local(params, state, grads):
    if grads_fn is not None:
      grads = grads_fn(grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return local


class Runner:
  """One variant's compiled step and its current params and states.

  ``mesh=None`` vmaps the workers on the default device
  (:func:`make_vmapped_step`); ``grads`` then carry the worker axis unsharded.
  """

  def __init__(self, tx, mesh, *, pmean_grads: bool, params, grads,
               plain: bool = False):
    self.vmapped, self.mesh, self.plain = mesh is None, mesh, plain
    if self.vmapped:
      num_workers = jax.tree.leaves(grads)[0].shape[0]
      self.step = make_vmapped_step(tx, pmean_grads=pmean_grads)
      self.params = jax.tree.map(lambda x: jax.device_put(
          np.broadcast_to(x, (num_workers,) + x.shape)), params)
      self.states = jax.jit(jax.vmap(tx.init))(self.params)
    else:
      self.step = (make_plain_step(tx) if plain else
                   make_step(tx, mesh, pmean_grads=pmean_grads))
      self.params = devices.replicate(params, mesh)
      self.states = parallel.init_worker_states(tx, self.params, mesh,
                                                axis_name=AXIS)
    self.grads = grads
    self.times = []

  def _context(self):
    return (jax.set_mesh(self.mesh) if self.plain
            else contextlib.nullcontext())

  def hlo_text(self) -> str:
    """The compiled step's HLO (compiles once more)."""
    with self._context():
      return self.step.lower(self.params, self.states,
                             self.grads).compile().as_text()

  def __call__(self) -> float:
    """Runs one step, blocked on; returns its wall time in seconds."""
    with self._context():
      start = time.perf_counter()
      self.params, self.states = self.step(self.params, self.states,
                                           self.grads)
      jax.block_until_ready((self.params, self.states))
      return time.perf_counter() - start


def named_variants(grid: bool, kernels: str, plain: bool, xla_too: bool,
                   abstain: bool = False):
  """``(name, optimizer, pmean_grads, plain)`` of each step to run: every
  variant of :func:`variants`, each D-Lion one also in a plain jitted step
  (``plain``; its name + :data:`PLAIN`), with ``kernels='xla'``
  (``xla_too``; + :data:`XLA`) and with ``abstain_nonfinite=True``
  (``abstain``; + :data:`ABSTAIN`)."""
  xla = variants(grid, kernels="xla") if xla_too else {}
  held = variants(grid, kernels, abstain=True) if abstain else {}
  for name, (tx, pmean_grads) in variants(grid, kernels).items():
    dlion = name.startswith("dlion ")
    txs = {"": tx, **({XLA: xla[name][0]} if dlion and xla else {}),
           **({ABSTAIN: held[name][0]} if dlion and held else {})}
    for form in [False, True] if plain and dlion else [False]:
      for suffix, tx in txs.items():
        yield name + suffix + (PLAIN if form else ""), tx, pmean_grads, form


def build(num_workers: int, shapes: dict, *, vmap: bool = False,
          grid: bool = False, plain: bool = False, kernels: str = "auto",
          xla_too: bool = False) -> dict[str, Runner]:
  """A compiled, warmed-up :class:`Runner` per variant (of
  :func:`variants`, with ``kernels``), on a mesh of ``num_workers``
  devices or (``vmap``) vmapped on the default device; with ``plain`` each
  D-Lion variant also in a plain jitted step (its name + :data:`PLAIN`),
  with ``xla_too`` also with ``kernels='xla'`` (its name + :data:`XLA`)."""
  params = random_tree(0, shapes)
  grads = random_tree(1, shapes, (num_workers,))
  if vmap:
    mesh = None
    grads = jax.device_put(grads)
  else:
    mesh = devices.data_mesh(num_workers, axis_name=AXIS)
    grads = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
  runners = {}
  for key, tx, pmean_grads, form in named_variants(grid, kernels, plain,
                                                  xla_too):
    runners[key] = Runner(tx, mesh, pmean_grads=pmean_grads, params=params,
                          grads=grads, plain=form)
    runners[key]()   # compile
    runners[key]()   # warm
  return runners


def time_interleaved(runners: dict[str, Runner], reps: int) -> None:
  """``reps`` rounds, each stepping every variant once, in rotating order."""
  names = list(runners)
  for r in bench.progress(range(reps), reps, "timing"):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      runners[name].times.append(runners[name]())


def paired_ratios(runners: dict[str, Runner], name: str,
                  reference: str) -> np.ndarray:
  """Round by round, ``name``'s step time over ``reference``'s: each pair
  ran back to back, so a load that slows a whole round cancels out."""
  return (np.asarray(runners[name].times) /
          np.asarray(runners[reference].times))


def table(runners: dict[str, Runner], num_workers: int) -> str:
  """Markdown: variant, comm picked, wire bits, median ms, ratios (of the
  medians, and the median and quartiles of the per-round ratios to the
  floor)."""
  med = {k: statistics.median(r.times) * 1e3 for k, r in runners.items()}
  rows = []
  for name, ms in med.items():
    spread = (f"{np.percentile(runners[name].times, 25) * 1e3:.1f}-"
              f"{np.percentile(runners[name].times, 75) * 1e3:.1f}")
    paired = paired_ratios(runners, name, FLOOR)
    rows.append([name, _comm_bits(name, num_workers), f"{ms:.1f}", spread,
                 f"{ms / med[BASELINE]:.2f}x", f"{ms / med[FLOOR]:.2f}x",
                 f"{np.median(paired):.2f}x ({np.percentile(paired, 25):.2f}"
                 f"-{np.percentile(paired, 75):.2f})"])
  return reporting.markdown_table(
      ["variant", "wire bits/param", "median ms", "IQR ms",
       "vs global lion", "vs local lion (floor)",
       "per-round vs floor, median (IQR)"], rows)


def agreement(runners: dict[str, Runner]) -> str:
  """One line: whether the parameters of every strategy of each aggregation
  and vote are bit for bit those of its first (all ran the same steps on
  the same gradients), and, vmapped, whether each variant's worker copies
  are alike."""
  groups = collections.defaultdict(list)
  for k in runners:
    if k.startswith("dlion "):
      _, aggregation, _, *vote = k.removesuffix(PLAIN).split()
      groups[(aggregation, *vote)].append(k)
  steps = len(next(iter(runners.values())).times) + 2
  said = []
  for (aggregation, *vote), names in groups.items():
    if len(names) < 2:
      continue
    first = jax.tree.leaves(runners[names[0]].params)
    differ = [k for k in names[1:] if not all(
        np.array_equal(a, b)
        for a, b in zip(first, jax.tree.leaves(runners[k].params)))]
    which = " ".join([aggregation.capitalize() if aggregation == "avg"
                      else "MaVo", *vote])
    said.append(f"{which} {', '.join(_comm_of(k) for k in names)} are "
                + ("bit for bit alike" if not differ else
                   f"NOT alike: {', '.join(differ)} differ from {names[0]}"))
  line = f"- After {steps} steps the parameters of " + "; of ".join(said) + "."
  if next(iter(runners.values())).vmapped:
    drifted = [k for k in runners if k.startswith("dlion") and not all(
        np.array_equal(x[0], x[i]) for x in jax.tree.leaves(runners[k].params)
        for i in range(1, x.shape[0]))]
    line += (" Every D-Lion variant's workers hold the same parameters."
             if not drifted else f" Workers drifted apart in {drifted}.")
  return line


def _comm_of(name: str) -> str:
  """A D-Lion variant's ``comm``, and its form if plain."""
  return name.split()[2] + (PLAIN if name.endswith(PLAIN) else "")


def _comm_bits(name: str, n: int) -> str:
  name = name.removesuffix(PLAIN)
  if name == BASELINE:
    return f"{dl.allreduce_bits(n):.3g} (fp32 all-reduce)"
  if name == FLOOR:
    return "0"
  if name == RENDEZVOUS:
    return "0 (one scalar)"
  _, aggregation, comm, *vote = name.split()
  vote = vote[0] if vote else "binary"
  picked = exchange.resolve_comm(comm, n, aggregation=aggregation,
                                 spec=quantize.vote_spec(vote=vote))
  bits = dl.wire_bits(n, aggregation=aggregation, comm=picked, vote=vote)
  return f"{bits:.3g} ({picked})" if comm == "auto" else f"{bits:.3g}"


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|\S+) "
    r"(?:.*op_name=\"(?P<op>[^\"]*)\")?")
_ARRAY = re.compile(r"\w+\[[\d,]*\]")


def _short_shape(shape: str) -> str:
  """``f32[8,3]{1,0}`` -> ``f32[8,3]``; a tuple -> ``(first xcount)``."""
  arrays = _ARRAY.findall(shape)
  if shape.startswith("(") and arrays:
    return f"({arrays[0]} x{len(arrays)})"
  return arrays[0] if arrays else shape


def _instructions(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> ``shape op_name`` in the entry computation."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  out = {}
  for line in entry.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      op = (m["op"] or "").split("shard_map/")[-1]
      out[m["name"]] = f"{_short_shape(m['shape'])} {op}".strip()
  return out


def thread_time(runner: Runner, steps: int) -> tuple[dict[str, float], float]:
  """Per-instruction thread time (ms per step, summed over the devices).

  Returns:
    ``({instruction: ms}, wall ms per step)`` from a :func:`jax.profiler`
    trace of ``steps`` steps.
  """
  names = _instructions(runner.hlo_text())
  total = collections.defaultdict(float)
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    wall = sum(runner() for _ in range(steps))
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                        recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in names:
          total[f"`{event.name}` {names[event.name]}"] += event.duration_ns
  per_step = {k: v / 1e6 / steps for k, v in total.items()}
  return per_step, wall * 1e3 / steps


def profile_table(runners: dict[str, Runner], steps: int = 5,
                  top: int = 8) -> str:
  """Top HLO instructions by thread time, for D-Lion and the baselines."""
  parts = []
  for name in ("dlion mavo auto", BASELINE, FLOOR):
    per_op, wall = thread_time(runners[name], steps)
    busy = sum(per_op.values())
    rows = [[op, f"{ms:.1f}", f"{100 * ms / busy:.0f}%"]
            for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]]
    parts += [
        f"**{name}**: {wall:.1f} ms/step wall under the profiler, "
        f"{busy:.1f} thread-ms/step in HLO instructions (8 device threads "
        "share the cores, so thread time includes time preempted).",
        "",
        reporting.markdown_table(
            ["instruction (shape, op)", "thread ms/step", "share"], rows),
        ""]
  return "\n".join(parts)


# XLA:TPU's memory-space assignment off: every buffer stays in HBM. With it
# on, XLA may stage a buffer in on-chip memory (VMEM) by copies, whose both
# ends its cost analysis counts as bytes accessed, though one end is on chip.
ALL_IN_HBM = {"xla_msa_enable": False}


def tpu_compiled(tx, mesh, shapes: dict, *, pmean_grads: bool = False,
                 plain: bool = False, options: dict | None = None):
  """:func:`make_step` (or with ``plain`` :func:`make_plain_step`) compiled
  for the TPU chips of ``mesh`` (no chip needed: libtpu compiles for a
  topology) on params of ``shapes``, with XLA compiler ``options`` (e.g.
  :data:`ALL_IN_HBM`)."""
  n = mesh.devices.size
  def placed(shape, spec, dtype=np.float32):
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(mesh, spec))
  is_shape = lambda x: isinstance(x, tuple)
  params = jax.tree.map(lambda s: placed(s, P()), shapes, is_leaf=is_shape)
  grads = jax.tree.map(lambda s: placed((n,) + s, P(AXIS)), shapes,
                       is_leaf=is_shape)
  states = jax.tree.map(
      lambda s: placed(s.shape, P(AXIS) if s.ndim else P(), s.dtype),
      jax.eval_shape(jax.vmap(tx.init), grads))
  if plain:
    with jax.set_mesh(mesh):
      return make_plain_step(tx).lower(params, states, grads).compile(
          compiler_options=options)
  return make_step(tx, mesh, pmean_grads=pmean_grads).lower(
      params, states, grads).compile(compiler_options=options)


def tpu_bytes(tx, mesh, shapes: dict, *, pmean_grads: bool = False,
              plain: bool = False,
              options: dict | None = None) -> tuple[float, int]:
  """``(bytes accessed, fusions)`` of a chip's :func:`tpu_compiled` step,
  from XLA:TPU's own cost analysis."""
  compiled = tpu_compiled(tx, mesh, shapes, pmean_grads=pmean_grads,
                          plain=plain, options=options)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  entry = compiled.as_text().split("\nENTRY", 1)[1]
  return cost["bytes accessed"], len(re.findall(r" fusion\(", entry))


def tpu_table(num_workers: int, shapes: dict, topology: str, *,
              grid: bool = False, plain: bool = False,
              xla_too: bool = False, kernels: str = "auto",
              all_in_hbm: bool = False, abstain: bool = False) -> str:
  """Markdown: every variant's compiled TPU step, bytes a parameter each
  chip reads and writes, against the floor's (see :func:`tpu_bytes`);
  with ``xla_too`` each D-Lion variant also without the fused kernels,
  named ``<variant> (XLA)``; with ``abstain`` also with
  ``abstain_nonfinite=True``, named ``<variant> (abstain)``; with
  ``all_in_hbm`` also the bytes of the step compiled with every buffer in
  HBM (:data:`ALL_IN_HBM`)."""
  devices = aot.tpu_devices(topology, 1)[:num_workers]
  if len(devices) != num_workers:
    raise ValueError(
        f"--tpu {topology} has {len(devices)} chips, fewer than --workers "
        f"{num_workers}; name a topology of at least that many (v5e:2x4 "
        "has 8).")
  mesh = Mesh(np.array(devices), (AXIS,))
  per_param = {}
  rows = []
  for key, tx, pmean_grads, form in named_variants(grid, kernels, plain,
                                                  xla_too, abstain):
    nbytes, fusions = tpu_bytes(tx, mesh, shapes, pmean_grads=pmean_grads,
                                plain=form)
    per_param[key] = nbytes / num_params(shapes)
    rows.append([key, f"{per_param[key]:.1f}", None, str(fusions)])
    if all_in_hbm:
      unstaged = tpu_bytes(tx, mesh, shapes, pmean_grads=pmean_grads,
                           plain=form, options=ALL_IN_HBM)[0]
      rows[-1].append(f"{unstaged / num_params(shapes):.1f}")
  for row in rows:
    row[2] = f"{per_param[row[0]] / per_param[FLOOR]:.2f}x"
  return reporting.markdown_table(
      ["variant", "bytes a parameter (a chip)", "vs local lion (floor)",
       "fusions"] + ["all in HBM"] * all_in_hbm, rows)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m dlion_jax.bench.step",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--reps", type=int, default=15)
  parser.add_argument("--tree", choices=sorted(TREES), default="mlp",
                      help="the params: an MLP's 8 leaves (3.97M), a "
                      "1024x3072 matrix and a 1M vector (4.19M), 100 "
                      "leaves of 40,960 (4.10M), or a 4096x8192 matrix and "
                      "a 16M vector (50.3M, for an accelerator)")
  parser.add_argument("--vmap", action="store_true",
                      help="vmap the workers on the default device (one GPU) "
                      "instead of one simulated CPU device each")
  parser.add_argument("--profile", action="store_true",
                      help="also trace D-Lion and optax.lion steps")
  parser.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                      help="instead of timing, compile every variant for "
                      "--workers chips of this TPU topology (e.g. v5e:2x4; "
                      "libtpu, no TPU needed) and report the bytes each "
                      "chip's step reads and writes a parameter")
  parser.add_argument("--grid", action="store_true",
                      help="every aggregation x comm x vote, not only MaVo's "
                      "comms and Avg auto with binary votes")
  parser.add_argument("--plain", action="store_true",
                      help="also run each D-Lion variant in a plain jax.jit "
                      "step (dl.workers: the update vmapped over the "
                      "workers' axis), beside its shard_map step")
  parser.add_argument("--kernels", choices=fused.KERNELS, default="auto",
                      help="the D-Lion variants' kernels option: 'pallas' "
                      "takes the fused kernels on a GPU too (Triton), "
                      "which 'auto' leaves to XLA there")
  parser.add_argument("--xla-too", action="store_true",
                      help="with --tpu or --kernels pallas, also each "
                      "D-Lion variant with kernels='xla' (no fused Pallas "
                      "kernels), named '<variant> (XLA)'")
  parser.add_argument("--abstain", action="store_true",
                      help="with --tpu, also each D-Lion variant with "
                      "abstain_nonfinite=True, named '<variant> (abstain)'")
  parser.add_argument("--all-in-hbm", action="store_true",
                      help="with --tpu, also compile each step with XLA's "
                      "memory-space assignment off (every buffer in HBM) "
                      "and report its bytes: the cost analysis counts both "
                      "ends of a copy that stages a buffer on chip")
  parser.add_argument("--out", default=None, help="also write markdown here")
  args = parser.parse_args(argv)
  if args.xla_too and not (args.tpu or args.kernels == "pallas"):
    parser.error("--xla-too compares the fused kernels with the XLA path; "
                 "add --tpu TOPOLOGY, or --kernels pallas on a GPU ("
                 "kernels='auto' takes the kernels on TPU only)")
  if args.xla_too and args.kernels == "xla":
    parser.error("--xla-too adds kernels='xla' rows beside --kernels auto "
                 "or pallas; leave out one of them")
  if args.kernels == "pallas" and args.plain:
    parser.error("--kernels pallas cannot run in the plain jitted steps of "
                 "--plain (XLA partitions them, and not a Pallas kernel); "
                 "leave out one of them")
  if args.kernels == "pallas" and not args.tpu and fused.interpreted():
    parser.error(f"--kernels pallas on {jax.default_backend()} times "
                 "Pallas' interpreter, which says nothing of the kernels' "
                 "speed: run it on a GPU or TPU, or compile for TPU with "
                 "--tpu TOPOLOGY")
  if args.plain and args.vmap:
    parser.error("--plain maps the workers over the mesh's devices; leave "
                 "out --vmap")
  if args.all_in_hbm and not args.tpu:
    parser.error("--all-in-hbm compiles for TPU; add --tpu TOPOLOGY")
  if args.abstain and not args.tpu:
    parser.error("--abstain compiles the abstaining steps for TPU; add "
                 "--tpu TOPOLOGY")
  if args.tpu:
    if args.vmap or args.profile:
      parser.error("--tpu compiles the step and times nothing; leave out "
                   "--vmap and --profile")
    return reporting.emit(_tpu_report(parser, args), args.out)
  if args.vmap and args.profile:
    parser.error("--profile reads CPU device threads; leave it out with "
                 "--vmap")
  if not args.vmap:
    devices.use_cpu_devices(args.workers)
  load = os.getloadavg()[0]
  start = time.perf_counter()
  shapes = TREES[args.tree]
  runners = build(args.workers, shapes, vmap=args.vmap, grid=args.grid,
                  plain=args.plain, kernels=args.kernels,
                  xla_too=args.xla_too)
  compiled = time.perf_counter()
  time_interleaved(runners, args.reps)
  timed = time.perf_counter()
  lines = [
      f"Machine: {bench.machine_line()}; {args.workers} workers"
      f"{' vmapped on one device' if args.vmap else ''}. "
      f"Parameters ({args.tree}): {num_params(shapes):,} in "
      f"{len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))}"
      f" leaves. {args.reps} interleaved repetitions after 2 warm-up steps.",
      "",
      table(runners, args.workers),
      "",
      agreement(runners),
      f"- Load average (1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} "
      f"after timing, on {os.cpu_count()} cores.",
      f"- Compile + warm-up {compiled - start:.1f} s, timing "
      f"{timed - compiled:.1f} s.",
  ]
  if args.profile:
    lines += ["", "### Profile", "", profile_table(runners)]
  lines.append(f"- Total {time.perf_counter() - start:.1f} s.")
  return reporting.emit("\n".join(lines), args.out)


def _tpu_report(parser, args) -> str:
  """The ``--tpu`` report: :func:`tpu_table` with what it was compiled by."""
  if os.environ.get("JAX_PLATFORMS") is None:
    jax.config.update("jax_platforms", "cpu")    # compile-only: no TPU used
  why = aot.libtpu_available()
  if why:
    parser.error(f"--tpu cannot compile for TPU topologies ({why}); install "
                 'libtpu: pip install "dlion_jax[tpu-aot]"')
  shapes = TREES[args.tree]
  start = time.perf_counter()
  try:
    table_md = tpu_table(args.workers, shapes, args.tpu, grid=args.grid,
                         plain=args.plain, xla_too=args.xla_too,
                         kernels=args.kernels, all_in_hbm=args.all_in_hbm,
                         abstain=args.abstain)
  except ValueError as e:
    parser.error(str(e))
  return "\n".join([
      f"Compiled for {args.workers} chips of TPU {args.tpu} by libtpu "
      f"({bench.machine_line()}). Parameters ({args.tree}): "
      f"{num_params(shapes):,}. Bytes: XLA:TPU's cost analysis of each "
      "chip's step (`bytes accessed`), over the parameters."
      + (" All in HBM: the same step compiled with memory-space assignment "
         "off (`xla_msa_enable=False`), nothing staged in on-chip memory."
         if args.all_in_hbm else ""), "",
      table_md, "",
      f"- Compiled in {time.perf_counter() - start:.1f} s."])


if __name__ == "__main__":
  main()
