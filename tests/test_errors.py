"""Misuse gives an error that names the argument, the value and the fix."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlion_jax import _packing as packing
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies
from dlion_jax import devices
import dlion_jax as dl
from messages import assert_names

PARAMS = {"w": jnp.zeros(5)}


@pytest.mark.parametrize("option,value,listed", [
    ("aggregation", "mean", "'mavo', 'avg'"),
    ("vote", "sign", "'binary', 'ternary'"),
    ("comm", "ring", "'alltoall', 'allgather', 'psum', 'psum_int8', 'auto'"),
    ("comm", None, "'auto'"),
])
def test_unknown_option_lists_valid_values(option, value, listed):
  """The option, the value given and the valid values."""
  for factory in (dl.scale_by_distributed_lion,
                  lambda **kw: dl.distributed_lion(1e-3, **kw)):
    with pytest.raises(ValueError) as e:
      factory(**{option: value})
    assert_names(e, f"{option}={value!r}", listed)


def test_unbound_axis_says_where_update_must_run():
  """The axis, and where to call update: shard_map, pmap, or axis_name=None
  for one worker; eagerly and under jit."""
  tx = dl.scale_by_distributed_lion(axis_name="data")
  state = tx.init(PARAMS)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(NameError) as e:
      update(PARAMS, state)
    assert_names(e, "axis_name='data'", "jax.shard_map", "jax.pmap",
                 "axis_name=None")


def test_wrong_axis_name_inside_shard_map():
  """A mesh without the optimizer's axis: the axis it wants, where."""
  tx = dl.scale_by_distributed_lion(axis_name="batch")
  mesh = dl.devices.data_mesh(2)
  fn = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
                     in_specs=jax.P("data"), out_specs=jax.P("data"))
  with pytest.raises(ValueError) as e:
    fn(jnp.zeros((2, 4)))
  assert_names(e, "axis_name='batch'", "devices of 'data'", "('data',)",
               "axis_name='data'", "no axis of it")


def test_integer_leaves_are_named():
  """An integer leaf: its path, its dtype, how to leave it out."""
  tx = dl.distributed_lion(1e-3)
  with pytest.raises(TypeError) as e:
    tx.init({"w": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)})
  assert_names(e, "params leaf ['step']", "int32", "optax.masked")
  state = tx.init(PARAMS)
  with pytest.raises(TypeError) as e:
    tx.update({"w": jnp.zeros(5, jnp.int32)}, state, PARAMS)
  assert_names(e, "gradient leaf ['w']", "int32", "optax.masked")


def test_mismatched_pytrees():
  """Grads for other params: both structures or shapes, and the fix."""
  tx = dl.scale_by_distributed_lion()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError) as e:
    tx.update({"v": jnp.zeros(5)}, state)
  assert_names(e, "{'v': *}", "{'w': *}", "Call `init` on the same "
               "parameters")
  with pytest.raises(ValueError) as e:
    tx.update({"w": jnp.zeros(4)}, state)
  assert_names(e, "leaf ['w']", "(4,)", "(5,)", "Call `init`")


def test_state_from_another_optimizer():
  """Another optimizer's state: the state wanted, the one given, the fix."""
  tx = dl.scale_by_distributed_lion()
  for state, got in ((optax.scale_by_adam().init(PARAMS), "ScaleByAdamState"),
                     ({"count": 0, "mu": PARAMS}, "got a dict")):
    with pytest.raises(TypeError) as e:
      tx.update(PARAMS, state)
    assert_names(e, "DistributedLionState", got, "tx.init(params)")
  # optax.lion's state has the same fields and meaning: switching is allowed.
  updates, _ = tx.update(PARAMS, optax.scale_by_lion().init(PARAMS))
  assert updates["w"].shape == (5,)


