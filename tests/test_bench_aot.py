"""bench.aot: training steps compiled for TPU topologies by libtpu, no TPU:
bytes over ICI and DCN, HBM per chip, and the overlap of each async
exchange with compute in the scheduled ENTRY computation."""

import json
import re

import pytest

from dlion_jax.bench import aot
from dlion_jax.bench import aot_models

# A scheduled ENTRY computation, handwritten in the compiled TPU form: a DCN
# send/recv pair around a convolution fusion, a while whose body holds a dot,
# an ICI all-gather-start, and copy-start/-done (memory, not an exchange).
HLO = """\
HloModule m, entry_computation_layout={()->f32[8]}

%fused_conv (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,8]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%fused_add (p0.1: f32[8]) -> f32[8] {
  %p0.1 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%p0.1, %p0.1)
}

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %g = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %dot.3 = f32[8,8]{1,0} dot(%g, %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%i, %dot.3)
}

ENTRY %main (a: f32[8,8], b: f32[8]) -> f32[8] {
  %a = f32[8,8]{1,0:T(8,128)} parameter(0)
  %b = f32[8]{0:T(128)} parameter(1)
  %after-all = token[] after-all()
  %send = (f32[8]{0}, u32[], token[]) send(%b, %after-all), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[8]{0}, u32[], token[]) recv(%after-all), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}
  %copy-start = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%b)
  %fusion.1 = f32[8,8]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_conv, backend_config={"estimated_cycles":"100"}
  %send-done = token[] send-done(%send), channel_id=1, is_host_transfer=true
  %fusion.2 = f32[8]{0} fusion(%b), kind=kLoop, calls=%fused_add, backend_config={"estimated_cycles":"7"}
  %copy-done = f32[8]{0} copy-done(%copy-start)
  %recv-done = (f32[8]{0}, token[]) recv-done(%recv), channel_id=2, is_host_transfer=true
  %all-gather-start = (f32[8]{0}, f32[32]{0}) all-gather-start(%fusion.2), replica_groups={{0,1,2,3}}, dimensions={0}
  %tup = (s32[], f32[8,8]{1,0}) tuple(%b, %a)
  %while.1 = (s32[], f32[8,8]{1,0}) while(%tup), condition=%cond, body=%body
  %all-gather-done = f32[32]{0} all-gather-done(%all-gather-start)
  ROOT %out = f32[8]{0} get-tuple-element(%recv-done), index=0
}
"""  # noqa: E501  (HLO lines quoted whole)


def test_async_pairs_lists_each_exchange_and_the_compute_between():
  pairs = {p.start: p for p in aot.async_pairs(HLO)}
  assert set(pairs) == {"send", "recv", "all-gather-start"}   # no copies
  send, recv, gather = pairs["send"], pairs["recv"], pairs["all-gather-start"]
  assert (send.link, send.transfer, send.done) == ("dcn", "ALL_REDUCE",
                                                   "send-done")
  assert send.between == 3 and send.compute == ["fusion.1"]
  assert send.cycles == 100 and send.overlapped
  assert recv.between == 5
  assert recv.fusions == ["fusion.1", "fusion.2"]
  assert recv.compute == ["fusion.1"] and recv.cycles == 107
  assert (gather.link, gather.done) == ("ici", "all-gather-done")
  assert gather.compute == ["while.1"]          # the loop's body has a dot
  assert aot.overlap_summary(list(pairs.values()), "dcn") == "2/2"
  assert aot.overlap_summary(list(pairs.values()), "ici") == "1/1"


def test_async_pairs_refuses_text_without_an_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    aot.async_pairs("%x = f32[] constant(0)\n")


