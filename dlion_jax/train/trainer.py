"""The training loop behind ``python -m dlion_jax.train``.

One :func:`train` call builds the mesh, data, Flax NNX model (split into a
pure parameter pytree), optimizer and a jitted ``shard_map`` step from
:mod:`dlion_jax.parallel`, then trains with a progress bar, JSON-lines
metrics, periodic evaluation, orbax checkpoints and PNG curves in the run
directory. It ends by reporting what went over the wire, read off the
compiled step's HLO, next to what an fp32 gradient all-reduce would send.

With ``mesh.nodes`` the mesh is hybrid (:func:`make_mesh`): the batch is
split over both of its axes, each node's gradients are reduce-scattered
over :data:`SHARD_AXIS`, the optimizer state (and with
``mesh.shard_params`` the params) is sharded over it, and the optimizer
votes across the nodes (:data:`AXIS`) only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import signal
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax import parallel
from dlion_jax.train import checkpoint
from dlion_jax.train import data as data_lib
from dlion_jax.train import faults
from dlion_jax.train import models
from dlion_jax.train import optimizers
from dlion_jax.train import report
from dlion_jax.train import restarts
from dlion_jax.train import rundir
from dlion_jax.train import signals
from dlion_jax.train.config import Config
from dlion_jax.train.config import ConfigError
from dlion_jax.train.config import local_steps_warning
from dlion_jax.train.config import schedule_warning
from dlion_jax.train.config import to_dict
import dlion_jax as dl

AXIS = "data"          # the optimizer's axis: workers, or nodes if hybrid
SHARD_AXIS = "fsdp"    # a hybrid mesh's devices inside one node


class Interrupted(KeyboardInterrupt):
  """Ctrl-C or SIGTERM during :func:`train`.

  Attributes:
    step: the last training step that finished.
    signum: ``signal.SIGINT`` (Ctrl-C) or ``signal.SIGTERM``.
  """

  def __init__(self, step: int, signum: int = signal.SIGINT):
    super().__init__(step)
    self.step, self.signum = step, signum


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


def make_mesh(cfg: Config):
  """The first ``workers`` devices: one axis, or ``mesh.nodes`` rows of a
  hybrid mesh (row ``i`` is node ``i``)."""
  mesh = devices.data_mesh(cfg.workers, axis_name=AXIS)
  if cfg.mesh.nodes is None:
    return mesh
  return devices.hybrid_mesh(cfg.mesh.nodes, axis_name=AXIS,
                             shard_axis=SHARD_AXIS,
                             devices=list(mesh.devices.flat))


def shard_axis(mesh) -> str | None:
  """``make_train_step``'s ``shard_axis`` on a hybrid mesh (each node's
  gradients reduce-scattered over its devices, params replicated or, with
  ``mesh.shard_params``, sharded at rest), else None."""
  return SHARD_AXIS if SHARD_AXIS in mesh.axis_names else None


def step_shard_axis(cfg: Config, mesh) -> str | None:
  """:func:`shard_axis`, but None with local steps: each node trains params
  of its own, and the compiler reduces its gradient over its devices."""
  return None if cfg.optimizer.local_steps > 1 else shard_axis(mesh)


def worker_axes(mesh):
  """The axis, or axes, whose devices each take a slice of the batch."""
  return (AXIS, SHARD_AXIS) if SHARD_AXIS in mesh.axis_names else AXIS


def place_params(params, cfg: Config, mesh):
  """The params on every device, or sharded FSDP-style over each node's
  devices (``mesh.shard_params``), from host values alike on every
  process."""
  if not cfg.mesh.shard_params:
    return devices.global_array(params, NamedSharding(mesh, P()))
  return devices.shard_params(params, mesh, SHARD_AXIS)


def make_eval_step(graphdef, mesh):
  """Sums of loss and correct predictions over a padded, masked batch."""
  axes = worker_axes(mesh)
  def local(params, batch):
    logits = models.apply(graphdef, params, batch["x"])
    loss, correct = _per_example(logits, batch["y"])
    w = batch["mask"]
    sums = jnp.stack([(loss * w).sum(), (correct * w).sum(), w.sum()])
    return jax.lax.psum(sums, axes)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axes)),
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
    totals += np.asarray(eval_step(params, devices.global_array(padded,
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


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False,
          progress: bool = True, log: Callable[[str], None] = print,
          resize_policy: str = "mean", restart=None) -> dict:
  """Runs ``cfg``; returns the final metrics (test metrics, wire bytes).

  Args:
    cfg: the run's configuration.
    resume: continue from the run directory's last checkpoint.
    overwrite: delete an earlier run found in the run directory (without
      it, a fresh run refuses such a directory).
    progress: show a progress bar.
    log: where the run's report lines go (process 0 only).
    resize_policy: how a resumed run on another number of workers (or
      nodes) makes its workers' momenta of the checkpoint's
      (:data:`dlion_jax.elastic.RESIZE_POLICIES`).
    restart: this start under ``python -m dlion_jax.launch --restarts``
      (:class:`dlion_jax.processes.RestartInfo`), recorded in the run
      directory (:mod:`dlion_jax.train.restarts`); a restart may resume a
      run that had reached its last step.

  Raises:
    rundir.RunDirError: the run directory holds another run (fresh run),
      or its checkpoint is of another config (``resume``).
    Interrupted: on Ctrl-C, with the last step that finished; on SIGTERM
      during training, once the step in progress has finished and a
      checkpoint of it is written (multi-process: at the step that jax's
      preemption service agrees on, a step or two later).
  """
  if resume and overwrite:
    raise ValueError("resume=True continues the run in the run directory, "
                     "overwrite=True deletes it: pass one of them.")
  main_process = jax.process_index() == 0
  say = log if main_process else (lambda *_: None)
  _prepare_run_dir(cfg, resume=resume, overwrite=overwrite,
                   main_process=main_process)
  mesh = make_mesh(cfg)
  run = _setup(cfg, mesh)
  start, ready = 0, time.time()
  if resume:
    (run.params, run.opt_state), start, resized, run.wire_before = _resume(
        run.ckpt, cfg, run, policy=resize_policy,
        finished=restart is not None)
    say(f"resumed from step {start}" + (f" on {resized}" if resized else ""))
  if restart is not None:
    run.started = restarts.entry(restart, cfg, step=start, resumed=resume,
                                 ready=ready)
  if main_process:
    _start_files(cfg, start)
    if run.started:
      restarts.record(cfg.run_path, run.started)
    for warning in (schedule_warning(cfg), local_steps_warning(cfg)):
      if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
  run.step = start
  try:
    return _train_from(cfg, run, say=say, progress=progress and main_process,
                       main_process=main_process)
  except KeyboardInterrupt as e:
    raise Interrupted(run.step, getattr(e, "signum", signal.SIGINT)) from None


def _prepare_run_dir(cfg: Config, *, resume: bool, overwrite: bool,
                     main_process: bool) -> None:
  """Refuses (or, with ``overwrite``, clears) an earlier run in a fresh
  run's directory, before any process writes there."""
  if not resume:
    rundir.check_fresh(cfg.run_path, overwrite=overwrite)
  if overwrite and not resume and main_process:
    rundir.clear(cfg.run_path)
  if overwrite and jax.process_count() > 1:
    # No process may open the checkpoints while process 0 deletes them.
    multihost_utils.sync_global_devices("dlion_jax.train: run_dir cleared")


