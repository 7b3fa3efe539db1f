"""A Flax Linen model and ``flax.training.train_state.TrainState`` trained
with Distributed Lion in a plain ``jax.jit`` step: 2 nodes x 4 devices,
params sharded FSDP-style inside each node.

``TrainState`` holds the step, the params and the optimizer state together.
Under Distributed Lion the optimizer state is each worker's own: built
with ``dl.workers.stacked(tx)``, it holds a row per worker (on the
``"data"`` devices) while the step and the params are one.
``dl.workers.value_and_grad`` gives each worker the gradients of its own
rows (split again over ``"fsdp"``: each device differentiates its own),
and ``state.apply_gradients`` applies the one voted update. The params are
sharded over ``"fsdp"`` at rest (``dl.devices.shard_params``); the
compiler gathers them for the forward pass, and each device votes across
``"data"`` on its own shard.

Run: ``python examples/linen_train_state.py`` (8 simulated CPU devices).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dlion_jax as dl  # noqa: E402
from dlion_jax import devices  # noqa: E402


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(64)(x)))


def main(steps: int = 20, seed: int = 0) -> dict:
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = MLP()
  params = model.init(jax.random.key(seed), jnp.zeros((1, 16)))["params"]
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(3e-3, weight_decay=1e-2,
                                       axis_name="data"))
  with jax.set_mesh(mesh):
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=devices.shard_params(params, mesh),
        tx=dl.workers.stacked(tx))

  @jax.jit
  def train_step(state, batch):                      # every worker
    def loss_fn(params, rows):                       # one device's rows
      pred = state.apply_fn({"params": params}, rows["x"])
      return jnp.mean((pred - rows["y"]) ** 2)
    losses, grads = dl.workers.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), losses.mean()

  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(16, 4)).astype(np.float32)
  spread = NamedSharding(mesh, P(("data", "fsdp")))
  losses = []
  with jax.set_mesh(mesh):                 # dl.workers reads the mesh
    for _ in range(steps):
      x = rng.normal(size=(32, 16)).astype(np.float32)
      batch = jax.device_put({"x": x, "y": x @ teacher}, spread)
      state, loss = train_step(state, batch)
      losses.append(float(loss))
    sent = dl.collective_bytes_by_axis(
        train_step.lower(state, batch).compile(), mesh)
  count = sum(x.size for x in jax.tree.leaves(params))
  return {"losses": losses, "data_bits_per_param": 8 * sent["data"] / count,
          "kernel_spec": state.params["Dense_0"]["kernel"].sharding.spec,
          "step": int(state.step)}


if __name__ == "__main__":
  out = main()
  print(f"loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f} in "
        f"{out['step']} steps; {out['data_bits_per_param']:.3f} "
        "bits/param/step across nodes per device; Dense_0 kernel sharded "
        f"{out['kernel_spec']}")
