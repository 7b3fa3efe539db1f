"""Step time at cluster scale: an alpha-beta model calibrated on measured rows.

A training step is compute followed by the step's collectives (the
optimizer's one message leaves after the backward pass, so nothing
overlaps; with ``--overlap``, a row with ``bucket_bytes`` hides the share
of its exchange that ``benchmarks.overlap`` measured)::

  t_step = t_compute + sum_c (messages_c * latency + bits_c / bandwidth)

``bits_c`` are the bits that cross the collective's bottleneck, which depends
on the pattern and on where the peers sit (Thakur et al., 2005, "Optimization
of Collective Communication Operations in MPICH"):

* **hub** (one shared medium, like the tc-shaped loopback of
  ``benchmarks/network.py``): every device's bytes go through the one queue,
  ``p * S`` for ``p`` devices sending ``S`` each, whatever the pattern.
* **one link class** (a node's NVLink, or one device per node): each device
  sends ``S`` through its own link, in parallel.
* **two link classes**, ``n`` nodes of ``k`` devices, a flat collective over
  all ``p = n k``: a ring (all-reduce, all-gather) is laid out node by node,
  and with one ring per device of a node (NCCL's channels) each node sends
  ``S`` through its network links; an all-to-all sends the share
  ``(p - k) / (p - 1)`` of every device's bytes off the node,
  ``k (p - k) / (p - 1)`` times what a ring of the same ``S`` sends through
  the node's links (7.1x for 8 nodes of 8, 2.3x for 2 nodes of 4).
* **hybrid** (``make_train_step(..., shard_axis=...)``): an exact fp32
  reduce-scatter and all-gather inside each node, and votes between the ``n``
  devices that hold the same ``1/k`` of the parameters.

The constants (per-message latency, the share of the shaped rate that the
wire delivers, the unshaped loopback's bandwidth) are fitted on the
2-process rows of ``docs/data/network.json`` (read by default); the
4-process rows
are held out and predicted. Compute is each row's unshaped step less its
measured exchange. The measured rows check the one-link (hub) rule only; the
two-level rules and the projections' link constants are assumptions that
no measurement here tests. Then the model projects the NeurIPS paper's
setting (3B params, 64 A100s, 8 per node) and finds, per model size and
compute time, the link speeds below which Distributed Lion wins by 2x, 5x
and 10x.

Usage::

  python -m benchmarks.project [--measured NETWORK.json]
      [--out docs/benchmarks.md] [--plot docs/img/projection.png]
      [--aot AOT_ROWS.json] [--overlap OVERLAP.json]

With ``--aot`` (the rows of ``python -m dlion_jax.bench.aot --json``) it
adds TPU multislice exchange times computed from the bytes each link class
carries as read off the real TPU executables; the link speeds there are
assumptions (the published per-chip ICI bandwidth, a grid of DCN rates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
import pathlib
import re
from typing import Sequence

import numpy as np

from dlion_jax import accounting
from dlion_jax import bench
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax.bench import reporting

# What benchmarks/network.py measured, in this checkout.
MEASURED = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "data"
            / "network.json")
MARKER = "bench.project"
# The NeurIPS paper's step times (ms) for its 3B model on 64 A100s.
PAPER_MS = {"AdamW, fp32 all-reduce": 291.0, "Lion, fp32 all-reduce": 288.0,
            "D-Lion MaVo, int8 psum (paper)": 207.0}
PAPER_PARAMS = 3e9
# The rows the constants are fitted on; the others are held out.
FIT_PROCS = 2
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
GROUPS = ("all", "node", "across")


@dataclasses.dataclass(frozen=True)
class Link:
  """One class of link: ``bandwidth`` in bits/s, ``latency`` s a message.

  ``burst``: bits a token-bucket shaper lets through at once when an
  exchange starts after an idle link (tc ``tbf``'s bucket).
  """
  name: str
  bandwidth: float
  latency: float = 0.0
  burst: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cluster:
  """``nodes`` machines of ``per_node`` devices.

  ``fast`` is each device's link inside a node; ``slow`` each node's
  aggregate network bandwidth (all its NICs).
  """
  name: str
  nodes: int
  per_node: int
  fast: Link
  slow: Link

  @property
  def devices(self) -> int:
    return self.nodes * self.per_node


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a step: ``bits`` each device sends per model param,
  among ``group``: ``'all'`` devices, each ``'node'``'s, or ``'across'``
  (one device per node, every node's devices in parallel). ``every``: it
  runs once every ``every`` steps (the outer step of
  :func:`dlion_jax.local_steps`), its time averaged over them."""
  kind: str
  bits: float
  group: str = "all"
  every: int = 1

  def __post_init__(self):
    if isinstance(self.every, bool) or not isinstance(self.every, int) \
        or self.every < 1:
      raise ValueError(f"Collective every={self.every!r} must be a positive "
                       "int: the steps of a round it runs once in.")
    if self.kind not in KINDS:
      raise ValueError(f"Collective kind={self.kind!r} is not one of "
                       f"{KINDS}; name the pattern the collective runs.")
    if self.group not in GROUPS:
      raise ValueError(f"Collective group={self.group!r} is not one of "
                       f"{GROUPS}: 'all' devices, a 'node', or 'across' "
                       "nodes.")


def messages(kind: str, peers: int) -> int:
  """Sequential messages of a ring all-reduce, reduce-scatter or
  all-gather, or of a pairwise all-to-all, among ``peers``."""
  if peers <= 1:
    return 0
  return (2 if kind == "all-reduce" else 1) * (peers - 1)


def hub_seconds(plan: Sequence[Collective], params: float, devices: int,
                link: Link) -> float:
  """An exchange with all ``devices``' bits through one shared medium."""
  # The bucket empties once an exchange: a round's, for a plan of rounds.
  seconds = 0.0
  for every in {c.every for c in plan}:
    part = [c for c in plan if c.every == every]
    bits = devices * params * sum(c.bits for c in part)
    seconds += (sum(messages(c.kind, devices) for c in part) * link.latency
                + max(bits - link.burst, 0.0) / link.bandwidth) / every
  return seconds


def cluster_seconds(c: Collective, params: float, cluster: Cluster) -> float:
  """One collective on a two-level cluster (see the module docstring),
  averaged over the ``c.every`` steps it runs once in."""
  return _once(c, params, cluster) / c.every


def _once(c: Collective, params: float, cluster: Cluster) -> float:
  n, k = cluster.nodes, cluster.per_node
  sent = c.bits * params
  if c.group == "node":
    return messages(c.kind, k) * cluster.fast.latency + (
        sent / cluster.fast.bandwidth if k > 1 else 0.0)
  if c.group == "across":
    return messages(c.kind, n) * cluster.slow.latency + (
        k * sent / cluster.slow.bandwidth if n > 1 else 0.0)
  p = n * k
  if n == 1:
    return messages(c.kind, p) * cluster.fast.latency + (
        sent / cluster.fast.bandwidth)
  off_node = (p - k) / (p - 1) if c.kind == "all-to-all" else 1 / k
  return messages(c.kind, p) * cluster.slow.latency + max(
      k * off_node * sent / cluster.slow.bandwidth,
      (1 - off_node) * sent / cluster.fast.bandwidth)


# --- What each optimizer sends ---------------------------------------------

def global_plan(n: int, dtype: str = "float32") -> list[Collective]:
  """Gradients averaged by a ring all-reduce (global AdamW or Lion)."""
  return [Collective("all-reduce", accounting.allreduce_bits(n, dtype))]


def vote_plan(n: int, *, aggregation: str = "mavo", comm: str = "auto",
              spec: quantize.VoteSpec = quantize.BINARY,
              group: str = "all", share: float = 1.0) -> list[Collective]:
  """Distributed Lion's vote exchange among ``n`` voters, each on ``share``
  of the params (``comm='auto'``: the cheapest, as the transform picks)."""
  if n == 1:
    return []
  if comm == "auto":
    comm = message.choose_comm(n, aggregation=aggregation, spec=spec)
  return [Collective(op, bits * share, group)
          for op, bits in message.collective_bits(
              n, aggregation=aggregation, spec=spec, comm=comm)]


def hybrid_plan(cluster: Cluster, *, aggregation: str = "mavo"
                ) -> list[Collective]:
  """fp32 reduce-scatter in a node, votes across nodes on ``1/k`` of the
  params, fp32 all-gather of the new shards in the node."""
  k = cluster.per_node
  inside = (k - 1) / k * 32
  return ([Collective("reduce-scatter", inside, "node")]
          + vote_plan(cluster.nodes, aggregation=aggregation,
                      group="across", share=1 / k)
          + [Collective("all-gather", inside, "node")])


def local_steps_plan(plan: Sequence[Collective], every: int
                     ) -> list[Collective]:
  """``plan`` as the outer step of :func:`dlion_jax.local_steps` sends it:
  once a round of ``every`` steps, nothing in between."""
  return [dataclasses.replace(c, every=every) for c in plan]


def exchange_seconds(plan: Sequence[Collective], params: float,
                     cluster: Cluster) -> float:
  """Seconds of a step's collectives, one after the other, on ``cluster``."""
  return sum(cluster_seconds(c, params, cluster) for c in plan)


# --- Calibration on the measured rows ----------------------------------------

REMEASURE = ("measure it again with `python -m benchmarks.network` (a "
             "checkout's), or remove it from the file")
# What check_measured asks of each row: field and unit.
ROW_FIELDS = (("wire_bytes", "bytes"), ("exchange_s", "seconds"),
              ("e2e_s", "seconds"))


def check_measured(data) -> None:
  """Raises ValueError naming the first entry of a network.json that the
  model cannot use (config, row, field and value) and what to do."""
  configs = data.get("configs") if isinstance(data, dict) else None
  if not isinstance(configs, list) or not configs:
    got = (f"'configs' is {configs!r}" if isinstance(data, dict)
           else f"a {type(data).__name__}, not an object")
    raise ValueError(f"has no measured runs ({got}); pass the JSON that "
                     "`python -m benchmarks.network --json FILE` wrote.")
  for i, config in enumerate(configs):
    _check_config(i, config)
  unshaped = {(c["procs"], name) for c in configs if c["rate"] == "none"
              for name in c["rows"]}
  for i, config in enumerate(configs):
    for name in config["rows"]:
      if (config["procs"], name) not in unshaped:
        raise ValueError(
            f"configs[{i}], row {name!r} at {config['procs']} processes has "
            "no unshaped (rate 'none') run to read its compute from; "
            "measure it with `python -m benchmarks.network` including rate "
            "none.")
  for shaped, what in ((True, "with a shaped rate"), (False, "at rate none")):
    if sum(len(c["rows"]) for c in configs if c["procs"] == FIT_PROCS
           and (c["rate"] != "none") == shaped) < 2:
      raise ValueError(
          f"has fewer than 2 rows of a {FIT_PROCS}-process run {what}; the "
          "model's constants are fitted on them: measure them with "
          f"`python -m benchmarks.network --procs {FIT_PROCS} ...`.")


def _check_config(i: int, config) -> None:
  if not isinstance(config, dict):
    raise ValueError(f"configs[{i}] is {config!r}, not an object; "
                     f"{REMEASURE}.")
  where = (f"configs[{i}] (procs={config.get('procs')!r}, "
           f"rate={config.get('rate')!r})")
  for key in ("procs", "rate", "rows"):
    if key not in config:
      raise ValueError(f"{where}: has no {key!r}; {REMEASURE}.")
  procs = config["procs"]
  if not isinstance(procs, int) or isinstance(procs, bool) or procs < 2:
    raise ValueError(f"{where}: procs={procs!r} must be an int >= 2 (a "
                     f"single process exchanges nothing); {REMEASURE}.")
  try:
    _rate(config["rate"])
  except ValueError as e:
    raise ValueError(f"{where}: {e} Correct it, {REMEASURE}.") from None
  if not isinstance(config["rows"], dict):
    raise ValueError(f"{where}: rows={config['rows']!r} must be an object "
                     f"of measured rows by name; {REMEASURE}.")
  for name, row in config["rows"].items():
    _check_row(f"{where}, row {name!r}", row)


def _check_row(where: str, row) -> None:
  if not isinstance(row, dict):
    raise ValueError(f"{where}: is {row!r}, not an object; {REMEASURE}.")
  for field in [f for f, _ in ROW_FIELDS] + ["ops"]:
    if field not in row:
      raise ValueError(f"{where}: has no {field!r}; {REMEASURE}.")
  for field, unit in ROW_FIELDS:
    value = row[field]
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
      raise ValueError(f"{where}: {field}={value!r} must be a positive "
                       f"number of {unit}; {REMEASURE}.")
  if row["e2e_s"] <= row["exchange_s"]:
    raise ValueError(
        f"{where}: e2e_s={row['e2e_s']!r} is not longer than its "
        f"exchange_s={row['exchange_s']!r}, but a step is its compute and "
        f"its exchange; {REMEASURE}.")
  ops = row["ops"]
  unknown = [k for k in str(ops).split("+") if k not in KINDS]
  if not isinstance(ops, str) or unknown:
    raise ValueError(f"{where}: ops={ops!r} names {unknown[0]!r}, not one "
                     f"of {KINDS} joined by '+'; {REMEASURE}.")


def measured_rows(data: dict) -> list[dict]:
  """One dict per measured (row, procs, rate) of network.json, with the
  compute read off the same row's unshaped configuration.

  Raises:
    ValueError: an entry the model cannot use (see :func:`check_measured`).
  """
  check_measured(data)
  unshaped = {(c["procs"], name): r for c in data["configs"]
              if c["rate"] == "none" for name, r in c["rows"].items()}
  out = []
  for config in data["configs"]:
    for name, r in config["rows"].items():
      base = unshaped[(config["procs"], name)]
      out.append(dict(
          name=name, procs=config["procs"], rate=config["rate"],
          bits=r["wire_bytes"] * 8, kinds=r["ops"].split("+"),
          exchange_s=r["exchange_s"], step_s=r["e2e_s"],
          compute_s=base["e2e_s"] - base["exchange_s"]))
  return out


def _rate(rate: str) -> float | None:
  """bits/s of a tc rate (``'100mbit'``), ``None`` for ``'none'``."""
  if rate == "none":
    return None
  m = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmg])bit", str(rate))
  if m is None or float(m[1]) <= 0:
    raise ValueError(f"rate={rate!r} is not a positive tc rate like "
                     "'100mbit', '1gbit' or 'none'.")
  return float(m[1]) * {"k": 1e3, "m": 1e6, "g": 1e9}[m[2]]


