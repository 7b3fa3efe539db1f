"""8 simulated CPU devices for every test (set before jax is imported), and
the test tiers: every test not marked ``integration`` or ``slow`` is
``core``."""

import os
import shutil
import signal
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist's workers each load libtpu for the ahead-of-time TPU compiles.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One XLA compilation cache for the run, shared by pytest-xdist's workers
# and the processes the tests start (they inherit it): many tests compile
# the same steps, the CLI's above all. Made here, in the controller, before
# the workers start; removed when the run ends.
_MADE_HERE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _MADE_HERE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="dlion_jax-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

assert jax.device_count() >= 8, jax.devices()


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(items):
  """Marks every test not marked ``integration`` or ``slow`` as ``core``:
  ``python -m pytest -q -m core`` runs the library's correctness tier."""
  for item in items:
    if not (item.get_closest_marker("integration")
            or item.get_closest_marker("slow")):
      item.add_marker(pytest.mark.core)


@pytest.hookimpl(tryfirst=True)   # before the test's fixtures
def pytest_runtest_setup(item):
  """No compilation cache for the compile-only TPU devices (``tpu_aot``):
  they cannot read an executable back, and jax warns on every read."""
  on = item.get_closest_marker("tpu_aot") is None
  if jax.config.jax_enable_compilation_cache != on:
    jax.config.update("jax_enable_compilation_cache", on)
    compilation_cache.reset_cache()     # jax reads the option once


def pytest_unconfigure(config):
  # The process that made it removes it (not a worker, nor a pytest run
  # inside a test: they inherit the variable).
  if _MADE_HERE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Started in the background (``pytest ... &`` in a script), the run inherits
# SIGINT ignored, and so would the training processes whose Ctrl-C the tests
# check: Python's own handling, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signal_handling_left_as_found():
  """A test that leaves SIGINT ignored or blocked would make every later
  test's Ctrl-C to a training process (which inherits both) hang; one that
  leaves a handler of its own, act on a signal as nothing else expects."""
  handlers = {s: signal.getsignal(s) for s in SIGNALS}
  blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
  yield
  changed = {signal.Signals(s).name: (h, signal.getsignal(s))
             for s, h in handlers.items() if signal.getsignal(s) != h}
  now_blocked = signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
  for s, h in handlers.items():
    if h is not None:
      signal.signal(s, h)
  assert not changed, f"the test left signal handlers changed: {changed}"
  assert now_blocked == blocked, (
      f"the test left signals blocked: {now_blocked - blocked}")
