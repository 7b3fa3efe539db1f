"""Training steps over a bandwidth-capped network: D-Lion against all-reduce.

Real multi-process JAX: ``N`` processes (one CPU device each) join with
:func:`jax.distributed.initialize` and run their collectives over TCP with
gloo, inside a private network namespace whose loopback is rate-limited with
``tc ... tbf`` (needs root). The model is the byte-level GPT of
:mod:`dlion_jax.train.models`, trained on real text (forward and backward on
each worker's own batch of byte windows).

For every (processes, rate) pair, one launch of ``N`` worker processes times,
for every row (an optimizer and its exchange), step after step:

* **optimizer step**: a jitted ``shard_map`` that takes each worker's local
  gradients, state and the parameters and does only the exchange and update
  (global AdamW / Lion: gradient all-reduce in fp32 or bf16, then the update;
  D-Lion: the vote exchange and update);
* **exchange**: the optimizer step's collectives alone, replayed: the
  collectives are read off the compiled step's HLO
  (:func:`dlion_jax.hlo.collectives`) and the same ops on buffers of
  the same byte sizes run back to back in a program with nothing else in it;
* **end-to-end step**: the forward/backward pass (a jitted function with no
  collective, shared by all rows) followed by the optimizer step.

Rows are interleaved (every row once per round), every call is blocked on,
and the medians of ``--steps`` rounds after ``--warmup`` are reported. Times
are per step as the slowest process sees it for the end-to-end step, and as
the fastest process sees it for the optimizer step and the exchange (the
last process to arrive at a collective does not wait for stragglers).

The **wire floor** is the bytes all workers send in one step over the link
rate: ``N * bytes_per_worker * 8 / rate``. ``tbf`` on ``lo`` puts the
traffic of every direction and every process through one queue, so the
shaped loopback is one shared ``rate`` medium (a hub), not ``N`` full-duplex
links of ``rate`` each; on a switched network the floor would be ``N`` times
lower.

Usage::

  python -m benchmarks.network [--procs 2 4] [--rates 100mbit 1gbit none]
      [--params 8M] [--steps 5] [--rows all] [--rows-above-2 core]
      [--out FILE.md] [--plot FILE.png]

The worker entry point (started by the above, one per process) is
``python benchmarks/network.py --worker SPEC.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

AXIS = "data"
LEARNING_RATES = {"adamw": 1e-3, "lion": 1e-4, "dlion": 1e-4}
TEXT = "/usr/share/common-licenses/GPL-3"
BASELINE = "global lion fp32"
TBF = ("burst", "256kb", "latency", "200ms")


@dataclasses.dataclass(frozen=True)
class GPTSize:
  """A GPT configuration and the per-worker batch it is timed with."""
  dim: int
  depth: int
  heads: int
  batch: int = 8          # sequences per worker
  seq_len: int = 128


PRESETS = {
    "tiny": GPTSize(dim=32, depth=1, heads=2, batch=2, seq_len=32),
    "8M": GPTSize(dim=400, depth=4, heads=8),       # 7.86M parameters
    "13M": GPTSize(dim=512, depth=4, heads=8),      # 12.8M parameters
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One optimizer and exchange to time.

  Attributes:
    name: the table label.
    optimizer: ``'adamw'`` or ``'lion'`` (global, gradients all-reduced) or
      ``'dlion'`` (:func:`dlion_jax.distributed_lion`).
    options: for global rows ``{'grad_dtype': 'float32' | 'bfloat16'}``; for
      ``'dlion'`` the keyword arguments of ``dl.distributed_lion`` (e.g.
      ``{'aggregation': 'avg', 'comm': 'psum'}`` or Lion Cub's
      ``{'quantizer': 'pbit_l1', 'bits': 4}``).
  """
  name: str
  optimizer: str
  options: dict


def _rows() -> list[Row]:
  rows = []
  for opt in ("adamw", "lion"):
    for dtype, label in (("float32", "fp32"), ("bfloat16", "bf16")):
      rows.append(Row(f"global {opt} {label}", opt, {"grad_dtype": dtype}))
  for agg in ("mavo", "avg"):
    for comm in ("auto", "alltoall", "allgather", "psum", "psum_int8"):
      rows.append(Row(f"dlion {agg} {comm}", "dlion",
                      {"aggregation": agg, "comm": comm}))
  rows.append(Row("lioncub mavo ternary_l1", "dlion",
                  {"quantizer": "ternary_l1"}))
  rows.append(Row("lioncub avg pbit_l1 4-bit", "dlion",
                  {"aggregation": "avg", "quantizer": "pbit_l1", "bits": 4}))
  return rows


