"""bench.hybrid: what each device sends over each axis of a flat and a
hybrid mesh, read off the compiled GPT step."""

import pathlib
import re
import sys

import jax
import pytest

from dlion_jax import devices
import dlion_jax as dl

pytestmark = pytest.mark.integration
hybrid = pytest.importorskip("dlion_jax.bench.hybrid")
pytest.importorskip("flax")


@pytest.mark.slow
def test_hybrid_votes_cross_the_slow_axis_on_shards_only():
  mesh = devices.hybrid_mesh(2, devices=jax.devices()[:4])
  flat = devices.data_mesh(4)
  tx = hybrid.optimizers()
  lion, dlion = tx["global lion (fp32 all-reduce)"], tx["dlion mavo auto"]
  flat_dlion, _, _ = hybrid.measure(dlion, flat, "flat")
  hybrid_dlion, _, _ = hybrid.measure(dlion, mesh, "shard_axis")
  hybrid_lion, _, _ = hybrid.measure(lion, mesh, "shard_axis")
  # fp32 on 1/2 of the params across 2 nodes; inside: reduce-scatter plus
  # all-gather over 2 devices, an fp32 all-reduce's worth (up to padding).
  assert hybrid_lion["data"] == pytest.approx(dl.allreduce_bits(2) / 2,
                                              rel=1e-4)
  assert hybrid_lion["fsdp"] == pytest.approx(dl.allreduce_bits(2), rel=1e-3)
  # The vote of 2 nodes on half the params: about 1/2 x 1 bit (alltoall of
  # binary votes, N = 2), against 4 voters' 1.5 bits on the flat mesh.
  assert hybrid_dlion["data"] == pytest.approx(
      dl.wire_bits(2) / 2, rel=0.01)
  assert flat_dlion["data"] == pytest.approx(dl.wire_bits(4), rel=0.01)
  assert hybrid_dlion["fsdp"] == pytest.approx(hybrid_lion["fsdp"])


@pytest.mark.slow       # the plain step's test below compiles ZeRO-3 too
def test_sharded_placements_vote_on_shards_and_shrink_memory():
  """Each device votes on its half of every leaf in every layout (the
  same slow-link bits); with shard_axis the fast links carry one
  reduce-scatter and one all-gather however the params are placed, fewer
  bytes than the compiler's layouts of this unannotated GPT; sharding the
  state, then the params, shrinks the arguments a device holds."""
  mesh = devices.hybrid_mesh(2, devices=jax.devices()[:4])
  dlion = hybrid.optimizers()["dlion mavo auto"]
  got = {p: hybrid.measure(dlion, mesh, p) for p in hybrid.PLACEMENTS[1:]}
  want = got["shard_axis"][0]
  for bits, _, _ in got.values():
    assert bits["data"] == pytest.approx(want["data"], rel=0.02)
  for p in ("shard_axis", "shard_axis zero3"):
    assert got[p][0]["fsdp"] == pytest.approx(dl.allreduce_bits(2), rel=0.01)
    for compiler in ("replicated", "zero2", "zero3"):
      assert got[p][0]["fsdp"] < got[compiler][0]["fsdp"]
  args = {p: mb["arguments"] for p, (_, mb, _) in got.items()}
  assert args["zero3"] < args["zero2"] < args["replicated"]
  assert args["shard_axis zero3"] < args["shard_axis"] < args["replicated"]


LAYOUT_ROWS = ("flat, 4 voters", "2 nodes x 2, shard_axis",
               "2 nodes x 2, shard_axis zero3", "2 nodes x 2, zero2",
               "2 nodes x 2, zero3")


@pytest.mark.parametrize("placement", [
    "zero3", pytest.param("replicated", marks=pytest.mark.slow)])
