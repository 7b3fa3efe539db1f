"""Distributed Lion inside optax's combinators."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlion_jax as dl
from harness import AXIS
from harness import random_tree
from harness import run_on_mesh
from reference import DistributedLionReference
from dlion_jax import _exchange as exchange

SHAPES = {"w": (13, 3), "b": (3,)}
N = 3


def grads_for(rng, steps):
  return [random_tree(rng, SHAPES, num_workers=N) for _ in range(steps)]


def test_schedule_through_inject_hyperparams_matches_plain_schedule():
  rng = np.random.default_rng(0)
  params, grads = random_tree(rng, SHAPES), grads_for(rng, 4)
  schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=4)
  injected = optax.inject_hyperparams(dl.distributed_lion)(
      learning_rate=schedule, b1=0.8, axis_name=AXIS, comm="alltoall")
  plain = dl.distributed_lion(schedule, b1=0.8, axis_name=AXIS,
                              comm="alltoall")
  out = run_on_mesh({"injected": injected, "plain": plain}, params, grads, N)
  chex.assert_trees_all_equal(out["injected"][0],
               out["plain"][0])
  hyper = out["injected"][1].hyperparams
  # Numbers became traced hyperparameters; strings stayed static options.
  assert set(hyper) == {"learning_rate", "b1", "b2", "weight_decay"}
  np.testing.assert_allclose(hyper["learning_rate"][0],
                             schedule(3), rtol=1e-6)   # lr of the last step


def test_injected_b1_is_a_runtime_value():
  """Changing an injected hyperparameter changes the vote, not the program."""
  tx = optax.inject_hyperparams(dl.scale_by_distributed_lion)(
      b1=0.9, axis_name=AXIS)
  params = {"w": jnp.zeros(2)}
  g1 = {"w": jnp.array([[1.0, -1.0]] * N)}
  g2 = {"w": jnp.array([[-0.5, 0.5]] * N)}   # against the momentum

  @jax.jit
  def second_update(b1):
    def worker(a, b):
      state = tx.init(params)
      state.hyperparams["b1"] = b1
      _, state = tx.update(a, state)     # momentum 0.01 * g1
      return tx.update(b, state)[0]["w"]
    return jax.vmap(worker, axis_name=AXIS)(g1, g2)[0]

  # c = b1 * 0.01 * g1 + (1 - b1) * g2: the momentum wins only for b1 ~ 1.
  np.testing.assert_array_equal(second_update(jnp.float32(0.5)), [-1, 1])
  np.testing.assert_array_equal(second_update(jnp.float32(0.999)), [1, -1])
  assert second_update._cache_size() == 1


def test_masked_leaves_skip_the_vote():
  rng = np.random.default_rng(1)
  params, grads = random_tree(rng, SHAPES), grads_for(rng, 3)
  tx = optax.masked(dl.distributed_lion(1e-2, axis_name=AXIS),
                    {"w": True, "b": False})
  out = run_on_mesh({"m": tx}, params, grads, N)["m"]
  ref = DistributedLionReference({"w": params["w"]}, N, learning_rate=1e-2)
  for g in grads:
    ref.step([{"w": g["w"][i]} for i in range(N)])
  for i in range(N):
    np.testing.assert_array_equal(out[0]["w"][i], ref.params["w"])
  # optax.masked passes masked-out updates through untouched: local grads.
  expected_b = params["b"] + sum(g["b"] for g in grads)
  np.testing.assert_allclose(out[0]["b"], expected_b, rtol=1e-6)


@pytest.mark.parametrize("mask", [{"w": False, "b": False}, {}],
                         ids=["all masked out", "no leaves"])
def test_nothing_to_vote_on(mask):
  """A D-Lion given no leaf (every one masked out, or an empty tree) steps
  as the identity on what it is given."""
  rng = np.random.default_rng(2)
  params = random_tree(rng, SHAPES) if mask else {}
  grads = grads_for(rng, 3) if mask else [{}] * 3
  tx = optax.masked(dl.distributed_lion(1e-2, axis_name=AXIS), mask) if (
      mask) else dl.distributed_lion(1e-2, axis_name=AXIS)
  out = run_on_mesh({"m": tx}, params, grads, N)["m"]
  for k in params:      # masked out: the local gradients pass through
    np.testing.assert_allclose(out[0][k][0], params[k] + sum(
        g[k][0] for g in grads), rtol=1e-6)


def test_complex_momentum_dtype_steps():
  """``mu_dtype=complex64`` (nothing refuses it) steps as before the
  momenta were tied to the vote (which only real floats are)."""
  params = {"w": jnp.zeros(100)}
  tx = dl.scale_by_distributed_lion(axis_name=AXIS, mu_dtype=jnp.complex64)
  def step(g):
    updates, state = tx.update(g, tx.init(params), params)
    return updates, state.mu
  updates, mu = jax.vmap(step, axis_name=AXIS)({"w": jnp.ones((4, 100))})
  assert mu["w"].dtype == jnp.complex64
  np.testing.assert_allclose(mu["w"], 0.01)
  np.testing.assert_array_equal(updates["w"], 1.0)


def test_apply_if_finite_skips_consistently_and_passes_finite_steps():
  rng = np.random.default_rng(2)
  params, grads = random_tree(rng, SHAPES), grads_for(rng, 3)
  grads[1]["w"][:, 0, 0] = np.nan          # every worker sees a NaN
  inner = dl.distributed_lion(1e-2, axis_name=AXIS)
  out = run_on_mesh({"safe": optax.apply_if_finite(inner, 3)}, params, grads,
                    N)["safe"]
  ref = DistributedLionReference(params, N, learning_rate=1e-2)
  for t, g in enumerate(grads):
    if t != 1:
      ref.step([{k: v[i] for k, v in g.items()} for i in range(N)])
  for k in SHAPES:
    # The wrapper's select changes XLA's fusion, hence 1 ulp of slack.
    np.testing.assert_array_max_ulp(out[0][k][0], ref.params[k], maxulp=1)
    assert all(np.array_equal(out[0][k][0], out[0][k][i]) for i in range(N))
  np.testing.assert_array_equal(out[1].total_notfinite, [1] * N)


def test_multisteps_votes_only_on_the_applying_step():
  rng = np.random.default_rng(3)
  params, grads = random_tree(rng, SHAPES), grads_for(rng, 4)
  tx = optax.MultiSteps(dl.distributed_lion(1e-2, axis_name=AXIS),
                        every_k_schedule=2)
  out = run_on_mesh({"ms": tx}, params, grads, N)["ms"]
  ref = DistributedLionReference(params, N, learning_rate=1e-2)
  for g0, g1 in zip(grads[::2], grads[1::2]):
    # MultiSteps averages the micro-batch gradients as a running mean.
    mean = {k: g0[k] + (g1[k] - g0[k]) / np.float32(2) for k in SHAPES}
    ref.step([{k: v[i] for k, v in mean.items()} for i in range(N)])
  for k in SHAPES:
    np.testing.assert_allclose(out[0][k][0], ref.params[k], rtol=1e-6)
    np.testing.assert_array_equal(out[0][k][0], out[0][k][-1])

  # XLA lowers MultiSteps' lax.cond to a select, so the exchange runs (and is
  # discarded) on every micro-step: same collectives as a plain update.
  def compiled_collectives(t):
    mesh = dl.devices.data_mesh(N)
    fn = jax.jit(dl.parallel.per_worker(
        lambda g, s: t.update(g, s, params)[0], mesh, axis_name=AXIS,
        ins=("stacked", "replicated"), outs="replicated"))
    text = fn.lower(grads[0], t.init(params)).compile().as_text()
    return [(c.op, c.result_bytes) for c in dl.hlo.collectives(text)]
  plain = compiled_collectives(dl.distributed_lion(1e-2, axis_name=AXIS))
  assert plain and compiled_collectives(tx) == plain


@pytest.mark.parametrize("comm", ["alltoall", "psum"])
def test_chain_with_clipping(comm):
  """Clipping acts on each worker's local gradient before the vote."""
  rng = np.random.default_rng(4)
  params, grads = random_tree(rng, SHAPES), grads_for(rng, 3)
  clip = optax.clip_by_global_norm(1.0)
  tx = optax.chain(clip, dl.distributed_lion(1e-2, axis_name=AXIS,
                                             comm=comm))
  p, _, _ = run_on_mesh({"c": tx}, params, grads, N)["c"]
  ref = DistributedLionReference(params, N, learning_rate=1e-2)
  for g in grads:
    local = [{k: v[i] for k, v in g.items()} for i in range(N)]
    clipped = [jax.tree.map(np.asarray, clip.update(x, clip.init(x))[0])
               for x in local]
    ref.step(clipped)
  for k in SHAPES:
    assert all(np.array_equal(p[k][0], p[k][i]) for i in range(N))
    np.testing.assert_allclose(p[k][0], ref.params[k], rtol=1e-6)


