"""Every step of an optimizer on a device mesh, compiled once.

:func:`harness.run_on_mesh` returns the state after the last step; a test
that looks at the state after each step would otherwise compile a program
per step count. Here ``lax.scan`` runs the steps inside one ``shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dlion_jax import devices
from dlion_jax import parallel
from harness import AXIS


def trajectory_on_mesh(tx, params, grads_seq, num_workers):
  """Steps ``tx`` on ``num_workers`` workers through ``grads_seq``.

  Args:
    tx: a GradientTransformation bound to axis ``AXIS``.
    params: initial params (dict of numpy arrays), the same on each worker.
    grads_seq: list over steps of dicts leaf -> array [N, *shape].

  Returns:
    (params, states): every leaf [N, steps, ...], worker first, then the
    value after each step.
  """
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  grads = jax.tree.map(lambda *g: np.stack(g, axis=1), *grads_seq)

  def worker(p, s, gs):
    def step(carry, g):
      p, s = carry
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
      return (p, s), (p, s)
    return jax.lax.scan(step, (p, s), gs)[1]

  run = jax.jit(parallel.per_worker(worker, mesh, axis_name=AXIS,
                                    ins=("stacked",) * 3, outs="stacked",
                                    check_vma=True))
  stack = lambda t: devices.replicate_for_pmap(t, num_workers)
  params = jax.tree.map(jnp.asarray, params)
  return jax.device_get(run(stack(params), stack(tx.init(params)), grads))
