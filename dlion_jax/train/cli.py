"""``python -m dlion_jax.train``: train from a YAML config.

Examples::

  python -m dlion_jax.train                      # configs/quickstart.yaml
  python -m dlion_jax.train --config fashion_mnist_mlp --set train.steps=50
  python -m dlion_jax.train --config my.yaml --resume
  # one of two processes (or use python -m dlion_jax.launch -n 2 -- ...):
  python -m dlion_jax.train --coordinator 127.0.0.1:1234 \\
      --num-processes 2 --process-id 0
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from dlion_jax.train.config import ConfigError
from dlion_jax.train.config import load_config

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


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m dlion_jax.train", description=__doc__.split("\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n", 2)[2])
  parser.add_argument("--config", help="YAML file or shipped config name "
                      "(default: quickstart)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE",
                      help="override a config key, e.g. train.steps=100")
  parser.add_argument("--resume", action="store_true",
                      help="continue from the run directory's last checkpoint")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar (metrics still go to JSON lines)")
  env = os.environ.get
  parser.add_argument("--coordinator", default=env("JAX_COORDINATOR_ADDRESS"),
                      help="host:port of process 0 for multi-process runs")
  parser.add_argument("--num-processes", type=int,
                      default=int(env("JAX_NUM_PROCESSES", "1")))
  parser.add_argument("--process-id", type=int,
                      default=int(env("JAX_PROCESS_ID", "0")))
  return parser.parse_args(argv)


def _start_jax(cfg, args) -> None:
  """Multi-process start-up and device count, before jax's backend starts."""
  import jax  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
  n = args.num_processes
  if cfg.workers % n:
    raise ConfigError(f"workers={cfg.workers} must be divisible by "
                      f"--num-processes={n}.")
  if n > 1:
    if not args.coordinator:
      raise ConfigError("--num-processes > 1 needs --coordinator host:port "
                        "(or JAX_COORDINATOR_ADDRESS).")
    jax.config.update("jax_num_cpu_devices", cfg.workers // n)
    jax.distributed.initialize(args.coordinator, num_processes=n,
                               process_id=args.process_id,
                               initialization_timeout=120)
  parallel.use_cpu_devices(cfg.workers // n)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cfg = load_config(resolve_config(args.config), args.overrides)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  _start_jax(cfg, args)
  from dlion_jax.train import trainer  # pylint: disable=g-import-not-at-top
  try:
    trainer.train(cfg, resume=args.resume, progress=not args.no_progress)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0
