"""A Flax NNX model sharded over FSDP and tensor-parallel axes, trained with
Distributed Lion through ``nnx.Optimizer`` in a plain ``nnx.jit`` step:
2 nodes x (2 x 2) devices.

The mesh is ``("data", "fsdp", "model")``: the votes cross ``"data"`` (the
slow links between nodes); inside a node the compiler owns ``"fsdp"`` and
``"model"``, over which ``nnx.with_partitioning`` shards the kernels. The
step is written for all the workers at once: ``dl.workers.value_and_grad``
gives each worker the gradients of its own rows of the batch (a leading
axis of workers on ``"data"``, no gradient all-reduce), and
``nnx.Optimizer`` with ``dl.workers.stacked(tx)`` keeps each worker's
momentum as a row of its state and applies the one voted update. Each
device votes on its own part of every leaf and sends that part's votes to
its peer on the other node.

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


def make_mesh() -> jax.sharding.Mesh:
  # Auto axes: the compiler places activations and gathers the sharded
  # kernels for each matmul (with Explicit ones the model would have to).
  return jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def make_optimizer() -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0),
                     dl.distributed_lion(3e-3, weight_decay=1e-2,
                                         axis_name="data"))


@nnx.jit
def train_step(model, optimizer, batch):
  """One step of every worker (run under ``jax.set_mesh``): each worker's
  loss and gradients of its rows, one voted update."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_of(params, rows):
    return loss_fn(nnx.merge(graphdef, params, rest), rows)
  losses, grads = dl.workers.value_and_grad(loss_of)(params, batch)
  optimizer.update(model, grads)
  return losses.mean()


def main(steps: int = 20, seed: int = 0) -> dict:
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(seed))
    # The optimizer's state: a row per worker (each worker's momentum).
    opt = nnx.Optimizer(model, dl.workers.stacked(make_optimizer()),
                        wrt=nnx.Param)

  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(16, 4)).astype(np.float32)
  spread = NamedSharding(mesh, P(("data", "fsdp", "model")))
  losses = []
  with jax.set_mesh(mesh):
    for _ in range(steps):
      x = rng.normal(size=(32, 16)).astype(np.float32)
      batch = jax.device_put({"x": x, "y": x @ teacher}, spread)
      losses.append(float(train_step(model, opt, batch)))
    sent = dl.collective_bytes_by_axis(
        train_step.lower(model, opt, batch).compile(), mesh)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {"losses": losses, "data_bits_per_param": 8 * sent["data"] / params,
          "kernel_spec": model.up.kernel.get_value().sharding.spec}


if __name__ == "__main__":
  out = main()
  print(f"loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}; "
        f"{out['data_bits_per_param']:.3f} bits/param/step across nodes "
        f"per device; up.kernel sharded {out['kernel_spec']}")
