"""Every guarantee in both doors: each case runs through the shard_map
door (``dl.parallel.make_train_step``) and the plain jitted step
(``dl.workers.value_and_grad`` and ``dl.workers.update`` in a
``jax.jit``), written as users write them, and holds in both, or is
refused in both by the same cause with its fix."""

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
from messages import assert_names

DOORS = ("shard_map", "plain")
LR = 1e-2


def mesh_of(n: int):
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:n])


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def problem(dtype=np.float32, rows=16, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(5, 3)).astype(dtype),
            "b": np.zeros(3, dtype)}
  batch = {"x": rng.normal(size=(rows, 5)).astype(dtype),
           "y": rng.normal(size=(rows, 3)).astype(dtype)}
  return params, batch


def run(door, tx, mesh, params, batch, *, steps=3, loss=loss_fn,
        params_per_worker=False, micro_batches=1, with_state=False):
  """``steps`` steps of ``tx`` through ``door``; the params after them
  (worker 0's row where they are per worker), and with ``with_state`` the
  optimizer state (every worker's rows) beside them."""
  if door == "shard_map":
    p = devices.replicate(params, mesh)
    s = parallel.init_worker_states(tx, p, mesh)
    if params_per_worker:
      p = devices.stack_for_workers(p, mesh)
    step = parallel.make_train_step(
        loss, tx, mesh, donate=False, params_per_worker=params_per_worker,
        micro_batches=micro_batches)
    b = devices.shard_batch(batch, mesh)
    for _ in range(steps):
      p, s, _ = step(p, s, b)
  else:
    with jax.set_mesh(mesh):
      p = jax.device_put(params, NamedSharding(mesh, P()))
      s = parallel.init_worker_states(tx, p, mesh)
      if params_per_worker:
        p = devices.stack_for_workers(p, mesh)

      @jax.jit
      def step(p, s, b):
        losses, grads = dl.workers.value_and_grad(
            loss, params_per_worker=params_per_worker,
            micro_batches=micro_batches)(p, b)
        updates, s = dl.workers.update(
            tx, params_per_worker=params_per_worker)(grads, s, p)
        new = optax.apply_updates(p, updates)
        if params_per_worker:
          new = dl.rounds.restart_at_anchor(new, s)
        return new, s, losses.mean()
      b = jax.device_put(batch, NamedSharding(mesh, P("data")))
      for _ in range(steps):
        p, s, _ = step(p, s, b)
  p = jax.device_get(p)
  p = jax.tree.map(lambda x: x[0], p) if params_per_worker else p
  return (p, jax.device_get(s)) if with_state else p


def assert_same(a, b, what=""):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16],
                         ids=["f32", "bf16"])
def test_one_worker_is_optax_lion_bit_for_bit(door, dtype):
  """A data axis of one device: no vote, exact Lion (was, in the plain
  door: refused, "updates differ from worker to worker")."""
  params, batch = problem(dtype)
  got = run(door, dl.distributed_lion(LR, axis_name="data"), mesh_of(1),
            params, batch)
  lion = optax.lion(LR, weight_decay=1e-3)
  p, s = jax.tree.map(jnp.asarray, params), lion.init(params)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
      *lion.update(jax.grad(loss_fn)(p, batch), s, p)))
  for _ in range(3):
    p, s = step(p, s)
  assert_same(got, p, door)


@pytest.mark.parametrize("door", DOORS)
def test_a_local_steps_outer_step_that_sends_nothing_is_refused(door):
  """Was, in the plain door: ran, every worker on an anchor of its own."""
  tx = dl.local_steps(optax.sgd(0.1), dl.distributed_lion(0.1), every=2)
  with pytest.raises(ValueError) as e:
    run(door, tx, mesh_of(4), *problem(), steps=2, params_per_worker=True)
  assert_names(e, "dl.local_steps: the anchor", "would differ from worker",
               "axis_name='data'", "dl.rounds.nesterov_outer")


@pytest.mark.parametrize("door", DOORS)
def test_local_steps_train_alike_in_both_doors(door):
  tx = dl.local_steps(optax.sgd(0.05), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0), every=2)
  got = run(door, tx, mesh_of(4), *problem(), steps=4,
            params_per_worker=True)
  other = run("plain" if door == "shard_map" else "shard_map", tx,
              mesh_of(4), *problem(), steps=4, params_per_worker=True)
  assert_same(got, other, door)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("freeze", ["masked", "multi_transform"])
