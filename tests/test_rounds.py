"""dl.local_steps (dlion_jax.rounds) against numpy, in the step users build.

Each worker runs SGD alone for a round, then Distributed Lion or Nesterov
over the workers' pseudo-gradients. The numpy reference is written from the
algorithm (Douillard et al. 2023 for the rounds; tests/reference.py for
Distributed Lion). Gradients and learning rates are dyadic, so the inner
steps and the pseudo-gradients are exact and the outer step is compared
bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import hlo
from dlion_jax import parallel
from dlion_jax import rounds
import dlion_jax as dl
from messages import assert_names
from reference import DistributedLionReference

SHAPES = {"w": (5, 7), "b": (13,)}      # not multiples of 8 N
INNER_LR, OUTER_LR, EVERY = 0.125, 0.25, 3


def linear_loss(params, batch):
  """Gradient = the worker's one batch row."""
  return sum(jnp.sum(params[k] * batch[k][0]) for k in params)


def problem(num_workers, steps, dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  params = {k: rng.integers(-8, 8, s).astype(dtype) / 4
            for k, s in SHAPES.items()}
  grads = [{k: rng.integers(-4, 5, (num_workers,) + s).astype(dtype)
            for k, s in SHAPES.items()} for _ in range(steps)]
  return params, grads


def run_step(tx, params, grads, num_workers):
  """Every worker's params after each step of make_train_step's
  per-worker step, and the last state."""
  mesh = devices.data_mesh(num_workers)
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  ps = devices.stack_for_workers(params, mesh)
  step = parallel.make_train_step(linear_loss, tx, mesh,
                                  params_per_worker=True)
  history = []
  for g in grads:
    ps, state, _ = step(ps, state, devices.shard_batch(g, mesh))
    history.append(jax.device_get(ps))
  return history, state


def numpy_rounds(params, grads, num_workers, outer, *, late=False):
  """Each worker's params after each step: SGD within a round, ``outer``
  (a function of the anchor and the workers' pseudo-gradients returning
  the new anchor) at its end, on this round's pseudo-gradients or
  (``late``) on the last round's."""
  anchor = {k: v.copy() for k, v in params.items()}
  local = [{k: v.copy() for k, v in params.items()}
           for _ in range(num_workers)]
  pending, history = None, []
  for t, g in enumerate(grads, start=1):
    for i, p in enumerate(local):
      for k in p:
        p[k] = (p[k] - p[k].dtype.type(INNER_LR) * g[k][i]).astype(p[k].dtype)
    if t % EVERY == 0:
      deltas = [{k: anchor[k] - p[k] for k in p} for p in local]
      if not late:
        anchor = outer(anchor, deltas)
      elif pending is not None:
        anchor = outer(anchor, pending)
      pending = deltas
      local = [{k: v.copy() for k, v in anchor.items()}
               for _ in range(num_workers)]
    history.append({k: np.stack([p[k] for p in local]) for k in params})
  return history


def dlion_outer(num_workers, aggregation):
  ref = None

  def outer(anchor, deltas):
    nonlocal ref
    if ref is None:
      ref = DistributedLionReference(anchor, num_workers,
                                     learning_rate=OUTER_LR, weight_decay=0.0,
                                     aggregation=aggregation)
    ref.params = {k: v.copy() for k, v in anchor.items()}
    ref.step(deltas)
    return ref.params
  return outer


@pytest.mark.parametrize("num_workers,aggregation", [
    (3, "mavo"), (4, "avg"), pytest.param(4, "mavo", marks=pytest.mark.slow),
    pytest.param(3, "avg", marks=pytest.mark.slow)])
def test_dlion_outer_matches_numpy_for_every_comm(num_workers, aggregation):
  params, grads = problem(num_workers, 2 * EVERY + 1)
  want = numpy_rounds(params, grads, num_workers,
                      dlion_outer(num_workers, aggregation))
  runs = {}
  for comm in message.COMMS:
    tx = dl.local_steps(optax.sgd(INNER_LR), dl.distributed_lion(
        OUTER_LR, axis_name="data", aggregation=aggregation, comm=comm,
        weight_decay=0.0), every=EVERY)
    runs[comm], state = run_step(tx, params, grads, num_workers)
    for t, (got, ref) in enumerate(zip(runs[comm], want), start=1):
      for k in SHAPES:
        np.testing.assert_array_equal(got[k], ref[k],
                                      err_msg=f"{comm} step {t} {k}")
    np.testing.assert_array_equal(             # the anchor of the last round
        rounds.anchor(state)["w"], np.broadcast_to(
            want[2 * EVERY - 1]["w"][0], (num_workers, *SHAPES["w"])))
  # Mid-round the workers differ; at a round's end they are one model.
  assert not np.array_equal(want[0]["w"][0], want[0]["w"][1])
  for t in (EVERY, 2 * EVERY):
    assert (want[t - 1]["w"] == want[t - 1]["w"][0]).all()


def mean_loss(params, batch):
  """Gradient = the mean of the rows a worker (a node) is given."""
  return sum(jnp.sum(params[k] * jnp.mean(batch[k], 0)) for k in params)


@pytest.mark.parametrize("nodes,per_node,aggregation", [
    (2, 4, "mavo"), (3, 2, "avg")])
def test_nodes_of_several_devices_step_alone_on_their_mean_gradient(
    nodes, per_node, aggregation):
  """A hybrid mesh (Auto axes): each node trains its own params on its
  devices' mean gradient (reduced over the fast axis every step, by the
  compiler), and the outer vote crosses the nodes only: numpy's rounds
  of the nodes' mean gradients, bit for bit, at every step."""
  rng = np.random.default_rng(3)
  params, _ = problem(nodes, 0)
  rows = [{k: rng.integers(-4, 5, (nodes * per_node,) + s).astype(
      np.float32) for k, s in SHAPES.items()} for _ in range(2 * EVERY + 1)]
  node_means = [{k: r[k].reshape((nodes, per_node) + SHAPES[k]).mean(1)
                 for k in r} for r in rows]
  want = numpy_rounds(params, node_means, nodes,
                      dlion_outer(nodes, aggregation))
  mesh = devices.hybrid_mesh(nodes, devices=jax.devices()[:nodes * per_node])
  tx = dl.local_steps(optax.sgd(INNER_LR), dl.distributed_lion(
      OUTER_LR, axis_name="data", aggregation=aggregation,
      weight_decay=0.0), every=EVERY)
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  ps = devices.stack_for_workers(params, mesh)
  step = parallel.make_train_step(mean_loss, tx, mesh, params_per_worker=True)
  for t, r in enumerate(rows):
    ps, state, _ = step(ps, state, devices.shard_batch(
        r, mesh, axis_name=("data", "fsdp")))
    for k in SHAPES:
      np.testing.assert_array_equal(ps[k], want[t][k],
                                    err_msg=f"step {t + 1} {k}")
  assert ps["w"].sharding.spec[0] == "data"


def test_per_worker_params_refuse_shard_axis_and_explicit_axes():
  mesh = devices.hybrid_mesh(2)
  tx = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
      0.1, axis_name="data"), every=2)
  with pytest.raises(ValueError) as e:
    parallel.make_train_step(mean_loss, tx, mesh, shard_axis="fsdp",
                             params_per_worker=True)
  assert_names(e, "shard_axis='fsdp'", "Drop shard_axis")
  explicit = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(
      jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError) as e:
    parallel.make_train_step(mean_loss, tx, explicit, params_per_worker=True)
  assert_names(e, "Explicit axes ('fsdp',)", "Auto axes")


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_workers_restart_exactly_on_the_anchor(dtype):
  """With values whose arithmetic rounds, params + (anchor - params) may
  miss the anchor by a bit, a different one on each worker: the step puts
  every worker exactly on it."""
  num_workers, rng = 3, np.random.default_rng(1)
  params = {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}
  grads = [{k: rng.normal(size=(num_workers,) + s).astype(dtype)
            for k, s in SHAPES.items()} for _ in range(EVERY)]
  tx = dl.local_steps(optax.lion(0.1), dl.distributed_lion(
      0.3, axis_name="data"), every=EVERY)
  history, state = run_step(tx, params, grads, num_workers)
  anchor = rounds.anchor(state)
  for k in SHAPES:
    assert history[-1][k].dtype == dtype
    np.testing.assert_array_equal(history[-1][k], anchor[k])
    np.testing.assert_array_equal(anchor[k], np.broadcast_to(
        anchor[k][0], anchor[k].shape))