ROWS = {r.name: r for r in _rows()}
ROW_SETS = {
    "all": list(ROWS),
    "core": [BASELINE, "global lion bf16", "dlion mavo auto",
             "dlion mavo psum_int8", "dlion avg auto"],
}


def select_rows(spec: str) -> list[str]:
  """Row names from a set name (``all``, ``core``) or comma-separated names."""
  names = ROW_SETS.get(spec) or [s.strip() for s in spec.split(",")
                                 if s.strip()]
  unknown = [n for n in names if n not in ROWS]
  if unknown:
    raise ValueError(f"unknown rows {unknown}; known: {list(ROWS)} or a set "
                     f"{list(ROW_SETS)}")
  if BASELINE not in names:
    names = [BASELINE] + names     # the speedups are against it
  return names


def parse_rate(rate: str) -> float | None:
  """Bits per second of a tc rate such as ``100mbit``; ``None`` for none."""
  if rate in ("none", "unshaped"):
    return None
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
  if not m:
    raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit or none")
  scale = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
  return float(m[1]) * scale


def wire_floor_s(bytes_per_worker: float, num_workers: int,
                 rate: float | None) -> float | None:
  """Seconds all workers' bytes take through one shared ``rate`` queue."""
  if rate is None:
    return None
  return num_workers * bytes_per_worker * 8 / rate


# --- Network namespaces ----------------------------------------------------

def can_shape() -> str | None:
  """Why this process cannot build shaped namespaces; ``None`` if it can."""
  if os.geteuid() != 0:
    return "needs root (ip netns and tc)"
  missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing:
    return f"needs {' and '.join(missing)} (iproute2)"
  return None


def _ip(*args: str) -> None:
  subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def namespace(rate: str, name: str | None = None) -> Iterator[list[str]]:
  """A private network namespace, its loopback shaped to ``rate``.

  Yields the command prefix that runs a program inside it
  (``ip netns exec NAME``). ``rate='none'`` leaves the loopback unshaped.
  The namespace is deleted on exit, whatever happens.
  """
  bits = parse_rate(rate)
  name = name or f"dlbench-{uuid.uuid4().hex[:8]}"
  _ip("netns", "add", name)
  try:
    _ip("-n", name, "link", "set", "lo", "up")
    if bits is not None:
      subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev",
                      "lo", "root", "tbf", "rate", rate, *TBF], check=True,
                     capture_output=True, text=True)
    yield ["ip", "netns", "exec", name]
  finally:
    subprocess.run(["ip", "netns", "del", name], check=False,
                   capture_output=True)


# --- Worker: everything that runs inside one JAX process -------------------

def _start_jax(timeout_s: float):
  """Joins the processes (gloo over TCP), one CPU device per process."""
  import jax  # pylint: disable=g-import-not-at-top
  from dlion_jax import processes  # pylint: disable=g-import-not-at-top
  processes.start_processes(1, init_timeout=timeout_s)
  return jax


