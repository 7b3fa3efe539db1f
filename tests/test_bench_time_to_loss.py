"""benchmarks.time_to_loss: training time to a target loss over a shaped
link, local steps against voting every step, DiLoCo and global Lion."""

import json

import pytest

import dlion_jax as dl
from benchmarks import network
from benchmarks import time_to_loss

pytestmark = pytest.mark.integration


def write_run(run_dir, losses, rates, accuracy=0.9, bits=1.0):
  """A run directory as the CLI leaves it: a log every 10 steps."""
  run_dir.mkdir()
  (run_dir / "config.json").write_text(json.dumps(
      {"data": {"global_batch": 256}}))
  logs = [{"step": 10 * (i + 1), "loss": loss, "examples_per_s": rate}
          for i, (loss, rate) in enumerate(zip(losses, rates))]
  logs.insert(1, {"step": 10, "test_loss": 9.0})      # an evaluation
  (run_dir / "metrics.jsonl").write_text(
      "\n".join(json.dumps(r) for r in logs) + "\n")
  (run_dir / "summary.json").write_text(json.dumps(
      {"test_accuracy": accuracy, "sent_bits_per_param": bits}))
  return time_to_loss.read_run(run_dir)


def test_time_is_the_sum_of_the_intervals_and_the_loss_is_smoothed(tmp_path):
  run = write_run(tmp_path / "a", [4.0, 2.0, 3.0, 1.0], [256, 512, 256, 128])
  # 10 steps of 256 examples at 256, 512, 256, 128 examples a second.
  assert [t for _, t, _ in run["curve"]] == [10.0, 15.0, 25.0, 45.0]
  assert [loss for *_, loss in run["curve"]] == [4.0, 3.0, 3.0, 2.0]
  assert time_to_loss.time_to(run["curve"], 3.0) == (20, 15.0)
  assert time_to_loss.time_to(run["curve"], 1.5) is None


def test_the_target_is_the_worst_final_loss_and_every_row_reaches_it(
    tmp_path):
  names = [*list(time_to_loss.rows(16))[:3], "global Lion"]
  runs = {name: write_run(tmp_path / str(i), losses, rates, bits=bits)
          for i, (name, losses, rates, bits) in enumerate(zip(
              names, [[3, 2, 1], [3, 1.5, 1], [3, 2, 2], [3, 2, 1.5]],
              [[256] * 3, [512] * 3, [256] * 3, [64] * 3],
              [1.0, 0.06, 4.0, 32.0]))}
  text = time_to_loss.report([{"procs": 2, "rate": "10mbit", "steps": 30,
                               "rows": runs}])
  assert "2 processes, 10mbit (target loss 2.3333)" in text
  cells = {line.split("|")[1].strip(): [c.strip() for c in
                                        line.split("|")[2:-1]]
           for line in text.splitlines() if line.startswith("| ")}
  # DiLoCo's smoothed losses are 3, 2.5, 2.33: it reaches the target last.
  assert cells["DiLoCo outer, H=16"][1:3] == ["30.00", "30"]
  assert cells["D-Lion outer, H=16"][1:4] == ["10.00", "20", "12.0x"]
  assert cells["global Lion"][3] == "1.0x"


def test_bad_links_name_the_fix(capsys):
  if network.can_shape() is None:
    pytest.skip("this machine can shape links")
  with pytest.raises(SystemExit):
    time_to_loss.main(["--procs", "2", "--rates", "100mbit"])
  assert "shaping the link needs" in capsys.readouterr().err


ROWS = ("D-Lion outer, H=8", "DiLoCo outer, H=8", "EF vote, late, H=8")


@pytest.mark.skipif(network.can_shape() is not None,
                    reason="shaping needs root, ip and tc")
@pytest.mark.parametrize("rows", [
    pytest.param(ROWS[2:], id="one-row"),
    pytest.param(ROWS, id="every-row", marks=pytest.mark.slow)])
def test_a_tiny_run_over_a_shaped_link_reports_every_row(tmp_path, rows):
  raw = tmp_path / "runs.json"
  text = time_to_loss.main([
      "--procs", "2", "--rates", "100mbit", "--steps", "16", "--every", "8",
      "--set", "model.hidden=[16]", "--json", str(raw),
      "--plot", str(tmp_path / "ttl.png"), "--rows", *rows])
  runs = json.loads(raw.read_text())[0]["rows"]
  assert list(runs) == [*rows, "global Lion"]
  bits = {name: run["bits"] for name, run in runs.items()}
  # The outer vote once a round of 8, DiLoCo's fp32 mean, fp32 every step
  # (plus the loss's mean each step: a few hundredths).
  vote = dl.wire_bits(2) / 8
  if "D-Lion outer, H=8" in bits:
    assert bits["D-Lion outer, H=8"] == pytest.approx(vote, abs=0.06)
  if "DiLoCo outer, H=8" in bits:
    assert bits["DiLoCo outer, H=8"] == pytest.approx(
        dl.allreduce_bits(2) / 8, abs=0.06)
  assert bits["global Lion"] == pytest.approx(dl.allreduce_bits(2), abs=0.1)
  # The same vote, late: as the D-Lion outer row's; alone, the vote's
  # bits and the scales of this tiny model's leaves.
  if "D-Lion outer, H=8" in bits:
    assert bits["EF vote, late, H=8"] == pytest.approx(
        bits["D-Lion outer, H=8"], abs=0.02)
  assert vote < bits["EF vote, late, H=8"] < 2 * vote
  for name in runs:
    assert f"| {name} |" in text
  assert (tmp_path / "ttl.png").read_bytes()[:4] == b"\x89PNG"
  again = time_to_loss.main(["--from-json", str(raw)])
  assert again == text
