"""Old public paths warn at their old place and give the object at the new
one, for the release dlion_jax._deprecations.MOVED names (the optax way:
one import path per name, the old one kept a release)."""

import importlib
import subprocess
import sys
import types

import pytest

from dlion_jax import _deprecations
import dlion_jax as dl

NAMED = sorted(k for k in _deprecations.MOVED if not k.endswith(".*"))
MODULES = sorted(k[:-2] for k in _deprecations.MOVED if k.endswith(".*"))


@pytest.mark.parametrize("old", NAMED)
def test_an_old_path_warns_and_gives_the_object_at_its_new_place(old):
  module, _, name = old.rpartition(".")
  new, _ = _deprecations.MOVED[old]
  with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*"
                    rf"goes in {_deprecations.REMOVED_IN}\."):
    found = getattr(importlib.import_module(module), name)
  new_module, _, new_name = new.rpartition(".")
  assert found is getattr(importlib.import_module(new_module), new_name)


@pytest.mark.parametrize("module", MODULES)
def test_every_name_of_a_module_made_private_still_works(module):
  """``import dlion_jax.packing`` and ``dl.packing`` still give every name
  of the private module, each with a warning; the module's own dunders
  none."""
  target, _ = _deprecations.MOVED[module + ".*"]
  private = importlib.import_module(target)
  names = [n for n in vars(private) if not n.startswith("_")
           and not isinstance(vars(private)[n], types.ModuleType)]
  assert names
  old = getattr(dl, module.rpartition(".")[2])
  for name in names:
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is "
                      r"deprecated: it is private from"):
      assert getattr(old, name) is getattr(private, name)


def test_an_unknown_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    dl.workers.nothing  # pylint: disable=pointless-statement
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    dl.packing.nothing  # pylint: disable=pointless-statement


def test_the_library_itself_uses_no_old_path():
  """Importing every module of the library, in a fresh process, warns
  nothing (in the test run such a warning is an error everywhere else)."""
  modules = ["accounting", "devices", "elastic", "hlo", "lion", "parallel",
             "processes", "rounds", "sync", "transforms", "workers", "launch",
             "train", "train.trainer", "bench", "bench.step", "bench.wire"]
  code = "; ".join(f"import dlion_jax.{m}" for m in modules)
  done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning",
                         "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
