"""One process of tests/test_hybrid_multiprocess.py (run by the launcher).

Runs STEPS hybrid steps of Distributed Lion on ``hybrid_mesh()``: one row
per process, this process's 4 CPU devices in it; ``layout`` is
``"shard_axis"`` (``shard_axis="fsdp"``, params replicated),
``"shard_axis_zero3"`` (the same with params sharded over ``fsdp`` at rest
by ``devices.shard_params``), ``"zero3"`` (params so sharded, the step
leaving ``fsdp`` to the compiler), or ``"plain"`` and ``"plain_zero3"``
(a plain ``jax.jit`` step of ``dl.workers``, params replicated or sharded
at rest; each device differentiates its own rows). Every
process builds the same inputs from a seed; process 0 writes the final
params and the whole stacked momentum to the .npz named on the command
line. Imported by the
test for the same inputs on one process.
"""

import sys

import numpy as np

SHAPES = {"b": (3,), "big": (37,), "w": (5, 7), "m": (8, 6)}
STEPS = 3
NODES, PER_NODE = 2, 4


def inputs():
  rng = np.random.default_rng(7)
  params = {k: rng.normal(size=s).astype(np.float32)
            for k, s in SHAPES.items()}
  batches = [{k: rng.integers(-3, 4, size=(NODES * PER_NODE,) + s).astype(
      np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]
  return params, batches


def run(mesh, layout="shard_axis"):
  """Final (params, momentum) as numpy, gathered onto every process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  import dlion_jax as dl  # pylint: disable=g-import-not-at-top
  from dlion_jax import devices  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top

  shard_axis = "fsdp" if layout.startswith("shard_axis") else None
  plain = layout.startswith("plain")
  def loss(p, batch):    # shard_axis, plain: a device's row; else the node's
    scale = 1.0 if shard_axis or plain else 1.0 / PER_NODE
    return sum(jnp.sum(p[k] * batch[k].sum(0)) for k in p) * scale
  tx = dl.distributed_lion(1e-2, axis_name="data", comm="alltoall")
  params, batches = inputs()
  p = (devices.global_array(params, NamedSharding(mesh, jax.P()))
       if layout in ("shard_axis", "plain")
       else devices.shard_params(params, mesh))
  state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
  step = parallel.make_train_step(loss, tx, mesh, shard_axis=shard_axis)
  if plain:
    placement = jax.tree.map(lambda x: x.sharding.spec, p)  # Auto axes
    def plain_step(p, state, batch):
      _, grads = dl.workers.value_and_grad(loss, placement=placement)(
          p, batch)
      updates, state = dl.workers.update(tx, placement=placement)(
          grads, state, p)
      return optax.apply_updates(p, updates), state, None
    step = jax.jit(plain_step)
  split = NamedSharding(mesh, jax.P(("data", "fsdp")))
  with jax.set_mesh(mesh):
    for batch in batches:
      p, state, _ = step(p, state, devices.global_array(batch, split))
  gather = lambda t: jax.tree.map(np.asarray, multihost_utils.process_allgather(
      t, tiled=True))
  return gather(p), gather(state[0].mu)


def main(out, layout):
  from dlion_jax import devices  # pylint: disable=g-import-not-at-top
  from dlion_jax import processes  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  processes.start_processes(PER_NODE, init_timeout=60)
  mesh = devices.hybrid_mesh()
  assert jax.process_count() == NODES and dict(mesh.shape) == {
      "data": NODES, "fsdp": PER_NODE}, mesh
  # Each row of the mesh is one process: the vote crosses processes.
  assert {d.process_index for d in mesh.devices[1]} == {1}
  params, mu = run(mesh, layout)
  if jax.process_index() == 0:
    np.savez(out, **{f"p_{k}": v for k, v in params.items()},
             **{f"mu_{k}": v for k, v in mu.items()})


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