def bf16_allreduce_mean(tree: Any, axis_name: str, num_workers: int) -> Any:
  """Mean of ``tree`` over the axis with bf16 on the wire.

  XLA:CPU widens a bf16 ``all-reduce`` to f32, sending fp32 bytes, so this
  does the ring all-reduce's two halves by hand on the 16-bit patterns: an
  ``all_to_all`` (each worker receives its shard from everyone, sums in
  fp32) and an ``all_gather`` of the bf16 shard means. Sends
  ``2 (N - 1) / N * 16`` bits per parameter, as a bf16 ring all-reduce.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  leaves, treedef = jax.tree.flatten(tree)
  flat = jnp.concatenate([x.reshape(-1) for x in leaves]).astype(jnp.bfloat16)
  size = flat.size
  flat = jnp.pad(flat, (0, -size % num_workers))
  words = lax.bitcast_convert_type(flat, jnp.uint16).reshape(num_workers, -1)
  shards = lax.all_to_all(words, axis_name, 0, 0)
  mean = lax.bitcast_convert_type(shards, jnp.bfloat16).astype(
      jnp.float32).mean(0).astype(jnp.bfloat16)
  gathered = lax.all_gather(lax.bitcast_convert_type(mean, jnp.uint16),
                            axis_name, tiled=True)
  flat = lax.bitcast_convert_type(gathered, jnp.bfloat16)[:size]
  out, start = [], 0
  for x in leaves:
    out.append(flat[start:start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return jax.tree.unflatten(treedef, out)


def build_optimizer(row: Row, num_workers: int):
  """``(tx, reduce)``: the optax transform and the gradient reduction."""
  import optax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  import dlion_jax as dl  # pylint: disable=g-import-not-at-top
  lr = LEARNING_RATES[row.optimizer]
  if row.optimizer == "dlion":
    return dl.distributed_lion(lr, axis_name=AXIS, **row.options), None
  tx = optax.adamw(lr) if row.optimizer == "adamw" else optax.lion(lr)
  if row.options["grad_dtype"] == "bfloat16":
    return tx, lambda g: bf16_allreduce_mean(g, AXIS, num_workers)
  return tx, lambda g: lax.pmean(g, AXIS)


def make_opt_step(tx, reduce: Callable | None, mesh):
  """Jitted ``(params, states, grads) -> (params, states)``: exchange+update.

  ``params`` replicated; ``states`` and ``grads`` carry a leading worker
  axis sharded over :data:`AXIS`. Parameters and states are donated.
  """
  from dlion_jax.bench import step  # pylint: disable=g-import-not-at-top
  return step.make_step(tx, mesh, grads_fn=reduce)


def make_grad_fn(graphdef, mesh):
  """Jitted ``(params, batch) -> (grads, losses)``, per worker, no exchange.

  Each worker differentiates its local next-byte loss; grads and losses get
  a leading worker axis sharded over :data:`AXIS`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import models  # pylint: disable=g-import-not-at-top

  def loss_fn(params, batch):
    return models.lm_loss(models.apply(graphdef, params, batch["x"]),
                          batch["y"])

  def local(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return grads, loss

  return jax.jit(parallel.per_worker(local, mesh, axis_name=AXIS,
                                     ins=("replicated", "split"),
                                     outs=("stacked", "stacked")))


def replay_buffers(collectives, num_workers: int) -> list[tuple[str, Any]]:
  """(op, per-worker numpy buffer) reproducing each collective's bytes.

  Collectives in conditional branches (scheduled syncs) are left out.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  n, out = num_workers, []
  for c in collectives:
    if c.conditional or c.group_size <= 1:
      continue
    if c.op == "all-reduce":
      buf = np.zeros((1, -(-c.result_bytes // 4)), np.float32)
    elif c.op == "all-gather":
      buf = np.zeros((1, c.result_bytes // n), np.uint8)
    elif c.op == "all-to-all":
      buf = np.zeros((1, n, c.result_bytes // n), np.uint8)
    else:
      raise ValueError(f"no replay for {c.op}")
    out.append((c.op, buf))
  return out


def make_replay(ops: Sequence[str], mesh):
  """Jitted program running ``ops`` back to back on its buffer arguments."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
  run = {
      "all-reduce": lambda x: lax.psum(x, AXIS),
      "all-gather": lambda x: lax.all_gather(x, AXIS, tiled=True),
      "all-to-all": lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True),
  }

  def local(*bufs):
    results, prev = [], None
    for op, buf in zip(ops, bufs):
      if prev is not None:   # one after the other, as in the step
        prev, buf = lax.optimization_barrier((prev, buf))
      prev = run[op](buf)
      results.append(prev)
    return tuple(results)

  layouts = ("stacked",) * len(ops)
  return jax.jit(parallel.per_worker(local, mesh, axis_name=AXIS,
                                     ins=layouts, outs=layouts))