# tc's "256kb" bucket of benchmarks/network.py (tc's kb is 1,024 bytes).
TBF_BURST_BITS = 256 * 1024 * 8


def _row_terms(row: dict) -> tuple[float, float]:
  """(messages, bits through the hub after the burst) of a measured row."""
  p = row["procs"]
  burst = 0 if row["rate"] == "none" else TBF_BURST_BITS
  return (sum(messages(k, p) for k in row["kinds"]),
          max(p * row["bits"] - burst, 0.0))


def fit(rows: Sequence[dict]) -> dict:
  """Least-squares constants in relative error: per-message latency and
  the delivered share of the rate beyond the burst (shaped rows), latency
  and bandwidth of the unshaped loopback.

  A negative latency has no meaning; where the unconstrained fit gives one,
  the latency is set to 0 and the bandwidth refitted alone. The
  unconstrained values are returned too (``*_unconstrained_s``) so that a
  report can say so.
  """
  def solve(subset, design):
    a = np.array([design(r) for r in subset]) / np.array(
        [[r["exchange_s"]] for r in subset])
    free, *_ = np.linalg.lstsq(a, np.ones(len(subset)), rcond=None)
    if free[0] >= 0:
      return free, free[0]
    inv_bw = np.linalg.lstsq(a[:, 1:], np.ones(len(subset)), rcond=None)[0]
    return np.array([0.0, inv_bw[0]]), free[0]
  shaped = [r for r in rows if r["rate"] != "none"]
  unshaped = [r for r in rows if r["rate"] == "none"]
  (lat, inv_eff), lat_free = solve(shaped, lambda r: (
      _row_terms(r)[0], _row_terms(r)[1] / _rate(r["rate"])))
  (lo_lat, inv_bw), lo_free = solve(unshaped, _row_terms)
  return {"latency_s": float(lat), "efficiency": float(1 / inv_eff),
          "loopback_latency_s": float(lo_lat),
          "loopback_bits_per_s": float(1 / inv_bw),
          "latency_unconstrained_s": float(lat_free),
          "loopback_latency_unconstrained_s": float(lo_free)}


