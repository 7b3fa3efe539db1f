"""Where each leaf, its momentum and the batch live: the spec arithmetic of
the steps of :mod:`dlion_jax.parallel`.

A param's placement over the compiler's axes (its ``NamedSharding``'s
spec); its momentum's (each worker's row of the stacked state placed like
the param, or cut over a ``shard_axis`` as
:func:`dlion_jax.devices.shard_params` would cut it, for ZeRO-2), checked
against the param's; the blocks each leaf's gradient and vote take; and
the calls that return the new params and state placed as they came in (on
Auto axes the compiler would pick a placement of its own).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _blocks
from dlion_jax import _mesh


def cut_over(params: Any, mesh: Mesh, shard_axis: str) -> Any:
  """``params`` as abstract arrays, each leaf not sharded over
  ``shard_axis`` placed over it as :func:`dlion_jax.devices.shard_params`
  would (its largest dimension the axis divides not sharded otherwise):
  where :func:`dlion_jax.parallel.init_worker_states` puts a ZeRO-2
  state."""
  k = mesh.shape[shard_axis]
  def cut(x):
    spec = _mesh.spec_on(x, mesh)
    if shard_axis not in _mesh.spec_axes(spec):
      spec = _mesh.fsdp_spec(np.shape(x), k, shard_axis, placed=spec)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x),
                                sharding=NamedSharding(mesh, spec))
  return jax.tree.map(cut, params)


def check_not_over(params: Any, axis_name: str) -> None:
  """Raises a ValueError naming a params leaf sharded over the vote's axis
  (each worker holds every param)."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    sharding = getattr(x, "sharding", None)
    if (isinstance(sharding, NamedSharding)
        and axis_name in _mesh.spec_axes(sharding.spec)):
      raise ValueError(
          f"params leaf {jax.tree_util.keystr(path)} is sharded "
          f"{sharding.spec}, over axis_name={axis_name!r}, the axis the "
          "workers vote over: each worker holds every param. Shard params "
          "over the mesh's other axes only (dl.devices.shard_params(params, "
          f"mesh, axis_name=...) with an axis other than {axis_name!r}), or "
          "vote over another axis. (Params stacked per worker for local "
          "steps? init_worker_states takes one worker's params: build the "
          "state first, then dl.devices.stack_for_workers(params, mesh).)")


def _ids(mesh) -> list[int]:
  return np.asarray(mesh.device_ids).ravel().tolist()


def _same_mesh(a, b) -> bool:
  return (a.shape_tuple == b.shape_tuple
          and np.array_equal(a.device_ids, b.device_ids))


