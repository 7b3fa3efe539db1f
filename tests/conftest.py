"""8 simulated CPU devices for every test (set before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() >= 8, jax.devices()
