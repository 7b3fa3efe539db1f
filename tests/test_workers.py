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

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import parallel
import dlion_jax as dl
from harness import AXIS
from harness import run_on_mesh
from messages import assert_names
from reference import DistributedLionReference

CONFIGS = list(itertools.product(("mavo", "avg"), ("binary", "ternary"),
                                 exchange.COMM_CHOICES))
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


def assert_same(mine, theirs, name):
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(a, b, err_msg=name)


def first_row(tree):
  """Worker 0's copy of what the shard_map step returns per worker."""
  return jax.tree.map(lambda x: x[0], tree)


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
    assert_same(got_s[name], manual[name][1], name)


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
    assert_same(got_p[name], first_row(manual[name][0]), name)
    assert_same(got_s[name], manual[name][1], name)


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
    assert_same(got_p[name], first_row(manual[name][0]), name)


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
  for comm in exchange.COMM_CHOICES:
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
  params = {"w": jnp.ones(4)}
  with jax.set_mesh(mesh_of(4, axes=("batch",))):
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.value_and_grad(lambda p, x: jnp.sum(x @ p)))(
          params["w"], jnp.ones((4, 4)))
  assert_names(e, "axis_name='data'", "{'batch': 4}", "axis_name='batch'")
  with jax.set_mesh(mesh_of(4)):
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.value_and_grad(lambda p, x: jnp.sum(x @ p)))(
          params["w"], jnp.ones((6, 4)))
  assert_names(e, "(6, 4)", "divisible by the 4 workers")
  lone = dl.distributed_lion(LR)             # no axis: each worker alone
  with jax.set_mesh(mesh_of(4)):
    state = parallel.init_worker_states(lone, params, mesh_of(4))
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.update(lone))(
          jax.device_put({"w": jnp.ones((4, 4))}, P(AXIS)), state, params)
  assert_names(e, "exchanges nothing over axis 'data'", "axis_name='data'")
  tx = dl.distributed_lion(LR, axis_name=AXIS)
  with jax.set_mesh(mesh_of(4)):
    state = parallel.init_worker_states(tx, params, mesh_of(4))
    grads = jax.device_put({"w": jnp.ones((4, 4))}, P(AXIS))
    with pytest.raises(ValueError) as e:        # was: a bare vmap error
      jax.jit(dl.workers.update(tx))(grads, tx.init(params), params)
    assert_names(e, "state leaf [0].count", "shape ()", "size 4",
                 "init_worker_states", "dl.workers.stacked(tx)")
    with pytest.raises(ValueError) as e:        # jax.grad of the batch
      jax.jit(dl.workers.update(tx))(params, state, params)
    assert_names(e, "grads leaf ['w']", "shape (4,)",
                 "dl.workers.value_and_grad")
    named = {"w": jax.NamedSharding(mesh_of(4), P())}    # not a spec
    jax.jit(dl.workers.update(tx, placement=named))(grads, state, params)


# Meshes with axes beside the workers', and where each leaf lies on them:
# FSDP (a dimension over one axis or both), tensor parallel, replicated.
LAYOUTS = {
    (2, 4): {"w": P("fsdp", None), "v": P(None, "fsdp")},
    (4, 2): {"w": P(None, "fsdp"), "v": P("fsdp", None)},
    (2, 2, 2): {"w": P("fsdp", "model"), "v": P("model", None),
                "u": P(("fsdp", "model"))},
}
FAST = {"w": ((64, 40), np.float32), "v": ((40, 24), BF16),
        "u": ((96,), np.float32), "b": ((7,), np.float32),
        "c": ((13, 5), BF16), "e": ((0,), np.float32)}


