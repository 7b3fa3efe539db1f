"""``python -m dlion_jax.train``; see :mod:`dlion_jax.train.cli`."""

import sys

from dlion_jax.train.cli import main

sys.exit(main())
