"""One worker's part of a step, for both doors: its loss and gradients
(averaged over micro-batches, taken over the float leaves of the params
only), the region it votes in, the mean of the losses over the workers,
its rows of the batch, the node mean, its state and the checks by cause.
The steps of :mod:`dlion_jax.parallel` are built of these, around the
optimizer update of ``dlion_jax._steps``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding

from dlion_jax import _checks
from dlion_jax import _mesh
from dlion_jax import _placement
from dlion_jax import rounds
from dlion_jax._mesh import axis_size
from dlion_jax import _drift


def _differentiable(leaf) -> bool:
  try:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
  except TypeError:               # not an array: left to jax.grad to name
    return True


def _value_and_grad(loss_fn, has_aux):
  """``jax.value_and_grad`` over the floating-point leaves of the params
  only: the others (an integer step counter, a flag) get zero gradients of
  their own dtype, so that an optimizer can leave them out with
  ``optax.masked`` and they stay unchanged."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
  def value_and_grad(params, batch):
    leaves, treedef = jax.tree.flatten(params)
    floats = [_differentiable(x) for x in leaves]
    if all(floats):
      return grad_fn(params, batch)
    def on_floats(float_leaves, batch):
      it = iter(float_leaves)
      return loss_fn(treedef.unflatten(
          [next(it) if f else x for x, f in zip(leaves, floats)]), batch)
    value, grads = jax.value_and_grad(on_floats, has_aux=has_aux)(
        [x for x, f in zip(leaves, floats) if f], batch)
    it = iter(grads)
    # Constants, not zeros_like: those of per-worker typed (check_vma)
    # params would be typed per worker, and so would the unchanged leaves.
    return value, treedef.unflatten(
        [next(it) if f else jnp.zeros(jnp.shape(x), jnp.result_type(x))
         for x, f in zip(leaves, floats)])
  return value_and_grad


