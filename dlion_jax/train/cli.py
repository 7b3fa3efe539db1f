"""python -m dlion_jax.train: train from a YAML config.

The command-line front of :func:`dlion_jax.train.trainer.train`: reads a
shipped config or a YAML file, applies ``--set`` overrides, starts jax
(several processes with ``--coordinator``), trains, and turns every expected
failure into one line on stderr: ``config error: ...`` (exit 2), ``error:
...`` (exit 1; a full disk included: what failed, the last good checkpoint,
what to free), or, on Ctrl-C (exit 130) or SIGTERM (exit 143, once a
checkpoint of the step reached is written), the step reached and how to
resume. Restarted by ``python -m dlion_jax.launch --restarts K`` after a
process was lost, it resumes by itself on the survivors' workers
(:mod:`dlion_jax.train.restarts`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import signal
import sys

from dlion_jax.train import missing_extra
from dlion_jax.train import restarts
from dlion_jax.train import rundir
from dlion_jax.train import signals
from dlion_jax.train.config import ConfigError
from dlion_jax.train.config import OPTIMIZER_NAMES
from dlion_jax.train.config import load_config
from dlion_jax.train.config import locate

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"


def resolve_config(name: str | None) -> pathlib.Path:
  """A path, or the name of a config shipped in ``configs/``."""
  if name is None:
    return CONFIG_DIR / "quickstart.yaml"
  path = pathlib.Path(name)
  if path.is_file():
    return path
  shipped = CONFIG_DIR / (path.name if path.suffix else f"{name}.yaml")
  if shipped.is_file():
    return shipped
  known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
  raise ConfigError(f"--config {name!r}: no such file, and no shipped config "
                    f"of that name (shipped: {known}).")


PROG = "python -m dlion_jax.train"
OPTIMIZERS = {
    "dlion": "Distributed Lion: workers exchange 1-bit sign votes",
    "signum": "majority-vote Signum: D-Lion with b1 = b2 = "
              "optimizer.momentum",
    "lion": "global Lion (all-reduces fp32 gradients)",
    "adamw": "AdamW (all-reduces fp32 gradients)",
    "sgd": "SGD with momentum (all-reduces fp32 gradients)",
}
EXAMPLES = f"""\
examples:
  {PROG}                 # configs/quickstart.yaml
  {PROG} --config fashion_mnist_mlp --set train.steps=50
  {PROG} --config my.yaml --resume
  {PROG} --set optimizer.name=lion \\
      --set run_dir=runs/quickstart-lion
  python -m dlion_jax.launch -n 2 -- {PROG} \\
      --set workers=2 --set run_dir=runs/quickstart-2proc   # 2 processes
