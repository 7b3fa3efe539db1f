"""``python -m dlion_jax.train``; see :mod:`dlion_jax.train.cli`."""

import sys

from dlion_jax import _platforms
from dlion_jax.train import missing_extra

_platforms.quiet_tpu_probe()     # before JAX starts: no libtpu noise

try:
  from dlion_jax.train.cli import run
except ModuleNotFoundError as e:
  line = missing_extra(e, "python -m dlion_jax.train")
  if line is None:
    raise
  sys.exit(line)

run()
