"""Resizing per-worker states (dlion_jax.elastic) against numpy: each new
row the mean of the old rows the policy names, counts and other alike
leaves from the first old row, N' = N the state itself."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax import parallel
from dlion_jax import transforms
import dlion_jax as dl
from jax.sharding import PartitionSpec as P
from messages import assert_names

SHAPES = {"w": (5, 7), "b": (3,)}


def stepped_state(tx, mesh, steps=3, dtype=np.float32, shard_axis=None):
  """The state after a few steps on random per-worker gradients: rows that
  differ by worker."""
  rng = np.random.default_rng(0)
  params = devices.replicate(
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
    params, state, _ = step(params, state, devices.shard_batch(
        batch, mesh, axis_name=axes))
  return params, state


def zero_params(mesh):
  """:data:`SHAPES` of zeros, replicated on ``mesh``."""
  return devices.replicate({k: np.zeros(s, np.float32)
                            for k, s in SHAPES.items()}, mesh)


def expected(rows: np.ndarray, groups) -> np.ndarray:
  """Each group's rows summed in order in float32, times 1/k, rounded;
  where the group's rows agree, their value."""
  def mean(group):
    total = np.zeros(rows.shape[1:], np.float32)
    for i in group:
      total = total + rows[i].astype(np.float32)
    alike = np.all(rows[group] == rows[group[0]], axis=0)
    return np.where(alike, rows[group[0]], (
        total * np.float32(1 / len(group))).astype(rows.dtype))
  return np.stack([rows[g[0]] if len(g) == 1 else mean(g) for g in groups])


@pytest.mark.parametrize("old,new", [(8, 4), (8, 2), (8, 3), (4, 8), (2, 8),
                                     (3, 6), (8, 1)])
@pytest.mark.parametrize("policy", elastic.RESIZE_POLICIES)
def test_rows_are_the_policys_means(old, new, policy):
  tx = dl.distributed_lion(1e-2, axis_name="data", error_feedback=True)
  _, state = stepped_state(tx, devices.data_mesh(old))
  mesh = devices.data_mesh(new)
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
  mesh = devices.data_mesh(4)
  params = zero_params(mesh)
  out = elastic.resize_worker_states(tx, state, params, mesh)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.device_set == set(mesh.devices.flat)


def test_rows_a_global_optimizer_keeps_alike_stay_alike():
  """AdamW behind pmean_gradients keeps one state on every worker: a group
  of 3 (8 -> 3) keeps it bit for bit. Was: (x + x + x) / 3, an ulp off on
  a third of the entries, and the workers' states then differed."""
  tx = optax.chain(transforms.pmean_gradients("data"), optax.adamw(1e-2))
  _, state = stepped_state(tx, devices.data_mesh(8))
  mesh = devices.data_mesh(3)
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
  _, state = stepped_state(tx, devices.data_mesh(8))
  mesh = devices.data_mesh(4)
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
  _, state = stepped_state(tx, devices.data_mesh(4))
  assert np.any(np.asarray(state[0].error["w"]))
  for n in (2, 4):
    mesh = devices.data_mesh(n)
    params = zero_params(mesh)
    out = elastic.resize_worker_states(tx, state, params, mesh,
                                       error="clear")
    assert not np.any(np.asarray(out[0].error["w"]))
    np.testing.assert_array_equal(
        np.asarray(out[0].mu["w"]),
        expected(np.asarray(state[0].mu["w"]), elastic.old_rows(4, n)))
  plain = dl.distributed_lion(1e-2, axis_name="data")
  mesh = devices.data_mesh(4)
  params = devices.replicate({"error": np.ones(3, np.float32)}, mesh)
  named = parallel.init_worker_states(plain, params, mesh)
  named = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x,
                       named)
  out = elastic.resize_worker_states(plain, named, devices.replicate(
      {"error": np.ones(3, np.float32)}, devices.data_mesh(2)),
      devices.data_mesh(2), error="clear")
  assert np.all(np.asarray(out[0].mu["error"]) == 1)