def _start_files(cfg: Config, start: int) -> None:
  """config.json, and a metrics log that holds each step once."""
  cfg.run_path.mkdir(parents=True, exist_ok=True)
  (cfg.run_path / "config.json").write_text(json.dumps(to_dict(cfg),
                                                       indent=2))
  metrics = cfg.run_path / "metrics.jsonl"
  if start:
    rundir.trim_metrics(metrics, start)
  else:
    metrics.unlink(missing_ok=True)


@dataclasses.dataclass
class _Run:
  """What a run trains with, built by :func:`_setup`."""
  mesh: Any
  dataset: Any
  graphdef: Any
  params: Any
  opt_state: Any
  num_params: int
  tx: Any
  batches: Any
  ckpt: Any
  step: int = 0                     # the last step done
  # Bytes sent (and an fp32 all-reduce's) up to step ``since``, which may
  # have run on another layout (an elastic resume), and a step's now.
  wire_before: tuple[float, float] | None = (0.0, 0.0)
  since: int = 0
  wire_per_step: tuple[float, float] = (0.0, 0.0)
  warned_nonfinite: bool = False    # a worker's loss was not finite
  # Which steps ran on how many workers, up to ``since``
  # (restarts.history); under the launcher's restarts, this start's record.
  history: list = dataclasses.field(default_factory=list)
  started: dict | None = None
  saving: list = dataclasses.field(default_factory=list)  # each save's s

  def wire_done(self, step: int) -> tuple[float, float]:
    """Bytes sent, and an fp32 all-reduce's, over steps 1..``step``."""
    return tuple(before + rate * (step - self.since) for before, rate in
                 zip(self.wire_before, self.wire_per_step))