def fast_mesh(shape, kind):
  names = (AXIS, "fsdp", "model")[:len(shape)]
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def placed_steps(txs, shape, kind, steps=3, seed=0):
  """Every optimizer of ``txs`` on a mesh of ``shape``, its params placed
  as LAYOUTS says: the vmapped form's params and states, the shard_map
  step's (dl.parallel.per_worker), and the bytes each sends over each
  axis."""
  n = shape[0]
  mesh = fast_mesh(shape, kind)
  specs = {k: LAYOUTS[shape].get(k, P()) for k in FAST}
  params, grads_seq = problem(FAST, n, steps, seed)
  out = {}
  with jax.set_mesh(mesh):
    p = {k: jax.device_put(x, jax.NamedSharding(mesh, specs[k]))
         for k, x in params.items()}
    for name, tx in txs.items():
      told = specs if kind == AxisType.Auto else None
      plain = jax.jit(lambda g, s, p, tx=tx: dl.workers.update(
          tx, placement=told)(g, s, p))
      manual = jax.jit(parallel.per_worker(
          lambda g, s, p, tx=tx: tx.update(g, s, p), mesh,
          ins=("stacked", "stacked", "replicated"),
          outs=("replicated", "stacked"),
          placement=told))
      results = []
      for fn in (plain, manual):
        q, s = p, parallel.init_worker_states(tx, p, mesh)
        for grads in grads_seq:
          g = {k: jax.device_put(x, jax.NamedSharding(
              mesh, P(AXIS, *specs[k]))) for k, x in grads.items()}
          sent = dl.collective_bytes_by_axis(fn.lower(g, s, q).compile(),
                                             mesh)
          u, s = fn(g, s, q)
          q = optax.apply_updates(q, u)
        results.append((jax.device_get(q), jax.device_get(s), sent))
      out[name] = results
  return out


# A vote by each collective once and a whole leaf's L1 scale in the core
# tier; both aggregations by every comm, on every mesh, under -m slow.
SOME_COMMS = ("mavo alltoall", "avg allgather", "mavo psum", "ternary_l1")


@pytest.mark.parametrize("shape,kind,every", [
    ((2, 4), AxisType.Auto, False),
    pytest.param((2, 4), AxisType.Auto, True, marks=pytest.mark.slow),
    pytest.param((2, 4), AxisType.Explicit, True, marks=pytest.mark.slow),
    *(pytest.param(shape, kind, True, marks=pytest.mark.slow)
      for shape in ((4, 2), (2, 2, 2))
      for kind in (AxisType.Explicit, AxisType.Auto))])
def test_every_comm_on_a_mesh_with_fast_axes(shape, kind, every):
  """Params sharded over the fast axes (FSDP, tensor parallel): each
  device votes on its own block of every leaf, the params and states
  equal the shard_map step's bit for bit, and each device sends over the
  workers' axis what it sends there (over the fast axes, at most
  that)."""
  txs = {f"{aggregation} {comm}": dl.distributed_lion(
      LR, axis_name=AXIS, comm=comm, aggregation=aggregation)
         for aggregation in ("mavo", "avg") for comm in message.COMMS}
  # A whole leaf's L1 scale, summed over the blocks.
  txs["ternary_l1"] = dl.distributed_lion(LR, axis_name=AXIS,
                                          quantizer="ternary_l1")
  if not every:
    txs = {name: txs[name] for name in SOME_COMMS}
  for name, ((p1, s1, sent1), (p2, s2, sent2)) in placed_steps(
      txs, shape, kind).items():
    if name == "ternary_l1" and kind == AxisType.Explicit:
      # The leaf's L1 scale: the blocks' sums added in another order than
      # the region's all-reduce adds them, a rounding apart; a few
      # entries' levels differ (a vote is at most 2 lr): at most 1% of a
      # leaf, or one entry of a small one (1 of 65 at 4 x 2).
      for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.sum(a != b) <= max(1, 0.01 * a.size)
        assert np.all(abs(a - b) <= 2.5 * LR)
    else:
      assert_same(p1, p2, name)
      assert_same(s1, s2, name)
    assert sent1[AXIS] == sent2[AXIS] > 0, (name, sent1, sent2)
    # Over the fast axes (together: the compiler may gather over one where
    # the region gathered over both), at most the shard_map step's.
    fast = lambda sent: sum(v for k, v in sent.items() if k != AXIS)
    assert fast(sent1) <= fast(sent2), (name, sent1, sent2)


# The options whose vote differs on blocks (a whole leaf's L1 scale, the
# syncs' means, the residual, buckets' messages, a traced rate), in the
# core tier; every option under -m slow.
ON_BLOCKS = ("ternary_l1", "pbit_l1", "momentum_sync", "buckets",
             "error_feedback", "inject_hyperparams")


@pytest.mark.parametrize("shape,every", [
    ((2, 2, 2), False), pytest.param((2, 4), True, marks=pytest.mark.slow)])
