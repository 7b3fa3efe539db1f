"""Regenerates the TPU executables' HLO the reader's tests read.

Compiles the small MLP's training step for 2 slices of v5e 2x2 with libtpu
(``pip install "dlion_jax[tpu-aot]"``; no TPU needed) and writes each
module's text, gzipped, beside this file:

* ``flat_<comm>.hlo.gz``: the flat step over the 8 chips, each ``comm``;
* ``hybrid.hlo.gz``: the hybrid step, ``data`` = 2 slices x ``fsdp`` = 4;
* ``reduce_scatter.hlo.gz``: a ``psum_scatter`` of a ``[4, 1648, 128]``
  buffer inside each slice, which XLA:TPU prints as a fusion calling
  ``all-reduce-scatter`` (:func:`scatter_buffer`).

Run: ``JAX_PLATFORMS=cpu python tests/data/tpu/capture.py``.
"""

import gzip
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dlion_jax as dl  # noqa: E402
from dlion_jax import parallel  # noqa: E402

HERE = pathlib.Path(__file__).parent
SHAPES = {"w1": (512, 384), "b1": (384,), "w2": (384, 256), "b2": (256,),
          "w3": (256, 10)}
COMMS = ("auto", "alltoall", "allgather", "psum", "psum_int8")


def loss_fn(p, batch):
  h = jax.nn.relu(batch @ p["w1"] + p["b1"])
  h = jax.nn.relu(h @ p["w2"] + p["b2"])
  return jnp.mean((h @ p["w3"]) ** 2)


def compile_step(mesh, tx, shard_axis=None):
  """The step's executable on ``mesh``, from abstract arguments."""
  workers = ("data",) if shard_axis is None else ("data", shard_axis)
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(workers))
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rep)
            for k, s in SHAPES.items()}
  state = jax.eval_shape(
      lambda p: parallel.init_worker_states(tx, p, mesh,
                                            shard_axis=shard_axis), params)
  shardings = parallel.state_shardings(tx, state, params, mesh,
                                       shard_axis=shard_axis)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), state, shardings)
  batch = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=split)
  step = parallel.make_train_step(loss_fn, tx, mesh, shard_axis=shard_axis)
  return step.lower(params, state, batch).compile()


def scatter_buffer(mesh):
  """A reduce-scatter of a tiled ``[k, rows, 128]`` f32 buffer over
  ``fsdp``, compiled."""
  scatter = jax.shard_map(
      lambda x: jax.lax.psum_scatter(x, "fsdp", scatter_dimension=0,
                                     tiled=True),
      mesh=mesh, in_specs=P("data"), out_specs=P("data", "fsdp"))
  buffer = jax.ShapeDtypeStruct((8, 1648, 128), jnp.float32,
                                sharding=NamedSharding(mesh, P("data")))
  return jax.jit(scatter).lower(buffer).compile()


def devices(slices=2):
  return topologies.get_topology_desc("v5e:2x2", "tpu",
                                      num_slices=slices).devices


def main():
  chips = devices()
  flat = jax.sharding.Mesh(np.array(chips), ("data",))
  for comm in COMMS:
    tx = dl.distributed_lion(1e-3, axis_name="data", comm=comm)
    write(f"flat_{comm}", compile_step(flat, tx))
  hybrid = jax.sharding.Mesh(np.array(chips).reshape(2, 4), ("data", "fsdp"))
  tx = dl.distributed_lion(1e-3, axis_name="data")
  write("hybrid", compile_step(hybrid, tx, "fsdp"))
  write("reduce_scatter", scatter_buffer(hybrid))


def write(name, compiled):
  with gzip.open(HERE / f"{name}.hlo.gz", "wt") as f:
    f.write(compiled.as_text())
  print(name, (HERE / f"{name}.hlo.gz").stat().st_size, "bytes gzipped")


if __name__ == "__main__":
  main()
