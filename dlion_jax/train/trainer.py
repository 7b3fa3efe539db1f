"""The training loop behind ``python -m dlion_jax.train``.

One :func:`train` call builds the mesh, data, Flax NNX model (split into a
pure parameter pytree), optimizer and a jitted ``shard_map`` step from
:mod:`dlion_jax.parallel`, then trains with a progress bar, JSON-lines
metrics, periodic evaluation, orbax checkpoints and PNG curves in the run
directory. It ends by reporting what went over the wire, read off the
compiled step's HLO, next to what an fp32 gradient all-reduce would send.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import parallel
from dlion_jax.train import checkpoint
from dlion_jax.train import data as data_lib
from dlion_jax.train import models
from dlion_jax.train import optimizers
from dlion_jax.train.config import Config
from dlion_jax.train.config import to_dict

AXIS = "data"


def _model_kwargs(cfg: Config, dataset) -> dict:
  """The config's model keys, completed with what the data determines."""
  kwargs = {k: v for k, v in cfg.model.items() if k != "name"}
  name = cfg.model["name"]
  if dataset.kind == "lm":
    if name != "gpt":
      raise ValueError(f"data.name={cfg.data.name!r} is language modelling; "
                       f"use model.name='gpt', not {name!r}.")
    kwargs.setdefault("vocab_size", dataset.vocab_size)
    kwargs.setdefault("context", cfg.data.seq_len)
    return kwargs
  if name == "gpt":
    raise ValueError(f"model.name='gpt' needs text data, not "
                     f"data.name={cfg.data.name!r}.")
  height, width, channels = dataset.input_shape
  kwargs.setdefault("num_classes", dataset.num_classes)
  if name == "mlp":
    kwargs.setdefault("in_features", height * width * channels)
  elif name == "cnn":
    kwargs.setdefault("in_channels", channels)
  elif name == "vit":
    kwargs.setdefault("image_size", height)
    kwargs.setdefault("in_channels", channels)
  return kwargs


