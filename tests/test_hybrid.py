"""Hybrid meshes: exact reduction over the fast axis, vote over the slow one.

``make_train_step(..., shard_axis=...)`` on an (n nodes, k devices) mesh must
equal flat Distributed Lion over the n nodes, each fed its node's mean
gradient, bit for bit against the numpy reference: params every step and
every node's momentum at the end, for leaves not divisible by k. With the
L1-scaled quantizers, whose scale sums the shards' sums, a large leaf may
differ within the rounding of that scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlion_jax as dl
from dlion_jax import parallel
from dlion_jax import quantize
from dlion_jax import shards
from messages import assert_names
from tests.reference import DistributedLionReference

SHAPES = {"b": (3,), "big": (37,), "w": (5, 7)}
STEPS = 3


def hybrid_mesh(nodes, per_node):
  return parallel.hybrid_mesh(nodes, devices=jax.devices()[:nodes * per_node])


def linear_loss(params, batch):
  """Gradient = the sum of the device's batch rows (here: one row)."""
  return sum(jnp.sum(params[k] * batch[k]) for k in params)


def node_means(rows, nodes, per_node):
  """rows[k]: [nodes * per_node, *shape] -> per node the mean, as the step
  takes it: an exact sum of small integers, times 1/k in the leaf's dtype."""
  def mean(v):
    return v.sum(axis=0, dtype=np.float32).astype(v.dtype) * v.dtype.type(
        1 / per_node)
  return [{k: mean(v[i * per_node:(i + 1) * per_node])
           for k, v in rows.items()} for i in range(nodes)]


def momenta(state, params, nodes, per_node):
  """Every node's whole momentum, rebuilt from its devices' shards."""
  mu = state[0].mu
  out = []
  for i in range(nodes):
    node = {}
    for k, p in params.items():
      rows = np.asarray(mu[k])[i * per_node:(i + 1) * per_node]
      node[k] = rows.reshape(-1)[:p.size].reshape(p.shape)
    out.append(node)
  return out


CASES = [(2, 4, "auto", np.float32), (3, 2, "auto", np.float32),
         (1, 8, "auto", np.float32), (8, 1, "auto", np.float32),
         (2, 4, "auto", jnp.bfloat16), (3, 2, "alltoall", np.float32),
         (3, 2, "allgather", np.float32), (2, 3, "psum", np.float32),
         (2, 3, "psum_int8", jnp.bfloat16), (4, 2, "alltoall", jnp.bfloat16)]


@pytest.mark.parametrize("nodes,per_node,comm,dtype", CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_equals_flat_dlion_on_node_means(nodes, per_node, comm, dtype,
                                         aggregation):
  check_against_reference(nodes, per_node, dtype, aggregation=aggregation,
                          comm=comm)


def test_momentum_sync_on_shards():
  """Lion Cub's momentum sync averages each shard over the nodes: the same
  as syncing whole momenta (2 nodes: their f32 mean is exact)."""
  check_against_reference(2, 3, np.float32, momentum_sync=2)


def check_against_reference(nodes, per_node, dtype, **options):
  """STEPS hybrid steps equal the numpy reference on node means."""
  rng = np.random.default_rng(nodes * 10 + per_node)
  mesh = hybrid_mesh(nodes, per_node)
  params = {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}
  tx = dl.distributed_lion(1e-2, axis_name="data", **options)
  sync = options.get("momentum_sync")
  same = {k: v for k, v in options.items()
          if k in ("aggregation", "quantizer", "bits", "min_compress_size",
                   "error_feedback")}
  ref = DistributedLionReference(
      params, nodes, sync_steps=range(sync, STEPS + 1, sync) if sync else (),
      **same)
  p = parallel.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  for _ in range(STEPS):
    rows = {k: rng.integers(-3, 4, size=(nodes * per_node,) + s).astype(
        dtype) for k, s in SHAPES.items()}
    batch = jax.device_put(rows, jax.sharding.NamedSharding(
        mesh, jax.P(("data", "fsdp"))))
    p, state, _ = step(p, state, batch)
    ref.step(node_means(rows, nodes, per_node))
    for k in params:
      np.testing.assert_array_equal(np.asarray(p[k]), ref.params[k])
  for got, want in zip(momenta(state, params, nodes, per_node), ref.mu):
    for k in params:
      np.testing.assert_array_equal(got[k], want[k])


def test_shards_round_trip():
  """own_shards then all_gather_leaves gives the leaves back, any size."""
  mesh = hybrid_mesh(1, 8)
  tree = {"a": jnp.arange(13.0), "b": jnp.ones((2, 3), jnp.bfloat16),
          "c": jnp.arange(8.0).reshape(2, 4)}
  fn = parallel.per_worker(
      lambda t: shards.all_gather_leaves(shards.own_shards(t, "fsdp"), t,
                                         "fsdp"),
      mesh, axis_name="fsdp", ins=("replicated",), outs="replicated")
  out = jax.jit(fn)(tree)
  for k in tree:
    assert out[k].dtype == tree[k].dtype
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))


