"""A worker with non-finite gradients abstains (``abstain_nonfinite=True``).

The vote is the others' (MaVo their majority, Avg their mean), the
abstainer's state stays as it was, every worker applies the same update,
a step every worker abstains from is skipped, and with every gradient
finite nothing changes, bit for bit. Checked against the numpy reference
(``tests/reference.py``, which leaves the abstainers out), against a run
of the other workers alone on their own batches, in both doors, on a
hybrid mesh and with local steps.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import devices
from dlion_jax import parallel
from harness import run_on_mesh
from reference import DistributedLionReference
from test_doors import DOORS, assert_same, mesh_of, problem, run
from tiers import slow_but

LR = 1e-2
SHAPES = {"w": (37, 5), "b": (13,)}     # not multiples of 8 N
COMMS = ("alltoall", "allgather", "psum", "psum_int8")


def grads_seq(n, steps, *, dtype=np.float32, bad=None, seed=0):
  """Per-worker gradients; ``bad(step, worker)`` a value to write into one
  entry of that worker's ``w`` (or None: left finite)."""
  rng = np.random.default_rng(seed)
  seq = []
  for t in range(steps):
    g = {k: rng.normal(size=(n,) + s).astype(dtype)
         for k, s in SHAPES.items()}
    for i in range(n):
      value = bad and bad(t, i)
      if value is not None:
        g["w"][i, t % 37, i % 5] = value
    seq.append(g)
  return seq


def params_of(dtype=np.float32):
  rng = np.random.default_rng(1)
  return {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}


def check_against_reference(n, options, seq, *, dtype=np.float32):
  """The params and every worker's momentum bit for bit the reference's; a
  momentum synced (``momentum_sync``) within a rounding of its mean (the
  reference takes it in float64), a residual within a rounding."""
  tx = dl.distributed_lion(LR, axis_name="data", abstain_nonfinite=True,
                           **options)
  params = params_of(dtype)
  ps, states, _ = run_on_mesh({"tx": tx}, params, seq, n)["tx"]
  ref_options = {k: v for k, v in options.items()
                 if k not in ("comm", "bucket_bytes", "momentum_sync")}
  period = options.get("momentum_sync")
  if period:
    ref_options["sync_steps"] = range(period, len(seq) + 1, period)
  ref = DistributedLionReference(params, n, learning_rate=LR,
                                 abstain_nonfinite=True, **ref_options)
  total = 0
  for g in seq:
    ref.step([{k: g[k][i] for k in g} for i in range(n)])
    total += ref.abstained
  for k in params:
    for i in range(n):   # every worker's replica
      np.testing.assert_array_equal(ps[k][i], ref.params[k], err_msg=k)
  lion = states[0]
  for i in range(n):
    for k in params:
      if period:
        np.testing.assert_allclose(lion.mu[k][i], ref.mu[i][k], rtol=1e-6,
                                   atol=1e-8)
      else:
        np.testing.assert_array_equal(lion.mu[k][i], ref.mu[i][k])
      if options.get("error_feedback"):   # p - a D contracts apart
        np.testing.assert_allclose(lion.error[k][i], ref.error[i][k],
                                   rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(lion.abstained, ref.abstained)
  np.testing.assert_array_equal(lion.abstentions, total)
  np.testing.assert_array_equal(lion.count, ref.t)


def nan_on(*workers, every=1):
  return lambda t, i: np.nan if i in workers and t % every == 0 else None


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("n", [5, 8])
def test_a_worker_with_nan_gradients_is_left_out_of_the_vote(comm, n):
  """Worker 3 NaN on every step, worker 1 an Inf now and then: the
  reference of the others' vote, bit for bit (at N = 5 the four present
  tie, D = 0 there)."""
  bad = lambda t, i: (np.nan if i == 3 else np.inf if i == 1 and t % 3 == 1
                      else None)
  check_against_reference(n, {"comm": comm}, grads_seq(n, 6, bad=bad))


@pytest.mark.parametrize("comm", slow_but(COMMS, 0))
@pytest.mark.parametrize("options", [
    {"aggregation": "avg"},
    {"vote": "ternary"},
    {"quantizer": "pbit_l1", "bits": 3, "aggregation": "avg"},
    {"quantizer": "ternary_l1", "error_feedback": True},
    {"min_compress_size": 20},
], ids=["avg", "ternary", "pbit_l1-avg", "ternary_l1-ef", "exact-small"])
def test_every_vote_and_lion_cub_option_counts_only_the_workers_present(
    comm, options):
  check_against_reference(8, dict(options, comm=comm),
                          grads_seq(8, 5, bad=nan_on(3, 6, every=2)))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16],
                         ids=["f32", "bf16"])
