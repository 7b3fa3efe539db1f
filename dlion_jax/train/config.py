"""Run configuration: YAML files with ``--set key=value`` overrides.

A config has five sections (``mesh`` optional) and a few top-level keys::

  name: quickstart
  seed: 0
  workers: 8                  # data-parallel workers (simulated on CPU)
  run_dir: runs/quickstart
  mesh: {nodes: 2}            # optional hybrid layout: 2 nodes of 4 workers
                              # (shard_params: true for FSDP params)
  data: {name: digits, global_batch: 256}
  model: {name: mlp, hidden: [128, 128]}      # other keys go to the model
  optimizer: {name: dlion, learning_rate: 3.0e-3, weight_decay: 1.0e-2}
  train: {steps: 300, eval_every: 100}

Every key is checked: an unknown key or a value of the wrong type raises a
:class:`ConfigError` naming the key, the value and what is expected.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
import typing
from typing import Any, Optional

import yaml

from dlion_jax import _checks
from dlion_jax import _quantize as quantize
from dlion_jax import rounds



class ConfigError(ValueError):
  """A config key is unknown, or its value has the wrong type or range.

  Attributes:
    key: the dotted key at fault where known (the CLI then says where the
      config file sets it), else None.
  """

  def __init__(self, message: str, key: str | None = None):
    super().__init__(message)
    self.key = key


@dataclasses.dataclass
class DataConfig:
  """Which data, and how it is batched.

  ``global_batch`` is split evenly over the workers: each sees
  ``global_batch / workers`` examples a step.
  """
  name: str = "digits"              # digits | fashion_mnist | text
  path: Optional[str] = None        # fashion_mnist directory or text file
  global_batch: int = 256
  seq_len: int = 64                 # text: bytes per example
  limit_train: Optional[int] = None  # fashion_mnist: first n examples
  limit_test: Optional[int] = None   # ... and text: first n test windows
  eval_batch: int = 1000


@dataclasses.dataclass
class OptimizerConfig:
  """The optimizer and its schedule (linear warmup, then cosine or constant).

  ``None`` means the optimizer's own default (e.g. ``b2`` is 0.99 for Lion
  and 0.999 for AdamW).
  """
  name: str = "dlion"               # dlion | lion | adamw | signum | sgd
  learning_rate: float = 3e-3
  weight_decay: float = 0.0
  b1: Optional[float] = None
  b2: Optional[float] = None
  momentum: float = 0.9             # sgd; also signum's b1 = b2
  warmup_steps: int = 0
  schedule: str = "cosine"          # cosine | constant
  end_lr_fraction: float = 0.0
  aggregation: str = "mavo"         # dlion
  vote: str = "binary"              # dlion
  comm: str = "auto"                # dlion
  # Lion Cub options of dlion (see dlion_jax.scale_by_distributed_lion):
  quantizer: str = "sign"           # sign | ternary_l1 | pbit_l1
  bits: Optional[int] = None        # pbit_l1: bits per vote
  momentum_sync: int = 0            # k of the sync schedule; 0: never
  sync_schedule: str = "every"      # every (k steps) | growing (intervals)
  sync_leaves: Optional[str] = None  # regex on leaf paths; None: all
  min_compress_size: Optional[int] = None
  error_feedback: bool = False
  # dlion, signum (with local_steps: every outer step, a worker whose round
  # ended non-finite): a worker whose gradients are not all finite abstains
  # from the vote (dlion_jax.distributed_lion's abstain_nonfinite; the
  # outer steps' own); refused where nothing would abstain.
  abstain_nonfinite: bool = False
  # dlion, signum: the vote in buckets of this many gradient bytes, each
  # exchanged on its own (overlaps the backward pass); None: one message.
  bucket_bytes: Optional[int] = None
  # Local steps (dlion_jax.local_steps): each worker runs local_steps steps
  # of the optimizer above alone (lion for dlion, signum alone for signum:
  # nothing sent), then one outer step of the pseudo-gradients over the
  # workers: voted (dlion_jax.rounds.voted_outer: the workers' mean
  # pseudo-gradient from error-fed votes, dense with aggregation, vote,
  # comm, quantizer and bits above, or sparse, then an SGD, Nesterov or
  # Lion step; the best low-bit outer step measured: level with the
  # best-tuned fp32 one, a plain step on the exact mean, at 24x fewer
  # bits, docs/training.md), dlion (Distributed Lion's vote, with
  # aggregation, vote, comm and the Lion Cub options above) or nesterov
  # (DiLoCo's, an fp32 all-reduce; outer_momentum 0 for the plain step).
  # 1: every step is an optimizer step over the workers.
  local_steps: int = 1
  # With local_steps: the workers' own steps on their mean gradient (an
  # fp32 all-reduce every step), so every worker's params stay alike and
  # the outer step is Lookahead's slow step (Zhang et al., 2019).
  inner_allreduce: bool = False
  outer: str = "voted"              # voted | dlion | nesterov
  # nesterov, voted: constant, null 0.7 (DiLoCo's) and 0.5; dlion: the
  # peak, null 10 x learning_rate, shaped by the schedule above at each
  # round's last step (voted too with outer_schedule: inner).
  outer_learning_rate: Optional[float] = None
  # nesterov's momentum (null: 0.9); dlion's b1 (null: 0.9); voted's
  # Nesterov momentum (null: 0, none) or, with outer_step: lion, its b1
  # (null: 0.95).
  outer_momentum: Optional[float] = None
  outer_b2: Optional[float] = None  # dlion's b2 (0.99), voted lion's (0.98)
  # voted: the step on the voted mean, sgd (Nesterov with outer_momentum
  # above 0) or lion (b1 outer_momentum, b2 outer_b2); each worker's
  # residual carried into its next vote; sparse: outer_sparse_keep entries
  # of every outer_sparse_chunk vote (null: all, dense).
  outer_step: str = "sgd"           # sgd | lion
  outer_schedule: str = "constant"  # constant | inner
  outer_error_feedback: bool = True
  outer_sparse_chunk: Optional[int] = None
  outer_sparse_keep: int = 1
  # voted: each residual's weight in the next vote (SparseLoCo's decay),
  # the entries that share a scale (null: a leaf), the dense vote on one
  # entry in outer_fragments a round in turn, a sparse entry's bits (2:
  # sign and a magnitude bit).
  outer_error_decay: float = 1.0
  outer_scale_chunk: Optional[int] = None
  outer_fragments: int = 1
  outer_sparse_value_bits: int = 1
  # voted: each worker's scale clipped at this many times the workers'
  # median scale (null: the plain mean of the scales, which one worker's
  # huge scale moves).
  outer_scale_clip: Optional[float] = 2.0
  # voted: the dense vote's scale fitted to the workers' mean after the
  # vote, not their mean magnitude (the scales exchanged after the vote).
  outer_fit_scale: bool = False
  # voted: no vote, the workers' fp32 mean all-reduced (with
  # outer_fragments, an fp32 fragment a round): the vote's control.
  outer_fp32_mean: bool = False
  # The outer step one round late, its exchange apart from the step's
  # gradients (dlion_jax.local_steps's late).
  outer_late: bool = False


@dataclasses.dataclass
class TrainConfig:
  """Loop length, logging, evaluation and checkpoint cadence (in steps)."""
  steps: int = 300
  log_every: int = 10
  eval_every: int = 100             # 0: only at the end
  checkpoint_every: int = 0         # 0: only at the end
  keep_checkpoints: int = 2


@dataclasses.dataclass
class MeshConfig:
  """How the ``workers`` devices are laid out.

  ``nodes`` unset (null, the default): one data-parallel axis, every worker
  a voter. ``nodes: n``: a hybrid mesh of ``n`` nodes of ``workers / n``
  devices (:func:`dlion_jax.devices.hybrid_mesh`). A node's devices each
  differentiate their own rows, average their gradients exactly (one
  reduce-scatter) and each keeps its block of every leaf of the optimizer
  state (ZeRO-2); the optimizer works across the nodes only: dlion and
  signum vote between nodes, lion, adamw and sgd all-reduce the gradients
  (the updates of a run without ``nodes`` up to the rounding of the sums).

  ``shard_params: true`` (with ``nodes``): the params are sharded over a
  node's devices at rest too (:func:`dlion_jax.devices.shard_params`,
  ZeRO-3) and gathered for each step.
  """
  nodes: Optional[int] = None
  shard_params: bool = False


@dataclasses.dataclass
class FaultsConfig:
  """Faulty workers, for the studies (dlion_jax.train.faults): the first
  ``workers`` workers' gradients are sign-flipped, random, scaled by
  ``scale`` or NaN on a share ``nan_rate`` of the steps; with
  ``on: pseudo_gradients`` (local steps) what they send the outer step
  instead, once a round."""
  kind: str = "none"       # none | sign_flip | random | scale | nonfinite
  workers: int = 0
  on: str = "gradients"    # gradients | pseudo_gradients
  scale: float = 1e6
  nan_rate: float = 0.5


@dataclasses.dataclass
class Config:
  """A whole run. ``model`` holds ``name`` plus the model's keyword args."""
  name: str = "run"
  seed: int = 0
  workers: int = 8
  run_dir: Optional[str] = None     # default: runs/<name>
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  model: dict = dataclasses.field(default_factory=lambda: {"name": "mlp"})
  optimizer: OptimizerConfig = dataclasses.field(
      default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)

  @property
  def run_path(self) -> pathlib.Path:
    return pathlib.Path(self.run_dir or f"runs/{self.name}")


