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

Some collectives do not survive ``vmap`` as they are: batched, an
``all_to_all`` or an ``all_gather`` of the packed votes becomes one
all-reduce of every worker's whole message (14 bits a parameter at 8
workers, against 2.275 and 7). :func:`exchanged` gives such an exchange a
batching rule of its own, which states it as placement instead: the
``[N, W]`` words are resharded so that each device holds its column of
every worker's words (one all-to-all), and the tally resharded whole (one
all-gather). The result is the same on every worker, bit for bit the
``shard_map`` step's; so is what a device sends.

On a mesh with more axes (``("data", "fsdp", "model")``) the params and
momenta stay sharded over the others as the user placed them (FSDP,
tensor parallel), and each device votes on its own block of every leaf
(:func:`blockwise`, :class:`dlion_jax.shards.BlockCut`): it packs and
sends across ``"data"`` only that block's votes, and the update is
gathered back over the fast axes where a leaf is replicated on them.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dlion_jax import _drift


def mapped_over_mesh(axis_name: Hashable | tuple) -> bool:
  """Whether ``axis_name`` is a ``jax.vmap`` axis named after axes of the
  enclosing mesh (``spmd_axis_name``), rather than a ``shard_map``'s
  manual axis, a ``vmap`` on its own or no axis bound at all."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not all(a in mesh.axis_names and a not in mesh.manual_axes
                           for a in _names(axis_name)):
    return False
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def mapped_mesh_axes() -> tuple[str, ...]:
  """The axes of the enclosing mesh bound as ``jax.vmap`` axes here (the
  workers of :func:`update` or :func:`stacked`), none manual."""
  mesh = jax.sharding.get_abstract_mesh()
  return () if mesh.empty else tuple(
      a for a in mesh.axis_names
      if a not in mesh.manual_axes and mapped_over_mesh(a))


def _names(axis_name) -> tuple:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def place(x: jax.Array, spec: P) -> jax.Array:
  """``x`` laid out as ``spec`` on the enclosing mesh: a reshard where its
  axes are Explicit, a sharding constraint where they are Auto."""
  if _explicit(spec):
    return jax.sharding.reshard(x, spec)
  return lax.with_sharding_constraint(x, spec)


def _explicit(spec: P) -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  named = {a for entry in spec if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))}
  return all(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit
             for a in named)


def exchanged(manual: Callable[[Any], Any], stacked: Callable[[Any], Any],
              axis_name) -> Callable[[Any], Any]:
  """``manual``, one worker's exchange of ``x`` (an array or a pytree of
  them) over ``axis_name``, whose result is the same on every worker;
  under ``jax.vmap`` over a mesh axis (:func:`mapped_over_mesh`)
  ``stacked`` instead, given every worker's ``x`` as arrays with a leading
  axis of workers and returning the result once. ``stacked`` says with
  :func:`place` where its arrays lie, so that the compiler moves them
  between the workers' devices.

  Inside :func:`blockwise` (each device of the fast axes voting on its own
  block of the leaves) ``stacked`` runs block by block: every worker's
  words of a block lie on the devices of that block, and move across the
  workers' axis only."""
  if not mapped_over_mesh(axis_name):
    return manual
  n = _mesh_size(axis_name)
  blocks = _BLOCK_AXES.get()

  def run(rows, blocked):
    lead = (axis_name, blocks) if blocked else (axis_name,)
    fn = jax.vmap(stacked, in_axes=1,
                  spmd_axis_name=blocks) if blocked else stacked
    if _explicit(P(*lead)):
      return fn(rows)
    # On Auto axes a sharding constraint leaves the compiler free to gather
    # more than the placement asks: the axes are made Explicit for the
    # exchange.
    specs = jax.tree.map(
        lambda r: P(*lead, *(None,) * (r.ndim - len(lead))), rows)
    return jax.sharding.explicit_axes(
        fn, axes=tuple(a for entry in lead for a in _names(entry)),
        in_sharding=(specs,))(rows)

  def broadcast(x, batched, size):
    return jax.tree.map(
        lambda leaf, b: leaf if b else jnp.broadcast_to(
            leaf, (size,) + leaf.shape), x, batched)

  def over_workers(blocked):
    # Not batched (the same on every worker already), x is every row.
    f = jax.custom_batching.custom_vmap(lambda x: run(
        broadcast(x, jax.tree.map(lambda _: False, x), n), blocked))

    @f.def_vmap
    def _(axis_size, in_batched, x):
      del axis_size
      out = run(broadcast(x, in_batched[0], n), blocked)
      return out, jax.tree.map(lambda _: False, out)
    return f
  if blocks is None:
    return over_workers(False)

  # The block's index, batched over the blocks, makes the innermost batching
  # rule the blocks' even where x is the same for every block: this rule
  # hands every block's x to the workers' rule at once.
  over_blocks = jax.custom_batching.custom_vmap(
      lambda x, index: over_workers(False)(x))

  @over_blocks.def_vmap
  def _(axis_size, in_batched, x, index):
    del index
    out = over_workers(True)(broadcast(x, in_batched[0], axis_size))
    return out, jax.tree.map(lambda _: True, out)
  return lambda x: over_blocks(x, lax.axis_index(BLOCKS))