def test_readme_chain_and_bf16_momenta():
  """clip_by_global_norm, a masked weight decay and bf16 momenta: the
  momenta are averaged in float32 and rounded once; the rest is kept."""
  tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
      1e-2, weight_decay=0.1, axis_name="data", mu_dtype=jnp.bfloat16,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  _, state = stepped_state(tx, devices.data_mesh(8))
  mesh = devices.data_mesh(2)
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
  _, state = stepped_state(tx, devices.hybrid_mesh(2), shard_axis="fsdp")
  mesh = devices.hybrid_mesh(4)
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
  mesh = devices.hybrid_mesh(2)
  params = devices.replicate({"w": np.zeros((8, 6), np.float32)}, mesh)
  target = elastic.restore_target(tx, params, mesh, 4, shard_axis="fsdp")
  assert target[0].mu["w"].sharding.spec == P("data", "fsdp")
  target = elastic.restore_target(tx, params, mesh, 1, shard_axis="fsdp")
  assert target[0].mu["w"].sharding.spec == P(None, "fsdp")


def test_bad_arguments_name_the_fix():
  tx = dl.distributed_lion(1e-2, axis_name="data")
  mesh = devices.data_mesh(2)
  params = devices.replicate({"w": np.zeros(3, np.float32)}, mesh)
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
    elastic.resize_worker_states(tx, state, devices.replicate(
        {"w": np.zeros(4, np.float32)}, mesh), mesh)
  assert_names(e, "not the state tx makes for params", "(3,)", "(4,)")
  with pytest.raises(ValueError) as e:   # was: KeyError: 'batch'
    elastic.resize_worker_states(tx, state, params, mesh, axis_name="batch")
  assert_names(e, "axis_name='batch'")
  with pytest.raises(ValueError) as e:
    elastic.old_rows(0, 4)
  assert_names(e, "num_old=0", "positive int")


def explicit(mesh):
  """``mesh``'s devices and axes, every axis Explicit."""
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(
      jax.sharding.AxisType.Explicit,) * len(mesh.axis_names))


@pytest.mark.parametrize("old,new,shard_axis", [
    (8, 4, None), (4, 4, None), ((4, 2), (2, 4), None),
    ((2, 4), (4, 2), "fsdp")] + [   # the rest under -m slow
        pytest.param(*c, marks=pytest.mark.slow) for c in [
            (2, 8, None), ((2, 4), (2, 4), None), ((2, 4), (2, 4), "fsdp"),
            ((4, 2), (2, 4), "fsdp")]], ids=str)
