"""Distributed Lion in a plain ``jax.jit`` step (:mod:`dlion_jax.workers`):
per-worker gradients and states on a leading axis of workers, the update
under ``jax.vmap(..., spmd_axis_name="data")``. Every worker's params equal
the numpy reference and the ``shard_map`` step bit for bit, and each device
sends what it sends there."""

import itertools

import ml_dtypes
import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import parallel
from harness import AXIS
from harness import run_on_mesh
from messages import assert_names
from reference import DistributedLionReference

CONFIGS = list(itertools.product(("mavo", "avg"), ("binary", "ternary"),
                                 dl.exchange.COMM_CHOICES))
LR = 1e-2
BF16 = ml_dtypes.bfloat16
# Empty, scalar and one-element leaves, bf16 beside fp32, sizes no 8 N
# divides.
SPEC = {"a": ((0,), BF16), "b": ((), np.float32), "c": ((1,), BF16),
        "d": ((37, 5), np.float32), "e": ((9,), BF16)}


def mesh_of(n, kind=AxisType.Explicit, axes=(AXIS,)):
  return jax.make_mesh((n,), axes, axis_types=(kind,),
                       devices=jax.devices()[:n])


def batched_step(txs):
  """One jitted step of every optimizer of ``txs`` on per-worker grads."""
  names = sorted(txs)

  def step(params, states, grads):
    out_p, out_s = {}, {}
    for k in names:
      updates, out_s[k] = dl.workers.update(txs[k])(grads, states[k],
                                                    params[k])
      out_p[k] = optax.apply_updates(params[k], updates)
    return out_p, out_s
  return jax.jit(step)


def run_batched(txs, params, grads_seq, n, kind=AxisType.Explicit):
  """Like harness.run_on_mesh, in the vmapped form: the params once (not a
  copy per worker), each state stacked over the workers."""
  mesh = mesh_of(n, kind)
  with jax.set_mesh(mesh):
    p = jax.device_put({k: params for k in txs}, P())
    s = {k: parallel.init_worker_states(tx, p[k], mesh)
         for k, tx in txs.items()}
    step = batched_step(txs)
    for grads in grads_seq:
      p, s = step(p, s, jax.device_put(grads, P(AXIS)))
  return jax.device_get(p), jax.device_get(s)


def problem(spec, n, steps, seed):
  rng = np.random.default_rng(seed)
  params = {k: rng.normal(size=s).astype(d) for k, (s, d) in spec.items()}
  grads = [{k: rng.normal(size=(n,) + s).astype(d)
            for k, (s, d) in spec.items()} for _ in range(steps)]
  return params, grads


@pytest.mark.parametrize("n", [3] + [pytest.param(n, marks=pytest.mark.slow)
                                     for n in (2, 5, 8)])
def test_every_config_equals_numpy_and_the_shard_map_step(n):
  """Every aggregation x vote x comm, 3 steps: the params equal the numpy
  reference bit for bit, and the momenta the shard_map step's."""
  params, grads = problem(SPEC, n, 3, seed=n)
  txs = {f"{a} {v} {c}": dl.distributed_lion(
      LR, axis_name=AXIS, aggregation=a, vote=v, comm=c)
         for a, v, c in CONFIGS}
  got_p, got_s = run_batched(txs, params, grads, n)
  manual = run_on_mesh(txs, params, grads, n, check_vma=False)
  for a, v, c in CONFIGS:
    name = f"{a} {v} {c}"
    ref = DistributedLionReference(params, n, learning_rate=LR,
                                   aggregation=a, vote=v)
    for g in grads:
      ref.step([{k: x[i] for k, x in g.items()} for i in range(n)])
    for k in SPEC:
      np.testing.assert_array_equal(got_p[name][k], ref.params[k],
                                    err_msg=f"{name} N={n} {k}")
    for mine, theirs in zip(jax.tree.leaves(got_s[name]),
                            jax.tree.leaves(manual[name][1])):
      np.testing.assert_array_equal(mine, theirs, err_msg=name)


