"""Data-parallel train steps: per-worker optimizer state, one exchange a step.

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

On a mesh with axes beside ``axis_name`` (``("data", "fsdp", "model")``)
the steps are manual over ``axis_name`` only, and ``P()`` and
``P(axis_name)`` above speak of it alone: over the other axes params are
sharded as placed (:func:`~dlion_jax.devices.shard_params` for FSDP),
each momentum like its param, and the compiler owns them
(:mod:`dlion_jax.shards`).

Each worker differentiates its local loss only: no gradient all-reduce is
issued, the optimizer's vote exchange is the step's only communication (plus
one scalar ``pmean`` of the loss).

On the CPU backend the steps these helpers build keep at most
:data:`MAX_IN_FLIGHT` steps queued (:func:`limit_in_flight`): queuing more
deadlocks XLA:CPU's collectives, so a loop need not block on each step.

The steps take what :mod:`dlion_jax.devices` places (meshes, replicated
params, sharded batches), and an optimizer that may be wrapped by
:mod:`dlion_jax.transforms` (:func:`~dlion_jax.transforms.pmean_gradients`,
:func:`~dlion_jax.transforms.apply_if_finite`). The steps' internals
live in private modules beside this one: the three steps
:func:`make_train_step` picks from and the worker update they run
(``_steps``), where each leaf, momentum and batch lives
(``_placement``), one worker's loss and gradients (``_core``),
:func:`per_worker`'s layouts (``_per_worker``), and the checks that what
a step returns replicated is equal on every worker (``_replication``).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from dlion_jax import _core
from dlion_jax import _deprecations
from dlion_jax import _extra_args
from dlion_jax import _mesh
from dlion_jax import _placement
from dlion_jax import _replication
from dlion_jax import _steps
from dlion_jax import devices
# Public here: the per-worker state and per_worker's map.
from dlion_jax._core import init_worker_states  # noqa: F401
from dlion_jax._core import state_shardings  # noqa: F401
from dlion_jax._per_worker import per_worker  # noqa: F401
from dlion_jax import _checks

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)

LossFn = Callable[[Any, Any], jax.Array]

# Steps the CPU backend may have queued (see limit_in_flight); XLA:CPU
# itself admits 32 executions per device.
MAX_IN_FLIGHT = 8


@jax.jit
def _first_entry(x: jax.Array) -> jax.Array:
  return x.reshape(-1)[:1]


def _marker(out: Any) -> jax.Array | None:
  """A one-entry copy of an output of a call, ready once the call's part on
  its first device is: what to wait on for the call (the outputs themselves
  may be donated to the next call, and are deleted by then)."""
  leaves = jax.tree.leaves(out)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return None                  # traced inside jit, scan, eval_shape, ...
  arrays = [x for x in leaves
            if isinstance(x, jax.Array) and x.size and not x.is_deleted()]
  if not arrays:
    return None
  shard = min(arrays, key=lambda x: x.size).addressable_shards[0].data
  # A mesh of the shard's own device: under the caller's jax.set_mesh of
  # the whole mesh, a call on one device is refused ("incompatible
  # devices"). On a mesh of one device the shard is the array itself,
  # typed on that mesh's Explicit axes, which the mesh of the marker does
  # not match: placed on its device alone (the same buffer, no copy).
  device = shard.device
  with jax.set_mesh(_device_mesh(device)):
    return _first_entry(jax.device_put(
        shard, jax.sharding.SingleDeviceSharding(device)))


@functools.cache
def _device_mesh(device) -> Mesh:
  """A mesh of one device (made once a device: :func:`_marker` runs every
  step)."""
  return Mesh(np.array([device]), ("marker",))


class _InFlightLimit:
  """``fn`` that waits for its oldest queued call once ``limit`` are queued."""

  def __init__(self, fn: Callable, limit: int):
    functools.update_wrapper(self, fn)
    self._fn, self._limit = fn, limit
    self._queued = collections.deque()

  def __call__(self, *args, **kwargs):
    out = self._fn(*args, **kwargs)
    # The call ran and consumed its donated inputs: from here on nothing
    # may keep its results from the caller.
    try:
      marker = _marker(out)
    except Exception:  # pylint: disable=broad-except
      jax.block_until_ready(out)       # waited for here instead
      marker = None
    self._queued.append(marker)
    while len(self._queued) > self._limit:
      jax.block_until_ready(self._queued.popleft())
    return out

  def __getattr__(self, name):         # lower, trace, eval_shape, ...
    return getattr(self._fn, name)


def limit_in_flight(fn: Callable, max_in_flight: int = MAX_IN_FLIGHT, *,
                    devices=None) -> Callable:
  """Keeps at most ``max_in_flight`` calls of ``fn`` queued on the CPU backend.

  JAX dispatches asynchronously: a loop that does not read each step's
  result queues steps faster than they run. On XLA:CPU that deadlocks a
  step with collectives once enough are queued (more than about 50 steps
  here; the process aborts after 40 s with "Expected 8 threads to join the
  rendezvous, but only 7 of them arrived"). The CPU client runs every
  device's part of a step on one thread pool of ``max(cores, devices)``
  threads and admits at most 32 executions per device: the launch of the
  33rd waits for a free slot *on a pool thread*. A few such waiting
  launches leave fewer free threads than the devices whose parts of an
  earlier step must meet in the collective's rendezvous, and none can go
  on. Waiting here, on the calling thread, for the oldest queued call keeps
  the pool free; the steps still overlap with the Python loop.

  Accelerator backends queue steps on streams, not on such a pool, and get
  ``fn`` back unchanged. :func:`make_train_step` and
  :func:`make_pmap_train_step` apply this already; use it for a step you
  write yourself.

  Args:
    fn: a jitted step (``lower`` and the other attributes still work).
    max_in_flight: calls queued before the next call waits for the oldest.
    devices: the devices ``fn`` runs on (default: ``jax.devices()``).

  Returns:
    ``fn``, or on CPU a callable that waits for the oldest of its queued
    results before returning once more than ``max_in_flight`` are queued.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from dlion_jax import parallel
    >>> step = parallel.limit_in_flight(jax.jit(lambda x: x + 1), 2)
    >>> x = jnp.zeros(3)
    >>> for _ in range(100):   # no float(...) needed on each step
    ...   x = step(x)
    >>> x
    Array([100., 100., 100.], dtype=float32)
  """
  max_in_flight = _checks.positive_int("max_in_flight", max_in_flight)
  devices = list(jax.devices() if devices is None else devices)
  if devices[0].platform != "cpu":
    return fn
  return _InFlightLimit(fn, max_in_flight)


def typed_alike(state: Any) -> Any:
  """One worker's optimizer state with what every worker holds alike typed
  so, for a step you write with ``jax.shard_map(check_vma=True)``.

  There JAX types each worker's row of the state as differing by worker,
  so that anything read from it after the vote makes the new params
  per worker too, and ``out_specs=P()`` is refused ("could not infer
  replication"), although every worker's step counts are equal: an optax
  schedule's (``optax.scale_by_learning_rate(schedule)``),
  :class:`optax.MultiSteps`' and :func:`optax.inject_hyperparams`' counts,
  and its hyperparameters. This types the state's integer scalars and
  injected hyperparameters as equal on every worker (their maximum over
  the workers: one small all-reduce each), and the state of
  :func:`optax.contrib.reduce_on_plateau` whole (its scale and values
  too: give it one ``value`` for all, e.g. the loss's ``pmean``).
  :func:`make_train_step` does it itself, and ``dl.distributed_lion``'s
  own schedules need none of it. Without ``check_vma`` it returns
  ``state`` unchanged.

  Example:
    >>> import jax, jax.numpy as jnp, optax, dlion_jax as dl
    >>> from dlion_jax import devices
    >>> from dlion_jax import parallel
    >>> mesh = devices.data_mesh(2)
    >>> schedule = optax.linear_schedule(1e-2, 1e-3, 100)
    >>> tx = optax.chain(dl.scale_by_distributed_lion(axis_name="data"),
    ...                  optax.scale_by_learning_rate(schedule))
    >>> params = devices.replicate({"w": jnp.ones(4)}, mesh)
    >>> state = parallel.init_worker_states(tx, params, mesh)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data")),
    ...                out_specs=(jax.P(), jax.P("data")))
    ... def step(params, state):
    ...   state = parallel.typed_alike(jax.tree.map(lambda s: s[0], state))
    ...   grads = jax.lax.pcast(params, "data", to="varying")  # any local grads
    ...   updates, state = tx.update(grads, state, params)
    ...   return (optax.apply_updates(params, updates),
    ...           jax.tree.map(lambda s: s[None], state))
    >>> params, state = step(params, state)
    >>> params["w"]
    Array([0.99, 0.99, 0.99, 0.99], dtype=float32)
  """
  return _extra_args.alike_state(state)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation,
                    mesh: Mesh, *, axis_name: str = "data",
                    shard_axis: str | None = None,
                    check_vma: bool = False, donate: bool = True,
                    has_aux: bool = False, micro_batches: int = 1,
                    params_per_worker: bool = False,
                    per_worker_args: tuple[str, ...] = (),
                    loss_as: str | None = None):
  """Builds a jitted ``shard_map`` data-parallel step.

  The step is manual over ``axis_name`` only: on a mesh with other axes
  (``("data", "fsdp")``, ``("data", "fsdp", "model")``) those stay the
  compiler's, and params, gradients and state are sharded over them as
  the user places them: params sharded at rest (FSDP / ZeRO-3, gathered by
  the compiler for the forward pass), tensor parallel, or replicated.
  ``loss_fn`` then sees its node's whole batch and whole logical leaves,
  so ``optax.clip_by_global_norm``, masks by rank and
  ``optax.multi_transform`` labels mean what they mean, and each device
  votes on its own part of every leaf with its peers across
  ``axis_name`` (``dlion_jax._blocks.on_own_shards``): Distributed Lion
  over the nodes, each fed its node's mean gradient. Place the batch over
  all the axes (``NamedSharding(mesh, P(("data", "fsdp")))``) so each
  device differentiates its own rows.

  With ``shard_axis`` (a hybrid mesh: ``axis_name`` across the slow links
  between nodes, ``shard_axis`` over the fast links inside one, whose
  devices only split a node's batch), the gradients are not left to the
  compiler: each device differentiates its own rows with whole params
  (gathered over ``shard_axis`` first where they are sharded at rest), and
  one reduce-scatter per leaf leaves it the node's mean gradient on its
  block of the leaf (``dlion_jax._core.node_mean_grads``). The fast
  links then carry that reduce-scatter and one all-gather (of the params,
  or of the updates where params are replicated), however the compiler
  would have partitioned an unannotated model. ``loss_fn`` then sees one
  device's rows: the node's gradient is the mean of its devices' (the
  gradient of the node's loss where ``loss_fn`` is a mean over equal
  rows), and the loss and ``aux`` are the means over all devices. The
  optimizer runs as above, on whole logical leaves, each device voting on
  its block. Params may be replicated (ZeRO-2 with
  :func:`init_worker_states`' ``shard_axis``) or placed by
  :func:`~dlion_jax.devices.shard_params` (ZeRO-3); the batch is split over
  both axes (:func:`~dlion_jax.devices.shard_batch` with
  ``axis_name=("data", "fsdp")``).

  Either way it equals Distributed Lion over the nodes, each fed its
  node's mean gradient, bit for bit with sign votes. The L1-scaled
  quantizers (``ternary_l1``, ``pbit_l1``, and error feedback) take a
  leaf's scale as the sum of its blocks' sums, which may round differently
  from one sum over the whole leaf: bit for bit when the sums are exact,
  otherwise within the rounding of the scale (its last bit; a level may
  then differ by one where ``L c / a`` lies on a rounding boundary).

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> scalar`` on one worker's batch.
    tx: the optimizer, e.g. ``dl.distributed_lion(lr, axis_name=axis_name)``.
    mesh: the device mesh; ``axis_name`` must be one of its axes.
    axis_name: the data-parallel axis, the one ``tx`` votes over.
    shard_axis: a mesh axis whose devices split each node's batch (see
      above), or None to leave every axis but ``axis_name`` to the
      compiler (tensor parallelism, models with sharding annotations).
    check_vma: passed to :func:`jax.shard_map`. With ``True`` JAX checks
      statically that the new params are replicated; the parameters are then
      marked per-worker before differentiation so that JAX does not insert
      its implicit gradient all-reduce, and the state's step counts and
      injected hyperparameters are typed alike on every worker
      (:func:`typed_alike`: an optax schedule, :class:`optax.MultiSteps`
      and :func:`optax.inject_hyperparams` work, each count one small
      all-reduce). Other per-worker state read after the vote makes JAX
      refuse the step although it is identical on every worker; hence off
      by default, with this module's own check of the new params.
    donate: donate ``params`` and ``state`` buffers to the step.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (a pytree of
      scalars, e.g. accuracy) is averaged over workers and returned with the
      loss as ``(loss, aux)``.
    micro_batches: split each worker's batch into this many micro-batches,
      average their gradients (a ``lax.scan``) and update once: one exchange
      per step, unlike :class:`optax.MultiSteps`, which exchanges on every
      micro-step.
    params_per_worker: each worker trains its own params, stacked on a
      leading axis of size ``N`` like the state
      (:func:`~dlion_jax.devices.stack_for_workers`) and returned so: what
      :func:`dlion_jax.local_steps` needs, whose workers' params differ
      within a round. On a mesh of ``axis_name`` and Auto axes beside it
      (:func:`~dlion_jax.devices.hybrid_mesh`), without ``shard_axis``:
      each node's devices then share its params and batch as the compiler
      partitions them, its gradient reduced over them every step, and only
      the outer step crosses ``axis_name``.
    per_worker_args: the extra arguments of ``tx.update`` (optax's
      :class:`~optax.GradientTransformationExtraArgs`, e.g. ``value`` of
      :func:`optax.contrib.reduce_on_plateau`) that are each worker's own:
      the step takes them with a leading axis of ``N``, and each worker
      gets its row. Every other extra argument is one value for all.
    loss_as: the name of an extra argument of ``tx.update`` that gets the
      step's loss (``loss_as="value"`` for
      :func:`optax.contrib.reduce_on_plateau`): each worker's own where
      ``per_worker_args`` names it, else the mean over the workers (the
      loss the step returns).

  Returns:
    ``step(params, state, batch, **extra_args) -> (params, state, loss)``
    with the shapes of the module docstring, ``extra_args`` passed on to
    ``tx.update`` (as ``per_worker_args`` says).

  Example:
    >>> import jax, jax.numpy as jnp, dlion_jax as dl
    >>> from dlion_jax import devices
    >>> from dlion_jax import parallel
    >>> mesh = devices.data_mesh(1)
    >>> loss_fn = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
    >>> tx = dl.distributed_lion(1e-2, axis_name="data")
    >>> params = devices.replicate({"w": jnp.ones(3)}, mesh)
    >>> state = parallel.init_worker_states(tx, params, mesh)
    >>> step = parallel.make_train_step(loss_fn, tx, mesh)
    >>> batch = devices.shard_batch(jnp.ones((4, 3)), mesh)
    >>> params, state, loss = step(params, state, batch)
    >>> float(loss)
    9.0
  """
  _core.check_shard_axis(axis_name, shard_axis, mesh)
  n = _mesh.axis_size(mesh, axis_name)
  if params_per_worker:
    _check_params_per_worker_mesh(mesh, axis_name, shard_axis)
  micro_batches = _checks.positive_int("micro_batches", micro_batches)
  per_worker_args = _extra_args.names(per_worker_args)
  _extra_args.check_loss_as(loss_as, tx)
  # A size-1 axis has no vote (the update is plain Lion, typed per-worker),
  # so there is nothing to check replication against.
  options = dict(axis_name=axis_name, shard_axis=shard_axis,
                 check_vma=check_vma and n > 1, has_aux=has_aux,
                 micro_batches=micro_batches,
                 params_per_worker=params_per_worker,
                 per_worker_args=per_worker_args, loss_as=loss_as)

  def build(placed=None, out_shardings=None):
    step = _steps.train_step(loss_fn, tx, mesh, placed, **options)

    def checked_step(params, state, batch, extra_args=None):
      _core.check_batch_rows(batch, n, axis_name)
      _core.check_worker_states(state, n, mesh.devices.size)
      _check_params_layout(params, state, n, params_per_worker)
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        shared, own = _extra_args.split(
            extra_args or {}, per_worker_args, tx, n, axis_name=axis_name)
      return step(params, state, batch, shared, own)

    return jax.jit(checked_step, out_shardings=out_shardings,
                   donate_argnums=(0, 1) if donate else ())

  jitted = build()
  if len(mesh.axis_names) > 1:
    # A shard_axis step updates on Auto axes, where optax adds leaves
    # placed differently without a sharding type error.
    jitted = _placement.OutputsPlacedLikeInputs(
        build, jitted, mesh, tx, check_placement=shard_axis is None,
        params_per_worker=params_per_worker)
  if params_per_worker:     # whose params differ within a round
    jitted = _replication.AnchorCheck(jitted, axis_name, n, per_worker_args)
  else:
    jitted = _replication.ExchangeCheck(
        jitted, axis_name, n,
        _steps.differentiates_first(mesh, axis_name, shard_axis),
        per_worker_args)
  return limit_in_flight(jitted, devices=mesh.devices.flat)


def _check_params_per_worker_mesh(mesh: Mesh, axis_name, shard_axis) -> None:
  explicit = _mesh.explicit_axes(mesh, axis_name)
  if shard_axis is not None or explicit:
    raise ValueError(
        f"params_per_worker=True runs on a mesh of axis_name={axis_name!r} "
        "and Auto axes beside it, whose devices share each worker's params "
        "and batch as the compiler partitions them; got "
        + (f"shard_axis={shard_axis!r}" if shard_axis else
           f"the Explicit axes {explicit}") + ". Drop shard_axis, and build "
        "the mesh with dl.devices.data_mesh(num_workers) or "
        "dl.devices.hybrid_mesh(nodes) (Auto axes).")


def _check_params_layout(params, state, n: int, params_per_worker: bool):
  """Per-worker params where the step wants them, and where local steps
  need them (:func:`dlion_jax.local_steps`)."""
  if not params_per_worker:
    _core.refuse_local_steps(
        state, "make_train_step's step without params_per_worker")
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not leaf.shape or leaf.shape[0] != n:
      raise ValueError(
          f"params leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}; "
          f"with params_per_worker=True the step wants each of the {n} "
          f"workers' own params stacked on a leading axis of size {n}. "
          "Place them with dl.devices.stack_for_workers(params, mesh) "
          "(after init_worker_states, which takes one worker's params).")


def init_pmap_states(tx: optax.GradientTransformation, params: Any,
                     num_devices: int | None = None) -> Any:
  """Per-device optimizer states for :func:`make_pmap_train_step`.

  Args:
    tx: the optimizer.
    params: one device's parameters, before
      :func:`~dlion_jax.devices.replicate_for_pmap` (given the stacked
      ones, the state would carry the device axis twice).
    num_devices: how many devices (default: all local devices).

  Returns:
    ``tx.init(params)`` stacked ``num_devices`` times: each device's own
    state (its momentum, which the devices do not share).

  Example:
    >>> import jax.numpy as jnp, dlion_jax as dl
    >>> params = {"w": jnp.zeros(3)}
    >>> tx = dl.distributed_lion(1e-3, axis_name="data")
    >>> state = dl.parallel.init_pmap_states(tx, params, 2)
    >>> params = dl.devices.replicate_for_pmap(params, 2)   # after the state
    >>> state[0].mu["w"].shape, params["w"].shape
    ((2, 3), (2, 3))
  """
  return devices.replicate_for_pmap(tx.init(params), num_devices)


def make_pmap_train_step(loss_fn: LossFn, tx: optax.GradientTransformation,
                         *, axis_name: str = "data", donate: bool = True,
                         devices=None, has_aux: bool = False,
                         micro_batches: int = 1,
                         per_worker_args: tuple[str, ...] = (),
                         loss_as: str | None = None):
  """The same data-parallel step for ``jax.pmap`` users.

  Every argument carries a leading device axis of size ``N``: ``params`` from
  :func:`~dlion_jax.devices.replicate_for_pmap`, ``state`` from
  :func:`init_pmap_states`, ``batch`` leaves of shape ``[N, local_batch, ...]``.

  Args:
    loss_fn: ``loss_fn(params, local_batch) -> scalar`` (or ``(scalar, aux)``
      with ``has_aux``) on one device's batch.
    tx: the optimizer, bound to ``axis_name``.
    axis_name: the name ``pmap`` gives the device axis.
    donate: donate ``params`` and ``state`` buffers to the step.
    devices: the devices to map over (default: all local devices).
    has_aux: as in :func:`make_train_step`.
    micro_batches: as in :func:`make_train_step`.
    per_worker_args: as in :func:`make_train_step`: the extra arguments of
      ``tx.update`` given a row per device (``[N, ...]``, each device its
      row); the others are one value for all.
    loss_as: as in :func:`make_train_step`.

  Returns:
    ``step(params, state, batch, **extra_args) -> (params, state, loss)``,
    ``loss`` of shape ``[N]`` (equal entries), ``extra_args`` passed on to
    ``tx.update``.
  """
  per_worker_args = _extra_args.names(per_worker_args)
  _extra_args.check_loss_as(loss_as, tx)
  learn = _steps.learn(loss_fn, tx, has_aux, micro_batches, loss_as=loss_as,
                       own_loss=loss_as in per_worker_args,
                       axis_name=axis_name)

  def local_step(params, state, batch, shared, own):
    fn = lambda shared, params, local, state, rows: learn(
        params, local, state, rows[0], {**shared, **rows[1]})
    # Each device's own extra arguments differ by device, as the batch.
    params, state, loss = _replication.require_exchange(
        fn, axis_name, lax.axis_size(axis_name), shared, params, params,
        state, (batch, own))
    return params, state, lax.pmean(loss, axis_name)

  step = jax.pmap(local_step, axis_name=axis_name, devices=devices,
                  donate_argnums=(0, 1) if donate else ())
  n = jax.local_device_count() if devices is None else len(devices)

  def checked(params, state, batch, extra_args):
    _core.refuse_local_steps(state, "make_pmap_train_step's step")
    stacked = "a copy for each of its devices stacked"
    _core.check_leading_axis(
        params, n, "params", stacked,
        f"Build it with dl.devices.replicate_for_pmap(params, {n}).")
    _core.check_leading_axis(
        state, n, "optimizer state", stacked,
        "Build it with parallel.init_pmap_states(tx, params, "
        f"{n}).", pmap=True)
    _core.check_leading_axis(
        batch, n, "batch", "each device's batch",
        f"Reshape it to [{n}, local_batch, ...].")
    shared, own = _extra_args.split(extra_args, per_worker_args, tx, n,
                                    "each device's own")
    # One for all, copied to every device: pmap's in_axes=None for an
    # empty argument left a leaf after optax.masked's empty node unmapped
    # (jax 0.10).
    shared = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), shared)
    return params, state, batch, shared, own

  @functools.wraps(step)          # keeps pmap's trace, ...
  def checked_step(params, state, batch, **extra_args):
    return step(*checked(params, state, batch, extra_args))
  checked_step.lower = lambda params, state, batch, **extra_args: step.lower(
      *checked(params, state, batch, extra_args))

  return limit_in_flight(checked_step, devices=devices)
