"""optax's extra arguments (:class:`optax.GradientTransformationExtraArgs`:
``value=`` of :func:`optax.contrib.reduce_on_plateau`) through every door,
one value for all or each worker's own as ``per_worker_args`` says; and
``dl.parallel.typed_alike`` over optax's own transforms in the README's
``shard_map`` step, against the plain door."""

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
from test_doors import loss_fn
from test_doors import mesh_of
from test_doors import problem

LR = 1e-2
STEPS = 4


def plateau():
  """Halves the scale after every step whose value is no better than the
  best so far (patience 1, each step's value its own average)."""
  return optax.contrib.reduce_on_plateau(factor=0.5, patience=1,
                                         accumulation_size=1)


def voted(extra=()):
  """Distributed Lion, then ``extra``. (Not clipped: the clip's norm
  rounds otherwise across the plain door's region edge, the params a last
  bit apart between the doors, as tests/test_workers.py's whole step
  notes.)"""
  return optax.chain(dl.distributed_lion(LR, axis_name="data"), *extra)


def values(n=None):
  """A value a step, no better after the second: the plateau halves the
  scale twice; with ``n``, each worker's own, the odd workers' improving
  (their scale stays 1)."""
  one = [3.0, 2.0, 2.5, 2.5]
  if n is None:
    return [jnp.float32(v) for v in one]
  return [jnp.array([v if i % 2 == 0 else -v * (t + 1) for i in range(n)],
                    jnp.float32) for t, v in enumerate(one)]


def plain_run(tx, mesh, params, batch, extras, *, per_worker_args=(),
              local=False):
  """The plain door: dl.workers.update in a jax.jit, the extra arguments
  of each step given; params (every worker's where ``local``), state."""
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = parallel.init_worker_states(tx, p, mesh)
    if local:
      p = devices.stack_for_workers(p, mesh)

    @jax.jit
    def step(p, s, b, extra):
      _, grads = dl.workers.value_and_grad(
          loss_fn, params_per_worker=local)(p, b)
      updates, s = dl.workers.update(
          tx, params_per_worker=local, per_worker_args=per_worker_args)(
              grads, s, p, **extra)
      new = optax.apply_updates(p, updates)
      return dl.rounds.restart_at_anchor(new, s) if local else new, s
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    for extra in extras:
      p, s = step(p, s, b, extra)
  return jax.device_get(p), jax.device_get(s)


def shard_map_run(tx, mesh, params, batch, extras, *, per_worker_args=(),
                  local=False, **options):
  """make_train_step, the same extra arguments given to each call."""
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  if local:
    p = devices.stack_for_workers(p, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False,
                                  params_per_worker=local,
                                  per_worker_args=per_worker_args, **options)
  b = devices.shard_batch(batch, mesh)
  for extra in extras:
    p, s, _ = step(p, s, b, **extra)
  return jax.device_get(p), jax.device_get(s)


def assert_same(a, b, what=""):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def scale_of(state):
  is_plateau = lambda x: isinstance(x, optax.contrib.ReduceLROnPlateauState)
  return next(x for x in jax.tree.leaves(state, is_leaf=is_plateau)
              if is_plateau(x)).scale


@pytest.mark.parametrize("n", [3, 4])
def test_one_value_for_all_in_both_doors(n):
  """reduce_on_plateau after the vote, value= one value for all: the scale
  halves as the values say, and both doors agree, params and state (was,
  in the plain door: TypeError, unexpected keyword argument 'value';
  make_train_step could not pass it)."""
  params, batch = problem(rows=8 * n)
  tx, extras = voted([plateau()]), [{"value": v} for v in values()]
  got = {"plain": plain_run(tx, mesh_of(n), params, batch, extras),
         "shard_map": shard_map_run(tx, mesh_of(n), params, batch, extras)}
  assert_same(got["plain"], got["shard_map"])
  np.testing.assert_array_equal(scale_of(got["plain"][1]), [0.25] * n)
  unscaled = plain_run(voted(), mesh_of(n), params, batch, [{}] * STEPS)[0]
  assert not np.array_equal(unscaled["w"], got["plain"][0]["w"])


