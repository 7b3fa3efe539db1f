"""Placement helpers: meshes, replicated params, sharded batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dlion_jax import _mesh
from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl
from messages import assert_names

N = 4


def linear_loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"]) ** 2)


def one_step(params, loss_fn, mesh, batch):
  """One donating step from ``replicate(params, mesh)``; returns its loss."""
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh)
  _, _, loss = step(p, state, devices.shard_batch(batch, mesh))
  return float(loss)


def test_replicate_spares_single_device_arrays():
  """Was: params fresh from ``jnp.ones`` (one device) shared their buffer
  with shard 0 of the replicated copy; the donating step deleted them and
  the second ``replicate(p0, mesh)`` raised "Array has been deleted"."""
  mesh = devices.data_mesh(N)
  p0 = {"w": jnp.ones(3), "b": jnp.zeros(())}
  batch = {"x": jnp.ones((8, 3))}
  first = one_step(p0, linear_loss, mesh, batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(p0))
  assert one_step(p0, linear_loss, mesh, batch) == first   # a second run
  np.testing.assert_array_equal(np.asarray(p0["w"]), np.ones(3))


@pytest.mark.parametrize("placed", ["one_device", "replicated", "split"])
def test_replicate_never_returns_the_callers_buffers(placed):
  """No shard of the copy is a buffer of the input, wherever it lies."""
  mesh = devices.data_mesh(N)
  x = jnp.arange(8.0)
  if placed != "one_device":
    spec = jax.P() if placed == "replicated" else jax.P("data")
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  theirs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  out = devices.replicate({"x": x, "host": np.ones(2), "n": 3.0}, mesh)
  for leaf in jax.tree.leaves(out):
    assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == N
  ours = {s.data.unsafe_buffer_pointer() for s in out["x"].addressable_shards}
  assert not ours & theirs
  np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(8.0))


def test_nnx_model_runs_after_a_donating_step():
  """Was: ``nnx.split`` hands out the model's own arrays; after one step
  from ``replicate(state, mesh)`` the model no longer ran."""
  mesh = devices.data_mesh(N)
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  x = jnp.ones((8, 3))
  before = np.asarray(model(x))

  def loss_fn(params, batch):
    return jnp.mean(nnx.merge(graphdef, params)(batch["x"]) ** 2)

  assert np.isfinite(one_step(state, loss_fn, mesh, {"x": x}))
  np.testing.assert_array_equal(np.asarray(model(x)), before)
  assert np.isfinite(one_step(nnx.state(model), loss_fn, mesh, {"x": x}))


def test_hybrid_mesh_accepts_numpy_ints_and_refuses_bools():
  """Was: ``np.int64(2)`` was refused as not an int, and ``True`` raised
  numpy's "an integer is required"."""
  mesh = devices.hybrid_mesh(np.int64(2))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
  with pytest.raises(ValueError) as e:
    devices.hybrid_mesh(True)
  assert_names(e, "nodes=True", "positive int")


def test_data_mesh_refuses_bools():
  """Was: ``data_mesh(True)`` built a mesh of one worker."""
  assert devices.data_mesh(np.int64(2)).shape["data"] == 2
  with pytest.raises(ValueError) as e:
    devices.data_mesh(True)
  assert_names(e, "num_workers=True", "positive int")


def test_hybrid_mesh_refuses_one_name_for_both_axes():
  """Was: ``hybrid_mesh(2, shard_axis="data")`` built a mesh whose two axes
  had one name."""
  with pytest.raises(ValueError) as e:
    devices.hybrid_mesh(2, shard_axis="data")
  assert_names(e, "shard_axis='data'", "axis_name='data'",
               "different names")


def test_shard_batch_over_both_axes_of_a_hybrid_mesh():
  """Was: ``axis_name=("data", "fsdp")`` was reported as not an axis of a
  mesh whose axes are ``('data', 'fsdp')``."""
  mesh = devices.hybrid_mesh(2)
  rows = np.arange(16.0).reshape(8, 2)
  batch = devices.shard_batch({"x": rows}, mesh, axis_name=("data", "fsdp"))
  assert batch["x"].sharding.spec == jax.P(("data", "fsdp"))
  for device, shard in zip(mesh.devices.flat,
                           sorted(batch["x"].addressable_shards,
                                  key=lambda s: s.index[0].start)):
    assert shard.device == device
  with pytest.raises(ValueError) as e:
    devices.shard_batch({"x": rows[:6]}, mesh, axis_name=("data", "fsdp"))
  assert_names(e, "(6, 2)", "8 workers")


@pytest.mark.parametrize("axes,named", [
    (("data", "model"), "axis_name=('data', 'model'): 'model' is not an axis"),
    (("data", "data"), "names axis 'data' twice"),
    ("model", "axis_name='model' is not an axis")])
def test_axis_size_names_the_axis_at_fault(axes, named):
  mesh = devices.hybrid_mesh(2)
  with pytest.raises(ValueError) as e:
    _mesh.axis_size(mesh, axes)
  assert_names(e, named, "('data', 'fsdp')" if "twice" not in named else "")