OPTIMIZER_NAMES = ("dlion", "lion", "adamw", "signum", "sgd")
_CHOICES = {
    "data.name": ("digits", "fashion_mnist", "text"),
    "optimizer.name": OPTIMIZER_NAMES,
    "optimizer.schedule": ("cosine", "constant"),
    "optimizer.aggregation": ("mavo", "avg"),
    "optimizer.vote": ("binary", "ternary"),
    "optimizer.comm": ("auto", "alltoall", "allgather", "psum", "psum_int8"),
    "optimizer.quantizer": ("sign", "ternary_l1", "pbit_l1"),
    "optimizer.sync_schedule": ("every", "growing"),
    "optimizer.outer": ("dlion", "nesterov", "voted"),
    "optimizer.outer_step": ("sgd", "lion"),
    "optimizer.outer_schedule": ("constant", "inner"),
    "faults.kind": ("none", "sign_flip", "random", "scale", "nonfinite"),
    "faults.on": ("gradients", "pseudo_gradients"),
}
_POSITIVE = ("workers", "data.global_batch", "data.seq_len", "data.eval_batch",
             "train.steps", "train.log_every", "train.keep_checkpoints",
             "optimizer.local_steps", "optimizer.outer_sparse_keep")
_NON_NEGATIVE = ("faults.workers", "train.eval_every",
                 "train.checkpoint_every",
                 "optimizer.warmup_steps", "optimizer.learning_rate",
                 "optimizer.weight_decay", "optimizer.momentum_sync")


