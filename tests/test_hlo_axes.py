"""collective_bytes_by_axis: each collective's bytes under the mesh axes its
replica groups cross (hlo.py), on compiled hybrid and flat steps and on
handwritten HLO in XLA's three printed forms of replica groups."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import hlo
from dlion_jax import parallel
import dlion_jax as dl

# Leaf sizes 3, 37, 35: none a multiple of 8, 4 or 2.
SHAPES = {"b": (3,), "big": (37,), "w": (5, 7)}
SIZES = tuple(int(np.prod(s)) for s in SHAPES.values())
F32 = 4


def linear_loss(params, batch):
  return sum(jnp.sum(params[k] * batch[k]) for k in params)


def compile_step(mesh, shapes, shard_axis=None, dtype=np.float32, **options):
  """The compiled D-Lion step on ``mesh``, voting over "data"."""
  workers = mesh.size
  params = devices.replicate(
      {k: np.ones(s, dtype) for k, s in shapes.items()}, mesh)
  tx = dl.distributed_lion(1e-2, axis_name="data", **options)
  state = parallel.init_worker_states(tx, params, mesh, shard_axis=shard_axis)
  step = parallel.make_train_step(linear_loss, tx, mesh, shard_axis=shard_axis,
                                  donate=False)
  batch = jax.device_put(
      {k: np.ones((workers,) + s, dtype) for k, s in shapes.items()},
      NamedSharding(mesh, P(tuple(mesh.axis_names))))
  return step.lower(params, state, batch).compile()


def hybrid(nodes, per_node, order=None, **options):
  order = jax.devices()[:nodes * per_node] if order is None else order
  mesh = devices.hybrid_mesh(nodes, devices=order)
  return compile_step(mesh, SHAPES, shard_axis="fsdp", **options), mesh


def pmean_bytes(n):
  """A float32 scalar's all-reduce over n devices (the loss pmean)."""
  return 2 * (n - 1) / n * F32


def flat_vote_bytes(nodes, leaf_sizes, **options):
  """What the flat ``nodes``-worker D-Lion step on leaves of ``leaf_sizes``
  sends, less its loss pmean: its vote."""
  mesh = devices.data_mesh(nodes)
  shapes = {f"l{i}": (s,) for i, s in enumerate(leaf_sizes)}
  return dl.collective_bytes(compile_step(mesh, shapes, **options)) - (
      pmean_bytes(nodes))


