"""The data-parallel helpers: shard_map and pmap steps, per-worker state."""

import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import transforms
import dlion_jax as dl
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
  mesh = devices.data_mesh(num_workers)
  params = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, check_vma=check_vma)
  losses = []
  for batch in batches:
    params, state, loss = step(params, state,
                               devices.shard_batch(batch, mesh))
    losses.append(float(loss))         # blocks: no queued collectives
  return params, state, losses, step


def train_pmap(tx, params, batches, num_workers=N):
  step = parallel.make_pmap_train_step(loss_fn, tx,
                                       devices=jax.devices()[:num_workers])
  params = devices.replicate_for_pmap(params, num_workers)
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
  mesh = devices.data_mesh(N)
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  text = step.lower(p, s, devices.shard_batch(batches[0], mesh)).compile(
  ).as_text()
  sent = dl.collective_bytes(text)
  comm = exchange.resolve_comm("auto", N, aggregation="mavo",
                                  leaf_sizes=[DIM, 1])
  votes = message.message_bytes([DIM, 1], N, comm=comm)
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
    devices.data_mesh(99)
  mesh = devices.data_mesh(N)
  with pytest.raises(ValueError, match=r"\['x'\].*divisible by the 4 workers"):
    devices.shard_batch({"x": np.zeros((6, 2))}, mesh)
  with pytest.raises(ValueError, match="axis_name='batch'"):
    parallel.make_train_step(loss_fn, optax.sgd(1.0), mesh, axis_name="batch")


def test_global_lion_through_pmean_gradients():
  """The baseline: optax.lion on gradients averaged by an fp32 all-reduce."""
  params, batches = make_problem(5)
  tx = optax.chain(transforms.pmean_gradients("data"), optax.lion(3e-2))
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
  mesh = devices.data_mesh(N)
  text = step.lower(devices.replicate(params, mesh),
                    parallel.init_worker_states(tx, params, mesh),
                    devices.shard_batch(batches[0], mesh)).compile().as_text()
  bits = 8 * dl.collective_bytes(text) / (DIM + 1)
  assert bits >= dl.allreduce_bits(N)          # 56 bits a parameter and more


