"""The drift check of the step builders: every new params leaf must be equal
on all workers, or the step is refused naming the leaves that are not
(docs/reliability.md section 5, rows 66 and 87)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import transforms
import dlion_jax as dl
from messages import assert_names

N = 4
LR = 1e-2


def loss_fn(params, batch):
  return jnp.mean((batch @ params["a"] + params["b"] - 2.0) ** 2)


def token_mean_loss(params, batch):
  """A sum over this worker's rows over the psum of all workers' rows."""
  total = jnp.sum((batch @ params["a"] + params["b"] - 2.0) ** 2)
  return total / jax.lax.psum(batch.shape[0], "data")


def clip_by_psummed_norm():
  """Scales updates down by the norm of all workers' gradients (a psum)."""
  def update(updates, state, params=None):
    del params
    norm = jnp.sqrt(jax.lax.psum(optax.tree.norm(updates) ** 2, "data"))
    return jax.tree.map(lambda u: u / jnp.maximum(norm, 1.0), updates), state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def dlion(lr=LR, **kw):
  return dl.distributed_lion(lr, axis_name="data", **kw)


DRIFTING = {   # optimizer, loss, the leaves that would drift
    "masked_off_leaf": (optax.masked(dlion(), {"a": True, "b": False}),
                        loss_fn, ["['b']"]),
    "multi_transform_adamw": (
        optax.multi_transform({"vote": dlion(), "local": optax.adamw(LR)},
                              {"a": "vote", "b": "local"}),
        loss_fn, ["['b']"]),
    "guard_around_forgotten_axis": (
        dl.apply_if_finite(dl.distributed_lion(LR), 5), loss_fn,
        ["['a']", "['b']"]),
    "psummed_clip_before_lion": (
        optax.chain(clip_by_psummed_norm(), optax.lion(LR)), loss_fn,
        ["['a']", "['b']"]),
    "psummed_token_count_with_lion": (optax.lion(LR), token_mean_loss,
                                      ["['a']", "['b']"]),
}


def _problem(mesh, params=None):
  params = {"a": jnp.ones((3, 5)), "b": jnp.zeros(5)} if params is None \
      else params
  # Each worker's rows on another scale, so that their gradients' signs
  # differ and a local update shows as drift.
  scale = jnp.repeat(jnp.array([0.2, 0.5, 1.0, 3.0]), 8)[:, None]
  batch = scale * jax.random.normal(jax.random.key(0), (8 * N, 3))
  return devices.replicate(params, mesh), devices.shard_batch(batch, mesh)


def _spread(leaf) -> float:
  """Largest difference between the devices' copies of a replicated leaf."""
  copies = [np.asarray(s.data) for s in leaf.addressable_shards]
  return max(float(np.abs(c - copies[0]).max(initial=0)) for c in copies)


@pytest.mark.parametrize("case", sorted(DRIFTING))
def test_drifting_leaves_are_refused_and_named(case):
  """Was: accepted, since *some* param depended on *some* collective over
  the axis; the replicas of the named leaves then drifted apart."""
  tx, loss, leaves = DRIFTING[case]
  mesh = devices.data_mesh(N)
  params, batch = _problem(mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss, tx, mesh, donate=False)
  with pytest.raises(ValueError) as e:
    step(params, state, batch)
  assert_names(e, "axis 'data'", f"{N} workers", *leaves,
               f"({len(leaves)} of 2)", "axis_name='data'",
               "pmean_gradients('data')")
  unchecked = step._fn._jitted            # pylint: disable=protected-access
  for _ in range(3):
    params, state, _ = unchecked(params, state, batch)
  drift = {k: _spread(v) for k, v in params.items()}
  assert {f"['{k}']" for k, d in drift.items() if d > 0} == set(leaves)


def test_pmap_step_refuses_a_guard_around_a_forgotten_axis():
  tx = dl.apply_if_finite(dl.distributed_lion(LR), 5)
  step = parallel.make_pmap_train_step(loss_fn, tx,
                                       devices=jax.devices()[:N])
  params = {"a": jnp.ones((3, 5)), "b": jnp.zeros(5)}
  with pytest.raises(ValueError) as e:
    step(devices.replicate_for_pmap(params, N),
         parallel.init_pmap_states(tx, params, N), jnp.ones((N, 2, 3)))
  assert_names(e, "axis 'data'", "['a'], ['b'] (2 of 2)")