def hub_link(rate: str, constants: dict) -> Link:
  """The calibrated shared link (a hub) of a measured configuration."""
  bw = _rate(rate)
  if bw is None:
    return Link("loopback", constants["loopback_bits_per_s"],
                constants["loopback_latency_s"])
  return Link(rate, constants["efficiency"] * bw, constants["latency_s"],
              burst=TBF_BURST_BITS)


def predict(row: dict, constants: dict) -> tuple[float, float]:
  """(exchange, step) seconds the model gives a measured row."""
  share = row["bits"] / len(row["kinds"])
  plan = [Collective(kind, share) for kind in row["kinds"]]
  exchange = hub_seconds(plan, 1.0, row["procs"],
                         hub_link(row["rate"], constants))
  return exchange, row["compute_s"] + exchange


# --- Projections ------------------------------------------------------------

def a100_clusters(nodes: int = 8, per_node: int = 8) -> list[Cluster]:
  """The two interconnects we assume for 64 A100s, 8 per node."""
  nvlink = Link("NVLink 3 (300 GB/s a GPU)", 300e9 * 8, 5e-6)
  return [
      Cluster("8x HDR InfiniBand a node (1.6 Tb/s)", nodes, per_node, nvlink,
              Link("InfiniBand", 8 * 200e9, 10e-6)),
      Cluster("100 Gb/s Ethernet a node", nodes, per_node, nvlink,
              Link("Ethernet", 100e9, 30e-6)),
  ]