# The jax.vmap axis of the blocks in blockwise, and the mesh axes they lie
# on while it is traced.
BLOCKS = "dlion_jax.blocks"
_BLOCK_AXES = contextvars.ContextVar("block_axes", default=None)


def blockwise(fn: Callable, axes: tuple[str, ...]) -> Callable:
  """``fn`` mapped over a leading axis of blocks, one block on each device
  of the mesh axes ``axes`` (``jax.vmap`` named :data:`BLOCKS`), where
  the workers are a ``jax.vmap`` axis too: its exchanges
  (:func:`exchanged`) move each block between the workers' devices of
  that block only (see :func:`dlion_jax.shards.on_own_shards`)."""
  mapped = jax.vmap(fn, axis_name=BLOCKS, spmd_axis_name=axes)

  def run(*args):
    token = _BLOCK_AXES.set(tuple(axes))
    try:
      return mapped(*args)
    finally:
      _BLOCK_AXES.reset(token)
  return run


def sum_over_blocks(x: jax.Array) -> jax.Array:
  """``x`` summed over the blocks of :func:`blockwise` (inside it), one
  value for every block: the rows of the blocks added in order."""
  add = jax.custom_batching.custom_vmap(lambda x, index: x)

  @add.def_vmap
  def _(axis_size, in_batched, x, index):
    del index
    return x.sum(0) if in_batched[0] else x * axis_size, False
  # The block's index, always batched, brings the blocks' rule first.
  return add(x, lax.axis_index(BLOCKS))


def psum(x: Any, axis_name) -> Any:
  """:func:`jax.lax.psum` of ``x`` (an array or a pytree) over the workers,
  in either form: batched, the sum of every worker's row in its dtype (an
  integer sum wraps as the ``psum`` does), which the compiler all-reduces.
  (JAX's own batching of a ``psum`` over a mesh axis shards its result
  over the axis, and fails where the axis does not divide it.)"""
  return exchanged(
      lambda x: lax.psum(x, axis_name),
      lambda rows: jax.tree.map(
          lambda r: place(r.sum(0, dtype=r.dtype), P()), rows), axis_name)(x)


def pmean(x: Any, axis_name) -> Any:
  """:func:`jax.lax.pmean` of ``x`` over the workers, in either form (the
  sum, then divided by their number, as ``pmean`` does)."""
  return exchanged(
      lambda x: lax.pmean(x, axis_name),
      lambda rows: jax.tree.map(
          lambda r: place(r.sum(0, dtype=r.dtype) / r.shape[0], P()), rows),
      axis_name)(x)


def alike(x: jax.Array, axis_name=None) -> jax.Array:
  """``x``, a value every worker holds alike (a step count in per-worker
  state), as one value.

  Inside ``shard_map(check_vma=True)`` JAX types it per worker, and so
  anything computed from it after the vote (a learning rate, the new
  params); there it takes its ``pmax`` over the axes it is typed varying
  over, one small all-reduce. In the batched form over ``axis_name``
  (:func:`mapped_over_mesh`) it is a row per worker, and the same
  maximum makes it one. Elsewhere it is returned as it is.
  """
  if axis_name is not None and mapped_over_mesh(axis_name):
    return exchanged(lambda x: lax.pmax(x, axis_name),
                     lambda rows: rows.max(0), axis_name)(x)
  axes = tuple(sorted(_drift.typed_varying_axes(x), key=str))
  return lax.pmax(x, axes) if axes else x


