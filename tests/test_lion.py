"""Distributed Lion against the numpy reference, on simulated devices."""

import itertools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from dlion_jax import _exchange
from dlion_jax import _fused
from dlion_jax import _mesh
from dlion_jax import _strategies as strategies
import dlion_jax as dl
from harness import AXIS
from harness import random_tree
from harness import run_on_mesh
from reference import DistributedLionReference
from reference import aggregate
from reference import worker_vote

BF16 = ml_dtypes.bfloat16
SHAPES = {"odd": (37,), "mat": (3, 5), "one": (1,), "zero": (11,),
          "big": (257,), "scalar": (), "empty": (0, 4)}
COMMS = ("alltoall", "allgather", "psum", "psum_int8", "auto")
LR, WD = 1e-2, 1e-3


def make_grads(rng, num_workers, steps, dtype=np.float32):
  grads = []
  for _ in range(steps):
    g = random_tree(rng, SHAPES, dtype, num_workers)
    g["zero"][:] = 0          # a leaf whose gradient is exactly zero
    grads.append(g)
  return grads


def bf16_tree_with_fp32_leaf(seed, num_workers, steps, fp32):
  """bf16 params and per-worker grads, leaf ``fp32`` float32 in both."""
  rng = np.random.default_rng(seed)
  params = random_tree(rng, SHAPES, BF16)
  params[fp32] = params[fp32].astype(np.float32)
  grads = make_grads(rng, num_workers, steps=steps, dtype=BF16)
  for g in grads:
    g[fp32] = g[fp32].astype(np.float32)
  return params, grads


def run_reference(params, grads, num_workers, **kwargs):
  ref = DistributedLionReference(params, num_workers, learning_rate=LR,
                                 weight_decay=WD, **kwargs)
  for g in grads:
    ref.step([{k: v[i] for k, v in g.items()} for i in range(num_workers)])
  return ref


def assert_matches_reference(out, ref, num_workers):
  for name, (params, state, _) in out.items():
    mu = state[0].mu
    for k in ref.params:
      for i in range(num_workers):
        np.testing.assert_array_equal(params[k][i], ref.params[k],
                                      err_msg=f"{name} params[{k}] worker {i}")
        np.testing.assert_array_equal(mu[k][i], ref.mu[i][k],
                                      err_msg=f"{name} mu[{k}] worker {i}")


def match_every_comm(params, grads, num_workers, configs, check_vma=True,
                     **options):
  """Every comm of each (aggregation, vote) in ``configs``, all in one
  program, gives the reference's params and momenta bit for bit; returns
  the runs, keyed "aggregation vote comm". ``options`` go to every
  optimizer."""
  txs = {f"{a} {v} {c}": dl.distributed_lion(
      LR, weight_decay=WD, axis_name=AXIS, aggregation=a, vote=v, comm=c,
      **options) for a, v in configs for c in COMMS}
  out = run_on_mesh(txs, params, grads, num_workers, check_vma=check_vma)
  for a, v in configs:
    ref = run_reference(params, grads, num_workers, aggregation=a, vote=v)
    assert_matches_reference({k: o for k, o in out.items()
                              if k.startswith(f"{a} {v} ")}, ref, num_workers)
  return out


def check_every_comm(num_workers, configs):
  rng = np.random.default_rng(num_workers)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, num_workers, steps=6)
  out = match_every_comm(params, grads, num_workers, configs)
  for a, v in configs:      # per-worker momenta are each worker's own
    mu = out[f"{a} {v} auto"][1][0].mu["odd"]
    assert not np.array_equal(mu[0], mu[1])


AGGREGATION_VOTES = list(itertools.product(("mavo", "avg"),
                                           ("binary", "ternary")))
# One aggregation x vote per N, each aggregation and each vote with an odd
# and an even N (MaVo ties: N = 2 here, test_even_workers_tie_gives_zero);
# the slow test below runs the whole product, tests/test_lockstep*.py every
# pair at drawn N.
COVERING = {2: [("mavo", "ternary")], 3: [("mavo", "binary")],
            5: [("avg", "ternary")], 8: [("avg", "binary")]}