def paper_plans(cluster: Cluster) -> dict[str, list[Collective]]:
  """The rows of the paper table: the paper's three optimizers, bf16 and
  dlion_jax's flat and hybrid layouts, each as the collectives it sends."""
  p = cluster.devices
  return {
      "AdamW, fp32 all-reduce": global_plan(p),
      "Lion, fp32 all-reduce": global_plan(p),
      "Lion, bf16 all-reduce": global_plan(p, "bfloat16"),
      "D-Lion MaVo, int8 psum (paper)": vote_plan(p, comm="psum_int8"),
      "dlion_jax MaVo auto, flat": vote_plan(p),
      "dlion_jax Avg auto, flat": vote_plan(p, aggregation="avg"),
      "dlion_jax MaVo, hybrid": hybrid_plan(cluster),
      "dlion_jax Avg, hybrid": hybrid_plan(cluster, aggregation="avg"),
  }


def paper_compute_s(cluster: Cluster) -> float:
  """Compute time that makes the model reproduce the paper's D-Lion 207 ms
  on ``cluster`` (the one paper figure the projection is fitted to)."""
  key = "D-Lion MaVo, int8 psum (paper)"
  compute = PAPER_MS[key] / 1e3 - exchange_seconds(
      paper_plans(cluster)[key], PAPER_PARAMS, cluster)
  if compute <= 0:
    raise ValueError(f"cluster {cluster.name!r}: the int8 psum alone takes "
                     f"longer than the paper's {PAPER_MS[key]:.0f} ms step; "
                     "its links are too slow to be the paper's.")
  return compute


def with_slow_bandwidth(cluster: Cluster, bits_per_s: float) -> Cluster:
  """``cluster`` with its network (between nodes) at ``bits_per_s``."""
  return dataclasses.replace(
      cluster, slow=dataclasses.replace(cluster.slow, bandwidth=bits_per_s))


def speedup(plan, baseline, params: float, compute_s: float,
            cluster: Cluster) -> float:
  """Step-time ratio baseline / plan."""
  return ((compute_s + exchange_seconds(baseline, params, cluster))
          / (compute_s + exchange_seconds(plan, params, cluster)))


