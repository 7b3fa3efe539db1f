"""NaN / Inf in one worker's gradient (docs/reliability.md, section 4).

* Guarded with :func:`dlion_jax.transforms.apply_if_finite`: the step is
  skipped on every worker at once; after ``max_consecutive_errors`` bad steps
  every worker applies the update together.
* Plain :func:`optax.apply_if_finite` decides per worker: under ``vmap`` the
  workers split, under ``shard_map`` the process hangs in the vote's
  collectives until XLA aborts it (the slow test).
* Unguarded: the vote treats non-finite entries deterministically (binary:
  NaN votes -1, +Inf +1, -Inf -1; ternary: NaN abstains), so replicas stay
  bit-identical and equal the numpy reference; only the bad worker's own
  momentum turns non-finite. A momentum sync repairs it (non-finite entries
  count as 0 in the mean) and error feedback keeps it to its coordinate.
"""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import transforms
import dlion_jax as dl
from harness import AXIS
from harness import run_on_mesh
from messages import assert_names
from reference import DistributedLionReference

N = 4
LR = 1e-2
SHAPES = {"w": (5, 3), "b": (7,)}
BAD_WORKER = 1


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(seed, bad=None, worker=BAD_WORKER):
  """Per-worker grads [N, ...]; ``bad`` written into two entries of one
  worker's ``w`` and one of its ``b``."""
  rng = np.random.default_rng(seed)
  g = {k: rng.normal(size=(N,) + s).astype(np.float32)
       for k, s in SHAPES.items()}
  if bad is not None:
    g["w"][worker, 0, 0] = g["w"][worker, 3, 2] = bad
    g["b"][worker, 4] = bad
  return g


def _assert_replicas_equal(tree):
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    for i in range(1, leaf.shape[0]):
      np.testing.assert_array_equal(leaf[i], leaf[0],
                                    err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("comm,bad,vote", [
    ("alltoall", np.nan, "binary"), ("allgather", np.inf, "ternary"),
    ("psum", -np.inf, "binary"), ("psum_int8", np.nan, "ternary")])
def test_guard_skips_the_step_on_every_worker(comm, bad, vote):
  """Steps: good, bad (skipped everywhere), good == the run without it."""
  guarded = transforms.apply_if_finite(
      dl.distributed_lion(LR, axis_name=AXIS, comm=comm, vote=vote), 3,
      axis_name=AXIS)
  seq = [_grads(1), _grads(2, bad), _grads(3)]
  params, state, updates = run_on_mesh({"g": guarded}, _params(), seq, N,
                                       check_vma=False)["g"]
  # The same program never shown the bad step (the same compiled program:
  # another one may fuse a*x+y differently, an ulp apart).
  ref_params, ref_state, _ = run_on_mesh({"g": guarded}, _params(),
                                         [seq[0], seq[2]], N,
                                         check_vma=False)["g"]
  for u in jax.tree.leaves(updates[1]):       # the bad step: no move anywhere
    np.testing.assert_array_equal(u, np.zeros_like(u))
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  jax.tree.map(np.testing.assert_array_equal, state.inner_state,
               ref_state.inner_state)
  np.testing.assert_array_equal(state.total_notfinite, np.ones(N))
  np.testing.assert_array_equal(state.notfinite_count, np.zeros(N))
  _assert_replicas_equal(params)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


def test_guard_gives_up_on_every_worker_together():
  """max_consecutive_errors=1: the 2nd bad step in a row is applied by all."""
  tx = transforms.apply_if_finite(dl.distributed_lion(LR, axis_name=AXIS), 1,
                                  axis_name=AXIS)
  seq = [_grads(1, np.nan), _grads(2, np.nan)]
  params, state, updates = run_on_mesh({"g": tx}, _params(), seq, N,
                                       check_vma=False)["g"]
  assert not np.any(updates[0]["w"])          # first bad step: skipped
  assert np.all(updates[1]["w"] != 0)         # second: applied everywhere
  _assert_replicas_equal(params)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  np.testing.assert_array_equal(state.notfinite_count, np.full(N, 2))
  mu = state.inner_state[0].mu["w"]
  assert np.isnan(mu[BAD_WORKER, 0, 0])
  assert np.isfinite(np.delete(mu, 1, 0)).all()


def test_plain_optax_apply_if_finite_splits_the_workers():
  """The bug the guard fixes: optax's check is local to each worker."""
  tx = optax.apply_if_finite(dl.distributed_lion(LR, axis_name=AXIS), 3)
  params0 = _params()
  grads = _grads(1, np.nan)

  def worker(g, s):
    u, _ = tx.update(g, s, params0)
    return optax.apply_updates(params0, u)

  state = tx.init(params0)
  out = jax.jit(jax.vmap(worker, in_axes=(0, None), axis_name=AXIS))(
      grads, state)
  np.testing.assert_array_equal(out["w"][BAD_WORKER], params0["w"])  # skipped
  assert not np.array_equal(out["w"][0], params0["w"])               # moved
  assert not np.array_equal(out["w"][0], out["w"][BAD_WORKER])       # split


HANG = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np, optax
    import dlion_jax as dl
    from dlion_jax import devices
    from dlion_jax import parallel
    P = jax.P
    mesh = devices.data_mesh(2)
    tx = optax.apply_if_finite(dl.distributed_lion(1e-2, axis_name="data"), 3)
    params = {"w": jnp.ones(8)}
    state = parallel.init_worker_states(tx, params, mesh)
    def local(p, s, g):
      s = jax.tree.map(lambda x: x[0], s)
      u, _ = tx.update({"w": g[0]}, s, p)
      return optax.apply_updates(p, u)
    g = np.ones((2, 8), np.float32); g[1, 0] = np.nan
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"),
        P("data")), out_specs=P(), check_vma=False))
    print(f(params, state, g), flush=True)
