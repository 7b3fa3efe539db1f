"""What a training run reports: the progress bar, the bytes its step
sends (read off the compiled step, against an fp32 gradient all-reduce),
the summary it prints and the curves it draws."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import dlion_jax as dl
from dlion_jax.train import optimizers
from dlion_jax.train.config import Config


# Seconds between redraws of a progress bar that is not on a terminal (a
# notebook without widgets, a log file, the launcher's pipes), where every
# redraw is kept: a few lines a run, not one every 0.1 s.
QUIET_REDRAW_S = 10.0


def progress(total: int, initial: int, enabled: bool):
  """A tqdm bar: a widget in a notebook with ipywidgets, else text, redrawn
  every 0.1 s on a terminal and every :data:`QUIET_REDRAW_S` elsewhere."""
  try:
    from tqdm import std  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  tqdm, widget = std.tqdm, False
  if importlib.util.find_spec("ipywidgets") is not None:
    # Without ipywidgets, tqdm.auto would warn in a notebook, then draw text.
    from tqdm import notebook  # pylint: disable=g-import-not-at-top
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    widget = issubclass(tqdm, notebook.tqdm)
  quiet = not widget and not (enabled and sys.stderr.isatty())
  return tqdm(total=total, initial=initial, disable=not enabled,
              unit="step", dynamic_ncols=True,
              mininterval=QUIET_REDRAW_S if quiet else 0.1)


def fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def sent_bytes_per_step(cfg: Config, compiled, steps: int) -> float:
  """Bytes a step sends, read off the compiled step; collectives in a
  conditional (momentum syncs) counted at the rate the schedule runs them.

  On a hybrid mesh this is every collective of a device, over both axes;
  :func:`sent_bytes_by_axis` splits it.
  """
  always = dl.collective_bytes(compiled, conditional=False)
  synced = dl.collective_bytes(compiled) - always
  return always + synced * sync_rate(cfg, steps)


def sent_bytes_by_axis(cfg: Config, compiled, mesh, steps: int) -> dict:
  """:func:`sent_bytes_per_step` split by the mesh axes each collective
  crosses (``"data+fsdp"`` for one that crosses both)."""
  always = dl.collective_bytes_by_axis(compiled, mesh, conditional=False)
  every = dl.collective_bytes_by_axis(compiled, mesh)
  rate = sync_rate(cfg, steps)
  name = lambda key: key if isinstance(key, str) else "+".join(key)
  return {name(k): always[k] + (every[k] - always[k]) * rate
          for k in every if k != ()}


def sync_rate(cfg: Config, steps: int) -> float:
  """The fraction of steps that run the conditional momentum sync (the
  outer step, with local steps)."""
  if cfg.optimizer.local_steps > 1:
    return optimizers.outer_steps(cfg.optimizer, steps) / steps
  schedule = optimizers.sync_schedule(cfg.optimizer)
  if schedule is None or cfg.optimizer.name != "dlion":
    return 0.0
  return schedule.count(steps) / steps


def fp32_allreduce_bytes(cfg: Config, num_params: int) -> float:
  """Bytes a worker's fp32 gradient all-reduce would send a step."""
  return dl.allreduce_bits(cfg.workers) * num_params / 8


def wire_report(cfg: Config, sent_bytes: float, num_params: int,
                steps: int, by_axis: dict | None = None, *,
                totals: tuple[float, float] | None = None) -> dict:
  """Bits sent per step and in total, against an fp32 all-reduce;
  ``by_axis`` (:func:`sent_bytes_by_axis`) adds the measured split.
  ``totals`` (sent, fp32) replaces the per-step figures times ``steps``
  where earlier steps ran on another layout."""
  n = cfg.workers
  fp32 = fp32_allreduce_bytes(cfg, num_params)
  sent_total, fp32_total = totals or (sent_bytes * steps, fp32 * steps)
  report = {
      "sent_bytes_per_step": sent_bytes,
      "sent_bits_per_param": 8 * sent_bytes / num_params,
      "sent_bytes_total": sent_total,
      "fp32_allreduce_bytes_per_step": fp32,
      "fp32_allreduce_bytes_total": fp32_total,
  }
  if cfg.mesh.nodes is None:
    report["analytic_bits_per_param"] = optimizers.analytic_bits_per_param(
        cfg.optimizer, n, steps=steps)
    return report
  across, inside = hybrid_bits_per_param(cfg, steps)
  for axis, sent in (by_axis or {}).items():
    report[f"sent_bits_per_param_over_{axis}"] = 8 * sent / num_params
  return {**report, "analytic_bits_per_param": across + inside,
          "analytic_bits_per_param_across_nodes": across,
          "analytic_bits_per_param_inside_nodes": inside}