@pytest.mark.parametrize("option", [
    {"quantizer": "ternary_l1"}, {"quantizer": "pbit_l1", "bits": 3},
    {"quantizer": "ternary_l1", "aggregation": "avg", "comm": "psum"},
    {"min_compress_size": 30}, {"error_feedback": True},
    {"quantizer": "pbit_l1", "bits": 4, "error_feedback": True}],
    ids=str)
def test_whole_leaf_options_see_whole_leaves(option):
  """Lion Cub's L1 scales (votes, error feedback) are taken over the whole
  leaf (a psum over the shard axis) and min_compress_size tests the whole
  leaf's size: the same as flat D-Lion on node means."""
  check_against_reference(3, 2, np.float32, **option)


def test_apply_if_finite_skips_the_step_on_every_device():
  """A NaN in one device's shard of one node: every device of both axes
  skips (params unchanged everywhere, one count), then steps together."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.apply_if_finite(dl.distributed_lion(1e-2, axis_name="data"), 3,
                          axis_name="data")
  params = {"w": np.linspace(-1, 1, 11).astype(np.float32)}
  p = parallel.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  sharding = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
  rows = np.ones((8, 11), np.float32)
  rows[5, 10] = np.nan           # node 1, device 1: the last shard's owner
  p, state, _ = step(p, state, jax.device_put({"w": rows}, sharding))
  np.testing.assert_array_equal(np.asarray(p["w"]), params["w"])
  assert np.all(np.asarray(state.notfinite_count) == 1)
  p, state, _ = step(p, state, jax.device_put({"w": np.ones((8, 11),
                                                            np.float32)},
                                              sharding))
  assert np.all(np.asarray(state.notfinite_count) == 0)
  assert np.all(np.asarray(p["w"]) < params["w"])


def test_hybrid_mesh_rows_and_errors():
  mesh = parallel.hybrid_mesh(2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
  assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
  with pytest.raises(ValueError, match=r"nodes=3 .*dividing the 8 devices"):
    parallel.hybrid_mesh(3)


def test_size_one_fast_axis_is_the_flat_step():
  """shard_axis of size 1 is today's make_train_step, bit for bit."""
  rng = np.random.default_rng(3)
  params = {k: rng.normal(size=s).astype(np.float32)
            for k, s in SHAPES.items()}
  rows = [{k: rng.normal(size=(8,) + s).astype(np.float32)
           for k, s in SHAPES.items()} for _ in range(STEPS)]
  tx = dl.distributed_lion(1e-2, axis_name="data", aggregation="avg")
  out = []
  for mesh, shard_axis in ((parallel.data_mesh(8), None),
                           (hybrid_mesh(8, 1), "fsdp")):
    axes = "data" if shard_axis is None else ("data", "fsdp")
    p = parallel.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
    step = parallel.make_train_step(linear_loss, tx, mesh,
                                    shard_axis=shard_axis)
    for batch in rows:
      batch = jax.device_put(batch, jax.sharding.NamedSharding(
          mesh, jax.P(axes)))
      p, state, _ = step(p, state, batch)
    out.append(jax.device_get((p, state[0].mu)))
  (flat_p, flat_mu), (hybrid_p, hybrid_mu) = out
  for k in SHAPES:
    np.testing.assert_array_equal(hybrid_p[k], flat_p[k])
    np.testing.assert_array_equal(hybrid_mu[k], flat_mu[k].reshape(8, -1))


def test_micro_batches_average_before_the_scatter():
  """micro_batches=2 on a hybrid mesh: each device averages its two
  micro-batches' gradients, then the node mean; the same as one batch."""
  mesh = hybrid_mesh(2, 2)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  rng = np.random.default_rng(5)
  params = {"w": rng.normal(size=(7,)).astype(np.float32)}
  rows = rng.integers(-3, 4, size=(4, 7)).astype(np.float32)
  doubled = np.repeat(rows, 2, axis=0)          # each device: its row twice
  split = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp")))
  results = []
  for batch, micro in ((rows, 1), (doubled, 2)):
    p = parallel.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
    step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                    micro_batches=micro)
    p, state, _ = step(p, state, jax.device_put({"w": batch}, split))
    results.append((np.asarray(p["w"]), np.asarray(state[0].mu["w"])))
  for got, want in zip(results[1], results[0]):   # params, then momenta
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(results[0][0], params["w"])