def test_micro_batches_exchange_once():
  params, batches = make_problem(6)
  tx = dl.distributed_lion(3e-2, axis_name="data")
  mesh = devices.data_mesh(N)
  p0 = devices.replicate(params, mesh)
  s0 = parallel.init_worker_states(tx, p0, mesh)
  batch = devices.shard_batch(batches[0], mesh)
  one = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  two = parallel.make_train_step(loss_fn, tx, mesh, donate=False,
                                 micro_batches=2)
  p1, _, l1 = one(p0, s0, batch)
  p2, _, l2 = two(p0, s0, batch)
  # The mean of two half-batch means is the batch mean (up to rounding).
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               p1, p2)
  ops = lambda f: [c.op for c in dl.hlo.collectives(
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
  tx = optax.chain(transforms.pmean_gradients("data"), optax.lion(1e-2))
  _, _, losses, _ = train_shard_map(tx, params, batches, check_vma=False)
  assert losses[-1] < losses[0]


_UNBLOCKED_LOOP = """
import jax, jax.numpy as jnp
from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl
mesh = devices.data_mesh(8)
tx = dl.distributed_lion(1e-3, axis_name="data")
params = devices.replicate({"w": jnp.ones((256, 64)), "b": jnp.zeros(64)},
                           mesh)
state = parallel.init_worker_states(tx, params, mesh)
loss_fn = lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2)
step = BUILDER
batch = devices.shard_batch(jax.random.normal(jax.random.key(0), (64, 256)),
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
from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl
mesh = devices.data_mesh(8)
tx = dl.distributed_lion(1e-3, axis_name="data")
params = devices.replicate({"w": jnp.ones((256, 64)), "b": jnp.zeros(64)},
                           mesh)
state = parallel.init_worker_states(tx, params, mesh)
batch = devices.shard_batch(jax.random.normal(jax.random.key(0), (64, 256)),
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
  mesh = devices.data_mesh(N)
  initial = (jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.P()))
             if placed == "replicated" else jax.tree.map(jnp.asarray, params))
  for _ in range(2):                           # two runs from the same start
    tx = dl.distributed_lion(1e-2, axis_name="data")
    p = devices.replicate(initial, mesh)
    state = parallel.init_worker_states(tx, p, mesh)
    step = parallel.make_train_step(loss_fn, tx, mesh)
    p, state, loss = step(p, state, devices.shard_batch(batches[0], mesh))
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
    step(devices.replicate_for_pmap(params),
         parallel.init_pmap_states(tx, params, N), local)
  assert_names(e, "params leaf ['b']", "shape (8,)", "size 4",
               "devices.replicate_for_pmap(params, 4)")
  with pytest.raises(ValueError) as e:
    step(devices.replicate_for_pmap(params, N),
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
  mesh = devices.data_mesh(N)
  p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(loss, tx, mesh, micro_batches=micro_batches,
                                  check_vma=check_vma)
  batch = devices.shard_batch(jnp.ones((4 * N, 3)), mesh)
  p, state, _ = step(p, state, batch)
  assert p["step"].dtype == jnp.int32 and int(p["step"]) == 0
  assert float(p["w"][0, 0]) < 1.0                       # the rest trains
  pmap_step = parallel.make_pmap_train_step(
      loss, tx, devices=jax.devices()[:N], micro_batches=micro_batches)
  q, _, _ = pmap_step(devices.replicate_for_pmap(params, N),
                      parallel.init_pmap_states(tx, params, N),
                      jnp.ones((N, 4, 3)))
  chex.assert_trees_all_equal(params_single(q), jax.device_get(p))


def test_micro_batches_accept_an_empty_batch_leaf():
  """Was: ZeroDivisionError from the reshape of a [B, 0] leaf."""
  mesh = devices.data_mesh(N)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  p = devices.replicate({"w": jnp.ones(3)}, mesh)
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2) + jnp.sum(b["mask"])
  step = parallel.make_train_step(loss, tx, mesh, micro_batches=2)
  batch = devices.shard_batch({"x": jnp.ones((4 * N, 3)),
                               "mask": jnp.ones((4 * N, 0))}, mesh)
  _, _, loss = step(p, parallel.init_worker_states(tx, p, mesh), batch)
  assert float(loss) == 9.0


def test_steps_take_keyword_arguments():
  """Was: TypeError: __call__() got an unexpected keyword argument."""
  params, batches = make_problem()
  mesh = devices.data_mesh(N)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  batch = devices.shard_batch(batches[0], mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  chex.assert_trees_all_equal(step(params=p, state=s, batch=batch),
                              step(p, s, batch))
  pmap_step = parallel.make_pmap_train_step(loss_fn, tx,
                                            devices=jax.devices()[:N])
  local = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), batches[0])
  new, _, _ = pmap_step(params=devices.replicate_for_pmap(params, N),
                        state=parallel.init_pmap_states(tx, params, N),
                        batch=local)
  chex.assert_trees_all_equal(params_single(new),
                              jax.device_get(step(p, s, batch)[0]))


def test_per_worker_checks_stacked_rows_and_replicated_outputs():
  """Was: a "stacked" argument of 8 rows on 4 workers silently kept rows
  0, 2, 4, 6; a "replicated" output of a per-worker value returned worker
  0's; a layout list of the wrong length said "zip() argument 2 is
  longer"."""
  mesh = devices.data_mesh(N)
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
  mesh = devices.data_mesh(N)
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  b = devices.shard_batch(batches[0], mesh)
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
  mesh = devices.data_mesh(N)
  p = devices.replicate(params, mesh)
  batch = devices.shard_batch(batches[0], mesh)
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


# Steps written the way users write them (review 4): arrays fresh from
# jax.random or a model's init, the README's chain, the user's own jit.

AxisType = jax.sharding.AxisType


def readme_tx(axis_name="data"):
  """README.md's optimizer."""
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      dl.distributed_lion(1e-2, weight_decay=1e-2, axis_name=axis_name))


def readme_loss(params, x, y):
  return jnp.mean((x @ params["w"] - y) ** 2)


def readme_step(tx, mesh, *, pcast=True, check_vma=True, loss=readme_loss,
                alike=False):
  """README.md's Example step (with or without its pcast line; ``alike``:
  the state's row through parallel.typed_alike)."""
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data"), jax.P("data"),
                                      jax.P("data")),
                 out_specs=(jax.P(), jax.P("data"), jax.P()),
                 check_vma=check_vma)
  def train_step(params, state, x, y):
    state = jax.tree.map(lambda s: s[0], state)
    if alike:
      state = parallel.typed_alike(state)
    local = jax.lax.pcast(params, "data", to="varying") if pcast else params
    value, grads = jax.value_and_grad(loss)(local, x, y)
    updates, state = tx.update(grads, state, params)
    state = jax.tree.map(lambda s: s[None], state)
    return (optax.apply_updates(params, updates), state,
            jax.lax.pmean(value, "data"))
  return train_step


def explicit_mesh(n):
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def readme_problem(mesh, n, features=1024):
  x = jax.random.normal(jax.random.key(0), (16 * n, features))
  y = x @ jnp.linspace(-1, 1, features)
  x, y = (jax.device_put(a, jax.NamedSharding(mesh, jax.P("data")))
          for a in (x, y))
  params = jax.device_put({"w": jnp.zeros(features)},
                          jax.NamedSharding(mesh, jax.P()))
  return params, x, y