# The network bandwidths (bits/s a node) break_even searches.
BANDWIDTH_RANGE = (1e6, 1e14)


def break_even(target: float, plan, baseline, params: float,
               compute_s: float, cluster: Cluster) -> float | None:
  """Network bandwidth (bits/s a node) below which ``plan`` is at least
  ``target`` times faster than ``baseline``.

  The speedup need not grow monotonically as the link slows (on a fast
  network NVLink caps the fp32 ring, not the network), so a log grid over
  ``BANDWIDTH_RANGE`` finds the first bandwidth, counting up from the
  slowest, where the target is lost, and bisection refines it.

  Returns:
    The bandwidth; ``None`` where even the slowest link misses the target;
    ``math.inf`` where every bandwidth in the range reaches it.
  """
  def gain(bw):
    return speedup(plan, baseline, params, compute_s,
                   with_slow_bandwidth(cluster, bw))
  grid = np.logspace(*np.log10(BANDWIDTH_RANGE), 161)
  wins = [gain(bw) >= target for bw in grid]
  if not wins[0]:
    return None
  if all(wins):
    return math.inf
  lost = wins.index(False)
  lo, hi = grid[lost - 1], grid[lost]
  for _ in range(60):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if gain(mid) >= target else (lo, mid)
  return float(lo)


# --- Report -----------------------------------------------------------------

def _ms(s: float) -> str:
  return f"{s * 1e3:,.1f}"


def _gbit(bw: float | None) -> str:
  if bw is None:
    return "never"
  if math.isinf(bw):
    return f"any (to {BANDWIDTH_RANGE[1] / 1e12:g} Tb/s)"
  return f"{bw / 1e9:,.2f}"


def validation_table(rows, constants) -> tuple[str, str]:
  """The model beside every measured row, and a summary of its errors on
  the steps and on the exchanges alone."""
  table, step_err, ratios = [], {}, {}
  for r in rows:
    exchange, step = predict(r, constants)
    err = step / r["step_s"] - 1
    held_out = r["procs"] != FIT_PROCS
    step_err.setdefault(held_out, []).append(abs(err))
    ratio = exchange / r["exchange_s"]
    ratios.setdefault(r["rate"] != "none", []).append(ratio)
    table.append([r["name"], r["procs"], r["rate"],
                  "held out" if held_out else "fit", _ms(exchange),
                  _ms(r["exchange_s"]), f"{ratio:.2f}",
                  _ms(step), _ms(r["step_s"]), f"{err:+.0%}"])
  headers = ["row", "procs", "rate", "set", "exchange ms, model",
             "exchange ms, measured", "model / measured", "step ms, model",
             "step ms, measured", "step error"]
  def spread(shaped):
    x = ratios.get(shaped, [])
    if not x:
      return "none measured"
    off = sum(abs(v - 1) > 0.2 for v in x)
    return (f"{min(x):.2f} to {max(x):.2f}, {off} of {len(x)} off by more "
            "than 20%")
  return reporting.markdown_table(headers, table), (
      f"Worst step error: {max(step_err[False]):.1%} on the fitted rows, "
      f"{max(step_err.get(True, [0.0])):.1%} on the held-out rows "
      f"({len(rows)} rows). Exchanges alone, model / measured: shaped "
      f"links {spread(True)}; unshaped loopback {spread(False)}.")


def paper_table(clusters: Sequence[Cluster], compute: float,
                hidden: float | None = None) -> str:
  """The paper's figures beside the first cluster's rows; with ``hidden``
  (:func:`hidden_share`), also the flat MaVo row with that share of its
  exchange hidden behind the backward pass by ``bucket_bytes``."""
  rows = []
  for cluster in clusters:
    for name, plan in paper_plans(cluster).items():
      ex = exchange_seconds(plan, PAPER_PARAMS, cluster)
      paper = PAPER_MS.get(name) if cluster is clusters[0] else None
      rows.append([cluster.name, name, _ms(ex), _ms(compute + ex),
                   "-" if paper is None else f"{paper:.0f}"])
      if hidden is not None and name == "dlion_jax MaVo auto, flat":
        rows.append([cluster.name, f"{name}, buckets ({hidden:.0%} of the "
                     "exchange hidden, as measured)", _ms(ex),
                     _ms(overlapped_step_s(compute, ex, hidden)), "-"])
  return reporting.markdown_table(
      ["interconnect", "optimizer", "exchange ms", "step ms, model",
       "step ms, paper"], rows)


def overlapped_step_s(compute_s: float, exchange_s: float,
                      hidden: float) -> float:
  """A step whose exchange overlaps the backward pass by the share
  ``hidden``: ``compute + (1 - hidden) exchange``, never below
  ``max(compute, exchange)`` (what full overlap would give)."""
  return max(compute_s + (1.0 - hidden) * exchange_s,
             max(compute_s, exchange_s))