""")


@pytest.mark.slow
def test_plain_optax_apply_if_finite_hangs_shard_map():
  """One worker skips the vote's collectives: XLA aborts after ~40 s."""
  out = subprocess.run([sys.executable, "-c", HANG], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode != 0
  assert "but only 1 of them arrived" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("aggregation,vote,comm,quantizer", [
    ("mavo", "binary", "alltoall", "sign"), ("mavo", "ternary", "psum", "sign"),
    ("avg", "binary", "allgather", "sign"),
    ("avg", "ternary", "psum_int8", "sign"),
    ("mavo", "ternary", "auto", "ternary_l1")])
def test_unguarded_nonfinite_votes_are_deterministic(aggregation, vote, comm,
                                                     quantizer):
  """NaN on worker 1, +Inf and -Inf on worker 2: replicas stay identical and
  equal numpy's; only the bad workers' own momenta turn non-finite."""
  seq = []
  for step in range(3):
    g = _grads(10 + step, np.nan)
    g["w"][2, 1, 1], g["b"][2, 0] = np.inf, -np.inf
    seq.append(g)
  tx = dl.distributed_lion(LR, axis_name=AXIS, aggregation=aggregation,
                           vote=vote, comm=comm, quantizer=quantizer)
  params, state, _ = run_on_mesh({"t": tx}, _params(), seq, N)["t"]
  ref = DistributedLionReference(_params(), N, learning_rate=LR,
                                 aggregation=aggregation, vote=vote,
                                 quantizer=quantizer)
  for g in seq:
    ref.step([{k: v[i] for k, v in g.items()} for i in range(N)])
  for k in SHAPES:
    for i in range(N):
      np.testing.assert_array_equal(params[k][i], ref.params[k], err_msg=k)
      np.testing.assert_array_equal(state[0].mu[k][i], ref.mu[i][k])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  mu = state[0].mu
  assert np.isnan(mu["w"][BAD_WORKER, 0, 0]) and np.isinf(mu["w"][2, 1, 1])
  assert np.isfinite(mu["w"][[0, 3]]).all()
  assert np.isfinite(mu["b"][[0, 3]]).all()


def test_unguarded_nan_in_an_exact_small_leaf_reaches_every_worker():
  """min_compress_size: small leaves are summed in fp32, so a NaN there
  makes that leaf NaN on every worker (still identical); voted leaves stay
  finite."""
  tx = dl.distributed_lion(LR, axis_name=AXIS, min_compress_size=10)
  params, _, _ = run_on_mesh({"t": tx}, _params(), [_grads(1, np.nan)],
                             N)["t"]
  assert np.isnan(params["b"]).any(axis=1).all()      # 7 < 10: exact psum
  assert np.isfinite(params["w"]).all()               # 15 >= 10: voted
  np.testing.assert_array_equal(np.isnan(params["b"][0]),
                                np.isnan(params["b"][BAD_WORKER]))


def _nan_once_then_ones(steps, bad=np.nan):
  """Worker 1's gradient is ``bad`` at w[0, 0] on step 1; every gradient is
  +1 otherwise, so every coordinate should fall at the same pace."""
  seq = [{k: np.ones((N,) + s, np.float32) for k, s in SHAPES.items()}
         for _ in range(steps)]
  seq[0]["w"][BAD_WORKER, 0, 0] = bad
  return seq


@pytest.mark.parametrize("vote", ["binary", "ternary"])
def test_momentum_sync_repairs_a_nan_momentum_instead_of_spreading_it(vote):
  """Was: the sync averaged worker 1's NaN into every worker's momentum, so
  from then on every worker voted -1 (binary) or abstained (ternary) there
  for good: after 21 steps w[0, 0] was at +1.9 while the rest were at -2.1.
  Now a non-finite entry counts as 0 in the mean and the momenta heal."""
  seq = _nan_once_then_ones(21)
  tx = dl.distributed_lion(0.1, weight_decay=0.0, axis_name=AXIS, vote=vote,
                           momentum_sync=1)
  params, state, updates = run_on_mesh({"t": tx}, _params(), seq, N)["t"]
  ref = DistributedLionReference(_params(), N, learning_rate=0.1,
                                 weight_decay=0.0, vote=vote,
                                 sync_steps=range(1, 22))
  for g in seq:
    ref.step([{k: v[i] for k, v in g.items()} for i in range(N)])
  for u in updates[1:]:                          # every step after the NaN
    np.testing.assert_array_equal(u["w"][:, 0, 0], np.float32(-0.1))  # as
  assert np.isfinite(state[0].mu["w"]).all()     # the rest; healed
  for i in range(N):
    np.testing.assert_array_equal(params["w"][i], ref.params["w"])
    np.testing.assert_array_equal(state[0].mu["w"][i], ref.mu[i]["w"])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_feedback_keeps_a_bad_entry_to_its_coordinate(bad):
  """Was: one NaN/+Inf made worker 1's L1 scale non-finite, its whole error
  buffer NaN for good, and D = 1/3 instead of 1 on every coordinate (avg,
  N = 3). Now the scale ignores it and the residual there is 0."""
  seq = _nan_once_then_ones(6, bad)
  tx = dl.distributed_lion(0.1, weight_decay=0.0, axis_name=AXIS,
                           aggregation="avg", error_feedback=True)
  _, state, updates = run_on_mesh({"t": tx}, _params(), seq, N)["t"]
  assert np.isfinite(state[0].error["w"]).all()
  assert np.isfinite(state[0].error["b"]).all()
  last = updates[-1]["w"][0] / np.float32(-0.1)     # D, every coordinate
  np.testing.assert_array_equal(last.ravel()[1:], 1.0)
  assert last[0, 0] == (1.0 if bad == np.inf else 0.5)   # NaN momentum: -1


def test_guard_accepts_bf16_params_with_float32_momentum():
  """Was: the update came out float32 and the skip branch returned bf16
  zeros, so lax.cond raised 'branches must have equal output types'."""
  params = {k: v.astype(jax.numpy.bfloat16) for k, v in _params().items()}
  tx = dl.apply_if_finite(dl.distributed_lion(LR, axis_name=AXIS,
                                              mu_dtype=np.float32), 3)
  seq = [{k: v.astype(jax.numpy.bfloat16) for k, v in g.items()}
         for g in (_grads(1), _grads(2, np.nan), _grads(3))]
  out, state, updates = run_on_mesh({"t": tx}, params, seq, N)["t"]
  assert updates[0]["w"].dtype == np.float32
  np.testing.assert_array_equal(updates[1]["w"], 0.0)       # skipped
  assert int(state.total_notfinite[0]) == 1
  assert out["w"].dtype == jax.numpy.bfloat16 and np.isfinite(
      out["w"].astype(np.float32)).all()


def test_guard_on_another_axis_names_the_argument():
  tx = dl.apply_if_finite(dl.distributed_lion(LR, axis_name="w"), 3)
  p = _params()
  with pytest.raises(NameError) as e:
    jax.vmap(lambda g: tx.update(g, tx.init(p), p), axis_name="w")(
        _grads(0))
  assert_names(e, "dl.apply_if_finite", "axis_name='data'",
               "dl.apply_if_finite(tx, 5, axis_name=")


def _compiled_step(tx):
  """The compiled step of ``tx`` on N workers (never run)."""
  mesh = devices.data_mesh(N, axis_name=AXIS)
  step = parallel.make_train_step(
      lambda p, x: sum(jax.numpy.sum(p[k] * x[k]) for k in p), tx, mesh,
      donate=False)
  params = devices.replicate(_params(), mesh)
  return step.lower(params, parallel.init_worker_states(tx, params, mesh),
                    devices.shard_batch(_grads(0), mesh)).compile()


@pytest.mark.parametrize("sync", [None, 3])
def test_guarded_vote_is_counted_as_sent_on_every_step(sync):
  """The guard adds its flag (one int32 psum) to what a step sends; the
  vote stays out of its conditional, so conditional=False keeps it and
  only a momentum sync is left out. Was: the vote ran in the guard's
  lax.cond and conditional=False left only the flag."""
  inner = dl.distributed_lion(LR, axis_name=AXIS, momentum_sync=sync)
  plain = _compiled_step(inner)
  guarded = _compiled_step(dl.apply_if_finite(inner, 3))
  flag = 2 * (N - 1) / N * 4
  for conditional in (True, False):
    assert dl.collective_bytes(guarded, conditional=conditional) == (
        dl.collective_bytes(plain, conditional=conditional) + flag)
  assert dl.collective_bytes(plain, conditional=False) > flag
  synced = [c for c in dl.hlo.collectives(guarded.as_text())
            if c.conditional]
  assert len(synced) == (sync is not None)


@pytest.mark.parametrize("options", [
    dict(), dict(momentum_sync=2, vote="ternary", comm="psum"),
    dict(error_feedback=True, aggregation="avg")])
def test_guard_on_finite_steps_is_the_unguarded_optimizer(options):
  """On finite steps the guarded optimizer's params and updates equal the
  inner one's bit for bit (was: a parameter an ulp apart after 4 steps: the
  update came out of a branch of a lax.cond, and XLA fused the step around
  it unlike the unguarded one)."""
  inner = dl.distributed_lion(LR, axis_name=AXIS, weight_decay=0.1,
                              **options)
  seq = [_grads(i) for i in range(4)]
  run = lambda tx: run_on_mesh({"t": tx}, _params(), seq, N,
                               check_vma=False)["t"]
  params, _, updates = run(inner)
  guarded_params, _, guarded_updates = run(dl.apply_if_finite(inner, 3))
  jax.tree.map(np.testing.assert_array_equal, (guarded_params,
                                               guarded_updates),
               (params, updates))
