"""Local steps through ``dl.workers.stacked(tx, params_per_worker=True)``:
an ``nnx.Optimizer`` and a Linen ``TrainState`` in the user's own jitted
step, bit for bit ``dl.parallel.make_train_step(...,
params_per_worker=True)``'s run (a model whose gradient both doors take
alike: a linear layer), and the mistakes on the way named with the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dlion_jax as dl
from dlion_jax import devices
from dlion_jax import parallel
from messages import assert_names
from test_doors import mesh_of
from test_doors import problem

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
train_state = pytest.importorskip("flax.training.train_state")

EVERY = 2


def local_tx(outer=None):
  """What a user writes: AdamW each worker runs alone, the recommended
  outer step (the voted mean) every ``EVERY`` steps. (Not clipped: the
  clip's norm rounds otherwise across the plain door's region edge, a
  last bit of the params apart, as tests/test_workers.py's whole step
  notes.)"""
  return dl.local_steps(
      optax.adamw(0.05),
      outer or dl.rounds.voted_outer(0.5, axis_name="data"), every=EVERY)


def reference(tx, mesh, params, loss, batch, steps):
  """``steps`` steps of make_train_step(..., params_per_worker=True): every
  worker's params and the state."""
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  p = devices.stack_for_workers(p, mesh)
  step = parallel.make_train_step(loss, tx, mesh, donate=False,
                                  params_per_worker=True)
  b = devices.shard_batch(batch, mesh)
  for _ in range(steps):
    p, s, _ = step(p, s, b)
  return jax.device_get(p), jax.device_get(s)


def assert_same(a, b, what=""):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def square_loss(model, rows):
  return jnp.mean((model(rows["x"]) - rows["y"]) ** 2)


def nnx_step(loss=square_loss):
  """The Flax NNX guide's local-steps step."""
  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(params, rows):                       # one worker's copy
      return loss(nnx.merge(graphdef, params, rest), rows)
    losses, grads = dl.workers.value_and_grad(
        loss_of, params_per_worker=True)(params, batch)
    optimizer.update(model, grads)
    nnx.update(model, dl.workers.restart_at_anchor(
        nnx.state(model, nnx.Param), optimizer.opt_state))
    return losses.mean()
  return step


def nnx_model(mesh, tx):
  """An nnx.Linear holding each worker's copy, its nnx.Optimizer, and one
  worker's params as the model made them."""
  with jax.set_mesh(mesh):
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    made = jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param)))
    nnx.update(model, devices.stack_for_workers(
        nnx.state(model, nnx.Param), mesh))
    optimizer = nnx.Optimizer(
        model, dl.workers.stacked(tx, params_per_worker=True), wrt=nnx.Param)
  return model, optimizer, made


@pytest.mark.parametrize("n", [3, 4])
def test_nnx_optimizer_takes_local_steps_as_make_train_step(n):
  """Five steps (two rounds and one step into the third) through
  nnx.Optimizer in an nnx.jit step: every worker's copy and the whole
  state (AdamW's moments, the anchor, the residuals) as make_train_step's
  run, bit for bit; at a round's end every copy is the anchor, and the
  anchor reads as one model (was: refused, "holds one copy of the params
  for every worker", naming an option stacked did not have)."""
  mesh, tx = mesh_of(n), local_tx()
  _, batch = problem(rows=8 * n)
  model, optimizer, made = nnx_model(mesh, tx)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  step = nnx_step()
  b = jax.device_put(batch, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    for i in range(5):
      step(model, optimizer, b)
      if i == 2 * EVERY - 1:                      # a round's end
        rows = jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param)))
        at_end = jax.device_get(dl.workers.anchor(optimizer.opt_state))
  for row, a in zip(jax.tree.leaves(rows), jax.tree.leaves(at_end)):
    assert (row == a).all()
  params, state = reference(
      tx, mesh, made, lambda p, r: square_loss(nnx.merge(graphdef, p), r),
      batch, steps=5)
  assert_same(nnx.as_pure(nnx.state(model, nnx.Param)), params, "params")
  assert_same(nnx.as_pure(optimizer.opt_state), state, "state")
  anchor = jax.device_get(dl.workers.anchor(optimizer.opt_state))
  assert_same(anchor, jax.tree.map(lambda a: a[0], dl.rounds.anchor(state)))
  assert not np.array_equal(anchor["kernel"], made["kernel"])
  one = nnx.merge(graphdef, anchor, rest)        # the anchor as one model
  assert one.kernel.shape == (5, 3)
  assert float(square_loss(one, batch)) < float(square_loss(
      nnx.merge(graphdef, made, rest), batch))