def test_analytic_bits_follow_the_cost_model():
  import dlion_jax as dl  # pylint: disable=g-import-not-at-top
  flat = aot.analytic_bits(aot.variant("dlion-alltoall"), 2, 8)
  assert flat == dl.wire_bits(8, comm="alltoall")
  hybrid = aot.analytic_bits(aot.variant("hybrid-dlion"), 2, 8)
  assert hybrid == dl.wire_bits(2) / 4           # 1/4 of the params each
  assert aot.analytic_bits(aot.variant("adamw"), 2, 8) == 56.0
  for layout in aot.LAYOUTS:
    v = aot.variant(f"{layout}-dlion")
    assert v.layout == layout and v.hybrid and v.comm == "auto"
    assert aot.analytic_bits(v, 2, 8) == hybrid
  assert aot.variant("zero3-adamw").comm is None
  assert aot.variant("dlion-psum").layout == "flat"


# ------------------------------------------------ compiled for v5e 2x2 x 2


@pytest.fixture(scope="module")
def compiled_rows():
  """The small MLP's flat D-Lion (auto), hybrid and ZeRO-3 steps, compiled
  for two v5e 2x2 slices: {variant: (row, HLO text)}."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra (libtpu)")
  why = aot.libtpu_available()
  if why:
    pytest.skip(f"libtpu cannot compile for TPU topologies here: {why}")
  problem = aot_models.mlp_problem()
  rows = {name: aot.compile_step(problem, "v5e:2x2", 2, name)
          for name in ("dlion-auto", "hybrid-dlion", "zero3-dlion")}
  rows["zero3-dlion" + aot.PLAIN] = aot.compile_step(
      problem, "v5e:2x2", 2, "zero3-dlion", plain=True)
  rows["dlion-auto" + aot.XLA] = aot.compile_step(
      problem, "v5e:2x2", 2, "dlion-auto", kernels="xla")
  return rows


@pytest.mark.tpu_aot
def test_rows_read_the_bytes_a_step_moves_with_and_without_the_kernels(
    compiled_rows):
  """Each row's bytes accessed a parameter (cost analysis), in its table
  cell; 'auto' takes the fused kernels for the MLP's 512x384 matrix (8
  planes of 64 rows), the '(XLA)' row does not."""
  (fused_row, fused_text), (xla_row, xla_text) = (
      compiled_rows["dlion-auto"], compiled_rows["dlion-auto" + aot.XLA])
  assert xla_row.variant == "dlion-auto (XLA)"
  assert "tpu_custom_call" in fused_text
  assert "tpu_custom_call" not in xla_text
  for row in (fused_row, xla_row):
    # At least the params read and written and the gradients read.
    assert row.bytes_accessed > 3 * 4 * row.params
    cell = aot.table_row(row)[aot.HEADERS.index("bytes accessed/param")]
    assert float(cell) == pytest.approx(row.bytes_accessed / row.params,
                                        abs=0.05)
  assert fused_row.bytes_accessed != xla_row.bytes_accessed


@pytest.mark.tpu_aot
def test_memory_is_positive_and_bounded(compiled_rows):
  params_bytes = 4 * aot_models.mlp_problem().count
  for name, (row, _) in compiled_rows.items():
    assert row.error is None, row.error
    # Replicated params plus this chip's momentum (whole or a quarter) and
    # its batch: at least the params, under three copies of them (ZeRO-3:
    # a quarter of the params at least).
    least = params_bytes / 4 if name.startswith("zero3") else params_bytes
    assert least <= row.argument_bytes < 3 * params_bytes
    assert 0 < row.temp_bytes < 64 * 2**20
    assert row.compile_s > 0


@pytest.mark.tpu_aot
def test_dcn_bytes_flat_and_hybrid(compiled_rows):
  flat, _ = compiled_rows["dlion-auto"]
  hybrid, _ = compiled_rows["hybrid-dlion"]
  assert flat.bytes_error is None and hybrid.bytes_error is None
  assert flat.dcn_bytes > 0 and hybrid.dcn_bytes > 0
  assert hybrid.dcn_bytes < flat.dcn_bytes
  assert hybrid.ici_bytes > flat.ici_bytes     # exact fp32 inside a slice


@pytest.mark.tpu_aot
def test_zero3_votes_over_dcn_what_the_hybrid_layout_does(compiled_rows):
  """Manual over data only, params and state sharded over the chips of a
  slice: each chip sends across slices the votes of its own shard, the
  shard_axis step's DCN bytes, and holds less."""
  hybrid, _ = compiled_rows["hybrid-dlion"]
  zero3, _ = compiled_rows["zero3-dlion"]
  assert zero3.error is None and zero3.bytes_error is None, zero3.error
  assert zero3.dcn_bytes == pytest.approx(hybrid.dcn_bytes, rel=0.05)
  assert zero3.argument_bytes < hybrid.argument_bytes


