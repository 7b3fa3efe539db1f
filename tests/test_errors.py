"""Misuse gives an error that names the argument, the value and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlion_jax as dl
from dlion_jax import accounting

PARAMS = {"w": jnp.zeros(5)}


@pytest.mark.parametrize("option,value,listed", [
    ("aggregation", "mean", "'mavo', 'avg'"),
    ("vote", "sign", "'binary', 'ternary'"),
    ("comm", "ring", "'alltoall', 'allgather', 'psum', 'psum_int8', 'auto'"),
    ("comm", None, "'auto'"),
])
def test_unknown_option_lists_valid_values(option, value, listed):
  for factory in (dl.scale_by_distributed_lion,
                  lambda **kw: dl.distributed_lion(1e-3, **kw)):
    with pytest.raises(ValueError, match=f"Unknown {option}={value!r}") as e:
      factory(**{option: value})
    assert listed in str(e.value)


def test_unbound_axis_says_where_update_must_run():
  tx = dl.scale_by_distributed_lion(axis_name="data")
  state = tx.init(PARAMS)
  with pytest.raises(NameError, match=r"axis_name='data' is not bound.*"
                     r"jax\.shard_map.*jax\.pmap"):
    tx.update(PARAMS, state)
  with pytest.raises(NameError, match="axis_name='data'"):
    jax.jit(tx.update)(PARAMS, state)


def test_wrong_axis_name_inside_shard_map():
  tx = dl.scale_by_distributed_lion(axis_name="batch")
  mesh = dl.parallel.data_mesh(2)
  fn = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
                     in_specs=jax.P("data"), out_specs=jax.P("data"))
  with pytest.raises(NameError, match="axis_name='batch' is not bound"):
    fn(jnp.zeros((2, 4)))


def test_integer_leaves_are_named():
  tx = dl.distributed_lion(1e-3)
  with pytest.raises(TypeError, match=r"params leaf \['step'\] has dtype "
                     "int32.*optax.masked"):
    tx.init({"w": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)})
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match=r"gradient leaf \['w'\] has dtype"):
    tx.update({"w": jnp.zeros(5, jnp.int32)}, state, PARAMS)


def test_mismatched_pytrees():
  tx = dl.scale_by_distributed_lion()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="does not match the optimizer state"):
    tx.update({"v": jnp.zeros(5)}, state)
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(4,\) but "
                     r"its momentum has shape \(5,\)"):
    tx.update({"w": jnp.zeros(4)}, state)


def test_state_from_another_optimizer():
  tx = dl.scale_by_distributed_lion()
  with pytest.raises(TypeError, match="DistributedLionState.*ScaleByAdamState"):
    tx.update(PARAMS, optax.scale_by_adam().init(PARAMS))
  with pytest.raises(TypeError, match="got dict"):
    tx.update(PARAMS, {"count": 0, "mu": PARAMS})
  # optax.lion's state has the same fields and meaning: switching is allowed.
  updates, _ = tx.update(PARAMS, optax.scale_by_lion().init(PARAMS))
  assert updates["w"].shape == (5,)


def test_field_widths_widen_with_the_worker_count():
  assert accounting.int_container(127) == jnp.int8
  assert accounting.int_container(128) == jnp.int16
  assert dl.wire_bits(200, comm="psum_int8") == pytest.approx(2 * 199 / 200
                                                              * 16)
  # psum counters: radix levels*N+1 always fits, words widen to uint32.
  for n in (2, 7, 64, 1000):
    radix = accounting.psum_radix(n, "ternary")
    assert radix ** dl.packing.digits_per_word(radix) <= 2**32


def test_wire_bits_rejects_bad_worker_counts():
  for bad in (0, -2, True, 4.0):
    with pytest.raises(ValueError, match=f"num_workers={bad!r}"):
      dl.wire_bits(bad)
  with pytest.raises(ValueError, match="Unknown comm='x'"):
    dl.wire_bits(4, comm="x")


def test_nan_votes_are_deterministic():
  """Binary: NaN votes -1 (it is not > 0); ternary: NaN abstains."""
  g = jnp.array([[np.nan, 1.0], [np.nan, 1.0], [np.nan, -1.0]])
  for vote, expected in (("binary", [-1.0, 1.0]), ("ternary", [0.0, 1.0])):
    tx = dl.scale_by_distributed_lion(axis_name="data", vote=vote)
    out = jax.vmap(lambda x: tx.update(x, tx.init(x))[0],
                   axis_name="data")(g)
    np.testing.assert_array_equal(out[0], expected)