def test_lion_cub_options_on_a_mesh_with_fast_axes(shape, every):
  """Lion Cub's L1-scaled votes (a whole leaf's scale summed over its
  blocks), momentum syncs, error feedback, buckets, min_compress_size and
  optax's wrappers: the shard_map step's params and states bit for
  bit."""
  txs = {name: dl.distributed_lion(**{"learning_rate": LR, **options},
                                   axis_name=AXIS)
         for name, options in LION_CUB.items()}
  txs["error_feedback"] = dl.distributed_lion(
      LR, axis_name=AXIS, quantizer="pbit_l1", bits=2, aggregation="avg",
      error_feedback=True)
  txs.update({name: make() for name, make in WRAPPED.items()})
  if not every:
    txs = {name: tx for name, tx in txs.items() if name in ON_BLOCKS}
  for name, ((p1, s1, _), (p2, s2, _)) in placed_steps(
      txs, shape, AxisType.Auto).items():
    assert_same(p1, p2, name)
    if name in WRAPPED:
      # The params only: injected b1 and b2 are traced, and each program
      # fuses the momentum's update with them in its own way (ulps apart).
      continue
    if name == "error_feedback":
      # The residual c - D: each program contracts the multiply and the
      # subtraction into one rounding or not (XLA:CPU's fusions), and the
      # residual carries it on: a few ulps of the leaf's largest apart
      # after 3 steps (c - D cancels: not of each entry). The params
      # above are equal.
      s1, s2 = s1[0].error, s2[0].error
      for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        ulp = 2.0 ** -(jnp.finfo(a.dtype).nmant)
        ulp *= 4
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.abs(a - b) <= ulp * np.abs(b).max(initial=0)), name
      continue
    assert_same(s1, s2, name)


def mlp_problem(n):
  def loss_fn(p, batch):
    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:
      # On Explicit axes a model gathers its FSDP params itself.
      p = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p)
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k[0], (64, 128)) / 8,
            "b1": jnp.zeros(128), "w2": jax.random.normal(k[1], (128, 8)) / 11}
  x = jax.random.normal(k[2], (16 * n, 64))
  return loss_fn, params, {"x": x, "y": jnp.sin(x[:, :8])}


def fsdp_steps(mesh, n, placed=False):
  """The MLP's params placed FSDP on ``mesh`` (("data", "fsdp")), their
  state and a batch over both axes; the plain jitted step of dl.workers
  (given the params' placement where ``placed``) and make_train_step's
  shard_axis step, each ``(params, state, batch) -> (params, state,
  loss)``; and the bytes each sends a step by axis."""
  tx = dl.distributed_lion(LR, weight_decay=1e-2, axis_name=AXIS)
  loss_fn, params, batch = mlp_problem(n)

  def step(p, s, batch):
    loss, grads = dl.workers.value_and_grad(loss_fn, placement=specs)(
        p, batch)
    updates, s = dl.workers.update(tx, placement=specs)(grads, s, p)
    return optax.apply_updates(p, updates), s, loss.mean()
  with jax.set_mesh(mesh):
    p = dl.devices.shard_params(params, mesh, "fsdp")
    specs = jax.tree.map(lambda x: x.sharding.spec, p) if placed else None
    s = parallel.init_worker_states(tx, p, mesh)
    b = jax.device_put(batch, jax.NamedSharding(mesh, P((AXIS, "fsdp"))))
    plain = jax.jit(step)
    ref = parallel.make_train_step(loss_fn, tx, mesh, donate=False,
                                   shard_axis="fsdp")
    sent = dl.collective_bytes_by_axis(plain.lower(p, s, b).compile(), mesh)
    theirs = dl.collective_bytes_by_axis(ref.lower(p, s, b).compile(), mesh)
  return (p, s, b), plain, ref, sent, theirs


@pytest.mark.parametrize("kind,placed", [
    (AxisType.Auto, False), (AxisType.Auto, True), (AxisType.Explicit, False)])
