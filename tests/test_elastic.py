"""Resizing per-worker states (dlion_jax.elastic) against numpy: each new
row the mean of the old rows the policy names, counts and other alike
leaves from the first old row, N' = N the state itself."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlion_jax as dl
from dlion_jax import elastic
from dlion_jax import parallel
from jax.sharding import PartitionSpec as P
from messages import assert_names

SHAPES = {"w": (5, 7), "b": (3,)}


def stepped_state(tx, mesh, steps=3, dtype=np.float32, shard_axis=None):
  """The state after a few steps on random per-worker gradients: rows that
  differ by worker."""
  rng = np.random.default_rng(0)
  params = parallel.replicate(
      {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}, mesh)
  state = parallel.init_worker_states(tx, params, mesh,
                                      shard_axis=shard_axis)
  step = parallel.make_train_step(
      lambda p, b: sum(jnp.sum(p[k] * b[k]) for k in p), tx, mesh,
      shard_axis=shard_axis, donate=False)
  axes = ("data", shard_axis) if shard_axis else "data"
  for _ in range(steps):
    batch = {k: rng.normal(size=(mesh.size,) + s).astype(dtype)
             for k, s in SHAPES.items()}
    params, state, _ = step(params, state, parallel.shard_batch(
        batch, mesh, axis_name=axes))
  return params, state


def zero_params(mesh):
  """:data:`SHAPES` of zeros, replicated on ``mesh``."""
  return parallel.replicate({k: np.zeros(s, np.float32)
                             for k, s in SHAPES.items()}, mesh)


def expected(rows: np.ndarray, groups) -> np.ndarray:
  """Each group's rows summed in order in float32, times 1/k, rounded."""
  def mean(group):
    total = np.zeros(rows.shape[1:], np.float32)
    for i in group:
      total = total + rows[i].astype(np.float32)
    return (total * np.float32(1 / len(group))).astype(rows.dtype)
  return np.stack([rows[g[0]] if len(g) == 1 else mean(g) for g in groups])


@pytest.mark.parametrize("old,new", [(8, 4), (8, 2), (8, 3), (4, 8), (2, 8),
                                     (3, 6), (8, 1)])
@pytest.mark.parametrize("policy", elastic.RESIZE_POLICIES)
def test_rows_are_the_policys_means(old, new, policy):
  tx = dl.distributed_lion(1e-2, axis_name="data", error_feedback=True)
  _, state = stepped_state(tx, parallel.data_mesh(old))
  mesh = parallel.data_mesh(new)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh, policy=policy)
  groups = elastic.old_rows(old, new, policy)
  for field in ("mu", "error"):
    for k in SHAPES:
      np.testing.assert_array_equal(
          np.asarray(getattr(out[0], field)[k]),
          expected(np.asarray(getattr(state[0], field)[k]), groups))
  np.testing.assert_array_equal(np.asarray(out[0].count),
                                np.full(new, np.asarray(state[0].count)[0]))
  again = parallel.init_worker_states(tx, params, mesh)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(again)):
    assert got.shape == want.shape and got.sharding == want.sharding


def test_same_count_keeps_every_value_and_places_it_on_the_mesh():
  """N' = N: the same values, bit for bit, on the mesh's devices. Was: the
  state itself, still on the old devices (the next step refused it)."""
  tx = dl.distributed_lion(1e-2, axis_name="data")
  _, state = stepped_state(tx, jax.sharding.Mesh(
      np.array(jax.devices()[4:]), ("data",)))
  mesh = parallel.data_mesh(4)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.device_set == set(mesh.devices.flat)


def test_rows_a_global_optimizer_keeps_alike_stay_alike():
  """AdamW behind pmean_gradients keeps one state on every worker: a group
  of 3 (8 -> 3) keeps it bit for bit. Was: (x + x + x) / 3, an ulp off on
  a third of the entries, and the workers' states then differed."""
  tx = optax.chain(parallel.pmean_gradients("data"), optax.adamw(1e-2))
  _, state = stepped_state(tx, parallel.data_mesh(8))
  mesh = parallel.data_mesh(3)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh)
  for got, old in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
    got, old = np.asarray(got), np.asarray(old)
    for row in got:
      np.testing.assert_array_equal(row, old[0])


def test_masked_and_multi_transform_states_resize():
  """Was: a pytree structure error (optax.MaskedNode against a bool)."""
  tx = optax.multi_transform(
      {"vote": dl.distributed_lion(1e-2, axis_name="data"),
       "frozen": optax.set_to_zero()},
      {"w": "vote", "b": "frozen"})
  _, state = stepped_state(tx, parallel.data_mesh(8))
  mesh = parallel.data_mesh(4)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh)
  old_mu = optax.tree_utils.tree_get(state, "mu")
  mu = optax.tree_utils.tree_get(out, "mu")
  np.testing.assert_array_equal(
      np.asarray(mu["w"]), expected(np.asarray(old_mu["w"]),
                                    elastic.old_rows(8, 4)))


