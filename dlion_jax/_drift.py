"""Which values of a traced step differ from worker to worker.

A data-parallel step keeps its params replicated only if every new param is
computed from values that are equal on every worker. This module follows the
values that *vary* over a mesh axis through a jaxpr: a worker's batch varies;
an elementwise op of anything varying varies; a collective whose result is
the same on every worker (``psum``, ``pmax``, ``all_gather``, ...) ends the
variation over its axes, one whose result is per worker (``all_to_all``,
``ppermute``, ``psum_scatter``, ``axis_index``) starts it. A new param that
still varies over the data axis would drift apart between the replicas.

Unlike JAX's own ``check_vma`` typing, only the inputs named as varying
start a variation: a per-worker step counter that every worker advances
alike (what an optax schedule reads) does not make the update vary.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.extend.core as jex

from dlion_jax import _mesh

Axes = frozenset

_NONE: Axes = frozenset()

# Collectives whose result is equal on every worker of their axes.
_INVARIANT = frozenset({"psum", "psum_invariant", "pmax", "pmin",
                        "all_gather", "all_gather_invariant", "pbroadcast"})
# Collectives (and axis_index) whose result differs from worker to worker.
_PER_WORKER = frozenset({"all_to_all", "ragged_all_to_all", "ppermute",
                         "reduce_scatter", "psum_scatter", "axis_index"})


def _axes(eqn) -> Axes:
  axes = eqn.params.get("axes", eqn.params.get("axis_name"))
  return frozenset(axes if isinstance(axes, (tuple, list)) else (axes,))


def open_jaxpr(jaxpr):
  return getattr(jaxpr, "jaxpr", jaxpr)


def varying_outputs(jaxpr, varying_inputs: Sequence[Axes]) -> list[Axes]:
  """The axes each output of ``jaxpr`` varies over, given its inputs'.

  Args:
    jaxpr: a ``Jaxpr`` or ``ClosedJaxpr`` (its constants vary over nothing).
    varying_inputs: for each of its inputs, the axes it varies over.

  Returns:
    For each output, the frozenset of mesh axes it varies over.
  """
  jaxpr = open_jaxpr(jaxpr)
  env = dict(zip(jaxpr.invars, varying_inputs, strict=True))
  read = lambda v: env.get(v, _NONE) if isinstance(v, jex.Var) else _NONE
  for eqn in jaxpr.eqns:
    outs = _equation(eqn, [read(v) for v in eqn.invars])
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def exchanges_over(jaxpr, axes: Axes) -> bool:
  """Whether any collective of ``jaxpr`` (nested ones too) exchanges
  arrays over one of ``axes``: a reduction of scalars (a loss, a norm, a
  finite flag) does not make per-worker arrays equal, and is not counted."""
  return any(_exchanges(eqn, axes) for eqn in open_jaxpr(jaxpr).eqns)


def _exchanges(eqn, axes: Axes) -> bool:
  """Whether ``eqn`` is, or nests, a collective of arrays over one of
  ``axes``."""
  if ("axes" in eqn.params or "axis_name" in eqn.params) and (
      _axes(eqn) & axes):
    return any(getattr(v.aval, "ndim", 0) for v in eqn.invars)
  return any(
      isinstance(inner, (jex.Jaxpr, jex.ClosedJaxpr))
      and exchanges_over(inner, axes)
      for value in eqn.params.values()
      for inner in (value if isinstance(value, (tuple, list)) else (value,)))


def exchanged_outputs(jaxpr, axes: Axes) -> list[bool]:
  """Whether each output of ``jaxpr`` depends on a collective of arrays
  over one of ``axes`` (as :func:`exchanges_over` counts them). A nested
  jaxpr (a ``cond``, a loop, a call) that runs one counts for all its
  outputs: what the answer tells is whether an exchange was meant, not
  which element it reached."""
  jaxpr = open_jaxpr(jaxpr)
  seen = {}
  read = lambda v: isinstance(v, jex.Var) and seen.get(v, False)
  for eqn in jaxpr.eqns:
    hit = _exchanges(eqn, axes) or any(read(v) for v in eqn.invars)
    seen.update((v, hit) for v in eqn.outvars)
  return [read(v) for v in jaxpr.outvars]


def _union(axes: Sequence[Axes]) -> Axes:
  return frozenset().union(*axes)


def _equation(eqn, ins: list[Axes]) -> list[Axes]:
  name, n_out = eqn.primitive.name, len(eqn.outvars)
  if eqn.params.get("axis_index_groups") is not None:   # pmap: per group
    name = "grouped " + name
  if name in _INVARIANT or name in _PER_WORKER:
    axes = _axes(eqn)
    move = (lambda a: a - axes) if name in _INVARIANT else (
        lambda a: a | axes)
    if len(ins) == n_out:                # psum of several operands
      return [move(a) for a in ins]
    return [move(_union(ins))] * n_out
  if name == "cond":
    return _cond(eqn, ins)
  if name == "scan":
    return _loop(eqn.params["jaxpr"], ins, eqn.params["num_consts"],
                 eqn.params["num_carry"])
  if name == "while":
    return _while(eqn, ins)
  if name == "shard_map":
    # A nested region's outputs are global arrays over the axes it maps.
    manual = frozenset(eqn.params.get("newly_manual_axes", ()))
    return [a - manual for a in varying_outputs(eqn.params["jaxpr"], ins)]
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(key)
    if (inner is not None and len(open_jaxpr(inner).invars) == len(ins)
        and len(open_jaxpr(inner).outvars) == n_out):
      return varying_outputs(inner, ins)
  return [_union(ins)] * n_out         # elementwise, or not understood


def _cond(eqn, ins: list[Axes]) -> list[Axes]:
  """Either branch may run; which one is decided by the index (``ins[0]``)."""
  index, operands = ins[0], ins[1:]
  outs = [varying_outputs(b, operands) for b in eqn.params["branches"]]
  return [index | _union(per_branch) for per_branch in zip(*outs)]


def _loop(body, ins: list[Axes], num_consts: int, num_carry: int):
  """A scan: the carry's variation, iterated to its fixed point."""
  consts = ins[:num_consts]
  carry = ins[num_consts:num_consts + num_carry]
  xs = ins[num_consts + num_carry:]
  while True:
    outs = varying_outputs(body, consts + carry + xs)
    grown = [a | b for a, b in zip(carry, outs[:num_carry])]
    if grown == carry:
      return carry + outs[num_carry:]
    carry = grown