def test_a_plain_step_with_fsdp_params_equals_make_train_step(kind, placed):
  """The README's 2 x 4 data x fsdp mesh, params sharded FSDP: the plain
  jitted step of dl.workers (each fsdp device differentiating its own
  rows) equals make_train_step's shard_axis step: params bit for bit,
  momenta to a few roundings (see the test above), the params' placement
  kept, at most 0.3 bits a parameter over the data axis (0.253 here: each
  device votes on a quarter of every leaf) and no more than it over
  fsdp. On Auto axes, given the params' placement, the node's mean
  gradient is reduce-scattered onto each param's shards (35,718 bytes
  over fsdp). On Auto axes without it the update is refused, naming
  placement= (was: the vote guessed each leaf's placement)."""
  mesh = fast_mesh((2, 4), kind)
  if kind == AxisType.Auto and not placed:
    with pytest.raises(ValueError) as e:
      fsdp_steps(mesh, 2, placed)
    assert_names(e, "Auto axes ('fsdp',)", "dl.workers.update(tx, "
                 "placement=jax.tree.map(lambda x: x.sharding.spec, params)")
    return
  (p, s, b), plain, ref, sent, theirs = fsdp_steps(mesh, 2, placed)
  with jax.set_mesh(mesh):
    p1, s1, p2, s2 = p, s, p, s
    for _ in range(3):
      p1, s1, loss1 = plain(p1, s1, b)
      p2, s2, loss2 = ref(p2, s2, b)
  size = sum(x.size for x in jax.tree.leaves(p))
  assert 8 * sent[AXIS] / size <= 0.3, sent
  assert sent[AXIS] <= theirs[AXIS], (sent, theirs)
  # The node's mean gradient is reduce-scattered onto each param's shards
  # as the shard_axis step does (56,070 bytes; all-reduced by XLA:CPU when
  # stated as a sum into that sharding: 84,102); on Auto axes the
  # compiler partitions the MLP's activations instead of its weights
  # (4,230).
  assert sent["fsdp"] <= theirs["fsdp"], (sent, theirs)
  assert loss1 == loss2
  for k in p:
    assert p1[k].sharding.spec[:1] == p[k].sharding.spec[:1], k
    np.testing.assert_array_equal(p1[k], p2[k], err_msg=k)
  for mine, theirs in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-9)


def test_placement_keeps_tensor_parallel_params_on_auto_axes():
  """On Auto axes a traced param's type does not say how it is sharded:
  given placement=, the plain step keeps tensor-parallel params where
  they were and moves no more over the fast axes than make_train_step
  (without it, each leaf is taken to lie as shard_params places it)."""
  mesh = fast_mesh((2, 2, 2), AxisType.Auto)
  tx = dl.distributed_lion(LR, weight_decay=1e-2, axis_name=AXIS)
  loss_fn, params, batch = mlp_problem(2)
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}

  def step(p, s, batch):
    _, grads = dl.workers.value_and_grad(loss_fn)(p, batch)
    updates, s = dl.workers.update(tx, placement=placement)(grads, s, p)
    return optax.apply_updates(p, updates), s
  with jax.set_mesh(mesh):
    p = {k: jax.device_put(x, jax.NamedSharding(mesh, specs[k]))
         for k, x in params.items()}
    placement = jax.tree.map(lambda x: x.sharding.spec, p)
    s = parallel.init_worker_states(tx, p, mesh)
    b = jax.device_put(batch, jax.NamedSharding(
        mesh, P((AXIS, "fsdp", "model"))))
    plain = jax.jit(step)
    sent = dl.collective_bytes_by_axis(plain.lower(p, s, b).compile(), mesh)
    ref = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
    theirs = dl.collective_bytes_by_axis(ref.lower(p, s, b).compile(), mesh)
    q = p
    for _ in range(2):
      q, s = plain(q, s, b)
  for k in specs:
    assert q[k].sharding.is_equivalent_to(p[k].sharding, q[k].ndim), (
        k, q[k].sharding.spec)
  fast = lambda sent: sum(v for k, v in sent.items() if k != AXIS)
  assert sent[AXIS] <= theirs[AXIS] and fast(sent) <= fast(theirs), (
      sent, theirs)


