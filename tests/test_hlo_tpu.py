"""The HLO reader on TPU multislice executables (2 slices of v5e 2x2),
compiled ahead of time by libtpu with no TPU: captured modules in
tests/data/tpu (``capture.py`` makes them), read without libtpu, and live
compiles where the [tpu-aot] extra is installed (marked ``tpu_aot``)."""

import gzip
import pathlib
import re
import sys
import types

import jax
import numpy as np
import pytest

from dlion_jax import hlo
import dlion_jax as dl
from messages import assert_names

DATA = pathlib.Path(__file__).parent / "data" / "tpu"
sys.path.insert(0, str(DATA))
import capture  # noqa: E402  pylint: disable=wrong-import-position

MODULES = [f"flat_{c}" for c in capture.COMMS] + ["hybrid"]


def text(name):
  with gzip.open(DATA / f"{name}.hlo.gz", "rt") as f:
    return f.read()


class _Chip:
  """What the reader reads of a TPU chip: its slice."""

  def __init__(self, slice_index):
    self.slice_index = slice_index


def tpu_mesh(shape, names):
  """A stand-in for a Mesh of 2 slices x 4 chips, slice major."""
  chips = np.array([_Chip(s) for s in range(2) for _ in range(4)])
  return types.SimpleNamespace(shape=dict(zip(names, shape)),
                               devices=chips.reshape(shape))


FLAT, HYBRID = ((8,), ("data",)), ((2, 4), ("data", "fsdp"))


@pytest.fixture(scope="module")
def cpu_bytes():
  """The same steps' bytes by axis on 8 XLA:CPU devices (and, under
  "modules", the flat steps' HLO)."""
  devices = np.array(jax.devices()[:8])
  out = {"modules": {}}
  for comm in capture.COMMS:
    mesh = jax.sharding.Mesh(devices, ("data",))
    tx = dl.distributed_lion(1e-3, axis_name="data", comm=comm)
    compiled = capture.compile_step(mesh, tx)
    out["modules"][f"flat_{comm}"] = compiled.as_text()
    out[f"flat_{comm}"] = dl.collective_bytes_by_axis(compiled, mesh)
  mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "fsdp"))
  out["hybrid"] = dl.collective_bytes_by_axis(capture.compile_step(
      mesh, dl.distributed_lion(1e-3, axis_name="data"), "fsdp"), mesh)
  return out


@pytest.mark.parametrize("name", MODULES)
def test_every_megascale_transfer_counts_once_and_the_splits_add_up(name):
  """Was: megascale sends were not read (only the in-slice pieces: 45,504
  of flat auto's 93,996 bytes) and collective_bytes_by_axis raised."""
  module = text(name)
  found = hlo.collectives(module)
  sends = re.findall(r" send\(.*is_host_transfer=true", module)
  dcn = [c for c in found if c.link == "dcn"]
  assert len(dcn) == len(sends) > 0
  assert all(c.sent_bytes > 0 for c in found)
  total = dl.collective_bytes(module)
  by_link = dl.collective_bytes_by_link(module)
  assert by_link["dcn"] > 0 and sum(by_link.values()) == total
  shape, names = HYBRID if name == "hybrid" else FLAT
  by_axis = dl.collective_bytes_by_axis(module, tpu_mesh(shape, names))
  assert sum(by_axis.values()) == total


def test_flat_allgather_sends_what_the_cpu_step_sends(cpu_bytes):
  """Its cross-slice gather is a megascale ALL_GATHER: the pieces add up
  to the same step's bytes on 8 XLA:CPU devices (within the loss pmean's
  padding to 128 floats on TPU)."""
  tpu = dl.collective_bytes(text("flat_allgather"))
  assert tpu == pytest.approx(cpu_bytes["flat_allgather"]["data"], rel=0.01)


def loss_and_optimizer_bytes(module):
  """(the loss pmean's bytes, the rest's): the pmean is the step's only
  all-reduce of at most 512 bytes (one float, which XLA:TPU moves as a row
  of 128 lanes)."""
  found = hlo.collectives(module)
  loss = sum(c.bytes_per_call for c in found
             if c.op == "all-reduce" and c.result_bytes <= 512)
  return loss, sum(c.bytes_per_call for c in found) - loss