@pytest.mark.parametrize("n", [3, 4])
def test_each_workers_own_value_in_local_steps(n):
  """The plateau in local steps' inner optimizer, each worker's own value
  (per_worker_args=('value',)): each worker's scale as its own values say,
  in both doors alike."""
  params, batch = problem(rows=8 * n)
  tx = dl.local_steps(optax.chain(optax.sgd(0.05), plateau()),
                      dl.rounds.voted_outer(0.5, axis_name="data"), every=2)
  extras = [{"value": v} for v in values(n)]
  got = {door: run(tx, mesh_of(n), params, batch, extras, local=True,
                   per_worker_args=("value",))
         for door, run in (("plain", plain_run),
                           ("shard_map", shard_map_run))}
  assert_same(got["plain"], got["shard_map"])
  scale = scale_of(got["plain"][1])
  np.testing.assert_array_equal(scale, [0.25 if i % 2 == 0 else 1.0
                                        for i in range(n)])


def test_the_steps_loss_as_the_value():
  """make_train_step(loss_as='value'): the mean loss of the step (as the
  README's shard_map step passes its pmean), or each worker's own with
  per_worker_args, which in local steps' inner optimizer is each worker's
  loss as the plain door's value_and_grad gives it."""
  mesh = mesh_of(4)
  params, batch = problem(rows=32)
  tx = voted([plateau()])
  got = shard_map_run(tx, mesh, params, batch, [{}] * STEPS,
                      loss_as="value")

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P("data"), P("data")),
                 out_specs=(P(), P("data")))
  def readme_step(params, state, batch):
    state = parallel.typed_alike(jax.tree.map(lambda s: s[0], state))
    local = jax.lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    updates, state = tx.update(grads, state, params,
                               value=jax.lax.pmean(loss, "data"))
    return (optax.apply_updates(params, updates),
            jax.tree.map(lambda s: s[None], state))
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  for _ in range(STEPS):
    p, s = readme_step(p, s, devices.shard_batch(batch, mesh))
  assert_same(got, jax.device_get((p, s)))

  local = dl.local_steps(optax.chain(optax.sgd(0.05), plateau()),
                         dl.rounds.voted_outer(0.5, axis_name="data"),
                         every=2)
  own = shard_map_run(local, mesh, params, batch, [{}] * STEPS, local=True,
                      per_worker_args=("value",), loss_as="value")
  plain = plain_losses_run(local, mesh, params, batch)
  assert_same(own, plain)


def plain_losses_run(tx, mesh, params, batch):
  """Local steps in the plain door, each step's losses (one a worker)
  passed as value=."""
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = parallel.init_worker_states(tx, p, mesh)
    p = devices.stack_for_workers(p, mesh)

    @jax.jit
    def step(p, s, b):
      losses, grads = dl.workers.value_and_grad(
          loss_fn, params_per_worker=True)(p, b)
      updates, s = dl.workers.update(
          tx, params_per_worker=True, per_worker_args=("value",))(
              grads, s, p, value=losses)
      return dl.rounds.restart_at_anchor(optax.apply_updates(p, updates),
                                         s), s
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    for _ in range(STEPS):
      p, s = step(p, s, b)
  return jax.device_get(p), jax.device_get(s)


@pytest.mark.parametrize("n", [3, 4])
def test_nnx_optimizer_passes_value_on(n):
  """nnx.Optimizer.update(model, grads, value=...) with
  dl.workers.stacked(tx): as the plain door's run (was: TypeError,
  unexpected keyword argument 'value')."""
  nnx = pytest.importorskip("flax.nnx")
  params, batch = problem(rows=8 * n)
  tx = voted([plateau()])

  class Linear(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.asarray(params["w"]))
      self.b = nnx.Param(jnp.asarray(params["b"]))

    def __call__(self, x):
      return x @ self.w[...] + self.b[...]

  @nnx.jit
  def step(model, optimizer, batch, value):
    graphdef, p, rest = nnx.split(model, nnx.Param, ...)
    def loss_of(p, rows):
      return jnp.mean((nnx.merge(graphdef, p, rest)(rows["x"])
                       - rows["y"]) ** 2)
    _, grads = dl.workers.value_and_grad(loss_of)(p, batch)
    optimizer.update(model, grads, value=value)

  mesh = mesh_of(n)
  with jax.set_mesh(mesh):
    model = Linear()
    optimizer = nnx.Optimizer(model, dl.workers.stacked(tx), wrt=nnx.Param)
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    for v in values():
      step(model, optimizer, b, v)
  want, state = plain_run(tx, mesh, params, batch,
                          [{"value": v} for v in values()])
  assert_same({"b": model.b[...], "w": model.w[...]}, want)
  assert_same(nnx.as_pure(optimizer.opt_state), state)
  np.testing.assert_array_equal(scale_of(state), [0.25] * n)


