"""benchmarks.network (multi-process, shaped loopback) and the wire plot."""

import json
import math
import os
import subprocess

import pytest

from benchmarks import network
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax.bench import wire
import dlion_jax as dl
from tiers import slow_but

pytestmark = pytest.mark.integration

ROWS = ["global lion fp32", "global lion bf16", "dlion mavo auto",
        "dlion avg psum", "dlion mavo alltoall"]


def test_rates_and_floor():
  assert network.parse_rate("100mbit") == 100e6
  assert network.parse_rate("1gbit") == 1e9
  assert network.parse_rate("none") is None
  with pytest.raises(ValueError, match="expected e.g."):
    network.parse_rate("fast")
  # 2 workers, 1.25 MB each, through one shared 100 Mbit/s queue: 0.2 s.
  assert network.wire_floor_s(1.25e6, 2, 100e6) == pytest.approx(0.2)
  assert network.wire_floor_s(1.25e6, 2, None) is None


def test_row_selection_always_has_the_baseline():
  assert network.select_rows("dlion mavo auto") == [network.BASELINE,
                                                    "dlion mavo auto"]
  assert set(network.select_rows("all")) == set(network.ROWS)
  with pytest.raises(ValueError, match="unknown rows"):
    network.select_rows("dlion nope")


@pytest.mark.skipif(network.can_shape() is not None,
                    reason="shaping needs root, ip and tc")
def test_namespace_shapes_its_own_loopback_and_is_deleted():
  with network.namespace("100mbit") as prefix:
    name = prefix[-1]
    qdisc = subprocess.run(prefix + ["tc", "qdisc", "show", "dev", "lo"],
                           capture_output=True, text=True, check=True).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True, check=True).stdout
  assert name not in listed
  host = subprocess.run(["tc", "qdisc", "show", "dev", "lo"],
                        capture_output=True, text=True, check=True).stdout
  assert "tbf" not in host          # the machine's own loopback untouched


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """2 processes, tiny GPT, unshaped, 1 warm-up + 2 timed rounds."""
  tmp = tmp_path_factory.mktemp("network")
  raw = tmp / "raw.json"
  text = network.main([
      "--procs", "2", "--rates", "none", "--params", "tiny", "--steps", "2",
      "--warmup", "1", "--rows", ",".join(ROWS), "--timeout", "150",
      "--json", str(raw), "--plot", str(tmp / "net.png")])
  return text, json.loads(raw.read_text())["configs"][0], tmp


def test_tiny_run_reports_every_row(tiny_run):
  text, config, tmp = tiny_run
  assert config["procs"] == 2 and config["num_workers"] == 2
  assert list(config["rows"]) == ROWS
  for name in ROWS:
    assert f"| {name} | 2 | none |" in text
    row = config["rows"][name]
    assert row["opt_s"] > 0 and row["exchange_s"] > 0 and row["e2e_s"] > 0
    assert all(math.isfinite(x) for x in row["losses"])
    assert len(row["losses"]) == 3
  assert config["grad_bytes"] == 0       # forward/backward sends nothing
  assert (tmp / "net.png").read_bytes()[:4] == b"\x89PNG"


def test_from_json_rerenders_the_same_report(tiny_run, tmp_path):
  text, _, tmp = tiny_run
  again = network.main(["--from-json", str(tmp / "raw.json"), "--plot",
                        str(tmp_path / "again.png")])
  assert again == text
  assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_tiny_run_bytes_match_the_accounting(tiny_run):
  _, config, _ = tiny_run
  sizes, p = config["leaf_sizes"], config["num_params"]
  assert sum(sizes) == p
  rows = config["rows"]
  for name, agg, comm in (("dlion mavo auto", "mavo", "allgather"),
                          ("dlion avg psum", "avg", "psum"),
                          ("dlion mavo alltoall", "mavo", "alltoall")):
    assert rows[name]["wire_bytes"] == pytest.approx(
        message.message_bytes(sizes, 2, aggregation=agg, comm=comm))
    analytic = dl.wire_bits(2, aggregation=agg, comm=comm) * p / 8
    assert rows[name]["wire_bytes"] == pytest.approx(analytic, rel=0.05)
  assert rows["global lion fp32"]["wire_bytes"] == 4 * p    # 2(N-1)/N * 4 B
  assert rows["global lion bf16"]["wire_bytes"] == 2 * (p + p % 2)
  assert rows["global lion bf16"]["ops"] == "all-to-all+all-gather"
  for row in rows.values():      # the replay sends what the step sends
    assert row["replay_bytes"] == pytest.approx(row["wire_bytes"], abs=8)


