"""Leaves cut into shards over the fast mesh axes, so that each device votes
on its own part.

**The compiler's axes** (:func:`compiler_axes`, :func:`on_own_shards`). A
step manual over the data axis only leaves the mesh's other axes to the
compiler; a leaf is sharded over them as its type says. The vote then runs
in a nested region manual over those axes: each device encodes, packs and
exchanges across the data axis only its own block of each leaf, cut once
more over the axes the leaf is replicated on, and gathers the update back
over the fast links.

**The hand-made hybrid layout** (``make_train_step(..., shard_axis=)``).
Hybrid meshes (several devices per node on a fast link, nodes on a slow
one) reduce the gradients exactly inside a node and vote across nodes only.
Inside a node each of its ``k`` devices keeps ``1/k`` of every leaf (ZeRO
stages 1 and 2: gradients and optimizer state sharded, params whole):

* leaf ``l`` of ``n_l`` elements is flattened and zero-padded to
  ``k * s_l`` elements, ``s_l = ceil(n_l / k)``; device ``j`` of the axis
  owns elements ``[j s_l, (j + 1) s_l)``;
* device ``j``'s shards of all leaves lie end to end in one buffer, so the
  gradients travel in **one** ``psum_scatter`` and the new params in one
  ``all_gather`` per dtype, however many leaves the model has (on TPU the
  ``psum_scatter``'s buffer is zero-padded to whole memory tiles, so that
  XLA:TPU keeps it a reduce-scatter: :func:`_scatter_width`).

Invariant: a shard holds whole elements of one leaf at the same positions
on every node, so an elementwise optimizer that runs on the shards (Lion's
update, its sign vote across nodes) computes exactly what it would on the
whole leaves; padding is zero in and cut off on the way back. A statistic
of a whole leaf (Lion Cub's L1 scale, via :class:`LeafShard`) is the sum
over the axis of each shard's sum: bit for bit the whole leaf's sum when
the sums are exact, otherwise within its rounding (the two orders of
addition may round the last bit differently).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Hashable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dlion_jax import devices


class LeafShard(NamedTuple):
  """An array that is one device's shard of a leaf of ``size`` elements cut
  over ``axis_name``: what a whole-leaf statistic (Lion Cub's L1 scale)
  must reduce over to see the whole leaf."""
  axis_name: Hashable
  size: int


class _Context(NamedTuple):
  axis_name: Hashable
  sizes: dict[str, int]       # whole leaf sizes by key path


# Set while dlion_jax.parallel.make_train_step traces a hybrid step's
# optimizer update.
_CONTEXT = contextvars.ContextVar("shards", default=None)


@contextlib.contextmanager
def sharded_over(axis_name: Hashable, whole: Any):
  """Marks the optimizer update traced inside as running on shards of the
  leaves of ``whole`` (the params), cut over ``axis_name``."""
  sizes = {jax.tree_util.keystr(path): int(x.size)
           for path, x in jax.tree_util.tree_leaves_with_path(whole)}
  token = _CONTEXT.set(_Context(axis_name, sizes))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current_shard_axis() -> Hashable | None:
  """The fast axis the leaves being updated are shards over, or None."""
  context = _CONTEXT.get()
  return None if context is None else context.axis_name


def leaf_shards(tree: Any) -> list[LeafShard | None]:
  """For each leaf of ``tree`` (an optimizer's updates), the whole leaf it
  is a shard of, found by its key path; all None outside a hybrid step.

  Raises:
    ValueError: a leaf's path is not one of the params' (a transform that
      renames the tree), so its whole size is unknown.
  """
  context = _CONTEXT.get()
  paths = jax.tree_util.tree_leaves_with_path(tree)
  if context is None:
    return [None] * len(paths)
  out = []
  for path, _ in paths:
    key = jax.tree_util.keystr(path)
    if key not in context.sizes:
      raise ValueError(
          f"The update's leaf {key} is not a leaf of the params, so its "
          f"whole size over shard_axis={context.axis_name!r} is unknown. "
          "Give the optimizer trees shaped like the params, or drop "
          "shard_axis.")
    out.append(LeafShard(context.axis_name, context.sizes[key]))
  return out


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """Where each leaf's shard sits in a device's buffer.

  Attributes:
    sizes: elements of each leaf, in ``jax.tree.leaves`` order.
    num_shards: ``k``, the size of the axis the leaves are cut over.
  """
  sizes: tuple[int, ...]
  num_shards: int

  @property
  def shard_sizes(self) -> tuple[int, ...]:
    """``ceil(n_l / k)``: one device's share of each leaf."""
    return tuple(math.ceil(n / self.num_shards) for n in self.sizes)

  @property
  def offsets(self) -> tuple[int, ...]:
    """Where each leaf's shard starts in a device's buffer."""
    ends = [0]
    for s in self.shard_sizes:
      ends.append(ends[-1] + s)
    return tuple(ends[:-1])

  def stack(self, leaves: list[jax.Array]) -> jax.Array:
    """``[k, sum s_l]``: row ``j`` is device ``j``'s buffer of shards."""
    rows = [jnp.pad(x.ravel(), (0, self.num_shards * s - x.size)).reshape(
        self.num_shards, s) for x, s in zip(leaves, self.shard_sizes)]
    return jnp.concatenate(rows, axis=1)

  def split(self, buffer: jax.Array) -> list[jax.Array]:
    """One device's buffer -> its shard of each leaf (1-D)."""
    return [buffer[..., o:o + s] for o, s in zip(self.offsets,
                                                  self.shard_sizes)]


def _by_dtype(leaves: list[jax.Array]):
  """(dtype, indices of the leaves of that dtype), in a fixed order."""
  for dtype in sorted({x.dtype for x in leaves}, key=str):
    yield dtype, [i for i, x in enumerate(leaves) if x.dtype == dtype]


def reduce_scatter_mean(tree: Any, axis_name: Hashable) -> Any:
  """The mean of ``tree`` over ``axis_name``, each device keeping its shard.

  One ``psum_scatter`` per dtype of the leaves; returns the tree of 1-D
  shards (sums in the leaves' dtype, times ``1/k``).
  """
  k = lax.axis_size(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  out = [None] * len(leaves)
  for dtype, group in _by_dtype(leaves):
    layout = ShardLayout(tuple(leaves[i].size for i in group), k)
    rows = layout.stack([leaves[i] for i in group])
    if on_tpu():
      width = _scatter_width(rows.shape[1], k)
      rows = jnp.pad(rows, ((0, 0), (0, width - rows.shape[1])))
      rows = rows.reshape(k, width // _LANES, _LANES)
    total = lax.psum_scatter(rows, axis_name, scatter_dimension=0,
                             tiled=True)
    # times 1/k, not / k: one rounding a reference can reproduce
    mine = total.reshape(-1) * dtype.type(1 / k)
    for i, shard in zip(group, layout.split(mine)):
      out[i] = shard
  return jax.tree.unflatten(treedef, out)


# TPU memory tiles are (8, 128) elements. XLA:TPU keeps a reduce-scatter
# only when each device's part is whole tiles along the operand's major
# dimension and the whole buffer cuts into equal spans of a few MiB, each
# of whole tiles per device; otherwise its reduce-scatter-decomposer makes
# it an all-reduce of the whole buffer and a dynamic-slice (twice the
# bytes). [k, width] scattered over dimension 0 (the tiles' rows) always
# was; [k, width / 128, 128] with width as below is not (libtpu 0.0.42,
# v5e/v6e, k = 4 to 64).
# Other backends keep any reduce-scatter, so only TPU pays the padding.
_LANES, _TILE = 128, 8 * 128


def on_tpu() -> bool:
  """Whether the devices of the step being traced are TPUs."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return getattr(device, "platform", None) == "tpu"


def lane_rows(x: jax.Array, rows: int) -> jax.Array:
  """1-D ``x`` zero-padded to a multiple of ``rows`` rows of 128 lanes and
  shaped ``[-1, 128]``: what XLA:TPU gathers across devices as whole
  tiles (the caller cuts the padding off each gathered row)."""
  return jnp.pad(x, (0, -x.size % (rows * _LANES))).reshape(-1, _LANES)


def _scatter_width(width: int, k: int) -> int:
  """``width`` rounded up to ``t`` whole tiles, ``t`` a multiple of a power
  of two ``>= max(2, k t / 1024)``, so that spans of up to 4 MiB (f32)
  divide the buffer evenly; adds at most 2 tiles or ``k / 512`` of it."""
  tiles = -(-width // _TILE)
  step = 1 << max(1, (k * tiles - 1).bit_length() - 10)
  return -(-tiles // step) * step * _TILE


def own_shards(tree: Any, axis_name: Hashable) -> Any:
  """This device's shard of every leaf of a replicated ``tree`` (no
  communication: each device slices its own part)."""
  k, j = lax.axis_size(axis_name), lax.axis_index(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  out = [None] * len(leaves)
  for _, group in _by_dtype(leaves):
    layout = ShardLayout(tuple(leaves[i].size for i in group), k)
    mine = layout.stack([leaves[i] for i in group])[j]
    for i, shard in zip(group, layout.split(mine)):
      out[i] = shard
  return jax.tree.unflatten(treedef, out)


def all_gather_leaves(shards: Any, like: Any, axis_name: Hashable) -> Any:
  """Inverse of :func:`own_shards`: the whole leaves, shaped like ``like``,
  from every device's shards (one ``all_gather`` per dtype)."""
  k = lax.axis_size(axis_name)
  leaves, treedef = jax.tree.flatten(shards)
  whole = treedef.flatten_up_to(like)
  out = [None] * len(leaves)
  for _, group in _by_dtype(leaves):
    layout = ShardLayout(tuple(whole[i].size for i in group), k)
    buffer = jnp.concatenate([leaves[i] for i in group])
    width = buffer.size
    if on_tpu():           # whole tiles, or XLA:TPU may all-reduce instead
      buffer = lane_rows(buffer, _TILE // _LANES)
    # Typed invariant: the whole leaves are the same on every device of the
    # axis, which replicated params need under shard_map(check_vma=True).
    rows = lax.all_gather(buffer, axis_name, to="invarying")
    rows = rows.reshape(k, -1)[:, :width]                     # [k, sum s_l]
    for i, part in zip(group, layout.split(rows)):
      x = whole[i]
      out[i] = part.reshape(-1)[:x.size].reshape(x.shape)
  return jax.tree.unflatten(treedef, out)


# Sharded leaves the JAX way: the step is manual over the vote's axis only
# (``jax.shard_map(..., axis_names={axis_name})``) and the compiler owns the
# mesh's other axes, over which each leaf is sharded as its type says.


def compiler_axes(axis_name: Hashable | tuple, leaves=()) -> tuple[str, ...]:
  """The mesh axes the compiler owns where the vote over ``axis_name`` is
  traced: those of the enclosing mesh (or, under a bare ``jax.jit``, of
  the ``leaves``' Explicit shardings) that are not manual. Empty under
  ``pmap``, ``vmap`` alone and a ``shard_map`` manual over every axis.

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
  partitioned = any(mesh.shape[a] > 1 for a in auto)
  if partitioned and (not mesh.manual_axes
                      or not all(a in mesh.axis_names for a in names)):
    raise ValueError(
        f"The vote over axis_name={axis_name!r} is traced on the mesh "
        f"{dict(mesh.shape)} without a jax.shard_map manual over it (a "
        "jax.vmap axis under jax.jit?): the compiler would partition the "
        "packed votes itself, sending several times the vote's bytes, or "
        "fail. Make the data axis manual and leave the others to the "
        "compiler: jax.shard_map(step, mesh=mesh, in_specs=..., "
        "out_specs=..., axis_names={'data'}) with axis_name='data', as "
        "dl.parallel.make_train_step builds it.")
  owned = [a for a in names if a in auto]
  if owned:
    raise ValueError(
        f"axis_name={axis_name!r} names the mesh axis {owned[0]!r}, which "
        "the compiler owns here (it is not manual in the enclosing "
        "jax.shard_map), so the leaves may be sharded over it and a vote "
        "over it would add up votes on different entries. Vote over the "
        "axes the shard_map is manual over "
        f"(axis_name={tuple(mesh.manual_axes)!r}), or make {owned[0]!r} "
        "manual too (shard_map's axis_names) if its devices are workers "
        "with batches of their own.")
  return auto


# Set while dlion_jax.parallel.make_train_step traces the optimizer update
# of a step on Auto axes: each params leaf's placement, by key path.
_PLACED = contextvars.ContextVar("placed", default=None)


@contextlib.contextmanager
def placed(specs: dict[str, P]):
  """Marks the optimizer update traced inside as updating leaves placed as
  ``specs`` says (by the params' key paths, ``jax.tree_util.keystr``): on
  Auto axes their types do not say how they are sharded."""
  token = _PLACED.set(specs)
  try:
    yield
  finally:
    _PLACED.reset(token)


def leaf_spec(x: jax.Array, axes: tuple[str, ...], path: str | None = None
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
  if spec_axes(spec) or not auto:
    return spec
  known = (_PLACED.get() or {}).get(path)
  if known is not None and len(known) <= x.ndim:
    return P(*map(keep, known))
  return devices.fsdp_spec(x.shape, math.prod(mesh.shape[a] for a in auto),
                           auto if len(auto) > 1 else auto[0])


def spec_axes(spec) -> set:
  """The mesh axes a ``PartitionSpec`` names."""
  return {a for entry in spec if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}


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
  the padding cut off. A leaf's blocks are those of the most sharded of
  its arrays across ``trees`` (a ZeRO-2 momentum beside a whole
  gradient); the result is typed like the first tree's leaf, as an optax
  update must be (``optax.MultiSteps`` puts it in a ``lax.cond`` beside
  zeros of the gradient's type). Traced values ``fn`` needs beside the
  trees (an ``optax.inject_hyperparams`` rate) go in ``constants``: a
  region may not close over values typed on Explicit axes.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(trees[0])
  paths, leaves = [jax.tree_util.keystr(p) for p, _ in paths], [
      x for _, x in paths]
  columns = list(zip(leaves, *[treedef.flatten_up_to(t) for t in trees[1:]]))
  # The most sharded of a leaf's arrays (a ZeRO-2 momentum beside a whole
  # gradient) sets its blocks: the others are cut to it, not gathered.
  specs = [max((leaf_spec(x, axes, path) for x in column),
               key=lambda spec: len(spec_axes(spec)))
           for path, column in zip(paths, columns)]
  sizes = dict(jax.sharding.get_abstract_mesh().shape)
  shards_ = [LeafShard(axes, int(x.size)) for x in leaves]

  def cut(trees):
    """Each tree's 1-D chunk of every leaf, and how to put them back."""
    columns = [treedef.flatten_up_to(t) for t in trees]
    chunks, gathers = [[] for _ in columns], []
    for k, spec in enumerate(specs):
      free = tuple(a for a in axes if a not in spec_axes(spec))
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

  in_specs = (P(),) + tuple(treedef.unflatten(specs) for _ in trees)
  out = jax.shard_map(local, in_specs=in_specs,
                      out_specs=treedef.unflatten(specs),
                      axis_names=set(axes), check_vma=False)(constants,
                                                             *trees)
  return treedef.unflatten([typed_like(d, x) for d, x in zip(
      treedef.flatten_up_to(out), leaves)])


def typed_like(d: jax.Array, x: jax.Array) -> jax.Array:
  """``d`` resharded as ``x``'s type says, where that is an Explicit
  sharding other than ``d``'s (on Auto axes the type says nothing and the
  compiler places it)."""
  typed = getattr(jax.typeof(x).sharding, "spec", None)
  if typed is None or getattr(jax.typeof(d).sharding, "spec", None) == typed:
    return d
  return jax.sharding.reshard(d, typed)