def test_bf16_and_buckets(dtype):
  check_against_reference(
      5, {"comm": "auto", "bucket_bytes": 64},
      grads_seq(5, 4, dtype=dtype, bad=nan_on(0)), dtype=dtype)


def test_a_step_every_worker_abstains_from_is_skipped():
  """Params, momenta, counts and the schedule's count unchanged (weight
  decay too): as dl.apply_if_finite skips it."""
  n = 4
  schedule = optax.linear_schedule(LR, 0.0, 100)
  tx = dl.distributed_lion(schedule, axis_name="data", weight_decay=0.1,
                           abstain_nonfinite=True)
  seq = grads_seq(n, 3, bad=lambda t, i: np.nan if t == 1 else None)
  out = run_on_mesh({"tx": tx}, params_of(), seq, n)["tx"]
  skipped = run_on_mesh({"tx": tx}, params_of(), [seq[0], seq[2]], n)["tx"]
  kept = lambda out: (out[0], out[1][0].count, out[1][0].mu, out[1][1:])
  for a, b in zip(jax.tree.leaves(kept(out)), jax.tree.leaves(kept(skipped))):
    np.testing.assert_array_equal(a, b)
  assert int(out[1][0].abstentions[0]) == n
  np.testing.assert_array_equal(out[2][1]["w"], 0.0)   # the skipped update


@pytest.mark.parametrize("options", slow_but([
    {}, {"aggregation": "avg", "comm": "alltoall"},
    {"quantizer": "pbit_l1", "bits": 3, "error_feedback": True},
    {"vote": "ternary", "comm": "psum", "momentum_sync": 2},
], 0, 3))
def test_with_every_gradient_finite_nothing_changes(options):
  """The README's chain (clip_by_global_norm, masked weight decay): params
  and state bit for bit the default's."""
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  chain = lambda **kw: optax.chain(
      optax.clip_by_global_norm(1.0),
      dl.distributed_lion(LR, axis_name="data", mask=mask, **options, **kw))
  out = run_on_mesh({"on": chain(abstain_nonfinite=True), "off": chain()},
                    params_of(), grads_seq(8, 4), 8)
  for a, b in zip(jax.tree.leaves(out["on"][0]), jax.tree.leaves(
      out["off"][0])):
    np.testing.assert_array_equal(a, b)
  on, off = out["on"][1][1][0], out["off"][1][1][0]
  for a, b in zip(jax.tree.leaves(on.mu), jax.tree.leaves(off.mu)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(on.abstentions, 0)


def batch_of(n, rows_each, bad=(), seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * rows_each, 5)).astype(np.float32)
  y = rng.normal(size=(n * rows_each, 3)).astype(np.float32)
  for worker in bad:
    x[worker * rows_each] = np.nan
  return {"x": x, "y": y}


def others_of(batch, n, bad):
  return {k: np.delete(v.reshape(n, -1, v.shape[-1]), list(bad), axis=0
                       ).reshape(-1, v.shape[-1]) for k, v in batch.items()}