def test_the_plain_step_sends_what_the_shard_axis_step_sends(placement):
  """bench.hybrid --plain's measurement: D-Lion's plain jitted step on a
  2 x 4 mesh, given the params' placement, sends over data what
  make_train_step sends, and over fsdp what its like, the shard_axis step,
  sends, within a bit a parameter, and fewer than make_train_step's step
  without shard_axis. With params sharded at rest (ZeRO-3) the node's
  mean gradient is reduce-scattered onto their shards (all-reduced by the
  compiler: 72.97 bits a parameter, against 48.97); with replicated ones
  (placement P()) it is all-reduced as the shard_axis step's mean and
  update together send it (72). Measured on what the step hands back
  (bench.steady_compiled)."""
  mesh = devices.hybrid_mesh(2, devices=jax.devices()[:8])
  dlion = hybrid.optimizers()["dlion mavo auto"]
  compiler, _, _ = hybrid.measure(dlion, mesh, placement)
  theirs, _, _ = hybrid.measure(dlion, mesh, placement, "shard_axis")
  mine, _, _ = hybrid.measure(dlion, mesh, placement, "plain")
  assert mine["data"] == pytest.approx(theirs["data"], rel=1e-6)
  assert mine["data"] == pytest.approx(dl.wire_bits(2) / 4, rel=0.01)
  assert mine["fsdp"] <= theirs["fsdp"] + 1, (mine, theirs)
  assert mine["fsdp"] < compiler["fsdp"], (mine, compiler)


def test_report_lists_every_layout(monkeypatch):
  """A row per layout and optimizer (each measured step stubbed: the two
  tests above compile the layouts)."""
  monkeypatch.setattr(hybrid, "measure", lambda *args, **kwargs: (
      {"data": 1.0, "fsdp": 0.5}, {"arguments": 1.0, "temporaries": 2.0},
      100))
  text = hybrid.report(4)
  for layout in LAYOUT_ROWS:
    assert text.count(f"| {layout} |") == 2


@pytest.mark.slow
def test_report_compiles_every_layout():
  text = hybrid.report(4)
  for layout in LAYOUT_ROWS:
    assert text.count(f"| {layout} |") == 2


def test_report_shows_each_compilation_as_it_ends(monkeypatch, capsys):
  """Where tqdm is absent, a line on stderr before each compilation (tqdm,
  where installed, draws a bar there instead): the run shows it is alive."""
  monkeypatch.setitem(sys.modules, "tqdm", None)     # import tqdm fails
  jobs = len(hybrid.layouts(4)) * len(hybrid.optimizers())
  seen = []

  def measure(tx, mesh, placement, step_form=None):
    seen.append(capsys.readouterr().err)
    return {"data": 1.0, "fsdp": 0.5}, {"arguments": 1.0,
                                        "temporaries": 2.0}, 100
  monkeypatch.setattr(hybrid, "measure", measure)
  hybrid.report(4)
  assert len(seen) == jobs
  for i, err in enumerate(seen):
    assert f"compiling: {i}/{jobs}" in err
  assert f"compiling: {jobs}/{jobs}" in capsys.readouterr().err


def test_help_says_how_long_the_default_run_takes(capsys):
  """--help gives the measured time of the default run and the number of
  compilations it makes; the module's docs give the same."""
  with pytest.raises(SystemExit):
    hybrid.main(["--help"])
  out = " ".join(capsys.readouterr().out.split())
  jobs = len(hybrid.layouts(8)) * len(hybrid.optimizers())
  assert f"Compiles the step {jobs} times at --workers 8" in out
  assert hybrid.DURATION in out
  assert re.search(r"\d+ min \d+ s on \d+ CPU cores", hybrid.DURATION)
  doc = " ".join(hybrid.__doc__.split())
  assert f"{jobs} times at the default 8 workers: " in doc
  assert hybrid.DURATION.split(",")[0] in doc
  benchmarks = pathlib.Path(__file__).resolve().parents[1] / "docs" / (
      "benchmarks.md")
  section = benchmarks.read_text().split("(`dlion_jax.bench.hybrid`)")[1]
  section = " ".join(section[:section.index("|")].split())
  assert f"compiles the step {jobs} times" in section
  assert f"took {hybrid.DURATION.split(' (')[0]}" in section