@pytest.mark.parametrize("n", [8, 3])
def test_readme_step_without_pcast_is_refused_with_the_fix(n):
  """Was: accepted; JAX all-reduced the gradients in fp32 (the transpose of
  the replicated params' broadcast) and every worker voted on the one
  global gradient, sending the all-reduce on top of the votes."""
  mesh = explicit_mesh(n)
  tx = readme_tx()
  params, x, y = readme_problem(mesh, n)
  state = parallel.init_worker_states(tx, params, mesh)
  with pytest.raises(ValueError) as e:
    readme_step(tx, mesh, pcast=False)(params, state, x, y)
  assert_names(e, "['w']", "check_vma",
               "jax.lax.pcast(params, 'data', to='varying')")
  step = readme_step(tx, mesh)
  new = step(params, state, x, y)
  sent = dl.collective_bytes(step.lower(params, state, x, y).compile())
  assert sent < dl.allreduce_bits(n) * 1024 / 8 / 10
  # Without check_vma nothing is typed, nothing all-reduced, nothing told:
  # the step without pcast is the step with it.
  unchecked = readme_step(tx, mesh, pcast=False, check_vma=False)
  chex.assert_trees_all_equal(unchecked(params, state, x, y), new)


def test_nnx_shard_map_step_without_pcast_is_refused_with_the_fix():
  """The same step with a Flax NNX model merged inside the shard_map and
  nnx.value_and_grad; was: accepted, the gradients all-reduced."""
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(16, 32, rngs=rngs)
      self.down = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  n = 3
  mesh = explicit_mesh(n)
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
  params = devices.replicate(params, mesh)
  tx = readme_tx()
  state = parallel.init_worker_states(tx, params, mesh)
  loss = lambda p, x, y: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)
  model_loss = lambda model, x, y: jnp.mean((model(x) - y) ** 2)

  def make(pcast, check_vma=True):
    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data"),
                                        jax.P("data"), jax.P("data")),
                   out_specs=(jax.P(), jax.P("data"), jax.P()),
                   check_vma=check_vma)
    def step(params, state, x, y):
      state = jax.tree.map(lambda s: s[0], state)
      local = jax.lax.pcast(params, "data", to="varying") if pcast else params
      value, grads = nnx.value_and_grad(model_loss)(
          nnx.merge(graphdef, local), x, y)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates),
              jax.tree.map(lambda s: s[None], state),
              jax.lax.pmean(value, "data"))
    return step

  x = jax.random.normal(jax.random.key(1), (8 * n, 16))
  x, y = (jax.device_put(a, jax.NamedSharding(mesh, jax.P("data")))
          for a in (x, jnp.sin(x[:, :1])))
  with pytest.raises(ValueError) as e:
    make(pcast=False)(params, state, x, y)
  assert_names(e, "['up']['kernel']", "['down']['bias']", "check_vma",
               "jax.lax.pcast(params, 'data', to='varying')")
  new = make(pcast=True)(params, state, x, y)
  chex.assert_trees_all_equal(
      make(pcast=False, check_vma=False)(params, state, x, y), new)
  # The same computation as make_train_step's.
  want = parallel.make_train_step(lambda p, b: loss(p, *b), tx, mesh,
                                  donate=False)(params, state, (x, y))
  chex.assert_trees_all_equal(new[0], want[0])


@pytest.mark.parametrize("n", [8, 3])
def test_per_worker_takes_raw_prng_keys_as_per_worker(n):
  """Was: a raw key (jax.random.PRNGKey's two uint32 words, as a Linen
  TrainState's dropout_rng holds it) counted as a step counter, equal on
  every worker: a value drawn from it came back "replicated", worker 0's."""
  mesh = devices.data_mesh(n)
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  assert keys.dtype == jnp.uint32 and keys.shape == (n, 2)
  draw = parallel.per_worker(lambda k: jax.random.normal(k, (2,)), mesh,
                             ins=("stacked",), outs="replicated")
  for run in (draw, jax.jit(draw)):
    with pytest.raises(ValueError) as e:
      run(keys)
    assert_names(e, "output 0", '"replicated"', "differs from worker to "
                 "worker", "jax.lax.pmean(x, 'data')")
  mean = parallel.per_worker(
      lambda k: lax.pmean(jax.random.normal(k, (2,)), "data"), mesh,
      ins=("stacked",), outs="replicated")
  np.testing.assert_allclose(
      jax.jit(mean)(keys),
      np.mean([jax.random.normal(k, (2,)) for k in keys], axis=0),
      rtol=1e-5, atol=1e-6)