def _type_name(tp) -> str:
  return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(key: str, value: Any, tp) -> Any:
  """Checks ``value`` against the annotation ``tp`` (ints pass as floats)."""
  args = typing.get_args(tp)
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    (tp,) = [a for a in args if a is not type(None)]
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if tp is dict and not isinstance(value, dict):
    raise ConfigError(f"{key} must be a mapping, got {value!r}.")
  if tp in (int, float, str, bool) and (
      not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
    raise ConfigError(
        f"{key}={value!r} has type {type(value).__name__}; expected "
        f"{_type_name(tp)}.")
  return value


def _build(cls, values: dict, prefix: str):
  if not isinstance(values, dict):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, "
                      f"got {values!r}.")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in values.items():
    if key not in fields:
      raise ConfigError(
          f"Unknown config key '{prefix}{key}'. Valid keys here: "
          f"{', '.join(sorted(fields))}.")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      kwargs[key] = _build(tp, value, f"{prefix}{key}.")
    else:
      kwargs[key] = _coerce(prefix + key, value, tp)
  return cls(**kwargs)


def _get(config: Config, dotted: str):
  value = config
  for part in dotted.split("."):
    value = getattr(value, part)
  return value


def validate(config: Config) -> Config:
  """Range and choice checks that types alone do not catch."""
  for key, valid in _CHOICES.items():
    if _get(config, key) not in valid:
      raise ConfigError(f"{key}={_get(config, key)!r} is not one of "
                        f"{', '.join(valid)}.")
  for key in _POSITIVE:
    if _get(config, key) <= 0:
      raise ConfigError(f"{key}={_get(config, key)!r} must be positive.")
  for key in _NON_NEGATIVE:
    if _get(config, key) < 0:
      raise ConfigError(f"{key}={_get(config, key)!r} must be >= 0.")
  if "name" not in config.model:
    raise ConfigError("model.name is missing (mlp, cnn, vit or gpt).")
  _validate_lion_cub(config.optimizer)
  if config.data.global_batch % config.workers:
    raise ConfigError(
        f"data.global_batch={config.data.global_batch} must be divisible by "
        f"workers={config.workers}: each worker takes an equal share.")
  _validate_mesh(config)
  _validate_limits(config.data)
  _validate_local_steps(config)
  _validate_abstain(config.optimizer)
  if config.faults.workers > config.workers:
    raise ConfigError(
        f"faults.workers={config.faults.workers} is more than the "
        f"workers={config.workers}.", key="faults.workers")
  if config.faults.on != "gradients" and config.optimizer.local_steps == 1:
    raise ConfigError(
        f"faults.on={config.faults.on} needs local steps (optimizer."
        "local_steps of 2 or more), whose outer step takes each worker's "
        "pseudo-gradient. Set optimizer.local_steps, or faults.on=gradients.",
        key="faults.on")
  return config


