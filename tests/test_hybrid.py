"""Hybrid meshes: data parallel inside a node, a vote across nodes.

``make_train_step(..., shard_axis=...)`` on an (n nodes, k devices) mesh:
each device differentiates its own rows, one reduce-scatter per leaf over
``shard_axis`` leaves it the node's mean gradient on its block, and the
optimizer runs on whole logical leaves, each device voting on its block.
It must equal flat Distributed Lion over the n nodes, each fed its node's
mean gradient, bit for bit against the numpy reference: params every step
and every node's momentum at the end, with params replicated (ZeRO-2) or
sharded at rest (ZeRO-3), on leaves the k devices divide and leaves they
do not. With the L1-scaled quantizers, whose scale sums the blocks' sums,
a large leaf may differ within the rounding of that scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _blocks
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl
from messages import assert_names
from tests.reference import DistributedLionReference
from tiers import slow_but

# "m" is cut over the fast devices (12 rows: k = 2, 3, 4), "w" where k is
# 2 or 4; no k here divides the others: their mean gradient is an
# all-reduce and the vote cuts them flat, zero-padded.
SHAPES = {"b": (3,), "big": (37,), "w": (5, 8), "m": (12, 6)}
STEPS = 3


def hybrid_mesh(nodes, per_node):
  return devices.hybrid_mesh(nodes, devices=jax.devices()[:nodes * per_node])


def linear_loss(params, batch):
  """Gradient = the sum of the device's batch rows (here: one row)."""
  return sum(jnp.sum(params[k] * batch[k]) for k in params)


def node_means(rows, nodes, per_node):
  """rows[k]: [nodes * per_node, *shape] -> per node the mean, as the step
  takes it: each row times 1/k (the leaf's dtype's, kept in float32 as
  XLA keeps it), summed in float32 (XLA:CPU's reduction), rounded once."""
  def mean(v):
    scale = np.float32(v.dtype.type(1 / per_node))
    return (v.astype(np.float32) * scale).sum(axis=0, dtype=np.float32
                                              ).astype(v.dtype)
  return [{k: mean(v[i * per_node:(i + 1) * per_node])
           for k, v in rows.items()} for i in range(nodes)]


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