class OutputsPlacedLikeInputs:
  """A step built for the placement of its params and state over the
  compiler's axes (``build((params' specs, placement), out_shardings)``,
  ``placement`` :func:`placement`'s, read off ``tx``'s state), one
  compilation per placement; traced arguments get the plain ``jitted``.

  The new params and state keep the caller's shardings (on Auto axes the
  compiler would pick its own: replicated params come back sharded), and
  the optimizer update is told how they are placed, each leaf voted in its
  blocks (:func:`blocks`).
  """

  def __init__(self, build: Callable, jitted: Callable, mesh: Mesh, tx, *,
               check_placement: bool = True, params_per_worker: bool = False):
    functools.update_wrapper(self, jitted)
    self._build, self._jitted, self._mesh, self._tx = build, jitted, mesh, tx
    self._check = check_placement
    self._params_per_worker = params_per_worker
    self._by_placement = {}

  def _for(self, params, state) -> Callable:
    leaves = jax.tree_util.tree_leaves_with_path({"params": params,
                                                  "state": state})
    shardings = [getattr(x, "sharding", None) for _, x in leaves]
    for (path, _), s in zip(leaves, shardings):
      if isinstance(s, NamedSharding) and not _same_mesh(s.mesh, self._mesh):
        raise ValueError(
            f"{jax.tree_util.keystr(path)} is placed on the mesh "
            f"{dict(s.mesh.shape)} (devices {_ids(s.mesh)}), not on the "
            f"step's {dict(self._mesh.shape)} (devices {_ids(self._mesh)}). "
            "Place params and "
            "state on the mesh given to make_train_step: "
            "dl.devices.replicate(params, mesh) or dl.devices.shard_params("
            "params, mesh), and parallel.init_worker_states(tx, params, "
            "mesh).")
    if not all(isinstance(s, NamedSharding) for s in shardings):
      return self._jitted
    treedef = jax.tree.structure((params, state))
    key = (treedef, tuple(shardings))
    if key not in self._by_placement:
      placed = jax.tree.unflatten(treedef, shardings)
      specs = jax.tree.map(lambda s: s.spec, placed)
      row = lambda tree: jax.tree.map(lambda spec: P(*spec[1:]), tree,
                                      is_leaf=lambda x: isinstance(x, P))
      # A worker's own: a row of the state (and of per-worker params).
      specs = (row(specs[0]) if self._params_per_worker else specs[0],
               specs[1])
      if self._check:
        check_placement(self._tx, specs, self._mesh)
      rows = (specs[0], row(specs[1]))
      self._by_placement[key] = self._build(
          (rows[0], placement(self._tx, *rows)),
          placed + (NamedSharding(self._mesh, P()),))
    return self._by_placement[key]

  # ``*extra``: optax's extra arguments, or nothing, so that a compiled
  # step is called with what it was lowered with (as ``jax.jit``'s is).
  def trace(self, params, state, batch, *extra):
    return self._for(params, state).trace(params, state, batch, *extra)

  def lower(self, params, state, batch, *extra):
    return self._for(params, state).lower(params, state, batch, *extra)

  def __call__(self, params, state, batch, *extra):
    return self._for(params, state)(params, state, batch, *extra)

  def __getattr__(self, name):
    return getattr(self._jitted, name)


def placement(tx, params_specs: Any, state_specs: Any) -> dict[str, P]:
  """For each params leaf (by key path), the most sharded of its own
  placement and that of the state leaves shaped like it (a ZeRO-2
  momentum): how the optimizer update is to cut it
  (``dlion_jax._blocks.placed``)."""
  out = {}
  def note(spec, param_spec, path):
    best = out.get(path, param_spec)
    if isinstance(spec, P) and len(_mesh.spec_axes(spec)) > len(
        _mesh.spec_axes(best)):
      best = spec
    out[path] = best
  _each_param_leaf(tx, note, params_specs, params_specs)
  _each_param_leaf(tx, note, state_specs, params_specs)   # else params only
  return out


def _each_param_leaf(tx, fn: Callable, state_specs: Any,
                     params_specs: Any) -> bool:
  """``fn(state spec, param spec, param key path)`` for every leaf of the
  state shaped like a param (``state_specs`` may be the params' own);
  False where optax cannot tell those leaves."""
  paths = jax.tree_util.tree_map_with_path(
      lambda path, _: _blocks.path_key(path), params_specs,
      is_leaf=lambda x: isinstance(x, P))
  if state_specs is params_specs:
    jax.tree.map(fn, state_specs, params_specs, paths,
                 is_leaf=lambda x: isinstance(x, P))
    return True
  try:
    optax.tree_utils.tree_map_params(
        tx, fn, state_specs, params_specs, paths,
        transform_non_params=lambda _: None,
        is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)))
  except (ValueError, TypeError):
    return False
  return True