def test_explicit_meshes_resize_as_auto_ones(old, new, shard_axis):
  """On an Explicit mesh (data only; data x fsdp with and without a
  shard_axis) the resized state is the Auto mesh's, bit for bit, placed as
  init_worker_states places it there. Was, N' = N included: a
  ShardingTypeError, "slicing on sharded dims ... i32[4@data]"."""
  mesh_of = lambda n: (devices.data_mesh(n) if isinstance(n, int) else
                       devices.hybrid_mesh(n[0]))
  tx = dl.distributed_lion(1e-2, axis_name="data", error_feedback=True)
  _, state = stepped_state(tx, mesh_of(old), shard_axis=shard_axis)
  auto = mesh_of(new)
  want = elastic.resize_worker_states(tx, state, zero_params(auto), auto,
                                      shard_axis=shard_axis)
  mesh = explicit(auto)
  params = zero_params(mesh)
  rows = np.shape(state[0].count)[0]
  target = elastic.restore_target(tx, params, mesh, rows,
                                  shard_axis=shard_axis)
  for given in (state, jax.device_put(state, jax.tree.map(
      lambda x: x.sharding, target))):
    out = elastic.resize_worker_states(tx, given, params, mesh,
                                       shard_axis=shard_axis)
    again = parallel.init_worker_states(tx, params, mesh,
                                        shard_axis=shard_axis)
    for got, w, placed in zip(jax.tree.leaves(out), jax.tree.leaves(want),
                              jax.tree.leaves(again)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
      assert got.sharding == placed.sharding and got.dtype == placed.dtype


def per_worker_values(state, seed=1):
  """``state`` with each float leaf's rows drawn at random (rows that differ
  by worker) and each int leaf 3 (a step count), placed as it was."""
  rng = np.random.default_rng(seed)
  def draw(x):
    value = (np.full(x.shape, 3, x.dtype) if jnp.issubdtype(x.dtype,
                                                            jnp.integer)
             else rng.normal(size=x.shape).astype(x.dtype))
    return jax.device_put(value, x.sharding)
  return jax.tree.map(draw, state)


def assert_same_leaves(got, want):
  """Equal values, bit for bit, and placements."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.sharding == w.sharding


def test_an_nnx_optimizers_state_resizes_like_its_optax_state():
  """The nnx.State of an nnx.Optimizer stacked with stack_for_workers (the
  Flax NNX guide's): its optax state resized as the plain optax state is,
  its step counter kept on each new worker, and it runs the guide's step.
  Was: "state is not the state tx makes for params", listing two identical
  leaf lists (the fifth leaf, the optimizer's step, cut off)."""
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x):
      return self.up(x)

  tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
      1e-2, axis_name="data", error_feedback=True))
  mesh, mesh4 = devices.data_mesh(8), devices.data_mesh(4)
  model = Model(nnx.Rngs(0))
  opt_def, opt_state = nnx.split(nnx.Optimizer(model, tx, wrt=nnx.Param))
  opt_state = per_worker_values(devices.stack_for_workers(opt_state, mesh))
  params = nnx.state(model, nnx.Param)
  # The same values as the plain optax state, read off the nnx.State.
  lion = opt_state["opt_state"][1][0]
  plain = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  plain = (plain[0], (plain[1][0]._replace(
      count=lion["count"][...],
      mu=jax.tree.map(lambda v: v[...], lion["mu"]),
      error=jax.tree.map(lambda v: v[...], lion["error"])),))
  params4 = devices.replicate(params, mesh4)
  out = elastic.resize_worker_states(tx, opt_state, params4, mesh4)
  want = elastic.resize_worker_states(tx, plain, params4, mesh4)
  got = out["opt_state"][1][0]
  assert_same_leaves([got["count"][...], got["mu"], got["error"]],
                     [want[1][0].count, want[1][0].mu, want[1][0].error])
  step = out["step"][...]
  np.testing.assert_array_equal(np.asarray(step), np.full(4, 3, np.uint32))
  assert step.sharding == jax.NamedSharding(mesh4, P("data"))
  assert type(out) is type(opt_state)

  def train_step(model_state, opt_state, batch):
    model = nnx.merge(model_def, model_state)
    optimizer = nnx.merge(opt_def, opt_state)
    grads = nnx.grad(lambda m: jnp.mean(m(batch) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state(model), nnx.state(optimizer)
  model_def, model_state = nnx.split(model)
  run = jax.jit(parallel.per_worker(
      train_step, mesh4, ins=("replicated", "stacked", "split"),
      outs=("replicated", "stacked")))
  _, after = run(devices.replicate(model_state, mesh4), out,
                 devices.shard_batch(np.ones((8, 4), np.float32), mesh4))
  np.testing.assert_array_equal(np.asarray(after["step"][...]),
                                np.full(4, 4, np.uint32))
  # restore_target of such a state: its stacked leaves with the old rows.
  target = elastic.restore_target(tx, params4, mesh4, 8, state=out)
  shapes = [x.shape for x in jax.tree.leaves(target)]
  assert sorted(shapes) == sorted((8,) + x.shape[1:]
                                  for x in jax.tree.leaves(out))


def test_a_linen_train_states_opt_state_resizes_the_rest_kept():
  """A flax TrainState whose opt_state is stacked per worker (the Linen
  guide's): opt_state resized as the plain optax state, params and step
  kept, moved onto the new mesh's devices (they were on the 8 devices of
  the old). Was: "state is not the state tx makes for params"."""
  train_state = pytest.importorskip("flax.training.train_state")
  tx = dl.distributed_lion(1e-2, axis_name="data")
  params, state = stepped_state(tx, devices.data_mesh(8))
  ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  ts = ts.replace(step=jnp.int32(3), opt_state=state)
  mesh = devices.data_mesh(2)
  params2 = zero_params(mesh)
  out = elastic.resize_worker_states(tx, ts, params2, mesh)
  assert_same_leaves(out.opt_state, elastic.resize_worker_states(
      tx, state, params2, mesh))
  for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ts.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == jax.NamedSharding(mesh, P())
  assert int(out.step) == 3 and out.step.sharding.mesh == mesh
  assert out.tx is tx


def test_a_state_holding_another_optimizers_state_is_refused():
  """What holds no state of tx (another optimizer's TrainState) is refused
  naming the first leaf that differs; an nnx.Optimizer resized with a part
  of its tx, naming the leaf it does not know."""
  train_state = pytest.importorskip("flax.training.train_state")
  tx = dl.distributed_lion(1e-2, axis_name="data")
  mesh = devices.data_mesh(2)
  params = zero_params(mesh)
  adam = optax.adam(1e-2)
  ts = train_state.TrainState.create(apply_fn=None, params=params, tx=adam)
  ts = ts.replace(opt_state=parallel.init_worker_states(adam, params, mesh))
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_states(tx, ts, params, mesh)
  assert_names(e, "holds none", ".step: () int32", "tx.init(params)",
               "[0].count: () int32", "Resize with the optimizer")
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  both = optax.chain(optax.scale_by_adam(), tx)
  opt_state = devices.stack_for_workers(
      nnx.state(nnx.Optimizer(model, both, wrt=nnx.Param)), mesh)
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_states(
        tx, opt_state, devices.replicate(nnx.state(model, nnx.Param), mesh),
        mesh)
  assert_names(e, "more optimizer state", "['opt_state'][0]",
               "the whole optimizer")


def local_steps_run(tx, mesh, steps):
  """A local-steps run of ``steps`` on random per-worker gradients: each
  worker's own params (stacked) and the state."""
  rng = np.random.default_rng(1)
  params = devices.replicate(
      {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()},
      mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  params = devices.stack_for_workers(params, mesh)
  step = parallel.make_train_step(
      lambda p, b: sum(jnp.sum(p[k] * b[k]) for k in p), tx, mesh,
      donate=False, params_per_worker=True)
  for _ in range(steps):
    batch = {k: rng.normal(size=(mesh.size,) + s).astype(np.float32)
             for k, s in SHAPES.items()}
    params, state, _ = step(params, state, devices.shard_batch(batch, mesh))
  return params, state, step


@pytest.mark.parametrize("old,new", [(8, 3), (3, 8)])
def test_local_steps_params_and_state_resize_the_anchor_kept(old, new):
  """Mid-round (2 steps of a 3-step round): each new worker's params and
  inner and outer momenta are its group's means, the anchor is the old
  one bit for bit, and the new workers end the round on one anchor."""
  tx = dl.local_steps(optax.lion(1e-2), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0), every=3)
  params, state, _ = local_steps_run(tx, devices.data_mesh(old), 2)
  mesh = devices.data_mesh(new)
  groups = elastic.old_rows(old, new)
  new_params = elastic.resize_worker_params(params, mesh)
  new_state = elastic.resize_worker_states(
      tx, state, zero_params(mesh), mesh)
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(new_params[k]),
                                  expected(np.asarray(params[k]), groups))
    for part in ("inner_state", "outer_state"):
      np.testing.assert_array_equal(
          np.asarray(getattr(new_state, part)[0].mu[k]),
          expected(np.asarray(getattr(state, part)[0].mu[k]), groups))
    np.testing.assert_array_equal(
        np.asarray(new_state.anchor[k]),
        np.broadcast_to(np.asarray(state.anchor[k])[0], (new,) + SHAPES[k]))
  assert new_params["w"].sharding == devices.stack_for_workers(
      zero_params(mesh), mesh)["w"].sharding
  step = parallel.make_train_step(
      lambda p, b: sum(jnp.sum(p[k] * b[k]) for k in p), tx, mesh,
      donate=False, params_per_worker=True)
  batch = {k: np.ones((new,) + s, np.float32) for k, s in SHAPES.items()}
  ended, ended_state, _ = step(new_params, new_state,
                               devices.shard_batch(batch, mesh))
  for k in SHAPES:       # the round's last step: every worker on the anchor
    np.testing.assert_array_equal(np.asarray(ended[k]),
                                  np.asarray(ended_state.anchor[k]))
    assert len({np.asarray(r).tobytes() for r in ended[k]}) == 1


def test_worker_params_keep_their_values_at_the_same_count_and_need_rows():
  tx = dl.local_steps(optax.sgd(0.1), dl.rounds.nesterov_outer(0.7),
                      every=4)
  params, _, _ = local_steps_run(tx, devices.data_mesh(4), 1)
  same = elastic.resize_worker_params(params, devices.data_mesh(4))
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(same[k]), np.asarray(params[k]))
  with pytest.raises(ValueError) as e:
    elastic.resize_worker_params(zero_params(devices.data_mesh(2)),
                                 devices.data_mesh(2))
  assert_names(e, "stacked for their workers", "stack_for_workers")