def test_nesterov_outer_is_diloco():
  """DiLoCo's outer step: Nesterov SGD on the mean pseudo-gradient."""
  num_workers, momentum = 4, 0.5
  params, grads = problem(num_workers, 2 * EVERY)
  velocity = {k: np.zeros_like(v) for k, v in params.items()}

  def outer(anchor, deltas):
    new = {}
    for k in anchor:
      mean = np.mean([d[k] for d in deltas], axis=0)
      velocity[k] = mean + momentum * velocity[k]
      new[k] = anchor[k] - OUTER_LR * (mean + momentum * velocity[k])
    return new
  want = numpy_rounds(params, grads, num_workers, outer)
  tx = dl.local_steps(optax.sgd(INNER_LR), rounds.nesterov_outer(
      OUTER_LR, momentum=momentum), every=EVERY)
  history, _ = run_step(tx, params, grads, num_workers)
  for got, ref in zip(history, want):
    for k in SHAPES:
      np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-6)


def test_the_vote_is_sent_once_a_round():
  """Read off the compiled step: the vote sits in a conditional (sent on a
  round's last step), every other step sends the loss's mean alone."""
  num_workers, size = 8, 1 << 16
  params = {"w": jnp.zeros(size)}
  mesh = devices.data_mesh(num_workers)
  tx = dl.local_steps(optax.lion(1e-3), dl.distributed_lion(
      1e-2, axis_name="data"), every=32)
  step = parallel.make_train_step(linear_loss, tx, mesh,
                                  params_per_worker=True)
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  batch = devices.shard_batch({"w": jnp.ones((num_workers, size))}, mesh)
  compiled = step.lower(devices.stack_for_workers(params, mesh), state,
                        batch).compile()
  every_step = hlo.collective_bytes(compiled, conditional=False)
  round_end = hlo.collective_bytes(compiled)
  vote = (round_end - every_step) * 8 / size
  assert every_step < 16                     # one float's all-reduce
  np.testing.assert_allclose(vote, dl.wire_bits(num_workers), rtol=0.01)
  assert (every_step * 8 / size + vote / 32) < 0.1