def test_bf16_momenta_of_f32_params_vote_alike_on_explicit_axes():
  """f32 params, bf16 momenta (mu_dtype), 2 workers on an Explicit mesh:
  the plain step's params equal make_train_step's bit for bit over 6
  steps (b1 m was rounded to bf16 in one program and not the other, and a
  vote flipped after a few steps)."""
  mesh = mesh_of(2)
  tx = dl.distributed_lion(LR, mu_dtype=jnp.bfloat16, weight_decay=1e-2,
                           axis_name=AXIS)
  loss_fn, params, _ = mlp_problem(2)
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(64, 64)).astype(np.float32) for _ in range(6)]

  def step(p, s, batch):
    _, grads = dl.workers.value_and_grad(loss_fn)(p, batch)
    updates, s = dl.workers.update(tx)(grads, s, p)
    return optax.apply_updates(p, updates), s, None
  with jax.set_mesh(mesh):
    p = jax.device_put(params, P())
    s = parallel.init_worker_states(tx, p, mesh)
    plain = jax.jit(step)
    ref = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
    p1, s1, p2, s2 = p, s, p, s
    for x in xs:
      b = jax.device_put({"x": x, "y": np.sin(x[:, :8])}, P(AXIS))
      p1, s1, _ = plain(p1, s1, b)
      p2, s2, _ = ref(p2, s2, b)
  for k in params:
    np.testing.assert_array_equal(p1[k], p2[k], err_msg=k)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_each_worker_draws_its_own_dropout_masks(shape, kind):
  """A typed PRNG key in the batch: every worker (and, on 2 x 4, every
  device of a worker's rows) draws its own masks from fold_in(key, worker)
  (then fold_in(.., device)), the same in two runs; with every row alike,
  only the masks tell the workers' gradients apart."""
  def loss_fn(p, b):
    mask = jax.random.bernoulli(b["key"], 0.5, b["x"].shape)
    return jnp.mean(jnp.where(mask, b["x"], 0.0) @ p)
  names = (AXIS, "fsdp")[:len(shape)]
  mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
  n, k = shape[0], (shape + (1,))[1]
  x = np.tile(np.arange(1, 9, dtype=np.float32), (4 * n * k, 1))
  key = jax.random.key(7)
  with jax.set_mesh(mesh):
    b = {"x": jax.device_put(x, P(names)), "key": key}
    f = jax.jit(dl.workers.value_and_grad(loss_fn))
    _, grads = f(jnp.ones(8), b)
    _, again = f(jnp.ones(8), b)
  grads, again = np.asarray(grads), np.asarray(again)
  rows = x.reshape(n, k, -1, 8)
  for i in range(n):
    keys = [jax.random.fold_in(key, i)]
    if k > 1:
      keys = [jax.random.fold_in(keys[0], j) for j in range(k)]
    want = sum(np.float32(1 / k) * jax.grad(loss_fn)(
        jnp.ones(8), {"x": rows[i, j], "key": kk})
               for j, kk in enumerate(keys)) if k > 1 else jax.grad(
                   loss_fn)(jnp.ones(8), {"x": rows[i, 0], "key": keys[0]})
    np.testing.assert_allclose(grads[i], want, rtol=1e-6)
  np.testing.assert_array_equal(grads, again)
  assert len({tuple(np.asarray(g)) for g in grads}) == n


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_the_plain_step_hands_back_what_it_took_on_auto_axes(shape):
  """On Auto axes a step's outputs lie where the compiler puts them: a
  schedule's count comes back on the workers' devices, and params given
  their placement (replicated here) stay replicated, so three steps
  compile once (was: the count came back replicated and the flat step
  compiled again)."""
  mesh = fast_mesh(shape, AxisType.Auto)
  schedule = optax.warmup_cosine_decay_schedule(0.0, LR, 2, 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(schedule, axis_name=AXIS))
  loss_fn, params, batch = mlp_problem(2)

  def step(p, s, batch):
    _, grads = dl.workers.value_and_grad(loss_fn, placement=specs)(p, batch)
    updates, s = dl.workers.update(tx, placement=specs)(grads, s, p)
    return optax.apply_updates(p, updates), s
  step = jax.jit(step)
  with jax.set_mesh(mesh):
    p = jax.device_put(params, P())
    specs = jax.tree.map(lambda x: x.sharding.spec, p)
    s = parallel.init_worker_states(tx, p, mesh)
    b = jax.device_put(batch, P(tuple(mesh.axis_names)))
    for _ in range(3):
      p, s = step(p, s, b)
  assert step._cache_size() == 1
  assert all(x.sharding.spec == P() for x in jax.tree.leaves(p))


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_a_fast_axis_of_one_device(kind):
  """A ("data", "fsdp") mesh of 8 x 1 (one device a node), FSDP-placed
  params: the plain step equals make_train_step(shard_axis="fsdp") bit
  for bit and sends what it sends over data (was, on Explicit axes: a
  ShardingTypeError in the model, the params typed over the size-1 axis
  never gathered)."""
  mesh = fast_mesh((8, 1), kind)
  args, plain, ref, sent, theirs = fsdp_steps(mesh, 8)
  with jax.set_mesh(mesh):
    mine, want = plain(*args)[0], ref(*args)[0]
  assert sent[AXIS] == theirs[AXIS] > 0, (sent, theirs)
  assert_same(mine, want, "params")