def _validate_local_steps(config: Config) -> None:
  """Local steps with an optimizer that has a local form and no momentum
  sync inside the outer vote."""
  opt = config.optimizer
  if opt.local_steps == 1:
    if opt.inner_allreduce:
      raise ConfigError(
          "optimizer.inner_allreduce=true needs optimizer.local_steps above "
          "1 (the workers' steps between outer steps); every step is over "
          "the workers without it: set optimizer.local_steps (e.g. 32), or "
          "drop optimizer.inner_allreduce.", key="optimizer.inner_allreduce")
    return
  fix = "or drop optimizer.local_steps"
  if opt.momentum_sync:
    raise ConfigError(
        f"optimizer.momentum_sync={opt.momentum_sync} with optimizer."
        f"local_steps={opt.local_steps}: the outer vote's momenta are not "
        f"synced yet. Set optimizer.momentum_sync=0, {fix}.",
        key="optimizer.momentum_sync")
  for key, what, example in (
      ("outer_momentum", "the outer step's momentum, or Lion's b1", 0.9),
      ("outer_b2", "the outer Lion step's b2", 0.98)):
    value = getattr(opt, key)
    why = None if value is None else _checks.rate_problem(value)
    if why:
      raise ConfigError(
          f"optimizer.{key}={value} must be in [0, 1) ({what}): {why}. Set "
          f"optimizer.{key}={example}, or null for the outer step's "
          "default.", key=f"optimizer.{key}")
  if opt.outer_learning_rate is not None and opt.outer_learning_rate <= 0:
    raise ConfigError(
        f"optimizer.outer_learning_rate={opt.outer_learning_rate} must be "
        "positive (null: the outer optimizer's default).",
        key="optimizer.outer_learning_rate")
  _validate_voted(opt)


def _validate_abstain(opt: OptimizerConfig) -> None:
  """``abstain_nonfinite`` only where a worker can abstain: dlion's and
  signum's votes, and with local steps every outer step (the workers' own
  steps send nothing)."""
  if not opt.abstain_nonfinite:
    return
  if opt.local_steps == 1 and opt.name not in ("dlion", "signum"):
    raise ConfigError(
        f"optimizer.abstain_nonfinite=true does nothing for optimizer.name="
        f"{opt.name}, which averages the workers' gradients (no vote to "
        "abstain from): a NaN or Inf gradient reaches every worker's params. "
        "Set optimizer.name=dlion or signum, or drop optimizer."
        "abstain_nonfinite (a non-finite loss then stops the run).",
        key="optimizer.abstain_nonfinite")