@pytest.mark.parametrize("num_workers", sorted(COVERING))
def test_every_comm_matches_reference(num_workers):
  """Every comm matches numpy bit for bit, for the configurations of
  COVERING."""
  check_every_comm(num_workers, COVERING[num_workers])


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, 3, 5, 8])
@pytest.mark.parametrize("aggregation,vote", AGGREGATION_VOTES)
def test_every_comm_matches_reference_everywhere(num_workers, aggregation,
                                                 vote):
  """test_every_comm_matches_reference on every N x aggregation x vote."""
  check_every_comm(num_workers, [(aggregation, vote)])


BIG_LEAVES = {"rows": (40, 420), "cube": (80, 15, 14), "flat": (16_800,),
              "odd": (37,)}


def check_big_leaves(num_workers, configs, dtype=np.float32,
                     leaves=BIG_LEAVES, **options):
  """Leaves big enough to be packed alone, whose sizes and leading axes the
  digits of a word divide (8 votes, 5 trits, 10 counters of radix 9) or
  not (m = 7, 13), match the reference through every comm."""
  rng = np.random.default_rng(7)
  params = random_tree(rng, leaves, dtype)
  grads = [random_tree(rng, leaves, dtype, num_workers) for _ in range(3)]
  match_every_comm(params, grads, num_workers, configs, **options)


BIG_CONFIGS = [(8, [("mavo", "binary"), ("avg", "ternary")]),
               (5, [("mavo", "ternary")]), (3, [("avg", "binary")])]


@pytest.mark.parametrize("num_workers,configs", BIG_CONFIGS)
def test_big_leaves_match_reference(num_workers, configs):
  check_big_leaves(num_workers, configs)


# N = 8 in float32 and N = 5 in bfloat16 in CI; the other pairs slow.
@pytest.mark.parametrize("num_workers,configs,dtype", [
    (*BIG_CONFIGS[0], np.float32), (*BIG_CONFIGS[1], BF16),
    pytest.param(*BIG_CONFIGS[0], BF16, marks=pytest.mark.slow),
    pytest.param(*BIG_CONFIGS[1], np.float32, marks=pytest.mark.slow)])
def test_big_leaves_match_reference_on_the_tpu_path(monkeypatch, num_workers,
                                                    configs, dtype):
  """The step as it is traced over a TPU mesh (_mesh.on_tpu): big leaves
  encoded plane by plane in their own shape, the outcome narrowed, reshaped
  and only then made float, the results gathered in rows of 128 lanes.
  The same updates, bit for bit, as the numpy reference. (The XLA path:
  on TPU ``kernels='auto'`` takes the fused kernels, tested below.)"""
  monkeypatch.setattr(_mesh, "on_tpu", lambda: True)
  check_big_leaves(num_workers, configs, dtype, kernels="xla")


# Leaves the fused kernels take: 8 planes of 32 rows (binary votes, and the
# counters of 3 workers' binary votes, 4 a byte: 64 rows), 5 planes (trits),
# 10 (the counters of 8 workers' binary votes), a flat one, and a small one
# they leave to XLA.
# "stack": a stack of layers, 8 planes of its 256 rows but not of its 2.
FUSED_LEAVES = {"w": (256, 256), "trits": (160, 128), "counters": (320, 128),
                "flat": (32768,), "cube": (8, 32, 128), "stack": (2, 128, 128),
                "odd": (37,)}


FUSED_8 = (8, [("mavo", "binary"), ("avg", "ternary")])
FUSED_3 = (3, [("avg", "binary"), ("mavo", "ternary")])


# Odd N in bfloat16 in CI (float32 and even N through the kernels in
# test_fused.py and test_fused_abstain.py); the other pairs under -m slow.
@pytest.mark.parametrize("num_workers,configs,dtype", [
    (*FUSED_3, BF16),
    pytest.param(*FUSED_8, np.float32, marks=pytest.mark.slow),
    pytest.param(*FUSED_8, BF16, marks=pytest.mark.slow),
    pytest.param(*FUSED_3, np.float32, marks=pytest.mark.slow)])