def test_params_fresh_from_init_on_an_explicit_mesh():
  """Params straight from init (on one device, not placed on the mesh),
  used beside a per-worker value in the loss: the same gradients as
  params placed on the mesh (was: JAX's "Resource axis: data ... is not
  found in mesh: ()" from batching them)."""
  def loss_fn(p, x):
    return jnp.sum(jnp.where(p > 0, p, 0.0)) * x.mean()
  fresh = jax.random.normal(jax.random.key(0), (64,))
  mesh = mesh_of(8)
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.arange(32.0).reshape(16, 2), P(AXIS))
    grad = jax.jit(dl.workers.value_and_grad(loss_fn))
    _, mine = grad(fresh, x)
    _, placed = grad(jax.device_put(fresh, P()), x)
  assert mine.shape == (8, 64)
  np.testing.assert_array_equal(mine, placed)


def test_local_steps_in_a_plain_step_equal_the_shard_map_step():
  """dl.local_steps with params_per_worker in a plain jitted step: every
  worker's params after each of 7 steps (rounds of 3) are the shard_map
  step's, bit for bit, for every comm; the vote sits in the round's
  conditional, so a step inside a round sends only the count's maximum."""
  from dlion_jax import devices, hlo  # pylint: disable=g-import-not-at-top
  from dlion_jax import _message as message  # pylint: disable=g-import-not-at-top
  n, rng = 3, np.random.default_rng(0)
  params = {"w": (rng.integers(-8, 8, (5, 7)) / 4).astype(np.float32),
            "b": (rng.integers(-8, 8, (13,)) / 4).astype(np.float32)}
  grads = [{k: rng.integers(-4, 5, (n,) + v.shape).astype(np.float32)
            for k, v in params.items()} for _ in range(7)]
  loss = lambda p, b: sum(jnp.sum(p[k] * b[k][0]) for k in p)

  def shard_map_run(tx):
    mesh = devices.data_mesh(n)
    state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                        mesh)
    ps = devices.stack_for_workers(params, mesh)
    step = parallel.make_train_step(loss, tx, mesh, params_per_worker=True)
    out = []
    for g in grads:
      ps, state, _ = step(ps, state, devices.shard_batch(g, mesh))
      out.append(jax.device_get(ps))
    return out

  def plain_run(tx):
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])
    with jax.set_mesh(mesh):
      state = parallel.init_worker_states(tx, params, mesh)
      ps = jax.device_put(jax.tree.map(
          lambda x: jnp.broadcast_to(x, (n,) + x.shape), params), P(AXIS))

      @jax.jit
      def step(ps, state, batch):
        _, g = dl.workers.value_and_grad(loss, params_per_worker=True)(
            ps, batch)
        updates, state = dl.workers.update(tx, params_per_worker=True)(
            g, state, ps)
        return dl.rounds.restart_at_anchor(
            optax.apply_updates(ps, updates), state), state
      out = []
      for g in grads:
        batch = jax.device_put(g, P(AXIS))
        ps, state = step(ps, state, batch)
        out.append(jax.device_get(ps))
      compiled = step.lower(ps, state, batch).compile()
    return out, compiled

  for comm in message.COMMS:
    tx = dl.local_steps(optax.sgd(0.125), dl.distributed_lion(
        0.25, axis_name=AXIS, comm=comm, weight_decay=0.0), every=3)
    got, compiled = plain_run(tx)
    for t, (a, b) in enumerate(zip(got, shard_map_run(tx)), start=1):
      for k in params:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{comm} {t} {k}")
    outside = hlo.collective_bytes(compiled, conditional=False)
    assert outside < 8 and hlo.collective_bytes(compiled) >= outside + 8
  assert not np.array_equal(got[0]["w"][0], got[0]["w"][1])


