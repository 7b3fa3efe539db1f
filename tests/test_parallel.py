"""The data-parallel helpers: shard_map and pmap steps, per-worker state."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import dlion_jax as dl
from dlion_jax import parallel
from messages import assert_names

N = 4
DIM = 37


def loss_fn(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def make_problem(seed=0, global_batch=32):
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=(DIM,)).astype(np.float32)
  x = rng.normal(size=(global_batch, DIM)).astype(np.float32)
  batches = [{"x": x, "y": x @ w_true}] * 6   # a fixed batch: loss must fall
  params = {"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}
  return params, batches


def train_shard_map(tx, params, batches, *, check_vma, num_workers=N):
  mesh = parallel.data_mesh(num_workers)
  params = parallel.replicate(params, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, check_vma=check_vma)
  losses = []
  for batch in batches:
    params, state, loss = step(params, state,
                               parallel.shard_batch(batch, mesh))
    losses.append(float(loss))         # blocks: no queued collectives
  return params, state, losses, step


def train_pmap(tx, params, batches, num_workers=N):
  step = parallel.make_pmap_train_step(loss_fn, tx,
                                       devices=jax.devices()[:num_workers])
  params = parallel.replicate_for_pmap(params, num_workers)
  state = parallel.init_pmap_states(tx, params_single(params), num_workers)
  losses = []
  for batch in batches:
    local = jax.tree.map(
        lambda x: x.reshape((num_workers, -1) + x.shape[1:]), batch)
    params, state, loss = step(params, state, local)
    losses.append(float(loss[0]))
  return params, state, losses


def params_single(stacked):
  return jax.tree.map(lambda x: x[0], stacked)


@pytest.fixture(scope="module")
def tx():
  return dl.distributed_lion(3e-2, axis_name="data")


def test_shard_map_step_trains_and_keeps_own_momenta(tx):
  params, batches = make_problem()
  params, state, losses, _ = train_shard_map(tx, params, batches,
                                             check_vma=True)
  assert losses[-1] < losses[0]
  mu = np.asarray(state[0].mu["w"])
  assert mu.shape == (N, DIM)                    # one momentum per worker
  assert not np.array_equal(mu[0], mu[1])
  assert params["w"].sharding.is_fully_replicated
  assert state[0].mu["w"].sharding.spec == jax.P("data")


def test_check_vma_on_off_and_pmap_agree(tx):
  params, batches = make_problem(1)
  on = train_shard_map(tx, params, batches, check_vma=True)
  off = train_shard_map(tx, params, batches, check_vma=False)
  pm = train_pmap(tx, params, batches)
  chex.assert_trees_all_equal(on[0], off[0])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b[0]), on[0],
               pm[0])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
               on[1][0].mu, pm[1][0].mu)
  np.testing.assert_allclose(on[2], pm[2], rtol=1e-6)
  for leaf in jax.tree.leaves(pm[0]):            # pmap replicas agree
    assert all(np.array_equal(leaf[0], leaf[i]) for i in range(N))


@pytest.mark.parametrize("check_vma", [True, False])
def test_step_sends_votes_not_gradients(tx, check_vma):
  """The only collectives are the vote exchange and the scalar loss mean."""
  params, batches = make_problem(2)
  *_, step = train_shard_map(tx, params, batches[:1], check_vma=check_vma)
  mesh = parallel.data_mesh(N)
  p = parallel.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  text = step.lower(p, s, parallel.shard_batch(batches[0], mesh)).compile(
  ).as_text()
  sent = dl.collective_bytes(text)
  comm = dl.exchange.resolve_comm("auto", N, aggregation="mavo",
                                  leaf_sizes=[DIM, 1])
  votes = dl.accounting.message_bytes([DIM, 1], N, comm=comm)
  loss_mean = 2 * (N - 1) / N * 4   # one f32 all-reduce
  assert sent == pytest.approx(votes + loss_mean)
  fp32_allreduce = dl.allreduce_bits(N) * (DIM + 1) / 8
  assert sent < fp32_allreduce / 4


def test_odd_worker_count(tx):
  params, batches = make_problem(3, global_batch=30)
  params, state, losses, _ = train_shard_map(tx, params, batches,
                                             check_vma=True, num_workers=3)
  assert losses[-1] < losses[0]


def test_single_worker_mesh_is_plain_lion():
  params, batches = make_problem(4, global_batch=8)
  ours = dl.distributed_lion(3e-2, axis_name="data")
  theirs = optax.lion(3e-2)
  a = train_shard_map(ours, params, batches, check_vma=True, num_workers=1)
  b = train_shard_map(theirs, params, batches, check_vma=True, num_workers=1)
  chex.assert_trees_all_equal(a[0], b[0])


def test_helper_errors_name_the_problem():
  with pytest.raises(ValueError, match="num_workers=99"):
    parallel.data_mesh(99)
  mesh = parallel.data_mesh(N)
  with pytest.raises(ValueError, match=r"\['x'\].*divisible by the 4 workers"):
    parallel.shard_batch({"x": np.zeros((6, 2))}, mesh)
  with pytest.raises(ValueError, match="axis_name='batch'"):
    parallel.make_train_step(loss_fn, optax.sgd(1.0), mesh, axis_name="batch")


def test_global_lion_through_pmean_gradients():
  """The baseline: optax.lion on gradients averaged by an fp32 all-reduce."""
  params, batches = make_problem(5)
  tx = optax.chain(parallel.pmean_gradients("data"), optax.lion(3e-2))
  trained, state, losses, step = train_shard_map(tx, params, batches,
                                                 check_vma=False)
  assert losses[-1] < losses[0]
  # The same as one optax.lion fed the full batch's gradient.
  ref_tx = optax.lion(3e-2)
  p, s = jax.tree.map(jnp.asarray, params), ref_tx.init(params)
  for batch in batches:
    g = jax.grad(loss_fn)(p, batch)
    u, s = ref_tx.update(g, s, p)
    p = optax.apply_updates(p, u)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               trained, p)
  mesh = parallel.data_mesh(N)
  text = step.lower(parallel.replicate(params, mesh),
                    parallel.init_worker_states(tx, params, mesh),
                    parallel.shard_batch(batches[0], mesh)).compile().as_text()
  bits = 8 * dl.collective_bytes(text) / (DIM + 1)
  assert bits >= dl.allreduce_bits(N)          # 56 bits a parameter and more


def test_micro_batches_exchange_once():
  params, batches = make_problem(6)
  tx = dl.distributed_lion(3e-2, axis_name="data")
  mesh = parallel.data_mesh(N)
  p0 = parallel.replicate(params, mesh)
  s0 = parallel.init_worker_states(tx, p0, mesh)
  batch = parallel.shard_batch(batches[0], mesh)
  one = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  two = parallel.make_train_step(loss_fn, tx, mesh, donate=False,
                                 micro_batches=2)
  p1, _, l1 = one(p0, s0, batch)
  p2, _, l2 = two(p0, s0, batch)
  # The mean of two half-batch means is the batch mean (up to rounding).
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               p1, p2)
  ops = lambda f: [c.op for c in dl.accounting.collectives(
      f.lower(p0, s0, batch).compile().as_text())]
  assert ops(two) == ops(one)                  # one exchange, not two
  with pytest.raises(ValueError, match="micro_batches=3 must divide"):
    parallel.make_train_step(loss_fn, tx, mesh, micro_batches=3)(
        p0, s0, batch)


@pytest.mark.parametrize("builder", ["shard_map", "pmap"])
def test_forgotten_axis_name_is_an_error_not_diverging_replicas(builder):
  """``distributed_lion(lr)`` without ``axis_name`` never votes: each worker
  would step on its own batch and the "replicated" params would differ."""
  params, batches = make_problem()
  tx = dl.distributed_lion(1e-2)                    # as one writes optax.lion
  with pytest.raises(ValueError) as e:
    if builder == "shard_map":
      train_shard_map(tx, params, batches[:1], check_vma=False)
    else:
      train_pmap(tx, params, batches[:1])
  assert_names(e, "axis 'data'", "4 workers", "axis_name='data'",
               "pmean_gradients('data')")


def test_forgotten_axis_name_is_fine_on_one_worker():
  params, batches = make_problem()
  _, _, losses, _ = train_shard_map(dl.distributed_lion(1e-2), params,
                                    batches, check_vma=False, num_workers=1)
  assert losses[-1] < losses[0]


def test_global_optimizer_after_pmean_gradients_passes_the_check():
  params, batches = make_problem()
  tx = optax.chain(parallel.pmean_gradients("data"), optax.lion(1e-2))
  _, _, losses, _ = train_shard_map(tx, params, batches, check_vma=False)
  assert losses[-1] < losses[0]


_UNBLOCKED_LOOP = """
import jax, jax.numpy as jnp
import dlion_jax as dl
from dlion_jax import parallel
mesh = parallel.data_mesh(8)
tx = dl.distributed_lion(1e-3, axis_name="data")
params = parallel.replicate({"w": jnp.ones((256, 64)), "b": jnp.zeros(64)},
                            mesh)
