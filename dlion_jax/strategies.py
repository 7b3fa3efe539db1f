"""Deprecated: ``dlion_jax.strategies`` is private from
0.3.0 (``dlion_jax._strategies``), and this path goes in 0.4.0; every name
still works here with a ``DeprecationWarning``."""

from dlion_jax import _deprecations

__getattr__ = _deprecations.old_paths(__name__)