@pytest.mark.parametrize("nodes,per_node,comm,dtype",
                         [(2, 4, "auto", np.float32),
                          (3, 2, "alltoall", jnp.bfloat16),
                          (2, 3, "psum", np.float32)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_params_sharded_at_rest_equal_the_reference(nodes, per_node, comm,
                                                    dtype, aggregation):
  """ZeRO-3: params placed by shard_params, gathered inside the step."""
  check_against_reference(nodes, per_node, dtype, zero3=True,
                          aggregation=aggregation, comm=comm)


def test_momentum_sync_on_shards():
  """Lion Cub's momentum sync averages each block over the nodes: the same
  as syncing whole momenta (2 nodes: their f32 mean is exact)."""
  check_against_reference(2, 3, np.float32, momentum_sync=2)


def check_against_reference(nodes, per_node, dtype, *, mesh=None,
                            zero3=False, specs=None, **options):
  """STEPS hybrid steps equal the numpy reference on node means."""
  rng = np.random.default_rng(nodes * 10 + per_node)
  mesh = mesh or hybrid_mesh(nodes, per_node)
  params = {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}
  tx = dl.distributed_lion(1e-2, axis_name="data", **options)
  sync = options.get("momentum_sync")
  same = {k: v for k, v in options.items()
          if k in ("aggregation", "vote", "quantizer", "bits",
                   "min_compress_size", "error_feedback")}
  ref = DistributedLionReference(
      params, nodes, sync_steps=range(sync, STEPS + 1, sync) if sync else (),
      **same)
  if specs is not None:
    p = {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P())))
         for k, v in params.items()}
  elif zero3:
    p = devices.shard_params(params, mesh)
  else:
    p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  split = NamedSharding(mesh, P(("data", "fsdp")))
  for _ in range(STEPS):
    rows = {k: rng.integers(-3, 4, size=(nodes * per_node,) + s).astype(
        dtype) for k, s in SHAPES.items()}
    p, state, _ = step(p, state, jax.device_put(rows, split))
    ref.step(node_means(rows, nodes, per_node))
    for k in params:
      np.testing.assert_array_equal(np.asarray(p[k]), ref.params[k],
                                    err_msg=k)
  for i, want in enumerate(ref.mu):
    for k in params:
      np.testing.assert_array_equal(np.asarray(state[0].mu[k])[i], want[k],
                                    err_msg=f"node {i} mu {k}")
  return p, state


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16],
                         ids=lambda x: x.__name__)
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_a_model_axis_beside_shard_axis_stays_the_compilers(kind, dtype):
  """data x fsdp x model: a leaf tensor parallel over "model" (and one
  over both fast axes, each on its own dimension) keeps its placement;
  the gradients are reduced over fsdp and the compiler owns "model".
  bf16 was: the process aborted (XLA:CPU cannot compile a bf16 reduction
  in a region manual over some axes only; such gradients are reduced in
  float32 there)."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(kind,) * 3)
  p, _ = check_against_reference(
      2, 2, dtype, mesh=mesh,
      specs={"m": P("fsdp", "model"), "w": P(None, "model")})
  assert p["m"].sharding.spec == P("fsdp", "model")
  assert p["w"].sharding.spec == P(None, "model")


@pytest.mark.parametrize("option", slow_but([
    {"vote": "ternary"}, {"vote": "ternary", "aggregation": "avg"},
    {"quantizer": "ternary_l1"}, {"quantizer": "pbit_l1", "bits": 3},
    {"quantizer": "ternary_l1", "aggregation": "avg", "comm": "psum"},
    {"min_compress_size": 30}, {"error_feedback": True},
    {"quantizer": "pbit_l1", "bits": 4, "error_feedback": True}], 0, 3, 6),
    ids=str)
def test_whole_leaf_options_see_whole_leaves(option):
  """Ternary votes; Lion Cub's L1 scales (votes, error feedback) taken
  over the whole leaf, min_compress_size testing the whole leaf's size,
  padding never voting: the same as flat D-Lion on node means."""
  check_against_reference(3, 2, np.float32, **option)
  check_against_reference(2, 4, np.float32, **option)


def test_apply_if_finite_skips_the_step_on_every_device():
  """A NaN in one device's rows of one node: every device of both axes
  skips (params unchanged everywhere, one count), then steps together."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.apply_if_finite(dl.distributed_lion(1e-2, axis_name="data"), 3,
                          axis_name="data")
  params = {"w": np.linspace(-1, 1, 12).astype(np.float32)}
  p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  sharding = NamedSharding(mesh, P(("data", "fsdp")))
  rows = np.ones((8, 12), np.float32)
  rows[5, 11] = np.nan           # node 1, device 1; the last block's entry
  p, state, _ = step(p, state, jax.device_put({"w": rows}, sharding))
  np.testing.assert_array_equal(np.asarray(p["w"]), params["w"])
  assert np.all(np.asarray(state.notfinite_count) == 1)
  p, state, _ = step(p, state, jax.device_put({"w": np.ones((8, 12),
                                                            np.float32)},
                                              sharding))
  assert np.all(np.asarray(state.notfinite_count) == 0)
  assert np.all(np.asarray(p["w"]) < params["w"])


