"""Leaves cut into shards over the fast mesh axes, so that each device votes
on its own part.

**The compiler's axes** (:func:`compiler_axes`, :func:`on_own_shards`). A
step manual over the data axis only leaves the mesh's other axes to the
compiler; a leaf is sharded over them as its type says. The vote then runs
in a nested region manual over those axes: each device encodes, packs and
exchanges across the data axis only its own block of each leaf, cut once
more over the axes the leaf is replicated on, and gathers the update back
over the fast links. In a plain jitted step whose workers are a
``jax.vmap`` axis (:mod:`dlion_jax.workers`) the same blocks are the rows
of ``[F, width]`` arrays the compiler keeps on their devices
(:class:`BlockCut`).

**Data parallel inside a node** (:func:`node_mean_grads`,
``make_train_step(..., shard_axis=)``). Where a fast axis only splits each
node's batch (the devices of a node each differentiate their own rows),
the gradients are not left to the compiler: each device gathers whole
params, differentiates its rows, and one reduce-scatter per leaf over the
axis leaves it the node's mean gradient on its block of the leaf (ZeRO),
so the fast links carry a reduce-scatter and an all-gather however the
compiler would have partitioned the model. The optimizer then runs on
whole logical leaves as above.

Invariant: a device's block of a leaf holds the same entries on every
node, so an elementwise optimizer (Lion's update, its sign vote across
nodes) computes on the blocks exactly what it would on whole leaves; a
statistic of a whole leaf (Lion Cub's L1 scale, via :class:`LeafShard`)
is the sum over the axes of each block's sum: bit for bit the whole
leaf's sum when the sums are exact, otherwise within its rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Hashable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dlion_jax import _collectives
from dlion_jax import _mesh


class LeafShard(NamedTuple):
  """An array that is one device's shard of a leaf of ``size`` elements cut
  over ``axis_name``: what a whole-leaf statistic (Lion Cub's L1 scale)
  must reduce over to see the whole leaf."""
  axis_name: Hashable
  size: int

  def sum(self, x: jax.Array) -> jax.Array:
    """``x``, each shard's part of a statistic, summed over the shards: a
    ``psum`` over the mesh axes, or over the blocks of
    :func:`dlion_jax.workers.blockwise` (whose ``psum`` JAX cannot batch
    on Explicit axes)."""
    if self.axis_name == _collectives.BLOCKS:
      return _collectives.sum_over_blocks(x)
    return lax.psum(x, self.axis_name)


# The minor dimension of XLA:TPU's tiles.
LANES = 128


def lane_rows(x: jax.Array, rows: int) -> jax.Array:
  """1-D ``x`` zero-padded to a multiple of ``rows`` rows of 128 lanes and
  shaped ``[-1, 128]``: what XLA:TPU gathers across devices as whole
  tiles (the caller cuts the padding off each gathered row)."""
  return jnp.pad(x, (0, -x.size % (rows * LANES))).reshape(-1, LANES)


# Sharded leaves the JAX way: the step is manual over the vote's axis only
# (``jax.shard_map(..., axis_names={axis_name})``) and the compiler owns the
# mesh's other axes, over which each leaf is sharded as its type says.


def compiler_axes(axis_name: Hashable | tuple, leaves=()) -> tuple[str, ...]:
  """The mesh axes the compiler owns where the vote over ``axis_name`` is
  traced: those of the enclosing mesh (or, under a bare ``jax.jit``, of
  the ``leaves``' Explicit shardings) that are not manual. Empty under
  ``pmap``, ``vmap`` alone and a ``shard_map`` manual over every axis.
  Where the workers are a ``jax.vmap`` axis named after mesh axes
  (:mod:`dlion_jax.workers`), the other axes that partition the mesh.

  Raises:
    ValueError: the vote is traced on a mesh without a ``shard_map`` manual
      over ``axis_name`` (e.g. ``jax.vmap(..., axis_name=)`` under
      ``jax.jit`` of sharded arrays), or ``axis_name`` names an axis the
      compiler owns: both would vote on the wrong entries or send several
      times the vote's bytes.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    meshes = [getattr(jax.typeof(x).sharding, "mesh", None) for x in leaves]
    mesh = next((m for m in meshes if m is not None and not m.empty), mesh)
  if mesh.empty:
    return ()
  auto = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if _collectives.mapped_over_mesh(axis_name):
    return _beside_workers(axis_name, mesh, auto)
  partitioned = any(mesh.shape[a] > 1 for a in auto)
  missing = [a for a in names if a not in mesh.axis_names]
  if mesh.manual_axes and missing:
    manual = tuple(mesh.manual_axes)
    manual = manual[0] if len(manual) == 1 else manual
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: the step's workers are "
        f"the devices of {manual!r}, on a mesh whose axes are "
        f"{tuple(mesh.axis_names)}. Build the optimizer with "
        f"axis_name={manual!r}; {missing[0]!r} is no axis of it.")
  mapped = _collectives.mapped_mesh_axes()
  if mapped:
    mapped = mapped[0] if len(mapped) == 1 else mapped
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
      raise ValueError(
          f"The optimizer votes over axis_name={axis_name!r}, but "
          f"{unknown[0]!r} is not an axis of the mesh, whose axes are "
          f"{tuple(mesh.axis_names)}; the workers of this plain jitted step "
          f"are mapped over {mapped!r}: build the optimizer with "
          f"axis_name={mapped!r}.")
    raise ValueError(
        f"The optimizer votes over axis_name={axis_name!r}, but the workers "
        f"of this plain jitted step are mapped over {mapped!r}: "
        "dl.workers.update(tx) and dl.workers.stacked(tx) map them over "
        "axis_name='data' unless told otherwise. Build the optimizer "
        f"with axis_name={mapped!r}, or "
        f"pass axis_name={axis_name!r} to dl.workers.update / stacked / "
        "value_and_grad if the workers are the devices of "
        f"{axis_name!r}.")
  if partitioned and (not mesh.manual_axes
                      or not all(a in mesh.axis_names for a in names)):
    raise ValueError(
        f"The vote over axis_name={axis_name!r} is traced on the mesh "
        f"{dict(mesh.shape)} without a jax.shard_map manual over it (a "
        "jax.vmap axis under jax.jit?): the compiler would partition the "
        "packed votes itself, sending several times the vote's bytes, or "
        "fail. In a plain jitted step, run every worker's update through "
        f"dl.workers.update(tx, axis_name={axis_name!r}) (for an "
        "nnx.Optimizer or a Linen TrainState, build it with "
        f"dl.workers.stacked(tx, axis_name={axis_name!r})), which maps "
        "it over the workers' rows with spmd_axis_name. Or make the data "
        "axis manual and leave the others to the compiler: "
        "jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=..., "
        "axis_names={'data'}) with axis_name='data', as "
        "dl.parallel.make_train_step builds it.")
  owned = [a for a in names if a in auto]
  if owned:
    manual = tuple(mesh.manual_axes)
    manual = manual[0] if len(manual) == 1 else manual
    raise ValueError(
        f"axis_name={axis_name!r} names the mesh axis {owned[0]!r}, which "
        "the compiler owns here: the step's workers are the devices of "
        f"{manual!r}, on a mesh whose axes are {tuple(mesh.axis_names)}, "
        f"and a vote over {owned[0]!r} would add up votes on different "
        f"entries. Build the optimizer with axis_name={manual!r}; or pass "
        f"axis_name={axis_name!r} to the step's builder "
        "(dl.parallel.make_train_step, per_worker, dl.workers.update) if "
        f"the devices of {owned[0]!r} are workers with batches of their "
        "own.")
  return auto


def _beside_workers(axis_name, mesh, auto) -> tuple[str, ...]:
  """The axes beside the workers' that partition the mesh, where the
  workers are a ``jax.vmap`` axis named after mesh axes
  (:mod:`dlion_jax.workers`): each device votes on its own block of every
  leaf over them (:func:`on_own_shards`)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  # An Explicit axis of one device stays: leaves are typed over it.
  return tuple(a for a in auto if a not in names and (
      mesh.shape[a] > 1 or mesh.axis_types[mesh.axis_names.index(a)]
      == jax.sharding.AxisType.Explicit))


def key_name(key: tuple) -> str:
  """A :func:`path_key` as ``jax.tree_util.keystr`` writes a dict's path,
  for messages: ``('up', 'kernel')`` is ``['up']['kernel']``."""
  return "".join(f"[{k!r}]" for k in key)


def path_key(path) -> tuple:
  """A leaf's key path by names alone: a dict's key, a sequence's index or
  an attribute's name alike (a ``flax.nnx.State`` holds an optax state's
  tuples and named tuples as dicts), without the ``.value`` of a variable
  that wraps the leaf (an ``nnx.Param``, an ``nnx.OptState``): how a
  placement (:func:`placed`) is told and looked up, whichever pytree the
  params come in."""
  names = tuple(
      k.key if isinstance(k, (jax.tree_util.DictKey,
                              jax.tree_util.FlattenedIndexKey))
      else k.idx if isinstance(k, jax.tree_util.SequenceKey)
      else k.name if isinstance(k, jax.tree_util.GetAttrKey) else str(k)
      for k in path)
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) \
      and path[-1].name == "value":
    names = names[:-1]
  return names


# Set while dlion_jax.parallel.make_train_step traces the optimizer update
# of a step on Auto axes: each params leaf's placement, by key path.
_PLACED = contextvars.ContextVar("placed", default=None)


@contextlib.contextmanager
def placed(specs: dict[tuple, P]):
  """Marks the optimizer update traced inside as updating leaves placed as
  ``specs`` says (by the params' key paths, :func:`path_key`): on Auto axes
  their types do not say how they are sharded."""
  token = _PLACED.set(specs)
  try:
    yield
  finally:
    _PLACED.reset(token)


# Set where a leaf's placement cannot be known (a function traced inside a
# caller's jax.jit on Auto axes, told no placement): the error to raise
# instead of guessing it.
_UNKNOWN = contextvars.ContextVar("unknown_placement", default=None)


@contextlib.contextmanager
def unknown_placement(error: str):
  """Inside, :func:`leaf_spec` raises ``ValueError(error)`` where it would
  guess how a leaf on Auto axes lies."""
  token = _UNKNOWN.set(error)
  try:
    yield
  finally:
    _UNKNOWN.reset(token)


def specs_by_path(placement: Any) -> dict[tuple, P]:
  """``placement``'s specs (a pytree of ``PartitionSpec``s,
  ``NamedSharding``s or None, e.g. ``jax.tree.map(lambda x:
  x.sharding.spec, params)``; an ``nnx.State`` of them too) by their key
  paths (:func:`path_key`), as :func:`placed` takes them (None: not
  said)."""
  if placement is None:
    return {}
  leaves = jax.tree_util.tree_flatten_with_path(
      placement, is_leaf=lambda x: x is None or isinstance(
          x, (P, jax.sharding.NamedSharding)))[0]
  return {path_key(path): getattr(x, "spec", x) for path, x in leaves}


def check_placement_covers(tree: Any, specs: dict[tuple, P],
                           what: str = "params") -> None:
  """Raises a ValueError naming the first leaf of ``tree`` (the params or
  their gradients) that a given placement does not name."""
  if not specs:
    return
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if path_key(path) not in specs:
      raise ValueError(
          f"placement names no spec for the {what} leaf "
          f"{jax.tree_util.keystr(path)}: give one (a PartitionSpec, or "
          "None) for each params leaf, e.g. placement=jax.tree.map(lambda "
          "x: x.sharding.spec, params) of the concrete params.")


def leaf_spec(x: jax.Array, axes: tuple[str, ...], path: tuple | None = None
              ) -> P:
  """How ``x`` is sharded over the mesh axes ``axes``: read off its type
  on Explicit axes. On Auto axes the type says nothing: the placement of
  the params leaf at ``path`` (:func:`placed`), or else the leaf as
  :func:`dlion_jax.devices.shard_params` places it (its largest dimension
  their devices divide, over all of them): free when it is so placed or
  replicated, a reshard over the fast links otherwise."""
  spec = getattr(jax.typeof(x).sharding, "spec", None) or ()
  def keep(entry):
    names = entry if isinstance(entry, tuple) else (entry,)
    names = tuple(a for a in names if a in axes)
    return None if not names else names if len(names) > 1 else names[0]
  spec = P(*map(keep, spec))
  mesh = jax.sharding.get_abstract_mesh()
  auto = tuple(a for a in axes
               if mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Auto)
  if _mesh.spec_axes(spec) or not auto:
    return spec
  known = (_PLACED.get() or {}).get(path)
  if known is not None and len(known) <= x.ndim:
    return P(*map(keep, known))
  if _UNKNOWN.get() is not None:
    raise ValueError(_UNKNOWN.get())
  return _mesh.fsdp_spec(x.shape, math.prod(mesh.shape[a] for a in auto),
                           auto if len(auto) > 1 else auto[0])


def on_own_shards(fn, trees: tuple, axes: tuple[str, ...],
                  constants: tuple = ()) -> Any:
  """``fn(*trees, leaf_shards=..., constants=...)`` run by each device on its
  own part of every leaf, in a region manual over the compiler's ``axes``.

  A leaf sharded over some of ``axes`` is its device's block; the block is
  flattened and cut once more over the axes it is replicated on (``F``
  devices, zero-padded to ``F`` equal chunks), so the devices of a node
  never vote twice on the same entry and each sends only its chunk's votes
  across the vote's axis. ``fn`` sees 1-D chunks, with a
  :class:`LeafShard` over ``axes`` per leaf (a whole-leaf statistic sums
  over them; padding adds zero), and returns the update of each chunk; the
  chunks are gathered back over the replicated axes (the fast links) and
  the padding cut off. Where the workers are a ``jax.vmap`` axis (no
  manual axes: :mod:`dlion_jax.workers`) there is no region: each leaf is
  laid out as one block a device (:class:`BlockCut`, the same chunks) and
  ``fn`` runs on the blocks under a ``jax.vmap`` of their own
  (:func:`dlion_jax.workers.blockwise`). A leaf's blocks are those of the
  most sharded of its arrays across ``trees`` (a ZeRO-2 momentum beside a
  whole gradient); the result is typed like the first tree's leaf, as an optax
  update must be (``optax.MultiSteps`` puts it in a ``lax.cond`` beside
  zeros of the gradient's type). Traced values ``fn`` needs beside the
  trees (an ``optax.inject_hyperparams`` rate) go in ``constants``: a
  region may not close over values typed on Explicit axes.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(trees[0])
  paths, leaves = [path_key(p) for p, _ in paths], [
      x for _, x in paths]
  columns = list(zip(leaves, *[treedef.flatten_up_to(t) for t in trees[1:]]))
  # The most sharded of a leaf's arrays (a ZeRO-2 momentum beside a whole
  # gradient) sets its blocks: the others are cut to it, not gathered.
  specs = [max((leaf_spec(x, axes, path) for x in column),
               key=lambda spec: len(_mesh.spec_axes(spec)))
           for path, column in zip(paths, columns)]
  sizes = dict(jax.sharding.get_abstract_mesh().shape)
  shards_ = [LeafShard(axes, int(x.size)) for x in leaves]

  def cut(trees):
    """Each tree's 1-D chunk of every leaf, and how to put them back."""
    columns = [treedef.flatten_up_to(t) for t in trees]
    chunks, gathers = [[] for _ in columns], []
    for k, spec in enumerate(specs):
      free = tuple(a for a in axes if a not in _mesh.spec_axes(spec))
      parts = math.prod(sizes[a] for a in free)
      block = columns[0][k]
      width = -(-block.size // parts)
      index = lax.axis_index(free) if free else 0
      for j, column in enumerate(columns):
        flat = jnp.pad(column[k].ravel(), (0, parts * width - block.size))
        chunks[j].append(lax.dynamic_slice_in_dim(flat, index * width, width))
      gathers.append((free if width else (), block.shape))
    return [treedef.unflatten(c) for c in chunks], gathers

  def whole(out, gathers):
    parts = []
    for d, (free, shape) in zip(treedef.flatten_up_to(out), gathers):
      if free:
        d = lax.all_gather(d, free, tiled=True)
      parts.append(d[:math.prod(shape)].reshape(shape))
    return treedef.unflatten(parts)

  def local(constants, *trees):
    chunks, gathers = cut(trees)
    return whole(fn(*chunks, leaf_shards=shards_, constants=constants),
                 gathers)

  if not jax.sharding.get_abstract_mesh().manual_axes:
    # The workers are a jax.vmap axis (dlion_jax.workers): no region.
    cuts = [BlockCut(x.shape, spec, axes, sizes)
            for x, spec in zip(leaves, specs)]
    blocks = [treedef.unflatten([cut.blocks(x) for cut, x in zip(
        cuts, treedef.flatten_up_to(t))]) for t in trees]
    shards_ = [LeafShard(_collectives.BLOCKS, int(x.size)) for x in leaves]
    out = _collectives.blockwise(lambda *trees: fn(
        *trees, leaf_shards=shards_, constants=constants), axes)(*blocks)
    return treedef.unflatten([
        _mesh.typed_like(cut.whole(d), x)
        for cut, d, x in zip(cuts, treedef.flatten_up_to(out), leaves)])
  in_specs = (P(),) + tuple(treedef.unflatten(specs) for _ in trees)
  out = jax.shard_map(local, in_specs=in_specs,
                      out_specs=treedef.unflatten(specs),
                      axis_names=set(axes), check_vma=False)(constants,
                                                             *trees)
  return treedef.unflatten([_mesh.typed_like(d, x) for d, x in zip(
      treedef.flatten_up_to(out), leaves)])


def workers_mean(tree: Any, axis_name, count=None, size: int | None = None):
  """The workers' ``pmean`` of ``tree`` (with ``count``, of the ``count``
  present of ``size``, the absent workers' leaves zero:
  :func:`dlion_jax._collectives.present_mean`), each device averaging
  only its own part of every leaf where the compiler owns axes beside
  ``axis_name`` (:func:`on_own_shards`): a replicated leaf costs the fp32
  all-reduce's bytes, not those of every device of a node sending all of
  it."""
  constants = ()
  mean = lambda x, *_: _collectives.pmean(x, axis_name)
  if count is not None:
    constants = (count,)
    mean = lambda x, count: _collectives.present_mean(x, axis_name, count,
                                                      size)
  axes = compiler_axes(axis_name, jax.tree.leaves(tree))
  if not axes:
    return mean(tree, *constants)
  # A traced count enters the region as a constant.
  return on_own_shards(lambda x, constants, **_: mean(x, *constants),
                       (tree,), axes, constants)


class BlockCut:
  """A leaf of ``shape``, sharded as ``spec`` over the mesh axes ``axes``,
  as one block for each of their devices (``[F, width]``, the blocks over
  ``axes``), where the workers are a ``jax.vmap`` axis and the vote runs
  on the blocks in a ``jax.vmap`` of its own (:func:`on_own_shards`).

  A device's block is its own shard of the leaf, flattened and cut once
  more over the axes the leaf is replicated on (zero-padded to equal
  chunks): :meth:`blocks` moves nothing between devices, and
  :meth:`whole` gathers the chunks back over those axes (the fast links).
  """

  def __init__(self, shape: tuple[int, ...], spec: P, axes: tuple[str, ...],
               sizes: dict[str, int]):
    mesh = jax.sharding.get_abstract_mesh()
    self.explicit = all(
        mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit
        for a in axes)
    self.shape, self.spec, self.axes = tuple(shape), spec, tuple(axes)
    # Each sharded dimension split into a dimension per axis and the rest.
    self.split, self.labels = [], []
    for d, n in enumerate(shape):
      names = _mesh.names(spec[d]) if d < len(spec) else ()
      self.split += [sizes[a] for a in names] + [
          n // math.prod(sizes[a] for a in names)]
      self.labels += list(names) + [None]
    labelled = sorted((i for i, a in enumerate(self.labels) if a),
                      key=lambda i: axes.index(self.labels[i]))
    self.order = labelled + [i for i, a in enumerate(self.labels) if not a]
    self.sharded = [self.labels[i] for i in labelled]
    self.tail = [self.split[i] for i in self.order[len(labelled):]]
    self.free = [a for a in axes if a not in self.sharded]
    self.rest = math.prod(self.tail)
    self.parts = math.prod(sizes[a] for a in self.free)
    self.width = -(-self.rest // self.parts)
    self.lead = self.sharded + self.free
    self.to_axes = sorted(range(len(self.lead)),
                          key=lambda i: axes.index(self.lead[i]))
    self.sizes = sizes

  def _shaped(self, x, shape, labels):
    """``x`` reshaped, its dimensions sharded over ``labels``."""
    spec = P(*labels)
    if self.explicit:
      return x.reshape(shape, out_sharding=spec)
    return lax.with_sharding_constraint(x.reshape(shape), spec)

  def _placed(self, x, labels):
    spec = P(*labels)
    if self.explicit:
      return jax.sharding.reshard(x, spec)
    return lax.with_sharding_constraint(x, spec)

  def blocks(self, x: jax.Array) -> jax.Array:
    """``x`` as ``[F, width]``, block ``i`` on device ``i`` of ``axes``."""
    k = [self.sizes[a] for a in self.sharded]
    y = self._shaped(x, self.split, self.labels).transpose(self.order)
    y = self._shaped(y, k + [self.rest], self.sharded + [None])
    y = jnp.pad(y, [(0, 0)] * len(k) + [(0, self.parts * self.width
                                         - self.rest)])
    y = self._shaped(y, k + [self.sizes[a] for a in self.free] + [self.width],
                     self.sharded + [None] * (len(self.free) + 1))
    y = self._placed(y, self.lead + [None])
    y = y.transpose(self.to_axes + [len(self.lead)])
    return self._shaped(y, (math.prod(self.sizes[a] for a in self.axes),
                            self.width), [self.axes, None])

  def whole(self, b: jax.Array) -> jax.Array:
    """The leaf from its blocks (:meth:`blocks`' inverse)."""
    k = [self.sizes[a] for a in self.sharded]
    y = self._shaped(b, [self.sizes[a] for a in self.axes] + [self.width],
                     list(self.axes) + [None])
    y = y.transpose(list(np.argsort(self.to_axes)) + [len(self.lead)])
    y = self._placed(y, self.sharded + [None] * (len(self.free) + 1))
    y = self._shaped(y, k + [self.parts * self.width], self.sharded + [None])
    y = self._shaped(y[..., :self.rest], k + self.tail,
                     self.sharded + [None] * len(self.tail))
    y = y.transpose(list(np.argsort(self.order)))
    return self._shaped(y, self.shape, list(self.spec) + [None] * (
        len(self.shape) - len(self.spec)))