def loss_and_grads(loss_fn, params, batch, has_aux, micro_batches):
  """``value_and_grad``, averaged over ``micro_batches`` slices of batch."""
  grad_fn = _value_and_grad(loss_fn, has_aux)
  if micro_batches == 1:
    return grad_fn(params, batch)
  def split(x):
    rows = x.shape[0]
    if rows % micro_batches:
      raise ValueError(
          f"micro_batches={micro_batches} must divide the batch each call "
          f"of loss_fn sees, which has {rows} rows.")
    spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
    mesh = jax.sharding.get_abstract_mesh()
    if not spec or spec[0] is None:
      if not _mesh.auto_axes(mesh):
        return x.reshape((micro_batches, rows // micro_batches) + x.shape[1:])
      # Rows the compiler may have sharded over Auto axes, unseen here: the
      # strided split keeps each device's share of each micro-batch on it.
      x = x.reshape((rows // micro_batches, micro_batches) + x.shape[1:])
      return jnp.moveaxis(x, 1, 0)
    k = math.prod(mesh.shape[a] for a in _mesh.names(spec[0]))
    if (rows // micro_batches) % k:
      raise ValueError(
          f"micro_batches={micro_batches} leaves {rows // micro_batches} "
          f"rows of each worker's batch of {rows} a micro-batch, which the "
          f"{k} devices its rows are sharded over ({spec[0]!r}) cannot "
          f"share: each micro-batch must hold a multiple of {k} rows. Use "
          f"a micro_batches that divides {rows // k}, or a larger batch.")
    # Rows sharded over the compiler's axes: micro-batch m takes rows m,
    # m + micro_batches, ..., so that each device keeps its share of each.
    x = x.reshape((rows // micro_batches, micro_batches) + x.shape[1:],
                  out_sharding=P(spec[0], None, *spec[1:]))
    return jnp.moveaxis(x, 1, 0)
  def body(total, micro):
    return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None
  micro = jax.tree.map(split, batch)
  first = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
  (value, grads), _ = lax.scan(body, first,
                               jax.tree.map(lambda x: x[1:], micro))
  mean = lambda x: x / micro_batches
  # Each mean gradient fenced off from the update that follows: XLA folds
  # 1/micro_batches into its constants (Lion's 1 - b2) where the update
  # follows in one region (the shard_map door) but not across the plain
  # door's region edge, and the momenta rounded apart.
  return jax.tree.map(mean, value), jax.tree.map(
      lambda g: lax.optimization_barrier(mean(g)) if _differentiable(g)
      else g, grads)


def float_leaves(params: Any) -> list[int]:
  """The indices of the params leaves that get gradients: the others (an
  integer counter) get constant zeros, which would read as differing by
  worker when they come from a per-worker computation."""
  return [i for i, x in enumerate(jax.tree.leaves(params))
          if _differentiable(x)]


def in_region(local, mesh, axis_name, in_specs: tuple, out_specs: tuple,
              out_typed: Callable | None = None) -> Callable:
  """``local``, one worker's function, as a ``jax.shard_map`` manual over
  ``axis_name`` alone: the mesh's other axes stay the compiler's, and each
  worker's update, vote included, runs there as in any ``shard_map`` step
  (the fused kernels too). Both doors vote so: the shard_map door's steps
  that differentiate first, and the plain jitted step's update.

  Where the mesh's other axes are Explicit, it runs with them made Auto
  (``jax.sharding.auto_axes``): a region manual over some axes of an
  Explicit mesh all-gathers its inputs and outputs over the others (jax
  0.10), which would gather every gradient and momentum; ``out_typed``
  (of the arguments) gives the outputs' specs there, and the update is
  told each leaf's placement (``dlion_jax._blocks.placed``)."""
  explicit = _mesh.explicit_axes(mesh, axis_name)

  def region(*args):    # on the mesh in context: Explicit axes made Auto
    return jax.shard_map(
        local, mesh=jax.sharding.get_abstract_mesh() if explicit else mesh,
        in_specs=in_specs, out_specs=out_specs,
        axis_names=set(_mesh.names(axis_name)), check_vma=False)(*args)
  if not explicit:
    return region

  def run(*args):
    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh",
                                                mesh)):
      return jax.sharding.auto_axes(region, axes=explicit,
                                    out_sharding=out_typed(*args))(*args)
  return run


def region_of(closed) -> Any:
  """The jaxpr of the last ``shard_map`` in ``closed`` (a traced step),
  looked for inside calls too (``auto_axes`` wraps one)."""
  found = []
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "shard_map":
        found.append(eqn.params["jaxpr"])
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          walk(inner)
  walk(_drift.open_jaxpr(closed))
  return found[-1]


def mean_of_workers(tree: Any, axis_name) -> Any:
  """``pmean`` of the losses (and aux) over the workers, floats narrower
  than float32 averaged in float32: a closer mean, and XLA:CPU aborts
  compiling a bfloat16 all-reduce in a ``shard_map`` manual over some of
  the mesh's axes only (jaxlib 0.10: "Invalid binary instruction opcode
  copy")."""
  def mean(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return lax.pmean(x, axis_name)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return lax.pmean(x.astype(wide), axis_name).astype(x.dtype)
  return jax.tree.map(mean, tree)


def _rows_error(path, shape, split: str) -> ValueError:
  return ValueError(
      f"batch leaf {jax.tree_util.keystr(tuple(path))} has shape {shape}; "
      f"its leading (global batch) axis must be divisible by {split}.")


def check_batch_rows(batch: Any, n: int, axis_name) -> None:
  """Every leaf of ``batch`` splits into ``n`` workers' rows."""
  for path, x in jax.tree_util.tree_leaves_with_path(batch):
    if not jnp.ndim(x) or jnp.shape(x)[0] % n:
      raise _rows_error(path, jnp.shape(x),
                        f"the {n} workers of axis {axis_name!r}")


def worker_rows(x: jax.Array, n: int, axis_name, path=(),
                groups: tuple[str, ...] = ()) -> jax.Array:
  """Batch leaf ``x`` (at ``path``) as ``[n, rows of a worker, ...]``, the
  workers on ``axis_name`` and each worker's rows placed as they were;
  with ``groups`` (mesh axes), ``[n, k, rows of a device, ...]``, a
  worker's rows split over the ``k`` devices of ``groups``."""
  k = _mesh.mesh_size(groups) if groups else 1
  if not x.ndim or x.shape[0] % (n * k):
    split = (f"the {n} workers of axis {axis_name!r}" if k == 1 else
             f"{n} workers x {k} devices (axis {axis_name!r} and "
             f"rows_over={groups!r}; pass rows_over=() to differentiate a "
             "worker's rows whole)")
    raise _rows_error(path, x.shape, split)
  spec = tuple(getattr(jax.typeof(x).sharding, "spec", None) or ())
  if groups:
    out = P(axis_name, _mesh.entry(groups), None, *spec[1:])
    shape = (n, k, x.shape[0] // (n * k)) + x.shape[1:]
  else:
    first = spec[0] if spec and spec[0] is not None else ()
    rest = tuple(a for a in _mesh.names(first)
                 if a not in _mesh.names(axis_name))
    out = P(axis_name, _mesh.entry(rest), *spec[1:])
    shape = (n, x.shape[0] // n) + x.shape[1:]
  if _mesh.explicit(out):
    return x.reshape(shape, out_sharding=out)
  return _mesh.place(x.reshape(shape), out)


def axis_dim(spec: P, axis: str, what: str = "leaf") -> int | None:
  """The dimension ``spec`` shards over ``axis`` alone, or None.

  Raises:
    ValueError: ``spec`` shards one dimension over ``axis`` together with
      other axes (a block :func:`node_mean_grads` cannot gather or cut).
  """
  for d, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    if axis in names and len(names) > 1:
      raise ValueError(
          f"{what} is sharded {spec}: its dimension {d} over {entry!r}, "
          f"shard_axis={axis!r} with other axes. With shard_axis each leaf "
          f"is cut over {axis!r} alone: place it on its own dimension "
          f"(dl.devices.shard_params(params, mesh, {axis!r})), or drop "
          "shard_axis and let the compiler own that axis.")
    if axis in names:
      return d
  return None


def node_mean(g: jax.Array, axes, k: int, dim: int | None = None, *,
              widen: bool = False) -> jax.Array:
  """The mean of each device's ``g`` over the ``k`` devices of ``axes``
  (manual where this runs): each term scaled by ``1/k``, then summed, one
  reduce-scatter onto dimension ``dim`` (each device gets its block of
  the mean), or an all-reduce where ``dim`` is None. The node mean of
  both doors (``make_train_step``'s ``shard_axis``, ``dl.workers``'
  ``rows_over``). (Scaled after the sum, XLA folds ``1/k`` into the
  constants of the update that follows, e.g. Lion's ``1 - b2``, and the
  momentum rounds otherwise than the mean's definition says.) ``widen``
  sums narrower floats in float32: XLA:CPU (jaxlib 0.10) aborts compiling
  a bfloat16 all-reduce or reduce-scatter in a region manual over some of
  the mesh's axes only ("Invalid binary instruction opcode copy")."""
  narrow = g.dtype
  g = g * np.dtype(narrow).type(1 / k)
  if widen:
    g = g.astype(jnp.promote_types(narrow, jnp.float32))
  if dim is None:
    return lax.psum(g, axes).astype(narrow)
  return lax.psum_scatter(g, axes, scatter_dimension=dim,
                          tiled=True).astype(narrow)


def node_mean_grads(grad_fn: Callable, mesh, *, axis_name: str,
                    shard_axis: str, param_dims: list, grad_dims: list,
                    ) -> Callable:
  """``grad_fn`` data parallel over ``shard_axis``, reduced inside a node.

  A region manual over ``axis_name`` and ``shard_axis`` (the mesh's other
  axes stay the compiler's): each device gathers whole params over
  ``shard_axis`` (those sharded over it at rest), runs
  ``grad_fn(params, its batch rows)`` and takes its block of the node's
  mean gradient in one reduce-scatter per leaf: the sum over
  ``shard_axis`` of each device's gradient times ``1/k``
  (:func:`node_mean`). JAX's FSDP recipe with ``shard_map``,
  written out so that the fast links carry one all-gather and one
  reduce-scatter whatever the model: left to the compiler, an unannotated
  model may run the node's whole batch on every device or gather each
  weight once per use.

  Args:
    grad_fn: ``(params, batch) -> (value, grads)`` on one device's rows,
      ``grads`` a list of floating-point arrays; it may reduce ``value``
      over ``shard_axis`` (bound inside).
    mesh: the mesh.
    axis_name: the nodes' axis (the vote's).
    shard_axis: the fast axis whose devices split a node's batch.
    param_dims: for each params leaf (``jax.tree.leaves`` order), the
      dimension it is sharded on over ``shard_axis`` at rest, or None.
    grad_dims: for each gradient, the dimension its mean is cut on over
      ``shard_axis``, or None (each device gets the whole mean: an
      all-reduce, for leaves no dimension of which ``k`` divides).

  Returns:
    ``f(params, batch) -> (value, grads)``, both with a leading axis of the
    nodes (sharded over ``axis_name``), the grads' blocks over
    ``shard_axis`` as ``grad_dims`` says. ``batch`` leaves are split over
    both axes on their first dimension.
  """
  k = mesh.shape[shard_axis]
  spec = lambda d: P() if d is None else P(*[None] * d, shard_axis)
  widen = (len(mesh.axis_names) > 2
           and getattr(mesh.devices.flat[0], "platform", None) == "cpu")

  def mean(g, d):
    typed = getattr(jax.typeof(g).sharding, "spec", None)
    if d is None or typed is None or not _mesh.spec_axes(typed):
      return node_mean(g, shard_axis, k, d, widen=widen)
    # JAX 0.10 cannot lower a reduce-scatter of an array typed on Explicit
    # axes in a partly manual region; under auto_axes it is untyped.
    return jax.sharding.auto_axes(
        lambda g: node_mean(g, shard_axis, k, d, widen=widen),
        axes=tuple(_mesh.spec_axes(typed)), out_sharding=typed)(g)

  def local(params, batch):
    leaves, treedef = jax.tree.flatten(params)
    whole = treedef.unflatten([
        x if d is None else lax.all_gather(x, shard_axis, axis=d, tiled=True)
        for x, d in zip(leaves, param_dims)])
    value, grads = grad_fn(whole, batch)
    grads = [mean(g, d) for g, d in zip(grads, grad_dims)]
    return jax.tree.map(lambda x: x[None], (value, grads))

  def run(params, batch):
    treedef = jax.tree.structure(params)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(treedef.unflatten([spec(d) for d in param_dims]),
                  P((axis_name, shard_axis))),
        out_specs=(P(axis_name), [P(axis_name, *spec(d)) for d in grad_dims]),
        axis_names={axis_name, shard_axis}, check_vma=False)(params, batch)
  return run


def check_leading_axis(tree: Any, n: int, what: str, wants: str,
                       fix: str, pmap: bool = False) -> None:
  """Raises a ValueError naming the first leaf without a leading axis n
  (and, for an injected hyperparameter, how to set one)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = np.shape(leaf)
    if not shape or shape[0] != n:
      name = _hyperparameter(path)
      raise ValueError(
          f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
          f"{shape}; the step wants {wants} on a leading axis of size {n}. "
          + (fix if name is None else _set_hyperparameter(name, n, pmap)))


def _hyperparameter(path) -> str | None:
  """The name of the :func:`optax.inject_hyperparams` hyperparameter at
  ``path`` in a state, or None."""
  keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
  for field, key in zip(keys, keys[1:]):
    if field == "hyperparams":
      return key
  return None


def _set_hyperparameter(name: str, n: int, pmap: bool) -> str:
  value = f"state.hyperparams[{name!r}]"
  how = (f"{value} = jnp.full_like({value}, new_value)" if pmap else
         f"value = {value}; {value} = jax.device_put(jnp.full_like(value, "
         "new_value), value.sharding)")
  return (
      f"It is the hyperparameter {name!r} of optax.inject_hyperparams, "
      f"which every worker's state holds, one row per worker ({n}): set "
      + ("every row: " if pmap else
         "every row, keeping the leaf's sharding: ") + how + ".")


def check_worker_states(state: Any, n: int, devices: int) -> None:
  """Raises a ValueError naming the first state leaf not stacked for the
  ``n`` workers of the step, and the call that builds the state (a state
  with a row per device of the mesh was built for a step whose workers
  are every device)."""
  rows = {np.shape(x)[0] for x in jax.tree.leaves(state) if np.ndim(x)}
  fix = ("Build it with parallel.init_worker_states(tx, params, mesh), "
         "not tx.init(params).")
  if devices != n and rows == {devices}:
    fix = (f"It has a row per device of the mesh ({devices}); this step's "
           f"workers are the {n} rows of the data axis, each voting for "
           "its node. " + fix)
  check_leading_axis(state, n, "optimizer state",
                     "every worker's state stacked", fix)


def check_shard_axis(axis_name, shard_axis, mesh: Mesh) -> None:
  """Raises a ValueError naming ``axis_name`` or ``shard_axis`` where it
  is not an axis of ``mesh``, or where they are the same axis."""
  axis_size(mesh, axis_name)
  if shard_axis is None:
    return
  if isinstance(axis_name, tuple):
    raise ValueError(
        f"shard_axis={shard_axis!r} with axis_name={axis_name!r}, a tuple of "
        "axes: the step with shard_axis votes over one mesh axis of nodes. "
        "Make the nodes one axis of the mesh (reshape the device array), or "
        "drop shard_axis.")
  if shard_axis == axis_name:
    raise ValueError(
        f"shard_axis={shard_axis!r} is also axis_name={axis_name!r}: the "
        "votes cross axis_name and each node's batch is split over "
        "shard_axis, two different axes of the mesh. Pass the mesh's other "
        "axis (dl.devices.hybrid_mesh names them 'data' and 'fsdp'), or drop "
        "shard_axis.")
  axis_size(mesh, shard_axis, name="shard_axis")


def init_worker_states(tx: optax.GradientTransformation, params: Any,
                       mesh: Mesh, *, axis_name: str = "data",
                       shard_axis: str | None = None) -> Any:
  """``tx.init(params)`` for every worker, stacked and sharded over the axis.

  Args:
    tx: the optimizer.
    params: the params, replicated or sharded over the mesh's other axes
      (:func:`~dlion_jax.devices.shard_params`): each momentum is sharded
      like its param.
    mesh: the device mesh.
    axis_name: the data-parallel axis the optimizer votes over.
    shard_axis: a fast axis to shard the state over as well (ZeRO-2 for
      :func:`make_train_step`'s ``shard_axis``): each momentum not sharded
      over it already is cut over it as
      :func:`~dlion_jax.devices.shard_params` would cut its param.

  Returns:
    The state pytree with a leading axis of size ``N`` on every leaf,
    placed so that worker ``i`` holds row ``i``.
  """
  check_shard_axis(axis_name, shard_axis, mesh)
  _placement.check_not_over(params, axis_name)
  init = jax.shard_map(
      lambda p: jax.tree.map(lambda x: x[None], tx.init(p)), mesh=mesh,
      in_specs=P(), out_specs=P(axis_name),
      axis_names=set(_mesh.names(axis_name)), check_vma=False)
  try:
    shardings = state_shardings(tx, jax.eval_shape(init, params), params,
                                mesh, axis_name, shard_axis=shard_axis)
  except (ValueError, TypeError):
    # A state optax cannot map param-shaped leaves of: the compiler places
    # it (Explicit axes still shard each momentum like its param).
    shardings = None
  return jax.jit(init, out_shardings=shardings)(params)


def state_shardings(tx: optax.GradientTransformation, state: Any,
                    params: Any, mesh: Mesh, axis_name: str = "data", *,
                    shard_axis: str | None = None) -> Any:
  """Where :func:`init_worker_states` places the stacked ``state`` (its
  shapes suffice): each row on its worker's devices of ``axis_name``, a
  leaf shaped like a param (a momentum) sharded over the other axes as the
  param is (``params'`` ``NamedSharding``s),
  and with a ``shard_axis`` each momentum cut over that axis too.

  Raises:
    ValueError: a param sharded over ``axis_name`` itself (the workers
      each hold every param; a momentum cannot be split over them twice).
  """
  if shard_axis is not None:
    params = _placement.cut_over(params, mesh, shard_axis)
  _placement.check_not_over(params, axis_name)
  specs = jax.tree.map(lambda x: _mesh.spec_on(x, mesh), params)
  return jax.tree.map(
      lambda spec: NamedSharding(mesh, spec),
      state_specs(tx, state, params, specs, axis_name),
      is_leaf=lambda x: isinstance(x, P))


def state_specs(tx: optax.GradientTransformation, state: Any, params: Any,
                specs: Any, axis_name) -> Any:
  """Where each worker's row of the stacked ``state`` lies, the one rule of
  both doors' per-worker state: each row on its worker's devices of
  ``axis_name``, and a leaf shaped like a param (a momentum) sharded over
  the mesh's other axes as ``specs`` (a ``PartitionSpec`` a params leaf)
  says its param is: ``P(axis_name, *spec)``; other leaves
  ``P(axis_name)``. ``optax.masked``'s holes stay holes."""
  def like(leaf, param=None, spec=None):
    if isinstance(leaf, optax.MaskedNode):
      return leaf
    if param is not None and np.shape(leaf)[1:] == np.shape(param):
      return P(axis_name, *(spec or ()))
    return P(axis_name)
  return optax.tree_utils.tree_map_params(
      tx, like, state, params, specs, transform_non_params=like,
      is_leaf=lambda x: isinstance(x, (optax.MaskedNode, P)))


def worker_states(tx: optax.GradientTransformation, params: Any, n: int,
                  axis_name, specs: Any) -> Any:
  """``tx.init(params)`` stacked for ``n`` workers and placed on the
  enclosing mesh by :func:`state_specs` (``specs``, each param's spec
  over the other axes): the state of ``dl.workers.stacked(tx)``, traced or
  not; :func:`init_worker_states` places the same rows for a mesh."""
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)),
                       tx.init(params))
  try:
    layout = state_specs(tx, state, params, specs, axis_name)
  except (ValueError, TypeError):   # a state optax cannot map
    layout = jax.tree.map(lambda _: P(axis_name), state)
  return jax.tree.map(
      lambda x, spec: _mesh.place(x, P(*spec, *(None,) * (
          x.ndim - len(spec)))), state, layout,
      is_leaf=lambda x: isinstance(x, P))


def refuse_local_steps(state: Any, where: str) -> None:
  """Raises a ValueError naming the step that runs local steps where
  ``where`` (a step holding one copy of the params) cannot."""
  if rounds.has_local_steps(state):
    raise ValueError(
        f"{where} holds one copy of the params for every worker, but the "
        "optimizer runs local steps (dl.local_steps), whose workers each "
        "train their own: build the step with dl.parallel.make_train_step("
        "loss_fn, tx, mesh, params_per_worker=True) (in a plain jitted "
        "step: dl.workers.value_and_grad and dl.workers.update with "
        "params_per_worker=True) and params from "
        "dl.devices.stack_for_workers(params, mesh).")

def anchor_flags(state: Any) -> Any:
  """``state`` with True at the leaves of a :class:`LocalStepsState`'s
  anchor and False elsewhere (what must be the same on every worker)."""
  def flags(x):
    if isinstance(x, rounds.LocalStepsState):
      return jax.tree.map(lambda _: False, x)._replace(
          anchor=jax.tree.map(lambda _: True, x.anchor))
    return jax.tree.map(lambda _: False, x)
  return jax.tree.map(flags, state,
                      is_leaf=lambda x: isinstance(x, rounds.LocalStepsState))


def typed_key(leaf) -> bool:
  """Whether ``leaf`` holds typed PRNG keys (``jax.random.key``, what
  ``nnx.Rngs`` holds), one or an array of them."""
  return jax.dtypes.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key)


def own_key(key: jax.Array, index) -> jax.Array:
  """``key`` (a typed PRNG key, or an array of them) folded with a worker's
  (or a device's) ``index``: from one key each worker draws its own
  dropout masks, the same in every run. Both doors fold keys so."""
  if not np.ndim(key):
    return jax.random.fold_in(key, index)
  return jax.vmap(jax.random.fold_in, (0, None))(
      key.reshape(-1), index).reshape(np.shape(key))


def check_placement_known(params: Any, mesh, axis_name, where: str,
                          fix: str) -> None:
  """Raises where per-worker state is built from params traced on Auto axes
  that partition the mesh beside the workers' (``where``: a ``jax.jit``
  of the caller's): there a traced param does not say how it lies, and
  every momentum would be replicated over those axes (4x its memory on a
  2 x 4 FSDP mesh, and the step sending 114 bits a parameter over
  ``fsdp`` where 42 do). ``fix``: how to tell the placement."""
  auto = tuple(a for a in _mesh.auto_axes(mesh)
               if a not in _mesh.names(axis_name))
  unknown = [x for x in jax.tree.leaves(params)
             if isinstance(x, jax.core.Tracer) and not _mesh.named(
                 _mesh.spec_of(x))]
  if auto and unknown:
    raise ValueError(
        f"{where} is traced (inside a jax.jit or jax.eval_shape) on the "
        f"mesh's Auto axes {auto}, where a traced param does not say how it "
        "is placed: "
        "each momentum would be replicated over them, and the vote would "
        f"cut the params as it guesses. {fix}; or call it on the arrays "
        "themselves (outside the jit), or use Explicit axes.")


# The checks by cause: new params or an anchor that would differ from
# worker to worker, read off one worker's traced update (dlion_jax._drift).


def drifting_leaves(jaxpr, params: Any, num_batch_leaves: int,
                     axis_name) -> list[tuple[int, str]]:
  """The params leaves (index, key path) whose new value (the first
  outputs of ``jaxpr``, one worker's step) varies over ``axis_name`` (an
  axis or a tuple of them) when the batch (its last ``num_batch_leaves``
  inputs) does; empty leaves cannot drift."""
  axes = frozenset(_mesh.names(axis_name))
  inputs = _drift.open_jaxpr(jaxpr).invars
  fixed = len(inputs) - num_batch_leaves
  new = _drift.varying_outputs(
      jaxpr, [frozenset()] * fixed + [axes] * num_batch_leaves)
  outvars = _drift.open_jaxpr(jaxpr).outvars
  return [(i, jax.tree_util.keystr(path) or "<root>")
          for i, ((path, _), varies, var) in enumerate(zip(
              jax.tree_util.tree_leaves_with_path(params), new, outvars))
          if varies & axes and math.prod(var.aval.shape)]

def drift_error(jaxpr, params: Any, drifting: list[tuple[int, str]],
                 axis_name, num_workers, state: Any) -> ValueError:
  """Why the new params ``drifting`` differ by worker, and the fix: an
  optimizer that exchanges nothing for them, or one whose update is taken
  per worker after the exchange (:func:`optax.apply_if_finite`'s
  decision)."""
  leaves = [name for _, name in drifting]
  named = ", ".join(leaves[:4]) + (
      f" and {len(leaves) - 4} more" if len(leaves) > 4 else "")
  count = f"{len(leaves)} of {len(jax.tree.leaves(params))}"
  exchanged = _drift.exchanged_outputs(
      jaxpr, frozenset(_mesh.names(axis_name)))
  if not any(exchanged[i] for i, _ in drifting):
    return ValueError(
        f"The optimizer exchanges nothing over axis {axis_name!r} for params "
        f"leaves {named} ({count}): each of its {num_workers} workers would "
        "apply an update to them computed from its own batch alone, and the "
        "replicated params would silently differ from worker to worker. "
        "Build the optimizer that updates them with "
        f"axis_name={axis_name!r} (e.g. dl.distributed_lion(lr, "
        f"axis_name={axis_name!r}), inside optax.masked, "
        "optax.multi_transform and dl.apply_if_finite too), or chain a "
        "global optimizer after "
        f"dl.transforms.pmean_gradients({axis_name!r}). A psum of a scalar (a "
        "global gradient norm, a token count, a finite flag) does not make "
        "the workers' updates equal." + _checks.masked_note(
            params, state, leaves))
  what = (f"The optimizer exchanges over axis {axis_name!r}, but params "
          "leaves "
          f"{named} ({count}) would still silently differ between its "
          f"{num_workers} workers")
  if any(isinstance(x, optax.ApplyIfFiniteState) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState))):
    return ValueError(
        f"{what}: optax.apply_if_finite decides from each worker's own "
        "gradients whether that worker applies the voted update, so a "
        "non-finite gradient on one worker splits the workers (in a "
        "shard_map it also leaves the vote's collectives to the others). "
        "Wrap the optimizer in dl.apply_if_finite(tx, "
        f"max_consecutive_errors, axis_name={axis_name!r}) instead of "
        "optax.apply_if_finite: it all-reduces the finiteness flag, so "
        "every worker skips a step together.")
  return ValueError(
      f"{what}: their new values depend on each worker's own batch after "
      "the exchange (a value or a decision taken per worker and applied "
      "after the vote, an extra argument of tx.update given each worker's "
      "own by per_worker_args among them, or an exchange among groups of "
      "the workers only, axis_index_groups). Apply after the exchange only "
      "what every worker computes alike, or reduce the per-worker value "
      f"over all the workers first (e.g. jax.lax.pmean over {axis_name!r}; "
      "one value for all: leave it out of per_worker_args).")

def check_no_drift(jaxpr, params: Any, num_varying: int, axis_name,
                    num_workers, state: Any = None) -> None:
  """Raises unless every new params leaf is equal on all workers: each must
  come from an exchange of its own update (or a reduction of its own
  gradient) over ``axis_name``. The last ``num_varying`` inputs of
  ``jaxpr`` (the batch, or each worker's gradients) differ by worker;
  ``state`` (the optimizer's) names the cause."""
  drifting = drifting_leaves(jaxpr, params, num_varying, axis_name)
  if drifting:
    raise drift_error(jaxpr, params, drifting, axis_name, num_workers,
                       state)


def anchor_error(named: str, state: Any, axis_name,
                 exchanges: bool = False) -> ValueError:
  """Why local steps' anchor (the state leaves ``named``) would differ from
  worker to worker after a round, and the fix (``exchanges``: whether the
  round's update exchanges arrays over ``axis_name`` at all)."""
  finite = any(isinstance(x, optax.ApplyIfFiniteState) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ApplyIfFiniteState)))
  masked = None      # the anchor's leaves an optax.masked leaves out
  local = lambda x: isinstance(x, rounds.LocalStepsState)
  for x in jax.tree.leaves(state, is_leaf=local) if exchanges else ():
    left_out = _checks.masked_out(x.anchor, x.outer_state) if local(
        x) else None
    if left_out is not None:
      masked = (masked or []) + left_out
  return ValueError(
      f"dl.local_steps: the anchor (state leaves {named}) would differ "
      "from worker to worker after a round: "
      + ("optax.apply_if_finite decides from each worker's own gradients "
         "whether it applies the round's outer step. Wrap the optimizer in "
         f"dl.apply_if_finite(tx, max_consecutive_errors, "
         f"axis_name={axis_name!r}) instead, which decides alike."
         if finite else _checks.masked_cause(masked, axis_name)
         if masked is not None else
         f"the outer optimizer exchanges nothing over axis {axis_name!r} "
         "(or applies a per-worker value after its exchange). Build it with "
         f"axis_name={axis_name!r}: dl.distributed_lion(lr, "
         f"axis_name={axis_name!r}, weight_decay=0.0) or "
         f"dl.rounds.nesterov_outer(lr, axis_name={axis_name!r})."))


def check_anchor_alike(jaxpr, params, state, batch, axis_name) -> None:
  """Raises unless every anchor leaf of the new state is equal on all
  workers, given per-worker params and batch (the region's last inputs,
  after the constants it closes over) and a state alike on all."""
  axes = frozenset(_mesh.names(axis_name))
  n_params, n_state, n_batch = (len(jax.tree.leaves(t))
                                for t in (params, state, batch))
  consts = len(_drift.open_jaxpr(jaxpr).invars) - n_params - n_state - n_batch
  varying = _drift.varying_outputs(
      jaxpr, [frozenset()] * consts + [axes] * n_params
      + [frozenset()] * n_state + [axes] * n_batch)
  new_state = varying[n_params:n_params + n_state]
  flags = jax.tree.leaves(anchor_flags(state))
  drifting = [jax.tree_util.keystr(path) for (path, _), flag, axes_ in zip(
      jax.tree_util.tree_leaves_with_path(state), flags, new_state)
              if flag and axes_ & axes]
  if not drifting:
    return
  named = ", ".join(drifting[:3]) + (
      f" and {len(drifting) - 3} more" if len(drifting) > 3 else "")
  raise anchor_error(named, state, axis_name,
                     _drift.exchanges_over(jaxpr, axes))