def test_local_steps_with_a_frozen_integer_leaf_train_alike(freeze, n):
  """An int32 counter among the params, left out of local steps by
  optax.masked or frozen by optax.multi_transform's set_to_zero: it stays,
  and both doors train the rest alike, params and state (was, in the
  plain door: "zip() argument 2 is longer than argument 1", the anchor's
  check counting the integer leaf's gradient that the update never
  takes)."""
  params, batch = problem(rows=24)
  params["step"] = np.int32(7)
  rounds = dl.local_steps(optax.sgd(0.05), dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0), every=2)
  if freeze == "masked":
    tx = optax.masked(rounds, {"w": True, "b": True, "step": False})
  else:
    tx = optax.multi_transform(
        {"train": rounds, "frozen": optax.set_to_zero()},
        {"w": "train", "b": "train", "step": "frozen"})
  got = {door: run(door, tx, mesh_of(n), params, batch, steps=4,
                   params_per_worker=True, with_state=True)
         for door in DOORS}
  assert_same(got["shard_map"], got["plain"])
  trained, _ = got["plain"]
  assert int(trained["step"]) == 7
  assert not np.array_equal(trained["w"], params["w"])


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("outer,n", [("distributed_lion", 4),
                                     ("nesterov_outer", 3)])
def test_a_leaf_masked_out_of_local_steps_names_the_cause_and_the_fix(
    door, outer, n):
  """A leaf "frozen" with optax.masked in the inner and the outer optimizer:
  refused naming optax.masked, which passes each worker's own
  pseudo-gradient of the leaf through, and set_to_zero (was: "exchanges
  nothing over axis 'data' ... Build it with axis_name='data'", of an outer
  step built so); the fix freezes the leaf and trains the rest alike in
  both doors."""
  params, batch = problem(rows=24)
  make = {"distributed_lion": lambda: dl.distributed_lion(
      0.1, axis_name="data", weight_decay=0.0),
          "nesterov_outer": lambda: dl.rounds.nesterov_outer(0.7)}[outer]
  mask = {"w": True, "b": False}
  tx = dl.local_steps(optax.masked(optax.sgd(0.05), mask),
                      optax.masked(make(), mask), every=2)
  with pytest.raises(ValueError) as e:
    run(door, tx, mesh_of(n), params, batch, steps=2,
        params_per_worker=True)
  assert_names(e, ".anchor['b']", "optax.masked", "['b']",
               "exchanges over axis 'data'", "optax.set_to_zero()",
               "optax.multi_transform(")
  assert "Build it with axis_name" not in str(e.value)
  labels = {"w": "train", "b": "frozen"}
  frozen = lambda tx: optax.multi_transform(
      {"train": tx, "frozen": optax.set_to_zero()}, labels)
  fixed = dl.local_steps(frozen(optax.sgd(0.05)), frozen(make()), every=2)
  got = {d: run(d, fixed, mesh_of(n), params, batch, steps=4,
                params_per_worker=True, with_state=True) for d in DOORS}
  assert_same(got["shard_map"], got["plain"])
  trained, _ = got[door]
  np.testing.assert_array_equal(trained["b"], params["b"])
  assert not np.array_equal(trained["w"], params["w"])


@pytest.mark.parametrize("door", DOORS)
def test_a_leaf_masked_out_of_the_vote_names_set_to_zero(door):
  """The same mistake without local steps: the params leaf optax.masked
  leaves out of the vote is named with what masked does to it and how to
  freeze it (was: only "Build the optimizer that updates them with
  axis_name='data'")."""
  tx = optax.masked(dl.distributed_lion(LR, axis_name="data"),
                    {"w": True, "b": False})
  with pytest.raises(ValueError) as e:
    run(door, tx, mesh_of(4), *problem())
  assert_names(e, "params leaves ['b']", "optax.masked leaves ['b'] out",
               "optax.set_to_zero()")


