"""``python -m dlion_jax.train``; see :mod:`dlion_jax.train.cli`."""

from dlion_jax.train.cli import run

run()