def test_train_state_dropout_rng_laid_out_stacked_is_per_worker():
  """A Linen TrainState with a per-worker dropout_rng (raw key) laid out
  "stacked": a metric of its dropout mask returned "replicated" without a
  reduction was accepted (worker 0's); now refused, naming the leaf. With
  the mean over workers the step runs and the voted params stay equal."""
  pytest.importorskip("flax.linen")
  from flax import linen as nn   # pylint: disable=import-outside-toplevel
  from flax.training import train_state  # pylint: disable=import-outside-toplevel

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      h = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
      return nn.Dense(1)(h)

  class State(train_state.TrainState):
    dropout_rng: jax.Array

  n = 4
  mesh = devices.data_mesh(n)
  model = MLP()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8)),
                      train=False)["params"]
  state = State.create(apply_fn=model.apply,
                       params=devices.replicate(params, mesh), tx=readme_tx(),
                       dropout_rng=jax.random.PRNGKey(1))
  state = state.replace(
      step=jax.device_put(jnp.int32(0), jax.NamedSharding(mesh, jax.P())),
      opt_state=devices.stack_for_workers(state.opt_state, mesh),
      dropout_rng=jax.device_put(jax.random.split(state.dropout_rng, n),
                                 jax.NamedSharding(mesh, jax.P("data"))))
  layout = state.replace(step="replicated", params="replicated",
                         opt_state="stacked", dropout_rng="stacked")

  def make(reduce):
    def train_step(state, batch):
      rng = jax.random.fold_in(state.dropout_rng, state.step)

      def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"], train=True,
                              rngs={"dropout": rng})
        return jnp.mean((pred - batch["y"]) ** 2)
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      kept = jnp.mean(jax.random.bernoulli(rng, 0.9, (16,)), dtype=float)
      if reduce:
        kept = lax.pmean(kept, "data")
      return (state.apply_gradients(grads=grads),
              {"loss": lax.pmean(loss, "data"), "kept": kept})
    return jax.jit(parallel.per_worker(train_step, mesh, ins=(layout, "split"),
                                       outs=(layout, "replicated")))

  x = jax.random.normal(jax.random.key(2), (8 * n, 8))
  batch = devices.shard_batch({"x": x, "y": x[:, :1]}, mesh)
  with pytest.raises(ValueError) as e:
    make(reduce=False)(state, batch)
  assert_names(e, "output 1", "['kept']", "differs from worker to worker",
               "jax.lax.pmean(x, 'data')")
  new, metrics = make(reduce=True)(state, batch)
  assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))
  for leaf in jax.tree.leaves(new.params):
    copies = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(np.array_equal(c, copies[0]) for c in copies)


