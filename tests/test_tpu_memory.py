"""The vote's HBM on TPU, compiled ahead of time by libtpu (no TPU needed).

XLA:TPU tiles the two minor dimensions of an array by (8, 128): a digit
array of minor dimension m (5, 8 or 10 digits a word), what unpacking the
interleaved order builds, takes 128 lanes a row. The message is packed
planar, and these tests fail if a step goes back to such an array.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import parallel
import dlion_jax as dl

pytestmark = pytest.mark.tpu_aot

# 9.4M params: above what XLA:TPU keeps in VMEM, so temporaries show.
SHAPES = {"w": (2048, 4096), "v": (1 << 20,), "b": (1000,)}


def update_step_memory(tx, mean_gradients=False):
  """HBM temporaries a parameter of the optimizer step alone, flat over
  2 slices of v5e 2x2."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  chips = topologies.get_topology_desc("v5e:2x2", "tpu", num_slices=2).devices
  mesh = jax.sharding.Mesh(np.array(chips), ("data",))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rep)
            for k, s in SHAPES.items()}
  state = jax.eval_shape(
      lambda p: parallel.init_worker_states(tx, p, mesh), params)
  def per_worker(tree, lead=()):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        lead + x.shape, x.dtype, sharding=split), tree)
  state, grads = per_worker(state), per_worker(params, (8,))

  def update(g, s, p):
    g, s = jax.tree.map(lambda x: x[0], (g, s))
    if mean_gradients:
      g = lax.pmean(g, "data")
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), jax.tree.map(lambda x: x[None], s)

  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(
      P("data"), P("data"), P()), out_specs=(P(), P("data")), check_vma=False))
  compiled = step.lower(grads, state, params).compile()
  size = sum(int(np.prod(s)) for s in SHAPES.values())
  return compiled.memory_analysis().temp_size_in_bytes / size


@pytest.fixture(scope="module")
def lion_temporaries():
  return update_step_memory(optax.lion(1e-3), mean_gradients=True)


@pytest.mark.parametrize("comm", [
    "psum", pytest.param("alltoall", marks=pytest.mark.slow),
    pytest.param("allgather", marks=pytest.mark.slow)])
def test_vote_temporaries_stay_near_optax_lions(comm, lion_temporaries):
  """Was 102, 68 and 51 bytes a parameter against optax.lion's 1.2 (the
  interleaved digits unpacked as f32[W, m], padded to 128 lanes): a 1B
  model's flat step needed 108 GB of HBM on v5e. Planar runs: 0.7-1.1."""
  temporaries = update_step_memory(
      dl.distributed_lion(1e-3, axis_name="data", comm=comm))
  assert temporaries < 1.5 * lion_temporaries


def _f32_relayouts(hlo_text: str, min_elements: int) -> set:
  """The float32 reshapes and copies of at least ``min_elements`` in the
  entry computation: on TPU each is a pass over that array (arrays are
  laid out in tiles, so flattening or unflattening one is a copy). The
  asynchronous copies between memory spaces (``copy-start``) are not
  counted."""
  entry = hlo_text.split("\nENTRY", 1)[1]
  found = set()
  for dims, kind in re.findall(
      r"= f32\[([\d,]*)\]\S* (copy|reshape)\(%", entry):
    if np.prod([int(d) for d in dims.split(",") if d]) >= min_elements:
      found.add((kind, dims))
  return found


def _large_step_hlo(tx) -> str:
  """The HLO of ``bench.step``'s step on its ``large`` tree
  (a 4096x8192 matrix and a 16M vector) for 8 v5e chips."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  from dlion_jax.bench import aot  # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import step as step_bench  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(aot.tpu_devices("v5e:2x4", 1)),
                           (step_bench.AXIS,))
  return step_bench.tpu_compiled(tx, mesh, step_bench.TREES["large"]).as_text()


@pytest.mark.parametrize("aggregation", [
    "mavo", pytest.param("avg", marks=pytest.mark.slow)])
def test_update_reaches_the_leaf_narrow(aggregation):
  """The vote's outcome is reshaped to the leaf's shape as int8 and only
  then turned into the leaf's float: XLA:TPU had relaid out a float32 D
  (with the other changes of that commit, MaVo ``auto`` went from 88 to 65
  bytes a parameter, Avg from 174 to 67:
  ``python -m dlion_jax.bench.step --tpu v5e:2x4 --tree large``)."""
  texts = {"floor": _large_step_hlo(optax.lion(1e-3)),
           "dlion": _large_step_hlo(dl.distributed_lion(
               1e-3, axis_name="data", aggregation=aggregation))}
  leaf = 1 << 24
  extra = _f32_relayouts(texts["dlion"], leaf) - _f32_relayouts(
      texts["floor"], leaf)
  assert not extra, extra


def test_tallies_come_back_in_rows():
  """The alltoall's gathered results reach the unpacking as rows, one a
  place and worker: the same step had cut them out of a flat gathered
  buffer with 40 dynamic-update-slices (and moved 65 bytes a parameter,
  now 60: ``python -m dlion_jax.bench.step --tpu v5e:2x4 --tree large``)."""
  entry = _large_step_hlo(dl.distributed_lion(
      1e-3, axis_name="data", comm="alltoall")).split("\nENTRY", 1)[1]
  assert not re.findall(r"= u8\[[\d,]*\]\S* dynamic-update-slice\(", entry)