state = parallel.init_worker_states(tx, params, mesh)
loss_fn = lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2)
step = BUILDER
batch = parallel.shard_batch(jax.random.normal(jax.random.key(0), (64, 256)),
                             mesh)
for _ in range(STEPS):
  params, state, loss = step(params, state, batch)   # never blocks
print("finished", float(loss))
"""


# A fresh Python process per case (integration); in process, the core tier
# checks the mechanism: test_limit_in_flight_waits_for_the_oldest_call.
@pytest.mark.integration
@pytest.mark.parametrize("builder,steps", [
    ("parallel.make_train_step(loss_fn, tx, mesh)", 200),
    # The raw jitted step (no limit) deadlocks with 64 queued steps here;
    # run it with few enough steps to finish, so the script itself is known
    # to be sound.
    ("parallel.make_train_step(loss_fn, tx, mesh).__wrapped__", 24),
])
def test_unblocked_loop_on_simulated_devices_completes(builder, steps):
  """A loop that never reads the loss queues steps; XLA:CPU deadlocks once
  about 32 per device are queued (exit 134 after 40 s). The helpers keep at
  most ``MAX_IN_FLIGHT`` queued."""
  _finishes(_UNBLOCKED_LOOP.replace("BUILDER", builder).replace(
      "STEPS", str(steps)))


def _finishes(script: str) -> None:
  """Runs ``script`` on 8 CPU devices in a fresh process: it must print
  "finished" and exit 0 (a deadlocked rendezvous aborts it)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  done = subprocess.run([sys.executable, "-c", script], env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "finished" in done.stdout


_DONATED_ONLY_LOOP = """
import jax, jax.numpy as jnp
import dlion_jax as dl
from dlion_jax import parallel
mesh = parallel.data_mesh(8)
tx = dl.distributed_lion(1e-3, axis_name="data")
params = parallel.replicate({"w": jnp.ones((256, 64)), "b": jnp.zeros(64)},
                            mesh)
state = parallel.init_worker_states(tx, params, mesh)
batch = parallel.shard_batch(jax.random.normal(jax.random.key(0), (64, 256)),
                             mesh)
def local(p, s, b):
  s = jax.tree.map(lambda x: x[0], s)
  g = jax.grad(lambda p: jnp.mean((b @ p["w"] + p["b"]) ** 2))(p)
  u, s = tx.update(g, s, p)
  return jax.tree.map(jnp.add, p, u), jax.tree.map(lambda x: x[None], s)
step = parallel.limit_in_flight(jax.jit(jax.shard_map(
    local, mesh=mesh, in_specs=(jax.P(), jax.P("data"), jax.P("data")),
    out_specs=(jax.P(), jax.P("data")), check_vma=False),
    donate_argnums=(0, 1)))
for _ in range(300):
  params, state = step(params, state, batch)     # every output donated
print("finished", float(params["b"][0]))
"""


@pytest.mark.integration
def test_limit_in_flight_holds_when_every_output_is_donated():
  """Was: the queued outputs were deleted by the donating next step when
  waited on, so nothing was waited on and the loop aborted (exit 134)."""
  _finishes(_DONATED_ONLY_LOOP)


def test_limit_in_flight_keeps_one_entry_per_queued_call_not_its_outputs():
  """Was: the queue held every output of the last calls (8 steps' params
  and optimizer states); now a one-entry copy each, which survives the
  outputs' deletion (donation) and is waited on."""
  step = parallel.limit_in_flight(
      lambda x: (jnp.full((1000,), x), jnp.full((7,), x)), 3)
  for i in range(10):
    big, small = step(i)
    big.delete()                                 # as a donating call would
  queued = list(step._queued)    # pylint: disable=protected-access
  assert [q.shape for q in queued] == [(1,)] * 3
  assert [int(q[0]) for q in queued] == [7, 8, 9] and not small.is_deleted()


def test_limit_in_flight_waits_for_the_oldest_call():
  calls = []

  def fn(i):
    calls.append(i)
    return jnp.full((), i)
  step = parallel.limit_in_flight(fn, 3)
  outs = [step(i) for i in range(10)]
  assert [int(o) for o in outs] == list(range(10)) and calls == list(range(10))
  assert len(step._queued) == 3   # pylint: disable=protected-access
  with pytest.raises(ValueError, match="max_in_flight must be a positive int"):
    parallel.limit_in_flight(fn, 0)
  assert parallel.limit_in_flight(fn, devices=[_FakeGpu()]) is fn


class _FakeGpu:
  platform = "gpu"


@pytest.mark.parametrize("placed", ["replicated", "one_device"])
def test_replicate_copies_so_a_donating_step_spares_the_callers_arrays(
    placed):
  """Was: ``replicate`` of arrays already placed so, or on one device (as
  ``jnp.ones`` or a model's init gives them: shard 0 kept their buffer),
  returned the caller's own buffers; the step donated them and the caller's
  initial params were deleted ("Array has been deleted" when reused for a
  second run)."""
  params, batches = make_problem()
  mesh = parallel.data_mesh(N)
  initial = (jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
             if placed == "replicated" else jax.tree.map(jnp.asarray, params))
  for _ in range(2):                           # two runs from the same start
    tx = dl.distributed_lion(1e-2, axis_name="data")
    p = parallel.replicate(initial, mesh)
    state = parallel.init_worker_states(tx, p, mesh)
    step = parallel.make_train_step(loss_fn, tx, mesh)
    p, state, loss = step(p, state, parallel.shard_batch(batches[0], mesh))
    assert np.isfinite(float(loss))
  assert not any(x.is_deleted() for x in jax.tree.leaves(initial))


def test_pmap_step_on_fewer_devices_names_the_stacking():
  """Was: jax's "cannot select an axis to squeeze out" when params were
  stacked for all 8 devices and the step maps over 4."""
  params, batches = make_problem()
  tx = dl.distributed_lion(1e-2, axis_name="data")
  step = parallel.make_pmap_train_step(loss_fn, tx, devices=jax.devices()[:N])
  local = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), batches[0])
  with pytest.raises(ValueError) as e:
    step(parallel.replicate_for_pmap(params),
         parallel.init_pmap_states(tx, params, N), local)
  assert_names(e, "params leaf ['b']", "shape (8,)", "size 4",
               "parallel.replicate_for_pmap(params, 4)")
  with pytest.raises(ValueError) as e:
    step(parallel.replicate_for_pmap(params, N),
         parallel.init_pmap_states(tx, params, N), batches[0])
  assert_names(e, "batch leaf ['x']", "shape (32, 37)",
               "[4, local_batch, ...]")