def test_per_worker_steps_pass_value_as_their_layouts_say():
  """A step written for one worker (dl.parallel.per_worker) calls
  tx.update itself: value laid out "replicated" is one for all, laid out
  "stacked" each worker's own (local steps' inner plateau); each as
  make_train_step's run."""
  n, mesh = 4, mesh_of(4)
  params, batch = problem(rows=32)
  tx = voted([plateau()])

  def train_step(params, state, batch, value):      # one worker
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, value=value)
    return optax.apply_updates(params, updates), state
  step = parallel.per_worker(
      train_step, mesh, ins=("replicated", "stacked", "split", "replicated"),
      outs=("replicated", "stacked"))
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  b = devices.shard_batch(batch, mesh)
  for v in values():
    p, s = step(p, s, b, v)
  extras = [{"value": v} for v in values()]
  assert_same(jax.device_get((p, s)),
              shard_map_run(tx, mesh, params, batch, extras))

  local = dl.local_steps(optax.chain(optax.sgd(0.05), plateau()),
                         dl.rounds.voted_outer(0.5, axis_name="data"),
                         every=2)

  def local_step(params, state, batch, value):       # one worker's copy
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = local.update(grads, state, params, value=value)
    return dl.rounds.restart_at_anchor(
        optax.apply_updates(params, updates), state), state
  step = parallel.per_worker(
      local_step, mesh, ins=("stacked", "stacked", "split", "stacked"),
      outs=("stacked", "stacked"))
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(local, p, mesh)
  p = devices.stack_for_workers(p, mesh)
  for v in values(n):                  # a row a worker, on its worker
    p, s = step(p, s, b, devices.shard_batch(v, mesh))
  extras = [{"value": v} for v in values(n)]
  assert_same(jax.device_get((p, s)), shard_map_run(
      local, mesh, params, batch, extras, local=True,
      per_worker_args=("value",)))


def test_the_pmap_step_passes_value_on():
  """make_pmap_train_step: value= one for all, or the step's mean loss
  (loss_as), as make_train_step's runs."""
  n = 4
  params, batch = problem(rows=32)
  tx = voted([plateau()])
  for options, extras in (({}, [{"value": v} for v in values()]),
                          ({"loss_as": "value"}, [{}] * STEPS)):
    step = parallel.make_pmap_train_step(
        loss_fn, tx, devices=jax.devices()[:n], donate=False, **options)
    p = devices.replicate_for_pmap(params, n)
    s = parallel.init_pmap_states(tx, params, n)
    b = jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch)
    for extra in extras:
      p, s, _ = step(p, s, b, **extra)
    want, state = shard_map_run(tx, mesh_of(n), params, batch, extras,
                                **options)
    assert_same(jax.tree.map(lambda x: x[0], p), want, str(options))
    assert_same(s, state, str(options))


# optax's own transforms whose state holds what every worker holds alike
# (counts, hyperparameters, a plateau's scale): whether it takes value=.
TRANSFORMS = {
    "reduce_on_plateau": (lambda: voted([plateau()]), True),
    "inject_hyperparams": (lambda: optax.chain(
        dl.scale_by_distributed_lion(axis_name="data"),
        optax.inject_hyperparams(optax.scale_by_learning_rate)(
            learning_rate=LR)), False),
    "MultiSteps": (lambda: optax.MultiSteps(voted(), every_k_schedule=2),
                   False),
    "schedule": (lambda: optax.chain(
        dl.scale_by_distributed_lion(axis_name="data"),
        optax.scale_by_learning_rate(optax.linear_schedule(LR, LR / 10, 8))),
                 False),
    "dl.apply_if_finite": (lambda: dl.apply_if_finite(
        voted(), 3, axis_name="data"), False),
}