def _odd_cases():
  """N = 5's cases through alltoall (whose results change radix with the
  abstainers' count) in the suite, the other comms' in the slow tier; N =
  8's through alltoall and psum."""
  cases = []
  for comm in COMMS:
    cases.append(pytest.param(
        comm, 8, (3,), id=f"{comm}-8-1",
        marks=() if comm in ("alltoall", "psum") else (pytest.mark.slow,)))
    for bad, name in (((1,), "5-1"), ((0, 3), "5-2")):
      marks = () if comm == "alltoall" else (pytest.mark.slow,)
      cases.append(pytest.param(comm, 5, bad, marks=marks,
                                id=f"{comm}-{name}"))
  return cases


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("comm,n,bad", _odd_cases())
def test_workers_with_nan_batches_leave_the_others_run(door, comm, n, bad):
  """The issue's case (8 workers, worker 3's batch NaN on every step, 20
  steps) equals a 7-worker run on the other 7 workers' batches; at N = 5
  the 4 present may tie (alltoall's results then go back in radix 3), the
  3 present of two abstainers may not (radix 2)."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
            "b": np.zeros(3, np.float32)}
  batch = batch_of(n, 4, bad)
  tx = lambda **kw: dl.distributed_lion(LR, axis_name="data", comm=comm,
                                        **kw)
  steps = 20 if n == 8 else 8
  voted = run(door, tx(abstain_nonfinite=True), mesh_of(n), params, batch,
              steps=steps)
  alone = run(door, tx(), mesh_of(n - len(bad)), params,
              others_of(batch, n, bad), steps=steps)
  for a, b in zip(jax.tree.leaves(voted), jax.tree.leaves(alone)):
    np.testing.assert_array_equal(a, b)
  assert np.isfinite(voted["w"]).all()


def run_nodes(nodes, batch, tx):
  """5 steps of ``tx`` on nodes of 2 devices, ``w`` sharded over a node's
  devices (FSDP); the params."""
  mesh = jax.make_mesh((nodes, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:2 * nodes])
  params = {"w": np.linspace(-1, 1, 40, dtype=np.float32).reshape(8, 5),
            "b": np.zeros(5, np.float32)}
  placement = {"w": P("model", None), "b": P()}
  p = jax.device_put(params, {k: NamedSharding(mesh, s)
                              for k, s in placement.items()})
  s = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(
      lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2), tx,
      mesh, donate=False)
  b = devices.shard_batch(batch, mesh)
  for _ in range(5):
    p, s, _ = step(p, s, b)
  return jax.device_get(p)


def test_a_hybrid_mesh_leaves_out_a_node_with_nan_gradients():
  """4 nodes of 2 devices, params sharded over the node's devices (FSDP):
  node 1's NaN leaves the 3 others' run, bit for bit."""
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
           "y": rng.normal(size=(16, 5)).astype(np.float32)}
  bad = {k: v.copy() for k, v in batch.items()}
  bad["x"][4] = np.nan            # node 1's first row
  others = {k: np.delete(v, range(4, 8), axis=0) for k, v in batch.items()}
  tx = lambda **kw: dl.distributed_lion(LR, axis_name="data", **kw)
  four = run_nodes(4, bad, tx(abstain_nonfinite=True))
  three = run_nodes(3, others, tx())
  for a, b in zip(jax.tree.leaves(four), jax.tree.leaves(three)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("door", DOORS)
def test_local_steps_leave_a_nan_worker_out_of_the_outer_vote(door):
  """Worker 3's params turn NaN inside a round; it abstains from the outer
  vote and the anchor is the other seven's."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
            "b": np.zeros(3, np.float32)}
  batch = batch_of(8, 4, (3,))
  others = others_of(batch, 8, (3,))
  tx = lambda **kw: dl.local_steps(optax.lion(1e-3), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0, **kw), every=2)
  eight = run(door, tx(abstain_nonfinite=True), mesh_of(8), params, batch,
              steps=6, params_per_worker=True)
  seven = run(door, tx(), mesh_of(7), params, others, steps=6,
              params_per_worker=True)
  for a, b in zip(jax.tree.leaves(eight), jax.tree.leaves(seven)):
    np.testing.assert_array_equal(a, b)