def hidden_share(overlap: dict, *, procs: int = 2,
                 rate: str = "100mbit") -> tuple[float, str]:
  """The share of the exchange that buckets hid in a run of
  ``python -m benchmarks.overlap --json``, and where it was measured.

  With ``T1`` one message's step at ``rate``, ``T0`` the same step on the
  unshaped loopback (compute and a fast exchange) and ``Tb`` the best
  bucketed step at ``rate``: ``(T1 - Tb) / (T1 - T0)``.
  """
  configs = {(c["procs"], c["rate"]): c for c in overlap["configs"]}
  try:
    shaped, unshaped = configs[(procs, rate)], configs[(procs, "none")]
  except KeyError:
    raise ValueError(
        f"the overlap runs have no {procs}-process rows at {rate} and "
        "unshaped (none); run benchmarks.overlap with --procs "
        f"{procs} --rates {rate} none") from None
  one, compute = shaped["runs"][0], unshaped["runs"][0]
  best = min(shaped["runs"][1:], key=lambda r: r["median_s"])
  share = ((one["median_s"] - best["median_s"])
           / (one["median_s"] - compute["median_s"]))
  return share, (f"{procs} processes at {rate}, buckets of "
                 f"{best['budget']:,} B: the step {one['median_s'] * 1e3:.0f}"
                 f" -> {best['median_s'] * 1e3:.0f} ms, "
                 f"{compute['median_s'] * 1e3:.0f} ms unshaped")


def paper_gap(cluster: Cluster) -> str:
  """What the int8 psum saves over the fp32 all-reduce, model against
  paper: the one comparison the fitted compute time does not absorb."""
  plans = paper_plans(cluster)
  int8 = "D-Lion MaVo, int8 psum (paper)"
  saved = (exchange_seconds(plans["Lion, fp32 all-reduce"], PAPER_PARAMS,
                            cluster)
           - exchange_seconds(plans[int8], PAPER_PARAMS, cluster))
  adamw, lion = (PAPER_MS[f"{name}, fp32 all-reduce"] - PAPER_MS[int8]
                 for name in ("AdamW", "Lion"))
  return (f"On {cluster.name}, the int8 psum saves {_ms(saved)} ms a step "
          "over the fp32 all-reduce in the model; the paper measured "
          f"{adamw:.0f} ms (AdamW) and {lion:.0f} ms (Lion).")


# (params, compute seconds a step) of the break-even table.
BREAK_EVEN_CASES = ((125e6, 0.1), (1.3e9, 0.1), (1.3e9, 1.0), (7e9, 1.0),
                    (70e9, 1.0), (70e9, 10.0))
TARGETS = (2, 5, 10)


def break_even_table(cluster: Cluster, cases) -> str:
  baseline = global_plan(cluster.devices)
  plans = {"flat MaVo auto": vote_plan(cluster.devices),
           "hybrid MaVo": hybrid_plan(cluster)}
  rows = []
  for params, compute in cases:
    for name, plan in plans.items():
      rows.append([f"{params / 1e9:g}B", _ms(compute), name] + [
          _gbit(break_even(t, plan, baseline, params, compute, cluster))
          for t in TARGETS])
  return reporting.markdown_table(
      ["params", "compute ms", "D-Lion layout"]
      + [f"{t}x below (Gb/s a node)" for t in TARGETS], rows)


# Steps a round of the local-steps rows (H = 1: an exchange every step).
LOCAL_STEPS = (1, 8, 32, 128)


def local_steps_table(clusters: Sequence[Cluster], compute: float) -> str:
  """The paper's 3B model with local steps: Distributed Lion's vote as the
  outer step (flat MaVo auto) against DiLoCo's fp32 all-reduce, once a
  round of ``H`` steps; each step's exchange averaged over the round, and
  the speedup over global Lion's fp32 all-reduce every step."""
  rows = []
  for cluster in clusters:
    p = cluster.devices
    baseline = global_plan(p)
    for h in LOCAL_STEPS:
      cells = [cluster.name, str(h)]
      for plan in (vote_plan(p), global_plan(p)):
        plan = local_steps_plan(plan, h)
        ex = exchange_seconds(plan, PAPER_PARAMS, cluster)
        cells += [_ms(ex), _ms(compute + ex), "{:.2f}x".format(
            speedup(plan, baseline, PAPER_PARAMS, compute, cluster))]
      rows.append(cells)
  return reporting.markdown_table(
      ["interconnect", "H", "D-Lion outer: exchange ms a step", "step ms",
       "speedup", "DiLoCo outer (fp32): exchange ms a step", "step ms",
       "speedup"], rows)