def _while(eqn, ins: list[Axes]) -> list[Axes]:
  """A while loop: its carry as a scan's; a varying predicate makes every
  output vary (the workers may stop after different trip counts)."""
  n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  cond_consts, rest = ins[:n_cond], ins[n_cond:]
  carry = _loop(eqn.params["body_jaxpr"], rest, n_body, len(rest) - n_body)
  (predicate,) = varying_outputs(eqn.params["cond_jaxpr"],
                                 cond_consts + carry)
  return [a | predicate for a in carry]


def typed_varying_axes(x) -> frozenset:
  """The mesh axes ``shard_map(check_vma=True)`` types ``x`` as varying over
  (``aval.vma`` in older jax, ``aval.manual_axis_type.varying`` later)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma)


def types_varying(axis_name) -> bool:
  """Whether values are typed by the axes they vary over here: inside a
  ``shard_map(check_vma=True)`` manual over ``axis_name`` (a worker's own
  index is typed varying there, and nowhere else)."""
  return set(_mesh.names(axis_name)) <= typed_varying_axes(
      jax.lax.axis_index(axis_name))


def check_local_gradients(grads, axis_name) -> None:
  """Raises a ValueError naming the gradient leaves typed equal on every
  worker of ``axis_name``, where ``check_vma`` types them.

  Under ``shard_map(check_vma=True)`` the gradient of a loss with respect
  to params replicated over the axis is all-reduced by JAX itself (the
  transpose of the implicit broadcast): every worker would then vote on
  the same global gradient, and the step would send the fp32 all-reduce
  on top of the votes, with nothing else to show for it. Without
  ``check_vma`` the types say nothing (``dl.collective_bytes`` of the
  compiled step does).
  """
  if not types_varying(axis_name):
    return
  same = [jax.tree_util.keystr(path) or "<root>"
          for path, g in jax.tree_util.tree_leaves_with_path(grads)
          if g.size and not set(_mesh.names(axis_name)) & typed_varying_axes(g)]
  if not same:
    return
  named = ", ".join(same[:4]) + (
      f" and {len(same) - 4} more" if len(same) > 4 else "")
  raise ValueError(
      f"The gradients given to the vote over axis_name={axis_name!r} are "
      f"the same on every worker (leaves {named}, typed invariant over "
      f"{axis_name!r} by shard_map's check_vma): JAX all-reduced them in "
      "fp32, as it does for a loss differentiated with respect to params "
      f"replicated over {axis_name!r}, and every worker would vote on the "
      "one global gradient. Differentiate each worker's local loss with "
      "respect to params marked per worker: local = jax.lax.pcast(params, "
      f"{axis_name!r}, to='varying') before jax.grad (the step then sends "
      "only the votes), or let dl.parallel.make_train_step build the step.")


