"""bucket_bytes: the vote in buckets of leaves, each exchanged on its own.

Every bucketing gives the update of the one message bit for bit, for every
strategy, aggregation and vote; each bucket sends exactly the message of
its own leaves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import hlo
from dlion_jax import parallel
import dlion_jax as dl
from tiers import slow_but

# Leaves a word's digits do not divide, one under OWN_PACKING (packed with
# the other small ones), a bf16 one; 4 bytes a parameter but "e".
SHAPES = {"a": (37, 11), "b": (1001,), "c": (5,), "d": (3000,), "e": (70,)}
BUDGETS = [1, 4_000, 13_000]       # every leaf alone; some together


def tree(seed=0):
  rng = np.random.default_rng(seed)
  out = {k: rng.standard_normal(s).astype(np.float32)
         for k, s in SHAPES.items()}
  out["e"] = out["e"].astype(jnp.bfloat16)
  return out


def loss(params, batch):
  return sum(jnp.sum(params[k].astype(jnp.float32) * batch[k].mean(0))
             for k in params)


def train(mesh, steps=3, params=None, **options):
  """Params after ``steps`` steps, and the compiled step."""
  tx = dl.distributed_lion(1e-2, axis_name="data", **options)
  params = devices.replicate(tree() if params is None else params, mesh)
  state = parallel.init_worker_states(tx, params, mesh)
  step = parallel.make_train_step(loss, tx, mesh, donate=False)
  rng = np.random.default_rng(1)
  rows = 2 * mesh.shape["data"]
  batch = devices.shard_batch({k: rng.standard_normal(
      (rows,) + np.shape(v)).astype(np.float32) for k, v in params.items()},
                               mesh)
  compiled = step.lower(params, state, batch).compile()
  for _ in range(steps):
    params, state, _ = step(params, state, batch)
  return jax.device_get(params), compiled


def assert_same(got, want):
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k], np.float32),
                                  np.asarray(want[k], np.float32), err_msg=k)


CASES = [(8, {"comm": c}) for c in ("auto",) + message.COMMS] + [
    (3, {"comm": "alltoall", "aggregation": "avg"}),
    (3, {"comm": "psum", "aggregation": "avg"}),
    (3, {"comm": "psum", "vote": "ternary"}),
    (8, {"quantizer": "pbit_l1", "bits": 3}),
    (5, {"error_feedback": True}),
    (8, {"min_compress_size": 100}),
]


@pytest.mark.parametrize("n,options", slow_but(CASES, 0, 5, 9), ids=str)
def test_buckets_give_the_one_message_update_bit_for_bit(n, options):
  mesh = devices.data_mesh(n)
  want, _ = train(mesh, **options)
  for budget in BUDGETS:
    got, _ = train(mesh, bucket_bytes=budget, **options)
    assert_same(got, want)


def test_a_sharded_step_in_buckets_equals_one_message():
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
                       axis_types=(AxisType.Explicit,) * 2)
  params = {"w": np.arange(96, dtype=np.float32).reshape(8, 12) / 50,
            "v": np.linspace(-1, 1, 40, dtype=np.float32)}
  outs = []
  for budget in (None, 1):
    tx = dl.distributed_lion(1e-2, axis_name="data", bucket_bytes=budget)
    p = devices.shard_params(params, mesh)
    state = parallel.init_worker_states(tx, p, mesh, shard_axis="fsdp")
    step = parallel.make_train_step(loss, tx, mesh, shard_axis="fsdp",
                                    donate=False)
    batch = devices.shard_batch(
        {k: np.ones((8,) + v.shape, np.float32) * np.arange(8).reshape(
            (8,) + (1,) * v.ndim) for k, v in params.items()}, mesh,
        axis_name=("data", "fsdp"))
    for _ in range(2):
      p, state, _ = step(p, state, batch)
    outs.append(jax.device_get(p))
  assert_same(outs[1], outs[0])


@pytest.mark.parametrize("comm", slow_but(message.COMMS, 0, 2))
def test_each_bucket_sends_the_message_of_its_own_leaves(comm):
  """With every leaf its own bucket, the step sends what the steps of each
  leaf alone send, added up: per-bucket padding and nothing more; and one
  exchange a bucket (as many collectives as for one leaf, times the
  buckets)."""
  mesh = devices.data_mesh(8)
  _, whole = train(mesh, steps=0, comm=comm)
  _, bucketed = train(mesh, steps=0, comm=comm, bucket_bytes=1)
  alone = [train(mesh, steps=0, comm=comm, params={k: v})[1]
           for k, v in tree().items()]
  # Each step also all-reduces its 4-byte loss: 2 (N - 1) / N * 4 bytes
  # (XLA may combine it with a psum of votes, so it is not told apart).
  loss_bytes = 2 * 7 / 8 * 4
  sent = lambda compiled: hlo.collective_bytes(compiled) - loss_bytes
  assert sent(bucketed) == sum(sent(c) for c in alone)
  assert sent(bucketed) >= sent(whole)
  if comm in ("alltoall", "allgather"):    # XLA combines all-reduces
    gathers = lambda compiled: sum(
        c.op != "all-reduce" for c in hlo.collectives(compiled))
    assert gathers(bucketed) == sum(gathers(c) for c in alone) > gathers(
        whole)


def test_buckets_are_taken_from_the_last_leaf_back():
  nbytes = [40, 30, 30, 50, 10]
  assert message.buckets([0, 1, 2, 3, 4], nbytes, None) == [[0, 1, 2, 3, 4]]
  assert message.buckets([0, 1, 2, 3, 4], nbytes, 60) == [
      [3, 4], [1, 2], [0]]
  assert message.buckets([0, 1, 2, 3, 4], nbytes, 1) == [
      [4], [3], [2], [1], [0]]
  assert message.buckets([1, 3], nbytes, 1000) == [[1, 3]]


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "1MB"])
def test_bad_bucket_bytes_are_named(bad):
  with pytest.raises((ValueError, TypeError)) as e:
    dl.distributed_lion(1e-3, axis_name="data", bucket_bytes=bad)
  assert "bucket_bytes" in str(e.value) and repr(bad) in str(e.value)