class Runner:
  """One row's compiled step and replay, its parameters, state and times."""

  def __init__(self, row: Row, params0, mesh, grads_like):
    from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    from dlion_jax import devices  # pylint: disable=g-import-not-at-top
    from dlion_jax import hlo  # pylint: disable=g-import-not-at-top
    from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
    n = mesh.shape[AXIS]
    self.row = row
    tx, reduce = build_optimizer(row, n)
    self.params = devices.global_array(params0, NamedSharding(mesh, P()))
    self.states = parallel.init_worker_states(tx, self.params, mesh,
                                              axis_name=AXIS)
    compiled = make_opt_step(tx, reduce, mesh).lower(
        self.params, self.states, grads_like).compile()
    self.step = compiled
    text = compiled.as_text()
    found = hlo.collectives(text)
    self.wire_bytes = hlo.collective_bytes(text, conditional=False)
    self.ops = "+".join(c.op for c in found)
    bufs = replay_buffers(found, n)
    sharding = NamedSharding(mesh, P(AXIS))
    self.replay_args = [
        devices.global_array(b.repeat(n, axis=0), sharding) for _, b in bufs]
    replay = make_replay([op for op, _ in bufs], mesh).lower(
        *self.replay_args).compile()
    self.replay = replay
    self.replay_bytes = hlo.collective_bytes(replay.as_text())
    self.times = {"grad": [], "opt": [], "exchange": []}
    self.losses = []

  def run(self, grad_fn, batch) -> None:
    """One end-to-end step then one replay, each blocked on and timed."""
    import jax  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    grads, losses = grad_fn(self.params, batch)
    jax.block_until_ready(grads)
    t1 = time.perf_counter()
    self.params, self.states = self.step(self.params, self.states, grads)
    jax.block_until_ready((self.params, self.states))
    t2 = time.perf_counter()
    jax.block_until_ready(self.replay(*self.replay_args))
    t3 = time.perf_counter()
    for key, dt in (("grad", t1 - t0), ("opt", t2 - t1),
                    ("exchange", t3 - t2)):
      self.times[key].append(dt)
    self.losses.append(float(losses.addressable_data(0)[0]))

  def result(self) -> dict:
    return {"times": self.times, "wire_bytes": self.wire_bytes,
            "replay_bytes": self.replay_bytes, "ops": self.ops,
            "options": self.row.options, "optimizer": self.row.optimizer,
            "losses": self.losses}


def _model(size: GPTSize, seed: int):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import models  # pylint: disable=g-import-not-at-top
  model = models.build_model("gpt", context=size.seq_len, dim=size.dim,
                             depth=size.depth, heads=size.heads,
                             rngs=nnx.Rngs(seed))
  return models.split_params(model)


def build_runners(names, params0, mesh, grads_like) -> tuple[list, dict]:
  """A :class:`Runner` per row; rows the library rejects are skipped."""
  runners, skipped = [], {}
  for name in names:
    try:
      runners.append(Runner(ROWS[name], params0, mesh, grads_like))
    except (TypeError, ValueError) as e:   # e.g. an option not (yet) there
      skipped[name] = f"{type(e).__name__}: {e}"
  return runners, skipped


@dataclasses.dataclass
class LMWorker:
  """What a launched process of a study trains on: the spec's GPT over a
  mesh of every device, and its batches (see :func:`lm_worker`)."""
  jax: Any
  mesh: Any
  graphdef: Any
  params0: Any
  batches: Any
  to_global: Callable      # a batch -> a global array split over AXIS


def lm_worker(spec: dict) -> LMWorker:
  """Starts jax in this process (``spec['init_timeout']``) and builds the
  GPT of ``spec['size']`` and the batches of ``spec['text']``."""
  jax = _start_jax(spec["init_timeout"])
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from dlion_jax import devices  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import data  # pylint: disable=g-import-not-at-top
  size = GPTSize(**spec["size"])
  n = jax.device_count()
  mesh = devices.data_mesh(n, axis_name=AXIS)
  graphdef, params0 = _model(size, spec["seed"])
  text = data.load_text(spec["text"], seq_len=size.seq_len)
  batches = data.Batches(text.train, global_batch=n * size.batch,
                         seed=spec["seed"], kind="lm", seq_len=size.seq_len)
  return LMWorker(jax, mesh, graphdef, params0, batches, lambda b:
                  devices.global_array(b, NamedSharding(mesh, P(AXIS))))


def step_ticks(spec: dict, per_round: int) -> Iterator:
  """Advance it once a timed step: process 0's progress over the spec's
  ``warmup + steps`` rounds of ``per_round`` steps."""
  import jax  # pylint: disable=g-import-not-at-top
  from dlion_jax import bench  # pylint: disable=g-import-not-at-top
  todo = range((spec["warmup"] + spec["steps"]) * per_round)
  if jax.process_index() == 0:
    todo = bench.progress(todo, len(todo), spec["label"])
  return iter(todo)