def _counter_problem():
  params = {"w": jnp.ones((3, 5)), "step": jnp.zeros((), jnp.int32)}
  tx = optax.masked(dl.distributed_lion(1e-2, axis_name="data"),
                    {"w": True, "step": False})
  loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2) + 0 * p["step"]
  return params, tx, loss


@pytest.mark.parametrize("micro_batches,check_vma", [(1, False), (2, False),
                                                    (1, True)])
def test_integer_leaves_left_out_with_masked_train_and_stay(micro_batches,
                                                            check_vma):
  """The integer-leaf error says "exclude it with optax.masked"; was: doing
  so, the step still differentiated every leaf ("grad requires real- or
  complex-valued inputs ... int32"). Integer leaves get zero gradients."""
  params, tx, loss = _counter_problem()
  mesh = parallel.data_mesh(N)
  p = parallel.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(loss, tx, mesh, micro_batches=micro_batches,
                                  check_vma=check_vma)
  batch = parallel.shard_batch(jnp.ones((4 * N, 3)), mesh)
  p, state, _ = step(p, state, batch)
  assert p["step"].dtype == jnp.int32 and int(p["step"]) == 0
  assert float(p["w"][0, 0]) < 1.0                       # the rest trains
  pmap_step = parallel.make_pmap_train_step(
      loss, tx, devices=jax.devices()[:N], micro_batches=micro_batches)
  q, _, _ = pmap_step(parallel.replicate_for_pmap(params, N),
                      parallel.init_pmap_states(tx, params, N),
                      jnp.ones((N, 4, 3)))
  chex.assert_trees_all_equal(params_single(q), jax.device_get(p))