def mlp_loss(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def linear_loss(params, batch):
  return readme_loss(params, batch["x"], batch["y"])


def two_axis_problem(model):
  """A model's params and a batch of 512 rows, fresh from jax.random."""
  k = jax.random.split(jax.random.key(7), 4)
  if model == "mlp":
    params = {"w1": jax.random.normal(k[0], (32, 48)) / 6, "b1": jnp.zeros(48),
              "w2": jax.random.normal(k[1], (48, 1)) / 7, "b2": jnp.zeros(1)}
    x = jax.random.normal(k[2], (512, 32))
    return mlp_loss, params, {"x": x, "y": jnp.sin(x[:, :1])}
  x = jax.random.normal(k[3], (512, 1024))
  return linear_loss, {"w": jnp.zeros(1024)}, {
      "x": x, "y": x @ jnp.linspace(-1, 1, 1024)}


def node_rows_moved(text: str, rows: int) -> list[str]:
  """The all-gathers and dots of compiled HLO ``text`` whose result has a
  dimension of ``rows``."""
  found = []
  for line in text.splitlines():
    m = re.search(r"= \w+\[([\d,]*)\]\S* (all-gather|dot)\(", line)
    if m and str(rows) in m.group(1).split(","):
      found.append(line.strip()[:120])
  return found


@pytest.mark.parametrize("model", ["mlp", "linear"])
def test_explicit_fast_axis_differentiates_own_rows_as_on_auto(model):
  """make_train_step on the README's Explicit ("data", "fsdp") 2 x 4 mesh,
  params replicated, the batch over both axes, no shard_axis. Was: the
  region manual over "data" all-gathered each node's 256 rows to its 4
  devices (the linear model: 791,046 bytes over "fsdp" against 9,222 on
  Auto axes), each device differentiating all of them."""
  loss, params, batch = two_axis_problem(model)
  tx = readme_tx()
  out, sent = {}, {}
  for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind,) * 2)
    p = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
    b = jax.device_put(batch, jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
    s = parallel.init_worker_states(tx, p, mesh)
    step = parallel.make_train_step(loss, tx, mesh, donate=False)
    compiled = step.lower(p, s, b).compile()
    sent[kind] = dl.collective_bytes_by_axis(compiled, mesh)
    assert not node_rows_moved(compiled.as_text(), 512 // 2)
    assert node_rows_moved(compiled.as_text(), 512 // 8)   # own rows
    for _ in range(2):
      p, s, value = step(p, s, b)
    out[kind] = jax.device_get((p, s, value))
  assert sent[AxisType.Explicit]["fsdp"] == sent[AxisType.Auto]["fsdp"]
  assert sent[AxisType.Explicit]["data"] == sent[AxisType.Auto]["data"]
  chex.assert_trees_all_equal(out[AxisType.Explicit], out[AxisType.Auto])


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_micro_batches_keep_each_devices_rows(kind):
  """micro_batches on a 2 x 4 mesh, the batch over both axes: each device
  differentiates its own share of every micro-batch. Was, on Auto axes:
  the contiguous split moved rows between the devices (798,508 bytes a
  step at micro_batches=2 against 9,258 at 1)."""
  loss, params, batch = two_axis_problem("linear")
  tx = readme_tx()
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind,) * 2)
  p = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
  b = jax.device_put(batch, jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
  s = parallel.init_worker_states(tx, p, mesh)
  sent = {}
  for k in (1, 2):
    step = parallel.make_train_step(loss, tx, mesh, micro_batches=k,
                                    donate=False)
    compiled = step.lower(p, s, b).compile()
    sent[k] = dl.collective_bytes(compiled)
    assert not node_rows_moved(compiled.as_text(), 512 // 2 // k)
  # One more reduction of the 1,024 gradients over "fsdp" per micro-batch.
  assert sent[2] < 2 * sent[1]


def vma_problem(n):
  k = jax.random.split(jax.random.key(3), 2)
  params = {"w": jax.random.normal(k[0], (DIM,)), "b": jnp.zeros(())}
  x = jax.random.normal(k[1], (8 * n, DIM))
  return params, {"x": x, "y": x @ jnp.linspace(-1, 1, DIM)}


VMA_TXS = {   # read a per-worker count or hyperparameter after the vote
    "optax_schedule": lambda: optax.chain(
        dl.scale_by_distributed_lion(axis_name="data"),
        optax.add_decayed_weights(1e-2),
        optax.scale_by_learning_rate(optax.linear_schedule(1e-2, 1e-3, 10))),
    "multi_steps": lambda: optax.MultiSteps(
        dl.distributed_lion(1e-2, axis_name="data"), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        dl.distributed_lion)(learning_rate=1e-2, axis_name="data"),
    "inject_schedule": lambda: optax.inject_hyperparams(dl.distributed_lion)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 10),
        axis_name="data"),
}


@pytest.mark.parametrize("case", sorted(VMA_TXS))
def test_optax_counts_and_hyperparams_run_under_check_vma(case):
  """Was: make_train_step(check_vma=True) refused by JAX ("out_specs ...
  could not infer replication"; MultiSteps: "cond branches must have equal
  output types"), and a hand-written step had no way out. Now both, the
  hand-written step with parallel.typed_alike, equal check_vma=False bit
  for bit, params and state, over 3 steps at 3 workers."""
  n = 3
  mesh = devices.data_mesh(n)
  tx = VMA_TXS[case]()
  params, batch = vma_problem(n)
  batch = devices.shard_batch(batch, mesh)
  loss = lambda p, x, y: loss_fn(p, {"x": x, "y": y})

  def run(step, hand):
    p = devices.replicate(params, mesh)
    s = parallel.init_worker_states(tx, p, mesh)
    for _ in range(3):
      p, s, value = (step(p, s, batch["x"], batch["y"]) if hand
                     else step(p, s, batch))
    return jax.device_get((p, s, value))

  want = run(parallel.make_train_step(loss_fn, tx, mesh, check_vma=False),
             hand=False)
  chex.assert_trees_all_equal(run(parallel.make_train_step(
      loss_fn, tx, mesh, check_vma=True), hand=False), want)
  variants = [(True, True), (False, True)]        # (check_vma, typed_alike)
  if case == "inject_hyperparams":                # the rate is typed alike
    variants.append((True, False))
  for check_vma, alike in variants:
    step = readme_step(tx, mesh, check_vma=check_vma, pcast=check_vma,
                       loss=loss, alike=alike)
    chex.assert_trees_all_equal(run(step, hand=True), want)


def test_typed_alike_costs_no_bytes_where_nothing_needs_it():
  """README's chain: check_vma=True sends what check_vma=False sends, in
  make_train_step and in a hand-written step through typed_alike; with
  dl.distributed_lion's own schedule (its one 4-byte pmax) typed_alike adds
  no second one."""
  n = 3
  mesh = explicit_mesh(n)
  params, x, y = readme_problem(mesh, n, features=DIM)
  scheduled = dl.distributed_lion(optax.linear_schedule(1e-2, 1e-3, 10),
                                  axis_name="data")
  sent = {}
  for name, tx in (("readme", readme_tx()), ("scheduled", scheduled)):
    state = parallel.init_worker_states(tx, params, mesh)
    for check_vma in (True, False):
      step = parallel.make_train_step(linear_loss, tx, mesh,
                                      check_vma=check_vma)
      sent[name, "made", check_vma] = dl.collective_bytes(step.lower(
          params, state, {"x": x, "y": y}).compile())
    for alike in (True, False):
      step = readme_step(tx, mesh, alike=alike)
      sent[name, "hand", alike] = dl.collective_bytes(
          step.lower(params, state, x, y).compile())
    assert (sent[name, "hand", True] == sent[name, "hand", False]
            == sent[name, "made", True]), sent
  assert sent["readme", "made", True] == sent["readme", "made", False]
  pmax = 2 * (n - 1) / n * 4                       # one int32 all-reduce
  assert sent["scheduled", "made", True] == pytest.approx(
      sent["readme", "made", True] + pmax)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_tuple_axis_name_votes_over_both_axes_like_a_flat_mesh(kind):
  """make_train_step(..., axis_name=("data", "fsdp")) with tx voting over
  both axes of a 2 x 4 mesh: 8 workers. Was refused: "exchanges nothing
  over axis ('data', 'fsdp')"."""
  loss, params, batch = two_axis_problem("mlp")
  axes = ("data", "fsdp")
  mesh = jax.make_mesh((2, 4), axes, axis_types=(kind,) * 2)
  tx = readme_tx(axis_name=axes)
  p = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
  s = parallel.init_worker_states(tx, p, mesh, axis_name=axes)
  b = jax.device_put(batch, jax.NamedSharding(mesh, jax.P(axes)))
  step = parallel.make_train_step(loss, tx, mesh, axis_name=axes,
                                  donate=False)
  sent = dl.collective_bytes_by_axis(step.lower(p, s, b).compile(), mesh)
  for _ in range(3):
    p, s, value = step(p, s, b)
  flat_mesh = devices.data_mesh(8)
  flat_tx = readme_tx()
  fp = devices.replicate(params, flat_mesh)
  fs = parallel.init_worker_states(flat_tx, fp, flat_mesh)
  fb = devices.shard_batch(batch, flat_mesh)
  flat = parallel.make_train_step(loss, flat_tx, flat_mesh, donate=False)
  flat_sent = dl.collective_bytes(flat.lower(fp, fs, fb).compile())
  for _ in range(3):
    fp, fs, flat_value = flat(fp, fs, fb)
  chex.assert_trees_all_equal(jax.device_get((p, s, value)),
                              jax.device_get((fp, fs, flat_value)))
  assert sent["data"] == sent["fsdp"] == 0             # one 8-worker vote
  assert sent[axes] == flat_sent


def test_per_worker_follows_carried_state_to_a_fixed_point():
  """per_worker with the optimizer state laid out "stacked" and the params
  "replicated". Was refused ("differs from worker to worker"): every
  stacked float leaf counted as per worker, so a global optimizer's
  moments after pmean_gradients, or an injected learning rate, made the
  new params look per worker. Now accepted, equal to make_train_step bit
  for bit; still refused: an optimizer that exchanges nothing, and params
  moved by a per-worker state that the step updates from its batch."""
  n = 5
  mesh = devices.data_mesh(n)
  params, batch = vma_problem(n)
  batch = devices.shard_batch(batch, mesh)

  def worker_step(tx):
    def step(params, state, batch):
      value, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state,
              lax.pmean(value, "data"))
    return jax.jit(parallel.per_worker(
        step, mesh, ins=("replicated", "stacked", "split"),
        outs=("replicated", "stacked", "replicated")))

  def run(step, tx):
    p = devices.replicate(params, mesh)
    s = parallel.init_worker_states(tx, p, mesh)
    for _ in range(3):
      p, s, value = step(p, s, batch)
    return jax.device_get((p, s, value))

  for tx in (optax.chain(transforms.pmean_gradients("data"), optax.adam(1e-2)),
             optax.inject_hyperparams(dl.distributed_lion)(
                 learning_rate=1e-2, axis_name="data")):
    made = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
    chex.assert_trees_all_equal(run(worker_step(tx), tx), run(made, tx))
  adam = optax.adam(1e-2)
  with pytest.raises(ValueError) as e:
    run(worker_step(adam), adam)
  assert_names(e, "output 0", "differs from worker to worker",
               "exchanges nothing over 'data'", "axis_name='data'")

  def carried(params, row, batch):        # the row read before its update
    new = jax.tree.map(lambda p, r: p - 1e-2 * r, params, row)
    row = jax.tree.map(lambda r, g: 0.9 * r + g, row,
                       jax.grad(loss_fn)(params, batch))
    return new, row, lax.pmean(loss_fn(params, batch), "data")
  step = jax.jit(parallel.per_worker(
      carried, mesh, ins=("replicated", "stacked", "split"),
      outs=("replicated", "stacked", "replicated")))
  rows = devices.stack_for_workers(jax.tree.map(jnp.zeros_like, params),
                                   mesh)
  with pytest.raises(ValueError) as e:
    step(devices.replicate(params, mesh), rows, batch)
  assert_names(e, "output 0", "differs from worker to worker")