def _setup(cfg: Config, mesh) -> _Run:
  dataset = _load_data(cfg)
  model = _build_model(cfg, dataset)
  graphdef, params = models.split_params(model)
  injected = None
  if cfg.faults.kind != "none" and cfg.faults.workers:
    injected = faults.faulty_workers(
        cfg.faults.kind, cfg.faults.workers, axis_name=AXIS,
        scale=cfg.faults.scale, nan_rate=cfg.faults.nan_rate, seed=cfg.seed)
  outer = cfg.faults.on == "pseudo_gradients"
  tx = optimizers.build_optimizer(
      cfg.optimizer, total_steps=cfg.train.steps, axis_name=AXIS,
      outer_faults=injected if outer else None)
  if injected is not None and not outer:
    tx = optax.chain(injected, tx)
  params = place_params(params, cfg, mesh)
  opt_state = parallel.init_worker_states(
      tx, params, mesh, axis_name=AXIS, shard_axis=step_shard_axis(cfg, mesh))
  num_params = models.count_params(params)
  if cfg.optimizer.local_steps > 1:      # each worker trains its own copy
    params = devices.stack_for_workers(params, mesh, axis_name=AXIS)
  batches = data_lib.Batches(dataset.train, global_batch=cfg.data.global_batch,
                             seed=cfg.seed, kind=dataset.kind,
                             seq_len=(cfg.data.seq_len if dataset.kind == "lm"
                                      else None))
  ckpt = checkpoint.Checkpointer(cfg.run_path / "checkpoints",
                                 keep=cfg.train.keep_checkpoints)
  return _Run(mesh, dataset, graphdef, params, opt_state, num_params, tx,
              batches, ckpt)