def test_micro_batches_accept_an_empty_batch_leaf():
  """Was: ZeroDivisionError from the reshape of a [B, 0] leaf."""
  mesh = parallel.data_mesh(N)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = parallel.replicate({"w": jnp.ones(3)}, mesh)
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2) + jnp.sum(b["mask"])
  step = parallel.make_train_step(loss, tx, mesh, micro_batches=2)
  batch = parallel.shard_batch({"x": jnp.ones((4 * N, 3)),
                                "mask": jnp.ones((4 * N, 0))}, mesh)
  _, _, loss = step(p, parallel.init_worker_states(tx, p, mesh), batch)
  assert float(loss) == 9.0


def test_steps_take_keyword_arguments():
  """Was: TypeError: __call__() got an unexpected keyword argument."""
  params, batches = make_problem()
  mesh = parallel.data_mesh(N)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  batch = parallel.shard_batch(batches[0], mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  p = parallel.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  chex.assert_trees_all_equal(step(params=p, state=s, batch=batch),
                              step(p, s, batch))
  pmap_step = parallel.make_pmap_train_step(loss_fn, tx,
                                            devices=jax.devices()[:N])
  local = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), batches[0])
  new, _, _ = pmap_step(params=parallel.replicate_for_pmap(params, N),
                        state=parallel.init_pmap_states(tx, params, N),
                        batch=local)
  chex.assert_trees_all_equal(params_single(new),
                              jax.device_get(step(p, s, batch)[0]))