def test_worker_params_sharded_inside_a_node_stay_so():
  """FSDP params of a hybrid mesh, a row per node: the target and the
  resized rows keep each row's sharding over the node's devices (was:
  whole on every device, silently)."""
  mesh = devices.hybrid_mesh(2)
  params = devices.stack_for_workers(devices.shard_params(
      {"w": jnp.ones((8, 12))}, mesh, "fsdp"), mesh)
  want = params["w"].sharding.spec
  assert "fsdp" in shards_of(want)
  assert elastic.resize_worker_params(params, mesh)["w"].sharding.spec == want
  target = elastic.worker_params_target(params, mesh, 4)["w"]
  assert target.shape == (4, 8, 12) and target.sharding.spec[1:] == want[1:]


def shards_of(spec):
  return {a for entry in spec if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}


@pytest.mark.parametrize("old,new", [(8, 4), (8, 3), (4, 8)])
def test_local_steps_params_resize_on_explicit_meshes_and_under_set_mesh(
    old, new):
  """A local-steps run of the plain jitted step (Explicit axes, under
  ``jax.set_mesh``): its per-worker params and its state resize to N'
  workers as on Auto axes, bit for bit, placed on the Explicit mesh. Was:
  ShardingTypeError "slicing on sharded dims" for the params at N' != N,
  and under set_mesh "context mesh ... should match the aval mesh" for
  params and state, N' = N included."""
  tx = dl.local_steps(optax.lion(1e-2), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0), every=3)
  params, state, _ = local_steps_run(tx, devices.data_mesh(old), 2)
  auto = devices.data_mesh(new)
  want_p = elastic.resize_worker_params(params, auto)
  want_s = elastic.resize_worker_states(tx, state, zero_params(auto), auto)
  mesh = explicit(auto)
  with jax.set_mesh(mesh):
    got_p = elastic.resize_worker_params(params, mesh)
    got_s = elastic.resize_worker_states(tx, state, zero_params(mesh), mesh)
    same_p = elastic.resize_worker_params(got_p, mesh)        # N' = N
    same_s = elastic.resize_worker_states(tx, got_s, zero_params(mesh),
                                          mesh)
  for got, want in ((got_p, want_p), (got_s, want_s), (same_p, want_p),
                    (same_s, want_s)):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                    strict=True):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
      assert g.sharding.mesh == mesh and g.sharding.spec == w.sharding.spec


