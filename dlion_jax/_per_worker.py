"""How :func:`dlion_jax.parallel.per_worker` maps one worker's function:
the layouts (``"replicated"``, ``"stacked"``, ``"split"``), each worker's
own PRNG keys, and the checks that a ``"stacked"`` argument or optimizer
state has a row per worker.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dlion_jax import _core
from dlion_jax import _mesh
from dlion_jax import _placement
from dlion_jax import _replication
from dlion_jax._mesh import axis_size


_LAYOUTS = ("replicated", "stacked", "split")


def per_worker(fn: Callable, mesh: Mesh, *, axis_name: str = "data",
               ins: tuple[Any, ...], outs: tuple[Any, ...] | Any,
               check_vma: bool = False,
               check_replicated: bool = True,
               fold_in_worker: bool = True,
               donate_argnums: int | tuple[int, ...] = (),
               placement: Any = None) -> Callable:
  """``jax.shard_map`` of ``fn``, written for one worker.

  Each positional argument and each output of ``fn`` has one of three
  layouts over the ``N`` workers of ``axis_name``:

  * ``"replicated"``: the same value on every worker (``P()``), e.g. params;
  * ``"stacked"``: every leaf has a leading axis of size ``N`` and row ``i``
    belongs to worker ``i`` (``P(axis_name)``), e.g. optimizer states or
    per-worker gradients. ``fn`` sees its own row, *without* that axis;
  * ``"split"``: the leading axis is split over the workers
    (``P(axis_name)``), e.g. a global batch. ``fn`` sees its slice.

  A layout may also be a pytree prefix of its argument with a layout at
  each leaf: ``state.replace(step="replicated", params="replicated",
  opt_state="stacked")`` for a flax ``TrainState`` whose optimizer state is
  every worker's own.

  ``fn`` is manual over ``axis_name`` only (``shard_map``'s
  ``axis_names``): the mesh's other axes stay the compiler's, and ``fn``
  sees every array whole, sharded over them as its type says (``P()`` above
  speaks of ``axis_name`` alone).

  A ``"replicated"`` output must be equal on every worker: ``shard_map``
  returns worker 0's copy without looking at the others. With
  ``check_replicated`` (and no ``check_vma``, more than one worker) ``fn``
  is traced once more to check that: a value computed from a ``"split"``
  argument, or from a ``"stacked"`` one that differs by worker, must pass
  through a reduction over the axis (``psum``, ``pmean``, ``all_gather``,
  ...). A ``"stacked"`` leaf that ``fn`` returns updated, at the same
  place of a ``"stacked"`` output of the same structure (an optimizer
  state), is taken as differing by worker only where its new value does:
  every worker's rows start alike (:func:`init_worker_states`,
  :func:`~dlion_jax.devices.stack_for_workers`), so the moments of a
  global optimizer after :func:`~dlion_jax.transforms.pmean_gradients` or
  an injected hyperparameter stay alike, while Distributed Lion's momenta
  differ. Integer scalars (step counts) are
  alike; PRNG keys, typed or raw, differ.

  With ``fold_in_worker`` each worker's index is folded into the typed PRNG
  keys (``jax.random.key``, what ``nnx.Rngs`` holds) of ``"replicated"``
  arguments before ``fn`` sees them (:func:`jax.random.fold_in`): from one
  replicated key each worker draws its own dropout masks, the same in
  every run. A key ``fn`` returns as it was given goes out as it came in;
  one ``fn`` derives from it differs by worker. Raw ``uint32`` keys
  (``jax.random.PRNGKey``) cannot be told from data: fold them yourself,
  ``jax.random.fold_in(key, jax.lax.axis_index(axis_name))``.

  Args:
    fn: one worker's computation; it may use collectives over ``axis_name``.
    mesh: the device mesh; ``axis_name`` must be one of its axes.
    axis_name: the data-parallel axis, or a tuple of mesh axes whose
      devices all count as workers (``N`` their product, rows in mesh order).
    ins: the layout of each positional argument (a layout or a prefix).
    outs: the layout of each output of ``fn`` (a tuple), or one layout
      (not a tuple) when ``fn`` returns a single pytree.
    check_vma: passed to :func:`jax.shard_map` (JAX's own, stricter check
      of the replicated outputs).
    check_replicated: check the ``"replicated"`` outputs as above; turn it
      off for a value that is equal on every worker by construction.
    fold_in_worker: give each worker its own stream of the typed PRNG keys
      of ``"replicated"`` arguments (above); False gives every worker the
      same key.
    donate_argnums: the arguments whose buffers a call on arrays donates
      (as :func:`jax.jit`'s).
    placement: the params' ``PartitionSpec``s over the mesh's other axes
      (a pytree like the params, e.g. ``jax.tree.map(lambda x:
      x.sharding.spec, params)`` of the concrete params), for a function
      traced inside a ``jax.jit`` of yours on a mesh whose other axes are
      Auto: there a traced array does not say how it is placed. The
      optimizer's vote then cuts each leaf as it lies, and each output of
      the params' structure is constrained to it.

  Returns:
    The mapped function on the global arrays. Called on arrays it compiles
    itself (:func:`jax.jit`, once a placement of its arguments), and each
    output that updates an argument (the same pytree, shapes and dtypes)
    keeps that argument's placement: on Auto axes the compiler would pick
    its own for the new params and state. Traced inside a ``jax.jit`` (or
    ``nnx.jit``) of yours on a mesh with Auto axes of more than one device
    beside ``axis_name``, it needs ``placement`` (without it a ValueError
    says so: the compiler would re-place the params silently). It raises
    a ValueError for a ``"stacked"`` argument whose leading axis is not
    ``N`` and for a ``"replicated"`` output that differs between workers.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from dlion_jax import devices
    >>> from dlion_jax import parallel
    >>> mesh = devices.data_mesh(1)
    >>> fn = parallel.per_worker(
    ...     lambda w, x: w + jax.lax.psum(x, "data"), mesh,
    ...     ins=("replicated", "stacked"), outs="replicated")
    >>> jax.jit(fn)(jnp.ones(2), jnp.ones((1, 2)))
    Array([2., 2.], dtype=float32)
  """
  # A fresh map for each trace in a caller's jit: the placement it is
  # traced under is not in the key of JAX's trace cache.
  make = lambda: mapped(fn, mesh, axis_name=axis_name, ins=ins, outs=outs,
                        check_vma=check_vma,
                        check_replicated=check_replicated,
                        fold_in_worker=fold_in_worker)
  # What placement= speaks of: the "replicated" parts of the arguments.
  replicated = lambda args: [jax.tree.map(
      lambda k, sub: sub if k == "replicated" else None, layout, arg)
                             for arg, layout in zip(args, ins)]
  return _placement.PlacedCall(make, mesh, axis_name, donate_argnums,
                               placement, replicated)


def mapped(fn: Callable, mesh: Mesh, *, axis_name, ins, outs,
           check_vma: bool = False, check_replicated: bool = True,
           fold_in_worker: bool = True) -> Callable:
  """:func:`per_worker`'s ``shard_map`` of ``fn``, to be traced inside a
  ``jax.jit`` that places its outputs (the library's own steps)."""
  n = axis_size(mesh, axis_name)
  single = not isinstance(outs, (tuple, list))
  ins, outs_ = tuple(ins), (outs,) if single else tuple(outs)
  for name, layouts in (("ins", ins), ("outs", outs_)):
    bad = [x for x in jax.tree.leaves(layouts) if x not in _LAYOUTS]
    if bad:
      raise ValueError(f"per_worker: {name} has {bad[0]!r}; each layout is "
                       f"one of {_LAYOUTS} (or a pytree prefix of the "
                       "argument with one at each leaf).")
  if fold_in_worker and n > 1:
    fn = _with_worker_keys(fn, ins, axis_name)
  checked = _replication.replication_checked(
      fn, ins, outs_, single, axis_name) if (
          check_replicated and not check_vma and n > 1
          and "replicated" in jax.tree.leaves(outs_)) else fn
  spec = lambda layout: jax.tree.map(
      lambda k: P() if k == "replicated" else P(axis_name), layout)
  def local(*args):
    args = [_rows(a, k, lambda x: x[0]) for a, k in zip(args, ins)]
    out = checked(*args)
    out = (out,) if single else _replication.outputs(out, outs_)
    out = tuple(_rows(o, k, lambda x: x[None]) for o, k in zip(out, outs_))
    return out[0] if single else out
  out_specs = tuple(map(spec, outs_))
  sharded = jax.shard_map(local, mesh=mesh, in_specs=tuple(map(spec, ins)),
                         out_specs=out_specs[0] if single else out_specs,
                         axis_names=set(_mesh.names(axis_name)),
                         check_vma=check_vma)
  def call(*args):
    if len(args) != len(ins):
      raise TypeError(
          f"per_worker: the function got {len(args)} positional arguments "
          f"but ins gives {len(ins)} layouts {ins}; give one layout per "
          "argument.")
    for i, (arg, layout) in enumerate(zip(args, ins)):
      _rows(arg, layout, lambda x: x, lambda sub: _core.check_leading_axis(
          sub, n, f"per_worker argument {i} (\"stacked\")",
          "one row per worker", "Stack one row per worker, or lay the "
          "argument out \"split\" if its rows are to be divided among "
          "the workers."))
    return sharded(*args)
  return call


def _with_worker_keys(fn: Callable, ins, axis_name) -> Callable:
  """``fn`` whose ``"replicated"`` arguments' typed PRNG keys are folded
  with the worker's index (:func:`jax.random.fold_in`): each worker draws
  its own dropout masks from one key, and two runs draw the same. A key
  ``fn`` returns as it was given goes out as it came in, the same on every
  worker; one derived from a folded key differs by worker."""
  def with_keys(*args):
    index = lax.axis_index(axis_name)
    given = {}
    def fold(x):
      if not _core.typed_key(x):
        return x
      folded = _core.own_key(x, index)
      given[id(folded)] = (folded, x)
      return folded
    args = [jax.tree.map(fold, a) if k == "replicated" else
            _map_layout(a, k, "replicated", fold) for a, k in zip(args, ins)]
    def unfold(x):
      folded, original = given.get(id(x), (None, None))
      return original if folded is x else x
    return jax.tree.map(unfold, fn(*args))
  return with_keys


def _map_layout(tree: Any, layout: Any, which: str, fn: Callable) -> Any:
  """``fn`` applied to the leaves of the parts of ``tree`` laid out
  ``which`` (``layout`` a layout or a prefix of ``tree``)."""
  return jax.tree.map(
      lambda k, sub: jax.tree.map(fn, sub) if k == which else sub,
      layout, tree)


def _rows(tree: Any, layout: Any, row: Callable, check=None) -> Any:
  """``row`` applied to every leaf of the ``"stacked"`` parts of ``tree``
  (``layout`` a layout or a prefix of ``tree``); ``check`` sees each
  stacked part first."""
  def part(k, sub):
    if k != "stacked":
      return sub
    if check is not None:
      check(sub)
    return jax.tree.map(row, sub)
  return jax.tree.map(part, layout, tree)