def plot(rows, constants, cluster: Cluster, compute: float, path: str
         ) -> None:
  """Model against measurement (left); projected speedup against the
  network bandwidth of ``cluster`` (right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for held, marker in ((False, "o"), (True, "^")):
    pts = [(r["step_s"], predict(r, constants)[1]) for r in rows
           if (r["procs"] != FIT_PROCS) == held]
    left.scatter(*zip(*pts), marker=marker,
                 label="held out (4 procs)" if held else "fit (2 procs)")
  lim = np.array([0.5, 25])
  left.plot(lim, lim, "k-", lw=0.8)
  left.fill_between(lim, lim * 0.8, lim * 1.2, color="grey", alpha=0.2,
                    label="within 20%")
  left.set(xscale="log", yscale="log", xlabel="measured step (s)",
           ylabel="model step (s)", title="Measured rows (network.json)")
  left.legend()
  bws = np.logspace(9, 13, 60)
  baseline = global_plan(cluster.devices)
  for name, plan in paper_plans(cluster).items():
    if "fp32" in name:
      continue
    right.plot(bws / 1e9, [speedup(plan, baseline, PAPER_PARAMS, compute,
                                   with_slow_bandwidth(cluster, b))
                           for b in bws], label=name)
  for bw, what in ((100e9, "100GbE"), (1.6e12, "8x HDR IB")):
    right.axvline(bw / 1e9, color="grey", ls=":")
    right.text(bw / 1e9, 1.02, what, rotation=90, va="bottom", fontsize=8)
  right.set(xscale="log", yscale="log", xlabel="network bandwidth a node "
            "(Gb/s)", ylabel="step speedup over fp32 all-reduce",
            title=f"3B params, {cluster.devices} A100s, compute "
            f"{compute * 1e3:.0f} ms")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _clamped(unconstrained_s: float) -> str:
  if unconstrained_s >= 0:
    return ""
  return (f" (clamped at 0: the unconstrained fit gives "
          f"{unconstrained_s * 1e3:+.1f} ms)")


def report(data: dict, plot_path: str | None = None,
           overlap: dict | None = None) -> str:
  """The section of docs/benchmarks.md: constants, validation, paper
  projection and break-even table (and the figure at ``plot_path``); with
  ``overlap`` (``benchmarks.overlap --json``) the bucketed row too."""
  rows = measured_rows(data)
  constants = fit([r for r in rows if r["procs"] == FIT_PROCS])
  table, summary = validation_table(rows, constants)
  clusters = a100_clusters()
  compute = paper_compute_s(clusters[0])
  if plot_path:
    plot(rows, constants, clusters[0], compute, plot_path)
  hidden, where = hidden_share(overlap) if overlap is not None else (
      None, None)
  c = constants
  return "\n\n".join([
      f"Constants fitted on the {FIT_PROCS}-process rows: latency "
      f"{c['latency_s'] * 1e6:.0f} us a message"
      + _clamped(c["latency_unconstrained_s"])
      + f", the shaped link delivers {c['efficiency']:.1%} of its rate; "
      f"unshaped loopback {c['loopback_bits_per_s'] / 1e9:.2f} Gb/s "
      f"shared, latency {c['loopback_latency_s'] * 1e6:.0f} us"
      + _clamped(c["loopback_latency_unconstrained_s"])
      + ". Compute: each row's unshaped step less its measured exchange.",
      table,
      summary,
      "Projection to the NeurIPS paper's setting (3B params, 64 A100s, 8 a "
      "node), compute "
      f"{compute * 1e3:.0f} ms (the paper's D-Lion 207 ms less its "
      "modelled exchange on InfiniBand):",
      paper_table(clusters, compute, hidden),
      *([f"The buckets row assumes the share of the exchange that "
         f"bucket_bytes hid on XLA:CPU ({where}; benchmarks.overlap) hides "
         "there too; no other row overlaps anything."]
        if overlap is not None else []),
      paper_gap(clusters[0]),
      "With local steps (`dl.local_steps`, `optimizer.local_steps`), the "
      "same model and compute, an outer exchange once a round of H steps "
      "and nothing in between; the round's last step pays the whole "
      "exchange, the table its average over the round (speedups over "
      "global Lion's fp32 all-reduce every step). What H costs in accuracy "
      "is measured in docs/training.md (\"Local steps\"), not modelled "
      "here:",
      local_steps_table(clusters, compute),
      f"Break-even network bandwidths, {clusters[0].devices} devices, "
      f"{clusters[0].per_node} a node on NVLink, against global Lion's fp32 "
      "all-reduce:",
      break_even_table(clusters[0], ((PAPER_PARAMS, compute),)
                       + BREAK_EVEN_CASES),
  ])


# ICI bandwidth a chip sends at (Google's published per-chip figures),
# assumed delivered in full; DCN bandwidth a chip gets, assumed: a grid.
TPU_ICI_BITS_PER_S = {"v5e": 1.6e12, "v5p": 4.8e12, "v6e": 3.2e12}
TPU_DCN_BITS_PER_S = (25e9, 100e9)
_AOT_FIELDS = ("model", "topology", "slices", "variant", "ici_bytes",
               "dcn_bytes")


def tpu_exchange_s(row: dict, dcn_bits_per_s: float) -> float:
  """Seconds a chip's exchange takes on TPU multislice: the bytes that
  ``bench.aot`` read off the executable for each link, over each link's
  bandwidth, one after the other (no overlap, no latency)."""
  ici = TPU_ICI_BITS_PER_S[row["topology"].split(":")[0]]
  return 8 * (row["ici_bytes"] / ici + row["dcn_bytes"] / dcn_bits_per_s)


def check_aot_rows(rows) -> list[dict]:
  """The rows of ``bench.aot --json`` that have bytes; refuses others."""
  if not isinstance(rows, list) or not rows:
    raise ValueError("expected the non-empty list of rows that "
                     "`python -m dlion_jax.bench.aot --json FILE` writes")
  for i, row in enumerate(rows):
    missing = [f for f in _AOT_FIELDS if not isinstance(row, dict)
               or f not in row]
    if missing:
      raise ValueError(f"row {i} lacks {', '.join(missing)}")
    family = str(row["topology"]).split(":")[0]
    if family not in TPU_ICI_BITS_PER_S:
      raise ValueError(
          f"row {i}: topology={row['topology']!r}: no ICI bandwidth for "
          f"{family!r}; known: {', '.join(TPU_ICI_BITS_PER_S)}")
  return rows


def tpu_table(rows: Sequence[dict]) -> str:
  """Exchange time a step per chip on TPU multislice, from the bytes of
  each link read off the executables, against AdamW's on the same layout."""
  adamw = {(r["model"], r["topology"], r["slices"]): r for r in rows
           if r["variant"] == "adamw" and r["dcn_bytes"] is not None}
  headers = ["model", "topology x slices", "variant", "ICI MB", "DCN MB"]
  for bw in TPU_DCN_BITS_PER_S:
    headers += [f"ms at {bw / 1e9:g} Gb/s DCN", "vs AdamW"]
  table = []
  for r in rows:
    line = [r["model"], f"{r['topology']} x {r['slices']}", r["variant"]]
    if r["dcn_bytes"] is None:       # did not compile (e.g. out of HBM)
      error = " ".join(str(r.get("error") or "no bytes read").split())
      error = error.split("RESOURCE_EXHAUSTED: ")[-1]
      table.append(line + [f"not compiled: {error[:120]}"]
                   + [""] * (len(headers) - 4))
      continue
    line += [f"{r['ici_bytes'] / 1e6:,.2f}", f"{r['dcn_bytes'] / 1e6:,.2f}"]
    base = adamw.get((r["model"], r["topology"], r["slices"]))
    for bw in TPU_DCN_BITS_PER_S:
      t = tpu_exchange_s(r, bw)
      line += [f"{t * 1e3:,.3f}", f"{tpu_exchange_s(base, bw) / t:.1f}x"
               if base and t > 0 else ""]
    table.append(line)
  return reporting.markdown_table(headers, table)