def test_error_feedback_state_can_be_donated():
  """Was: init put the same zeros array in mu and error, and
  ``jit(..., donate_argnums=...)`` refused to donate it twice."""
  tx = dl.distributed_lion(0.1, error_feedback=True)
  params = {"w": jnp.ones(5)}

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  state = tx.init(params)
  assert state[0].mu["w"] is not state[0].error["w"]
  p, _ = jax.jit(step, donate_argnums=(0, 1))(params, state, {"w": jnp.ones(5)})
  np.testing.assert_allclose(p["w"], 0.8999, rtol=1e-6)


@pytest.mark.parametrize("comm", ["alltoall", "allgather", "psum",
                                  "psum_int8", "auto"])
def test_explicit_data_by_model_mesh(comm):
  """Gradients sharded over an Explicit "model" axis beside the vote's
  "data" axis (``shard_map(axis_names={"data"})``). Was: ShardingTypeError
  from the message assembly (or the reshape of a sharded leaf). Now every
  strategy votes on whole leaves and hands the update back sharded like
  the leaf, equal to the vote of the same gradients unsharded."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  specs = {"w": P("data", None, "model"), "v": P("data", "model"),
           "b": P("data")}
  rng = np.random.default_rng(0)
  grads = {"w": rng.normal(size=(4, 6, 10)), "v": rng.normal(size=(4, 14)),
           "b": rng.normal(size=(4, 7))}
  grads = {k: v.astype(np.float32) for k, v in grads.items()}
  for aggregation in ("mavo", "avg"):
    tx = dl.scale_by_distributed_lion(axis_name="data", comm=comm,
                                      aggregation=aggregation, b1=0.0,
                                      min_compress_size=8)

    def local(g):
      g = jax.tree.map(lambda x: x[0], g)
      u, _ = tx.update(g, tx.init(jax.tree.map(jnp.zeros_like, g)))
      return jax.tree.map(lambda x: x[None], u)
    with jax.set_mesh(mesh):
      sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                 for k, v in grads.items()}
      out = jax.jit(jax.shard_map(
          local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
          axis_names={"data"}))(sharded)
    assert jax.typeof(out["w"]).sharding.spec == specs["w"]
    ref = jax.vmap(lambda g: dl.scale_by_distributed_lion(
        axis_name="data", comm="psum", aggregation=aggregation, b1=0.0,
        min_compress_size=8).update(g, tx.init(g))[0], axis_name="data")(
            grads)
    for k in grads:
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]),
                                    err_msg=f"{aggregation} {k}")


@pytest.mark.parametrize("comm", ["psum", "psum_int8", "auto"])
def test_tuple_axis_under_nested_vmap(comm):
  """jax's all_gather/all_to_all take one vmapped axis at a time: the psum
  strategies vote over nested vmaps, and 'auto' picks one of them even
  where the message would favour alltoall."""
  rng = np.random.default_rng(0)
  g = rng.normal(size=(2, 3, 4096)).astype(np.float32)
  tx = dl.scale_by_distributed_lion(axis_name=("a", "b"), comm=comm, b1=0.0)
  u = jax.vmap(jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="b"),
               axis_name="a")(g)
  want = np.sign(np.where(g > 0, 1, -1).sum((0, 1)))
  np.testing.assert_array_equal(np.asarray(u).reshape(6, -1),
                                np.broadcast_to(want, (6, 4096)))
  assert exchange.resolve_comm("auto", 6, aggregation="mavo",
                                  leaf_sizes=[4096]) == (
                                      "alltoall")


@pytest.mark.parametrize("comm", ["alltoall", "allgather"])
def test_tuple_axis_under_nested_vmap_refuses_gathers(comm):
  tx = dl.scale_by_distributed_lion(axis_name=("a", "b"), comm=comm)
  with pytest.raises(ValueError, match=(
      rf"comm='{comm}' cannot vote over axis_name=\('a', 'b'\), a tuple of "
      r"axes bound by nested jax.vmap.*Use comm='psum'")):
    jax.vmap(jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="b"),
             axis_name="a")(jnp.ones((2, 3, 5)))