# --- hybrid steps -------------------------------------------------------------


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (4, 2)])
@pytest.mark.parametrize("comm", ["auto", "alltoall", "allgather", "psum"])
def test_hybrid_step_splits_vote_and_shard_traffic(nodes, per_node, comm):
  shapes = dict(SHAPES, m=(8, 6))    # "m": cut over k = 2 or 4 devices
  mesh = devices.hybrid_mesh(nodes, devices=jax.devices()[:nodes * per_node])
  compiled = compile_step(mesh, shapes, shard_axis="fsdp", comm=comm)
  by_axis = dl.collective_bytes_by_axis(compiled, mesh)
  k = per_node
  blocks = tuple(-(-n // k) for n in SIZES) + (48 // k,)
  # over the slow axis: the vote on one device's blocks, and the loss mean
  assert by_axis["data"] == flat_vote_bytes(nodes, blocks, comm=comm) + (
      pmean_bytes(nodes))
  if comm != "auto":
    assert by_axis["data"] == message.message_bytes(
        blocks, nodes, comm=comm) + pmean_bytes(nodes)
  # over the fast axis, float32: "m"'s gradient reduce-scattered ((k-1) x
  # its block) and its update all-gathered ((k-1)/k of it); the others'
  # all-reduced (2 (k-1)/k) and their votes' chunks gathered ((k-1) x a
  # chunk); the loss mean
  cut = (k - 1) * 48 / k * F32 + (k - 1) / k * 48 * F32
  whole = sum(2 * (k - 1) / k * n * F32 + (k - 1) * c * F32
              for n, c in zip(SIZES, blocks))
  assert by_axis["fsdp"] == cut + whole + pmean_bytes(k)
  assert set(by_axis) == {"data", "fsdp"}
  assert sum(by_axis.values()) == dl.collective_bytes(compiled)


def test_ids_are_positions_in_the_mesh_not_device_ids():
  """jit numbers devices by their place in mesh.devices.flat: a mesh of
  shuffled devices compiles to the same groups and the same split."""
  shuffled = [jax.devices()[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
  compiled, mesh = hybrid(2, 4, order=shuffled)
  plain, plain_mesh = hybrid(2, 4)
  groups = [c.replica_groups for c in hlo.collectives(compiled.as_text())]
  assert groups == [c.replica_groups
                    for c in hlo.collectives(plain.as_text())]
  assert (dl.collective_bytes_by_axis(compiled, mesh)
          == dl.collective_bytes_by_axis(plain, plain_mesh))


def test_flat_mesh_puts_everything_under_data():
  mesh = devices.data_mesh(8)
  compiled = compile_step(mesh, SHAPES)
  by_axis = dl.collective_bytes_by_axis(compiled, mesh)
  assert list(by_axis) == ["data"]
  assert by_axis["data"] == dl.collective_bytes(compiled) > 0


def test_conditional_false_leaves_out_momentum_syncs():
  compiled, mesh = hybrid(2, 4, momentum_sync=2)
  for conditional in (True, False):
    by_axis = dl.collective_bytes_by_axis(compiled, mesh,
                                          conditional=conditional)
    assert sum(by_axis.values()) == dl.collective_bytes(
        compiled, conditional=conditional)
  synced = dl.collective_bytes_by_axis(compiled, mesh)
  plain = dl.collective_bytes_by_axis(compiled, mesh, conditional=False)
  # the sync averages each device's chunk of each momentum over the nodes;
  # these leaves no k divides are whole on every device of a node, so the
  # chunks are gathered back over the fast axis
  assert synced["data"] > plain["data"]
  assert synced["fsdp"] - plain["fsdp"] == sum(3 * -(-n // 4) * F32
                                               for n in SIZES)


def test_ppermute_goes_under_the_axis_it_shifts_along():
  mesh = devices.hybrid_mesh(2, devices=jax.devices())
  shift = jax.shard_map(
      lambda x: jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]), mesh=mesh,
      in_specs=P("data", "fsdp"), out_specs=P("data", "fsdp"))
  compiled = jax.jit(shift).lower(jnp.ones((2, 4 * 16))).compile()
  assert dl.collective_bytes_by_axis(compiled, mesh) == {
      "data": 16 * F32, "fsdp": 0.0}


# --- XLA's printed forms of replica groups -----------------------------------

MESH_2x4 = AbstractMesh((2, 4), ("data", "fsdp"))
ROWS = ((0, 1, 2, 3), (4, 5, 6, 7))       # "fsdp" groups of a (2, 4) mesh
COLUMNS = ((0, 4), (1, 5), (2, 6), (3, 7))  # "data" groups


def module(*groups):
  """A module of one f32[8] all-reduce per ``replica_groups=`` text."""
  return "HloModule m, num_partitions=8\n" + "".join(
      f"  %ar.{i} = f32[8]{{0}} all-reduce(%p), channel_id={i + 1}, "
      f"replica_groups={g}, use_global_device_ids=true, to_apply=%add\n"
      for i, g in enumerate(groups))


@pytest.mark.parametrize("text,groups", [
    ("{{0,1,2,3},{4,5,6,7}}", ROWS),
    ("{{0,4},{1,5},{2,6},{3,7}}", COLUMNS),
    ("{}", None),
    ("[2,4]<=[8]", ROWS),
    ("[4,2]<=[2,4]T(1,0)", COLUMNS),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ROWS),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", COLUMNS),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     ROWS),
    ("mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    # a device order iota cannot write: a list (our reading of XLA's
    # printer; jit numbers devices in mesh order, so jax prints iotas)
    ("mesh['a'=2,'b'=2], device_ids=(0,3,1,2) {'a'}", ((0, 1), (3, 2))),
])
def test_replica_group_forms(text, groups):
  (c,) = hlo.collectives(module(text))
  assert c.replica_groups == groups
  assert c.group_size == (len(groups[0]) if groups else 8)


def test_gspmd_mesh_form_group_sizes():
  """Auto-partitioned jit prints mesh-axes groups; their size, not the
  module's device count, sets the bytes."""
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  x = jax.device_put(np.ones((8, 16), np.float32),
                     NamedSharding(mesh, P("a", "b")))
  compiled = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(
      mesh, P())).lower(x).compile()
  assert "replica_groups=mesh[" in compiled.as_text()
  by_axis = dl.collective_bytes_by_axis(compiled, mesh)
  # all-reduce of the [4] column sums over "a", all-gather of [16] over "b"
  assert by_axis == {"a": 2 * 1 / 2 * 4 * F32, "b": 3 / 4 * 16 * F32}
  assert sum(by_axis.values()) == dl.collective_bytes(compiled)


def test_handwritten_keys():
  text = module("{{0,4},{1,5},{2,6},{3,7}}", "[2,4]<=[8]", "{}",
                "{{0},{1},{2},{3},{4},{5},{6},{7}}")
  assert dl.collective_bytes_by_axis(text, MESH_2x4) == {
      "data": 32.0, "fsdp": 48.0, ("data", "fsdp"): 2 * 7 / 8 * 32, (): 0.0}
  # the same groups on a (4, 2) mesh of the same devices: axes swap
  mesh = AbstractMesh((4, 2), ("data", "fsdp"))
  assert dl.collective_bytes_by_axis(module("{{0,2,4,6},{1,3,5,7}}"),
                                     mesh) == {"data": 48.0, "fsdp": 0.0}


# --- groups that cross no whole axis -----------------------------------------


@pytest.mark.parametrize("groups,mesh,why", [
    # halves of each "fsdp" row: part of an axis
    ("{{0,1},{2,3},{4,5},{6,7}}", MESH_2x4, "not the groups of any axes"),
    # a (2, 4) module's "fsdp" rows read on a (4, 2) mesh
    ("{{0,1,2,3},{4,5,6,7}}", AbstractMesh((4, 2), ("data", "fsdp")),
     "not the groups of any axes"),
    # 8 devices, a mesh of 4
    ("[2,4]<=[8]", AbstractMesh((4,), ("data",)), "do not split the 4"),
    ("{}", AbstractMesh((2, 2), ("data", "fsdp")), "do not split the 4"),
    # groups of unequal size
    ("{{0,1,2},{3,4,5,6,7}}", MESH_2x4, "do not split the 8"),
])
def test_unmatched_groups_are_refused(groups, mesh, why):
  with pytest.raises(ValueError, match=why) as error:
    dl.collective_bytes_by_axis(module(groups), mesh)
  message_ = str(error.value)
  assert "%ar.0 (all-reduce)" in message_ and "mesh={" in message_
  assert "Pass the mesh the function was compiled on" in message_


@pytest.mark.parametrize("mesh", ["data", ("data", "fsdp"), np.zeros((2, 4))])
def test_mesh_must_be_a_mesh(mesh):
  with pytest.raises(TypeError, match="mesh=.* is not a jax.sharding.Mesh"):
    dl.collective_bytes_by_axis(module("[2,4]<=[8]"), mesh)


def test_docstring_example():
  result = doctest.testmod(hlo, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_exported():
  assert dl.collective_bytes_by_axis is hlo.collective_bytes_by_axis
  assert "collective_bytes_by_axis" in dl.__all__