def test_wire_plot_is_written(tmp_path):
  sizes = (2, 3, 8, 64)
  dlion = [wire.Measurement(n, agg, vote, comm, comm, bits, bits, bits, "-")
           for n, agg, vote, comm in wire.configs(sizes)
           if comm != "auto"
           for bits in [dl.wire_bits(n, aggregation=agg, vote=vote,
                                     comm=comm)]]
  baselines = [wire.Measurement(n, "-", "-", f"pmean {d}", "-", b, b, b, "-")
               for n in sizes for d in ("float32", "bfloat16")
               for b in [dl.allreduce_bits(n, d)]]
  path = tmp_path / "img" / "wire.png"
  wire.plot(dlion, baselines, str(path))
  assert path.read_bytes()[:4] == b"\x89PNG"


def test_floors_are_below_what_the_strategies_send():
  for n in range(2, 20):
    for agg in message.AGGREGATIONS:
      for vote in quantize.VOTES:
        info = wire.information_floor_bits(n, agg, vote)
        best = dl.wire_bits(n, aggregation=agg, vote=vote)
        assert 0 < info <= best + 1e-9
        assert wire.pattern_floor_bits(n, agg, vote) <= dl.wire_bits(
            n, aggregation=agg, vote=vote, comm="alltoall") + 1e-9
  # Binary MaVo, N = 2: learning the other's bit is all there is to it.
  assert wire.information_floor_bits(2, "mavo", "binary") == pytest.approx(1)
  assert wire.pattern_floor_bits(3, "mavo", "binary") == pytest.approx(4 / 3)


def test_docs_quote_network_bench():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "benchmarks.md"), encoding="utf-8") as f:
    doc = f.read()
  assert "python -m benchmarks.network" in doc
  assert "img/wire_bits_vs_n.png" in doc


@pytest.mark.parametrize("outer,bits", slow_but([
    ("dlion", dl.wire_bits(3)), ("voted", dl.wire_bits(3)),
    ("sparse 1/32", dl.sparse_vote_bits(3, sparse_chunk=32)),
    ("voted 1/4", dl.wire_bits(3) / 4),
    ("sparse 16/4096 2-bit", dl.sparse_vote_bits(
        3, sparse_chunk=4096, sparse_keep=16, sparse_value_bits=2,
        scale_chunk=4096)),
    ("nesterov", dl.allreduce_bits(3))], 1, 2, 5), ids=str)
def test_wire_local_steps_reads_a_round_off_the_compiled_step(outer, bits):
  """Odd N = 3, H = 4: the vote (and DiLoCo's all-reduce) once a round."""
  measured, analytic = wire.local_steps_bits(3, outer, 4)
  assert analytic == bits / 4
  # (the voted means' scales, a float32 a leaf, are under 1 %; the
  # 4,096-entry chunks' padding at the leaves' ends 1.5 %)
  assert measured == pytest.approx(analytic, rel=0.02), outer


@pytest.mark.parametrize("hs", [("4",), pytest.param(
    ("1", "4"), marks=pytest.mark.slow)], ids="-".join)
def test_wire_prints_a_row_for_each_h(hs):
  text = wire.main(["--sizes", "3", "--local-steps", *hs])
  assert all(f"| 3 | {h} | " in text for h in hs)