def test_one_worker_skips_a_nonfinite_step_and_is_lion_otherwise():
  tx = dl.distributed_lion(LR, abstain_nonfinite=True)
  params = params_of()
  state = tx.init(params)
  good = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
  updates, state = tx.update(good, state, params)
  expected, _ = optax.lion(LR, weight_decay=1e-3).update(
      good, optax.lion(LR, weight_decay=1e-3).init(params), params)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  nan = dict(good, b=np.full(13, np.nan, np.float32))
  skipped, after = tx.update(nan, state, params)
  assert all(not np.any(u) for u in jax.tree.leaves(skipped))
  assert int(after[0].count) == 1 and int(after[0].abstained) == 1
  for a, b in zip(jax.tree.leaves(after[0].mu), jax.tree.leaves(state[0].mu)):
    np.testing.assert_array_equal(a, b)


def test_a_bad_value_names_the_argument():
  with pytest.raises(ValueError, match="abstain_nonfinite must be True or "
                     "False .*abstain_nonfinite='yes'"):
    dl.distributed_lion(LR, abstain_nonfinite="yes")


def test_a_worker_nan_for_one_round_votes_again_in_the_next():
  """Local steps: worker 1's gradients NaN in round 1 only; it abstains
  from that outer vote, restarts with a fresh inner state and votes in
  round 2 (a NaN inner momentum kept would make it abstain for good)."""
  n, every = 4, 2
  tx = dl.local_steps(optax.lion(1e-2), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0, abstain_nonfinite=True),
      every=every)
  params = {"w": np.linspace(-1, 1, 12, dtype=np.float32)}
  rng = np.random.default_rng(0)
  seq = [{"w": rng.normal(size=(n, 12)).astype(np.float32)}
         for _ in range(2 * every)]
  seq[0]["w"][1, 3] = np.nan

  def worker(p, g_seq):
    state, counts = tx.init(p), []
    for t in range(2 * every):
      u, state = tx.update({"w": g_seq["w"][t]}, state, p)
      p = dl.rounds.restart_at_anchor(optax.apply_updates(p, u), state)
      counts.append(state.outer_state[0].abstained)
    return p, jnp.stack(counts), state.inner_state
  stacked = jax.tree.map(lambda *g: jnp.stack(g, 1), *seq)
  p, counts, inner = jax.vmap(worker, axis_name="data")(
      {"w": np.broadcast_to(params["w"], (n, 12))}, stacked)
  np.testing.assert_array_equal(counts[0], [0, 1, 1, 0])   # rounds end 2, 4
  assert np.isfinite(p["w"]).all()
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(inner))


def test_forced_kernels_take_abstention():
  """kernels='pallas' with abstain_nonfinite=True builds (the kernels take
  the count; tests/test_fused_abstain.py checks them bit for bit)."""
  dl.distributed_lion(LR, kernels="pallas", abstain_nonfinite=True)


def test_a_skipped_step_does_not_sync_the_momenta_again():
  """momentum_sync=1: the step after a sync that every worker abstains
  from leaves the momenta as they were (its count, unchanged, still names
  a sync step; averaging the synced momenta again may round them)."""
  n = 3
  tx = dl.scale_by_distributed_lion(axis_name="data", momentum_sync=1,
                                    abstain_nonfinite=True)
  rng = np.random.default_rng(0)
  g = rng.normal(size=(n, 101)).astype(np.float32) * np.float32(1 / 3)

  def worker(g):
    state = tx.init(g)
    _, state = tx.update(g, state)
    _, after = tx.update(jnp.full_like(g, jnp.nan), state)
    return state.mu, after.mu, after.count
  before, after, count = jax.vmap(worker, axis_name="data")(g)
  np.testing.assert_array_equal(after, before)
  np.testing.assert_array_equal(count, 1)


# A momentum sync averages the workers present.