def tpu_section(rows: Sequence[dict]) -> str:
  return "\n\n".join([
      "TPU multislice, from the bytes each link carries as read off the "
      "TPU executables (`python -m dlion_jax.bench.aot --json`): a chip's "
      "exchange takes its ICI bytes at the published per-chip ICI bandwidth "
      "(assumed delivered: "
      + ", ".join(f"{k} {v / 1e12:g} Tb/s" for k, v in
                  TPU_ICI_BITS_PER_S.items())
      + ") plus its DCN bytes at an assumed DCN bandwidth per chip, no "
      "overlap and no latency; compute is not modelled (these are exchange "
      "times, and the ratio is AdamW's over the row's):",
      tpu_table(rows)])


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.project",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--measured", default=str(MEASURED),
                      help="network.json of benchmarks/network.py (default: "
                      "the copy of docs/data/network.json the package "
                      "ships)")
  parser.add_argument("--out", help="write the report to this file (between "
                      f"<!-- {MARKER} --> markers when it has them)")
  parser.add_argument("--plot", help="write the figure to this PNG")
  parser.add_argument("--overlap", help="JSON of `python -m "
                      "benchmarks.overlap --json FILE`: adds the flat MaVo "
                      "row with the measured share of its exchange hidden "
                      "by bucket_bytes")
  parser.add_argument("--aot", help="rows of `python -m dlion_jax.bench.aot "
                      "--json FILE`: adds the TPU multislice exchange times "
                      "from the bytes read off the TPU executables")
  args = parser.parse_args(argv)
  if args.plot:
    bench.require_examples(parser, "matplotlib", "--plot")
  try:
    with open(args.measured, encoding="utf-8") as f:
      data = json.load(f)
    check_measured(data)
  except FileNotFoundError:
    parser.error(f"--measured {args.measured}: no such file. Pass the JSON "
                 "that `python -m benchmarks.network --json FILE` wrote.")
  except json.JSONDecodeError as e:
    parser.error(f"--measured {args.measured}: not JSON (line {e.lineno}, "
                 f"column {e.colno}: {e.msg}). Pass the JSON that "
                 "`python -m benchmarks.network --json FILE` wrote.")
  except ValueError as e:
    parser.error(f"--measured {args.measured}: {e}")
  overlap = None
  if args.overlap:
    try:
      with open(args.overlap, encoding="utf-8") as f:
        overlap = json.load(f)
      hidden_share(overlap)
    except (OSError, ValueError, KeyError, TypeError) as e:
      parser.error(f"--overlap {args.overlap}: {e}")
  text = report(data, args.plot, overlap)
  if args.aot:
    try:
      with open(args.aot, encoding="utf-8") as f:
        text += "\n\n" + tpu_section(check_aot_rows(json.load(f)))
    except (OSError, ValueError) as e:
      parser.error(f"--aot {args.aot}: {e}")
  return reporting.write_section(text, args.out, MARKER)


if __name__ == "__main__":
  main()
