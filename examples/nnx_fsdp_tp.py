"""A Flax NNX model sharded over FSDP and tensor-parallel axes, trained with
Distributed Lion through ``nnx.Optimizer``: 2 nodes x (2 x 2) devices.

The mesh is ``("data", "fsdp", "model")``: the votes cross ``"data"`` (the
slow links between nodes); inside a node the compiler owns ``"fsdp"`` and
``"model"``, over which ``nnx.with_partitioning`` shards the kernels. The
step is written for one worker and mapped by ``dl.parallel.per_worker``,
manual over ``"data"`` only: the model state is the same on every worker,
the optimizer state (each worker's own momentum) is stacked on a leading
``"data"`` axis, the batch is split. Each device votes on its own part of
every leaf and sends that part's votes to its peer on the other node.

Run: ``python examples/nnx_fsdp_tp.py`` (8 simulated CPU devices).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dlion_jax as dl  # noqa: E402
from dlion_jax import parallel  # noqa: E402


class MLP(nnx.Module):
  """Two layers: the first kernel over (fsdp, model), the second over
  (model, None), Megatron style."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
        16, 64, kernel_init=nnx.with_partitioning(init, ("fsdp", "model")),
        rngs=rngs)
    self.down = nnx.Linear(
        64, 4, kernel_init=nnx.with_partitioning(init, ("model", None)),
        rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def main(steps: int = 20, seed: int = 0) -> dict:
  # Auto axes: the compiler places activations and gathers the sharded
  # kernels for each matmul (with Explicit ones the model would have to).
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   dl.distributed_lion(3e-3, weight_decay=1e-2,
                                       axis_name="data"))
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(optimizer)
  opt_state = parallel.stack_for_workers(opt_state, mesh)

  def train_step(model_state, opt_state, batch):      # one worker
    model = nnx.merge(model_def, model_state)
    optimizer = nnx.merge(opt_def, opt_state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return (nnx.state(model), nnx.state(optimizer),
            jax.lax.pmean(loss, "data"))

  # Called on arrays, per_worker's step compiles itself and keeps the new
  # states placed as the old (on Auto axes the compiler would pick).
  step = parallel.per_worker(train_step, mesh,
                             ins=("replicated", "stacked", "split"),
                             outs=("replicated", "stacked", "replicated"),
                             donate_argnums=(0, 1))
  step = parallel.limit_in_flight(step, devices=mesh.devices.flat)

  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(16, 4)).astype(np.float32)
  spread = NamedSharding(mesh, P(("data", "fsdp", "model")))
  losses = []
  for _ in range(steps):
    x = rng.normal(size=(32, 16)).astype(np.float32)
    batch = jax.device_put({"x": x, "y": x @ teacher}, spread)
    model_state, opt_state, loss = step(model_state, opt_state, batch)
    losses.append(float(loss))
  sent = dl.collective_bytes_by_axis(
      step.lower(model_state, opt_state, batch).compile(), mesh)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {"losses": losses, "data_bits_per_param": 8 * sent["data"] / params,
          "kernel_spec": model_state["up"]["kernel"].get_value().sharding.spec}


if __name__ == "__main__":
  out = main()
  print(f"loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}; "
        f"{out['data_bits_per_param']:.3f} bits/param/step across nodes "
        f"per device; up.kernel sharded {out['kernel_spec']}")