def test_hybrid_mesh_rows_and_errors():
  mesh = devices.hybrid_mesh(2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
  assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
  with pytest.raises(ValueError, match=r"nodes=3 .*dividing the 8 devices"):
    devices.hybrid_mesh(3)


def test_size_one_fast_axis_is_the_flat_step():
  """shard_axis of size 1 is the flat make_train_step, bit for bit."""
  rng = np.random.default_rng(3)
  params = {k: rng.normal(size=s).astype(np.float32)
            for k, s in SHAPES.items()}
  rows = [{k: rng.normal(size=(8,) + s).astype(np.float32)
           for k, s in SHAPES.items()} for _ in range(STEPS)]
  tx = dl.distributed_lion(1e-2, axis_name="data", aggregation="avg")
  runs = [trainer(tx, params, devices.data_mesh(8), None),
          trainer(tx, params, hybrid_mesh(8, 1), "fsdp")]
  for batch in rows:
    (flat_p, flat_mu), (hybrid_p, hybrid_mu) = [run(batch) for run in runs]
  for k in SHAPES:
    np.testing.assert_array_equal(hybrid_p[k], flat_p[k])
    np.testing.assert_array_equal(hybrid_mu[k], flat_mu[k])


def test_micro_batches_average_before_the_scatter():
  """micro_batches=2 on a hybrid mesh: each device averages its two
  micro-batches' gradients, then the node mean; the same as one batch."""
  mesh = hybrid_mesh(2, 2)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  rng = np.random.default_rng(5)
  params = {"w": rng.normal(size=(8,)).astype(np.float32)}
  rows = rng.integers(-3, 4, size=(4, 8)).astype(np.float32)
  doubled = np.repeat(rows, 2, axis=0)          # each device: its row twice
  split = NamedSharding(mesh, P(("data", "fsdp")))
  results = []
  for batch, micro in ((rows, 1), (doubled, 2)):
    p = devices.replicate(params, mesh)
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
  """With check_vma=True JAX proves the new params replicated; the step is
  the same as without the check."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data", comm=comm)
  params = {"w": np.linspace(-1, 1, 12).astype(np.float32),
            "b": np.linspace(-1, 1, 11).astype(np.float32)}
  rng = np.random.default_rng(0)
  batch = jax.device_put(
      {k: rng.normal(size=(8,) + v.shape).astype(np.float32)
       for k, v in params.items()},
      NamedSharding(mesh, P(("data", "fsdp"))))
  out = []
  for check_vma in (False, True):
    p = devices.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
    step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                    check_vma=check_vma)
    out.append(jax.device_get(step(p, state, batch)[0]))
  for k in params:
    np.testing.assert_array_equal(out[1][k], out[0][k])


def test_large_leaf_l1_votes_within_the_rounding_of_the_scale():
  """On a leaf of 2,000,003 elements the L1 scale, a sum of the blocks'
  sums, may round unlike one sum over the leaf: the hybrid step equals flat
  D-Lion over the nodes except for votes one level apart where ``L c / a``
  lies on a rounding boundary. The momenta, which no scale touches, stay
  equal bit for bit."""
  size, nodes, per_node, lr, level = 2_000_003, 2, 4, 1e-2, 127
  rng = np.random.default_rng(2)
  params = {"w": rng.normal(size=size).astype(np.float32)}
  tx = dl.distributed_lion(lr, axis_name="data", quantizer="pbit_l1", bits=8,
                           aggregation="avg")
  hybrid = trainer(tx, params, hybrid_mesh(nodes, per_node), "fsdp")
  flat = trainer(tx, params, devices.data_mesh(nodes), None)
  one_level = lr / (nodes * level)     # a vote's level moves Avg by 1/(N L)
  for t in range(1, 4):
    rows = rng.integers(-3, 4, size=(nodes * per_node, size)).astype(
        np.float32)
    means = node_means({"w": rows}, nodes, per_node)
    (p, hybrid_mu), (q, flat_mu) = hybrid({"w": rows}), flat(
        {"w": np.stack([m["w"] for m in means])})
    moved = np.abs(p["w"] - q["w"]) / one_level
    assert np.count_nonzero(moved) <= 5, t
    assert moved.max() <= t * 1.01, t   # at most one level a step
  np.testing.assert_array_equal(hybrid_mu["w"], flat_mu["w"])


def trainer(tx, params, mesh, shard_axis):
  """``advance(rows) -> (params, momenta)`` on the host: one step of a run
  of ``linear_loss`` on ``mesh``, one row per worker."""
  p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis=shard_axis)
  axes = "data" if shard_axis is None else ("data", shard_axis)

  def advance(rows):
    nonlocal p, state
    p, state, _ = step(p, state, devices.shard_batch(rows, mesh,
                                                     axis_name=axes))
    mu = optax.tree_utils.tree_get(state, "mu")
    return jax.device_get(p), jax.device_get(mu)
  return advance


def test_l1_scale_of_blocks_within_an_ulp_of_the_whole_leaf():
  """The scale of a 2,000,003-element leaf cut in 4 zero-padded chunks
  (as the vote cuts a leaf over the devices that hold it), against the
  whole leaf's: at most an ulp apart (the two orders of addition)."""
  size, k = 2_000_003, 4
  mesh = hybrid_mesh(1, k)

  def chunk_scale(c):
    chunks = jnp.pad(c, (0, -size % k)).reshape(k, -1)
    return quantize.l1_scale(chunks[jax.lax.axis_index("fsdp")],
                             _blocks.LeafShard("fsdp", size))
  fn = jax.jit(parallel.per_worker(chunk_scale, mesh, axis_name="fsdp",
                                   ins=("replicated",), outs="replicated"))
  rng = np.random.default_rng(0)
  for _ in range(4):
    c = rng.normal(size=size).astype(np.float32)
    np.testing.assert_array_max_ulp(np.asarray(fn(c)),
                                    np.asarray(jax.jit(quantize.l1_scale)(c)),
                                    maxulp=1)


def test_readme_chain_with_clip_and_rank_mask():
  """Was (the hand-made layout): clip_by_global_norm clipped each shard by
  its own norm, and a weight-decay mask by rank saw 1-D shards (decay off
  on every matrix). Now the chain sees whole leaves: params equal flat
  D-Lion over the nodes fed node means bit for bit (the update is a
  vote); the momenta within the norm's reduction order."""
  rng = np.random.default_rng(3)
  params = {k: rng.normal(size=s).astype(np.float32)
            for k, s in SHAPES.items()}
  tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
      1e-2, weight_decay=0.5, axis_name="data",
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
  hybrid = trainer(tx, params, hybrid_mesh(2, 4), "fsdp")
  flat = trainer(tx, params, devices.data_mesh(2), None)
  for _ in range(STEPS):
    rows = {k: rng.integers(-3, 4, size=(8,) + s).astype(np.float32)
            for k, s in SHAPES.items()}
    means = node_means(rows, 2, 4)
    (p, mu), (q, want_mu) = hybrid(rows), flat(
        {k: np.stack([m[k] for m in means]) for k in SHAPES})
    for k in params:
      np.testing.assert_array_equal(p[k], q[k], err_msg=k)
      np.testing.assert_allclose(mu[k], want_mu[k], rtol=1e-6, atol=1e-7,
                                 err_msg=k)
  decayed = p["m"] - params["m"]
  assert np.abs(decayed).max() > 3 * 1e-2, "the mask left m undecayed"


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit],
                         ids=str)