@pytest.mark.parametrize("n,micro", [(4, 2), (3, 3)])
def test_micro_batches_are_the_same_in_both_doors(n, micro):
  """The plain door takes micro_batches= as make_train_step does: the two
  agree bit for bit, params and momenta (was: momenta a last bit apart, up
  to 1.9e-9, where XLA folded 1/micro_batches into Lion's 1 - b2 in the
  shard_map door and not across the plain door's region edge); a first
  step's momentum is (1 - b2) times the mean gradient, rounded as defined;
  and each worker's gradient is the mean of its micro-batches' (a loss not
  linear in the batch, where it is not the whole rows' gradient)."""
  rows = 4 * micro
  params, batch = problem(rows=n * rows)
  square = lambda p, b: loss_fn(p, b) ** 2

  def mean_grads(loss):
    with jax.set_mesh(mesh_of(n)):
      b = jax.device_put(batch, NamedSharding(mesh_of(n), P("data")))
      return jax.device_get(jax.jit(dl.workers.value_and_grad(
          loss, micro_batches=micro))(params, b)[1])
  tx = dl.distributed_lion(LR, axis_name="data")
  want = jax.tree.map(lambda g: np.float32(1 - 0.99) * g, mean_grads(loss_fn))
  for door in DOORS:
    _, state = run(door, tx, mesh_of(n), params, batch, steps=1,
                   micro_batches=micro, with_state=True)
    assert_same(state[0].mu, want, door)
  got = {door: run(door, tx, mesh_of(n), params, batch, steps=4,
                   micro_batches=micro, with_state=True) for door in DOORS}
  assert_same(got["shard_map"], got["plain"])
  grads = mean_grads(square)
  for i in range(n):
    own = jax.tree.map(lambda x: x[rows * i:rows * (i + 1)], batch)
    parts = [jax.grad(square)(params, jax.tree.map(
        lambda x: x[4 * h:4 * h + 4], own)) for h in range(micro)]
    want = jax.tree.map(lambda *g: sum(g) / micro, *parts)
    whole = jax.grad(square)(params, own)
    for k in params:
      np.testing.assert_allclose(grads[k][i], want[k], rtol=1e-5, atol=1e-6)
      assert not np.allclose(grads[k][i], whole[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("door", DOORS)
def test_optax_apply_if_finite_is_named_with_the_fix(door):
  with pytest.raises(ValueError) as e:
    run(door, optax.apply_if_finite(dl.distributed_lion(
        LR, axis_name="data"), 3), mesh_of(4), *problem())
  assert_names(e, "optax.apply_if_finite", "dl.apply_if_finite(tx, ")


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("tx", [optax.lion(LR), dl.distributed_lion(LR)],
                         ids=["optax.lion", "no axis_name"])
def test_an_optimizer_that_sends_nothing_is_named_with_the_fix(door, tx):
  """Was, in the plain door: one message for four causes, suggesting the
  call already made."""
  with pytest.raises(ValueError) as e:
    run(door, tx, mesh_of(4), *problem())
  assert_names(e, "exchanges nothing over axis 'data'",
               "axis_name='data'", "pmean_gradients")


@pytest.mark.parametrize("door", DOORS)
def test_a_global_optimizer_trains_alike_in_both_doors(door):
  """Adam after pmean_gradients, its moments a row a worker, alike in
  value (was, in the plain door: refused, "its state keeps a value per
  worker")."""
  tx = optax.chain(dl.transforms.pmean_gradients("data"), optax.adam(LR))
  got = run(door, tx, mesh_of(4), *problem())
  other = run("plain" if door == "shard_map" else "shard_map", tx,
              mesh_of(4), *problem())
  assert_same(got, other, door)


@pytest.mark.parametrize("door", DOORS)
def test_a_wrong_axis_name_names_the_meshs_axes(door):
  with pytest.raises((ValueError, NameError)) as e:
    run(door, dl.distributed_lion(LR, axis_name="batch"), mesh_of(4),
        *problem())
  assert_names(e, "axis_name='batch'", "('data',)", "axis_name='data'")


@pytest.mark.parametrize("door", DOORS)
def test_integer_leaves_masked_out_stay_and_the_rest_trains(door):
  """An int32 counter that optax.masked leaves out (the library's own error
  recommends it): unchanged, the float leaves as both doors train them
  (was, in the plain door: jax.grad of an int32 leaf)."""
  params, batch = problem()
  params["step"] = np.int32(7)
  tx = optax.masked(dl.distributed_lion(LR, axis_name="data"),
                    {"w": True, "b": True, "step": False})
  got = run(door, tx, mesh_of(4), params, batch)
  assert int(got["step"]) == 7
  other = run("plain" if door == "shard_map" else "shard_map", tx,
              mesh_of(4), params, batch)
  assert_same(got, other, door)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", ["every leaf exact", "a leaf of size 0",
                                  "an empty tree"])
def test_nothing_voted_runs_in_both_doors(door, case):
  """Every leaf under min_compress_size (was, in the plain door: "Need at
  least one array to concatenate"), a leaf of no entries, nothing to
  optimize."""
  params, batch = problem()
  tx = dl.distributed_lion(LR, axis_name="data")
  loss = loss_fn
  if case == "every leaf exact":
    tx = dl.distributed_lion(LR, axis_name="data", min_compress_size=1000)
  elif case == "a leaf of size 0":
    params["e"] = np.zeros((0,), np.float32)
  else:
    params, loss = {}, lambda p, b: jnp.mean(b["x"])
  got = run(door, tx, mesh_of(4), params, batch, loss=loss)
  other = run("plain" if door == "shard_map" else "shard_map", tx,
              mesh_of(4), params, batch, loss=loss)
  assert_same(got, other, door)