@pytest.mark.parametrize("n", [5, 8])
def test_a_sync_averages_the_present_and_leaves_the_abstainers_alone(n):
  """momentum_sync=2, workers 1 and 3 NaN on alternate steps (their
  momenta stale, not zero): the numpy reference, whose sync averages the
  workers present and leaves the abstainers' momenta as they were."""
  bad = lambda t, i: np.nan if (i == 1 and t % 2 == 0) or (
      i == 3 and t % 2 == 1) else None
  check_against_reference(n, {"momentum_sync": 2},
                          grads_seq(n, 7, bad=bad))


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("n,bad", [(5, (1,)), (8, (3,))], ids=["5", "8"])
def test_a_momentum_sync_leaves_the_others_run(door, n, bad):
  """A sync every step, worker ``bad``'s batch NaN on every step: the
  others' params and momenta equal a run on their batches alone, bit for
  bit (the present workers' sum, the abstainer's zeros adding nothing
  where the all-reduce sums in the workers' order, as XLA:CPU's does,
  times 1 / (N - a) as a pmean over N - a workers takes it); the
  abstainer's momentum stays as it was (zero)."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
            "b": np.zeros(3, np.float32)}
  batch = batch_of(n, 4, bad)
  tx = lambda **kw: dl.distributed_lion(LR, axis_name="data",
                                        momentum_sync=1, **kw)
  voted, state = run(door, tx(abstain_nonfinite=True), mesh_of(n), params,
                     batch, steps=8, with_state=True)
  alone, alone_state = run(door, tx(), mesh_of(n - len(bad)), params,
                           others_of(batch, n, bad), steps=8,
                           with_state=True)
  assert_same(voted, alone, "params")
  for k in params:
    mu = np.asarray(state[0].mu[k])
    np.testing.assert_array_equal(np.delete(mu, bad, axis=0),
                                  alone_state[0].mu[k], err_msg=k)
    np.testing.assert_array_equal(mu[list(bad)], 0.0, err_msg=k)


# One worker left: one worker's Lion.


def _lone_configs():
  votes = {"binary": {}, "ternary": {"vote": "ternary"},
           "ternary_l1": {"quantizer": "ternary_l1"},
           "pbit_l1": {"quantizer": "pbit_l1", "bits": 3}}
  return [pytest.param(dict(aggregation=a, error_feedback=ef, **v),
                       id=f"{a}-{name}{'-ef' if ef else ''}")
          for a in ("mavo", "avg") for name, v in votes.items()
          for ef in (False, True)]


def lone_seq(n, steps, lone=0):
  """Gradients on which every worker but ``lone`` is NaN somewhere on every
  step; each leaf zero in a few coordinates (where ``sign(c)`` is 0)."""
  seq = grads_seq(n, steps, bad=lambda t, i: None if i == lone else np.nan)
  for g in seq:
    g["w"][:, 30:] = 0.0
    g["b"][:, :4] = 0.0
  return seq


@pytest.mark.parametrize("options", slow_but(_lone_configs(), 0, 3, 5, 6, 8,
                                             15))
def test_a_lone_worker_takes_one_workers_lion_step(options):
  """Every worker but one abstains (N = 2 and 3): each worker's update is
  the present worker's sign(c), zero where c is (one worker's Lion, as at
  N = 1: optax.lion's), whatever the vote, aggregation, quantizer and
  error feedback; its momentum is N = 1's, its residual kept as N = 1
  keeps it, the abstainers' untouched."""
  tx = dl.scale_by_distributed_lion(axis_name="data", abstain_nonfinite=True,
                                    **options)
  params = params_of()
  for n in (2, 3):
    seq = lone_seq(n, 3)
    _, states, updates = run_on_mesh({"tx": tx}, params, seq, n)["tx"]
    one = run_on_mesh({"tx": tx}, params, [
        {k: v[:1] for k, v in g.items()} for g in seq], 1)["tx"]
    for step, (u, u1) in enumerate(zip(updates, one[2])):
      for k in params:
        for i in range(n):
          np.testing.assert_array_equal(u[k][i], u1[k][0],
                                        err_msg=f"{n} {step} {k} {i}")
      assert not np.any(u1["w"][0][30:])   # c = 0 there
    for k in params:
      np.testing.assert_array_equal(states.mu[k][0], one[1].mu[k][0])
      np.testing.assert_array_equal(states.mu[k][1:], 0.0)
      if options["error_feedback"]:
        np.testing.assert_array_equal(states.error[k], 0.0)
    np.testing.assert_array_equal(states.count, 3)
    np.testing.assert_array_equal(states.abstained, n - 1)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("comm", slow_but(COMMS, 0, 2))