def test_per_worker_checks_stacked_rows_and_replicated_outputs():
  """Was: a "stacked" argument of 8 rows on 4 workers silently kept rows
  0, 2, 4, 6; a "replicated" output of a per-worker value returned worker
  0's; a layout list of the wrong length said "zip() argument 2 is
  longer"."""
  mesh = parallel.data_mesh(N)
  double = parallel.per_worker(lambda x: 2 * x, mesh, ins=("stacked",),
                               outs="stacked")
  with pytest.raises(ValueError) as e:
    double(jnp.ones((2 * N, 3)))
  assert_names(e, "per_worker argument 0", "shape (8, 3)", "size 4",
               '"split"')
  np.testing.assert_array_equal(double(jnp.ones((N, 3))), 2 * np.ones((N, 3)))
  local = parallel.per_worker(lambda x: 2 * x, mesh, ins=("stacked",),
                              outs="replicated")
  with pytest.raises(ValueError) as e:
    jax.jit(local)(jnp.arange(float(N)))
  assert_names(e, "output 0", '"replicated"', "jax.lax.pmean(x, 'data')",
               '"stacked"', "check_replicated=False")
  mean = parallel.per_worker(lambda x: lax.pmean(2 * x, "data"), mesh,
                             ins=("stacked",), outs="replicated")
  assert float(jax.jit(mean)(jnp.arange(float(N)))) == N - 1.0
  noise = parallel.per_worker(lambda k: jax.random.normal(k, (2,)), mesh,
                              ins=("stacked",), outs="replicated")
  with pytest.raises(ValueError, match="output 0"):   # keys are per worker
    noise(jax.random.split(jax.random.key(0), N))
  counter = parallel.per_worker(lambda c, x: (c + 1, x), mesh,
                                ins=("stacked", "split"),
                                outs=("replicated", "split"))
  assert int(jax.jit(counter)(jnp.zeros(N, jnp.int32), jnp.ones(8))[0]) == 1
  with pytest.raises(TypeError) as e:
    double(jnp.ones((N, 3)), jnp.ones((N, 3)))
  assert_names(e, "2 positional arguments", "1 layouts")
  pair = parallel.per_worker(lambda x: (x, x), mesh, ins=("stacked",),
                             outs=("stacked",))
  with pytest.raises(ValueError) as e:
    pair(jnp.ones((N, 3)))
  assert_names(e, "returned 2 outputs", "1 layouts")


