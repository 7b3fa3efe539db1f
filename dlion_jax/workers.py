"""The workers as a leading axis of arrays, in a plain ``jax.jit`` step.

JAX's compiler partitions a step written with ``jax.vmap(...,
spmd_axis_name="data")``: each worker's values (its gradients, its
momentum) are one row of an array whose leading axis lies on the mesh's
``"data"`` devices, and a collective over the vmapped axis is carried out
across those devices. Distributed Lion runs there as it is, given the
state stacked one row per worker and the gradients of each worker's own
rows of the batch::

  grads = dl.workers.value_and_grad(loss_fn)(params, batch)[1]
  updates, state = dl.workers.update(tx)(grads, state, params)

with no ``shard_map``, no ``pcast`` and no gradient all-reduce.

The vote's exchanges carry batching rules of their own
(``dlion_jax._collectives``): batched as they are, an ``all_to_all`` or
``all_gather`` of the packed votes would become one all-reduce of every
worker's whole message. The result is the same on every worker, bit for
bit the ``shard_map`` step's; so is what a device sends.

On a mesh with more axes (``("data", "fsdp", "model")``) the params and
momenta stay sharded over the others as the user placed them (FSDP,
tensor parallel), and each device votes on its own block of every leaf
(``dlion_jax._blocks``): it packs and
sends across ``"data"`` only that block's votes, and the update is
gathered back over the fast axes where a leaf is replicated on them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
import jax.extend.core as jex

from dlion_jax import _blocks
from dlion_jax import _core
from dlion_jax import _extra_args
from dlion_jax import _deprecations
from dlion_jax import _mesh
from dlion_jax import rounds
from dlion_jax import _checks

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)


def value_and_grad(loss_fn: Callable, *, axis_name: str = "data",
                   rows_over: tuple[str, ...] | None = None,
                   has_aux: bool = False, placement: Any = None,
                   params_per_worker: bool = False,
                   micro_batches: int = 1) -> Callable:
  """Each worker's loss and gradients, in a plain jitted step.

  On a mesh with more axes, a worker's rows are split again over
  ``rows_over`` (FSDP): each of those devices differentiates its own rows,
  and the worker's loss and gradients are the mean over them, each term
  scaled by ``1/k`` before the sum as
  :func:`dlion_jax.parallel.make_train_step`'s ``shard_axis`` step does
  (one reduce-scatter over the fast links where a param is sharded over
  them). Left to the compiler, a model's gradient may be computed on
  every device of a node from its whole batch, or partitioned like the
  vote's blocks, gathering activations.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``) of one worker's rows (of one device's, with
      ``rows_over``).
    axis_name: the mesh axis of the workers (the vote's).
    rows_over: the mesh axes beside ``axis_name`` whose devices split a
      worker's rows; ``()`` for none. By default those the batch is
      sharded over on Explicit axes, and on Auto axes (whose types do not
      say) every other axis of more than one device. Where the devices of
      an axis share their rows (tensor parallelism over ``"model"``), leave
      it out: ``rows_over=("fsdp",)``. On Explicit axes a batch placed
      over ``"data"`` alone is not split further: with FSDP params, place
      it over both (``jax.P(("data", "fsdp"))``) or pass ``rows_over``,
      or the model meets params sharded over an axis its rows are not.
    has_aux: as in :func:`jax.value_and_grad` (``aux`` averaged over
      ``rows_over`` like the loss).
    placement: on Auto axes, the params' ``PartitionSpec``s, as for
      :func:`update` (on Explicit axes their types say it). Where a param
      is sharded on one dimension over ``rows_over`` (FSDP, ZeRO-3), its
      worker's mean gradient is reduce-scattered onto its shards, as the
      ``shard_axis`` step does; the compiler, given the mean as a sum
      into that sharding, all-reduces it (the CLI's GPT at 2 x 4: 49 bits
      a parameter over ``fsdp`` against 73).
    params_per_worker: ``params`` hold each worker's own, stacked on a
      leading axis (:func:`dlion_jax.local_steps`, whose workers train
      copies of their own within a round); each worker differentiates at
      its row. On a mesh of ``axis_name`` alone.
    micro_batches: each worker's rows are taken in this many slices, the
      gradients averaged over them (as
      :func:`dlion_jax.parallel.make_train_step`'s ``micro_batches``):
      one exchange for the whole batch, a slice's activations in memory.

  Only the floating-point leaves of ``params`` are differentiated; the
  others (an integer step counter) get zero gradients of their own dtype,
  for ``optax.masked`` to leave out.

  Returns:
    ``f(params, batch) -> (values, grads)``: ``batch``'s leaves split on
    their leading axis into one block of rows per worker, and for each
    worker its loss (``[N]``, with ``aux``) and its gradients (each leaf
    ``[N, *param.shape]``, the workers on ``axis_name``'s devices). No
    gradient all-reduce over ``axis_name`` is issued. A typed PRNG key in
    ``batch`` (``jax.random.key``, for dropout) is not split: each worker
    gets ``jax.random.fold_in(key, worker)``, and with ``rows_over`` each
    of its devices that folded again with its index among them, so that
    each draws its own masks, the same in every run.

  Example:
    >>> import jax, jax.numpy as jnp, dlion_jax as dl
    >>> mesh = jax.make_mesh((2,), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Explicit,))
    >>> loss_fn = lambda p, x: jnp.mean(x @ p)
    >>> x = jnp.array([[1., 2.], [3., 4.], [5., 6.], [7., 8.]])
    >>> with jax.set_mesh(mesh):
    ...   x = jax.device_put(x, jax.P("data"))
    ...   loss, grads = jax.jit(dl.workers.value_and_grad(loss_fn))(
    ...       jnp.ones(2), x)
    >>> grads            # worker 0's rows 0-1, worker 1's rows 2-3
    Array([[2., 3.],
           [6., 7.]], dtype=float32)
  """
  micro_batches = _checks.positive_int("micro_batches", micro_batches)

  def grad_fn(params, rows):
    try:
      return _core.loss_and_grads(loss_fn, params, rows, has_aux,
                                  micro_batches)
    except Exception as e:   # flax.errors.TraceContextError; flax optional
      if type(e).__name__ != "TraceContextError":
        raise
      raise ValueError(
          "loss_fn changes NNX state it did not make (an nnx.Dropout's or "
          "nnx.Rngs' count, captured from the step around "
          "dl.workers.value_and_grad): each worker's rows are traced in a "
          "jax.vmap, where NNX refuses to mutate state of the trace outside. "
          "Merge the model inside loss_fn with nnx.merge(graphdef, params, "
          "rest, copy=True), and give each worker its own dropout masks: "
          "put a key in the batch, batch['key'] = jax.random.key(step) "
          "(value_and_grad folds it with each worker's index), and "
          "nnx.reseed(model, dropout=rows['key']) in loss_fn; or step "
          "with dl.parallel.per_worker, which folds the keys of nnx.Rngs "
          "per worker.") from e

  def each_worker(params, batch):
    _not_in_a_shard_map("dl.workers.value_and_grad", axis_name)
    n = _mesh.mesh_size(axis_name)
    params = jax.tree.map(_mesh.on_mesh, params)
    named = _row_groups(batch, axis_name, rows_over)
    mesh = jax.sharding.get_abstract_mesh()
    groups = tuple(a for a in named if mesh.shape[a] > 1)
    if named != groups:    # an axis of one device: whole params, no split
      params = jax.tree.map(lambda x: _mesh.gathered(x, named), params)
    rows = jax.tree_util.tree_map_with_path(
        lambda path, x: _own_keys(x, n, axis_name, groups)
        if _core.typed_key(x) and not np.ndim(x)
        else _core.worker_rows(x, n, axis_name, path, groups), batch)
    if params_per_worker and groups:
      raise ValueError(
          "params_per_worker=True takes a mesh of axis_name="
          f"{axis_name!r} alone, but the rows are split again over "
          f"{groups}: pass rows_over=() where the devices of those axes do "
          "not split a worker's rows, or build the step with "
          "dl.parallel.make_train_step(..., params_per_worker=True), which "
          "takes nodes of several devices.")
    if not groups:
      try:
        return jax.vmap(grad_fn, in_axes=(0 if params_per_worker else None,
                                          0), spmd_axis_name=axis_name)(
                                              params, rows)
      except Exception as e:    # the model's own error, on stacked copies?
        if params_per_worker or not _copies_of(params, n):
          raise
        raise ValueError(
            f"loss_fn failed ({type(e).__name__}) on params whose every "
            f"leaf has a leading axis of the {n} workers: each worker's own "
            "copy, stacked (local steps: dl.workers.stacked(tx, "
            "params_per_worker=True))? Differentiate each copy at its row: "
            "dl.workers.value_and_grad(loss_fn, params_per_worker=True).") \
            from e
    k = _mesh.mesh_size(groups)
    placed = _blocks.specs_by_path(placement)
    _blocks.check_placement_covers(params, placed)

    def spec(path, x):      # its type's on Explicit axes, else placement's
      typed = _mesh.spec_of(x)
      return typed if _mesh.named(typed) else placed.get(
          _blocks.path_key(path))
    specs = jax.tree_util.tree_map_with_path(spec, params)

    def one_worker(params, rows):
      whole = jax.tree.map(lambda x: _mesh.gathered(x, groups), params)
      return jax.vmap(grad_fn, in_axes=(None, 0),
                      spmd_axis_name=groups)(whole, rows)
    values, grads = jax.vmap(one_worker, in_axes=(None, 0),
                             spmd_axis_name=axis_name)(params, rows)

    def mean(v, like=None, spec=None):
      if spec is not None and _scatters(v, spec, axis_name, groups):
        return _node_mean(v, spec, axis_name, groups)
      return jax.vmap(lambda v: _mean_of_groups(v, k, like),
                      spmd_axis_name=axis_name)(v)
    return (jax.tree.map(mean, values),
            jax.tree.map(mean, grads, params, specs,
                         is_leaf=lambda x: x is None))
  return each_worker


def _copies_of(params: Any, n: int) -> bool:
  """Whether every leaf of ``params`` has a leading axis of ``n``: params
  stacked a copy per worker."""
  leaves = jax.tree.leaves(params)
  return bool(leaves) and all(np.ndim(x) and np.shape(x)[0] == n
                              for x in leaves)


def _own_keys(key: jax.Array, n: int, axis_name, groups) -> jax.Array:
  """A batch's PRNG key as one key a worker (:func:`dlion_jax._core.
  own_key`, as :func:`dlion_jax.parallel.per_worker` folds it), and with
  ``groups`` one a device of the worker's, folded again with the device's
  index among them."""
  fold = lambda key, count: jax.vmap(lambda i: _core.own_key(key, i))(
      jnp.arange(count))
  keys = fold(key, n)
  if not groups:
    return _mesh.place(keys, P(axis_name))
  keys = jax.vmap(lambda k: fold(k, _mesh.mesh_size(groups)))(keys)
  return _mesh.place(keys, P(axis_name, _mesh.entry(groups)))


def _row_groups(batch: Any, axis_name, rows_over) -> tuple[str, ...]:
  """The mesh axes whose devices split each worker's rows (see
  :func:`value_and_grad`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if rows_over is not None:
    groups = tuple(_mesh.names(rows_over))
    bad = [a for a in groups if a not in mesh.axis_names
           or a in _mesh.names(axis_name)]
    if bad:
      others = [a for a in mesh.axis_names if a not in _mesh.names(
          axis_name)]
      raise ValueError(
          f"rows_over={rows_over!r} names {bad[0]!r}, which is "
          + ("the workers' axis" if bad[0] in _mesh.names(axis_name) else
             "not an axis of the mesh")
          + f"; the mesh's axes are {tuple(mesh.axis_names)}. Name the "
          "axes beside axis_name whose devices split a worker's rows"
          + (f" (here: rows_over={tuple(others)!r})" if others else "")
          + ", or rows_over=() for none.")
  elif mesh.empty or mesh.are_all_axes_explicit:
    specs = [tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
             for x in jax.tree.leaves(batch)]
    groups = next((tuple(a for a in _mesh.names(s[0]) if a not in _mesh.names(
        axis_name)) for s in specs if s and s[0] is not None), ())
  else:
    groups = tuple(a for a in mesh.axis_names if a not in _mesh.names(
        axis_name) and mesh.shape[a] > 1)
  return groups


def _scatters(g: jax.Array, spec: P, axis_name,
              groups: tuple[str, ...]) -> bool:
  """Whether :func:`_node_mean` takes the mean of ``g``: a float gradient
  of a param sharded on one dimension over ``groups`` and nothing else
  (FSDP), on a mesh of ``axis_name`` and ``groups`` alone."""
  mesh = jax.sharding.get_abstract_mesh()
  dims = [e for e in spec if e is not None]
  return (jnp.issubdtype(g.dtype, jnp.floating) and len(dims) == 1
          and tuple(_mesh.names(dims[0])) == groups
          and set(mesh.axis_names) == {*_mesh.names(axis_name), *groups})


def _node_mean(g: jax.Array, spec: P, axis_name,
               groups: tuple[str, ...]) -> jax.Array:
  """The mean of each worker's ``[N, k, ...]`` gradients over its ``k``
  devices of ``groups``, reduce-scattered onto the dimension ``spec`` (its
  param's) shards over ``groups`` (:func:`dlion_jax._core.node_mean`).
  Stated as a sum into that sharding, the compiler all-reduces it
  (XLA:CPU, jax 0.10), so it is a region manual over the mesh."""
  d, k = next(i for i, e in enumerate(spec) if e is not None), g.shape[1]
  return jax.shard_map(
      lambda g: _core.node_mean(g[0, 0], groups, k, d)[None],
      in_specs=P(axis_name, _mesh.entry(groups)),
      out_specs=P(axis_name, *spec), check_vma=False)(g)


def _mean_of_groups(v: jax.Array, k: int, like=None) -> jax.Array:
  """The mean over ``v``'s leading axis of ``k`` row groups: each term
  scaled by ``1/k``, then summed (``make_train_step``'s order); sharded
  as ``like``'s type says: on Explicit axes a sum typed replicated is
  all-reduced whole, and summed on Auto axes into ``like``'s sharding it
  sends fewer bytes (XLA:CPU still all-reduces it where ``shard_map``'s
  ``psum_scatter`` reduce-scatters: see the design notes)."""
  if not jnp.issubdtype(v.dtype, jnp.floating):
    return jnp.mean(v, axis=0)
  mean = lambda v: (v * np.dtype(v.dtype).type(1 / k)).sum(0, dtype=v.dtype)
  spec = None if like is None else getattr(jax.typeof(like).sharding,
                                           "spec", None)
  axes = tuple(a for entry in spec or () for a in _mesh.names(entry or ()))
  if not axes:
    return mean(v)
  return jax.sharding.auto_axes(mean, axes=axes, out_sharding=spec)(v)


def update(tx, *, axis_name: str = "data",
           placement: Any = None,
           params_per_worker: bool = False,
           per_worker_args: tuple[str, ...] = ()) -> Callable:
  """``tx.update`` of every worker, in a plain jitted step.

  Args:
    tx: the optimizer, voting over ``axis_name`` (e.g.
      ``dl.distributed_lion(lr, axis_name="data")``).
    axis_name: the mesh axis of the workers.
    placement: on Auto axes, where a traced array's type does not say how
      a param is sharded, the params' ``PartitionSpec``s (a pytree like
      the params, e.g. ``jax.tree.map(lambda x: x.sharding.spec, params)``
      of the concrete params), so that each device votes on its own shard
      and the update comes back placed as the params are. Without it a
      leaf is taken to lie as :func:`dlion_jax.devices.shard_params`
      places it, and other placements cost a reshard over the fast links
      and come back so placed. Not needed on Explicit axes, nor with
      :func:`stacked`, which reads it when it builds the state.
    params_per_worker: ``params`` hold each worker's own, stacked on a
      leading axis, and so do the ``updates`` returned (the form
      :func:`dlion_jax.local_steps` needs): apply them with
      ``dl.rounds.restart_at_anchor(optax.apply_updates(params, updates),
      state)``, which puts every worker exactly on the anchor at a round's
      end (``params + updates`` misses it in the last bit, by another
      bit on each worker). The outer optimizer must make the anchor one
      value by an exchange over ``axis_name`` (``dl.distributed_lion``,
      ``dl.rounds.nesterov_outer``): an outer step that sends nothing is
      refused, as :func:`dlion_jax.parallel.make_train_step` refuses it.
    per_worker_args: the extra arguments of ``tx.update`` (optax's
      :class:`~optax.GradientTransformationExtraArgs`: ``value`` of
      :func:`optax.contrib.reduce_on_plateau`) that are each worker's own,
      given with a leading axis of workers (``value=losses``, the losses
      :func:`value_and_grad` returns): each worker gets its row. Every
      other extra argument is one value for all (``value=losses.mean()``).

  Returns:
    ``f(grads, state, params, **extra_args) -> (updates, state)``:
    ``grads`` and ``state`` with one row per worker on a leading axis (from
    :func:`value_and_grad` and :func:`dlion_jax.parallel.init_worker_states`),
    ``params`` and ``updates`` the same for every worker, ``extra_args``
    passed on to ``tx.update`` as ``per_worker_args`` says. The state's
    step counts and injected hyperparameters are made one value first
    (``dlion_jax._collectives.alike_state``), so that a schedule read after
    the vote gives one update.

  Example:
    >>> import jax, jax.numpy as jnp, optax, dlion_jax as dl
    >>> mesh = jax.make_mesh((2,), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Explicit,))
    >>> tx = dl.distributed_lion(0.1, weight_decay=0.0, axis_name="data")
    >>> with jax.set_mesh(mesh):
    ...   params = jnp.zeros(3)
    ...   state = dl.parallel.init_worker_states(tx, params, mesh)
    ...   grads = jax.device_put(jnp.array([[1., -1., 2.], [1., 3., -2.]]),
    ...                          jax.P("data"))     # worker 0's, worker 1's
    ...   updates, state = jax.jit(dl.workers.update(tx))(grads, state,
    ...                                                  params)
    >>> updates          # MaVo of 2 workers: a tie moves nothing
    Array([-0.1, -0. , -0. ], dtype=float32)
  """
  per_worker_args = _extra_args.names(per_worker_args)

  def run(grads, state, params, **extra_args):
    _not_in_a_shard_map("dl.workers.update", axis_name)
    if not params_per_worker:
      _core.refuse_local_steps(state, "dl.workers.update's step without "
                               "params_per_worker")
    n = _mesh.mesh_size(axis_name)
    shared, own = _extra_args.split(extra_args, per_worker_args, tx, n,
                                    axis_name=axis_name)
    fix = _WHOLE_BATCH_FIX.format("", ", params_per_worker=True"
                                  if params_per_worker else "")
    _check_worker_grads(grads, params, n, params_per_worker, fix)
    _core.check_leading_axis(
        grads, n, "grads", f"each of the {n} workers' gradients", fix)
    _core.check_leading_axis(
        state, n, "state", f"each of the {n} workers' optimizer state",
        "Build it with dl.parallel.init_worker_states(tx, params, mesh) "
        "(for an nnx.Optimizer or a Linen TrainState, with "
        "dl.workers.stacked(tx)), not tx.init(params).")
    placed = _blocks.specs_by_path(placement)
    _blocks.check_placement_covers(grads, placed, "gradient")
    mesh = jax.sharding.get_abstract_mesh()
    typed = lambda tree: jax.tree.map(
        lambda x: getattr(jax.typeof(x).sharding, "spec", None) or P(),
        tree)
    if _mesh.explicit_axes(mesh, axis_name):   # the types say where
      placed = {**_blocks.specs_by_path(
          jax.tree.map(lambda spec: P(*spec[params_per_worker:]),
                       typed(params), is_leaf=lambda x: isinstance(x, P))),
                **placed}
    # An integer leaf's gradient is zeros (value_and_grad's, for
    # optax.masked to leave out): made in the region, one for every worker.
    floats = [g for g in jax.tree.leaves(grads)
              if jnp.issubdtype(jnp.result_type(g), jnp.inexact)]
    # The extra arguments one for all first, among the constants; what
    # differs by worker last: the checks read it as varying.
    region = _core.in_region(
        _one_worker(tx, grads, params_per_worker), mesh, axis_name,
        in_specs=(P(), P(axis_name) if params_per_worker else P(),
                  P(axis_name), P(axis_name), P(axis_name)),
        out_specs=(P(axis_name) if params_per_worker else P(),
                   P(axis_name)),
        out_typed=lambda shared, params, state, own, grads: (
            typed(params), typed(state)))
    args = (shared, params, state, own, floats)
    with _blocks.placed(placed), _unknown_placement(placement, axis_name):
      closed, shape = jax.make_jaxpr(region, return_shape=True)(*args)
    if n > 1:     # replicated outputs come from worker 0: equal on all?
      traced = _core.region_of(closed)
      if rounds.has_local_steps(state):
        _core.check_anchor_alike(traced, params, state, (own, floats),
                                 axis_name)
      elif not params_per_worker:
        _core.check_no_drift(traced, params, len(jax.tree.leaves(own))
                             + len(floats), axis_name, n, state)
    out = jex.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shape), out)
  return run


_WHOLE_BATCH_FIX = (
    "Take them from dl.workers.value_and_grad(loss_fn{1})(params, batch) "
    "(a row per worker{0}), not jax.grad or nnx.value_and_grad of the "
    "whole batch.")


def _check_worker_grads(grads: Any, params: Any, n: int,
                        params_per_worker: bool, fix: str) -> None:
  """Raises a ValueError naming the first gradient leaf without the leading
  axis of the ``n`` workers (``params`` without one, unless
  ``params_per_worker``), its shape, its param's and ``fix``."""
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(params)):
    if np.ndim(g) != np.ndim(p) + (not params_per_worker):
      raise ValueError(
          f"grads leaf {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(g)} and its param {np.shape(p)}; the step wants "
          f"each of the {n} workers' gradients on a leading axis. {fix}")


def _one_worker(tx, grads, params_per_worker: bool) -> Callable:
  """One worker's update in the region of :func:`update`: its rows of the
  float leaves' gradients, of the state and of its own extra arguments,
  the other leaves' gradients zeros (one for every worker, for
  ``optax.masked`` to leave out), ``tx.update``, the new state a row
  again."""
  leaves, treedef = jax.tree.flatten(grads)
  floats = [jnp.issubdtype(jnp.result_type(g), jnp.inexact) for g in leaves]
  row = lambda tree: jax.tree.map(lambda x: x[0], tree)

  def local(shared, params, state, own, float_grads):
    given = iter(float_grads)
    grads = treedef.unflatten([
        next(given)[0] if f else jnp.zeros(np.shape(g)[1:],
                                           jnp.result_type(g))
        for g, f in zip(leaves, floats)])
    params = row(params) if params_per_worker else params
    updates, state = tx.update(grads, _extra_args.alike_state(row(state)),
                               params, **shared, **row(own))
    lead = lambda tree: jax.tree.map(lambda x: x[None], tree)
    return (lead(updates) if params_per_worker else updates), lead(state)
  return local


def _not_in_a_shard_map(what: str, axis_name) -> None:
  """Raises where a plain-door function runs inside a ``shard_map``
  manual over the workers' axis: the two doors mixed."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(_mesh.names(axis_name)) & set(mesh.manual_axes):
    raise ValueError(
        f"{what} is the plain jitted step's (every worker's rows on a "
        "leading axis), but it runs inside a jax.shard_map manual over "
        f"{axis_name!r} (dl.parallel.make_train_step, per_worker or a "
        "shard_map of yours), where each worker sees its own row: the two "
        "doors mixed. Inside a shard_map step call tx.update(grads, state, "
        "params) on the worker's own gradients (jax.grad), with tx itself, "
        "not dl.workers.stacked(tx); or keep the whole step plain "
        "(dl.workers.value_and_grad and dl.workers.update in a jax.jit).")


def stacked(tx: optax.GradientTransformation, *, axis_name: str = "data",
            placement: Any = None, params_per_worker: bool = False,
            per_worker_args: tuple[str, ...] = ()
            ) -> optax.GradientTransformationExtraArgs:
  """``tx`` with its state held once per worker, for code that calls
  ``tx.init`` and ``tx.update`` itself: :class:`flax.nnx.Optimizer`, a
  Linen ``TrainState``.

  ``init`` stacks ``tx.init(params)`` over the workers of ``axis_name``
  (each row on its worker's devices, each momentum sharded over the other
  axes like its param, as :func:`dlion_jax.parallel.init_worker_states`
  places it); ``update`` is :func:`update`: ``grads`` a row per worker
  (:func:`value_and_grad`), ``updates`` the same for every worker. Both run
  under ``jax.set_mesh(mesh)``. On Auto axes, where a traced array's type
  does not say how it is sharded, the placement the params had when
  ``init`` saw them (or ``placement``) tells the vote where each leaf's
  blocks lie, so the update comes back placed as the params are. It is
  the placement of the last ``init``: build one ``stacked(tx)`` per model.
  :func:`value_and_grad` does not see it: give it ``placement=`` too where
  params are sharded over the axes a worker's rows are split over (FSDP),
  so that each node's mean gradient is reduce-scattered (the NNX guide
  measures it).

  Local steps (:func:`dlion_jax.local_steps`) take ``params_per_worker``:
  the model holds each worker's copy, stacked on a leading axis
  (:func:`dlion_jax.devices.stack_for_workers`), and the step differentiates
  each at its row (``dl.workers.value_and_grad(..., params_per_worker=
  True)``), applies the update and puts every worker back on the anchor at
  a round's end (:func:`restart_at_anchor`); :func:`anchor` reads the
  anchor as one copy of the params. Bit for bit
  :func:`dlion_jax.parallel.make_train_step`'s ``params_per_worker`` step.

  Args:
    tx: the optimizer, voting over ``axis_name``.
    axis_name: the mesh axis of the workers.
    placement: the params' ``PartitionSpec``s (a pytree like the params,
      e.g. ``jax.tree.map(lambda x: x.sharding.spec, params)``), for an
      ``init`` traced in a ``jax.jit`` of yours on Auto axes (MaxText's
      and levanter's way), where the params do not say how they lie; it
      is refused there without it. Not needed on Explicit axes, nor for an
      ``init`` on the arrays themselves.
    params_per_worker: the params ``init`` and ``update`` see hold each
      worker's own, stacked on a leading axis of workers, and so do the
      updates (what local steps need); ``init`` builds every worker's
      state from worker 0's copy. On a mesh of ``axis_name`` alone.
    per_worker_args: as in :func:`update`: the extra arguments of
      ``tx.update`` given a row per worker (``nnx.Optimizer.update(model,
      grads, value=losses)``); the others are one value for all.

  Example:
    >>> import jax, jax.numpy as jnp, dlion_jax as dl
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((2,), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Explicit,))
    >>> tx = dl.distributed_lion(0.1, weight_decay=0.0, axis_name="data")
    >>> with jax.set_mesh(mesh):
    ...   model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    ...   optimizer = nnx.Optimizer(model, dl.workers.stacked(tx),
    ...                             wrt=nnx.Param)
    >>> optimizer.opt_state[0].mu["kernel"].shape   # a row per worker
    (2, 3, 1)
  """
  per_worker_args = _extra_args.names(per_worker_args)
  params_per_worker = _checks.flag(
      "params_per_worker", params_per_worker,
      "whether the params hold each worker's own copy (local steps)")
  told = []

  def init_fn(params):
    _not_in_a_shard_map("dl.workers.stacked(tx)", axis_name)
    n = _mesh.mesh_size(axis_name)
    # Flax NNX's Variables read as their values: nnx.Optimizer would lay
    # out the stacked rows by a Variable's sharding metadata, the param's.
    params = _values(params)
    if params_per_worker:
      _core.check_leading_axis(
          params, n, "params", f"each of the {n} workers' own copy",
          "Stack the model's params a copy per worker first: "
          "dl.devices.stack_for_workers(params, mesh) (for an nnx model, "
          "nnx.update(model, dl.devices.stack_for_workers(nnx.state(model, "
          "nnx.Param), mesh))), then build the optimizer.")
      # Every worker's state from worker 0's copy: the anchor is one.
      params = _one_copy(params, axis_name, first=True)
    if placement is not None:
      given = _blocks.specs_by_path(placement)
      _blocks.check_placement_covers(params, given)
      specs = jax.tree_util.tree_map_with_path(
          lambda path, _: given[_blocks.path_key(path)] or P(), params)
    else:
      _core.check_placement_known(
          params, jax.sharding.get_abstract_mesh(), axis_name,
          "dl.workers.stacked(tx).init",
          "Pass the params' placement: dl.workers.stacked(tx, placement="
          "jax.tree.map(lambda x: x.sharding.spec, params)) of the concrete "
          "params")
      specs = jax.tree.map(lambda x: _mesh.spec_of(x) or P(), params)
    told[:] = [specs]
    state = _core.worker_states(tx, params, n, axis_name, specs)
    if rounds.has_local_steps(state) and not params_per_worker:
      raise ValueError(
          "dl.workers.stacked(tx): tx runs local steps (dl.local_steps), "
          "whose workers each train their own copy of the params, but the "
          "params it got are one copy. Hold each worker's copy in the "
          "model and say so: params = dl.devices.stack_for_workers(params, "
          "mesh) (for an nnx model, nnx.update(model, dl.devices."
          "stack_for_workers(nnx.state(model, nnx.Param), mesh))), then "
          "dl.workers.stacked(tx, params_per_worker=True); the step takes "
          "dl.workers.value_and_grad(loss_fn, params_per_worker=True) and "
          "ends with dl.workers.restart_at_anchor (the Flax NNX guide).")
    return state

  def update_fn(grads, state, params=None, **extra_args):
    _not_in_a_shard_map("dl.workers.stacked(tx)", axis_name)
    if params is not None:
      _check_worker_grads(
          grads, params, _mesh.mesh_size(axis_name), params_per_worker,
          _WHOLE_BATCH_FIX.format(
              ", as the NNX guide's step does", ", params_per_worker=True"
              if params_per_worker else "")
          + ("" if params_per_worker else
             " (A wrapper around stacked(tx) that keeps one copy of the "
             "gradients, optax.MultiSteps(dl.workers.stacked(tx), k), gives "
             "them so too: wrap tx inside, dl.workers.stacked("
             "optax.MultiSteps(tx, k)), or pass micro_batches=k to "
             "dl.workers.value_and_grad.)"))
    return update(tx, axis_name=axis_name,
                  placement=told[0] if told else placement,
                  params_per_worker=params_per_worker,
                  per_worker_args=per_worker_args)(
                      grads, state, params, **extra_args)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _values(tree: Any) -> Any:
  """``tree`` with its Flax NNX Variables (an ``nnx.Param``, an
  ``nnx.Optimizer``'s ``OptArray``) read as their values."""
  variable = lambda v: hasattr(v, "get_value")
  return jax.tree.map(lambda v: v.get_value() if variable(v) else v, tree,
                      is_leaf=variable)


def restart_at_anchor(params: Any, state: Any) -> Any:
  """:func:`dlion_jax.rounds.restart_at_anchor` for the step of
  ``stacked(tx, params_per_worker=True)``: each worker's copy in
  ``params``, exactly on the anchor where its last update ended a round
  (applying ``anchor - params`` may miss it in the last bit, or stay NaN
  on a worker whose copy turned NaN), elsewhere as it is. ``params`` and
  ``state`` as :class:`flax.nnx.Optimizer` and a Linen ``TrainState``
  hold them: Flax NNX Variables are read as their values, and the result
  has the structure of ``params`` (its ``nnx.Param`` Variables).

  Example:
    A step's last line, Flax NNX: ``nnx.update(model,
    dl.workers.restart_at_anchor(nnx.state(model, nnx.Param),
    optimizer.opt_state))``; Linen: ``state.replace(params=
    dl.workers.restart_at_anchor(state.params, state.opt_state))``.
  """
  new = rounds.restart_at_anchor(_values(params), _values(state))
  return jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(new))


def anchor(state: Any, *, axis_name: str = "data") -> Any:
  """The anchor of a ``stacked(tx, params_per_worker=True)`` state (an
  ``nnx.Optimizer``'s ``opt_state``, a ``TrainState``'s) as one copy of
  the params: the params of the last outer step, every worker's alike
  (:func:`dlion_jax.rounds.anchor` gives each worker's row), Flax NNX
  Variables read as their values. The model to evaluate and keep:
  ``nnx.merge(graphdef, dl.workers.anchor(optimizer.opt_state), rest)``
  with ``graphdef, _, rest = nnx.split(model, nnx.Param, ...)``, or
  ``model.apply({"params": dl.workers.anchor(state.opt_state)}, x)``."""
  return _one_copy(rounds.anchor(_values(state)), axis_name)


def _one_copy(tree: Any, axis_name, first: bool = False) -> Any:
  """``tree``, stacked a row per worker, as one copy on every worker: each
  worker's own row, where the rows are alike (the anchor), moving
  nothing; with ``first``, worker 0's row (one all-reduce of a row)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return tree
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:              # arrays outside jax.set_mesh: their own mesh
    mesh = leaves[0].sharding.mesh

  def own(row):
    if not first:
      return row[0]
    mine = jnp.where(jax.lax.axis_index(axis_name) == 0, row[0],
                     jnp.zeros_like(row[0]))
    return jax.lax.psum(mine, axis_name)
  return jax.shard_map(lambda t: jax.tree.map(own, t), mesh=mesh,
                       in_specs=P(axis_name), out_specs=P(),
                       axis_names=set(_mesh.names(axis_name)),
                       check_vma=False)(tree)


def _unknown_placement(placement: Any, axis_name):
  """Where the update is traced on Auto axes that partition the mesh beside
  the workers' with no placement told, the error to raise in place of
  guessing how a leaf lies."""
  mesh = jax.sharding.get_abstract_mesh()
  auto = tuple(a for a in _mesh.auto_axes(mesh)
               if a not in _mesh.names(axis_name))
  if placement is not None or not auto:
    return contextlib.nullcontext()
  return _blocks.unknown_placement(
      "dl.workers.update(tx) is traced on the mesh's Auto axes "
      f"{auto}, where a traced array does not say how it is placed: the "
      "vote would cut each param as it guesses and the update would come "
      "back placed as the compiler picks. Pass the params' placement: "
      "dl.workers.update(tx, placement=jax.tree.map(lambda x: "
      "x.sharding.spec, params)) of the concrete params (with "
      "dl.workers.stacked(tx), an init on the arrays themselves tells it), "
      "or use Explicit axes.")
