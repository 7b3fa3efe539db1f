"""Compiled (never run) distributed Lion updates and shard_maps on abstract
inputs, for the tests that read what a compiled program sends."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl

AXIS = "data"
# Odd leaf sizes, about 1e5 parameters: no strategy's packing unit divides d.
SHAPES = {"w": (101, 997), "b": (997,), "s": (7,)}
SIZES = [math.prod(s) for s in SHAPES.values()]


def compile_update(num_workers, *, aggregation, vote, comm):
  """Compiled shard_map of one distributed Lion update (never run)."""
  mesh = devices.data_mesh(num_workers, axis_name=AXIS)
  tx = dl.scale_by_distributed_lion(axis_name=AXIS, aggregation=aggregation,
                                    vote=vote, comm=comm)

  def local(grads, mu):
    state = dl.DistributedLionState(jnp.zeros([], jnp.int32), mu)
    return tx.update(grads, state)[0]

  # A size-1 axis has no vote, so nothing marks D as replicated.
  fn = jax.jit(parallel.per_worker(local, mesh, axis_name=AXIS,
                                   ins=("stacked", "stacked"),
                                   outs="replicated",
                                   check_vma=num_workers > 1))
  arg = {k: jax.ShapeDtypeStruct((num_workers,) + s, jnp.float32)
         for k, s in SHAPES.items()}
  return fn.lower(arg, arg).compile()


def compile_on_mesh(fn, mesh, in_spec, *shapes, out_specs=P(AXIS)):
  """Compiled ``shard_map(fn)`` on abstract float32 inputs of ``shapes``."""
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_specs,
                         check_vma=False)
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  return jax.jit(mapped).lower(*args).compile()
