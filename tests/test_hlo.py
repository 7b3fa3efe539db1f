"""The HLO reader (dlion_jax.hlo): collectives parsed from compiled modules
and handwritten lines, loops counted once per trip, conditionals by their
branches.

Compile-only: nothing here runs a collective.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import hlo
from dlion_jax import parallel
import dlion_jax as dl
from compiled import AXIS
from compiled import SHAPES
from compiled import SIZES
from compiled import compile_on_mesh
from compiled import compile_update

COMMS = message.COMMS
D = sum(SIZES)


# --- collectives(): parsing compiled modules --------------------------------


def _one(text, op):
  found = [c for c in hlo.collectives(text) if c.op == op]
  assert len(found) == 1, hlo.collectives(text)
  return found[0]


def test_parses_all_reduce():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  text = compile_on_mesh(lambda x: lax.psum(x, AXIS), mesh, P(AXIS),
                         (8 * 64,)).as_text()
  c = _one(text, "all-reduce")
  assert (c.result_bytes, c.group_size) == (256, 8)
  assert c.sent_bytes == 2 * 7 / 8 * 256


def test_parses_tuple_all_reduce():
  mesh = devices.data_mesh(4, axis_name=AXIS)
  fn = lambda x, y: lax.psum((x, y.astype(jnp.int32)), AXIS)
  text = compile_on_mesh(fn, mesh, (P(AXIS), P(AXIS)), (4 * 64,), (4 * 3,),
                         out_specs=(P(AXIS), P(AXIS))).as_text()
  found = [c for c in hlo.collectives(text) if c.op == "all-reduce"]
  assert sum(c.result_bytes for c in found) == 64 * 4 + 3 * 4
  assert hlo.collective_bytes(text) == 2 * 3 / 4 * (64 * 4 + 3 * 4)


def test_parses_all_gather():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  text = compile_on_mesh(lambda x: lax.all_gather(x, AXIS, tiled=True), mesh,
                         P(AXIS), (8 * 10,)).as_text()
  c = _one(text, "all-gather")
  assert (c.result_bytes, c.group_size, c.sent_bytes) == (320, 8, 280)


def test_parses_all_to_all():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  fn = lambda x: lax.all_to_all(x.reshape(8, 16), AXIS, 0, 0).ravel()
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 128,)).as_text()
  c = _one(text, "all-to-all")       # XLA:CPU prints a tuple of 8 [1,16]
  assert (c.result_bytes, c.group_size, c.sent_bytes) == (512, 8, 448)


def test_parses_reduce_scatter():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  fn = lambda x: lax.psum_scatter(x, AXIS, tiled=True)
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  c = _one(text, "reduce-scatter")
  # The result is 1/N of the 256-byte input, of which (N-1)/N is sent.
  assert (c.result_bytes, c.group_size, c.sent_bytes) == (32, 8, 224)


def test_parses_subgroups_of_a_2d_mesh():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  fn = lambda x: (lax.psum(x, "a"), lax.all_gather(x, "b", tiled=True))
  text = compile_on_mesh(fn, mesh, P(("a", "b")), (8 * 16,),
                         out_specs=(P(("a", "b")),) * 2).as_text()
  assert _one(text, "all-reduce").group_size == 2
  gather = _one(text, "all-gather")
  assert (gather.group_size, gather.result_bytes) == (4, 256)


def test_collective_bytes_takes_compiled_or_text():
  compiled = compile_update(8, aggregation="mavo", vote="binary",
                            comm="psum_int8")
  assert hlo.collective_bytes(compiled) == (
      hlo.collective_bytes(compiled.as_text())) == 2 * 7 / 8 * D


# --- collectives(): handwritten HLO lines ------------------------------------

_HEADER = "HloModule m, num_partitions=8\n"


@pytest.mark.parametrize("line,op,result_bytes,group_size", [
    # Iota replica groups: [groups, size] <= [devices], possibly transposed.
    ("%ar = f32[1024]{0} all-reduce(%p), channel_id=1, "
     "replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add",
     "all-reduce", 4096, 8),
    ("%ag = u8[4,100]{1,0} all-gather(%p), channel_id=2, "
     "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}",
     "all-gather", 400, 4),
    # Empty groups: every device of the module.
    ("ROOT %ar.1 = s8[77]{0} all-reduce(%p), replica_groups={}, "
     "to_apply=%add", "all-reduce", 77, 8),
    # Tuple results, with XLA's /*index=k*/ comments.
    ("%a2a = (u8[1,8]{1,0}, u8[1,8]{1,0}, u8[1,8]{1,0}, u8[1,8]{1,0}, "
     "u8[1,8]{1,0}, /*index=5*/u8[1,8]{1,0}, u8[1,8]{1,0}, u8[1,8]{1,0}) "
     "all-to-all(%a, %b, %c, %d, %e, /*index=5*/%f, %g, %h), channel_id=3, "
     "replica_groups={{0,1,2,3,4,5,6,7}}", "all-to-all", 64, 8),
    ("%ar2 = (f32[64]{0}, bf16[3]{0}, u32[5]{0}) all-reduce(%x, %y, %z), "
     "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add",
     "all-reduce", 256 + 6 + 20, 2),
    ("%rs = f32[8]{0} reduce-scatter(f32[64]{0} %p), channel_id=4, "
     "replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add",
     "reduce-scatter", 32, 8),
    # Async (GPU) forms: the start carries (operand, result) for all-gather.
    ("%ars = u32[100]{0} all-reduce-start(u32[100]{0} %p), "
     "replica_groups=[1,8]<=[8], to_apply=%add", "all-reduce", 400, 8),
    ("%ags = (u8[10]{0}, u8[80]{0}) all-gather-start(u8[10]{0} %p), "
     "replica_groups=[1,8]<=[8], dimensions={0}", "all-gather", 80, 8),
    ("%ags2 = ((u8[10]{0}, f32[2]{0}), (u8[80]{0}, f32[16]{0})) "
     "all-gather-start(%p, %q), replica_groups=[1,8]<=[8], dimensions={0}",
     "all-gather", 80 + 64, 8),
    ("%cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) "
     "collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}",
     "collective-permute", 64, 8),
])
def test_parses_handwritten_lines(line, op, result_bytes, group_size):
  (c,) = hlo.collectives(_HEADER + "  " + line + "\n")
  assert (c.op, c.result_bytes, c.group_size) == (op, result_bytes,
                                                  group_size)
  n = group_size
  factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1,
            "collective-permute": 1}.get(op, (n - 1) / n)
  assert c.sent_bytes == pytest.approx(factor * result_bytes)


def test_ignores_non_collectives_and_done_ops():
  text = _HEADER + "\n".join([
      '  %f = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="psum"}',
      "  %ard = u32[100]{0} all-reduce-done(u32[100]{0} %ars)",
      "  %agd = u8[80]{0} all-gather-done((u8[10]{0}, u8[80]{0}) %ags)",
      "  %c = f32[8]{0} copy(%all-gather.1)",
  ])
  assert hlo.collectives(text) == []
  assert hlo.collective_bytes(text) == 0


# --- collectives(): loops count once per trip --------------------------------


def compile_steps(num_workers, steps, **options):
  """Compiled shard_map of ``steps`` distributed Lion updates: one plain
  update for ``steps=None``, else a ``lax.scan`` over ``steps`` (never run)."""
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  tx = dl.distributed_lion(1e-3, axis_name=AXIS, **options)

  def update(carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  def local(params, state, grads):   # the state out too: syncs stay live
    if steps is None:
      return update((params, state), grads)[0]
    return lax.scan(update, (params, state), grads)[0]

  fn = jax.jit(parallel.per_worker(
      local, mesh, axis_name=AXIS, ins=("replicated", "replicated", "stacked"),
      outs=("replicated", "stacked")))
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  lead = (num_workers,) if steps is None else (num_workers, steps)
  grads = {k: jax.ShapeDtypeStruct(lead + s, jnp.float32)
           for k, s in SHAPES.items()}
  return fn.lower(params, jax.eval_shape(tx.init, params), grads).compile()


@pytest.mark.parametrize("comm", COMMS)
def test_scan_of_k_steps_sends_k_steps_bytes(comm):
  one = hlo.collective_bytes(compile_steps(4, None, comm=comm))
  scanned = compile_steps(4, 10, comm=comm)
  assert one > 0
  assert hlo.collective_bytes(scanned) == pytest.approx(10 * one,
                                                        rel=1e-12)
  assert {c.count for c in hlo.collectives(scanned.as_text())} == {10}


def test_scan_keeps_momentum_syncs_conditional():
  """A momentum sync (lax.cond) in a scanned step: conditional, k times."""
  kw = dict(comm="alltoall", momentum_sync=3)
  one, scanned = compile_steps(8, None, **kw), compile_steps(8, 10, **kw)
  found = hlo.collectives(scanned.as_text())
  synced = [c for c in found if c.conditional]
  assert [(c.op, c.count) for c in synced] == [("all-reduce", 10)]
  assert synced[0].bytes_per_call == 10 * synced[0].sent_bytes
  for conditional in (True, False):
    assert hlo.collective_bytes(
        scanned, conditional=conditional) == pytest.approx(
            10 * hlo.collective_bytes(one, conditional=conditional))


def _psums(x, times):
  """``times`` psums of x, in a lax.scan."""
  return lax.scan(lambda c, _: (lax.psum(c, AXIS) / 8, None), x, None,
                  length=times)[0]


def test_nested_scans_multiply():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  fn = lambda x: lax.scan(lambda c, _: (_psums(c, 4), None), x, None,
                          length=3)[0]
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  c = _one(text, "all-reduce")
  assert (c.count, c.conditional) == (12, False)
  assert hlo.collective_bytes(text) == 12 * 2 * 7 / 8 * 256


def test_scan_inside_cond_stays_conditional():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  fn = lambda x: lax.cond(x[0] > 0, lambda y: _psums(y, 5), lambda y: y, x)
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  c = _one(text, "all-reduce")
  assert (c.count, c.conditional) == (5, True)
  assert hlo.collective_bytes(text) == 5 * 2 * 7 / 8 * 256
  assert hlo.collective_bytes(text, conditional=False) == 0


def _psum_bytes(floats, n=8):
  """What one ring all-reduce of ``floats`` float32s over n workers sends."""
  return 2 * (n - 1) / n * 4 * floats


@pytest.mark.parametrize("sizes", [(64, 64, 64), (16, 64, 32)])
def test_switch_counts_one_branch(sizes):
  """lax.switch runs one branch a call: its largest, or with
  conditional=False its smallest, not the sum of the three."""
  mesh = devices.data_mesh(8, axis_name=AXIS)
  branches = [lambda y, s=s: y.at[:s].set(lax.psum(y[:s], AXIS))
              for s in sizes]
  fn = lambda x: lax.switch(x[0].astype(jnp.int32) % 3, branches, x)
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  found = hlo.collectives(text)
  assert sorted(c.result_bytes for c in found) == sorted(4 * s for s in sizes)
  assert all(c.conditional for c in found)
  assert hlo.collective_bytes(text) == _psum_bytes(max(sizes))
  assert hlo.collective_bytes(text, conditional=False) == (
      _psum_bytes(min(sizes)))
  by_axis = dl.collective_bytes_by_axis(text, mesh)
  assert by_axis == {AXIS: _psum_bytes(max(sizes))}


def test_fori_loop_with_static_bounds_counts_each_trip():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  fn = lambda x: lax.fori_loop(0, 7, lambda i, y: lax.psum(y, AXIS) / 8, x)
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  assert _one(text, "all-reduce").count == 7
  assert hlo.collective_bytes(text) == 7 * 2 * 7 / 8 * 256


def test_dynamic_loop_without_collectives_is_fine():
  """An unknown trip count only matters when the loop sends something."""
  mesh = devices.data_mesh(8, axis_name=AXIS)
  def fn(x):
    halve = lambda c: (c[0] + 1, c[1] / 2)
    _, y = lax.while_loop(lambda c: c[0] < x[0].astype(jnp.int32), halve,
                          (0, x))
    return lax.psum(y, AXIS)
  text = compile_on_mesh(fn, mesh, P(AXIS), (8 * 64,)).as_text()
  assert '"known_trip_count"' not in text
  assert _one(text, "all-reduce").count == 1


_LOOP_MODULE = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
}

%sync (q: f32[16]) -> f32[16] {
  %q = f32[16]{0} parameter(0)
  ROOT %ar = f32[16]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%add
}

%keep (r: f32[16]) -> f32[16] {
  ROOT %r = f32[16]{0} parameter(0)
}

%body (t: (s32[], f32[16])) -> (s32[], f32[16]) {
  %t = (s32[], f32[16]{0}) parameter(0)
  %x = f32[16]{0} get-tuple-element(%t), index=1
  %c = f32[16]{0} call(%x), to_apply=%inner
  %pr = pred[] constant(true)
  %d = f32[16]{0} conditional(%pr, %c, %c), true_computation=%sync, false_computation=%keep, metadata={op_name="while/body/cond"}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %o = (s32[], f32[16]{0}) tuple(%i, %d)
}

%cond (u: (s32[], f32[16])) -> pred[] {
  %u = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%u), index=1
  %cp = f32[16]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %w = pred[] constant(false)
}

ENTRY %main (x: f32[16]) -> (s32[], f32[16]) {
  %x = f32[16]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[16]{0}) tuple(%z, %x)
  ROOT %loop = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
}
"""


