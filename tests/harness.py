"""Runs optimizers on explicit per-worker gradients over a device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import devices
from dlion_jax import parallel

AXIS = "data"


def random_tree(rng, shapes, dtype=np.float32, num_workers=None):
  """dict leaf name -> array, with a leading worker axis if num_workers."""
  lead = () if num_workers is None else (num_workers,)
  return {k: rng.normal(size=lead + s).astype(dtype) for k, s in shapes.items()}


def run_on_mesh(txs, params, grads_seq, num_workers, *, check_vma=True):
  """Steps every optimizer of ``txs`` (dict name -> tx) on the same grads.

  Args:
    txs: dict name -> GradientTransformation, all bound to axis ``AXIS``.
    params: initial params (dict of numpy arrays), copied to each worker.
    grads_seq: list over steps of dicts leaf -> array [N, *shape].

  Returns:
    dict name -> (params [N, ...] per worker, states [N, ...], updates list):
    everything stacked per worker so tests can check the replicas.
  """
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  sharded = NamedSharding(mesh, P(AXIS))
  names = sorted(txs)

  def local(ps, states, grads):
    out_p, out_s, out_u = {}, {}, {}
    for k in names:
      out_u[k], out_s[k] = txs[k].update(grads, states[k], ps[k])
      out_p[k] = optax.apply_updates(ps[k], out_u[k])
    return out_p, out_s, out_u

  step = jax.jit(parallel.per_worker(
      local, mesh, axis_name=AXIS, ins=("stacked",) * 3, outs=("stacked",) * 3,
      check_vma=check_vma))
  stacked = devices.replicate_for_pmap(
      jax.tree.map(jnp.asarray, params), num_workers)
  ps = jax.device_put({k: stacked for k in names}, sharded)
  states = jax.device_put(
      {k: devices.replicate_for_pmap(txs[k].init(params), num_workers)
       for k in names}, sharded)
  updates = []
  for grads in grads_seq:
    ps, states, u = step(ps, states, jax.device_put(grads, sharded))
    jax.block_until_ready(ps)   # a step at a time, as a test should
    updates.append(u)
  return {k: (jax.device_get(ps[k]), jax.device_get(states[k]),
              [jax.device_get(u[k]) for u in updates]) for k in names}