def _build_model(cfg: Config, dataset):
  """The config's model, its mistakes reported as ConfigErrors naming the
  key (``model.hidden`` missing, an unknown key, a bad value)."""
  name = cfg.model["name"]
  try:
    valid, required = models.model_arguments(name)
  except ValueError:
    raise ConfigError(
        f"model.name={name!r} is not one of {', '.join(models.MODELS)}.",
        key="model.name") from None
  kwargs = _model_kwargs(cfg, dataset)
  for key in kwargs:
    if key not in valid:
      raise ConfigError(
          f"model.{key} is not a setting of model {name!r}; its settings "
          f"are {', '.join(valid)}.", key=f"model.{key}")
  for key in required:
    if key not in kwargs:
      raise ConfigError(
          f"model.{key} is missing: model {name!r} needs it. Add it to the "
          f"model section, or pass --set model.{key}=VALUE.",
          key=f"model.{key}")
  try:
    return models.build_model(name, rngs=nnx.Rngs(cfg.seed), **kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model ({name}): {e}", key="model") from None


def _train_from(cfg: Config, run: _Run, *, say, progress: bool,
                main_process: bool) -> dict:
  """Compiles the step, trains from ``run.step`` on, evaluates, saves and
  reports."""
  per_worker = NamedSharding(run.mesh, P(worker_axes(run.mesh)))
  step_fn = parallel.make_train_step(
      make_loss_fn(run.graphdef), run.tx, run.mesh, axis_name=AXIS,
      shard_axis=step_shard_axis(cfg, run.mesh), has_aux=True,
      params_per_worker=cfg.optimizer.local_steps > 1)
  position = run.batches.state()
  example = devices.global_array(next(run.batches), per_worker)
  run.batches.restore(position)
  tic = time.time()
  compiled = step_fn.lower(run.params, run.opt_state, example).compile()
  if run.started:
    restarts.compiled(cfg.run_path, run.started, time.time() - tic, say=say,
                      main_process=main_process)
  sent = report.sent_bytes_per_step(cfg, compiled, cfg.train.steps)
  by_axis = (report.sent_bytes_by_axis(cfg, compiled, run.mesh, cfg.train.steps)
             if cfg.mesh.nodes is not None else None)
  run.wire_per_step = (sent, report.fp32_allreduce_bytes(cfg, run.num_params))
  if run.wire_before is None:     # a checkpoint that did not count them
    run.wire_before = tuple(rate * run.step for rate in run.wire_per_step)
  run.since = run.step
  kind = run.dataset.kind
  run_eval = _model_of(cfg, run.mesh, functools.partial(
      evaluate, make_eval_step(run.graphdef, run.mesh),
      split=run.dataset.test, batch_size=cfg.data.eval_batch,
      workers=cfg.workers, sharding=per_worker,
      seq_len=cfg.data.seq_len if kind == "lm" else None))
  say(_headline(cfg, run.num_params))
  writer = _Writer(cfg.run_path / "metrics.jsonl", main_process)
  bar = report.progress(cfg.train.steps, run.step, progress)
  try:
    _loop(cfg, run, compiled, writer=writer, bar=bar, run_eval=run_eval,
          per_worker=per_worker)
  finally:
    if bar is not None:
      bar.close()
  final = {"step": cfg.train.steps, **run_eval(run.params, run.opt_state)}
  writer.write(final)
  if run.ckpt.latest_step() != cfg.train.steps:   # else: a restart at the end
    _save(run, cfg.train.steps, cfg)
  run.ckpt.close()
  wire = report.wire_report(cfg, sent, run.num_params, cfg.train.steps, by_axis,
                     totals=run.wire_done(cfg.train.steps))
  summary = {**final, **wire, "num_params": run.num_params, "kind": kind,
             **restarts.summary(cfg, run.history, run.since, run.started,
                                say=say, saving=run.saving,
                                main_process=main_process)}
  if main_process:
    (cfg.run_path / "summary.json").write_text(json.dumps(summary, indent=2))
    report.plot(cfg.run_path, kind)
  say(report.summary_text(summary, cfg))
  return {"summary": summary,
          "params": model_params(cfg, run.mesh, run.params, run.opt_state),
          "opt_state": run.opt_state}


def model_params(cfg: Config, mesh, params, opt_state) -> Any:
  """The run's model: its params, or with local steps the anchor (the
  params of the last outer step, replicated), which every worker shares."""
  if cfg.optimizer.local_steps == 1:
    return params
  return _first_row(mesh)(dl.rounds.anchor(opt_state))


@functools.cache
def _first_row(mesh):
  return jax.jit(lambda tree: jax.tree.map(lambda x: x[0], tree),
                 out_shardings=NamedSharding(mesh, P()))


def _model_of(cfg: Config, mesh, run_eval):
  """``run_eval`` as a function of the params and the optimizer state:
  with local steps it evaluates the anchor (:func:`model_params`)."""
  return lambda params, opt_state: run_eval(
      model_params(cfg, mesh, params, opt_state))


def _headline(cfg: Config, num_params: int) -> str:
  where = jax.devices()[0].platform
  if jax.process_count() > 1:
    k = jax.local_device_count()
    where += (f"; {jax.process_count()} processes, {k} device"
              f"{'s' if k > 1 else ''} each")
  layout = "" if cfg.mesh.nodes is None else (
      f" as {cfg.mesh.nodes} nodes of {cfg.workers // cfg.mesh.nodes}")
  opt = cfg.optimizer
  outer = "voted (fp32 mean, no vote)" if (
      opt.outer == "voted" and opt.outer_fp32_mean) else opt.outer
  optimizer = opt.name if opt.local_steps == 1 else (
      f"{opt.name} alone for {opt.local_steps} steps then a {outer} "
      "outer step")
  return (f"{cfg.name}: {cfg.model['name']} with {num_params:,} parameters, "
          f"{optimizer} on {cfg.workers} workers{layout} ({where}), "
          f"{cfg.data.global_batch} examples a step "
          f"({cfg.data.global_batch // cfg.workers} per worker)")


def _loop(cfg: Config, run: _Run, compiled, *, writer, bar, run_eval,
          per_worker) -> None:
  """Steps ``run.step`` to ``train.steps``: logs, evaluates, checkpoints."""
  with _sigterm_at_step_end() as terminated:
    _steps(cfg, run, compiled, writer=writer, bar=bar, run_eval=run_eval,
           per_worker=per_worker, terminated=terminated)


def _sigterm_at_step_end():
  """SIGTERM held until the step in progress ends (single process); a
  multi-process run leaves it to jax's preemption service."""
  if jax.process_count() > 1:
    return contextlib.nullcontext([])
  return signals.held()


def _terminate(cfg: Config, run: _Run, terminated: list[int]) -> None:
  """After a SIGTERM: saves a checkpoint of the step just done and raises
  Terminated. After the last step no checkpoint is saved: it would mark the
  run finished, without its summary."""
  if not terminated and not (
      jax.process_count() > 1
      and multihost_utils.reached_preemption_sync_point(run.step)):
    return
  if run.step < cfg.train.steps:
    _save(run, run.step, cfg)
  raise signals.Terminated


def _steps(cfg: Config, run: _Run, compiled, *, writer, bar, run_eval,
           per_worker, terminated) -> None:
  """:func:`_loop`'s steps; ``terminated`` is not empty once a SIGTERM
  arrived."""
  schedule = optimizers.make_schedule(cfg.optimizer, cfg.train.steps)
  tic, last_step = time.perf_counter(), run.step
  for step in range(run.step, cfg.train.steps):
    batch = devices.global_array(next(run.batches), per_worker)
    run.params, run.opt_state, (loss, aux) = compiled(run.params,
                                                      run.opt_state, batch)
    loss = float(loss)   # read every step: a NaN stops the run at once
    done = run.step = step + 1
    if not math.isfinite(loss):
      if not cfg.optimizer.abstain_nonfinite:
        raise _diverged(cfg, run, f"the loss became {loss} at step {done}")
      if not run.warned_nonfinite:
        run.warned_nonfinite = True
        print(f"warning: the mean loss over workers is {loss} at step "
              f"{done}: a worker's loss is not finite. With optimizer."
              "abstain_nonfinite a worker with non-finite gradients "
              "abstains and the run goes on (logged losses may be nan).",
              file=sys.stderr, flush=True)
    if done % cfg.train.log_every == 0 or done == cfg.train.steps:
      elapsed = time.perf_counter() - tic
      rate = (done - last_step) * cfg.data.global_batch / max(elapsed, 1e-9)
      abstained = abstentions(run.opt_state)
      writer.write({"step": done, "loss": loss, "workers": cfg.workers,
                    "accuracy": float(aux["accuracy"]),
                    "learning_rate": float(schedule(step)),
                    "examples_per_s": rate,
                    **({} if abstained is None else
                       {"abstentions": abstained})})
      if bar is not None:
        bar.set_postfix(loss=f"{loss:.4f}", ex_s=f"{rate:,.0f}",
                        **({} if abstained is None else
                           {"abstained": abstained}),
                        refresh=False)     # shown at the next redraw
      tic, last_step = time.perf_counter(), done
    if bar is not None:
      bar.update(1)
    _terminate(cfg, run, terminated)
    if (cfg.train.eval_every and done % cfg.train.eval_every == 0
        and done < cfg.train.steps):
      writer.write({"step": done, **run_eval(run.params, run.opt_state)})
    if (cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0
        and done < cfg.train.steps):
      _save(run, done, cfg)


def abstentions(opt_state) -> int | None:
  """How many times a worker abstained from the vote so far
  (``optimizer.abstain_nonfinite``), or None where no vote abstains."""
  kinds = (dl.AbstainingState, dl.AbstainingErrorFeedbackState,
           dl.transforms.AbstainingMeanState)
  found = [x for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, kinds))
           if isinstance(x, kinds)]
  if not found:
    return None
  return int(sum(np.asarray(jax.device_get(x.abstentions)).reshape(-1)[0]
                 for x in found))


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
    kwargs = {"path": cfg.data.path, "seq_len": cfg.data.seq_len,
              "limit_test": cfg.data.limit_test}
  return data_lib.load_dataset(cfg.data.name, **kwargs)


