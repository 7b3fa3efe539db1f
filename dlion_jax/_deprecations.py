"""Old public paths, kept for one release behind a ``DeprecationWarning``.

:data:`MOVED` is the one table of them: each old path, where its name went
(a public path, or a private module where no public name replaces it) and
the release that removes it. A module with old paths gets a module-level
``__getattr__`` (PEP 562) from :func:`old_paths`, which imports the name
from its new place only when asked for, as optax deprecates its names; a
module made private keeps a file at its old path whose every name warns.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

# The release that deprecated the paths below, and the one that removes them.
DEPRECATED_IN = "0.3.0"
REMOVED_IN = "0.4.0"

_CODEC = "the vote's codec, which dl.distributed_lion runs for you"
_COMM = ("dl.accounting.cheapest_comm(num_workers, ..., leaf_sizes=...) "
         "names the strategy comm='auto' takes")

#: old path -> (new path, why). A path ``module.*`` stands for every name of
#: a module made private; a new path with a leading underscore somewhere is
#: private (no public name replaces the old one).
MOVED: dict[str, tuple[str, str]] = {
    **{f"dlion_jax.{m}.*": (f"dlion_jax._{m}", _CODEC) for m in (
        "packing", "strategies", "message", "exchange", "quantize",
        "fused")},
    "dlion_jax.shards.*": ("dlion_jax._blocks", _CODEC),
    "dlion_jax.exchange.resolve_comm": ("dlion_jax._exchange.resolve_comm",
                                        _COMM),
    "dlion_jax.message.choose_comm": ("dlion_jax._message.choose_comm", _COMM),
    # Names of the codec's modules that went to another private module.
    **{f"dlion_jax.{m}.{n}": (f"dlion_jax.{new}", _CODEC) for m, n, new in (
        *(("exchange", n, f"_strategies.{n}") for n in (
            "exchange_allgather", "exchange_alltoall", "exchange_psum",
            "exchange_psum_int8")),
        ("exchange", "axis_size", "_exchange.workers_along"),
        ("exchange", "buckets", "_message.buckets"),
        *(("message", n, f"_strategies.{n}") for n in (
            "psum_radix", "mavo_has_ties", "alltoall_down_radix",
            "int_container", "signed_sum")),
        ("message", "BINARY", "_quantize.BINARY"),
        ("message", "VoteSpec", "_quantize.VoteSpec"),
        *(("shards", n, f"_core.{n}") for n in ("axis_dim",
                                                "node_mean_grads")),
        *(("shards", n, f"_mesh.{n}") for n in ("on_tpu", "spec_axes",
                                                "typed_like")))},
    **{f"dlion_jax.workers.{n}": ("dlion_jax._collectives." + n,
                                  "the collectives both doors use") for n in (
        "exchanged", "BLOCKS", "blockwise", "sum_over_blocks", "psum",
        "pmean", "alike", "alike_state", "mapped_over_mesh",
        "mapped_mesh_axes")},
    "dlion_jax.workers.place": ("dlion_jax._mesh.place", "spec arithmetic"),
    "dlion_jax.workers.worker_rows": ("dlion_jax._core.worker_rows",
                                      "the worker core"),
    **{f"dlion_jax.devices.{n}": ("dlion_jax._mesh." + n, "spec arithmetic")
       for n in ("axis_size", "spec_on")},
    "dlion_jax.devices.stacked_sharding": ("dlion_jax._mesh.stacked_sharding",
                                           "spec arithmetic"),
    "dlion_jax.devices.stack": ("dlion_jax.devices._stack", "internal"),
    "dlion_jax.rounds.refuse": ("dlion_jax._core.refuse_local_steps",
                                "the worker core's checks"),
    "dlion_jax.rounds.anchor_flags": ("dlion_jax._core.anchor_flags",
                                      "the worker core's checks"),
    **{f"dlion_jax.hlo.{n}": ("dlion_jax.hlo._" + n, "internal")
       for n in ("MEGASCALE_SLICE", "Groups", "AxisKey", "Pick")},
    **{f"dlion_jax.launch.{n}": ("dlion_jax.launch._" + n, "internal")
       for n in ("HOST", "GRACE_S", "POLL_S", "free_port", "PROG",
                 "DESCRIPTION", "EPILOG", "parse_args")},
    # Public in 0.2.0 at these paths (deprecated since).
    **{f"dlion_jax.parallel.{n}": (f"dlion_jax.devices.{n}", "placement")
       for n in ("data_mesh", "global_array", "hybrid_mesh", "replicate",
                 "replicate_for_pmap", "shard_batch", "shard_params",
                 "stack_for_workers", "use_cpu_devices")},
    "dlion_jax.bench.use_cpu_devices": ("dlion_jax.devices.use_cpu_devices",
                                        "placement"),
    **{f"dlion_jax.parallel.{n}": (f"dlion_jax.transforms.{n}",
                                   "the optimizer wrappers")
       for n in ("apply_if_finite", "pmean_gradients")},
    **{f"dlion_jax.{m}.{n}": (f"dlion_jax.processes.{n}", "process start-up")
       for m, n in (("parallel", "start_processes"),
                    ("devices", "start_processes"),
                    ("devices", "check_processes"),
                    ("devices", "coordinator_problem"))},
    **{f"dlion_jax.accounting.{n}": (f"dlion_jax.hlo.{n}",
                                     "the HLO reader")
       for n in ("Collective", "collective_bytes", "collectives")},
    **{f"dlion_jax.accounting.{n}": (f"dlion_jax._{m}.{n}", _CODEC)
       for m, names in (
           ("message", ("AGGREGATIONS", "COMMS", "message_bytes",
                        "message_radix", "message_word_multiple",
                        "vote_bits")),
           ("quantize", ("PBIT_RANGE", "QUANTIZERS", "VOTES", "VoteSpec",
                         "vote_spec")),
           ("strategies", ("alltoall_down_radix", "int_container",
                           "mavo_has_ties", "psum_radix")))
       for n in names},
}


def _private(path: str) -> bool:
  return any(part.startswith("_") for part in path.split("."))


def _resolve(path: str) -> Any:
  module, _, name = path.rpartition(".")
  return getattr(importlib.import_module(module), name)


def _warn(old: str, new: str, why: str) -> None:
  if _private(new):
    advice = f"it is private from {DEPRECATED_IN}, as {new} ({why})"
  else:
    module, _, name = new.rpartition(".")
    advice = (f"use {new} (from {module.rpartition('.')[0]} import "
              f"{module.rpartition('.')[2]}; {why})")
  warnings.warn(f"{old} is deprecated: {advice}. The old path goes in "
                f"{REMOVED_IN}.", DeprecationWarning, stacklevel=3)


def old_paths(module: str) -> Callable[[str], Any]:
  """The ``__getattr__`` of ``module``: each old path of :data:`MOVED`
  under it warns and gives the object at its new place."""
  def getattr_(name: str) -> Any:
    old = f"{module}.{name}"
    if old in MOVED:
      new, why = MOVED[old]
      _warn(old, new, why)
      return _resolve(new)
    if f"{module}.*" in MOVED:
      target, why = MOVED[f"{module}.*"]
      value = getattr(importlib.import_module(target), name, _MISSING)
      if value is not _MISSING and not name.startswith("__"):
        _warn(old, f"{target}.{name}", why)
        return value
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
  return getattr_


_MISSING = object()