def test_fused_kernels_match_reference(monkeypatch, num_workers, configs,
                                       dtype):
  """``kernels='pallas'`` (Pallas' interpreter here): every comm gives the
  numpy reference's params and momenta bit for bit, and the kernels ran
  (``alltoall``'s shards voted and results decoded in blocks, the message
  padded for them; ``psum_int8``'s levels encoded)."""
  ran = []
  for name in ("encode", "tally", "decode", "vote_shard"):
    def counted(*args, _kernel=getattr(_fused, name), _name=name, **kw):
      ran.append(_name)
      return _kernel(*args, **kw)
    monkeypatch.setattr(_fused, name, counted)
  # Pallas' interpreter cannot run under check_vma (fused._call says why).
  check_big_leaves(num_workers, configs, dtype, FUSED_LEAVES,
                   check_vma=False, kernels="pallas")
  assert {"encode", "tally", "decode", "vote_shard"} <= set(ran), ran


@pytest.mark.parametrize("num_workers,vote,shape", [
    (8, "binary", (80, 1024)), (5, "ternary", (32, 1000))])
def test_tallies_gathered_as_rows_on_the_tpu_path(monkeypatch, num_workers,
                                                  vote, shape):
  """A leaf whose per-place results fill 256 words a worker: the TPU path
  gathers them as rows, each place's 256 words in rows of 128 lanes (``[m,
  2, 128]``, not one flat buffer to cut them out of), with the
  reference's updates bit for bit."""
  monkeypatch.setattr(_mesh, "on_tpu", lambda: True)
  gathered, all_gather = [], strategies._all_gather
  def recorded(x, *args, **kwargs):
    gathered.append(x.shape)
    return all_gather(x, *args, **kwargs)
  monkeypatch.setattr(strategies, "_all_gather", recorded)
  rng = np.random.default_rng(3)
  params = random_tree(rng, {"w": shape})
  grads = [random_tree(rng, {"w": shape}, np.float32, num_workers)
           for _ in range(2)]
  match_every_comm(params, grads, num_workers, [("mavo", vote)],
                   kernels="xla")
  places = 8 if vote == "binary" else 5
  assert (places, 2, 128) in gathered, gathered


@pytest.mark.parametrize("vote,expected", [("binary", -1.0), ("ternary", 0.0)])
def test_zero_gradient_leaf_binary_and_ternary_differ(vote, expected):
  """c == 0 everywhere: binary votes -1 on every worker, ternary abstains."""
  rng = np.random.default_rng(0)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, 3, steps=2)
  txs = {c: dl.scale_by_distributed_lion(axis_name=AXIS, vote=vote, comm=c)
         for c in COMMS}
  out = run_on_mesh(txs, params, grads, 3)
  for name, (_, _, updates) in out.items():
    for u in updates:
      np.testing.assert_array_equal(u["zero"], np.full((3, 11), expected),
                                    err_msg=name)


def test_even_workers_tie_gives_zero():
  grads = [{"w": np.array([[1.0, 1.0, -1.0], [-1.0, 1.0, -1.0]], np.float32)}]
  params = {"w": np.zeros(3, np.float32)}
  txs = {c: dl.scale_by_distributed_lion(axis_name=AXIS, comm=c)
         for c in COMMS}
  for name, (_, _, updates) in run_on_mesh(txs, params, grads, 2).items():
    np.testing.assert_array_equal(updates[0]["w"][0], [0.0, 1.0, -1.0],
                                  err_msg=name)




DTYPE_CONFIGS = [(BF16, None), (np.float32, BF16), (BF16, np.float32)]


# bf16 avg with an odd and an even N (D = s / N rounds, or not), each
# dtype configuration once; the slow test below runs the whole product.
@pytest.mark.parametrize("num_workers,param_dtype,mu_dtype", [
    (8, BF16, None), (3, BF16, np.float32), (8, np.float32, BF16)])
def test_low_precision_and_mu_dtype(num_workers, param_dtype, mu_dtype):
  """bf16 params or momenta: params and momenta equal numpy's bit for bit,
  in the dtypes asked for."""
  check_low_precision(num_workers, param_dtype, mu_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [3, 8])
@pytest.mark.parametrize("param_dtype,mu_dtype", DTYPE_CONFIGS)
def test_low_precision_and_mu_dtype_everywhere(num_workers, param_dtype,
                                               mu_dtype):
  """test_low_precision_and_mu_dtype on every N x dtype configuration."""
  check_low_precision(num_workers, param_dtype, mu_dtype)