LION_CUB = {
    "ternary_l1": dict(quantizer="ternary_l1"),
    "pbit_l1": dict(quantizer="pbit_l1", bits=4, aggregation="avg"),
    "momentum_sync": dict(momentum_sync=2),
    "growing_sync": dict(momentum_sync=dl.sync.growing_intervals(1)),
    "min_compress_size": dict(min_compress_size=40),
    "buckets": dict(bucket_bytes=64),
    "bf16_momenta": dict(mu_dtype=jnp.bfloat16),
    "schedule": dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 3)),
}


@pytest.mark.parametrize("n", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_lion_cub_options_and_schedules_equal_the_shard_map_step(n):
  """Lion Cub's options, buckets, bf16 momenta and a schedule: params and
  states equal the shard_map step's bit for bit, 4 steps."""
  params, grads = problem(SPEC, n, 4, seed=10 + n)
  txs = {name: dl.distributed_lion(**{"learning_rate": LR, **options},
                                   axis_name=AXIS)
         for name, options in LION_CUB.items()}
  got_p, got_s = run_batched(txs, params, grads, n)
  manual = run_on_mesh(txs, params, grads, n, check_vma=False)
  for name in txs:
    for mine, theirs in zip(jax.tree.leaves(got_p[name]),
                            jax.tree.leaves(manual[name][0])):
      np.testing.assert_array_equal(mine, theirs[0], err_msg=name)
    for mine, theirs in zip(jax.tree.leaves(got_s[name]),
                            jax.tree.leaves(manual[name][1])):
      np.testing.assert_array_equal(mine, theirs, err_msg=name)


WRAPPED = {   # optax pieces reading per-worker counts after the vote
    "apply_if_finite": lambda: dl.apply_if_finite(
        dl.distributed_lion(LR, axis_name=AXIS), 3),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        dl.distributed_lion)(learning_rate=optax.linear_schedule(LR, 1e-3, 3),
                             axis_name=AXIS),
    "optax_schedule": lambda: optax.chain(
        dl.scale_by_distributed_lion(axis_name=AXIS),
        optax.scale_by_learning_rate(optax.linear_schedule(LR, 1e-3, 3))),
    "multi_steps": lambda: optax.MultiSteps(
        dl.distributed_lion(LR, axis_name=AXIS), 2),
}


def test_optax_wrappers_run_once_for_all_workers():
  """dl.apply_if_finite, injected hyperparameters, an optax schedule after
  the vote and MultiSteps: one update for all the workers (their counts
  made one value), equal to the shard_map step bit for bit."""
  n = 5
  params, grads = problem(SPEC, n, 4, seed=3)
  grads[1]["d"][2, 0, 0] = np.nan         # one worker's step skipped
  txs = {name: make() for name, make in WRAPPED.items()}
  got_p, _ = run_batched(txs, params, grads, n)
  manual = run_on_mesh(txs, params, grads, n, check_vma=False)
  for name in txs:
    for mine, theirs in zip(jax.tree.leaves(got_p[name]),
                            jax.tree.leaves(manual[name][0])):
      np.testing.assert_array_equal(mine, theirs[0], err_msg=name)


def sent(step, *args):
  return dl.collective_bytes(step.lower(*args).compile())


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("n", [8, pytest.param(5, marks=pytest.mark.slow)])
def test_each_strategy_sends_what_the_shard_map_step_sends(n, kind):
  """Bytes a device sends a step, read off both compiled steps, for every
  comm (alltoall and allgather were one all-reduce of every worker's whole
  message under vmap: 14 bits a parameter at N = 8)."""
  shapes = {"w": (300, 41), "b": (7,)}
  rng = np.random.default_rng(0)
  params = {k: rng.normal(size=s).astype(np.float32)
            for k, s in shapes.items()}
  mesh = mesh_of(n, kind)
  for comm in dl.exchange.COMM_CHOICES:
    tx = dl.distributed_lion(LR, axis_name=AXIS, comm=comm)
    with jax.set_mesh(mesh):
      p = jax.device_put(params, P())
      s = parallel.init_worker_states(tx, p, mesh)
      g = jax.device_put({k: jnp.zeros((n,) + x.shape) for k, x in
                          params.items()}, P(AXIS))
      batched = sent(jax.jit(dl.workers.update(tx)), g, s, p)
    manual = sent(jax.jit(parallel.per_worker(
        lambda g, s, p: tx.update(g, s, p), mesh,
        ins=("stacked", "stacked", "replicated"),
        outs=("replicated", "stacked"))), g, s, p)
    assert batched == manual, (comm, batched, manual)