def _per_example(logits, labels):
  """Per-example loss (nats) and number correct (per token for LM)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  if ce.ndim > 1:                                  # LM: mean over positions
    return ce.mean(axis=tuple(range(1, ce.ndim))), correct.mean(
        axis=tuple(range(1, ce.ndim)))
  return ce, correct


def make_loss_fn(graphdef) -> Callable:
  def loss_fn(params, batch):
    logits = models.apply(graphdef, params, batch["x"])
    loss, correct = _per_example(logits, batch["y"])
    return loss.mean(), {"accuracy": correct.mean()}
  return loss_fn


def make_eval_step(graphdef, mesh):
  """Sums of loss and correct predictions over a padded, masked batch."""
  def local(params, batch):
    logits = models.apply(graphdef, params, batch["x"])
    loss, correct = _per_example(logits, batch["y"])
    w = batch["mask"]
    sums = jnp.stack([(loss * w).sum(), (correct * w).sum(), w.sum()])
    return jax.lax.psum(sums, AXIS)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)),
                               out_specs=P()))


def evaluate(eval_step, params, split, *, batch_size, workers, sharding,
             seq_len=None) -> dict:
  """Mean test loss and accuracy (per token for LM) over the whole split."""
  totals = np.zeros(3)
  for batch in data_lib.eval_batches(split, batch_size, seq_len=seq_len):
    n = len(batch["y"])
    pad = -n % workers
    padded = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
              for k, v in batch.items()}
    padded["mask"] = np.concatenate([np.ones(n), np.zeros(pad)]).astype(
        np.float32)
    totals += np.asarray(eval_step(params, parallel.global_array(padded,
                                                                 sharding)))
  loss, correct, count = totals
  return {"test_loss": loss / count, "test_accuracy": correct / count}


@dataclasses.dataclass
class _Writer:
  """Metrics as JSON lines, written by process 0 only."""
  path: Any
  enabled: bool

  def write(self, record: dict) -> None:
    if self.enabled:
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _progress(total: int, initial: int, enabled: bool):
  try:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(total=total, initial=initial, disable=not enabled,
              unit="step", dynamic_ncols=True)


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


def sent_bytes_per_step(cfg: Config, compiled, steps: int) -> float:
  """Bytes a step sends, read off the compiled step; collectives in a
  conditional (momentum syncs) counted at the rate the schedule runs them."""
  always = dl.collective_bytes(compiled, conditional=False)
  schedule = optimizers.sync_schedule(cfg.optimizer)
  if schedule is None or cfg.optimizer.name != "dlion":
    return always
  synced = dl.collective_bytes(compiled) - always
  return always + synced * schedule.count(steps) / steps


def wire_report(cfg: Config, sent_bytes: float, num_params: int,
                steps: int) -> dict:
  """Bits sent per step and in total, against an fp32 all-reduce."""
  n = cfg.workers
  fp32 = dl.allreduce_bits(n) * num_params / 8
  return {
      "sent_bytes_per_step": sent_bytes,
      "sent_bits_per_param": 8 * sent_bytes / num_params,
      "sent_bytes_total": sent_bytes * steps,
      "fp32_allreduce_bytes_per_step": fp32,
      "fp32_allreduce_bytes_total": fp32 * steps,
      "analytic_bits_per_param": optimizers.analytic_bits_per_param(
          cfg.optimizer, n, steps=steps),
  }


def train(cfg: Config, *, resume: bool = False, progress: bool = True,
          log: Callable[[str], None] = print) -> dict:
  """Runs ``cfg``; returns the final metrics (test metrics, wire bytes)."""
  main_process = jax.process_index() == 0
  say = log if main_process else (lambda *_: None)
  run_dir = cfg.run_path
  if main_process:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
  mesh = parallel.data_mesh(cfg.workers, axis_name=AXIS)
  replicated, per_worker = NamedSharding(mesh, P()), NamedSharding(
      mesh, P(AXIS))

  dataset = _load_data(cfg)
  model = models.build_model(cfg.model["name"], rngs=nnx.Rngs(cfg.seed),
                             **_model_kwargs(cfg, dataset))
  graphdef, params = models.split_params(model)
  num_params = models.count_params(params)
  tx = optimizers.build_optimizer(cfg.optimizer,
                                  total_steps=cfg.train.steps, axis_name=AXIS)
  params = parallel.global_array(params, replicated)
  opt_state = parallel.init_worker_states(tx, params, mesh, axis_name=AXIS)
  batches = data_lib.Batches(dataset.train, global_batch=cfg.data.global_batch,
                             seed=cfg.seed, kind=dataset.kind,
                             seq_len=(cfg.data.seq_len if dataset.kind == "lm"
                                      else None))

  ckpt = checkpoint.Checkpointer(run_dir / "checkpoints",
                                 keep=cfg.train.keep_checkpoints)
  start = 0
  if resume:
    (params, opt_state), start = _resume(ckpt, cfg, (params, opt_state),
                                         batches)
    say(f"resumed from step {start}")

  step_fn = parallel.make_train_step(make_loss_fn(graphdef), tx, mesh,
                                     axis_name=AXIS, has_aux=True)
  position = batches.state()
  example = parallel.global_array(next(batches), per_worker)
  batches.restore(position)
  compiled = step_fn.lower(params, opt_state, example).compile()
  sent = sent_bytes_per_step(cfg, compiled, cfg.train.steps)
  eval_step = make_eval_step(graphdef, mesh)
  run_eval = functools.partial(
      evaluate, eval_step, split=dataset.test,
      batch_size=cfg.data.eval_batch, workers=cfg.workers,
      sharding=per_worker,
      seq_len=cfg.data.seq_len if dataset.kind == "lm" else None)
  where = jax.devices()[0].platform
  if jax.process_count() > 1:
    k = jax.local_device_count()
    where += (f"; {jax.process_count()} processes, {k} device"
              f"{'s' if k > 1 else ''} each")
  say(f"{cfg.name}: {cfg.model['name']} with {num_params:,} parameters, "
      f"{cfg.optimizer.name} on {cfg.workers} workers "
      f"({where}), {cfg.data.global_batch} examples a "
      f"step ({cfg.data.global_batch // cfg.workers} per worker)")

  writer = _Writer(run_dir / "metrics.jsonl", main_process)
  if main_process and not resume:
    writer.path.unlink(missing_ok=True)   # a fresh run starts a fresh log
  bar = _progress(cfg.train.steps, start, progress and main_process)
  schedule = optimizers.make_schedule(cfg.optimizer, cfg.train.steps)
  tic, last_step = time.perf_counter(), start
  for step in range(start, cfg.train.steps):
    batch = parallel.global_array(next(batches), per_worker)
    params, opt_state, (loss, aux) = compiled(params, opt_state, batch)
    loss = float(loss)   # one step at a time (simulated devices deadlock)
    done = step + 1
    if not math.isfinite(loss):
      raise FloatingPointError(
          f"loss became {loss} at step {done}; lower optimizer.learning_rate "
          f"(now {cfg.optimizer.learning_rate}).")
    if done % cfg.train.log_every == 0 or done == cfg.train.steps:
      elapsed = time.perf_counter() - tic
      rate = (done - last_step) * cfg.data.global_batch / max(elapsed, 1e-9)
      record = {"step": done, "loss": loss,
                "accuracy": float(aux["accuracy"]),
                "learning_rate": float(schedule(step)),
                "examples_per_s": rate}
      writer.write(record)
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", ex_s=f"{rate:,.0f}")
      tic, last_step = time.perf_counter(), done
    if bar is not None:
      bar.update(1)
    if (cfg.train.eval_every and done % cfg.train.eval_every == 0
        and done < cfg.train.steps):
      record = {"step": done, **run_eval(params)}
      writer.write(record)
    if (cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0
        and done < cfg.train.steps):
      _save(ckpt, done, params, opt_state, batches, cfg)
  if bar is not None:
    bar.close()

  final = {"step": cfg.train.steps, **run_eval(params)}
  writer.write(final)
  _save(ckpt, cfg.train.steps, params, opt_state, batches, cfg)
  ckpt.close()
  wire = wire_report(cfg, sent, num_params, cfg.train.steps)
  summary = {**final, **wire, "num_params": num_params,
             "kind": dataset.kind}
  if main_process:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(run_dir, dataset.kind)
  say(_summary_text(summary, cfg))
  return {"summary": summary, "params": params, "opt_state": opt_state}


def _load_data(cfg: Config):
  kwargs = {}
  if cfg.data.name == "fashion_mnist":
    kwargs = {"limit_train": cfg.data.limit_train,
              "limit_test": cfg.data.limit_test}
    if cfg.data.path:
      kwargs["path"] = cfg.data.path
  elif cfg.data.name == "text":
    if not cfg.data.path:
      raise ValueError("data.name='text' needs data.path: the file to model "
                       "(any text file, read as bytes).")
    kwargs = {"path": cfg.data.path}
  return data_lib.load_dataset(cfg.data.name, **kwargs)


def _save(ckpt, step, params, opt_state, batches, cfg):
  ckpt.save(step, {"params": params, "opt_state": opt_state},
            {"step": step, "data": batches.state(), "workers": cfg.workers,
             "seed": cfg.seed})


def _resume(ckpt, cfg, like, batches):
  latest = ckpt.latest_step()
  if latest is None:
    raise FileNotFoundError(
        f"--resume: no checkpoint in {ckpt.directory}; run without --resume "
        "first (checkpoints are written every train.checkpoint_every steps "
        "and at the end).")
  meta = ckpt.metadata(latest)
  if meta["workers"] != cfg.workers:
    raise ValueError(
        f"The checkpoint at step {latest} was written with "
        f"workers={meta['workers']}, this run has workers={cfg.workers}: "
        "each worker's momentum is saved, so resume with the same count.")
  state, meta = ckpt.restore({"params": like[0], "opt_state": like[1]},
                             latest)
  batches.restore(meta["data"])
  return (state["params"], state["opt_state"]), int(meta["step"])


def _summary_text(s: dict, cfg: Config) -> str:
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
      f"{_fmt_bytes(s['sent_bytes_per_step'])}/step, "
      f"{_fmt_bytes(s['sent_bytes_total'])} over {cfg.train.steps} steps")
  lines.append(
      f"an fp32 gradient all-reduce would send "
      f"{dl.allreduce_bits(cfg.workers):.0f} bits/param/step = "
      f"{_fmt_bytes(s['fp32_allreduce_bytes_per_step'])}/step, "
      f"{_fmt_bytes(s['fp32_allreduce_bytes_total'])} in total "
      + (f"({ratio:.1f}x more)" if ratio > 1.05 else
         "(what this optimizer sends: it all-reduces fp32 gradients)"))
  lines.append(f"run directory: {cfg.run_path}")
  return "\n".join(lines)


def _plot(run_dir, kind) -> None:
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