def check_low_precision(num_workers, param_dtype, mu_dtype):
  rng = np.random.default_rng(7)
  params = random_tree(rng, SHAPES, param_dtype)
  grads = make_grads(rng, num_workers, steps=4, dtype=param_dtype)
  txs = {c: dl.distributed_lion(LR, weight_decay=WD, mu_dtype=mu_dtype,
                                axis_name=AXIS, aggregation="avg", comm=c)
         for c in ("alltoall", "psum")}
  out = run_on_mesh(txs, params, grads, num_workers)
  ref = run_reference(params, grads, num_workers, aggregation="avg",
                      mu_dtype=mu_dtype)
  assert_matches_reference(out, ref, num_workers)
  expected_mu = np.dtype(mu_dtype or param_dtype)
  assert out["psum"][1][0].mu["odd"].dtype == expected_mu
  assert out["psum"][0]["odd"].dtype == np.dtype(param_dtype)


def check_mixed_dtypes(configs):
  """One message carries leaves of both dtypes; each comes back in its own,
  equal to numpy's, for every comm of each (aggregation, vote)."""
  params, grads = bf16_tree_with_fp32_leaf(8, 4, steps=3, fp32="odd")
  out = match_every_comm(params, grads, 4, configs)
  for a, v in configs:
    assert out[f"{a} {v} auto"][0]["odd"].dtype == np.float32
    assert out[f"{a} {v} auto"][0]["mat"].dtype == BF16


def test_mixed_bf16_and_fp32_leaves():
  """Both votes and both aggregations, through every comm (the slow test
  below runs all four pairs)."""
  check_mixed_dtypes([("mavo", "binary"), ("avg", "ternary")])


@pytest.mark.slow
def test_mixed_bf16_and_fp32_leaves_everywhere():
  """test_mixed_bf16_and_fp32_leaves on every aggregation x vote."""
  check_mixed_dtypes(AGGREGATION_VOTES)


# The widths change past 127 and 255 workers; 64, 200 and 300 (slow) add
# nothing.
@pytest.mark.parametrize("num_workers", [16, 127, 128, 256] + [
    pytest.param(n, marks=pytest.mark.slow) for n in (64, 200, 300)])
def test_many_workers_field_widths(num_workers):
  """Counters and containers widen with N (uint8 -> uint16, int8 -> int16).

  All N workers run under ``jax.vmap`` on one device; one update from zero
  momentum votes the sign of each worker's gradient.
  """
  rng = np.random.default_rng(num_workers)
  shapes = {"a": (37,), "b": (3, 5)}
  grads = {k: rng.normal(size=(num_workers,) + s).astype(np.float32)
           for k, s in shapes.items()}
  grads["b"][: num_workers // 2, 0, 0] = 0.0      # ternary ties somewhere
  configs = list(itertools.product(("mavo", "avg"), ("binary", "ternary"),
                                   COMMS))
  def run(g):
    out = []
    for aggregation, vote, comm in configs:
      tx = dl.scale_by_distributed_lion(axis_name=AXIS, aggregation=aggregation,
                                        vote=vote, comm=comm)
      out.append(tx.update(g, tx.init(g))[0])
    return out
  outs = jax.jit(jax.vmap(run, axis_name=AXIS))(grads)
  for (aggregation, vote, comm), out in zip(configs, outs):
    for k in shapes:
      votes = [worker_vote(grads[k][i], vote) for i in range(num_workers)]
      expected = aggregate(votes, aggregation, np.float32)
      np.testing.assert_array_equal(out[k][0], expected,
                                    err_msg=f"{aggregation} {vote} {comm} {k}")
      assert all(np.array_equal(out[k][0], out[k][i])
                 for i in (1, num_workers - 1))


def test_float64_avg_is_exact():
  with jax.enable_x64(True):
    g = jnp.array([[1.0], [1.0], [-1.0]], jnp.float64)
    tx = dl.scale_by_distributed_lion(axis_name=AXIS, aggregation="avg")
    out = jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name=AXIS)(g)
    assert out.dtype == jnp.float64
    assert out[0, 0] == 1 / 3