def test_mistakes_are_named():
  mesh = devices.data_mesh(4)
  params = {"w": jnp.zeros(3)}
  tx = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
      0.1, axis_name="data"), every=2)
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  batch = devices.shard_batch({"w": jnp.ones((4, 3))}, mesh)
  replicated = parallel.make_train_step(linear_loss, tx, mesh)
  with pytest.raises(ValueError) as e:
    replicated(devices.replicate(params, mesh), state, batch)
  assert_names(e, "dl.local_steps", "params_per_worker=True",
               "dl.devices.stack_for_workers(params, mesh)")
  per_worker = parallel.make_train_step(linear_loss, tx, mesh,
                                        params_per_worker=True)
  with pytest.raises(ValueError) as e:
    per_worker(devices.replicate(params, mesh), state, batch)
  assert_names(e, "params leaf ['w'] has shape (3,)", "params_per_worker=True",
               "dl.devices.stack_for_workers(params, mesh)")
  with pytest.raises(ValueError, match="every=0"):
    dl.local_steps(optax.sgd(0.1), optax.sgd(0.1), every=0)
  with pytest.raises(ValueError) as e:
    tx.update(params, tx.init(params))
  assert_names(e, "local_steps needs the params", "tx.update(grads, state, "
               "params)")


def test_check_vma_gives_the_same_steps():
  params, grads = problem(3, EVERY + 1)
  tx = dl.local_steps(optax.sgd(INNER_LR), dl.distributed_lion(
      OUTER_LR, axis_name="data"), every=EVERY)
  mesh = devices.data_mesh(3)
  runs = []
  for check_vma in (False, True):
    state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                        mesh)
    ps = devices.stack_for_workers(params, mesh)
    step = parallel.make_train_step(linear_loss, tx, mesh, check_vma=check_vma,
                                    params_per_worker=True)
    for g in grads:
      ps, state, _ = step(ps, state, devices.shard_batch(g, mesh))
    runs.append(jax.device_get(ps))
  for k in SHAPES:
    np.testing.assert_array_equal(runs[0][k], runs[1][k])