def alike_state(state: Any, axis_name=None) -> Any:
  """``state`` with what every worker's optimizer state holds alike made
  one value by :func:`alike`: its integer scalars (step counts: an optax
  schedule's, :class:`optax.MultiSteps`') and the hyperparameters of
  :func:`optax.inject_hyperparams`. A state whose class says
  ``counts_read_alike`` (Distributed Lion's, whose transform does it where
  it reads its count) is left as it is: that would cost an all-reduce for
  nothing."""
  def walk(x):
    if getattr(x, "counts_read_alike", False):
      return x
    if isinstance(x, optax.ApplyIfFiniteState):
      return x._replace(inner_state=alike_state(x.inner_state, axis_name))
    if isinstance(x, _INJECTED):
      return type(x)(*[
          jax.tree.map(lambda h: alike(h, axis_name), value)
          if field == "hyperparams" else alike_state(value, axis_name)
          for field, value in zip(x._fields, x)])
    if (isinstance(x, jax.Array) and not x.ndim
        and jnp.issubdtype(x.dtype, jnp.integer)):
      return alike(x, axis_name)
    return x
  return jax.tree.map(walk, state, is_leaf=lambda x: isinstance(
      x, _INJECTED + (optax.ApplyIfFiniteState,)) or getattr(
          x, "counts_read_alike", False))


_INJECTED = (optax.InjectHyperparamsState,
             optax.InjectStatefulHyperparamsState)


def value_and_grad(loss_fn: Callable, *, axis_name: str = "data",
                   rows_over: tuple[str, ...] | None = None,
                   has_aux: bool = False, placement: Any = None,
                   params_per_worker: bool = False) -> Callable:
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
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def each_worker(params, batch):
    n = _mesh_size(axis_name)
    params = jax.tree.map(_on_mesh, params)
    named = _row_groups(batch, axis_name, rows_over)
    mesh = jax.sharding.get_abstract_mesh()
    groups = tuple(a for a in named if mesh.shape[a] > 1)
    if named != groups:    # an axis of one device: whole params, no split
      params = jax.tree.map(lambda x: _gathered(x, named), params)
    rows = jax.tree_util.tree_map_with_path(
        lambda path, x: _own_keys(x, n, axis_name, groups) if _key(x)
        else worker_rows(x, n, axis_name, path, groups), batch)
    if params_per_worker and groups:
      raise ValueError(
          "params_per_worker=True takes a mesh of axis_name="
          f"{axis_name!r} alone, but the rows are split again over "
          f"{groups}: pass rows_over=() where the devices of those axes do "
          "not split a worker's rows, or build the step with "
          "dl.parallel.make_train_step(..., params_per_worker=True), which "
          "takes nodes of several devices.")
    if not groups:
      return jax.vmap(grad_fn, in_axes=(0 if params_per_worker else None, 0),
                      spmd_axis_name=axis_name)(params, rows)
    k = _mesh_size(groups)
    from dlion_jax import shards  # import this module
    placed = shards.specs_by_path(params, placement)

    def spec(path, x):      # its type's on Explicit axes, else placement's
      typed = _spec_of(x)
      return typed if _named(typed) else placed.get(
          jax.tree_util.keystr(path))
    specs = jax.tree_util.tree_map_with_path(spec, params)

    def one_worker(params, rows):
      whole = jax.tree.map(lambda x: _gathered(x, groups), params)
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


def _key(x) -> bool:
  """Whether ``x`` is one typed PRNG key (``jax.random.key``)."""
  return not np.ndim(x) and jax.dtypes.issubdtype(
      jnp.result_type(x), jax.dtypes.prng_key)


def _own_keys(key: jax.Array, n: int, axis_name, groups) -> jax.Array:
  """A batch's PRNG key as one key a worker, ``fold_in(key, worker)`` (as
  :func:`dlion_jax.parallel.per_worker` folds it), and with ``groups`` one
  a device of the worker's, folded again with the device's index among
  them: each draws its own dropout masks, the same in every run."""
  fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
  keys = fold(key, jnp.arange(n))
  if not groups:
    return place(keys, P(axis_name))
  keys = jax.vmap(fold, in_axes=(0, None))(keys, jnp.arange(_mesh_size(
      groups)))
  return place(keys, P(axis_name, _entry(groups)))