def write_process_json(spec: dict, out: dict) -> None:
  """This process's results, ``processK.json`` in ``spec['out_dir']``."""
  import jax  # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
  reporting.write_json(
      pathlib.Path(spec["out_dir"]) / f"process{jax.process_index()}.json", out)


def worker(spec: dict) -> None:
  """One process of a launch: times every row, writes its JSON."""
  w = lm_worker(spec)
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from dlion_jax import devices  # pylint: disable=g-import-not-at-top
  from dlion_jax import hlo  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import models  # pylint: disable=g-import-not-at-top
  grad_fn = make_grad_fn(w.graphdef, w.mesh)
  params_g = devices.global_array(w.params0, NamedSharding(w.mesh, P()))
  first = w.to_global(next(w.batches))
  grad_fn = grad_fn.lower(params_g, first).compile()
  grad_bytes = hlo.collective_bytes(grad_fn.as_text())
  grads_like = grad_fn(params_g, first)[0]
  runners, skipped = build_runners(spec["rows"], w.params0, w.mesh,
                                   grads_like)
  it = step_ticks(spec, len(runners))
  for _ in range(spec["warmup"] + spec["steps"]):
    batch = w.to_global(next(w.batches))
    for r in runners:
      r.run(grad_fn, batch)
      next(it, None)
  write_process_json(spec, {
      "process": w.jax.process_index(), "num_workers": w.jax.device_count(),
      "num_params": models.count_params(w.params0),
      "leaf_sizes": [int(x.size) for x in w.jax.tree.leaves(w.params0)],
      "grad_bytes": grad_bytes, "skipped": skipped,
      "rows": {r.row.name: r.result() for r in runners}})


# --- Orchestrator ----------------------------------------------------------

def _median_over_steps(per_process: list[list[float]], warmup: int,
                       combine) -> float:
  steps = zip(*(t[warmup:] for t in per_process))
  return statistics.median(combine(s) for s in steps)


def merge(results: list[dict], warmup: int) -> dict:
  """Per-row medians from every process's JSON (see the module docstring)."""
  first = results[0]
  rows = {}
  for name, r in first["rows"].items():
    each = [res["rows"][name]["times"] for res in results]
    e2e = [[g + o for g, o in zip(t["grad"], t["opt"])] for t in each]
    rows[name] = dict(
        r, opt_s=_median_over_steps([t["opt"] for t in each], warmup, min),
        exchange_s=_median_over_steps([t["exchange"] for t in each], warmup,
                                      min),
        grad_s=_median_over_steps([t["grad"] for t in each], warmup, max),
        e2e_s=_median_over_steps(e2e, warmup, max))
    del rows[name]["times"]
  return {"rows": rows, "num_params": first["num_params"],
          "leaf_sizes": first["leaf_sizes"], "grad_bytes": first["grad_bytes"],
          "skipped": first["skipped"], "num_workers": first["num_workers"]}


def launch_workers(script: str, procs: int, rate: str, spec: dict, *,
                   shaped: bool, timeout: float) -> list[dict]:
  """Runs ``python SCRIPT --worker SPEC`` in ``procs`` processes (in a
  namespace shaped to ``rate`` when ``shaped``); each process's JSON."""
  from dlion_jax import launch  # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix="dlbench-") as tmp:
    spec = dict(spec, out_dir=tmp, label=f"{procs} procs, {rate}")
    spec_path = pathlib.Path(tmp) / "spec.json"
    reporting.write_json(spec_path, spec)
    # By path: the workers find the script wherever they are started from.
    command = [sys.executable, str(pathlib.Path(script).resolve()),
               "--worker", str(spec_path)]
    with (namespace(rate) if shaped else contextlib.nullcontext([])) as pre:
      status = launch.launch(procs, pre + command, timeout=timeout,
                             stdout=sys.stderr)
    if status:
      raise RuntimeError(f"{procs} processes at {rate}: workers exited with "
                         f"status {status} (their output is above)")
    return [json.loads((pathlib.Path(tmp) / f"process{i}.json").read_text())
            for i in range(procs)]