@pytest.mark.parametrize("shape", [(4,), (4, 2)], ids=str)
def test_an_nnx_optimizer_resized_in_memory_steps_on_the_new_mesh(shape):
  """The Flax NNX guide's plain nnx.jit step (``dl.workers.stacked(tx)``
  under ``jax.set_mesh``), its optimizer's state resized in memory from 8
  workers to 4, on 4 devices or on a 4 x 2 mesh of the same 8: every leaf
  on the new mesh (the optimizer's own unstacked ``step`` included) and
  the guide's step runs there. Was: "context mesh ... should match the
  aval mesh" in the resize, and once past it "incompatible devices" in
  the next step (the step counter left on the 8 devices), or on the same
  devices "context mesh ... should match" (left on the old mesh)."""
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
      return self.up(x)

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(1e-2, axis_name="data"))
  mesh8 = explicit(devices.data_mesh(8))
  mesh4 = explicit(devices.data_mesh(4) if len(shape) == 1 else
                   devices.hybrid_mesh(4))
  with jax.set_mesh(mesh8):
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dl.workers.stacked(tx), wrt=nnx.Param)
  opt_def, opt_state = nnx.split(optimizer)
  model_def, model_state = nnx.split(model)

  @nnx.jit
  def train_step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(params, rows):
      return jnp.mean(nnx.merge(graphdef, params, rest)(rows) ** 2)
    losses, grads = dl.workers.value_and_grad(loss_of)(params, batch)
    optimizer.update(model, grads)
    return losses.mean()

  with jax.set_mesh(mesh4):
    state4 = jax.device_put(model_state, jax.NamedSharding(mesh4, P()))
    resized = elastic.resize_worker_states(
        tx, opt_state, nnx.state(nnx.merge(model_def, state4), nnx.Param),
        mesh4)
    assert all(x.sharding.mesh == mesh4 for x in jax.tree.leaves(resized))
    assert resized["opt_state"][1][0]["mu"]["up"]["kernel"][...].shape == (
        4, 4, 3)
    model4 = nnx.merge(model_def, state4)
    optimizer4 = nnx.merge(opt_def, resized)
    batch = devices.shard_batch(np.ones((8, 4), np.float32), mesh4)
    assert np.isfinite(float(train_step(model4, optimizer4, batch)))
  assert int(optimizer4.step[...]) == 1
