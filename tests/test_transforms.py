"""dl.transforms.pmean_gradients against numpy, the way a user chains it.

apply_if_finite, the module's other transform, has its own file:
tests/test_nonfinite.py (docs/reliability.md, section 4).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlion_jax import transforms
from harness import AXIS
from harness import random_tree
from harness import run_on_mesh
from messages import assert_names

SHAPES = {"w": (5, 7), "b": (13,)}     # 35 and 13: not multiples of 8 N


@pytest.mark.parametrize("num_workers", [3, 4])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_every_worker_gets_the_mean_of_the_workers_gradients(num_workers,
                                                             dtype):
  rng = np.random.default_rng(num_workers)
  grads = random_tree(rng, SHAPES, dtype, num_workers)
  tx = transforms.pmean_gradients(AXIS)
  out, state = jax.vmap(lambda g: tx.update(g, tx.init(g)),
                        axis_name=AXIS)(grads)
  assert state == optax.EmptyState()
  for name, g in grads.items():
    want = np.asarray(g, np.float64).mean(axis=0)
    got = np.asarray(out[name], np.float64)
    assert out[name].dtype == g.dtype
    # Every worker holds the same mean, within the rounding of its dtype.
    np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
    # A sum of N roundings of at most |g_i| eps each, then the division.
    bound = float(jnp.finfo(dtype).eps) * num_workers * np.abs(
        np.asarray(g, np.float64)).max(axis=0)
    assert np.all(np.abs(got[0] - want) <= bound), name


@pytest.mark.parametrize("num_workers", [3, 4])
def test_on_a_mesh_it_is_global_lion_on_the_mean_gradient(num_workers):
  """The README's baseline chain on a device mesh equals optax.lion fed the
  numpy mean of the workers' gradients, step after step."""
  rng = np.random.default_rng(0)
  params = random_tree(rng, SHAPES)
  grads_seq = [random_tree(rng, SHAPES, num_workers=num_workers)
               for _ in range(3)]
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   transforms.pmean_gradients(AXIS), optax.lion(1e-2))
  ps, _, _ = run_on_mesh({"global": tx}, params, grads_seq,
                         num_workers)["global"]
  ref, p = optax.chain(optax.lion(1e-2)), params
  state = ref.init(p)
  for grads in grads_seq:
    # Each worker clips its own gradient before the mean.
    clipped = [optax.clip_by_global_norm(1.0).update(
        {k: g[i] for k, g in grads.items()}, optax.EmptyState())[0]
               for i in range(num_workers)]
    mean = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *clipped)
    u, state = ref.update(mean, state, p)
    p = optax.apply_updates(p, u)
  for name in SHAPES:
    for i in range(num_workers):
      np.testing.assert_allclose(ps[name][i], p[name], rtol=1e-6, atol=1e-6)


def test_an_unbound_axis_names_the_argument_and_how_to_bind_it():
  tx = transforms.pmean_gradients("batch")
  grads = {"w": jnp.ones(3)}
  with pytest.raises(NameError) as e:
    tx.update(grads, tx.init(grads))
  assert_names(e, "dl.transforms.pmean_gradients", "axis_name='batch'",
               "jax.shard_map", "make_train_step")