def run_config(procs: int, rate: str, spec: dict, *, shaped: bool,
               timeout: float) -> dict:
  """Launches ``procs`` workers (in a namespace when ``shaped``); merges."""
  results = launch_workers(__file__, procs, rate, spec, shaped=shaped,
                           timeout=timeout)
  merged = merge(results, spec["warmup"])
  merged.update(procs=procs, rate=rate)
  return merged


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def table_rows(config: dict) -> list[list]:
  """Markdown rows of one (procs, rate) configuration."""
  rows, n, rate = config["rows"], config["procs"], config["rate"]
  base = rows[BASELINE]
  out = []
  for name, r in rows.items():
    floor = wire_floor_s(r["wire_bytes"], n, parse_rate(rate))
    ratio = "-" if not floor else f"{r['exchange_s'] / floor:.2f}"
    out.append([
        name, n, rate, _ms(r["opt_s"]), _ms(r["exchange_s"]),
        f"{r['exchange_s'] / r['opt_s']:.0%}",
        f"{r['wire_bytes'] * 8 / config['num_params']:.2f}",
        f"{r['wire_bytes'] / 1e6:.2f}", _ms(floor), ratio, _ms(r["e2e_s"]),
        f"{base['opt_s'] / r['opt_s']:.2f}x",
        f"{base['e2e_s'] / r['e2e_s']:.2f}x"])
  return out


HEADERS = ["row", "procs", "rate", "opt step ms", "exchange ms",
           "exchange share", "wire bits/param", "wire MB/worker",
           "wire floor ms", "exchange / floor", "end-to-end ms",
           "opt speedup", "e2e speedup"]


def headline(configs: list[dict]) -> list[str]:
  """The auto rows' figures at 2 processes and 100 Mbit/s, when run."""
  lines = []
  for c in configs:
    if c["procs"] != 2 or c["rate"] != "100mbit":
      continue
    rows, base = c["rows"], c["rows"][BASELINE]
    for name in ("dlion mavo auto", "dlion avg auto"):
      if name not in rows:
        continue
      r = rows[name]
      floor = wire_floor_s(r["wire_bytes"], 2, parse_rate("100mbit"))
      lines.append(
          f"2 procs, 100mbit, {name}: optimizer step "
          f"{base['opt_s'] / r['opt_s']:.1f}x faster than {BASELINE}, "
          f"exchange {r['exchange_s'] / floor:.2f}x the wire floor, "
          f"end-to-end step {base['e2e_s'] / r['e2e_s']:.2f}x")
  return lines


def plot(configs: list[dict], path: str) -> None:
  """Optimizer and end-to-end step time against rate, one panel per N."""
  # pylint: disable=g-import-not-at-top
  import matplotlib
  from matplotlib.figure import Figure
  procs = sorted({c["procs"] for c in configs})
  rates = list(dict.fromkeys(c["rate"] for c in configs))
  fig = Figure(figsize=(5.5 * len(procs) + 3, 9), layout="constrained")
  axes = fig.subplots(2, len(procs), squeeze=False)
  names = list(dict.fromkeys(n for c in configs for n in c["rows"]))
  colors = {name: matplotlib.colormaps["tab20"](k % 20)
            for k, name in enumerate(names)}
  for j, n in enumerate(procs):
    for i, (key, what) in enumerate((("opt_s", "optimizer step"),
                                     ("e2e_s", "end-to-end step"))):
      ax = axes[i][j]
      for name in names:
        pts = [(rates.index(c["rate"]), c["rows"][name][key] * 1e3)
               for c in configs if c["procs"] == n and name in c["rows"]]
        if pts:
          style = "-" if name.startswith("global") else "--" if (
              name.startswith("dlion")) else ":"
          ax.plot(*zip(*pts), style, marker="o", label=name,
                  color=colors[name])
      ax.set_yscale("log")
      ax.set_xticks(range(len(rates)), rates)
      ax.set_title(f"{what}, {n} processes")
      ax.set_ylabel("ms (median)")
      ax.grid(True, which="both", alpha=0.3)
  handles = {}
  for ax in axes.flat:
    handles.update(zip(*reversed(ax.get_legend_handles_labels())))
  fig.legend([handles[n] for n in names], names, loc="outside right center",
             fontsize=8)
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


