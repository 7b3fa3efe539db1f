"""Deprecated: ``dlion_jax.quantize`` is private from
0.3.0 (``dlion_jax._quantize``), and this path goes in 0.4.0; every name
still works here with a ``DeprecationWarning``."""

from dlion_jax import _deprecations

__getattr__ = _deprecations.old_paths(__name__)
