"""Old public paths warn at their old place and give the object at the new
one, for the release dlion_jax._deprecations.MOVED names (the optax way:
one import path per name, the old one kept a release)."""

import importlib
import subprocess
import sys
import types
import warnings

import pytest

from dlion_jax import _deprecations
import dlion_jax as dl
import public_0_2

NAMED = sorted(k for k in _deprecations.MOVED if not k.endswith(".*"))
MODULES = sorted(k[:-2] for k in _deprecations.MOVED if k.endswith(".*"))
PUBLIC_0_2 = public_0_2.listed()


def _new_path(old):
  """Where MOVED sends ``old``; None for a path that is public still."""
  if old in _deprecations.MOVED:
    return _deprecations.MOVED[old][0]
  module, _, name = old.rpartition(".")
  if f"{module}.*" in _deprecations.MOVED:
    return f"{_deprecations.MOVED[module + '.*'][0]}.{name}"
  return None


def _resolve(path):
  module, _, name = path.rpartition(".")
  return getattr(importlib.import_module(module), name)


@pytest.mark.skipif(not public_0_2.has_history(),
                    reason="a clone without 0.2.0's commits")
def test_the_list_of_0_2_0s_paths_is_its_sources():
  """tests/data/public_0_2.txt is what tests/public_0_2.py reads off git."""
  assert PUBLIC_0_2 == sorted(set().union(
      *map(public_0_2.public_paths, public_0_2.REVS)))
  assert len(PUBLIC_0_2) > 200


@pytest.mark.parametrize("old", PUBLIC_0_2)
def test_every_path_public_in_0_2_0_works_until_0_4_0(old):
  """Each path 0.2.0 made public gives its object: a path that moved warns
  once, naming the new path and the release that removes the old one,
  and gives the object at the new path; a path public still, silently."""
  module, _, name = old.rpartition(".")
  new = _new_path(old)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    found = getattr(importlib.import_module(module), name)
  said = [str(w.message) for w in caught
          if issubclass(w.category, DeprecationWarning)]
  if new is None:
    assert not said
    return
  assert len(said) == 1, said
  assert said[0].startswith(f"{old} is deprecated: "), said
  assert new in said[0], said
  assert said[0].endswith(f"goes in {_deprecations.REMOVED_IN}."), said
  assert found is _resolve(new)


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