def _state_rows(cfg: Config) -> int:
  """Rows of the stacked optimizer state: one per voter (a node of a
  hybrid mesh, else a worker)."""
  return cfg.mesh.nodes or cfg.workers


def _save(run: _Run, step: int, cfg: Config) -> None:
  """Writes checkpoint ``step``; raises FloatingPointError instead where
  the model's params hold a NaN or an Inf."""
  bad = _nonfinite_leaf(run.mesh, model_params(cfg, run.mesh, run.params,
                                               run.opt_state))
  if bad is not None:
    raise _diverged(cfg, run, f"the params at step {step} hold NaN or Inf "
                    f"(leaf {bad} first), so no checkpoint of them is "
                    "written")
  sent, fp32 = run.wire_done(step)
  tic = time.perf_counter()
  run.ckpt.save(step, {"params": run.params, "opt_state": run.opt_state},
                {"step": step, "data": run.batches.state(),
                 "workers": cfg.workers, "state_rows": _state_rows(cfg),
                 "seed": cfg.seed, "config": rundir.comparable(cfg),
                 "sent_bytes": sent, "fp32_allreduce_bytes": fp32,
                 "history": restarts.history(run.history, run.since, step,
                                             cfg)})
  run.saving.append(time.perf_counter() - tic)


def _nonfinite_leaf(mesh, params) -> str | None:
  """The path of the first float leaf of ``params`` that holds a NaN or an
  Inf, or None."""
  leaves = [(jax.tree_util.keystr(path), x) for path, x in
            jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return None
  flags = np.asarray(_finite_flags(mesh)([x for _, x in leaves])
                     .addressable_data(0))
  bad = [path for (path, _), ok in zip(leaves, flags) if not ok]
  return bad[0] if bad else None


@functools.cache
def _finite_flags(mesh):
  return jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]),
                 out_shardings=NamedSharding(mesh, P()))


