"""Mesh and spec arithmetic: axis names, ``PartitionSpec`` entries, mesh
sizes and where a leaf lies.

The bottom of the library: every module that asks which axes a spec names,
how many workers an axis holds or how to lay an array out on the enclosing
mesh asks here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def names(entry) -> tuple:
  """The mesh axes of one axis name, a tuple of them or a spec entry, as a
  tuple (``()`` for None)."""
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def entry(axes: tuple) -> Any:
  """The ``PartitionSpec`` entry of mesh axes: None, one name, or the
  tuple of several."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def spec_axes(spec) -> set:
  """The mesh axes a ``PartitionSpec`` names."""
  return {a for e in spec for a in names(e)}


def named(spec: P | None) -> bool:
  """Whether ``spec`` shards over any mesh axis."""
  return spec is not None and any(e is not None for e in spec)


def explicit(spec: P) -> bool:
  """Whether every axis ``spec`` names is Explicit on the enclosing mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  return all(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit
             for a in spec_axes(spec))


def place(x: jax.Array, spec: P) -> jax.Array:
  """``x`` laid out as ``spec`` on the enclosing mesh: a reshard where its
  axes are Explicit, a sharding constraint where they are Auto."""
  if explicit(spec):
    return jax.sharding.reshard(x, spec)
  return lax.with_sharding_constraint(x, spec)


def spec_of(x) -> P | None:
  """Where ``x`` lies: its type's spec, or a concrete array's."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if not named(spec) and isinstance(x, jax.Array) and not isinstance(
      x, jax.core.Tracer):      # on Auto axes only a concrete array says
    spec = getattr(x.sharding, "spec", None)
  return spec


def typed_like(d: jax.Array, x: jax.Array) -> jax.Array:
  """``d`` resharded as ``x``'s type says, where that is an Explicit
  sharding other than ``d``'s (on Auto axes the type says nothing and the
  compiler places it)."""
  typed = getattr(jax.typeof(x).sharding, "spec", None)
  if typed is None or getattr(jax.typeof(d).sharding, "spec", None) == typed:
    return d
  return jax.sharding.reshard(d, typed)


def on_mesh(x: jax.Array) -> jax.Array:
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


def gathered(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``x`` whole over ``axes`` (FSDP's gather of a param sharded over
  them), where its type says it is sharded over them (Explicit axes; on
  Auto axes the compiler gathers what it needs)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  if spec is None or not any(a in axes for e in spec for a in names(e)):
    return x
  keep = [tuple(a for a in names(e) if a not in axes) for e in spec]
  return jax.sharding.reshard(x, P(*map(entry, keep)))


def mesh_size(axis_name) -> int:
  """The number of workers: the size of the mesh axes ``axis_name``."""
  mesh = jax.sharding.get_abstract_mesh()
  missing = [a for a in names(axis_name)
             if mesh.empty or a not in mesh.axis_names]
  if missing and mesh.empty:
    raise ValueError(
        f"axis_name={axis_name!r} is not an axis of the enclosing mesh "
        "(none): the workers lie on a mesh axis. Trace the step under "
        "jax.set_mesh(mesh) with that axis, e.g. jax.make_mesh((8,), "
        "('data',)).")
  if missing:
    raise ValueError(
        f"axis_name={axis_name!r} is not an axis of the enclosing mesh "
        f"{dict(mesh.shape)}. Pass the workers' axis of this mesh, e.g. "
        f"axis_name={mesh.axis_names[0]!r}, to every call that takes one "
        "(dl.workers' functions take 'data' unless told, as the optimizer "
        "must be told).")
  return math.prod(mesh.shape[a] for a in names(axis_name))


def axis_size(mesh: Mesh, axis_name: str | tuple[str, ...], *,
              name: str = "axis_name") -> int:
  """The size of ``axis_name`` in ``mesh``, or the product of the sizes of a
  tuple of axes.

  Raises:
    ValueError: naming the argument (``name``) and the mesh's axes, if an
      axis is not one of them or a tuple names one twice.
  """
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  for axis in axes:
    if axis not in mesh.shape:
      which = "" if axis == axis_name else f": {axis!r}"
      raise ValueError(
          f"{name}={axis_name!r}{which} is not an axis of the mesh, whose "
          f"axes are {tuple(mesh.axis_names)}.")
    if axes.count(axis) > 1:
      raise ValueError(
          f"{name}={axis_name!r} names axis {axis!r} twice; name each axis "
          "of the mesh at most once.")
  return math.prod(mesh.shape[axis] for axis in axes)


def spec_on(like: Any, mesh: Mesh) -> P:
  """How ``like`` (an array or ``jax.ShapeDtypeStruct`` placed on
  ``mesh``) is sharded; ``P()`` for anything else."""
  sharding = getattr(like, "sharding", None)
  return (sharding.spec if isinstance(sharding, NamedSharding)
          and sharding.mesh.shape == mesh.shape else P())


def stacked_sharding(like: Any, mesh: Mesh, axis_name: str) -> NamedSharding:
  """Rows split over ``axis_name`` (a leading worker axis), each row
  sharded over the mesh's other axes as ``like`` is (an array placed on
  ``mesh``; otherwise, or for None, whole)."""
  return NamedSharding(mesh, P(axis_name, *spec_on(like, mesh)))


def fsdp_spec(shape: tuple[int, ...], num_shards: int,
              axis_name: str | tuple[str, ...] = "fsdp", *,
              placed: P = P()) -> P:
  """The usual FSDP partition of a leaf: its largest dimension that
  ``num_shards`` divides (the first of equals) cut over ``axis_name``;
  ``P()`` (replicated) when none is, e.g. a bias of 10 over 4 devices.

  With ``placed`` (the leaf's spec over other axes, e.g. tensor parallel
  ``P(None, "model")``) the dimensions it shards are kept and not chosen.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from dlion_jax import devices
    >>> devices.fsdp_spec((8, 12), 4)
    P(None, 'fsdp')
    >>> devices.fsdp_spec((8, 12), 4, placed=P(None, "model"))
    P('fsdp', 'model')
  """
  entries = list(placed) + [None] * (len(shape) - len(placed))
  fits = [d for d, n in enumerate(shape)
          if n % num_shards == 0 and n > 0 and entries[d] is None]
  if not fits:
    return placed
  best = max(fits, key=lambda d: (shape[d], -d))
  entries[best] = axis_name
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def auto_axes(mesh) -> tuple:
  """The Auto axes of more than one device of an abstract mesh."""
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if t == AxisType.Auto and mesh.shape[a] > 1)


def explicit_axes(mesh: Mesh, axis_name) -> tuple:
  """The mesh's Explicit axes beside ``axis_name``."""
  return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
               if a not in names(axis_name)
               and t == AxisType.Explicit)


def on_tpu() -> bool:
  """Whether the devices of the step being traced are TPUs."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return getattr(device, "platform", None) == "tpu"