def test_field_widths_widen_with_the_worker_count():
  assert strategies.int_container(127) == jnp.int8
  assert strategies.int_container(128) == jnp.int16
  assert dl.wire_bits(200, comm="psum_int8") == pytest.approx(2 * 199 / 200
                                                              * 16)
  # psum counters: radix levels*N+1 always fits, words widen to uint32.
  for n in (2, 7, 64, 1000):
    radix = strategies.psum_radix(n, quantize.TERNARY)
    assert radix ** packing.digits_per_word(radix) <= 2**32


def test_wire_bits_rejects_bad_worker_counts():
  for bad in (0, -2, True, 4.0):
    with pytest.raises(ValueError) as e:
      dl.wire_bits(bad)
    assert_names(e, f"num_workers={bad!r}", "positive int")
  with pytest.raises(ValueError) as e:
    dl.wire_bits(4, comm="x")
  assert_names(e, "comm='x'", "'psum'", "'auto'")


def test_nan_votes_are_deterministic():
  """Binary: NaN votes -1 (it is not > 0); ternary: NaN abstains."""
  g = jnp.array([[np.nan, 1.0], [np.nan, 1.0], [np.nan, -1.0]])
  for vote, expected in (("binary", [-1.0, 1.0]), ("ternary", [0.0, 1.0])):
    tx = dl.scale_by_distributed_lion(axis_name="data", vote=vote)
    out = jax.vmap(lambda x: tx.update(x, tx.init(x))[0],
                   axis_name="data")(g)
    np.testing.assert_array_equal(out[0], expected)


def test_state_restored_without_a_target_says_how_to_restore(tmp_path):
  """Was: "Re-create the optimizer state with tx.init(params)", which loses
  the run's momenta; orbax restores NamedTuples as dicts without a target."""
  ocp = pytest.importorskip("orbax.checkpoint")
  from dlion_jax import parallel   # pylint: disable=import-outside-toplevel
  mesh = devices.data_mesh(4)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(1e-2, axis_name="data"))
  params = devices.replicate({"w": jnp.ones((3, 5))}, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2),
                                  tx, mesh, donate=False)
  batch = devices.shard_batch(jnp.ones((8, 3)), mesh)
  state = step(params, state, batch)[1]
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  with pytest.raises(TypeError) as e:
    step(params, checkpointer.restore(tmp_path / "state"), batch)
  assert_names(e, "got a dict of its fields (count, mu)", "without a target",
               "checkpointer.restore(path, dl.parallel.init_worker_states("
               "tx, params, mesh))")
  restored = checkpointer.restore(
      tmp_path / "state", parallel.init_worker_states(tx, params, mesh))
  chex.assert_trees_all_equal(restored, state)
  step(params, restored, batch)