def test_state_initialised_under_jit_is_placed_like_the_params():
  """MaxText's and levanter's way: the optimizer state built inside a
  jax.jit, here jax.jit(dl.workers.stacked(tx, placement=...).init) on an
  Auto 2 x 4 (data, fsdp) mesh with FSDP params: each momentum row is
  placed like its param, as an init on the arrays themselves places it,
  and the step sends what that one's sends over each axis (was: every
  momentum replicated over fsdp, 4x its memory, and 114 bits a parameter
  over fsdp where 42 do). Without placement= the traced init is refused,
  naming it."""
  mesh = fast_mesh((2, 4), AxisType.Auto)
  tx = dl.distributed_lion(LR, weight_decay=1e-2, axis_name=AXIS)
  loss_fn, params, batch = mlp_problem(2)
  with jax.set_mesh(mesh):
    p = dl.devices.shard_params(params, mesh, "fsdp")
    specs = jax.tree.map(lambda x: x.sharding.spec, p)
    b = jax.device_put(batch, jax.NamedSharding(mesh, P((AXIS, "fsdp"))))
    with pytest.raises(ValueError) as e:
      jax.jit(dl.workers.stacked(tx).init)(p)
    assert_names(e, "Auto axes ('fsdp',)", "stacked(tx, placement=")
    eager_tx = dl.workers.stacked(tx)
    jitted_tx = dl.workers.stacked(tx, placement=specs)
    states = {"eager": (eager_tx, eager_tx.init(p)),
              "jitted": (jitted_tx, jax.jit(jitted_tx.init)(p))}
    sent = {}
    for name, (stx, s) in states.items():
      def step(p, s, b, stx=stx):
        loss, grads = dl.workers.value_and_grad(loss_fn, placement=specs)(
            p, b)
        updates, s = stx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss.mean()
      compiled = jax.jit(step).lower(p, s, b).compile()
      sent[name] = dl.collective_bytes_by_axis(compiled, mesh)
  size = sum(x.size for x in jax.tree.leaves(p))
  for e, j in zip(jax.tree.leaves(states["eager"][1]),
                  jax.tree.leaves(states["jitted"][1])):
    assert j.sharding.is_equivalent_to(e.sharding, j.ndim), (e.sharding,
                                                              j.sharding)
  assert sent["jitted"] == sent["eager"], sent
  print("bits a parameter by axis:",
        {k: 8 * v / size for k, v in sent["jitted"].items()})
  assert 8 * sent["jitted"]["fsdp"] / size < 60


@pytest.mark.parametrize("n", [3, 4])
def test_whole_batch_gradients_given_to_an_nnx_optimizer_name_the_fix(n):
  """The NNX guide's optimizer (nnx.Optimizer over dl.workers.stacked(tx),
  tx the README's chain with clip_by_global_norm) given nnx.value_and_grad
  of the whole batch: refused naming the leaf, its shape and the fix,
  dl.workers.value_and_grad, as dl.workers.update names it for the same
  mistake (was: blamed on "a wrapper around stacked(tx)" such as
  optax.MultiSteps, never used); the fix, the guide's step, trains."""
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(5, 8, rngs=rngs)
      self.down = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  @nnx.jit
  def whole_batch_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def guide_step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    losses, grads = dl.workers.value_and_grad(
        lambda p, rows: loss_fn(nnx.merge(graphdef, p, rest), rows))(
            params, batch)
    optimizer.update(model, grads)
    return losses.mean()

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(3e-2, axis_name=AXIS))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8 * n, 5)).astype(np.float32)
  mesh = mesh_of(n)
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dl.workers.stacked(tx), wrt=nnx.Param)
    batch = jax.device_put({"x": x, "y": np.sin(x[:, :1])}, P(AXIS))
    with pytest.raises(ValueError) as e:
      whole_batch_step(model, optimizer, batch)
    assert_names(e, "['down']['bias']", "(1,)", f"each of the {n} workers'",
                 "dl.workers.value_and_grad", "nnx.value_and_grad")
    assert "a wrapper around stacked(tx) made them" not in str(e.value)
    params = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError) as plain:
      jax.jit(dl.workers.update(tx))(params, optimizer.opt_state, params)
    assert_names(plain, "dl.workers.value_and_grad")
    losses = [float(guide_step(model, optimizer, batch)) for _ in range(20)]
  assert losses[-1] < 0.5 * losses[0]