def check_placement(tx, specs: Any, mesh: Mesh) -> None:
  """Raises a ValueError naming a state leaf sharded over the mesh's
  Explicit axes otherwise than its param, unless the param is whole (a
  ZeRO-2 state): optax would add them, a sharding type error."""
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit}
  params_specs, state_specs = specs
  conflicts = []
  def check(spec, param_spec, path):
    if not isinstance(spec, P):
      return
    mine, theirs = P(*spec[1:]), param_spec
    pad = max(len(mine), len(theirs))
    if (_mesh.spec_axes(theirs) & explicit
        and _mesh.spec_axes(mine) & explicit
        and tuple(mine) + (None,) * (pad - len(mine))
        != tuple(theirs) + (None,) * (pad - len(theirs))):
      conflicts.append((path, mine, theirs))
  _each_param_leaf(tx, check, state_specs, params_specs)
  if conflicts:
    path, mine, theirs = conflicts[0]
    raise ValueError(
        f"The optimizer state's leaf for params {_blocks.key_name(path)} is "
        f"sharded {mine} "
        f"but the param is sharded {theirs} (Explicit axes): the optimizer "
        "would add arrays sharded differently. Build the state from the "
        "params as you place them: parallel.init_worker_states(tx, params, "
        "mesh), or from dl.devices.shard_params(params, mesh) for whole "
        "params and a sharded state (ZeRO-2).")


def blocks(placed, params: Any, mesh: Mesh, shard_axis: str | None):
  """Each params leaf's spec, and by key path the blocks its gradient and
  vote take: from ``placed`` (the params' specs and :func:`placement`'s,
  the most sharded of each param's and its state's placement, given by
  :class:`OutputsPlacedLikeInputs`), else from the leaves' types; cut over
  ``shard_axis`` (if any) as :func:`dlion_jax.devices.shard_params` would
  where neither is."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if placed is None:
    param_specs = [getattr(jax.typeof(x).sharding, "spec", None) or P()
                   for _, x in leaves]
    merged = {_blocks.path_key(p): s
              for (p, _), s in zip(leaves, param_specs)}
  else:
    param_specs = jax.tree.leaves(placed[0],
                                  is_leaf=lambda x: isinstance(x, P))
    merged = placed[1]
  if shard_axis is None:
    return param_specs, merged
  k = mesh.shape[shard_axis]
  blocks = {}
  for path, x in leaves:
    key = _blocks.path_key(path)
    spec = merged[key]
    if shard_axis not in _mesh.spec_axes(spec):
      spec = _mesh.fsdp_spec(x.shape, k, shard_axis, placed=spec)
    blocks[key] = spec
  return param_specs, blocks


class PlacedCall:
  """:func:`dlion_jax.parallel.per_worker`'s function. Called on arrays it
  is jitted, once a placement of its arguments, with each output that
  updates an argument (the same pytree of the same shapes) placed as that
  argument. On the mesh's Auto axes the compiler would otherwise pick its
  own placement for the new params and state (replicated params come back
  sharded). Traced inside a caller's ``jax.jit`` it is the mapped function,
  told the params' ``placement`` where Auto axes partition the mesh beside
  the workers' (refused without it: nothing there says how the arguments
  lie)."""

  def __init__(self, make: Callable[[], Callable], mesh: Mesh, axis_name,
               donate_argnums, placement: Any = None,
               replicated: Callable[[tuple], Any] = lambda args: args):
    self._make, self._call = make, make()
    self._replicated = replicated
    functools.update_wrapper(self, self._call)
    self._mesh, self._axis = mesh, axis_name
    self._donate = donate_argnums
    self._placement = placement
    self._jitted = {}

  def __call__(self, *args):
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
      return self._traced(*args)
    return self._for(args)(*args)

  def trace(self, *args):
    return self._for(args).trace(*args)

  def lower(self, *args):
    return self._for(args).lower(*args)

  def _auto_axes(self) -> tuple:
    """The Auto axes beside the workers' that partition the mesh."""
    return tuple(a for a, t in zip(self._mesh.axis_names,
                                   self._mesh.axis_types)
                 if a not in _mesh.names(self._axis) and self._mesh.shape[a] > 1
                 and t == jax.sharding.AxisType.Auto)

  def _traced(self, *args):
    auto = self._auto_axes()
    if not auto:
      return self._call(*args)
    if self._placement is None:
      # Refused only where a vote (or another exchange of the library)
      # would guess a leaf's placement.
      with _blocks.unknown_placement(
          "per_worker's function is traced inside a jax.jit of yours on "
          f"the mesh's Auto axes {auto}, where a traced array does not say "
          "how it is placed: the vote would cut each param as it guesses, "
          "and the compiler would pick the new params' placement itself "
          "(a tensor-parallel P('fsdp', 'model') param came back "
          "P('fsdp',), silently). Pass the params' placement: "
          "parallel.per_worker(..., placement=jax.tree.map(lambda x: "
          "x.sharding.spec, params)) of the concrete params; or call the "
          "function on the arrays themselves (it compiles itself and keeps "
          "each updated argument's placement), or use Explicit axes."):
        return self._make()(*args)
    out = self._told()(*args)
    return _constrained(out, self._replicated(args),
                        _blocks.specs_by_path(self._placement), self._mesh,
                        self._axis)

  def _for(self, args) -> Callable:
    placed = tuple((np.shape(x), getattr(x, "sharding", None))
                   for x in jax.tree.leaves(args))
    key = (jax.tree.structure(args), placed)
    if key not in self._jitted:
      auto = any(t == jax.sharding.AxisType.Auto for a, t in zip(
          self._mesh.axis_names, self._mesh.axis_types)
                 if a not in _mesh.names(self._axis))
      self._jitted[key] = jax.jit(
          self._told(), donate_argnums=self._donate,
          out_shardings=_placed_like(self._call, args) if auto else None)
    return self._jitted[key]

  def _told(self) -> Callable:
    """A fresh map, traced under the ``placement`` given (if any)."""
    call = self._make()
    if self._placement is None:
      return call
    specs = _blocks.specs_by_path(self._placement)
    def placed_call(*args):
      with _blocks.placed(specs):
        return call(*args)
    return placed_call