def test_handwritten_loop_module():
  """Calls inside a loop body multiply; its condition runs trips + 1 times;
  a conditional in the body stays conditional."""
  found = hlo.collectives(_LOOP_MODULE)
  assert [(c.op, c.count, c.conditional) for c in found] == [
      ("collective-permute", 7, False),
      ("all-gather", 6, False),
      ("all-reduce", 6, True),
  ]
  sent = 7 * 64 + 6 * 7 / 8 * 64
  assert hlo.collective_bytes(_LOOP_MODULE,
                              conditional=False) == pytest.approx(sent)
  assert hlo.collective_bytes(_LOOP_MODULE) == pytest.approx(
      sent + 6 * 2 * 7 / 8 * 64)


_SWITCH_MODULE = _HEADER + """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%one (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %ar16 = f32[16]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add
}

%gather (q: f32[16]) -> f32[16] {
  %q = f32[16]{0} parameter(0)
  ROOT %ag16 = f32[16]{0} all-gather(%q), replica_groups=[1,8]<=[8], dimensions={0}
}

%cond (u: f32[16]) -> pred[] {
  %u = f32[16]{0} parameter(0)
  ROOT %w = pred[] constant(false)
}

%loop (r: f32[16]) -> f32[16] {
  %r = f32[16]{0} parameter(0)
  ROOT %l = f32[16]{0} while(%r), condition=%cond, body=%gather, backend_config={"known_trip_count":{"n":"3"}}
}

%sync (v: f32[64]) -> f32[64] {
  %v = f32[64]{0} parameter(0)
  ROOT %ar64 = f32[64]{0} all-reduce(%v), replica_groups=[1,8]<=[8], to_apply=%add
}

%keep (k: f32[64]) -> f32[64] {
  ROOT %k = f32[64]{0} parameter(0)
}

%nested (t: f32[64]) -> f32[64] {
  %t = f32[64]{0} parameter(0)
  %ag8 = f32[8]{0} all-gather(%t), replica_groups=[1,8]<=[8], dimensions={0}
  %pr = pred[] constant(true)
  ROOT %inner = f32[64]{0} conditional(%pr, %t, %t), true_computation=%sync, false_computation=%keep
}

ENTRY %main (x: f32[16], y: f32[64], i: s32[]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %i = s32[] parameter(2)
  %outer = f32[64]{0} conditional(%i, %y, %y, %y), branch_computations={%one, %loop, %nested}
  ROOT %after = f32[16]{0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add
}
"""