@pytest.mark.parametrize("comm", ["auto", "alltoall"])
def test_flat_vote_sends_what_the_cpu_step_sends(cpu_bytes, comm):
  """The vote's results cross slices in a megascale all-gather (their rows
  padded to 128 lanes on TPU). Was 1.108x: XLA:TPU gathered the small,
  unaligned buffer by a DCN all-reduce of a zero-padded one. The optimizer
  sends within 2% of the CPU's (that padding); the step's loss pmean, 4
  bytes on CPU, moves 512 on TPU (1,280 bytes a step of 87,660)."""
  module = text(f"flat_{comm}")
  gathers = [c for c in hlo.collectives(module) if c.link == "dcn"
             and c.op == "all-gather"]
  assert len(gathers) == 1
  loss, optimizer = loss_and_optimizer_bytes(module)
  cpu_loss, cpu_optimizer = loss_and_optimizer_bytes(cpu_bytes["modules"][
      f"flat_{comm}"])
  # One row of 128 floats: a ring of 4 chips in a slice, then of 2 slices.
  assert 0 < cpu_loss < 8 and loss == 2 * 3 / 4 * 512 + 2 * 1 / 2 * 512
  assert cpu_optimizer <= optimizer <= 1.03 * cpu_optimizer
  cpu = cpu_bytes[f"flat_{comm}"]["data"]
  assert cpu <= dl.collective_bytes(module) <= 1.04 * cpu


def test_hybrid_vote_crosses_slices_as_on_cpu(cpu_bytes):
  """The hybrid step's vote is the one megascale all-gather, with the
  bytes the CPU step's vote sends over "data" (its other 4 bytes there:
  the loss mean, a 512-byte row on TPU); its in-slice traffic is under
  "fsdp", within 1% of the CPU's, and the gradients of the matrices cross
  in reduce-scatters, the updates in all-gathers."""
  module = text("hybrid")
  vote = [c for c in hlo.collectives(module)
          if c.link == "dcn" and c.op == "all-gather"]
  assert [c.bytes_per_call for c in vote] == [cpu_bytes["hybrid"]["data"]
                                              - 4]
  by_axis = dl.collective_bytes_by_axis(module, tpu_mesh(*HYBRID))
  assert by_axis["data"] == dl.collective_bytes_by_link(module)["dcn"]
  cpu = cpu_bytes["hybrid"]["fsdp"]
  assert cpu <= by_axis["fsdp"] <= 1.01 * cpu
  assert sorted(c.op for c in hlo.collectives(module)
                if c.sent_bytes > 10**5) == ["all-gather"] * 2 + [
                    "reduce-scatter"] * 2


def test_reduce_scatter_fusion_counts_as_a_reduce_scatter():
  """XLA:TPU prints a reduce-scatter of a [k, rows, 128] buffer inside a
  slice as a fusion whose computation holds an all-reduce of the buffer
  and a dynamic-slice; its emitter sends what a reduce-scatter of the
  fusion's result sends: the same program's reduce-scatter on XLA:CPU,
  but for the rows padded to whole (8, 128) tiles (1,648 -> 1,664). Was:
  the inner all-reduce, twice the bytes."""
  module = text("reduce_scatter")
  scatter = [c for c in hlo.collectives(module) if c.op == "reduce-scatter"]
  assert len(scatter) == 1 and scatter[0].instruction == "fusion"
  (c,) = scatter
  assert c.sent_bytes == (c.group_size - 1) * c.result_bytes
  assert "all-reduce-scatter" in module and not any(
      x.op == "all-reduce" for x in hlo.collectives(module))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4),
                           ("data", "fsdp"))
  (cpu,) = hlo.collectives(capture.scatter_buffer(mesh).as_text())
  assert cpu.op == "reduce-scatter"
  assert c.sent_bytes == cpu.sent_bytes * 1664 / 1648


