"""The user guides of docs/guides/ run as written: each guide's ``>>>``
examples, in one namespace per guide, print what the guide says they print.

Code blocks without prompts (commands, scripts for several processes or a
TPU) are not run. The guides need the 8 simulated CPU devices of
tests/conftest.py.
"""

import doctest
import importlib.util
import pathlib

import pytest

GUIDES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides"
# Each guide, and the packages beyond jax and optax that its examples import.
REQUIRES = {
    "optax_lion.md": (),
    "flax_nnx.md": ("flax",),
    "linen_train_state.md": ("flax",),
    "pmap.md": (),
    "sharded.md": (),
    "multihost_tpu.md": (),
    "checkpoints.md": ("orbax.checkpoint", "flax"),
    "wire_bytes.md": (),
}


def test_the_guides_are_the_eight_expected():
  assert sorted(p.name for p in GUIDES.glob("*.md")) == sorted(REQUIRES)


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REQUIRES))
def test_guide_examples_print_what_they_say(name):
  for module in REQUIRES[name]:
    if importlib.util.find_spec(module.split(".")[0]) is None:
      pytest.skip(f"{name} needs {module} (the [examples] extra)")
  result = doctest.testfile(
      str(GUIDES / name), module_relative=False, encoding="utf-8",
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
      raise_on_error=False, verbose=False)
  assert result.attempted > 0, f"{name} runs no example"
  assert result.failed == 0, (
      f"{result.failed} of the {result.attempted} examples of {name} failed "
      "(doctest printed each above)")
