"""dlion_jax: Distributed Lion and Lion Cub as optax transformations.

Workers exchange bit-packed sign votes over ``jax.lax`` collectives instead of
all-reducing fp32 gradients (Liu et al., NeurIPS 2024; Ishikawa et al., ICML
2025).
"""

from dlion_jax import accounting
from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax import hlo
from dlion_jax import parallel
from dlion_jax import rounds
from dlion_jax import sync
from dlion_jax import transforms
from dlion_jax import workers
from dlion_jax.accounting import allreduce_bits
from dlion_jax.accounting import sparse_vote_bits
from dlion_jax.accounting import wire_bits
from dlion_jax.hlo import collective_bytes
from dlion_jax.hlo import collective_bytes_by_axis
from dlion_jax.hlo import collective_bytes_by_link
from dlion_jax.lion import AbstainingErrorFeedbackState
from dlion_jax.lion import AbstainingState
from dlion_jax.lion import DistributedLionState
from dlion_jax.lion import ErrorFeedbackState
from dlion_jax.lion import distributed_lion
from dlion_jax.lion import scale_by_distributed_lion
from dlion_jax.lion import skip_if_none_voted
from dlion_jax.rounds import LocalStepsState
from dlion_jax.rounds import local_steps
from dlion_jax.transforms import apply_if_finite

__version__ = "0.2.0"

__all__ = (
    "AbstainingErrorFeedbackState",
    "AbstainingState",
    "DistributedLionState",
    "ErrorFeedbackState",
    "LocalStepsState",
    "accounting",
    "allreduce_bits",
    "apply_if_finite",
    "collective_bytes",
    "collective_bytes_by_axis",
    "collective_bytes_by_link",
    "devices",
    "distributed_lion",
    "elastic",
    "hlo",
    "local_steps",
    "parallel",
    "rounds",
    "scale_by_distributed_lion",
    "skip_if_none_voted",
    "sparse_vote_bits",
    "sync",
    "transforms",
    "wire_bits",
    "workers",
)

# The codec's old public modules (dl.packing, dl.message, ...), each a
# file that warns on every name (dlion_jax._deprecations.MOVED).
_OLD_MODULES = ("packing", "strategies", "message", "exchange", "quantize",
                "fused", "shards")


def __getattr__(name: str):
  if name in _OLD_MODULES:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"dlion_jax.{name}")
  raise AttributeError(f"module 'dlion_jax' has no attribute {name!r}")