def test_the_last_worker_present_trains_as_one_worker(door, comm):
  """N = 5, workers 1 to 4's batches NaN on every step: worker 0's run
  alone (a data axis of one device, optax.lion), bit for bit, for every
  comm, through both doors; at N = 2 too."""
  params, batch = problem(rows=20)
  batch["x"][:, 4] = 0.0          # w's last row: a zero gradient
  tx = lambda n: dl.distributed_lion(LR, axis_name="data", comm=comm,
                                     abstain_nonfinite=n > 1)
  one = run(door, tx(1), mesh_of(1), params,
            {k: v[:4] for k, v in batch.items()}, steps=6)
  for n, rows in ((5, 20), (2, 8)):
    bad = {k: v[:rows].copy() for k, v in batch.items()}
    bad["x"][4:rows:4] = np.nan
    assert_same(run(door, tx(n), mesh_of(n), params, bad, steps=6), one,
                f"{n} workers")


@pytest.mark.parametrize("options", [
    {}, {"quantizer": "ternary_l1", "error_feedback": True},
    {"aggregation": "avg", "min_compress_size": 6},
], ids=["binary", "ternary_l1-ef", "avg-exact-bias"])
def test_one_node_left_on_a_hybrid_mesh_trains_as_that_node(options):
  """3 nodes of 2 devices (FSDP params), nodes 1 and 2 NaN on every step:
  node 0's run on its own, bit for bit (each device sends its block's
  signs; the bias, under min_compress_size, summed exactly); a zero
  gradient in one row of w."""
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(12, 8)).astype(np.float32),
           "y": rng.normal(size=(12, 5)).astype(np.float32)}
  batch["x"][:, 7] = 0.0          # w's last row: a zero gradient
  bad = {k: v.copy() for k, v in batch.items()}
  bad["x"][[4, 8]] = np.nan              # nodes 1 and 2's first rows
  tx = lambda **kw: dl.distributed_lion(LR, axis_name="data", **options, **kw)
  three = run_nodes(3, bad, tx(abstain_nonfinite=True))
  one = run_nodes(1, {k: v[:4] for k, v in batch.items()}, tx())
  assert_same(three, one)


# With every gradient finite, the plain jitted step is the default's too.


def _plain_steps(tx, mesh, params, batch, *, steps, stacked):
  """The README's plain jitted step (dl.workers.update, or an optimizer
  that calls dl.workers.stacked(tx).update, as nnx.Optimizer does)."""
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    door = dl.workers.stacked(tx) if stacked else None
    s = door.init(p) if stacked else parallel.init_worker_states(tx, p, mesh)

    @jax.jit
    def step(p, s, b):
      _, grads = dl.workers.value_and_grad(
          lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2))(
              p, b)
      u, s = (door.update if stacked else dl.workers.update(tx))(grads, s, p)
      return optax.apply_updates(p, u), s
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    for _ in range(steps):
      p, s = step(p, s, b)
    return jax.device_get((p, s))


_EF = {"error_feedback": True}
_TERNARY_L1_EF = {"quantizer": "ternary_l1", "error_feedback": True,
                  "comm": "psum"}
_PBIT_AVG_EF = {"quantizer": "pbit_l1", "bits": 3, "aggregation": "avg",
                "error_feedback": True}
_SYNCED = {"vote": "ternary", "momentum_sync": 2, "min_compress_size": 4}


@pytest.mark.parametrize("form,options", slow_but([
    ("bare", _EF), ("bare", _TERNARY_L1_EF), ("bare", _PBIT_AVG_EF),
    ("chain", _PBIT_AVG_EF), ("chain", _SYNCED),
    ("stacked", _EF), ("stacked", _SYNCED),
], 0, 3, 5), ids=["ef", "ternary_l1-ef", "pbit_l1-avg-ef",
                   "chain-pbit_l1-avg-ef", "chain-ternary-sync-exact",
                   "stacked-ef", "stacked-ternary-sync"])