def report(configs: list[dict], spec: dict, elapsed: float, notes) -> str:
  """The markdown report."""
  first = configs[0]
  body = [row for c in configs for row in table_rows(c)]
  size = spec["size"]
  skipped = {k: v for c in configs for k, v in c["skipped"].items()}
  parts = [
      f"Model: byte-level GPT dim {size['dim']}, depth {size['depth']}, "
      f"heads {size['heads']}: {first['num_params']:,} parameters in "
      f"{len(first['leaf_sizes'])} leaves; {size['batch']} sequences of "
      f"{size['seq_len']} bytes per worker from {spec['text']}. "
      f"{spec['steps']} timed rounds after {spec['warmup']} warm-up, rows "
      "interleaved; medians. Forward/backward sends "
      f"{first['grad_bytes']:.0f} bytes.",
      "",
      bench_table(body),
      "",
      *[f"- {line}" for line in headline(configs)],
      *[f"- skipped {k}: {v}" for k, v in skipped.items()],
      *[f"- {note}" for note in notes],
      f"- took {elapsed:.0f} s",
  ]
  return "\n".join(parts)


def bench_table(body) -> str:
  from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
  return reporting.markdown_table(HEADERS, body)


def _load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit",
                                                     "none"])
  parser.add_argument("--params", default="8M", choices=list(PRESETS),
                      help="GPT size preset")
  parser.add_argument("--steps", type=int, default=5, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--rows", default="all",
                      help="row set (all, core) or names, comma-separated")
  parser.add_argument("--rows-above-2", default="core",
                      help="rows for more than 2 processes")
  parser.add_argument("--text", default=TEXT, help="training text file")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--timeout", type=float, default=1800,
                      help="seconds per (procs, rate) launch")
  parser.add_argument("--out", default=None, help="also write markdown here")
  parser.add_argument("--plot", default=None, help="write the PNG here")
  parser.add_argument("--json", default=None, help="write raw results here")
  parser.add_argument("--from-json", metavar="FILE", default=None,
                      help="report (and plot) results saved by --json "
                      "instead of running")
  parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def plan(args) -> tuple[list[str], bool, list[str]]:
  """(rates to run, whether to use namespaces, notes) given the privileges."""
  why = can_shape()
  if why is None:
    return list(args.rates), True, []
  kept = [r for r in args.rates if parse_rate(r) is None]
  note = (f"benchmarks.network: shaping the network {why}; running unshaped on "
          f"the machine's loopback only (skipped rates: "
          f"{[r for r in args.rates if r not in kept] or 'none'}).")
  print(note, file=sys.stderr)
  return kept or ["none"], False, [note]


def _write(text: str, out: str | None) -> str:
  """Prints the report; writes it into ``out`` (between its
  ``<!-- bench.network: begin/end -->`` markers, if it has them)."""
  from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
  return reporting.write_section(text, out, "bench.network")


def main(argv=None) -> str:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(pathlib.Path(args.worker).read_text()))
    return ""
  start = time.perf_counter()
  base = {"size": dataclasses.asdict(PRESETS[args.params]), "text": args.text,
          "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
          "init_timeout": 120}
  if args.from_json:
    saved = json.loads(pathlib.Path(args.from_json).read_text())
    if args.plot:
      plot(saved["configs"], args.plot)
    return _write(report(saved["configs"], saved["spec"], saved["elapsed"],
                         saved["notes"]), args.out)
  rates, shaped, notes = plan(args)
  notes.append(f"load average before: {_load()}")
  configs = []
  for procs in args.procs:
    names = select_rows(args.rows if procs <= 2 else args.rows_above_2)
    for rate in rates:
      t = time.perf_counter()
      configs.append(run_config(procs, rate, dict(base, rows=names),
                                shaped=shaped, timeout=args.timeout))
      notes.append(f"{procs} procs, {rate}: {time.perf_counter() - t:.0f} s")
  notes.append(f"load average after: {_load()}")
  if args.plot:
    plot(configs, args.plot)
  elapsed = time.perf_counter() - start
  if args.json:
    from dlion_jax.bench import reporting  # pylint: disable=g-import-not-at-top
    reporting.write_json(args.json, {"configs": configs, "spec": base,
                                     "elapsed": elapsed, "notes": notes},
                         indent=1)
  return _write(report(configs, base, elapsed, notes), args.out)


if __name__ == "__main__":
  main()