"""
RUN_DIR_NOTE = """\
A run writes config.json, metrics.jsonl, summary.json, curves.png and
checkpoints to run_dir (default runs/<name>). A new run refuses a directory
that holds an earlier run: --resume continues that run, --overwrite deletes
it, --set run_dir=DIR puts this run elsewhere."""


def config_summary(path: pathlib.Path) -> str:
  """The first comment line of a YAML config: what it trains."""
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.startswith("#"):
      return line.lstrip("#").strip()
  return ""


def help_epilog() -> str:
  """Examples, the shipped configs and the optimizers, as plain text."""
  configs = sorted(CONFIG_DIR.glob("*.yaml"))
  width = max(len(p.stem) for p in configs) + 2
  lines = [EXAMPLES, "shipped configs (--config NAME; times on 2 CPU cores):"]
  lines += [f"  {p.stem:<{width}}{config_summary(p)}" for p in configs]
  lines += ["", "optimizers (--set optimizer.name=NAME):"]
  lines += [f"  {n:<8}{OPTIMIZERS[n]}" for n in OPTIMIZER_NAMES]
  return "\n".join(lines + ["", RUN_DIR_NOTE])


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog=PROG, description="Train from a YAML config, a shipped one "
      "(below) or a file of yours,\nany key overridden with --set.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=help_epilog())
  parser.add_argument("--config", help="YAML file or shipped config name "
                      "(default: quickstart)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE",
                      help="override a config key, e.g. train.steps=100")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the run directory's last "
                      "checkpoint (workers, mesh.nodes and the number of "
                      "processes may differ from the run's)")
  parser.add_argument("--resize-policy", choices=("mean", "all", "keep"),
                      default="mean",
                      help="with --resume on another number of workers: "
                      "each new worker's momentum is the mean of those it "
                      "replaces (mean, the default), the mean of all (all), "
                      "or one old worker's (keep)")
  parser.add_argument("--overwrite", action="store_true",
                      help="delete an earlier run in the run directory "
                      "(its checkpoints, metrics, summary) before starting")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar (metrics still go to JSON lines)")
  env = os.environ.get
  parser.add_argument("--coordinator", default=env("JAX_COORDINATOR_ADDRESS"),
                      help="host:port of process 0 for multi-process runs")
  parser.add_argument("--num-processes", type=int,
                      default=int(env("JAX_NUM_PROCESSES", "1")))
  parser.add_argument("--process-id", type=int,
                      default=int(env("JAX_PROCESS_ID", "0")))
  parser.add_argument("--init-timeout", type=float, metavar="SECONDS",
                      default=float(env("DLION_INIT_TIMEOUT", "60")),
                      help="multi-process start-up: give up (exit 1) if not "
                      "every process has joined the coordinator after this "
                      "long (default 60, or DLION_INIT_TIMEOUT)")
  parser.add_argument("--heartbeat-timeout", type=float, metavar="SECONDS",
                      default=float(env("DLION_HEARTBEAT_TIMEOUT", "60")),
                      help="multi-process: a process that stops answering "
                      "(hung, or its host gone) for this long is declared "
                      "dead and every process exits with an error (default "
                      "60, or DLION_HEARTBEAT_TIMEOUT). A process that dies "
                      "outright is noticed at the next step.")
  return parser.parse_args(argv)


# How the multi-process arguments of processes.start_processes are spelled
# here, so that its errors name the flags.
_FLAGS = {"num_processes": "--num-processes", "process_id": "--process-id",
          "coordinator": "--coordinator", "init_timeout": "--init-timeout",
          "heartbeat_timeout": "--heartbeat-timeout"}


def _start_jax(cfg, args) -> None:
  """Multi-process start-up and device count, before jax's backend starts."""
  from dlion_jax import processes  # pylint: disable=g-import-not-at-top
  n, address = args.num_processes, args.coordinator
  if cfg.workers % n:
    raise ConfigError(f"workers={cfg.workers} must be divisible by "
                      f"--num-processes={n}.")
  if n > 1:
    try:
      processes.check_processes(n, args.process_id, address,
                                args.init_timeout, args.heartbeat_timeout,
                                names=_FLAGS)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  hint = (f"Start the others with --coordinator {address} --num-processes "
          f"{n} --process-id 1..{n - 1}, or use python -m dlion_jax.launch."
          if args.process_id == 0 else
          f"Is process 0 running with --coordinator {address}, and reachable "
          "from here?")
  processes.start_processes(cfg.workers // n, num_processes=n,
                            process_id=args.process_id, coordinator=address,
                            init_timeout=args.init_timeout,
                            heartbeat_timeout=args.heartbeat_timeout,
                            timeout_hint=hint)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  path = None
  try:
    path = resolve_config(args.config)
    cfg = load_config(path, args.overrides)
    if args.resume and args.overwrite:
      raise ConfigError("--resume continues the run in the run directory, "
                        "--overwrite deletes it: pass one of them.")
    restart = _restart_info(args)
    if restart is not None:
      cfg = restarts.on_survivors(cfg, restart)
  except ConfigError as e:
    return config_error(e, path, args.overrides)
  try:
    with signals.raising():     # SIGTERM ends the run as Ctrl-C does
      _start_jax(cfg, args)
      return _train(cfg, args, argv, restart)
  except ConfigError as e:
    return config_error(e, path, args.overrides)
  except KeyboardInterrupt as e:
    return _interrupted(e, cfg, args, argv)