def _validate_voted(opt: OptimizerConfig) -> None:
  """The voted outer step's keys: set only with it, in range, and the
  sparse vote without the dense vote's options."""
  voted_only = {"outer_step": "sgd", "outer_schedule": "constant",
                "outer_error_feedback": True, "outer_sparse_chunk": None,
                "outer_sparse_keep": 1, "outer_error_decay": 1.0,
                "outer_scale_chunk": None, "outer_fragments": 1,
                "outer_sparse_value_bits": 1, "outer_scale_clip": 2.0,
                "outer_fit_scale": False, "outer_fp32_mean": False}
  for key, default in voted_only.items():
    if getattr(opt, key) != default and opt.outer != "voted":
      raise ConfigError(
          f"optimizer.{key}={getattr(opt, key)!r} applies to "
          f"optimizer.outer=voted, not {opt.outer}: set optimizer.outer="
          f"voted, or drop optimizer.{key}.", key=f"optimizer.{key}")
  chunk = opt.outer_sparse_chunk
  if chunk is None and opt.outer_sparse_keep != 1:
    raise ConfigError(
        f"optimizer.outer_sparse_keep={opt.outer_sparse_keep} needs "
        "optimizer.outer_sparse_chunk (e.g. 128): the entries of every "
        "chunk that vote.", key="optimizer.outer_sparse_keep")
  if chunk is None:
    if opt.outer == "voted":
      _validate_vote_levers(opt)
    return
  dense_only = {"aggregation": "mavo", "vote": "binary",
                "quantizer": "sign", "comm": "auto"}
  for key, default in dense_only.items():
    if getattr(opt, key) != default:
      raise ConfigError(
          f"optimizer.{key}={getattr(opt, key)} does not apply to the "
          f"sparse vote (optimizer.outer_sparse_chunk={chunk}), which "
          f"sends signs and positions: set optimizer.{key}={default}, or "
          "drop optimizer.outer_sparse_chunk for the dense vote.",
          key=f"optimizer.{key}")
  if chunk < 2 or chunk & (chunk - 1) or chunk > 2**15:
    raise ConfigError(
        f"optimizer.outer_sparse_chunk={chunk} must be a power of two from "
        "2 to 32768 (e.g. 128: one entry of every 128 votes), or null for "
        "the dense vote.", key="optimizer.outer_sparse_chunk")
  if opt.outer_sparse_keep >= chunk:
    raise ConfigError(
        f"optimizer.outer_sparse_keep={opt.outer_sparse_keep} must be below "
        f"optimizer.outer_sparse_chunk={chunk}.",
        key="optimizer.outer_sparse_keep")
  _validate_vote_levers(opt)


def _validate_vote_levers(opt: OptimizerConfig) -> None:
  """The voted mean's levers as the library checks them, its errors named
  by their keys."""
  keys = {name: f"outer_{name}" for name in (
      "error_decay", "scale_chunk", "fragments", "sparse_value_bits",
      "error_feedback", "sparse_chunk", "sparse_keep", "scale_clip",
      "fit_scale")}
  if opt.outer_fp32_mean:   # the vote's own keys then must stay unset
    keys.update({name: name for name in (
        "aggregation", "vote", "quantizer", "bits", "comm")})
  keys["fp32_mean"] = "outer_fp32_mean"   # last: an error names the other
  options = {name: getattr(opt, key) for name, key in keys.items()}
  try:
    rounds.scale_by_voted_mean(**options)
  except ValueError as e:
    named = [f"optimizer.{keys[name]}" for name in options
             if f"{name}=" in str(e)] or ["optimizer.outer"]
    raise ConfigError(f"{named[0]}: {e}", key=named[0]) from None