@pytest.mark.parametrize("comm", ["alltoall", "psum"])
def test_check_vma_true_gives_the_same_step(comm):
  """With check_vma=True JAX proves the gathered params replicated; the
  step is the same as without the check."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data", comm=comm)
  params = {"w": np.linspace(-1, 1, 11).astype(np.float32)}
  rows = np.random.default_rng(0).normal(size=(8, 11)).astype(np.float32)
  batch = jax.device_put({"w": rows}, jax.sharding.NamedSharding(
      mesh, jax.P(("data", "fsdp"))))
  out = []
  for check_vma in (False, True):
    p = parallel.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
    step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                    check_vma=check_vma)
    out.append(np.asarray(step(p, state, batch)[0]["w"]))
  np.testing.assert_array_equal(out[1], out[0])


def test_large_leaf_l1_votes_within_the_rounding_of_the_scale():
  """On a leaf of 2,000,003 elements the L1 scale, a sum of the shards'
  sums, may round unlike one sum over the leaf: the hybrid step equals flat
  D-Lion over the nodes except for votes one level apart where ``L c / a``
  lies on a rounding boundary (here one coordinate, at step 3). The
  momenta, which no scale touches, stay equal bit for bit."""
  size, nodes, per_node, lr, level = 2_000_003, 2, 4, 1e-2, 127
  rng = np.random.default_rng(2)
  params = {"w": rng.normal(size=size).astype(np.float32)}
  tx = dl.distributed_lion(lr, axis_name="data", quantizer="pbit_l1", bits=8,
                           aggregation="avg")
  hybrid = trainer(tx, params, hybrid_mesh(nodes, per_node), "fsdp")
  flat = trainer(tx, params, parallel.data_mesh(nodes), None)
  one_level = lr / (nodes * level)     # a vote's level moves Avg by 1/(N L)
  for t in range(1, 4):
    rows = rng.integers(-3, 4, size=(nodes * per_node, size)).astype(
        np.float32)
    means = node_means({"w": rows}, nodes, per_node)
    (p, hybrid_mu), (q, flat_mu) = hybrid(rows), flat(
        np.stack([m["w"] for m in means]))
    moved = np.abs(p - q) / one_level
    assert np.count_nonzero(moved) <= 5, t
    assert moved.max() <= t * 1.01, t   # at most one level a step
  np.testing.assert_array_equal(hybrid_mu.reshape(nodes, -1)[:, :size],
                                flat_mu)


def trainer(tx, params, mesh, shard_axis):
  """``advance(rows) -> (params["w"], momenta)``: one step of a run of
  ``linear_loss`` on ``mesh``, one row per worker."""
  p = parallel.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis=shard_axis)
  axes = "data" if shard_axis is None else ("data", shard_axis)

  def advance(rows):
    nonlocal p, state
    p, state, _ = step(p, state, parallel.shard_batch({"w": rows}, mesh,
                                                      axis_name=axes))
    return np.asarray(p["w"]), np.asarray(state[0].mu["w"])
  return advance


def test_l1_scale_of_shards_within_an_ulp_of_the_whole_leaf():
  """The scale of a 2,000,003-element leaf cut in 4 shards, against the
  whole leaf's: at most an ulp apart (the two orders of addition)."""
  size = 2_000_003
  mesh = hybrid_mesh(1, 4)
  fn = jax.jit(parallel.per_worker(
      lambda c: quantize.l1_scale(shards.own_shards(c, "fsdp"),
                                  shards.LeafShard("fsdp", size)),
      mesh, axis_name="fsdp", ins=("replicated",), outs="replicated"))
  rng = np.random.default_rng(0)
  for _ in range(4):
    c = rng.normal(size=size).astype(np.float32)
    np.testing.assert_array_max_ulp(np.asarray(fn(c)),
                                    np.asarray(jax.jit(quantize.l1_scale)(c)),
                                    maxulp=1)


def test_state_built_without_shard_axis_names_it():
  """Was: "Build it with parallel.init_worker_states(...)", which the user
  had called, only without shard_axis."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = parallel.replicate({"w": np.ones(11, np.float32)}, mesh)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp")
  batch = parallel.shard_batch({"w": np.ones((8, 11), np.float32)}, mesh,
                               axis_name=("data", "fsdp"))
  with pytest.raises(ValueError) as e:
    step(p, parallel.init_worker_states(tx, p, mesh), batch)
  assert_names(e, "shape (2,)", "size 8",
               "parallel.init_worker_states(tx, params, mesh, "
               "shard_axis='fsdp')")


@pytest.mark.parametrize("build", ["make_train_step", "init_worker_states"])
def test_shard_axis_misuse_names_shard_axis(build):
  """Was: a shard_axis not in the mesh was reported as axis_name; the same
  axis twice raised jax's DuplicateSpecError from init_worker_states and
  was accepted by make_train_step (4 "workers" on 2 devices)."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = parallel.replicate({"w": np.ones(11, np.float32)}, mesh)
  call = {"make_train_step": lambda s: parallel.make_train_step(
              linear_loss, tx, mesh, shard_axis=s),
          "init_worker_states": lambda s: parallel.init_worker_states(
              tx, p, mesh, shard_axis=s)}[build]
  with pytest.raises(ValueError) as e:
    call("model")
  assert_names(e, "shard_axis='model' is not an axis of the mesh",
               "('data', 'fsdp')")
  with pytest.raises(ValueError) as e:
    call("data")
  assert_names(e, "shard_axis='data' is also axis_name='data'", "'fsdp'")