def test_schedules_work_under_check_vma_and_match_it_off():
  """Was: JAX's "out_specs ... could not infer replication" under
  check_vma=True, since a schedule read the per-worker (varying) count."""
  params, batches = make_problem(3)
  tx = dl.distributed_lion(
      optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 6),
      weight_decay=optax.linear_schedule(1e-2, 0.0, 6), axis_name="data")
  on = train_shard_map(tx, params, batches, check_vma=True)
  off = train_shard_map(tx, params, batches, check_vma=False)
  chex.assert_trees_all_equal(on[0], off[0])
  assert on[2] == off[2] and on[2][-1] < on[2][0]
  mesh = parallel.data_mesh(N)
  p = parallel.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  b = parallel.shard_batch(batches[0], mesh)
  constant = dl.distributed_lion(3e-2, weight_decay=1e-2, axis_name="data")
  plain = parallel.make_train_step(loss_fn, constant, mesh)
  s0 = parallel.init_worker_states(constant, p, mesh)
  # Off, the schedule adds no collective; on, one 4-byte pmax each.
  sent = lambda step, s: dl.collective_bytes(step.lower(p, s, b).compile())
  assert sent(off[3], s) == sent(plain, s0)
  assert sent(on[3], s) > sent(plain, s0)


def test_setting_an_injected_learning_rate_in_per_worker_states():
  """The README's recipe: every worker's copy of the learning rate, set with
  the leaf's own sharding, trains like an optimizer built with that rate."""
  params, batches = make_problem(4)
  mesh = parallel.data_mesh(N)
  p = parallel.replicate(params, mesh)
  batch = parallel.shard_batch(batches[0], mesh)
  tx = optax.inject_hyperparams(dl.distributed_lion, static_args=(
      "axis_name",))(learning_rate=1e-2, axis_name="data")
  state = parallel.init_worker_states(tx, p, mesh)
  lr = state.hyperparams["learning_rate"]
  state.hyperparams["learning_rate"] = jax.device_put(
      jnp.full_like(lr, 3e-4), lr.sharding)
  new = parallel.make_train_step(loss_fn, tx, mesh, donate=False)(
      p, state, batch)[0]
  fixed = dl.distributed_lion(3e-4, axis_name="data")
  want = parallel.make_train_step(loss_fn, fixed, mesh, donate=False)(
      p, parallel.init_worker_states(fixed, p, mesh), batch)[0]
  chex.assert_trees_all_equal(new, want)


def test_limited_steps_can_be_traced():
  """Was: ConcretizationTypeError when a limited step ran inside jit, scan
  or eval_shape (the limit looked at its traced outputs)."""
  step = parallel.limit_in_flight(jax.jit(lambda x: x + 1))
  x = jnp.zeros(3)
  np.testing.assert_array_equal(jax.jit(step)(x), np.ones(3))
  scanned = jax.jit(lambda x: lax.scan(lambda c, _: (step(c), None), x, None,
                                       length=4)[0])
  np.testing.assert_array_equal(scanned(x), np.full(3, 4.0))
  assert jax.eval_shape(step, x).shape == (3,)


def test_guard_under_check_vma_equals_check_vma_off():
  """Was: "out_specs ... could not infer replication": the guard read its
  per-worker (typed varying) count of bad steps."""
  params, batches = make_problem(5)
  tx = dl.apply_if_finite(dl.distributed_lion(3e-2, axis_name="data"), 3)
  on = train_shard_map(tx, params, batches, check_vma=True)
  off = train_shard_map(tx, params, batches, check_vma=False)
  chex.assert_trees_all_equal(on[0], off[0])
  assert on[2] == off[2]