@pytest.mark.parametrize("outer,named", [
    (optax.sgd(0.7, momentum=0.9, nesterov=True),     # no pmean: DiLoCo
     "dl.rounds.nesterov_outer(lr, axis_name='data')"),   # written wrongly
    (dl.distributed_lion(0.1), "axis_name='data'"),
])
def test_an_outer_step_that_sends_nothing_is_refused(outer, named):
  """Each worker would move its own anchor: refused when the step is
  traced, naming the outer optimizer's fix."""
  tx = dl.local_steps(optax.sgd(0.1), outer, every=2)
  params, grads = problem(3, 1)
  with pytest.raises(ValueError) as e:
    run_step(tx, params, grads, 3)
  assert_names(e, "dl.local_steps: the anchor", named)


def test_optax_apply_if_finite_around_local_steps_names_the_fix():
  tx = optax.apply_if_finite(dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
      0.1, axis_name="data"), every=2), 3)
  params, grads = problem(3, 1)
  with pytest.raises(ValueError) as e:
    run_step(tx, params, grads, 3)
  assert_names(e, "optax.apply_if_finite", "dl.apply_if_finite(tx, "
               "max_consecutive_errors, axis_name='data')")
  guarded = dl.apply_if_finite(dl.local_steps(optax.sgd(0.1),
                                              dl.distributed_lion(
                                                  0.1, axis_name="data"),
                                              every=2), 3)
  run_step(guarded, params, grads, 3)                 # accepted


def test_frozen_params_stay_when_the_outer_step_freezes_them_too():
  """A param the inner optimizer never moves has a zero pseudo-gradient,
  which a binary vote counts as -1 (as Distributed Lion counts c = 0): the
  docstring's recipe freezes it in the outer optimizer as well."""
  num_workers = 3
  params, grads = problem(num_workers, 2 * EVERY)
  labels = {"w": "train", "b": "frozen"}
  freeze = lambda tx: optax.multi_transform(
      {"train": tx, "frozen": optax.set_to_zero()}, labels)
  tx = dl.local_steps(freeze(optax.sgd(INNER_LR)), freeze(
      dl.distributed_lion(OUTER_LR, axis_name="data", weight_decay=0.0)),
                      every=EVERY)
  history, _ = run_step(tx, params, grads, num_workers)
  np.testing.assert_array_equal(history[-1]["b"], np.broadcast_to(
      params["b"], (num_workers, *SHAPES["b"])))
  assert not np.array_equal(history[-1]["w"][0], params["w"])
  unfrozen = dl.local_steps(freeze(optax.sgd(INNER_LR)), dl.distributed_lion(
      OUTER_LR, axis_name="data", weight_decay=0.0), every=EVERY)
  moved, _ = run_step(unfrozen, params, grads, num_workers)
  assert not np.array_equal(moved[-1]["b"][0], params["b"])