def test_error_feedback_cleared_on_request():
  """error="clear" zeroes the residuals, at N' = N too, and only they: a
  param named "error" keeps its momentum."""
  tx = dl.distributed_lion(1e-2, axis_name="data", error_feedback=True)
  _, state = stepped_state(tx, parallel.data_mesh(4))
  assert np.any(np.asarray(state[0].error["w"]))
  for n in (2, 4):
    mesh = parallel.data_mesh(n)
    params = zero_params(mesh)
    out = elastic.resize_worker_states(tx, state, params, mesh,
                                       error="clear")
    assert not np.any(np.asarray(out[0].error["w"]))
    np.testing.assert_array_equal(
        np.asarray(out[0].mu["w"]),
        expected(np.asarray(state[0].mu["w"]), elastic.old_rows(4, n)))
  plain = dl.distributed_lion(1e-2, axis_name="data")
  mesh = parallel.data_mesh(4)
  params = parallel.replicate({"error": np.ones(3, np.float32)}, mesh)
  named = parallel.init_worker_states(plain, params, mesh)
  named = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x,
                       named)
  out = elastic.resize_worker_states(plain, named, parallel.replicate(
      {"error": np.ones(3, np.float32)}, parallel.data_mesh(2)),
      parallel.data_mesh(2), error="clear")
  assert np.all(np.asarray(out[0].mu["error"]) == 1)


def test_readme_chain_and_bf16_momenta():
  """clip_by_global_norm, a masked weight decay and bf16 momenta: the
  momenta are averaged in float32 and rounded once; the rest is kept."""
  tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
      1e-2, weight_decay=0.1, axis_name="data", mu_dtype=jnp.bfloat16,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  _, state = stepped_state(tx, parallel.data_mesh(8))
  mesh = parallel.data_mesh(2)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh)
  mu = optax.tree_utils.tree_get(out, "mu")
  old_mu = optax.tree_utils.tree_get(state, "mu")
  assert mu["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(mu["w"]),
      expected(np.asarray(old_mu["w"]), elastic.old_rows(8, 2)))


def test_hybrid_state_changes_nodes():
  """A shard_axis state (a row per node, momenta sharded over fsdp) of 2
  nodes of 4, resized for 4 nodes of 2: placed as init_worker_states
  places it there, each node's momentum its old node's."""
  tx = dl.distributed_lion(1e-2, axis_name="data")
  _, state = stepped_state(tx, parallel.hybrid_mesh(2), shard_axis="fsdp")
  mesh = parallel.hybrid_mesh(4)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh,
                                     shard_axis="fsdp")
  np.testing.assert_array_equal(
      np.asarray(out[0].mu["w"]),
      expected(np.asarray(state[0].mu["w"]), [[0], [0], [1], [1]]))
  again = parallel.init_worker_states(tx, params, mesh, shard_axis="fsdp")
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(again)):
    assert got.sharding == want.sharding


def test_describe_says_what_it_did():
  assert elastic.describe(8, 4) == "momenta averaged in pairs"
  assert elastic.describe(8, 2) == "momenta averaged in groups of 4"
  assert elastic.describe(8, 3) == "momenta averaged in groups of 2 or 3"
  assert elastic.describe(4, 8) == "each momentum copied to 2 workers"
  assert elastic.describe(8, 4, "keep") == "momenta of the first 4 workers kept"
  assert elastic.describe(8, 4, "all") == (
      "every worker given the mean of the 8 momenta")
  assert elastic.describe(8, 4, error="clear") == (
      "momenta averaged in pairs, error feedback cleared")


def test_restore_target_places_rows_like_the_run():
  """A checkpoint's rows restore sharded as the new run shards its own (a
  hybrid momentum over fsdp), over the workers where they divide."""
  tx = dl.distributed_lion(1e-2, axis_name="data")
  mesh = parallel.hybrid_mesh(2)
  params = parallel.replicate({"w": np.zeros((8, 6), np.float32)}, mesh)
  target = elastic.restore_target(tx, params, mesh, 4, shard_axis="fsdp")
  assert target[0].mu["w"].sharding.spec == P("data", "fsdp")
  target = elastic.restore_target(tx, params, mesh, 1, shard_axis="fsdp")
  assert target[0].mu["w"].sharding.spec == P(None, "fsdp")


def test_bad_arguments_name_the_fix():
  tx = dl.distributed_lion(1e-2, axis_name="data")
  mesh = parallel.data_mesh(2)
  params = parallel.replicate({"w": np.zeros(3, np.float32)}, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_states(tx, state, params, mesh, policy="median")
  assert_names(e, "policy='median'", "'mean', 'all', 'keep'")
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_states(tx, state, params, mesh, error="drop")
  assert_names(e, "error='drop'", "'map', 'clear'")
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_states(tx, tx.init({"w": jnp.zeros(3)}), params,
                                 mesh)
  assert_names(e, "stacked", "init_worker_states")
  with pytest.raises(ValueError) as e:   # was: a device_put prefix error
    elastic.resize_worker_states(
        dl.distributed_lion(1e-2, axis_name="data", error_feedback=True),
        state, params, mesh)
  assert_names(e, "not the state tx makes for params", "the optimizer")
  with pytest.raises(ValueError) as e:   # was: silently accepted
    elastic.resize_worker_states(tx, state, parallel.replicate(
        {"w": np.zeros(4, np.float32)}, mesh), mesh)
  assert_names(e, "not the state tx makes for params", "(3,)", "(4,)")
  with pytest.raises(ValueError) as e:   # was: KeyError: 'batch'
    elastic.resize_worker_states(tx, state, params, mesh, axis_name="batch")
  assert_names(e, "axis_name='batch'")
  with pytest.raises(ValueError) as e:
    elastic.old_rows(0, 4)
  assert_names(e, "num_old=0", "positive int")