def test_nested_conditionals_count_their_largest_or_smallest_branch():
  """Branches sending 112 (%one), 3 x 56 (%loop) and 28 + a nested
  conditional of 448 or 0 (%nested); an all-reduce of 112 after them."""
  found = hlo.collectives(_SWITCH_MODULE)
  assert [(c.instruction, c.count, c.conditional) for c in found] == [
      ("ar16", 1, True), ("ag16", 3, True), ("ag8", 1, True),
      ("ar64", 1, True), ("after", 1, False)]
  ar16, ag16, ag8, ar64 = (_psum_bytes(16), 7 / 8 * 64, 7 / 8 * 32,
                           _psum_bytes(64))
  assert hlo.collective_bytes(_SWITCH_MODULE) == pytest.approx(
      ar16 + max(ar16, 3 * ag16, ag8 + ar64))
  assert hlo.collective_bytes(
      _SWITCH_MODULE, conditional=False) == pytest.approx(
          ar16 + min(ar16, 3 * ag16, ag8 + 0))


def test_async_wrapper_counts_once():
  text = _HEADER + """
%wrapped (p: u8[64]) -> u8[64] {
  %p = u8[64]{0} parameter(0)
  ROOT %a2a = u8[64]{0} all-to-all(%p), replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %main (x: u8[64]) -> u8[64] {
  %x = u8[64]{0} parameter(0)
  %start = ((u8[64]{0}), u8[64]{0}, u32[]) async-start(%x), calls=%wrapped
  ROOT %done = u8[64]{0} async-done(%start), calls=%wrapped
}
"""
  (c,) = hlo.collectives(text)
  assert (c.op, c.count, c.sent_bytes) == ("all-to-all", 1, 56)


def test_lowered_text_marks_conditionals_and_refuses_loops():
  """Lowered HLO (``name {`` headers, no % signs) reads like compiled HLO,
  but its loops carry no trip count yet."""
  mesh = devices.data_mesh(8, axis_name=AXIS)
  mapped = lambda fn: jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
  arg = jax.ShapeDtypeStruct((8 * 64,), jnp.float32)
  cond = lambda x: lax.cond(x[0] > 0, lambda y: lax.psum(y, AXIS),
                            lambda y: y, x)
  text = mapped(cond).lower(arg).as_text(dialect="hlo")
  c = _one(text, "all-reduce")
  assert (c.conditional, c.count) == (True, 1)
  assert hlo.collective_bytes(text, conditional=False) == 0
  lowered = mapped(lambda x: _psums(x, 5)).lower(arg)
  with pytest.raises(ValueError, match="known_trip_count"):
    hlo.collective_bytes(lowered.as_text(dialect="hlo"))
  assert hlo.collective_bytes(lowered.compile()) == 5 * 2 * 7 / 8 * 256