@pytest.mark.tpu_aot
def test_the_plain_step_votes_over_dcn_what_the_shard_map_step_does(
    compiled_rows):
  """--plain: the ZeRO-3 layout's step in plain jax.jit form (dl.workers)
  sends across slices the votes of each chip's own shard, as the
  shard_map step does, from the same arguments."""
  zero3, _ = compiled_rows["zero3-dlion"]
  plain, _ = compiled_rows["zero3-dlion" + aot.PLAIN]
  assert plain.error is None and plain.bytes_error is None, plain.error
  assert plain.dcn_bytes == pytest.approx(zero3.dcn_bytes, rel=0.05)
  assert plain.argument_bytes == zero3.argument_bytes


@pytest.mark.tpu_aot
def test_overlap_report_lists_every_dcn_pair(compiled_rows):
  for row, text in compiled_rows.values():
    transfers = re.findall(
        r"^\s*%([\w.\-]+) = .*? (?:send|recv)\(.*is_host_transfer=true",
        text, re.M)
    assert transfers
    dcn = [p for p in row.pairs if p.link == "dcn"]
    assert sorted(p.start for p in dcn) == sorted(transfers)
    assert all(p.done.startswith(("send-done", "recv-done")) for p in dcn)
    listed = "\n".join(aot.overlap_lines(row))
    for p in dcn:
      assert f" {p.start} .. {p.done}:" in listed


@pytest.mark.tpu_aot
def test_cli_prints_the_table_and_writes_json(tmp_path):
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra (libtpu)")
  if aot.libtpu_available():
    pytest.skip("libtpu cannot compile for TPU topologies here")
  out = tmp_path / "rows.json"
  text = aot.main(["--model", "mlp", "--variants", "hybrid-dlion",
                   "--json", str(out)])
  rows = json.loads(out.read_text())
  assert [r["variant"] for r in rows] == ["hybrid-dlion"]
  assert rows[0]["dcn_bytes"] > 0 and rows[0]["pairs"]
  assert "| v5e:2x2 x2 (8 chips) | hybrid-dlion |" in text


@pytest.mark.tpu_aot
def test_buckets_put_the_backward_pass_between_a_votes_start_and_done():
  """One message: no DCN transfer of the step has a matmul between its
  start and its done. In buckets (the MLP's 3 matrices apart), some do,
  with the bytes of the buckets' own messages."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra (libtpu)")
  if aot.libtpu_available():
    pytest.skip("libtpu cannot compile for TPU topologies here")
  problem = aot_models.mlp_problem()
  one, _ = aot.compile_step(problem, "v5e:2x2", 2, "dlion-auto")
  buckets, _ = aot.compile_step(problem, "v5e:2x2", 2, "dlion-auto", 20_000)
  dcn = lambda row: [p for p in row.pairs if p.link == "dcn"]
  assert not any(p.overlapped for p in dcn(one))
  assert any(p.overlapped for p in dcn(buckets))
  assert len(dcn(buckets)) > len(dcn(one))
  assert one.dcn_bytes <= buckets.dcn_bytes < 1.1 * one.dcn_bytes
  assert "dlion-auto, buckets of 20,000 B" in aot.table_row(buckets)
