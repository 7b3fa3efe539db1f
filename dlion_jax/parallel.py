"""Data-parallel helpers: per-worker optimizer state and train steps.

Shapes (``N`` workers on the mesh axis ``axis_name``):

* ``params``: the model's pytree, replicated on every worker (``P()``).
* ``state``: every leaf of ``tx.init(params)`` with a leading axis of size
  ``N``, sharded over ``axis_name`` (``P(axis_name)``): row ``i`` is worker
  ``i``'s own state, so each worker keeps its own momentum.
* ``batch``: any pytree whose leaves have a leading *global* batch axis,
  divisible by ``N`` and sharded over ``axis_name``; worker ``i`` sees rows
  ``[i * B/N, (i+1) * B/N)``.
* the step returns ``(params, state, loss)`` with ``loss`` the mean over
  workers of their local losses.

Each worker differentiates its local loss only: no gradient all-reduce is
issued, the optimizer's vote exchange is the step's only communication (plus
one scalar ``pmean`` of the loss).

On hosts that simulate many devices on few cores (``XLA_FLAGS=
--xla_force_host_platform_device_count=8``) block on each step's output
(``float(loss)``) before dispatching the next: queuing many steps with
collectives can starve XLA's rendezvous.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LossFn = Callable[[Any, Any], jax.Array]


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
  num_workers = len(devices) if num_workers is None else num_workers
  if not 1 <= num_workers <= len(devices):
    raise ValueError(
        f"num_workers={num_workers} but {len(devices)} devices are visible. "
        "On CPU, simulate more with XLA_FLAGS="
        "--xla_force_host_platform_device_count=N set before importing jax.")
  return Mesh(np.array(devices[:num_workers]), (axis_name,))


def _axis_size(mesh: Mesh, axis_name: str) -> int:
  if axis_name not in mesh.shape:
    raise ValueError(
        f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
        f"{tuple(mesh.axis_names)}.")
  return mesh.shape[axis_name]


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places ``tree`` on every device of ``mesh`` (``P()``)."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def shard_batch(batch: Any, mesh: Mesh, *, axis_name: str = "data") -> Any:
  """Splits the leading axis of every leaf of ``batch`` over ``axis_name``."""
  n = _axis_size(mesh, axis_name)
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if not np.ndim(leaf) or np.shape(leaf)[0] % n:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(leaf)}; its leading (global batch) axis must be "
          f"divisible by the {n} workers of axis {axis_name!r}.")
  return jax.device_put(batch, NamedSharding(mesh, P(axis_name)))


def _stack(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)),
                      tree)


def init_worker_states(tx: optax.GradientTransformation, params: Any,
                       mesh: Mesh, *, axis_name: str = "data") -> Any:
  """``tx.init(params)`` for every worker, stacked and sharded over the axis.

  Returns:
    The state pytree with a leading axis of size ``N`` on every leaf, placed
    so that worker ``i`` holds row ``i``.
  """
  n = _axis_size(mesh, axis_name)
  sharding = NamedSharding(mesh, P(axis_name))
  return jax.jit(lambda p: _stack(tx.init(p), n), out_shardings=sharding)(
      params)


def pmean_gradients(axis_name: str = "data") -> optax.GradientTransformation:
  """Averages the gradients over ``axis_name``: what global optimizers need.

  ``optax.chain(pmean_gradients("data"), optax.lion(...))`` is the usual
  data-parallel Lion that all-reduces fp32 gradients, the baseline that
  :func:`dlion_jax.distributed_lion` replaces.
  """

  def update_fn(updates, state, params=None):
    del params
    return lax.pmean(updates, axis_name), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def apply_if_finite(inner: optax.GradientTransformation,
                    max_consecutive_errors: int, *,
                    axis_name: str = "data") -> optax.GradientTransformation:
  """:func:`optax.apply_if_finite` that skips a step on every worker at once.

  ``optax.apply_if_finite`` checks only the gradients it is given: inside a
  data-parallel step a NaN or Inf on one worker makes that worker alone skip.
  Around :func:`dlion_jax.distributed_lion` that is a hang or a split: under
  ``shard_map`` the skipping worker leaves the vote's collectives inside a
  ``lax.cond`` the others entered (XLA's CPU rendezvous aborts the process
  after 40 s); under ``vmap`` both branches run and the skipping worker keeps
  its old parameters while the others move. Here the finiteness flag is
  all-reduced over ``axis_name`` (one int32 ``psum``) first, so every worker
  takes the same branch: a step with a non-finite gradient on *any* worker is
  skipped on *every* worker (parameters and every worker's state unchanged,
  ``notfinite_count`` the same everywhere), and after
  ``max_consecutive_errors`` such steps every worker gives up and applies
  the update together.

  Args:
    inner: the optimizer to guard, e.g. ``dl.distributed_lion(...)``.
    max_consecutive_errors: as in :func:`optax.apply_if_finite`.
    axis_name: the data-parallel axis the workers share.

  Returns:
    A transform whose state is :class:`optax.ApplyIfFiniteState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32),
        last_finite=jnp.array(True, jnp.bool_),
        total_notfinite=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    local_ok = jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
    bad_workers = lax.psum((~local_ok).astype(jnp.int32), axis_name)
    isfinite = bad_workers == 0
    notfinite_count = jnp.where(isfinite, jnp.zeros([], jnp.int32),
                                optax.safe_increment(state.notfinite_count))
    updates, inner_state = lax.cond(
        isfinite | (notfinite_count > max_consecutive_errors),
        lambda: inner.update(updates, state.inner_state, params,
                             **extra_args),
        lambda: (optax.tree.zeros_like(updates), state.inner_state))
    return updates, optax.ApplyIfFiniteState(
        notfinite_count=notfinite_count, last_finite=isfinite,
        total_notfinite=jnp.where(isfinite, state.total_notfinite,
                                  optax.safe_increment(state.total_notfinite)),
        inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def global_array(value: Any, sharding: NamedSharding) -> Any:
  """Places host values (the same on every process) with ``sharding``.

  Works with one process and with many (``jax.distributed``): each process
  supplies only the shards its own devices hold.
  """
  def place(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
  return jax.tree.map(place, value)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation,
                    mesh: Mesh, *, axis_name: str = "data",
                    check_vma: bool = False, donate: bool = True,
                    has_aux: bool = False, micro_batches: int = 1):
  """Builds a jitted ``shard_map`` data-parallel step.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> scalar`` on one worker's batch.
    tx: the optimizer, e.g. ``dl.distributed_lion(lr, axis_name=axis_name)``.
    mesh: the device mesh; ``axis_name`` must be one of its axes.
    axis_name: the data-parallel axis.
    check_vma: passed to :func:`jax.shard_map`. With ``True`` JAX checks
      statically that the new params are replicated; the parameters are then
      marked per-worker before differentiation so that JAX does not insert
      its implicit gradient all-reduce. The check fails whenever per-worker
      optimizer state enters after the vote (e.g. a learning-rate schedule
      reads its step count from the per-worker state), although the values
      are identical on every worker; hence off by default.
    donate: donate ``params`` and ``state`` buffers to the step.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (a pytree of
      scalars, e.g. accuracy) is averaged over workers and returned with the
      loss as ``(loss, aux)``.
    micro_batches: split each worker's batch into this many micro-batches,
      average their gradients (a ``lax.scan``) and update once: one exchange
      per step, unlike :class:`optax.MultiSteps`, which exchanges on every
      micro-step.

  Returns:
    ``step(params, state, batch) -> (params, state, loss)`` with the shapes of
    the module docstring.

  Example:
    >>> import jax, jax.numpy as jnp, dlion_jax as dl
    >>> from dlion_jax import parallel
    >>> mesh = parallel.data_mesh(1)
    >>> loss_fn = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
    >>> tx = dl.distributed_lion(1e-2, axis_name="data")
    >>> params = parallel.replicate({"w": jnp.ones(3)}, mesh)
    >>> state = parallel.init_worker_states(tx, params, mesh)
    >>> step = parallel.make_train_step(loss_fn, tx, mesh)
    >>> batch = parallel.shard_batch(jnp.ones((4, 3)), mesh)
    >>> params, state, loss = step(params, state, batch)
    >>> float(loss)
    9.0
  """
  n = _axis_size(mesh, axis_name)
  if not isinstance(micro_batches, int) or micro_batches < 1:
    raise ValueError(f"micro_batches must be a positive int, got "
                     f"micro_batches={micro_batches!r}.")
  # A size-1 axis has no vote (the update is plain Lion, typed per-worker),
  # so there is nothing to check replication against.
  check_vma = check_vma and n > 1

  def local_step(params, state, batch):
    state = jax.tree.map(lambda x: x[0], state)
    local_params = (lax.pcast(params, axis_name, to="varying")
                    if check_vma else params)
    loss, grads = _loss_and_grads(loss_fn, local_params, batch, has_aux,
                                  micro_batches)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    state = jax.tree.map(lambda x: x[None], state)
    return params, state, lax.pmean(loss, axis_name)

  step = jax.shard_map(
      local_step, mesh=mesh,
      in_specs=(P(), P(axis_name), P(axis_name)),
      out_specs=(P(), P(axis_name), P()),
      check_vma=check_vma)

  def checked_step(params, state, batch):
    _check_worker_states(state, n)
    return step(params, state, batch)

  return jax.jit(checked_step, donate_argnums=(0, 1) if donate else ())


def _check_worker_states(state: Any, n: int) -> None:
  """Raises a ValueError unless every state leaf has a leading axis of n."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    shape = np.shape(leaf)
    if not shape or shape[0] != n:
      raise ValueError(
          f"optimizer state leaf {jax.tree_util.keystr(path) or '<root>'} "
          f"has shape {shape}; the step wants every worker's state stacked "
          f"on a leading axis of size {n}. Build it with "
          "parallel.init_worker_states(tx, params, mesh), not tx.init(params).")


def _loss_and_grads(loss_fn, params, batch, has_aux, micro_batches):
  """``value_and_grad``, averaged over ``micro_batches`` slices of batch."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
  if micro_batches == 1:
    return grad_fn(params, batch)
  def split(x):
    if x.shape[0] % micro_batches:
      raise ValueError(
          f"micro_batches={micro_batches} must divide each worker's batch, "
          f"which has {x.shape[0]} rows.")
    return x.reshape((micro_batches, -1) + x.shape[1:])
  def body(total, micro):
    return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None
  micro = jax.tree.map(split, batch)
  first = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
  total, _ = lax.scan(body, first, jax.tree.map(lambda x: x[1:], micro))
  return jax.tree.map(lambda x: x / micro_batches, total)


def replicate_for_pmap(tree: Any, num_devices: int | None = None) -> Any:
  """Stacks ``tree`` ``num_devices`` times (default: all local devices)."""
  n = jax.local_device_count() if num_devices is None else num_devices
  return _stack(tree, n)


def init_pmap_states(tx: optax.GradientTransformation, params: Any,
                     num_devices: int | None = None) -> Any:
  """Per-device optimizer states for :func:`make_pmap_train_step`."""
  return replicate_for_pmap(tx.init(params), num_devices)


def make_pmap_train_step(loss_fn: LossFn, tx: optax.GradientTransformation,
                         *, axis_name: str = "data", donate: bool = True,
                         devices=None, has_aux: bool = False,
                         micro_batches: int = 1):
  """The same data-parallel step for ``jax.pmap`` users.

  Every argument carries a leading device axis of size ``N``: ``params`` from
  :func:`replicate_for_pmap`, ``state`` from :func:`init_pmap_states`,
  ``batch`` leaves of shape ``[N, local_batch, ...]``.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> scalar`` (or ``(scalar, aux)``
      with ``has_aux``) on one device's batch.
    tx: the optimizer, bound to ``axis_name``.
    axis_name: the name ``pmap`` gives the device axis.
    donate: donate ``params`` and ``state`` buffers to the step.
    devices: the devices to map over (default: all local devices).
    has_aux: as in :func:`make_train_step`.
    micro_batches: as in :func:`make_train_step`.

  Returns:
    ``step(params, state, batch) -> (params, state, loss)``, ``loss`` of shape
    ``[N]`` (equal entries).
  """

  def local_step(params, state, batch):
    loss, grads = _loss_and_grads(loss_fn, params, batch, has_aux,
                                  micro_batches)
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state,
            lax.pmean(loss, axis_name))

  return jax.pmap(local_step, axis_name=axis_name, devices=devices,
                  donate_argnums=(0, 1) if donate else ())