def test_fast_links_carry_one_reduce_scatter_and_one_all_gather(kind):
  """Over fsdp each device sends a reduce-scatter of the gradients and an
  all-gather of the updates (fp32, (k-1)/k of each leaf), plus the loss's
  scalar mean; over data, the flat message of its blocks and the loss's
  mean: the figures read off the compiled HLO, for ZeRO-2 and ZeRO-3.
  Explicit axes were 2.5x (ZeRO-2) and 3.5x (ZeRO-3) that over fsdp: a
  region manual over "data" alone all-gathered every gradient and
  momentum over the Explicit "fsdp" at its edges."""
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind,) * 2)
  shapes = {"m": (16, 6), "w": (8, 12)}
  count = sum(int(np.prod(s)) for s in shapes.values())
  tx = dl.distributed_lion(1e-2, axis_name="data", comm="alltoall")
  batch = jax.device_put({k: jnp.zeros((8,) + s) for k, s in shapes.items()},
                         NamedSharding(mesh, P(("data", "fsdp"))))
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  whole = {k: jnp.zeros(s) for k, s in shapes.items()}
  for params in (devices.replicate(whole, mesh),
                 devices.shard_params(whole, mesh)):
    state = parallel.init_worker_states(tx, params, mesh, shard_axis="fsdp")
    sent = dl.collective_bytes_by_axis(
        step.lower(params, state, batch).compile(), mesh)
    assert sent["fsdp"] == 2 * 3 / 4 * 4 * count + 2 * 3 / 4 * 4
    blocks = tuple(int(np.prod(s)) // 4 for s in shapes.values())
    vote = message.MessageLayout(blocks, 2, quantize.BINARY, "mavo",
                                 "alltoall").sent_bytes()
    assert sent["data"] == vote + 4


def test_integer_leaves_masked_out_stay_and_train_the_rest():
  """Was: refused as a leaf that drifts ("exchanges nothing over axis
  'data' for params leaves ['n']"): its zero gradient came out of the
  gradient region, read as differing by node. The flat step's
  optax.masked pattern for such leaves works, equal to the flat run."""
  params = {"m": np.linspace(-1, 1, 72, dtype=np.float32).reshape(12, 6),
            "n": np.arange(8, dtype=np.int32)}
  floats = lambda p: jax.tree.map(
      lambda x: jnp.issubdtype(x.dtype, jnp.floating), p)
  tx = optax.masked(dl.distributed_lion(1e-2, axis_name="data"), floats)
  loss = lambda p, b: jnp.sum(p["m"] * b["m"])
  rows = np.random.default_rng(0).integers(-3, 4, (8, 12, 6)).astype(
      np.float32)
  out = []
  for mesh, shard_axis, batch in (
      (hybrid_mesh(2, 4), "fsdp", rows),
      (devices.data_mesh(2), None,
       np.stack([m["m"] for m in node_means({"m": rows}, 2, 4)]))):
    p = devices.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
    step = parallel.make_train_step(loss, tx, mesh, shard_axis=shard_axis)
    axes = ("data", "fsdp") if shard_axis else "data"
    p, _, _ = step(p, state, devices.shard_batch(
        {"m": batch, "n": np.zeros((len(batch), 8), np.int32)}, mesh,
        axis_name=axes))
    out.append(jax.device_get(p))
  np.testing.assert_array_equal(out[0]["n"], params["n"])
  np.testing.assert_array_equal(out[0]["m"], out[1]["m"])
  assert not np.array_equal(out[0]["m"], params["m"])


@pytest.mark.parametrize("zero3", [False, True], ids=["zero2", "zero3"])
def test_multi_steps_on_explicit_axes(zero3):
  """optax.MultiSteps with shard_axis on an Explicit mesh equals the Auto
  mesh's run. Was: TypeError, cond branches of unequal output types (the
  update typed sharded beside optax's unsharded zeros)."""
  tx = optax.MultiSteps(dl.distributed_lion(1e-2, axis_name="data"), 2)
  params = {"m": np.linspace(-1, 1, 72, dtype=np.float32).reshape(12, 6)}
  rng = np.random.default_rng(1)
  batches = [{"m": rng.integers(-3, 4, (8, 12, 6)).astype(np.float32)}
             for _ in range(4)]
  out = []
  for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind,) * 2)
    p = (devices.shard_params if zero3 else devices.replicate)(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
    step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp")
    for b in batches:
      p, state, _ = step(p, state, devices.shard_batch(
          b, mesh, axis_name=("data", "fsdp")))
    out.append(jax.device_get(p["m"]))
  np.testing.assert_array_equal(out[1], out[0])
  assert not np.array_equal(out[0], params["m"])


def test_tensor_parallel_param_with_the_zero2_state_on_explicit_axes():
  """Was: the state init_worker_states(..., shard_axis="fsdp") built for a
  param P(None, "model") was refused by the step as "sharded otherwise
  than its param" (Explicit axes)."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(AxisType.Explicit,) * 3)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = {"u": jax.device_put(np.ones((6, 4), np.float32),
                           NamedSharding(mesh, P(None, "model")))}
  state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
  assert state[0].mu["u"].sharding.spec == P("data", "fsdp", "model")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp")
  p, state, _ = step(p, state, devices.shard_batch(
      {"u": np.ones((4, 6, 4), np.float32)}, mesh,
      axis_name=("data", "fsdp")))
  assert p["u"].sharding.spec == P(None, "model")
  assert np.all(np.asarray(p["u"]) < 1)


def test_a_tuple_axis_name_with_shard_axis_names_the_fix():
  """Was: jax's "A tuple inside PartitionSpec cannot contain a nested
  tuple"."""
  mesh = jax.make_mesh((2, 2, 2), ("slice", "data", "fsdp"))
  tx = dl.distributed_lion(1e-2, axis_name=("slice", "data"))
  with pytest.raises(ValueError) as e:
    parallel.make_train_step(linear_loss, tx, mesh,
                             axis_name=("slice", "data"), shard_axis="fsdp")
  assert_names(e, "shard_axis='fsdp'", "axis_name=('slice', 'data')",
               "one mesh axis of nodes", "drop shard_axis")


def test_vote_over_the_shard_axis_is_refused():
  """Was (the hand-made layout): accepted, adding up votes of different
  entries."""
  mesh = hybrid_mesh(2, 4)
  params = devices.replicate({"w": jnp.ones((8, 6))}, mesh)
  tx = dl.distributed_lion(1e-2, axis_name=("data", "fsdp"))
  state = parallel.init_worker_states(tx, params, mesh, shard_axis="fsdp")
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp")
  with pytest.raises(ValueError) as e:
    step(params, state, jax.device_put({"w": jnp.ones((8, 8, 6))},
                                       NamedSharding(mesh, P(("data",
                                                              "fsdp")))))
  assert_names(e, "axis_name=('data', 'fsdp')", "'fsdp', which the compiler "
               "owns", "axis_name='data'")


def test_state_without_shard_axis_is_the_same_step():
  """A state built without shard_axis (momenta whole on every device of
  a node) gives the same step as the ZeRO-2 state and keeps its
  placement; one with a row per device names the fix."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = devices.replicate({"w": np.linspace(-1, 1, 12, dtype=np.float32)},
                        mesh)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp",
                                  donate=False)
  batch = devices.shard_batch(
      {"w": np.random.default_rng(0).normal(size=(8, 12)).astype(
          np.float32)}, mesh, axis_name=("data", "fsdp"))
  out = []
  for shard_axis in (None, "fsdp"):
    state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
    new, state, _ = step(p, state, batch)
    out.append((np.asarray(new["w"]), np.asarray(state[0].mu["w"])))
    assert state[0].mu["w"].sharding.spec == P(
        "data", *([] if shard_axis is None else ["fsdp"]))
  for got, want in zip(*out):
    np.testing.assert_array_equal(got, want)
  flat = devices.data_mesh(8)
  rows = parallel.init_worker_states(tx, devices.replicate(
      {"w": np.zeros(12, np.float32)}, flat), flat)
  with pytest.raises(ValueError) as e:
    step(p, jax.device_put(jax.device_get(rows), NamedSharding(
        mesh, P(("data", "fsdp")))), batch)
  assert_names(e, "shape (8,)", "size 2", "a row per device of the mesh (8)",
               "parallel.init_worker_states(tx, params, mesh)")


def test_a_leaf_cut_over_shard_axis_with_another_axis_is_refused():
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(AxisType.Explicit,) * 3)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = {"w": jax.device_put(jnp.ones((8, 3)),
                           NamedSharding(mesh, P(("fsdp", "model"))))}
  state = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis="fsdp")
  with pytest.raises(ValueError) as e:
    step(p, state, jax.device_put({"w": jnp.ones((8, 8, 3))},
                                  NamedSharding(mesh, P(("data", "fsdp")))))
  assert_names(e, "params leaf ['w']", "('fsdp', 'model')",
               "shard_axis='fsdp'", "devices.shard_params(params, mesh, "
               "'fsdp')")


@pytest.mark.parametrize("build", ["make_train_step", "init_worker_states"])
def test_shard_axis_misuse_names_shard_axis(build):
  """Was: a shard_axis not in the mesh was reported as axis_name; the same
  axis twice raised jax's DuplicateSpecError from init_worker_states and
  was accepted by make_train_step (4 "workers" on 2 devices)."""
  mesh = hybrid_mesh(2, 4)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = devices.replicate({"w": np.ones(11, np.float32)}, mesh)
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