@pytest.mark.parametrize("n", [3, 4])
def test_linen_train_state_takes_local_steps_as_make_train_step(n):
  """The same through a Linen TrainState and apply_gradients in a
  jax.jit step."""
  mesh, tx = mesh_of(n), local_tx()
  _, batch = problem(rows=8 * n)
  model = linen.Dense(3)
  made = model.init(jax.random.key(0), jnp.zeros((1, 5)))["params"]
  with jax.set_mesh(mesh):
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=devices.stack_for_workers(made, mesh),
        tx=dl.workers.stacked(tx, params_per_worker=True))

  @jax.jit
  def step(state, batch):
    def loss_fn(params, rows):                      # one worker's copy
      return jnp.mean((state.apply_fn({"params": params}, rows["x"])
                       - rows["y"]) ** 2)
    losses, grads = dl.workers.value_and_grad(
        loss_fn, params_per_worker=True)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state.replace(params=dl.workers.restart_at_anchor(
        state.params, state.opt_state)), losses.mean()

  b = jax.device_put(batch, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    for _ in range(5):
      state, _ = step(state, b)
  params, opt_state = reference(
      tx, mesh, made, lambda p, r: jnp.mean(
          (model.apply({"params": p}, r["x"]) - r["y"]) ** 2), batch, steps=5)
  assert_same(state.params, params, "params")
  assert_same(state.opt_state, opt_state, "state")
  assert int(state.step) == 5
  anchor = dl.workers.anchor(state.opt_state)
  assert anchor["kernel"].shape == (5, 3)
  assert_same(anchor, jax.tree.map(lambda a: a[0],
                                   dl.rounds.anchor(opt_state)))


def test_a_worker_lost_to_nan_restarts_exactly_on_the_anchor():
  """Worker 1's rows NaN for one step of the first round: its copy turns
  NaN, it abstains from the round's vote, and the restart puts it on the
  anchor (params + (anchor - params) would stay NaN); the next round
  trains on as make_train_step's run does."""
  n, mesh = 4, mesh_of(4)
  tx = local_tx(dl.distributed_lion(0.1, axis_name="data", weight_decay=0.0,
                                    abstain_nonfinite=True))
  _, batch = problem(rows=8 * n)
  lost = {k: v.copy() for k, v in batch.items()}
  lost["x"][8:16] = np.nan
  model, optimizer, made = nnx_model(mesh, tx)
  graphdef, _, _ = nnx.split(model, nnx.Param, ...)
  step = nnx_step()
  batches = [lost] + [batch] * 3
  with jax.set_mesh(mesh):
    for i, one in enumerate(batches):
      step(model, optimizer, jax.device_put(one, NamedSharding(mesh,
                                                               P("data"))))
      rows = jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param)))
      assert np.isnan(rows["kernel"][1]).all() == (i == 0)
  assert np.isfinite(rows["kernel"]).all()

  # The shard_map door, the same batches.
  p = devices.stack_for_workers(devices.replicate(made, mesh), mesh)
  s = parallel.init_worker_states(tx, devices.replicate(made, mesh), mesh)
  ref_step = parallel.make_train_step(
      lambda p, r: square_loss(nnx.merge(graphdef, p), r), tx, mesh,
      donate=False, params_per_worker=True)
  for one in batches:
    p, s, _ = ref_step(p, s, devices.shard_batch(one, mesh))
  assert_same(rows, jax.device_get(p))


def test_local_steps_without_params_per_worker_name_the_fix():
  """stacked(local_steps) on a model of one copy: refused when the
  optimizer is built, naming params_per_worker=True, the copies and the
  restart (was: refused at the first update, naming
  dl.workers.stacked's missing option)."""
  with jax.set_mesh(mesh_of(4)), pytest.raises(ValueError) as e:
    nnx.Optimizer(nnx.Linear(5, 3, rngs=nnx.Rngs(0)),
                  dl.workers.stacked(local_tx()), wrt=nnx.Param)
  assert_names(e, "dl.workers.stacked(tx, params_per_worker=True)",
               "dl.devices.stack_for_workers", "nnx.update(model",
               "dl.workers.restart_at_anchor")


def test_params_per_worker_on_one_copy_names_stack_for_workers():
  with jax.set_mesh(mesh_of(4)), pytest.raises(ValueError) as e:
    nnx.Optimizer(nnx.Linear(5, 3, rngs=nnx.Rngs(0)),
                  dl.workers.stacked(local_tx(), params_per_worker=True),
                  wrt=nnx.Param)
  assert_names(e, "params leaf", "(3,)", "each of the 4 workers' own copy",
               "dl.devices.stack_for_workers(nnx.state(model, nnx.Param)")


def test_gradients_of_the_stacked_copies_whole_name_params_per_worker():
  """The vote step's value_and_grad on a model holding each worker's
  copy: the gradients have the workers' axis twice, refused naming
  params_per_worker=True."""
  mesh = mesh_of(4)
  model, optimizer, _ = nnx_model(mesh, local_tx())

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(params, rows):
      return square_loss(nnx.merge(graphdef, params, rest), rows)
    grads = dl.workers.value_and_grad(loss_of)(params, batch)[1]
    optimizer.update(model, grads)

  _, batch = problem(rows=32)
  with jax.set_mesh(mesh), pytest.raises(Exception) as e:
    step(model, optimizer, jax.device_put(batch, NamedSharding(mesh,
                                                               P("data"))))
  assert_names(e, "params_per_worker=True")
