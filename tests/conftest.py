"""8 simulated CPU devices for every test (set before jax is imported), and
the test tiers: every test not marked ``integration`` or ``slow`` is
``core``."""

import os

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist's workers each load libtpu for the ahead-of-time TPU compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() >= 8, jax.devices()


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(items):
  """Marks every test not marked ``integration`` or ``slow`` as ``core``:
  ``python -m pytest -q -m core`` runs the library's correctness tier."""
  for item in items:
    if not (item.get_closest_marker("integration")
            or item.get_closest_marker("slow")):
      item.add_marker(pytest.mark.core)
