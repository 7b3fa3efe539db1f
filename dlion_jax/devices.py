"""Devices, meshes and data placement for data-parallel training.

Which devices take part and where each array lives: simulated CPU devices
for tests and laptops, the 1-D data-parallel mesh and the hybrid (nodes x
devices) one, and the placement of params (replicated, or sharded
FSDP-style over a fast axis), per-worker state built elsewhere (stacked),
batches (split over the workers) and host values on several processes. The
step builders of :mod:`dlion_jax.parallel` take what these return;
``dl.parallel`` re-exports the public names. Starting several processes
(``jax.distributed``) lives in :mod:`dlion_jax.processes`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _mesh
from dlion_jax._mesh import fsdp_spec  # noqa: F401  (public here)
from dlion_jax import _checks
from dlion_jax import _deprecations

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)

def use_cpu_devices(num_devices: int) -> None:
  """Asks for ``num_devices`` simulated CPU devices on this process.

  Must run before the first call that initializes a backend (e.g.
  ``jax.devices()``); it overrides ``--xla_force_host_platform_device_count``.
  Harmless on a machine with accelerators, whose devices are used instead.

  Raises:
    RuntimeError: the backend is already up with fewer devices.
  """
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError:
    pass  # Backend already initialized: check what it has below.
  if jax.default_backend() != "cpu":
    return   # accelerators: data_mesh says if there are too few
  if jax.local_device_count() < num_devices:
    raise RuntimeError(
        f"Need {num_devices} devices, jax sees {jax.local_device_count()}. "
        "Run in a fresh process, or set XLA_FLAGS="
        f"--xla_force_host_platform_device_count={num_devices} before "
        "importing jax.")


def data_mesh(num_workers: int | None = None, *, axis_name: str = "data",
              devices=None) -> Mesh:
  """A 1-D mesh of the first ``num_workers`` devices (all by default)."""
  devices = list(jax.devices() if devices is None else devices)
  num_workers = len(devices) if num_workers is None else _checks.positive_int(
      "num_workers", num_workers, "devices on the mesh")
  if num_workers > len(devices):
    raise ValueError(
        f"num_workers={num_workers} but {len(devices)} devices are visible. "
        "On CPU, simulate more with XLA_FLAGS="
        "--xla_force_host_platform_device_count=N set before importing jax.")
  return Mesh(np.array(devices[:num_workers]), (axis_name,))


def hybrid_mesh(nodes: int | None = None, *, axis_name: str = "data",
                shard_axis: str = "fsdp", devices=None) -> Mesh:
  """A 2-D mesh: ``nodes`` rows over the slow links, a node's devices in a row.

  With several processes (one per node) ``nodes`` defaults to
  ``jax.process_count()`` and row ``i`` holds process ``i``'s local devices,
  so ``axis_name`` crosses the processes and ``shard_axis`` stays inside
  each. For :func:`dlion_jax.parallel.make_train_step` with
  ``shard_axis``. On TPU multislice or multi-node GPU,
  ``jax.experimental.mesh_utils.create_hybrid_device_mesh((1, k), (n, 1))``
  orders the devices by the physical topology as well; pass its array to
  ``jax.sharding.Mesh(..., (axis_name, shard_axis))``.

  Args:
    nodes: rows of the mesh; must divide the number of devices.
    axis_name: the slow axis (the one the optimizer votes over).
    shard_axis: the fast axis (exact reduction, sharded state).
    devices: the devices (default: ``jax.devices()``).

  Example:
    >>> from dlion_jax import devices
    >>> devices.hybrid_mesh(1).axis_names     # 1 node: all devices in a row
    ('data', 'fsdp')
  """
  devices = sorted(jax.devices() if devices is None else devices,
                   key=lambda d: (d.process_index, d.id))
  nodes = jax.process_count() if nodes is None else _checks.positive_int(
      "nodes", nodes, "rows of the mesh")
  if len(devices) % nodes:
    raise ValueError(
        f"nodes={nodes!r} must be a positive int dividing the {len(devices)} "
        f"devices: each node gets the same number. Pass a divisor of "
        f"{len(devices)}, or the devices to use.")
  if shard_axis == axis_name:
    raise ValueError(
        f"shard_axis={shard_axis!r} is also axis_name={axis_name!r}: the "
        "mesh needs two axes, the slow one the optimizer votes over and the "
        "fast one the shards are cut over. Give them different names (by "
        "default axis_name='data', shard_axis='fsdp').")
  return Mesh(np.array(devices).reshape(nodes, -1), (axis_name, shard_axis))


def replicate(tree: Any, mesh: Mesh) -> Any:
  """A copy of ``tree`` on every device of ``mesh`` (``P()``).

  Always a copy, never the caller's own buffers: the steps of this module
  donate their params, which would otherwise delete the caller's arrays
  (say, initial params meant for a second run, or a flax model's).
  """
  leaves, treedef = jax.tree.flatten(tree)
  ours = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, own in zip(leaves, ours) if own]
  # device_put keeps an array's buffer as the shard on the array's own
  # device, may_alias=False or not: copy each array where it lies first (a
  # device-side copy, no compilation), then place the copies.
  copies = iter(jax.device_put(arrays, [x.sharding for x in arrays],
                               may_alias=False))
  leaves = [next(copies) if own else x for x, own in zip(leaves, ours)]
  placed = jax.device_put(leaves, NamedSharding(mesh, P()),
                          may_alias=[None if own else False for own in ours])
  return jax.tree.unflatten(treedef, placed)


def shard_params(tree: Any, mesh: Mesh, axis_name: str | tuple[str, ...]
                 = "fsdp") -> Any:
  """A copy of ``tree`` sharded FSDP-style over ``axis_name``
  (:func:`~dlion_jax.devices.fsdp_spec` for each leaf), replicated over the
  mesh's other axes; from host values alike on every process, as
  :func:`global_array`.

  Params placed so are sharded at rest (ZeRO-3): the compiler gathers them
  for the forward pass. To keep params whole and shard only the optimizer
  state (ZeRO-2), build the state from these and step with
  :func:`replicate`'s params:
  ``init_worker_states(tx, shard_params(params, mesh), mesh)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import devices
    >>> mesh = devices.hybrid_mesh(1)       # 1 x (every device)
    >>> w = devices.shard_params({"w": jnp.zeros((3, 8))}, mesh)["w"]
    >>> w.sharding.spec
    P(None, 'fsdp')
  """
  k = _mesh.axis_size(mesh, axis_name)
  return jax.tree.map(lambda x: global_array(x, NamedSharding(
      mesh, _mesh.fsdp_spec(np.shape(x), k, axis_name))), tree)


def stack_for_workers(tree: Any, mesh: Mesh, *,
                      axis_name: str = "data") -> Any:
  """A copy of ``tree`` for each worker of ``axis_name``, stacked on a
  leading axis split over it, each leaf otherwise sharded as it was.

  The per-worker state of an optimizer built outside the library, e.g. a
  :class:`flax.nnx.Optimizer`'s ``nnx.state(optimizer)`` or a flax
  :class:`~flax.training.train_state.TrainState`'s ``opt_state``: laid out
  ``"stacked"`` for :func:`dlion_jax.parallel.per_worker`
  (:func:`dlion_jax.parallel.init_worker_states` does this for
  ``tx.init(params)``).

  Example:
    >>> import jax.numpy as jnp
    >>> from dlion_jax import devices
    >>> mesh = devices.data_mesh(1)
    >>> devices.stack_for_workers({"mu": jnp.zeros(3)}, mesh)["mu"].shape
    (1, 3)
  """
  n = _mesh.axis_size(mesh, axis_name)
  stack = lambda t: jax.tree.map(
      lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), t)
  return jax.jit(stack, out_shardings=jax.tree.map(
      lambda x: _mesh.stacked_sharding(x, mesh, axis_name), tree))(tree)


def shard_batch(batch: Any, mesh: Mesh, *,
                axis_name: str | tuple[str, ...] = "data") -> Any:
  """Splits the leading axis of every leaf of ``batch`` over ``axis_name``
  (one mesh axis, or a tuple of them, the first major: e.g.
  ``("data", "fsdp")`` for a step with ``shard_axis``).

  With several processes (``jax.distributed``) every process passes the
  whole global batch, alike, and each keeps the rows of its own devices;
  where each process loads only its own rows, build the array with
  ``jax.make_array_from_process_local_data`` instead.

  Example:
    >>> import numpy as np
    >>> from dlion_jax import devices
    >>> mesh = devices.data_mesh(1)
    >>> batch = devices.shard_batch({"x": np.zeros((4, 3))}, mesh)
    >>> batch["x"].sharding.spec
    P('data',)
  """
  n = _mesh.axis_size(mesh, axis_name)
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if not np.ndim(leaf) or np.shape(leaf)[0] % n:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(leaf)}; its leading (global batch) axis must be "
          f"divisible by the {n} workers of axis {axis_name!r}.")
  return jax.device_put(batch, NamedSharding(mesh, P(axis_name)))


def _stack(tree: Any, n: int) -> Any:
  """``tree`` with a leading axis of ``n`` copies on every leaf."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)),
                      tree)


def global_array(value: Any, sharding: NamedSharding) -> Any:
  """Places host values (the same on every process) with ``sharding``.

  Works with one process and with many (``jax.distributed``): each process
  supplies only the shards its own devices hold.
  """
  def place(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
  return jax.tree.map(place, value)


def replicate_for_pmap(tree: Any, num_devices: int | None = None) -> Any:
  """Stacks ``tree`` ``num_devices`` times (default: all local devices)."""
  n = jax.local_device_count() if num_devices is None else num_devices
  return _stack(tree, n)