def test_a_step_of_gradients_and_update_equals_make_train_step():
  """The whole step a user writes: dl.workers.value_and_grad over the
  batch's rows, dl.workers.update, optax.apply_updates, with the README's
  chain minus the clip: make_train_step's params bit for bit, and its
  momenta to a few roundings (each program fuses the gradient into the
  momentum's update in its own way, and XLA:CPU contracts a multiply and
  an add into one rounding where they share a fusion: 3 ulp after 3
  steps here)."""
  n = 8
  mesh = mesh_of(n)
  tx = dl.distributed_lion(LR, weight_decay=1e-2, axis_name=AXIS,
                           mask=lambda p: jax.tree.map(
                               lambda x: x.ndim > 1, p))

  def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k[0], (16, 32)) / 4,
            "b1": jnp.zeros(32), "w2": jax.random.normal(k[1], (32, 1)) / 6}
  x = jax.random.normal(k[2], (8 * n, 16))
  batch = {"x": x, "y": jnp.sin(x[:, :1])}

  def step(p, s, batch):
    loss, grads = dl.workers.value_and_grad(loss_fn)(p, batch)
    updates, s = dl.workers.update(tx)(grads, s, p)
    return optax.apply_updates(p, updates), s, loss.mean()
  with jax.set_mesh(mesh):
    p = jax.device_put(params, P())
    s = parallel.init_worker_states(tx, p, mesh)
    b = jax.device_put(batch, P(AXIS))
    plain = jax.jit(step)
    ref = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
    p1, s1, p2, s2 = p, s, p, s
    for _ in range(3):
      p1, s1, _ = plain(p1, s1, b)
      p2, s2, _ = ref(p2, s2, b)
  for mine, theirs in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(mine, theirs)
  for mine, theirs in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-9)


def test_value_and_grad_gives_each_worker_its_rows_gradient():
  mesh = mesh_of(4)
  loss_fn = lambda p, x: jnp.mean(x @ p)
  x = jnp.arange(24.0).reshape(8, 3)
  with jax.set_mesh(mesh):
    loss, grads = jax.jit(dl.workers.value_and_grad(loss_fn))(
        jnp.ones(3), jax.device_put(x, P(AXIS)))
  np.testing.assert_array_equal(grads, np.asarray(x).reshape(4, 2, 3).mean(1))
  np.testing.assert_array_equal(loss, np.asarray(x).reshape(4, 2, 3).sum(
      2).mean(1))


def test_mistakes_are_named():
  tx = dl.distributed_lion(LR, axis_name=AXIS)
  params = {"w": jnp.ones(4)}
  with jax.set_mesh(mesh_of(4, axes=("batch",))):
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.value_and_grad(lambda p, x: jnp.sum(x @ p)))(
          params["w"], jnp.ones((4, 4)))
  assert_names(e, "axis_name='data'", "{'batch': 4}", "jax.set_mesh(mesh)")
  with jax.set_mesh(mesh_of(4)):
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.value_and_grad(lambda p, x: jnp.sum(x @ p)))(
          params["w"], jnp.ones((6, 4)))
  assert_names(e, "(6, 4)", "divisible by the 4 workers")
  two = jax.make_mesh((2, 4), (AXIS, "fsdp"),
                      axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(two):
    p = jax.device_put(params, P())
    s = parallel.init_worker_states(tx, p, two)
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.update(tx))(jax.device_put(
          {"w": jnp.ones((2, 4))}, P(AXIS)), s, p)
  assert_names(e, "['fsdp']", "make_train_step")