def _constrained(out: Any, params: Any, specs: dict[tuple, P], mesh: Mesh,
                 axis_name) -> Any:
  """``out`` with each leaf that is a param, or a worker's row of one
  stacked (a momentum), constrained to lie as ``specs`` (by
  :func:`dlion_jax._blocks.path_key`) says.

  A leaf is a param's where its key path ends with the param's and its
  shape is the param's (read off ``params``, the arguments laid out
  ``"replicated"``), or, stacked, the workers' count before it; the rest
  (counts, losses) is left to the compiler."""
  def param_of(path):
    key = _blocks.path_key(path)
    found = [k for k in specs if key[len(key) - len(k):] == k]
    return max(found, key=len) if found else None
  shapes = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = param_of(path)
    if key is not None and specs[key] is not None:
      shapes.setdefault(key, np.shape(x))
  n = _mesh.axis_size(mesh, axis_name)
  def constrain(path, x):
    key = param_of(path)
    if key is None or key not in shapes or specs[key] is None:
      return x
    if np.shape(x) == shapes[key]:
      spec = specs[key]
    elif np.shape(x) == (n,) + shapes[key]:
      spec = P(axis_name, *specs[key])
    else:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(constrain, out)


def _placed_like(fn: Callable, args: tuple) -> Any:
  """For each output of ``fn(*args)`` (each element of a tuple, or the
  one output), the shardings of the first argument of the same pytree
  structure, leaf shapes and dtypes, all of them placed; None for the
  others (the compiler's choice)."""
  out = jax.eval_shape(fn, *args)
  outs = out if isinstance(out, tuple) else (out,)
  def like(o):
    for a in args:
      a_leaves, o_leaves = jax.tree.leaves(a), jax.tree.leaves(o)
      if (jax.tree.structure(a) == jax.tree.structure(o)
          and all(np.shape(x) == y.shape and jnp.result_type(x) == y.dtype
                  and isinstance(getattr(x, "sharding", None),
                                 NamedSharding)
                  for x, y in zip(a_leaves, o_leaves))):
        return jax.tree.map(lambda x: x.sharding, a)
    return None
  placed = tuple(like(o) for o in outs)
  return placed if isinstance(out, tuple) else placed[0]