def schedule_warning(config: Config) -> str | None:
  """What is odd about the learning-rate schedule, if anything: a warmup
  as long as the run, or longer, so the rate never reaches its peak."""
  opt, steps = config.optimizer, config.train.steps
  if not opt.warmup_steps or opt.warmup_steps < steps:
    return None
  reached = opt.learning_rate * (steps - 1) / opt.warmup_steps
  return (f"optimizer.warmup_steps={opt.warmup_steps} is not below "
          f"train.steps={steps}: the learning rate rises for the whole run "
          f"and ends at {reached:.3g}, never reaching "
          f"optimizer.learning_rate={opt.learning_rate:g}"
          + ("" if opt.schedule == "constant" else
             ", and the cosine decay never starts")
          + f". Lower it, e.g. --set optimizer.warmup_steps={steps // 10}.")


def local_steps_warning(config: Config) -> str | None:
  """What a run with local steps leaves out of its model, if anything: the
  steps after the last round's end (the model is the anchor of the last
  outer step), or every step of a run shorter than a round."""
  h, steps = config.optimizer.local_steps, config.train.steps
  if h == 1 or steps % h == 0:
    return None
  if steps < h:
    return (f"train.steps={steps} is shorter than one round of "
            f"optimizer.local_steps={h}: no outer step runs, and the model "
            "evaluated and returned is the untrained one. Set train.steps to "
            f"a multiple of {h}, or lower optimizer.local_steps.")
  return (f"train.steps={steps} is not a multiple of optimizer.local_steps="
          f"{h}: the last {steps % h} steps end no round, so the model "
          f"evaluated and saved (the anchor) is step {steps - steps % h}'s. "
          f"Set train.steps={steps - steps % h} or {steps - steps % h + h}.")


# The data.limit_* keys each dataset's loader takes.
_LIMITS = {"fashion_mnist": ("limit_train", "limit_test"),
           "text": ("limit_test",), "digits": ()}


def _validate_limits(data: DataConfig) -> None:
  """No ``data.limit_*`` the dataset would silently ignore."""
  for key in ("limit_train", "limit_test"):
    value = getattr(data, key)
    if value is not None and key not in _LIMITS[data.name]:
      raise ConfigError(
          f"data.{key}={value} does nothing for data.name={data.name!r} "
          f"(it takes {', '.join(_LIMITS[data.name]) or 'no limits'}): "
          "remove it.", key=f"data.{key}")


def _validate_mesh(config: Config) -> None:
  """``mesh.nodes``, if set, divides ``workers``; ``mesh.shard_params``
  needs it."""
  nodes = config.mesh.nodes
  if config.mesh.shard_params and nodes is None:
    raise ConfigError(
        "mesh.shard_params=true shards the params over each node's devices, "
        "but mesh.nodes is not set (one data axis, no node to shard over). "
        "Set mesh.nodes (e.g. mesh.nodes=2), or drop mesh.shard_params.",
        key="mesh.shard_params")
  if nodes is None or (nodes >= 1 and config.workers % nodes == 0):
    return
  divisors = [d for d in range(1, config.workers + 1)
              if config.workers % d == 0]
  raise ConfigError(
      f"mesh.nodes={nodes} must be a positive divisor of workers="
      f"{config.workers}: each node gets workers / nodes devices. Use one "
      f"of {', '.join(map(str, divisors))}, or null for no hybrid layout.",
      key="mesh.nodes")