def _on_mesh(x: jax.Array) -> jax.Array:
  """``x`` replicated on the enclosing Explicit mesh where its type has no
  mesh (params fresh from init, on one device): vmapped with
  ``spmd_axis_name``, JAX's batching of such a value beside a per-worker
  one fails ("Resource axis: data ... is not found in mesh: ()")."""
  mesh = jax.sharding.get_abstract_mesh()
  sharding = jax.typeof(x).sharding
  if (mesh.empty or not mesh.are_all_axes_explicit
      or not getattr(sharding, "mesh", mesh).empty):
    return x
  return jax.sharding.reshard(x, P())


def _row_groups(batch: Any, axis_name, rows_over) -> tuple[str, ...]:
  """The mesh axes whose devices split each worker's rows (see
  :func:`value_and_grad`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if rows_over is not None:
    groups = tuple(_names(rows_over))
  elif mesh.empty or mesh.are_all_axes_explicit:
    specs = [tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
             for x in jax.tree.leaves(batch)]
    groups = next((tuple(a for a in _names(s[0]) if a not in _names(
        axis_name)) for s in specs if s and s[0] is not None), ())
  else:
    groups = tuple(a for a in mesh.axis_names if a not in _names(
        axis_name) and mesh.shape[a] > 1)
  return groups


def _gathered(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``x`` whole over ``axes`` (FSDP's gather of a param sharded over
  them), where its type says it is sharded over them (Explicit axes; on
  Auto axes the compiler gathers what it needs)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if spec is None or not any(a in axes for entry in spec
                             for a in _names(entry or ())):
    return x
  keep = [tuple(a for a in _names(entry or ()) if a not in axes)
          for entry in spec]
  return jax.sharding.reshard(x, P(*map(_entry, keep)))


def _scatters(g: jax.Array, spec: P, axis_name,
              groups: tuple[str, ...]) -> bool:
  """Whether :func:`_node_mean` takes the mean of ``g``: a float gradient
  of a param sharded on one dimension over ``groups`` and nothing else
  (FSDP), on a mesh of ``axis_name`` and ``groups`` alone."""
  mesh = jax.sharding.get_abstract_mesh()
  dims = [e for e in spec if e is not None]
  return (jnp.issubdtype(g.dtype, jnp.floating) and len(dims) == 1
          and tuple(_names(dims[0])) == groups
          and set(mesh.axis_names) == {*_names(axis_name), *groups})


def _node_mean(g: jax.Array, spec: P, axis_name,
               groups: tuple[str, ...]) -> jax.Array:
  """The mean of each worker's ``[N, k, ...]`` gradients over its ``k``
  devices of ``groups``, in one reduce-scatter onto the dimension
  ``spec`` (its param's) shards over ``groups``: each term scaled by
  ``1/k``, then summed, as the ``shard_axis`` step's
  :func:`dlion_jax.shards.node_mean_grads` does. Stated as a sum into
  that sharding, the compiler all-reduces it (XLA:CPU, jax 0.10), so it
  is a region manual over the mesh."""
  d = next(i for i, e in enumerate(spec) if e is not None)
  scale = np.dtype(g.dtype).type(1 / g.shape[1])

  def local(g):
    return lax.psum_scatter(g[0, 0] * scale, groups, scatter_dimension=d,
                            tiled=True)[None]
  return jax.shard_map(
      local, in_specs=P(axis_name, _entry(groups)),
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
  axes = tuple(a for entry in spec or () for a in _names(entry or ()))
  if not axes:
    return mean(v)
  return jax.sharding.auto_axes(mean, axes=axes, out_sharding=spec)(v)


def update(tx, *, axis_name: str = "data",
           placement: Any = None,
           params_per_worker: bool = False) -> Callable:
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
      end. The outer optimizer must make the anchor one value by an
      exchange over ``axis_name`` (``dl.distributed_lion``,
      ``dl.rounds.nesterov_outer``): nothing here checks it, where
      :func:`dlion_jax.parallel.make_train_step`'s step refuses an outer
      step that sends nothing.

  Returns:
    ``f(grads, state, params) -> (updates, state)``: ``grads`` and
    ``state`` with one row per worker on a leading axis (from
    :func:`value_and_grad` and :func:`dlion_jax.parallel.init_worker_states`),
    ``params`` and ``updates`` the same for every worker. The state's
    step counts and injected hyperparameters are made one value first
    (:func:`alike_state`), so that a schedule read after the vote gives
    one update.

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
  def each_worker(grads, state, params):
    return tx.update(grads, alike_state(state, axis_name), params)
  mine = 0 if params_per_worker else None
  mapped = jax.vmap(each_worker, in_axes=(0, 0, mine), out_axes=(mine, 0),
                    axis_name=axis_name, spmd_axis_name=axis_name)

  def run(grads, state, params):
    from dlion_jax import _per_worker, rounds, shards  # import this module
    if not params_per_worker:
      rounds.refuse(state, "dl.workers.update's step without "
                    "params_per_worker")
    n = _mesh_size(axis_name)
    fix = ("Take them from dl.workers.value_and_grad (a row per worker), "
           "not jax.grad of the whole batch.")
    for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(params)):
      if np.ndim(g) != np.ndim(p) + (not params_per_worker):
        raise ValueError(
            f"grads leaf {jax.tree_util.keystr(path)} has shape "
            f"{np.shape(g)} and its param {np.shape(p)}; the step wants "
            f"each of the {n} workers' gradients on a leading axis. {fix}")
    _per_worker.check_leading_axis(
        grads, n, "grads", f"each of the {n} workers' gradients", fix)
    _per_worker.check_leading_axis(
        state, n, "state", f"each of the {n} workers' optimizer state",
        "Build it with dl.parallel.init_worker_states(tx, params, mesh) "
        "(for an nnx.Optimizer or a Linen TrainState, with "
        "dl.workers.stacked(tx)), not tx.init(params).")
    try:
      with shards.placed(shards.specs_by_path(grads, placement)):
        updates, state = mapped(grads, state, params)
      # A count made one value (alike_state) would come back replicated,
      # and the next step compile again for a state so placed.
      return updates, jax.tree.map(
          lambda x: place(x, P(axis_name)) if np.ndim(x) == 1 else x, state)
    except ValueError as e:
      if "mapped output" not in str(e):
        raise
      raise ValueError(
          "tx's updates differ from worker to worker in the vmapped form "
          f"over axis_name={axis_name!r}: each worker computes them from "
          "values of its own (its gradients, its state) that no exchange "
          f"over {axis_name!r} makes one. Either tx does not vote over that "
          "axis (optax.lion; dl.distributed_lion without axis_name, or "
          f"with another: pass axis_name={axis_name!r}), or its state keeps "
          "per-worker values after a mean of the gradients (optax.chain("
          "dl.transforms.pmean_gradients(...), optax.adam(...)): each "
          "worker's Adam moments); for such an optimizer keep one state "
          "for all the workers and call tx.update on the gradients' mean "
          "over the workers (grads' leading axis: jax.tree.map(lambda g: "
          "g.mean(0), grads)), not through dl.workers.update."
      ) from None
  return run


def stacked(tx: optax.GradientTransformation, *,
            axis_name: str = "data") -> optax.GradientTransformation:
  """``tx`` with its state held once per worker, for code that calls
  ``tx.init`` and ``tx.update`` itself: :class:`flax.nnx.Optimizer`, a
  Linen ``TrainState``.

  ``init`` stacks ``tx.init(params)`` over the workers of ``axis_name``
  (each row on its worker's devices, each momentum sharded over the other
  axes like its param); ``update`` is :func:`update`: ``grads`` a row per
  worker (:func:`value_and_grad`), ``updates`` the same for every worker.
  Both run under ``jax.set_mesh(mesh)``. On Auto axes, where a traced
  array's type does not say how it is sharded, the params' placement read
  by ``init`` tells the vote where each leaf's blocks lie, so the update
  comes back placed as the params are (no reshard over the fast links).
  It is the placement of the last ``init``: build one ``stacked(tx)`` per
  model. :func:`value_and_grad` does not see it: give it ``placement=``
  too where params are sharded over the axes a worker's rows are split
  over (FSDP), so that each node's mean gradient is reduce-scattered (the
  NNX guide measures it).

  Args:
    tx: the optimizer, voting over ``axis_name``.
    axis_name: the mesh axis of the workers.

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
  placement = []

  def init_fn(params):
    n = _mesh_size(axis_name)
    # Flax NNX's Variables read as their values: nnx.Optimizer would lay
    # out the stacked rows by a Variable's sharding metadata, the param's.
    variable = lambda v: hasattr(v, "get_value")
    params = jax.tree.map(lambda v: v.get_value() if variable(v) else v,
                          params, is_leaf=variable)
    leaves, treedef = jax.tree.flatten(params)
    placement[:] = [_spec_of(x) for x in leaves]
    # Each momentum placed like its param (an eager zeros_like is not).
    return optax.tree_utils.tree_map_params(
        tx, lambda x, i: _stacked_rows(x, n, axis_name, placement[i]),
        tx.init(params), treedef.unflatten(range(len(leaves))),
        transform_non_params=lambda x: _stacked_rows(x, n, axis_name))

  def update_fn(grads, state, params=None):
    return update(tx, axis_name=axis_name, placement=placement or None)(
        grads, state, params)
  return optax.GradientTransformation(init_fn, update_fn)