def test_an_integer_leaf_rides_along_with_nesterov_outer_steps():
  """An int32 counter among the params, masked out of the inner step: the
  outer step's Nesterov trace of it stays int32 (it came back float32,
  and the round's cond refused the two branches' types)."""
  mesh = devices.data_mesh(2)
  def train(with_counter):
    params = {"w": jnp.ones(3)}
    mask = {"w": True}
    if with_counter:
      params["n"], mask["n"] = jnp.array(7, jnp.int32), False
    tx = dl.local_steps(optax.masked(optax.sgd(0.1), mask),
                        dl.rounds.nesterov_outer(0.7), every=2)
    params = devices.replicate(params, mesh)
    state = parallel.init_worker_states(tx, params, mesh)
    params = devices.stack_for_workers(params, mesh)
    step = parallel.make_train_step(lambda p, b: jnp.mean(b @ p["w"]), tx,
                                    mesh, params_per_worker=True)
    for i in range(4):
      batch = devices.shard_batch(jnp.full((4, 3), i + 1.0), mesh)
      params, state, _ = step(params, state, batch)
    return params
  counted, plain = train(True), train(False)
  np.testing.assert_array_equal(counted["n"], [7, 7])
  np.testing.assert_array_equal(counted["w"], plain["w"])
  assert not np.array_equal(plain["w"], np.ones((2, 3)))


def test_local_steps_under_multi_transform_restart_their_own_leaves():
  num_workers = 3
  params, grads = problem(num_workers, EVERY)
  local = dl.local_steps(optax.lion(0.1), dl.distributed_lion(
      0.3, axis_name="data"), every=EVERY)
  tx = optax.multi_transform({"local": local, "global": optax.chain(
      dl.transforms.pmean_gradients("data"), optax.sgd(0.1))},
                             {"w": "local", "b": "global"})
  history, _ = run_step(tx, params, grads, num_workers)
  for k in SHAPES:          # one model at the round's end, on both leaves
    np.testing.assert_array_equal(history[-1][k], np.broadcast_to(
        history[-1][k][0], history[-1][k].shape))


def test_local_steps_inside_local_steps_is_refused():
  inner = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
      0.1, axis_name="data"), every=2)
  tx = dl.local_steps(inner, dl.distributed_lion(0.1, axis_name="data"),
                      every=4)
  with pytest.raises(ValueError, match="nest none"):
    tx.init({"w": jnp.zeros(3)})


def test_steps_holding_one_copy_of_the_params_name_params_per_worker():
  mesh = devices.data_mesh(2)
  params = {"w": jnp.zeros(3)}
  tx = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(
      0.1, axis_name="data"), every=2)
  pmap_step = parallel.make_pmap_train_step(linear_loss, tx,
                                            devices=jax.devices()[:2])
  with pytest.raises(ValueError) as e:
    pmap_step(devices.replicate_for_pmap(params, 2),
              parallel.init_pmap_states(tx, params, 2),
              {"w": jnp.ones((2, 1, 3))})
  assert_names(e, "make_pmap_train_step's step", "params_per_worker=True")
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    dl.workers.update(tx)({"w": jnp.ones((2, 3))}, state, params)
  assert_names(e, "dl.workers.update's step", "dl.workers.update with "
               "params_per_worker=True")
  with pytest.raises(ValueError) as e:       # stacked before the state
    parallel.init_worker_states(tx, devices.stack_for_workers(params, mesh),
                                mesh)
  assert_names(e, "build the state first, then "
               "dl.devices.stack_for_workers(params, mesh)")


def test_per_worker_params_step_equals_the_replicated_step_bit_for_bit():
  """Without local steps, each worker's row of the per-worker-params step
  is the replicated step's params, bit for bit (every comm)."""
  num_workers = 3
  params, grads = problem(num_workers, 3)
  mesh = devices.data_mesh(num_workers)
  for comm in message.COMMS:
    tx = dl.distributed_lion(OUTER_LR, axis_name="data", comm=comm)
    history, _ = run_step(tx, params, grads, num_workers)
    step = parallel.make_train_step(linear_loss, tx, mesh)
    p = devices.replicate(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh)
    for g in grads:
      p, state, _ = step(p, state, devices.shard_batch(g, mesh))
    for k in SHAPES:
      np.testing.assert_array_equal(history[-1][k], np.broadcast_to(
          np.asarray(p[k]), history[-1][k].shape), err_msg=comm)