def _restart_info(args):
  """This start under ``python -m dlion_jax.launch --restarts`` (None if
  not); at the first, process 0 warns of the restarts the config would
  not survive."""
  from dlion_jax import processes  # pylint: disable=g-import-not-at-top
  try:
    info = processes.restart_info()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return info


def _warn_of_restarts(cfg, restart) -> None:
  """At the first start under the launcher's restarts, process 0 says which
  restarts the config would not survive, and where a restart would resume
  mid-round."""
  if restart is None or restart.restart:
    return
  opt, every = cfg.optimizer, cfg.train.checkpoint_every
  warnings = [restarts.fragile_counts(cfg, restart)]
  if opt.local_steps > 1 and every % opt.local_steps:
    warnings.append(
        f"train.checkpoint_every={every} is not a multiple of optimizer."
        f"local_steps={opt.local_steps}: a restart resumes mid-round, on "
        "fewer workers each new worker's params the mean of those it "
        "replaces. A multiple resumes at an anchor (an outer step).")
  for warning in filter(None, warnings):
    print(f"warning: {warning}", file=sys.stderr, flush=True)


def _train(cfg, args, argv=(), restart=None) -> int:
  """Trains; reports an expected failure as one ``error:`` line (exit 1)."""
  try:
    from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
    if args.process_id == 0:
      _warn_of_restarts(cfg, restart)
    resume, overwrite = restarts.resume_mode(
        cfg.run_path, restart, resume=args.resume, overwrite=args.overwrite)
    trainer.train(cfg, resume=resume, overwrite=overwrite,
                  progress=not args.no_progress,
                  resize_policy=args.resize_policy, restart=restart)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if missing_extra(e, PROG):
      print(missing_extra(e, PROG), file=sys.stderr)
      return 1
    from dlion_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
    if args.num_processes > 1 and lost_peer(e):
      _exit_lost_peer(e, cfg, args)
    if checkpoint.disk_full(e):
      print(_disk_full(e, cfg, args, argv), file=sys.stderr, flush=True)
      _EXIT_AT_ONCE.append(1)
      return 1
    if not isinstance(e, (FileNotFoundError, ValueError, FloatingPointError)):
      raise
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


# Set when the process should end without the interpreter's shutdown: after a
# full disk, orbax's failed writer threads may still print tracebacks.
_EXIT_AT_ONCE: list[int] = []


def run() -> None:
  """``python -m dlion_jax.train``: :func:`main`, then exit with its code."""
  code = main()
  if _EXIT_AT_ONCE:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)


def _disk_full(error: Exception, cfg, args, argv) -> str:
  """One line: what failed, the last good checkpoint, what to free."""
  size = getattr(error, "checkpoint_bytes", None)
  each = f", each about {_fmt_bytes(size)}" if size else ""
  what = (str(error) if getattr(error, "step", None) is not None else
          f"writing to {cfg.run_path} failed: no space left on the device")
  return (f"error: {what}. Free space on the file system holding "
          f"{cfg.run_path.absolute()} (delete runs you no longer need, or "
          f"keep fewer checkpoints: train.keep_checkpoints="
          f"{cfg.train.keep_checkpoints}{each}); "
          f"{_how_to_continue(cfg, args, argv)}")


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"


def config_error(error: ConfigError, path=None, overrides=()) -> int:
  """Prints ``error`` as one line, led by where its key was set (the
  ``--set`` that set it, or the config file and line); returns 2."""
  where = None
  if error.key:
    given = [o for o in overrides
             if _related(o.partition("=")[0].strip(), error.key)]
    where = f"--set {given[-1]}" if given else (
        locate(path, error.key) or (str(path) if path else None))
  print(f"config error: {where + ': ' if where else ''}{error}",
        file=sys.stderr)
  return 2