def test_none_leaves_and_tuple_axis_names():
  mesh = jax.make_mesh((2, 4), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  tx = dl.scale_by_distributed_lion(axis_name=("a", "b"), comm="alltoall")
  rng = np.random.default_rng(9)
  g = rng.normal(size=(8, 21)).astype(np.float32)
  def local(x):
    tree = {"w": x[0], "skip": None}
    out = tx.update(tree, tx.init(tree))[0]
    assert out["skip"] is None
    return out["w"][None]
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=jax.P(("a", "b")),
                              out_specs=jax.P(("a", "b"))))(g)
  expected = aggregate([worker_vote(g[i], "binary") for i in range(8)],
                       "mavo", np.float32)
  for i in range(8):
    np.testing.assert_array_equal(out[i], expected)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("mu_dtype", [None, BF16])
def test_no_axis_is_optax_lion_bit_for_bit(dtype, mu_dtype):
  rng = np.random.default_rng(1)
  params = jax.tree.map(jnp.asarray, random_tree(rng, SHAPES, dtype))
  ours = dl.distributed_lion(LR, mu_dtype=mu_dtype)
  theirs = optax.lion(LR, mu_dtype=mu_dtype)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  p_ours = p_theirs = params
  step_ours, step_theirs = jax.jit(ours.update), jax.jit(theirs.update)
  for _ in range(5):
    g = jax.tree.map(jnp.asarray, random_tree(rng, SHAPES, dtype))
    g["zero"] = jnp.zeros_like(g["zero"])
    u1, s_ours = step_ours(g, s_ours, p_ours)
    u2, s_theirs = step_theirs(g, s_theirs, p_theirs)
    p_ours = optax.apply_updates(p_ours, u1)
    p_theirs = optax.apply_updates(p_theirs, u2)
    chex.assert_trees_all_equal((u1, p_ours),
                 (u2, p_theirs))
  chex.assert_trees_all_equal(s_ours[0].mu, s_theirs[0].mu)


def test_axis_of_size_one_is_optax_lion_without_collectives():
  rng = np.random.default_rng(2)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, 1, steps=3)
  out = run_on_mesh({"ours": dl.distributed_lion(LR, weight_decay=WD,
                                                 axis_name=AXIS),
                     "optax": optax.lion(LR, weight_decay=WD)},
                    params, grads, 1)
  chex.assert_trees_all_equal(out["ours"][0],
               out["optax"][0])
  chex.assert_trees_all_equal(out["ours"][1][0].mu,
               out["optax"][1][0].mu)

  mesh = dl.devices.data_mesh(1)
  tx = dl.scale_by_distributed_lion(axis_name=AXIS)
  fn = jax.jit(jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
                             in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)))
  assert dl.hlo.collectives(
      fn.lower(jnp.ones((1, 64))).compile().as_text()) == []


def test_signum_is_b1_equal_b2():
  """Majority-vote Signum: with b1 == b2 the sent c_t is the new momentum."""
  rng = np.random.default_rng(3)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, 3, steps=3)
  tx = dl.scale_by_distributed_lion(0.9, 0.9, axis_name=AXIS)
  _, state, updates = run_on_mesh({"s": tx}, params, grads, 3)["s"]
  votes = np.where(state.mu["odd"] > 0, 1, -1)      # sign of each momentum
  np.testing.assert_array_equal(updates[-1]["odd"][0],
                                np.sign(votes.sum(0)))


# 10**9 packs every leaf together, as the default does with these sizes
# (test_mixed_bf16_and_fp32_leaves): slow.
@pytest.mark.parametrize("own_packing", [
    1, 16, pytest.param(10**9, marks=pytest.mark.slow)])
def test_leaves_packed_alone_or_together_match_reference(own_packing,
                                                         monkeypatch):
  """Leaves of at least ``exchange.OWN_PACKING`` elements are packed one by
  one, smaller ones in one pass per dtype: any split, with two dtypes in
  the message, gives numpy's update bit for bit through every strategy."""
  monkeypatch.setattr(_exchange, "OWN_PACKING", own_packing)
  n = 3
  params, grads = bf16_tree_with_fp32_leaf(9, n, steps=2, fp32="big")
  match_every_comm(params, grads, n, [("avg", "binary")])