def test_the_plain_step_with_every_gradient_finite_is_the_defaults(
    form, options):
  """dl.workers.update in a plain jax.jit (dl.distributed_lion itself, or
  the README's chain with clip_by_global_norm and masked weight decay;
  dl.workers.stacked's update, as nnx.Optimizer calls it), 8 and 5
  workers, 20 steps: params, momenta and residuals bit for bit the
  default's (the residuals had moved by an ulp in 4 steps, 2.6e-5 in
  200)."""
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  if form == "chain":
    build = lambda **kw: optax.chain(
        optax.clip_by_global_norm(1.0),
        dl.distributed_lion(LR, axis_name="data", mask=mask, **options, **kw))
    lion_of = lambda state: state[1][0]
  else:
    build = lambda **kw: dl.distributed_lion(LR, axis_name="data", **options,
                                             **kw)
    lion_of = lambda state: state[0]
  params, batch = problem(rows=40)
  for n in (8, 5):
    rows = {k: v[:5 * n] for k, v in batch.items()}
    on, off = (_plain_steps(build(**kw), mesh_of(n), params, rows, steps=20,
                            stacked=form == "stacked")
               for kw in ({"abstain_nonfinite": True}, {}))
    assert_same(on[0], off[0], f"{n} params")
    assert_same(lion_of(on[1]).mu, lion_of(off[1]).mu, f"{n} momenta")
    if options.get("error_feedback"):
      assert_same(lion_of(on[1]).error, lion_of(off[1]).error,
                  f"{n} residuals")
    np.testing.assert_array_equal(lion_of(on[1]).abstentions, 0)


# Schedules counted outside the transform skip with dl.skip_if_none_voted.


@pytest.mark.parametrize("door", DOORS)
def test_an_injected_schedule_skips_a_step_every_worker_abstains_from(door):
  """optax.inject_hyperparams(dl.distributed_lion)(learning_rate=schedule,
  ...) in dl.skip_if_none_voted: a step whose batch is NaN on every worker
  leaves the params and the whole state (the injected count, the rate it
  read) as they were, so the run equals the run without that step."""
  schedule = optax.linear_schedule(0.1, 0.0, 10)
  tx = dl.skip_if_none_voted(optax.inject_hyperparams(dl.distributed_lion)(
      learning_rate=schedule, axis_name="data", weight_decay=0.1,
      abstain_nonfinite=True))
  params, batch = problem()
  nan = {k: np.full_like(v, np.nan) for k, v in batch.items()}
  mesh = mesh_of(4)

  def steps(batches):
    if door == "shard_map":
      p = devices.replicate(params, mesh)
      s = parallel.init_worker_states(tx, p, mesh)
      step = parallel.make_train_step(
          lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
          tx, mesh, donate=False)
      for b in batches:
        p, s, _ = step(p, s, devices.shard_batch(b, mesh))
      return jax.device_get((p, s))
    with jax.set_mesh(mesh):
      p = jax.device_put(params, NamedSharding(mesh, P()))
      s = parallel.init_worker_states(tx, p, mesh)

      @jax.jit
      def step(p, s, b):
        _, grads = dl.workers.value_and_grad(
            lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2))(
                p, b)
        u, s = dl.workers.update(tx)(grads, s, p)
        return optax.apply_updates(p, u), s
      for b in batches:
        p, s = step(p, s, jax.device_put(b, NamedSharding(mesh, P("data"))))
      return jax.device_get((p, s))
  skipped = steps([batch, nan, batch, batch])
  without = steps([batch, batch, batch])
  assert_same(skipped[0], without[0], "params")
  assert_same(skipped[1].count, without[1].count, "injected count")
  assert_same(skipped[1].hyperparams, without[1].hyperparams, "rate")
  lion, lion_without = skipped[1].inner_state[0], without[1].inner_state[0]
  assert_same((lion.count, lion.mu), (lion_without.count, lion_without.mu))
  np.testing.assert_array_equal(lion.abstentions, 4)


def test_skipping_needs_an_abstaining_transform():
  tx = dl.skip_if_none_voted(dl.distributed_lion(LR, axis_name=None))
  params = params_of()
  with pytest.raises(ValueError, match="holds no dl.AbstainingState.*"
                     "abstain_nonfinite=True"):
    tx.update(params, tx.init(params), params)