ACCEPTED = {
    "readme_chain_with_schedule_and_mask": optax.chain(
        optax.clip_by_global_norm(1.0),
        dlion(optax.warmup_cosine_decay_schedule(0.0, LR, 2, 10),
              weight_decay=1e-2,
              mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))),
    "guard_on_the_axis": dl.apply_if_finite(dlion(), 5),
    "global_optimizer_after_pmean": optax.chain(
        transforms.pmean_gradients("data"), optax.adamw(LR)),
    "inject_hyperparams": optax.inject_hyperparams(
        dl.distributed_lion, static_args=("axis_name",))(
            learning_rate=LR, axis_name="data"),
    "momentum_sync_alltoall_avg": dlion(momentum_sync=2, comm="alltoall",
                                        aggregation="avg"),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_optimizers_that_keep_replicas_equal_are_accepted(case,
                                                          micro_batches):
  tx = ACCEPTED[case]
  mesh = devices.data_mesh(N)
  params, batch = _problem(mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh,
                                  micro_batches=micro_batches)
  for _ in range(3):
    params, state, loss = step(params, state, batch)
  assert np.isfinite(float(loss))
  assert all(_spread(leaf) == 0 for leaf in jax.tree.leaves(params))


def test_params_of_empty_arrays_are_accepted():
  """Was refused: no leaf depended on an exchange, since none has an entry
  to exchange; an empty leaf cannot drift."""
  mesh = devices.data_mesh(N)
  params, batch = _problem(mesh, {"a": jnp.zeros((3, 0)), "b": jnp.zeros(0)})
  tx = dlion()
  step = parallel.make_train_step(
      lambda p, b: jnp.mean(b) + jnp.sum(b @ p["a"]) + jnp.sum(p["b"]), tx,
      mesh)
  new, _, _ = step(params, parallel.init_worker_states(tx, params, mesh),
                   batch)
  assert jax.tree.map(jnp.shape, new) == {"a": (3, 0), "b": (0,)}


def test_pmap_step_refuses_a_mean_over_groups_of_workers():
  """A pmean with axis_index_groups agrees within each group only; was:
  accepted, and the two halves of the workers drifted apart."""
  def group_mean():
    def update(grads, state, params=None):
      del params
      return jax.tree.map(lambda g: jax.lax.pmean(
          g, "data", axis_index_groups=[[0, 1], [2, 3]]), grads), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)
  tx = optax.chain(group_mean(), optax.adam(LR))
  step = parallel.make_pmap_train_step(loss_fn, tx, devices=jax.devices()[:N])
  params = {"a": jnp.ones((3, 5)), "b": jnp.zeros(5)}
  with pytest.raises(ValueError) as e:
    step(devices.replicate_for_pmap(params, N),
         parallel.init_pmap_states(tx, params, N), jnp.ones((N, 2, 3)))
  assert_names(e, "axis 'data'", "['a'], ['b'] (2 of 2)")


def test_optax_apply_if_finite_is_told_apart_from_a_forgotten_axis():
  """optax.apply_if_finite around an optimizer that does vote decides per
  worker whether to apply the vote. Was: "exchanges nothing over axis
  'data' ... Build the optimizer ... with axis_name='data'", which it is."""
  tx = optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(1.0),
                  dlion(weight_decay=1e-2)), 3)
  mesh = devices.data_mesh(N)
  params, batch = _problem(mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss_fn, tx, mesh, donate=False)
  with pytest.raises(ValueError) as e:
    step(params, state, batch)
  assert_names(e, "optax.apply_if_finite", "dl.apply_if_finite(",
               "axis_name='data'", "['a'], ['b'] (2 of 2)")
  assert "exchanges nothing" not in str(e.value)
  assert "Build the optimizer" not in str(e.value)
  fixed = dl.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(1.0), dlion(weight_decay=1e-2)),
      3)
  step = parallel.make_train_step(loss_fn, fixed, mesh, donate=False)
  new, _, _ = step(params, parallel.init_worker_states(fixed, params, mesh),
                   batch)
  assert all(_spread(leaf) == 0 for leaf in jax.tree.leaves(new))