def _entry(axes: tuple) -> Any:
  """The ``PartitionSpec`` entry of mesh axes: None, one name, or the
  tuple of several."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _named(spec: P | None) -> bool:
  """Whether ``spec`` shards over any mesh axis."""
  return spec is not None and any(entry is not None for entry in spec)


def _spec_of(x) -> P | None:
  """Where ``x`` lies: its type's spec, or a concrete array's."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if not _named(spec) and isinstance(x, jax.Array) and not isinstance(
      x, jax.core.Tracer):      # on Auto axes only a concrete array says
    spec = getattr(x.sharding, "spec", None)
  return spec


def _stacked_rows(x, n: int, axis_name, spec: P | None = None
                  ) -> jax.Array:
  """``n`` copies of ``x`` on a leading axis over ``axis_name``, sharded
  over the other axes as ``spec`` says (by default, as ``x`` is)."""
  spec = tuple((_spec_of(x) if spec is None else spec) or ())
  spec += (None,) * (jnp.ndim(x) - len(spec))
  return place(jnp.broadcast_to(x, (n,) + jnp.shape(x)),
               P(axis_name, *spec))


def _mesh_size(axis_name) -> int:
  """The number of workers: the size of the mesh axes ``axis_name``."""
  mesh = jax.sharding.get_abstract_mesh()
  missing = [a for a in _names(axis_name)
             if mesh.empty or a not in mesh.axis_names]
  if missing:
    raise ValueError(
        f"axis_name={axis_name!r} is not an axis of the enclosing mesh "
        f"({'none' if mesh.empty else dict(mesh.shape)}): the workers lie "
        "on a mesh axis. Trace the step under jax.set_mesh(mesh) with that "
        "axis, e.g. jax.make_mesh((8,), ('data',)).")
  return math.prod(mesh.shape[a] for a in _names(axis_name))