def _validate_lion_cub(opt: OptimizerConfig) -> None:
  """The library's own checks of the quantizer options, as ConfigErrors."""
  if opt.min_compress_size is not None and opt.min_compress_size < 0:
    raise ConfigError(f"optimizer.min_compress_size={opt.min_compress_size} "
                      "must be >= 0.")
  if opt.bucket_bytes is not None and opt.bucket_bytes < 1:
    raise ConfigError(f"optimizer.bucket_bytes={opt.bucket_bytes} must be "
                      "a positive number of gradient bytes, or null for one "
                      "message.")
  try:
    quantize.vote_spec(opt.quantizer, vote=opt.vote, bits=opt.bits)
  except ValueError as e:
    raise ConfigError(f"optimizer: {e}") from None
  if opt.sync_leaves is not None:
    try:
      re.compile(opt.sync_leaves)
    except re.error as e:
      raise ConfigError(f"optimizer.sync_leaves={opt.sync_leaves!r} is not "
                        f"a regular expression: {e}.") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
  *parents, leaf = dotted.split(".")
  node = tree
  for part in parents:
    node = node.setdefault(part, {})
    if not isinstance(node, dict):
      raise ConfigError(f"--set {dotted}: {part} is not a section.")
  node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
  """``'optimizer.learning_rate=1e-3'`` -> ``('optimizer.learning_rate',
  0.001)``; the value is read as YAML (numbers, lists, null, strings)."""
  key, sep, raw = text.partition("=")
  if not sep or not key:
    raise ConfigError(f"--set expects key=value, got {text!r}.")
  try:
    value = yaml.safe_load(raw) if raw else None
  except yaml.YAMLError as e:
    raise ConfigError(
        f"--set {text!r}: the value is not valid YAML ({_yaml_problem(e)}); "
        "close brackets and braces, and quote strings with ':' or '#'."
    ) from None
  if isinstance(value, str) and _looks_numeric(value):
    value = float(value)   # YAML 1.1 reads "1e-3" as a string
  return key.strip(), value


def _looks_numeric(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def _numbers_from_yaml(tree: Any) -> Any:
  if isinstance(tree, dict):
    return {k: _numbers_from_yaml(v) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_numbers_from_yaml(v) for v in tree]
  if isinstance(tree, str) and _looks_numeric(tree) and not tree.isalpha():
    return float(tree)
  return tree


def load_config(path: str | pathlib.Path | None = None,
                overrides: list[str] = ()) -> Config:
  """Reads a YAML config, applies ``key=value`` overrides, validates it.

  Example:
    >>> cfg = load_config(None, ["optimizer.name=lion", "train.steps=5"])
    >>> cfg.optimizer.name, cfg.train.steps
    ('lion', 5)
  """
  tree: dict = {}
  if path is not None:
    path = pathlib.Path(path)
    if not path.is_file():
      raise ConfigError(f"Config file {str(path)!r} does not exist.")
    tree = _numbers_from_yaml(_read_yaml(path) or {})
  for text in overrides:
    _set_dotted(tree, *parse_override(text))
  return validate(_build(Config, tree, ""))


def _yaml_problem(error: yaml.YAMLError) -> str:
  """What the YAML parser objects to, without its excerpt of the text."""
  problem = getattr(error, "problem", None)
  if not problem:
    return str(error).splitlines()[0]
  context, opened = getattr(error, "context", None), getattr(
      error, "context_mark", None)
  mark = getattr(error, "problem_mark", None)
  if context and opened and mark and opened.line != mark.line:
    context += f" that starts on line {opened.line + 1}"
  return f"{problem}, {context}" if context else problem


def _read_yaml(path: pathlib.Path) -> Any:
  try:
    return yaml.safe_load(path.read_text(encoding="utf-8"))
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}); "
                      "--config takes a YAML file.") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = (f"{path}, line {mark.line + 1}, column {mark.column + 1}"
             if mark else str(path))
    raise ConfigError(
        f"{where}: not valid YAML ({_yaml_problem(e)}). Check the "
        "indentation there, the ':' after each key, and close brackets and "
        "quotes.") from None


def locate(path: str | pathlib.Path | None, key: str) -> str | None:
  """``'FILE, line N'``: where the YAML file sets ``key`` (dotted), or
  opens its closest enclosing section (``model:`` for a missing
  ``model.hidden``); None if it does neither.
  """
  if path is None or not pathlib.Path(path).is_file():
    return None
  try:
    node = yaml.compose(pathlib.Path(path).read_text(encoding="utf-8"))
  except yaml.YAMLError:
    return None
  line = None
  for part in key.split("."):
    if not isinstance(node, yaml.MappingNode):
      break
    found = [(k, v) for k, v in node.value if k.value == part]
    if not found:
      break
    line, node = found[0][0].start_mark.line + 1, found[0][1]
  return None if line is None else f"{path}, line {line}"


def to_dict(config: Config) -> dict:
  return dataclasses.asdict(config)