def _related(a: str, b: str) -> bool:
  """Whether dotted keys ``a`` and ``b`` are equal or one contains the
  other."""
  return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _interrupted(error: KeyboardInterrupt, cfg, args, argv) -> int:
  """Reports Ctrl-C or SIGTERM in one line: the step reached, the last
  checkpoint and how to continue. Returns 130 (Ctrl-C) or 143 (SIGTERM),
  128 + the signal's number; exits at once in a multi-process run, as jax's
  shutdown barrier would wait for the others."""
  signum = getattr(error, "signum", signal.SIGINT)
  step = getattr(error, "step", None)
  reached = ("before training started" if step is None else
             f"at step {step} of {cfg.train.steps}")
  how = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
  print(f"{how} {reached}; {_how_to_continue(cfg, args, argv)}",
        file=sys.stderr, flush=True)
  code = 128 + signum
  if args.num_processes > 1:
    sys.stdout.flush()
    os._exit(code)  # pylint: disable=protected-access
  return code


def _how_to_continue(cfg, args, argv) -> str:
  steps = rundir.checkpoint_steps(cfg.run_path)
  again = shlex.join([*PROG.split(), *[a for a in argv if a not in (
      "--resume", "--overwrite")]])
  every = " on every process" if args.num_processes > 1 else ""
  if not steps:
    return (f"no checkpoint was written yet. Start again{every} with: "
            f"{again} --overwrite")
  where = f"step {steps[-1]} in {cfg.run_path / 'checkpoints'}"
  if steps[-1] >= cfg.train.steps:
    return (f"training had finished (checkpoint {where}) but summary.json "
            "or curves.png may be missing.")
  return (f"the last checkpoint is {where}. Continue{every} with: {again} "
          "--resume")


# What gloo, gRPC and jax's coordination service say when another process
# died, was killed or became unreachable (docs/reliability.md, section 3),
# e.g. "Gloo AllGather failed: [...] Read error [...]: Connection reset by
# peer" or "The following tasks are unhealthy (stopped sending heartbeats)".
_PEER_LOST = re.compile("|".join((
    r"connection (?:reset|closed) by peer",
    r"connection refused",
    r"socket closed",
    r"broken pipe",
    r"gloo\b.*\b(?:read|write) error",
    r"stopped sending heartbeats",
    r"heartbeat timeout",
    r"\btask\b.*\b(?:died|crashed)\b",
)), re.IGNORECASE)


def lost_peer(error: BaseException) -> bool:
  """Whether ``error`` (or an error it was raised from) says that another
  process is gone: a reset, closed or refused connection, a closed socket,
  missed heartbeats or a task that died.

  Any other error is not, whatever its type (a jax runtime error such as an
  out-of-memory, a ValueError that mentions a barrier), and neither is a
  Python ``OSError``: those come from the program's own files and sockets.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if not isinstance(error, OSError) and _PEER_LOST.search(str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def last_checkpoint_step(run_dir: pathlib.Path) -> int | None:
  """The newest finished checkpoint step in ``run_dir`` (read off the
  directory names, without orbax)."""
  steps = rundir.checkpoint_steps(run_dir)
  return steps[-1] if steps else None


def _exit_lost_peer(error: BaseException, cfg, args) -> None:
  """Reports a failed cross-process collective and exits at once.

  Returning normally would run jax.distributed's shutdown barrier, which
  waits for the dead process until --heartbeat-timeout and then aborts with
  a C++ stack trace; the error says more and ends sooner.
  """
  cause = str(error).strip().splitlines()[0] if str(error).strip() else (
      type(error).__name__)
  step = last_checkpoint_step(cfg.run_path)
  resume = (f"The last checkpoint is step {step} in "
            f"{cfg.run_path / 'checkpoints'}: restart every process with "
            "--resume to continue from it." if step is not None else
            "No checkpoint was written yet: restart without --resume.")
  print(f"error: process {args.process_id} of {args.num_processes} lost "
        "contact with the other processes during training (one died, was "
        f"killed or became unreachable): {cause}. {resume}",
        file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)  # pylint: disable=protected-access