def test_the_doors_mixed_are_named_as_such():
  """dl.workers.stacked(tx) given to make_train_step, dl.workers.update in
  a per_worker step: each refused as the two doors mixed."""
  tx = dl.distributed_lion(LR, axis_name="data")
  with pytest.raises(ValueError) as e:
    run("shard_map", dl.workers.stacked(tx), mesh_of(4), *problem())
  assert_names(e, "the two doors mixed", "with tx itself")
  mesh = mesh_of(4)
  params, batch = problem()
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)

  def step(p, s, b):
    grads = jax.grad(loss_fn)(p, b)
    updates, s = dl.workers.update(tx)(grads, s, p)
    return optax.apply_updates(p, updates), s
  mixed = parallel.per_worker(step, mesh, ins=("replicated", "stacked",
                                               "split"),
                              outs=("replicated", "stacked"))
  with pytest.raises(ValueError) as e:
    mixed(p, s, devices.shard_batch(batch, mesh))
  assert_names(e, "dl.workers.update", "the two doors mixed",
               "tx.update(grads, state, params)")


def test_a_bad_rows_over_names_the_argument_and_the_meshs_axes():
  with pytest.raises(ValueError) as e:
    with jax.set_mesh(mesh_of(4)):
      dl.workers.value_and_grad(loss_fn, rows_over=("fsdp",))(
          jnp.zeros((5, 3)), {"x": jnp.zeros((16, 5))})
  assert_names(e, "rows_over=('fsdp',)", "'fsdp'", "not an axis of the mesh",
               "('data',)")


def test_nnx_dropout_in_the_plain_step_names_the_fix_and_the_fix_trains():
  """The NNX guide's plain step with an nnx.Dropout(rngs=...): refused
  naming the fix (was: flax's TraceContextError from inside the vmap);
  the fix, a key in the batch folded per worker and nnx.reseed, trains
  with each worker's own masks."""
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(5, 3, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.lin(x))

  tx = dl.distributed_lion(LR, axis_name="data")
  mesh = mesh_of(4)
  _, batch = problem()

  def make_step(fixed):
    @nnx.jit
    def step(model, optimizer, b):
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      def loss_of(params, rows):
        if not fixed:
          m = nnx.merge(graphdef, params, rest)
        else:
          m = nnx.merge(graphdef, params, rest, copy=True)
          nnx.reseed(m, dropout=rows["key"])
        return jnp.mean((m(rows["x"]) - rows["y"]) ** 2)
      losses, grads = dl.workers.value_and_grad(loss_of)(params, b)
      optimizer.update(model, grads)
      return losses
    return step

  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, dl.workers.stacked(tx), wrt=nnx.Param)
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError) as e:
      make_step(False)(model, optimizer, b)
    assert_names(e, "nnx.reseed(model, dropout=rows['key'])", "copy=True",
                 "dl.parallel.per_worker")
    b["key"] = jax.random.key(0)
    same_rows = jax.tree.map(lambda x: x, b)
    same_rows["x"] = jax.device_put(np.tile(batch["x"][:4], (4, 1)),
                                    NamedSharding(mesh, P("data")))
    same_rows["y"] = jax.device_put(np.tile(batch["y"][:4], (4, 1)),
                                    NamedSharding(mesh, P("data")))
    losses = np.asarray(make_step(True)(model, optimizer, same_rows))
  # The same rows on every worker: only their own masks tell them apart.
  assert np.all(np.isfinite(losses)) and len(set(losses.tolist())) == 4


def test_a_batch_the_workers_cannot_split_is_named_as_in_the_plain_door():
  """make_train_step says what dl.workers.value_and_grad says (was: a
  shard_map error about in_specs)."""
  params, batch = problem(rows=6)
  mesh, tx = mesh_of(4), dl.distributed_lion(LR, axis_name="data")
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  p = devices.replicate(params, mesh)
  with pytest.raises(ValueError) as e:
    step(p, parallel.init_worker_states(tx, p, mesh), batch)
  assert_names(e, "batch leaf ['x']", "(6, 5)", "divisible by the 4 workers")
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    dl.workers.value_and_grad(loss_fn)(p, batch)
  assert_names(e, "batch leaf ['x']", "(6, 5)", "divisible by the 4 workers")