def slow_link_line(cfg: Config, across: float) -> str:
  """What crosses the nodes, against global Lion on the same layout (an
  fp32 all-reduce of each device's shard between the nodes)."""
  nodes = cfg.mesh.nodes
  fp32 = dl.allreduce_bits(nodes) / (cfg.workers // nodes)
  return (f"across the nodes, what the slow links carry: {across:.3f} "
          f"bits/param/step; an fp32 all-reduce of the shards (global "
          f"Lion on this layout) would send {fp32:.3f} "
          f"({fp32 / max(across, 1e-9):.1f}x more)")


def hybrid_bits_per_param(cfg: Config, steps: int) -> tuple[float, float]:
  """Analytic bits per parameter per step each device of a hybrid mesh
  sends: ``(across nodes, inside its node)``.

  Across: the optimizer's exchange between the ``nodes`` devices holding
  the same shard, on ``1/k`` of the params. Inside: an fp32 reduce-scatter
  of the gradients plus an all-gather of the new params, i.e. what a ring
  all-reduce over the node's ``k`` devices sends.
  """
  nodes = cfg.mesh.nodes
  k = cfg.workers // nodes
  across = optimizers.analytic_bits_per_param(cfg.optimizer, nodes,
                                              steps=steps) / k
  return across, dl.allreduce_bits(k)


def summary_text(s: dict, cfg: Config) -> str:
  lines = []
  if s["kind"] == "lm":
    lines.append(f"test loss {s['test_loss']:.4f} nats/byte = "
                 f"{s['test_loss'] / math.log(2):.4f} bits/byte")
  else:
    lines.append(f"test accuracy {s['test_accuracy']:.4f} "
                 f"(loss {s['test_loss']:.4f})")
  ratio = s["fp32_allreduce_bytes_per_step"] / max(s["sent_bytes_per_step"],
                                                   1e-9)
  lines.append(
      f"wire, each worker, read off the compiled step: "
      f"{s['sent_bits_per_param']:.3f} bits/param/step = "
      f"{fmt_bytes(s['sent_bytes_per_step'])}/step, "
      f"{fmt_bytes(s['sent_bytes_total'])} over {cfg.train.steps} steps")
  if cfg.mesh.nodes is not None:
    inside = ("fp32 params all-gather and gradient reduce-scatter"
              if cfg.mesh.shard_params else
              "the compiler's fp32 gradient all-reduce"
              if cfg.optimizer.local_steps > 1 else
              "fp32 gradient reduce-scatter and updates all-gather")
    lines.append(
        f"of which {s['sent_bits_per_param_over_data']:.3f} bits/param/step "
        f"across the {cfg.mesh.nodes} nodes (analytic "
        f"{s['analytic_bits_per_param_across_nodes']:.3f}), "
        f"{s['sent_bits_per_param_over_fsdp']:.1f} inside a node (analytic "
        f"{s['analytic_bits_per_param_inside_nodes']:.0f}: {inside}); "
        "each also carries the loss and metrics' means")
  lines.append(
      f"an fp32 gradient all-reduce would send "
      f"{dl.allreduce_bits(cfg.workers):.0f} bits/param/step = "
      f"{fmt_bytes(s['fp32_allreduce_bytes_per_step'])}/step, "
      f"{fmt_bytes(s['fp32_allreduce_bytes_total'])} in total "
      + (f"({ratio:.1f}x more)" if ratio > 1.05 else
         "(what this optimizer sends: it all-reduces fp32 gradients)"))
  if cfg.mesh.nodes is not None:
    lines.append(slow_link_line(cfg, s["sent_bits_per_param_over_data"]))
  lines.append(f"run directory: {cfg.run_path}")
  return "\n".join(lines)


def plot(run_dir, kind) -> None:
  """curves.png from the run's whole metrics.jsonl (resumed runs included)."""
  try:
    # A bare Figure: no pyplot, so a notebook's backend stays as it was.
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  history = [json.loads(line) for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in history if "loss" in r]
  test = [r for r in history if "test_loss" in r]
  fig = Figure(figsize=(10, 4))
  ax1, ax2 = fig.subplots(1, 2)
  ax1.plot([r["step"] for r in train], [r["loss"] for r in train],
           label="train")
  ax1.plot([r["step"] for r in test], [r["test_loss"] for r in test], "o-",
           label="test")
  ax1.set(xlabel="step", ylabel="loss (nats)", title="loss")
  ax1.legend()
  if kind == "lm":
    ax2.plot([r["step"] for r in test],
             [r["test_loss"] / math.log(2) for r in test], "o-")
    ax2.set(xlabel="step", ylabel="bits per byte", title="test bits/byte")
  else:
    ax2.plot([r["step"] for r in train], [r["accuracy"] for r in train],
             label="train")
    ax2.plot([r["step"] for r in test], [r["test_accuracy"] for r in test],
             "o-", label="test")
    ax2.set(xlabel="step", ylabel="accuracy", title="accuracy")
    ax2.legend()
  fig.tight_layout()
  fig.savefig(run_dir / "curves.png", dpi=100)