def _step_problem(n=4):
  """A linear model's replicated params and a batch over n workers."""
  mesh = devices.data_mesh(n)
  k = jax.random.split(jax.random.key(0), 2)
  params = devices.replicate({"w": jax.random.normal(k[0], (16,)),
                              "b": jnp.zeros(())}, mesh)
  x = jax.random.normal(k[1], (8 * n, 16))
  batch = devices.shard_batch({"x": x, "y": x @ jnp.linspace(-1, 1, 16)},
                              mesh)
  return mesh, params, batch


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def test_injected_hyperparameter_set_to_one_value_names_the_recipe():
  """state.hyperparams["learning_rate"] = 3e-4 on a per-worker state. Was:
  "Build it with parallel.init_worker_states(tx, params, mesh), not
  tx.init(params)", which the user had done."""
  from dlion_jax import parallel   # pylint: disable=import-outside-toplevel
  mesh, params, batch = _step_problem()
  tx = optax.inject_hyperparams(dl.distributed_lion)(learning_rate=1e-2,
                                                     axis_name="data")
  state = parallel.init_worker_states(tx, params, mesh)
  state.hyperparams["learning_rate"] = 3e-4
  step = parallel.make_train_step(_loss, tx, mesh, donate=False)
  with pytest.raises(ValueError) as e:
    step(params, state, batch)
  assert_names(e, "'learning_rate'", "optax.inject_hyperparams",
               "jax.device_put(jnp.full_like(", "value.sharding")
  assert "not tx.init(params)" not in str(e.value)

  def worker_step(params, state, batch):    # the same state in per_worker
    updates, state = tx.update(jax.grad(_loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state
  mapped = parallel.per_worker(worker_step, mesh,
                               ins=("replicated", "stacked", "split"),
                               outs=("replicated", "stacked"))
  with pytest.raises(ValueError) as e:
    jax.jit(mapped)(params, state, batch)
  assert_names(e, '"stacked"', "'learning_rate'",
               "jax.device_put(jnp.full_like(")


@pytest.mark.parametrize("n", [4, 3])
def test_hand_written_step_without_the_row_names_s0(n):
  """A shard_map step given the stacked state (in_specs P("data")) that
  forgets ``s[0]``: each worker's block has a leading axis of 1. Was:
  "the state was built from params already stacked per worker (e.g.
  init_pmap_states ...)", which it was not."""
  from dlion_jax import parallel   # pylint: disable=import-outside-toplevel
  mesh, params, batch = _step_problem(n)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(1e-2, weight_decay=1e-2,
                                       axis_name="data"))

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(jax.P(), jax.P("data"), jax.P("data")),
                 out_specs=(jax.P(), jax.P("data"), jax.P()))
  def step(params, state, batch):
    local = jax.lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(_loss)(local, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(
        loss, "data")
  with pytest.raises(ValueError) as e:
    step(params, parallel.init_worker_states(tx, params, mesh), batch)
  assert_names(e, "leading axis of 1", "jax.tree.map(lambda s: s[0], state)",
               "s[None]")
  assert "init_pmap_states" not in str(e.value)


def test_per_worker_state_laid_out_replicated_names_stacked():
  """per_worker given every worker's stacked state laid out "replicated":
  each worker sees all rows. Was: the stacked-params message only."""
  from dlion_jax import parallel   # pylint: disable=import-outside-toplevel
  mesh, params, batch = _step_problem()
  tx = dl.distributed_lion(1e-2, axis_name="data")

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(
        loss, "data")
  wrong = parallel.per_worker(step, mesh,
                              ins=("replicated", "replicated", "split"),
                              outs=("replicated", "replicated", "replicated"))
  state = parallel.init_worker_states(tx, params, mesh)
  with pytest.raises(ValueError) as e:
    jax.jit(wrong)(params, state, batch)
  assert_names(e, "(4 rows, one per worker)", '"stacked"', '"replicated"',
               "parallel.per_worker")
  right = parallel.per_worker(step, mesh,
                              ins=("replicated", "stacked", "split"),
                              outs=("replicated", "stacked", "replicated"))
  jax.jit(right)(params, state, batch)


def test_an_outer_momentum_of_one_or_more_is_refused():
  """Was: nesterov_outer(momentum=1.5) accepted (the CLI refused it)."""
  for bad in (1.0, 1.5, -0.1, float("nan"), True, jnp.asarray(1.5)):
    with pytest.raises(ValueError) as e:
      dl.rounds.nesterov_outer(0.7, momentum=bad)
    assert_names(e, f"momentum={bad!r}", "[0, 1)")
  for good in (0.0, 0.9, np.float32(0.5), jnp.asarray(0.9)):
    dl.rounds.nesterov_outer(0.7, momentum=good)


NAN = float("nan")


@pytest.mark.parametrize("call,arg,why,fix", [
    (lambda: dl.rounds.voted_outer(0.5, momentum=-0.1), "momentum=-0.1",
     "negative", "momentum=0.9"),
    (lambda: dl.rounds.voted_outer(0.5, momentum=NAN), "momentum=nan",
     "NaN", "momentum=0.9"),
    (lambda: dl.rounds.voted_outer(0.5, lion=(-0.5, 0.98)), "lion[0]=-0.5",
     "negative", "lion=(0.95, 0.98)"),
    (lambda: dl.rounds.voted_outer(0.5, lion=(0.95, NAN)), "lion[1]=nan",
     "NaN", "lion=(0.95, 0.98)"),
    (lambda: dl.rounds.nesterov_outer(0.7, momentum=NAN), "momentum=nan",
     "NaN", "momentum=0.9"),
    (lambda: dl.rounds.nesterov_outer(0.7, momentum=-0.1), "momentum=-0.1",
     "negative", "momentum=0.9"),
    (lambda: dl.rounds.nesterov_outer(0.7, momentum=1.5), "momentum=1.5",
     "1 or more", "momentum=0.9"),
], ids=["voted -0.1", "voted nan", "voted lion b1 -0.5", "voted lion b2 nan",
        "nesterov nan", "nesterov -0.1", "nesterov 1.5"])
def test_an_outer_rate_out_of_range_names_why_and_the_fix(call, arg, why, fix):
  """A negative or NaN outer momentum or Lion rate: the argument, the
  value, the range, why and a valid call (was: "at 1 or more the momentum
  grows without bound" for every value, -0.1 and NaN too, and no fix)."""
  with pytest.raises(ValueError) as e:
    call()
  assert_names(e, arg, "[0, 1)", why, fix)
  assert ("1 or more" in str(e.value)) == (why == "1 or more")


@pytest.mark.parametrize("key,value,why", [
    ("outer_momentum", "-0.1", "negative"), ("outer_momentum", ".nan", "NaN"),
    ("outer_b2", "-0.5", "negative"), ("outer_b2", "1.5", "1 or more")])
def test_the_clis_outer_rate_out_of_range_names_why_and_the_fix(key, value,
                                                                why):
  """The CLI's keys of the same rates (was: "must be in [0, 1)." with no
  reason nor fix)."""
  from dlion_jax.train.config import ConfigError, load_config  # pylint: disable=import-outside-toplevel
  with pytest.raises(ConfigError) as e:
    load_config(None, ["optimizer.local_steps=4",
                       f"optimizer.{key}={value}"])
  shown = value.lstrip(".")
  assert_names(e, f"optimizer.{key}={shown}", "[0, 1)", why,
               f"Set optimizer.{key}=0.", "or null")


@pytest.mark.parametrize("kind", ["Explicit", "Auto"])
def test_a_vote_over_another_axis_than_the_plain_steps_workers(kind):
  """A tx voting over "model" in dl.workers.update's step over "data": the
  error names both axes and the two fixes. Was: a message about shard_map
  regions suggesting dl.workers.update, the call already made."""
  kind = getattr(jax.sharding.AxisType, kind)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
  tx = dl.distributed_lion(1e-2, axis_name="model")
  with jax.set_mesh(mesh):
    params = {"w": jnp.ones((8, 4))}
    state = dl.parallel.init_worker_states(
        dl.distributed_lion(1e-2, axis_name="data"), params, mesh)
    grads = {"w": jax.device_put(jnp.ones((4, 8, 4)),
                                 jax.NamedSharding(mesh, jax.P("data")))}
    with pytest.raises((ValueError, NameError)) as e:
      jax.jit(dl.workers.update(tx))(grads, state, params)
  assert_names(e, "axis_name='model'", "devices of 'data'",
               "('data', 'model')", "with axis_name='data'",
               "pass axis_name='model'")
  with jax.set_mesh(mesh), pytest.raises((ValueError, NameError)) as e:
    jax.jit(dl.workers.update(dl.distributed_lion(1e-2, axis_name="batch")))(
        grads, state, params)
  assert_names(e, "axis_name='batch'", "no axis of it",
               "('data', 'model')", "with axis_name='data'")
  assert "pass axis_name='batch'" not in str(e.value)
