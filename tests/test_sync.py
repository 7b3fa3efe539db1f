"""What every worker decides alike, on meshes of two axes: momentum syncs
(dlion_jax.sync) under JAX's own check_vma typing, and dl.apply_if_finite's
skip, in the steps make_train_step builds."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl

SHAPES = {"w": (8, 3), "b": (3,)}


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def two_steps(mesh, shard_axis, zero3, check_vma):
  """Params and state after 2 steps of momentum_sync=2 (a sync at the
  second), on a fixed batch of 16 rows a step."""
  tx = dl.distributed_lion(1e-2, axis_name="data", momentum_sync=2)
  values = {k: np.linspace(-1, 1, np.prod(s)).reshape(s).astype(np.float32)
            for k, s in SHAPES.items()}
  params = (devices.shard_params(values, mesh) if zero3 else
            devices.replicate(values, mesh))
  state = parallel.init_worker_states(tx, params, mesh,
                                      shard_axis=shard_axis)
  step = parallel.make_train_step(loss_fn, tx, mesh, shard_axis=shard_axis,
                                  check_vma=check_vma, donate=False)
  rng = np.random.default_rng(0)
  for _ in range(2):
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
             "y": rng.normal(size=(16, 3)).astype(np.float32)}
    params, state, _ = step(params, state, devices.shard_batch(
        batch, mesh, axis_name=("data", shard_axis) if shard_axis
        else "data"))
  return params, state


# Every axis type x shard_axis x params at rest; a covering half in the
# core tier (each value twice), the rest under -m slow.
CORE = {(AxisType.Auto, None, False), (AxisType.Explicit, "fsdp", True),
        (AxisType.Explicit, None, True), (AxisType.Auto, "fsdp", False)}
LAYOUTS = [pytest.param(*c, marks=() if c in CORE else pytest.mark.slow)
           for c in itertools.product((AxisType.Auto, AxisType.Explicit),
                                      (None, "fsdp"), (False, True))]


@pytest.mark.parametrize("kind,shard_axis,zero3", LAYOUTS, ids=str)
def test_momentum_sync_with_check_vma_on_two_axes(kind, shard_axis, zero3):
  """A 2 x 4 ("data", "fsdp") mesh, Auto or Explicit, with or without
  shard_axis, params replicated or sharded at rest: check_vma=True gives
  check_vma=False's params and momenta bit for bit, the momenta synced.
  Was: "cond branches must have equal output types" (the means, averaged
  in a region without check_vma, typed alike on every worker; the
  skipped branch's momenta per worker)."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))
  want = two_steps(mesh, shard_axis, zero3, check_vma=False)
  got = two_steps(mesh, shard_axis, zero3, check_vma=True)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  for mu in jax.tree.leaves(got[1][0].mu):
    mu = np.asarray(mu)
    np.testing.assert_array_equal(mu[0], mu[1])     # synced at step 2


@pytest.mark.parametrize("kind,shard_axis,zero3", LAYOUTS, ids=str)
def test_apply_if_finite_reads_whole_leaves_on_two_axes(kind, shard_axis,
                                                        zero3):
  """As dl.apply_if_finite's docstring says: the check reads whole logical
  leaves, so a NaN in one device's rows (node 1's second device) that lands
  in another device's block of the leaf (the fourth's) skips the step on
  every device of both nodes, params unchanged, one count everywhere."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))
  tx = dl.apply_if_finite(dl.distributed_lion(1e-2, axis_name="data"), 3,
                          axis_name="data")
  values = {"w": np.linspace(-1, 1, 12).astype(np.float32)}
  params = (devices.shard_params(values, mesh) if zero3 else
            devices.replicate(values, mesh))
  state = parallel.init_worker_states(tx, params, mesh,
                                      shard_axis=shard_axis)
  step = parallel.make_train_step(
      lambda p, b: jnp.mean(p["w"] * b["w"]), tx, mesh,
      shard_axis=shard_axis, donate=False)
  rows = np.ones((8, 12), np.float32)
  rows[5, 11] = np.nan
  split = P(("data", shard_axis) if shard_axis else "data")
  params, state, _ = step(params, state, jax.device_put(
      {"w": rows}, NamedSharding(mesh, split)))
  np.testing.assert_array_equal(np.asarray(params["w"]), values["w"])
  for shard in state.notfinite_count.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), 1)