def _diverged(cfg: Config, run: _Run, what: str) -> FloatingPointError:
  """The error that stops a run whose loss or params are not finite: what
  happened, the last checkpoint (written before it, finite) and the fix."""
  last = run.ckpt.latest_step()
  kept = ("No checkpoint was written before it" if last is None else
          f"The last checkpoint, step {last} in {run.ckpt.directory}, was "
          "written before it")
  return FloatingPointError(
      f"{what}; the run stops. {kept}. Lower optimizer.learning_rate (now "
      f"{cfg.optimizer.learning_rate:g}) and start again (--overwrite, or "
      "--set run_dir=... to keep this run's files); where a worker's "
      "gradients are NaN or Inf, optimizer.abstain_nonfinite=true with "
      "dlion or signum leaves it out of the vote.")


def _resume(ckpt, cfg, run, *, policy: str, finished: bool = False):
  """The last checkpoint's params and state (its state resized to this
  run's workers, :mod:`dlion_jax.elastic`, where their count differs),
  its step, what resizing did (or None) and the bytes sent (and an fp32
  all-reduce's) up to it (None where the checkpoint did not count them).
  The step is the last that every process found; ``finished`` accepts one
  at ``train.steps`` (a restart after the last checkpoint)."""
  latest = restarts.agreed_step(ckpt.latest_step())
  if latest is None:
    started = (cfg.run_path / "metrics.jsonl").is_file()
    raise FileNotFoundError(
        f"--resume: no checkpoint in {ckpt.directory}; " + (
            "the run there stopped before its first one, so start it again "
            "with --overwrite instead of --resume" if started else
            "run without --resume first") + " (checkpoints are written "
        "every train.checkpoint_every steps and at the end).")
  meta = ckpt.metadata(latest)
  saved = _saved_config(meta)
  rundir.check_resume(saved, cfg, latest, ckpt.directory)
  # Before the hybrid state kept a row per node it kept one per device.
  rows = meta.get("state_rows")
  if rows is None and saved and saved.get("mesh.nodes"):
    raise ValueError(
        f"The checkpoint at step {latest} holds the optimizer state in "
        f"{meta['workers']} rows, one per device of each node, as dlion_jax "
        "wrote it before the hybrid layout kept one row per node; it "
        "cannot be resumed. Start the run afresh (--overwrite, or --set "
        "run_dir=...).")
  rows = meta["workers"] if rows is None else rows
  axes = dict(axis_name=AXIS, shard_axis=step_shard_axis(cfg, run.mesh))
  local = cfg.optimizer.local_steps > 1   # each worker's params, stacked
  row = elastic.worker_row(run.params, run.mesh) if local else run.params
  like = {"params": run.params, "opt_state": run.opt_state}
  if rows != _state_rows(cfg):
    like = {"params": (elastic.worker_params_target(run.params, run.mesh,
                                                    rows, axis_name=AXIS)
                       if local else run.params),
            "opt_state": elastic.restore_target(run.tx, row, run.mesh, rows,
                                                **axes)}
  state, meta = ckpt.restore(like, latest)
  if not finished:
    rundir.check_unfinished(cfg, latest, ckpt.directory)
  run.batches.restore(meta["data"])
  run.history = restarts.history_in(meta, latest)
  if local:
    state["params"] = elastic.resize_worker_params(
        state["params"], run.mesh, axis_name=AXIS, policy=policy)
  state["opt_state"] = elastic.resize_worker_states(
      run.tx, state["opt_state"], row if local else state["params"],
      run.mesh, policy=policy, **axes)
  resized = None
  if _voters(cfg) != _voters_of(meta["workers"], saved):
    if optimizers.state_alike_on_every_worker(cfg.optimizer):
      what = "the optimizer state, alike on every worker, kept"
    else:
      what = elastic.describe(rows, _state_rows(cfg), policy,
                              unit="node" if cfg.mesh.nodes else "worker")
    if local:
      what += ", each worker's params likewise, the anchor kept"
    resized = (f"{_voters(cfg)} from {_voters_of(meta['workers'], saved)}: "
               f"{what}; the global batch of {cfg.data.global_batch} kept, "
               f"{cfg.data.global_batch // cfg.workers} examples a worker "
               f"(was {cfg.data.global_batch // meta['workers']})")
  wire = (None if "sent_bytes" not in meta else
          (meta["sent_bytes"], meta["fp32_allreduce_bytes"]))
  return ((state["params"], state["opt_state"]), int(meta["step"]), resized,
          wire)


def _voters(cfg: Config) -> str:
  return _voters_of(cfg.workers, {"mesh.nodes": cfg.mesh.nodes,
                                  "mesh.shard_params": cfg.mesh.shard_params})


def _voters_of(workers: int, saved: dict | None) -> str:
  """"8 workers", or "2 nodes of 4" for a hybrid layout (", params
  sharded" where they are)."""
  saved = saved or {}
  nodes = saved.get("mesh.nodes")
  plural = lambda n, word: f"{n} {word}{'s' if n != 1 else ''}"
  if not nodes:
    return plural(workers, "worker")
  return (f"{plural(nodes, 'node')} of {workers // nodes}"
          + (", params sharded" if saved.get("mesh.shard_params") else ""))


def _saved_config(meta: dict) -> dict | None:
  """A checkpoint's flat config; one written before ``mesh.nodes`` or
  ``mesh.shard_params`` existed had no hybrid layout, or one with params
  replicated."""
  saved = meta.get("config")
  return None if saved is None else {"mesh.nodes": None,
                                     "mesh.shard_params": False, **saved}