def readme_run(tx, mesh, params, batch, extras):
  """The README's shard_map step (check_vma=True, dl.parallel.typed_alike),
  each step's extra arguments one value for all."""
  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                 out_specs=(P(), P("data")))
  def step(params, state, batch, extra):
    state = parallel.typed_alike(jax.tree.map(lambda s: s[0], state))
    local = jax.lax.pcast(params, "data", to="varying")
    grads = jax.grad(loss_fn)(local, batch)
    updates, state = tx.update(grads, state, params, **extra)
    return (optax.apply_updates(params, updates),
            jax.tree.map(lambda s: s[None], state))
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  b = devices.shard_batch(batch, mesh)
  for extra in extras:
    p, s = step(p, s, b, extra)
  return jax.device_get((p, s))


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("n", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_typed_alike_takes_optax_transforms(name, n):
  """Each of optax's transforms in the README's shard_map step with
  typed_alike and in the plain door: both run, alike bit for bit, and
  train (was, reduce_on_plateau: "cond branches must have equal output
  types", its counts typed alike and its scale not)."""
  make, takes_value = TRANSFORMS[name]
  params, batch = problem(rows=8 * n)
  extras = ([{"value": v} for v in values()] if takes_value
            else [{}] * STEPS)
  got = readme_run(make(), mesh_of(n), params, batch, extras)
  assert_same(got, plain_run(make(), mesh_of(n), params, batch, extras),
              name)
  assert not np.array_equal(got[0]["w"], params["w"])


def test_a_value_of_each_worker_after_the_vote_is_refused():
  """Each worker's own value for a plateau after the vote: each worker
  would scale the voted update by its own, refused in every door by its
  cause (a value taken per worker and applied after the vote)."""
  n, mesh = 4, mesh_of(4)
  params, batch = problem(rows=32)
  tx, extras = voted([plateau()]), [{"value": v} for v in values(n)]
  for run in (plain_run, shard_map_run):
    with pytest.raises(ValueError) as e:
      run(tx, mesh, params, batch, extras, per_worker_args=("value",))
    assert_names(e, "would still silently differ", "applied after the vote",
                 "per_worker_args")
  step = parallel.make_pmap_train_step(loss_fn, tx, devices=jax.devices()[:n],
                                       per_worker_args=("value",))
  with pytest.raises(ValueError) as e:
    step(devices.replicate_for_pmap(params, n),
         parallel.init_pmap_states(tx, params, n),
         jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch),
         **extras[0])
  assert_names(e, "would still silently differ", "applied after the vote",
               "per_worker_args")


def test_extra_arguments_misused_name_the_fix():
  params, batch = problem(rows=32)
  mesh = mesh_of(4)
  bare = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda u, s, p=None: (u, s))        # an update that takes none
  with pytest.raises(ValueError) as e:
    shard_map_run(bare, mesh, params, batch, [{"value": jnp.float32(1)}])
  assert_names(e, "value=", "takes none", "optax.chain(",
               "optax.contrib.reduce_on_plateau")
  with pytest.raises(ValueError) as e:     # one value, said to be per worker
    plain_run(voted([plateau()]), mesh, params, batch,
              [{"value": jnp.float32(1)}], per_worker_args=("value",))
  assert_names(e, "value", "shape ()", "per_worker_args", "the 4 workers",
               "dl.workers.value_and_grad")
  with pytest.raises(ValueError) as e:
    dl.workers.update(voted(), per_worker_args=[0])
  assert_names(e, "per_worker_args=[0]", "per_worker_args=('value',)")
  with pytest.raises(ValueError) as e:
    parallel.make_train_step(loss_fn, voted(), mesh, loss_as="the loss")
  assert_names(e, "loss_as='the loss'", "loss_as='value'")
  with pytest.raises(ValueError) as e:
    parallel.make_train_step(loss_fn, bare, mesh, loss_as="value")
  assert_names(e, "value=", "takes none")


def test_a_later_call_with_a_value_of_each_worker_is_checked_too():
  """make_train_step checks its first trace; a later call that brings an
  extra argument of each worker's own (after the vote) traces anew and is
  checked too (was: only the first trace was, and the params drifted)."""
  n, mesh = 4, mesh_of(4)
  params, batch = problem(rows=32)

  def scaled():             # the update scaled by value=, where given
    def update(u, state, params=None, *, value=None, **extra_args):
      del params, extra_args
      return (u if value is None else jax.tree.map(lambda x: x * value, u),
              state)
    return optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), update)
  tx = voted([scaled()])
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False,
                                  per_worker_args=("value",))
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  b = devices.shard_batch(batch, mesh)
  p, s, _ = step(p, s, b)
  with pytest.raises(ValueError) as e:
    step(p, s, b, value=jnp.arange(1.0, n + 1))
  assert_names(e, "would still silently differ", "per_worker_args")


@pytest.mark.parametrize("axes", [1, 2])
def test_a_step_compiled_ahead_without_extra_arguments_takes_three(axes):
  """``step.lower(params, state, batch).compile()`` is called with the
  same three arguments, as a ``jax.jit`` step's is (the training CLI's
  way, on nodes of 2 devices too), and gives the step's own result."""
  n = 3
  mesh = (mesh_of(n) if axes == 1 else jax.make_mesh(
      (n, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=jax.devices()[:2 * n]))
  params, batch = problem(rows=4 * n)
  tx = voted()
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = parallel.init_worker_states(tx, p, mesh)
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    compiled = step.lower(p, s, b).compile()
    got = compiled(p, s, b)
    want = step(p, s, b)
  assert_same(got[0], want[0], "params")
  assert_same(got[1], want[1], "state")