def test_per_worker_keeps_the_placement_of_what_it_updates():
  """A per_worker step called on arrays on an Auto ("data", "fsdp",
  "model") mesh returns the params and state placed as they came, with no
  out_shardings pinned (was: P('fsdp', 'model') came back
  P(('fsdp', 'model'),), P('model', None) came back P())."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(AxisType.Auto,) * 3)
  tx = readme_tx()
  k = jax.random.split(jax.random.key(5), 3)
  params = {
      "a": jax.device_put(jax.random.normal(k[0], (4, 4)),
                          jax.NamedSharding(mesh, jax.P("fsdp", "model"))),
      "b": jax.device_put(jax.random.normal(k[1], (4, 4)),
                          jax.NamedSharding(mesh, jax.P("model", None)))}
  state = parallel.init_worker_states(tx, params, mesh)
  placed = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]
  before = placed((params, state))

  def step(p, s, batch):
    grads = jax.grad(lambda p: jnp.mean((batch @ p["a"] @ p["b"]) ** 2))(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s
  mapped = parallel.per_worker(step, mesh, ins=("replicated", "stacked",
                                                "split"),
                               outs=("replicated", "stacked"))
  batch = jax.device_put(jax.random.normal(k[2], (8, 4)),
                         jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
  new_params, new_state = mapped(params, state, batch)
  assert placed((new_params, new_state)) == before
  # Under a jit of the caller's, nothing says how the arguments lie: the
  # params' placement is asked for, and then kept (was: the compiler's
  # choice, P('fsdp', 'model') came back P('fsdp',), silently).
  with pytest.raises(ValueError) as e:
    jax.jit(mapped)(params, state, batch)
  assert_names(e, "Auto axes ('fsdp', 'model')", "placement=jax.tree.map",
               "call the function on the arrays")
  told = parallel.per_worker(
      step, mesh, ins=("replicated", "stacked", "split"),
      outs=("replicated", "stacked"),
      placement=jax.tree.map(lambda x: x.sharding.spec, params))
  jitted = jax.jit(told)(params, state, batch)
  for x, spec in zip(jax.tree.leaves(jitted[0]), before[:2]):
    assert x.sharding.is_equivalent_to(jax.NamedSharding(mesh, spec), 2)
  chex.assert_trees_all_equal(jitted, told(params, state, batch))
  chex.assert_trees_all_close(jitted, (new_params, new_state), rtol=1e-5,
                              atol=1e-6)


def test_per_worker_gives_each_worker_its_own_key_stream():
  """A typed key laid out "replicated": each worker draws from its own
  stream (the worker's index folded in), the same in every run, and the
  key goes back as given. fold_in_worker=False: one stream for all."""
  mesh = devices.data_mesh(N)
  key = devices.replicate(jax.random.key(0), mesh)

  def draw(key, x):
    return key, jax.random.bernoulli(key, 0.5, x.shape)
  x = jnp.zeros((N, 32))
  for fold in (True, False):
    mapped = parallel.per_worker(draw, mesh, ins=("replicated", "split"),
                                 outs=("replicated", "split"),
                                 fold_in_worker=fold)
    back, masks = mapped(key, x)
    rows = {tuple(r) for r in np.asarray(masks)}
    assert len(rows) == (N if fold else 1)
    assert np.array_equal(jax.random.key_data(back), jax.random.key_data(
        jax.random.key(0)))
    _, again = jax.jit(mapped)(key, x)
    np.testing.assert_array_equal(again, masks)

  def derive(key, x):   # a new key from the folded one differs by worker
    return jax.random.split(key)[0], x
  with pytest.raises(ValueError) as e:
    parallel.per_worker(derive, mesh, ins=("replicated", "split"),
                        outs=("replicated", "split"))(key, x)
  assert_names(e, "output 0", "differs from worker to worker")


def test_per_worker_in_a_jit_of_yours_refuses_only_where_a_vote_guesses():
  """On an Auto (nodes x devices) mesh, a per_worker function that votes
  on nothing (an eval step) runs in a caller's jax.jit without placement,
  equal to the eager call (was: refused, blaming the vote); one that
  votes is refused, naming placement=."""
  mesh = devices.hybrid_mesh(2)
  def eval_fn(w, batch):
    return jax.lax.pmean(jnp.mean((batch @ w) ** 2), "data")
  ev = parallel.per_worker(eval_fn, mesh, ins=("replicated", "split"),
                           outs="replicated")
  w = devices.replicate(jnp.ones((4, 2)), mesh)
  x = devices.shard_batch(jnp.arange(64.0).reshape(16, 4) / 64, mesh)
  np.testing.assert_array_equal(jax.jit(ev)(w, x), ev(w, x))
  tx = dl.distributed_lion(1e-2, axis_name="data")
  def step(p, s, batch):
    grads = jax.grad(lambda p: jnp.mean((batch @ p) ** 2))(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s
  voted = parallel.per_worker(step, mesh, ins=("replicated", "stacked",
                                               "split"),
                              outs=("replicated", "stacked"))
  with pytest.raises(ValueError) as e:
    jax.jit(voted)(w, parallel.init_worker_states(tx, w, mesh), x)
  assert_names(e, "placement=jax.tree.map")


def test_per_worker_placement_keeps_a_train_states_params_and_momenta():
  """The Linen guide's TrainState laid out ("replicated" params and step,
  "stacked" opt_state) in a caller's jax.jit with placement=: the params
  and each worker's momentum rows come back placed as they went in (was:
  constrained only where an output had the placement's own structure, a
  replicated bias came back P('model',), a momentum P('data', 'model'))."""
  train_state = pytest.importorskip("flax.training.train_state")
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(AxisType.Auto,) * 3)
  params = {"w": jax.device_put(jnp.ones((16, 8)) * 0.1,
                                jax.NamedSharding(mesh, jax.P("fsdp",
                                                              "model"))),
            "b": jax.device_put(jnp.zeros(8), jax.NamedSharding(mesh,
                                                                jax.P()))}
  tx = dl.distributed_lion(1e-3, axis_name="data")
  ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  ts = ts.replace(step=jax.device_put(jnp.int32(0),
                                      jax.NamedSharding(mesh, jax.P())),
                  opt_state=devices.stack_for_workers(ts.opt_state, mesh))
  layout = ts.replace(step="replicated", params="replicated",
                      opt_state="stacked")
  def loss_fn(p, x):
    return jnp.mean((x @ p["w"] + p["b"]) ** 2)
  def train(state, x):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x)
    return state.apply_gradients(grads=grads), jax.lax.pmean(loss, "data")
  step = parallel.per_worker(
      train, mesh, ins=(layout, "split"), outs=(layout, "replicated"),
      placement=jax.tree.map(lambda x: x.sharding.spec, params))
  out, _ = jax.jit(step)(ts, devices.shard_batch(jnp.ones((8, 16)), mesh))
  same = lambda x, spec: x.sharding.is_equivalent_to(
      jax.NamedSharding(mesh, spec), x.ndim)
  assert same(out.params["w"], jax.P("fsdp", "model"))
  assert same(out.params["b"], jax.P())
  assert same(out.opt_state[0].mu["w"], jax.P("data", "fsdp", "model"))
  assert same(out.opt_state[0].mu["b"], jax.P("data"))


def _steps_on(mesh, tx, params, batches):
  params = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh)
  losses = []
  for batch in batches:
    params, state, loss = step(params, state, devices.shard_batch(batch, mesh))
    losses.append(float(loss))
  return params, state, losses


@pytest.mark.parametrize("n", [1, 2, 3])
def test_explicit_mesh_step_with_a_scalar_param_runs_as_on_auto(n):
  """Was, on one device: the step ran, consumed its donated params, then
  failed ("context mesh ... should match the aval mesh" for the scalar
  ``b``): what waits for the step read that scalar under a mesh of its
  own, and the caller's params were lost. Now each step returns, equal to
  the step on Auto axes bit for bit, and on one worker to optax's Lion."""
  params, batches = make_problem(global_batch=6 * n)
  params["w"] = np.asarray(jax.random.normal(jax.random.key(n), (DIM,)))
  tx = lambda: optax.chain(optax.clip_by_global_norm(1.0),
                           dl.distributed_lion(3e-2, axis_name="data"))
  explicit = _steps_on(explicit_mesh(n), tx(), params, batches[:3])
  auto = _steps_on(devices.data_mesh(n), tx(), params, batches[:3])
  chex.assert_trees_all_equal(explicit, auto)
  assert explicit[0]["b"].shape == ()
  if n == 1:
    lion = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(3e-2))

    @jax.jit
    def plain(p, s, batch):
      loss, g = jax.value_and_grad(loss_fn)(p, batch)
      u, s = lion.update(g, s, p)
      return optax.apply_updates(p, u), s, loss
    p, s = jax.tree.map(jnp.asarray, params), lion.init(params)
    for batch in batches[:3]:
      p, s, _ = plain(p, s, batch)
    chex.assert_trees_all_close(explicit[0], p, rtol=1e-6, atol=1e-7)


def test_a_step_that_fails_keeps_what_it_would_have_donated(monkeypatch):
  """A step refused before it runs leaves its params and state as they
  were; and after it ran, a failure in what waits for it (the marker
  of limit_in_flight) still hands back its results, which the donated
  inputs are gone for."""
  mesh = explicit_mesh(3)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  params0, batches = make_problem(global_batch=9)
  params = devices.replicate(params0, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh)
  eight = jax.device_put(make_problem(global_batch=8)[1][0],
                         jax.NamedSharding(mesh, jax.P()))
  with pytest.raises(ValueError, match="divisible by the 3 workers"):
    step(params, state, eight)
  assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
  want = _steps_on(mesh, tx, params0, batches[:1])

  def broken(x):
    raise RuntimeError("the marker failed")
  monkeypatch.setattr(parallel, "_first_entry", broken)
  got = step(params, state, devices.shard_batch(batches[0], mesh))
  assert all(x.is_deleted() for x in jax.tree.leaves((params, state)))
  chex.assert_trees_all_equal(got[:2], want[:2])
  assert float(got[2]) == want[2][0]