def worker_rows(x: jax.Array, n: int, axis_name, path=(),
                groups: tuple[str, ...] = ()) -> jax.Array:
  """Batch leaf ``x`` (at ``path``) as ``[n, rows of a worker, ...]``, the
  workers on ``axis_name`` and each worker's rows placed as they were;
  with ``groups`` (mesh axes), ``[n, k, rows of a device, ...]``, a
  worker's rows split over the ``k`` devices of ``groups``."""
  k = _mesh_size(groups) if groups else 1
  if not x.ndim or x.shape[0] % (n * k):
    split = (f"the {n} workers of axis {axis_name!r}" if k == 1 else
             f"{n} workers x {k} devices (axis {axis_name!r} and "
             f"rows_over={groups!r}; pass rows_over=() to differentiate a "
             "worker's rows whole)")
    raise ValueError(
        f"batch leaf {jax.tree_util.keystr(tuple(path))} has shape "
        f"{x.shape}; its leading (global batch) axis must be divisible by "
        f"{split}.")
  spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
  if groups:
    out = P(axis_name, _entry(groups), None, *spec[1:])
    shape = (n, k, x.shape[0] // (n * k)) + x.shape[1:]
  else:
    first = spec[0] if spec and spec[0] is not None else ()
    rest = tuple(a for a in _names(first) if a not in _names(axis_name))
    out = P(axis_name, _entry(rest), *spec[1:])
    shape = (n, x.shape[0] // n) + x.shape[1:]
  if _explicit(out):
    return x.reshape(shape, out_sharding=out)
  return place(x.reshape(shape), out)