def test_megascale_targets_are_read_as_groups():
  product = hlo.collectives(
      '  %s = (f32[16]{0}, u32[], token[]) send(%x, %t), '
      'is_host_transfer=true, frontend_attributes={_xla_megascale_target='
      '"{1,2,4}x{0:1,3}",_xla_megascale_transfer_type="ALL_GATHER"}\n')[0]
  assert product.replica_groups == ((100000, 200000, 400000),
                                    (100001, 200001, 400001),
                                    (100003, 200003, 400003))
  assert (product.op, product.result_bytes, product.sent_bytes) == (
      "all-gather", 3 * 64, 2 * 64)
  listed = hlo.collectives(
      '  %s = (u8[4,10]{1,0}, u32[], token[]) send(%x, %t), '
      'is_host_transfer=true, frontend_attributes={_xla_megascale_target='
      '{{100000,100001,200000,200001}},'
      '_xla_megascale_transfer_type="ALL_TO_ALL"}\n')
  assert listed[0].group_size == 4 and listed[0].sent_bytes == 30
  # Of its 3 peers, 2 are in the other slice: 2/3 over DCN, 1/3 inside.
  assert dl.collective_bytes_by_link("\n".join([
      '  %s = (u8[4,10]{1,0}, u32[], token[]) send(%x, %t), '
      'is_host_transfer=true, frontend_attributes={_xla_megascale_target='
      '{{100000,100001,200000,200001}},'
      '_xla_megascale_transfer_type="ALL_TO_ALL"}'])) == {"ici": 10.0,
                                                           "dcn": 20.0}


@pytest.mark.parametrize("dtype,bits", [
    ("f8e4m3fn", 8), ("f8e5m2", 8), ("f8e4m3b11fnuz", 8), ("f8e8m0fnu", 8),
    ("f4e2m1fn", 4), ("s4", 4), ("u4", 4), ("s2", 2), ("bf16", 16),
    ("f64", 64), ("pred", 8)])
def test_every_dtype_xla_prints_is_sized(dtype, bits):
  """Was: the small floats read as 0 bytes (f8e4m3fn did not match)."""
  found = hlo.collectives(
      f"  %a = {dtype}[1024]{{0:T(1024)}} all-gather(%x), "
      "replica_groups={{0,1}}, dimensions={0}\n")
  assert found[0].result_bytes == 1024 * bits // 8


def test_ragged_all_to_all_counts_its_output_buffer():
  found = hlo.collectives(
      "  %r = f32[8,16] ragged-all-to-all(%a, %b, %c, %d, %e, %f), "
      "replica_groups={{0,1,2,3}}\n")
  assert (found[0].op, found[0].sent_bytes) == ("all-to-all", 3 / 4 * 512)


@pytest.mark.parametrize("line,names", [
    ('  %s = (f32[8]{0}, u32[], token[]) send(%x, %t), is_host_transfer=true,'
     ' frontend_attributes={_xla_host_transfer_handler_name="callback"}\n',
     ["%s", "host transfer", "'callback'", "ALL_REDUCE"]),
    ('  %s = (f32[8]{0}, u32[], token[]) send(%x, %t), is_host_transfer=true,'
     ' frontend_attributes={_xla_megascale_target="{1,2}x{0:3}",'
     '_xla_megascale_transfer_type="REDUCE_SCATTER"}\n',
     ["%s", "'REDUCE_SCATTER'"]),
    ("  %c = f32[8] all-reduce-scatter(%x), replica_groups={{0,1}}\n",
     ["%c", "'all-reduce-scatter'", "by hand"]),
])
def test_unknown_transfers_and_opcodes_are_refused(line, names):
  """Never read as 0 bytes."""
  with pytest.raises(ValueError) as e:
    dl.collective_bytes(line)
  assert_names(e, *names)


def test_by_axis_needs_the_chips_mesh_for_a_multislice_module():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  with pytest.raises(ValueError) as e:
    dl.collective_bytes_by_axis(text("flat_auto"), mesh)
  assert_names(e, "%send", "megascale", "slice_index", "num_slices=2")


@pytest.mark.tpu_aot
@pytest.mark.parametrize("name", ["flat_auto", "hybrid"])
def test_live_compiles_read_like_the_captured_modules(name):
  """The captured modules are what libtpu compiles now (run capture.py
  after a libtpu upgrade if this fails), read with the real chips' mesh."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  chips = capture.devices()
  if name == "hybrid":
    mesh = jax.sharding.Mesh(np.array(chips).reshape(2, 4), ("data", "fsdp"))
    compiled = capture.compile_step(
        mesh, dl.distributed_lion(1e-3, axis_name="data"), "fsdp")
  else:
    mesh = jax.sharding.Mesh(np.array(chips), ("data",))
    compiled = capture.compile_step(
        mesh, dl.distributed_lion(1e-3, axis_name="data"))
  assert dl.collective_bytes_by_axis(compiled, mesh) == (
      dl.collective_bytes_by_axis(text(name), tpu_mesh(
          *(HYBRID if name == "hybrid" else FLAT))))
  assert compiled.memory_analysis().temp_size_in_bytes > 0
