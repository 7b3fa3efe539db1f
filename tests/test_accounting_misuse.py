"""Misuse of the wire accounting: each error names the argument, the value
it got and how to fix it (issue #16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _message as message
from dlion_jax import accounting
from dlion_jax import devices
from dlion_jax import hlo
import dlion_jax as dl

AXIS = "data"
GROWING = dl.sync.growing_intervals(2)


# --- numpy integers are ints -------------------------------------------------


def test_numpy_integers_are_accepted():
  assert dl.wire_bits(np.int64(8)) == dl.wire_bits(8)
  assert dl.wire_bits(np.int32(8), quantizer="pbit_l1", bits=np.int64(4)) == (
      dl.wire_bits(8, quantizer="pbit_l1", bits=4))
  assert dl.wire_bits(np.int64(8), momentum_sync=GROWING,
                      steps=np.int64(100)) == dl.wire_bits(
                          8, momentum_sync=GROWING, steps=100)
  assert accounting.momentum_sync_bits(np.int64(8), np.int64(4)) == (
      accounting.momentum_sync_bits(8, 4))
  assert dl.allreduce_bits(np.int64(8)) == dl.allreduce_bits(8) == 56.0


@pytest.mark.parametrize("value", [True, np.bool_(True), 8.0, "8", 0, -3])
def test_num_workers_must_be_a_positive_int(value):
  message = (r"num_workers must be a positive int \(the size of the "
             rf"data-parallel axis\), got num_workers={value!r}\.")
  with pytest.raises(ValueError, match=message):
    dl.wire_bits(value)
  with pytest.raises(ValueError, match=message):
    accounting.momentum_sync_bits(value, 4)
  with pytest.raises(ValueError, match=message):
    dl.allreduce_bits(value)


# --- synced_fraction -------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1.5, float("nan"), True, "0.5"])
def test_synced_fraction_must_be_in_0_1(value):
  message = (r"synced_fraction must be in \[0, 1\] \(the share of parameters "
             rf"the sync mask selects\), got synced_fraction={value!r}\.")
  with pytest.raises(ValueError, match=message):
    dl.wire_bits(8, momentum_sync=4, synced_fraction=value)
  with pytest.raises(ValueError, match=message):
    accounting.momentum_sync_bits(8, 4, synced_fraction=value)


def test_synced_fraction_bounds_are_valid():
  assert dl.wire_bits(8, momentum_sync=56, synced_fraction=0) == (
      dl.wire_bits(8))
  assert dl.wire_bits(8, momentum_sync=56, synced_fraction=np.float32(1)) == (
      dl.wire_bits(8, momentum_sync=56))


# --- steps -------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, 2.5, True])
def test_steps_must_be_a_positive_int(value):
  message = (r"steps must be a positive int \(the number of updates to "
             r"average the sync cost over, e.g. the length of the run\), "
             rf"got steps={value!r}\.")
  with pytest.raises(ValueError, match=message):
    dl.wire_bits(8, momentum_sync=GROWING, steps=value)
  with pytest.raises(ValueError, match=message):
    accounting.momentum_sync_bits(8, GROWING, steps=value)


# --- the largest N -----------------------------------------------------------


@pytest.mark.parametrize("kwargs,limit", [
    (dict(), 2**30 - 1),
    (dict(vote="ternary"), 2**30 - 1),
    (dict(quantizer="pbit_l1", bits=8), 8454660),
])
def test_num_workers_up_to_max_workers(kwargs, limit):
  assert accounting.max_workers(**{k: v for k, v in kwargs.items()
                                   if k != "vote"}) == limit
  for comm in message.COMMS + ("auto",):
    assert dl.wire_bits(limit, comm=comm, **kwargs) > 0
    error = (rf"num_workers={limit + 1} is more than the vote exchange "
             rf"supports: at most {limit} workers")
    with pytest.raises(ValueError, match=error):
      dl.wire_bits(limit + 1, comm=comm, **kwargs)


def test_num_workers_2_to_the_40_blames_num_workers():
  with pytest.raises(ValueError, match=(
      r"num_workers=1099511627776 is more than the vote exchange supports: "
      r"at most 1073741823 workers for 2-level votes")):
    dl.wire_bits(2**40)


# --- collectives in loops of unknown trip count ------------------------------


def test_dynamic_while_loop_with_collectives_is_refused():
  mesh = devices.data_mesh(8, axis_name=AXIS)

  def fn(x):
    step = lambda c: (c[0] + 1, lax.psum(c[1], AXIS) / 8)
    return lax.while_loop(lambda c: c[0] < x[0].astype(jnp.int32), step,
                          (0, x))[1]

  mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                         check_vma=False)
  compiled = jax.jit(mapped).lower(
      jax.ShapeDtypeStruct((8 * 64,), jnp.float32)).compile()
  message = (r"Cannot count the collectives in %[\w.\-]+, run by while loop "
             r"%[\w.\-]+: the HLO gives no known_trip_count for it.*compile "
             r"one step without the loop and multiply its bytes by the number "
             r"of steps\.")
  with pytest.raises(ValueError, match=message):
    dl.collective_bytes(compiled)
  with pytest.raises(ValueError, match=message):
    hlo.collectives(compiled.as_text())


# --- what was not compiled -------------------------------------------------


def _sharded_sum():
  """``jnp.sum`` of a vector sharded over 8 devices: jit inserts its
  all-reduce of one float32 only when it partitions the module."""
  mesh = devices.data_mesh(8, axis_name=AXIS)
  x = jax.ShapeDtypeStruct((8 * 64,), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P(AXIS)))
  return jax.jit(jnp.sum), x, mesh


@pytest.mark.parametrize("stage,kind,fix", [
    (lambda f, x: f.lower(x), "a jax.stages.Lowered",
     r"Pass lowered\.compile\(\)"),
    (lambda f, x: f.trace(x), "a jax.stages.Traced",
     r"Pass traced\.lower\(\)\.compile\(\)"),
    (lambda f, x: f, "a jitted function",
     r"Pass jit\(f\)\.lower\(\*args\)\.compile\(\)"),
], ids=["lowered", "traced", "function"])
def test_uncompiled_stages_are_refused(stage, kind, fix):
  fn, x, mesh = _sharded_sum()
  for name, count in [
      ("collective_bytes", dl.collective_bytes),
      ("collective_bytes_by_axis",
       lambda v: dl.collective_bytes_by_axis(v, mesh))]:
    message = (rf"{name}: compiled_or_text is {kind}, not a compiled "
               rf"function.*{fix}")
    with pytest.raises(TypeError, match=message):
      count(stage(fn, x))
  with pytest.raises(TypeError, match=r"collective_bytes: compiled_or_text "
                     r"must be a jax\.stages\.Compiled.*got int"):
    dl.collective_bytes(3)
  # what the fix gives: one all-reduce of a float32 over 8 devices
  assert dl.collective_bytes(fn.lower(x).compile()) == 2 * 7 / 8 * 4


def test_uncompiled_texts_are_refused():
  fn, x, _ = _sharded_sum()
  lowered = fn.lower(x)
  with pytest.raises(ValueError, match=(
      r"collective_bytes: compiled_or_text is StableHLO \(MLIR\) text, which "
      r"this reader cannot read\. Pass jit\(f\)\.lower\(\.\.\.\)\.compile\(\) "
      r"or its \.as_text\(\)\.")):
    dl.collective_bytes(lowered.as_text())
  with pytest.raises(ValueError, match=(
      r"collectives: hlo_text is HLO that XLA has not partitioned \(it still "
      r"carries jit's sharding annotations\) and holds no collective: those "
      r"the partitioner inserts are not in it yet\. Pass "
      r"jit\(f\)\.lower\(\.\.\.\)\.compile\(\) or its \.as_text\(\)\.")):
    hlo.collectives(lowered.as_text(dialect="hlo"))
  with pytest.raises(ValueError, match="has not partitioned"):
    dl.collective_bytes(lowered.as_text(dialect="hlo"))
  assert dl.collective_bytes(lowered.compile().as_text()) == 2 * 7 / 8 * 4
