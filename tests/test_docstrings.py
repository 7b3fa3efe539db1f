"""The examples in the docstrings of every module with examples (those of
the API reference) run and print what they say."""

import doctest

import pytest

from dlion_jax import _message as message
from dlion_jax import _packing as packing
from dlion_jax import _per_worker
from dlion_jax import _quantize as quantize
from dlion_jax import accounting
from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax import hlo
from dlion_jax import lion
from dlion_jax import parallel
from dlion_jax import rounds
from dlion_jax import sync
from dlion_jax import transforms
from dlion_jax import workers


# per_worker lives in _per_worker (dl.parallel.per_worker): its example.
@pytest.mark.parametrize("module", [_per_worker, accounting, devices, elastic,
                                    hlo, lion, message, packing, parallel,
                                    quantize, rounds, sync, transforms,
                                    workers],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
