"""The train CLI resumes on another number of workers, nodes or processes
(dlion_jax.elastic): the quickstart checkpointed at step 100 and resumed
on half or twice its workers ends within 2 points of the uninterrupted
run's test accuracy, says what it did, and refuses only what cannot be
mapped."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(run_dir, *overrides):
  return load_config(cli.resolve_config("quickstart"), [
      f"run_dir={run_dir}", "train.checkpoint_every=100",
      "train.keep_checkpoints=5", "train.eval_every=0", *overrides])


def _from_step_100(run_dir, copy):
  """A copy of ``run_dir`` as if its run had stopped after step 100."""
  shutil.copytree(run_dir, copy)
  (copy / "summary.json").unlink()
  for step in ("200", "300"):
    shutil.rmtree(copy / "checkpoints" / step)
  return copy


@pytest.mark.parametrize("old,new", [
    (8, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_resumed_on_other_workers_ends_near_the_uninterrupted_run(
    tmp_path, old, new):
  full = trainer.train(_config(tmp_path / "full", f"workers={old}"),
                       progress=False, log=lambda *_: None)["summary"]
  lines = []
  resumed = trainer.train(
      _config(_from_step_100(tmp_path / "full", tmp_path / "resumed"),
              f"workers={new}"), resume=True, progress=False,
      log=lines.append)["summary"]
  assert abs(resumed["test_accuracy"] - full["test_accuracy"]) <= 0.02
  what = ("momenta averaged in pairs" if new < old
          else "each momentum copied to 2 workers")
  assert lines[0] == (
      f"resumed from step 100 on {new} workers from {old} workers: {what}; "
      f"the global batch of 256 kept, {256 // new} examples a worker "
      f"(was {256 // old})")


def test_resumed_on_a_hybrid_mesh_and_back(tmp_path):
  """8 workers -> 2 nodes of 4 (a row per node: momenta averaged in groups
  of 4) at step 100, -> 8 workers again at step 200."""
  trainer.train(_config(tmp_path / "run"), progress=False,
                log=lambda *_: None)
  run = _from_step_100(tmp_path / "run", tmp_path / "hybrid")
  lines = []
  trainer.train(_config(run, "mesh.nodes=2"), resume=True, progress=False,
                log=lines.append)
  assert lines[0].startswith("resumed from step 100 on 2 nodes of 4 from 8 "
                             "workers: momenta averaged in groups of 4;")
  (run / "summary.json").unlink()
  shutil.rmtree(run / "checkpoints" / "300")
  lines = []
  out = trainer.train(_config(run), resume=True, progress=False,
                      log=lines.append)
  assert lines[0].startswith("resumed from step 200 on 8 workers from 2 "
                             "nodes of 4: each momentum copied to 4 workers")
  assert out["summary"]["test_accuracy"] > 0.9


def test_same_workers_resume_bit_for_bit(tmp_path):
  full = trainer.train(_config(tmp_path / "full"), progress=False,
                       log=lambda *_: None)
  again = trainer.train(
      _config(_from_step_100(tmp_path / "full", tmp_path / "again")),
      resume=True, progress=False, log=lambda *_: None)
  for a, b in zip(*(map(np.asarray, __import__("jax").tree.leaves(x))
                    for x in (full["params"], again["params"]))):
    np.testing.assert_array_equal(a, b)


def test_a_global_batch_the_new_workers_cannot_share_is_refused(tmp_path,
                                                                capsys):
  trainer.train(_config(tmp_path / "full"), progress=False,
                log=lambda *_: None)
  run = _from_step_100(tmp_path / "full", tmp_path / "resumed")
  argv = ["--no-progress", "--resume"] + [
      a for s in [f"run_dir={run}", "train.checkpoint_every=100",
                  "train.keep_checkpoints=5", "train.eval_every=0",
                  "workers=3"] for a in ("--set", s)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "workers=3" in err and "256" in err


def test_two_processes_resume_on_one(tmp_path):
  """A run of 2 processes (one worker each) checkpointed at step 3 resumes
  in one process on one worker."""
  small = ["train.steps=6", "model.hidden=[16]", "train.log_every=3",
           "train.eval_every=0", "train.checkpoint_every=3",
           "train.keep_checkpoints=5", f"run_dir={tmp_path / 'run'}"]
  sets = [a for s in small + ["workers=2"] for a in ("--set", s)]
  out = subprocess.run(
      [sys.executable, "-m", "dlion_jax.launch", "-n", "2", "--timeout",
       "150", "--", sys.executable, "-m", "dlion_jax.train", "--no-progress",
       "--init-timeout", "60", *sets], capture_output=True, text=True,
      timeout=180, cwd=ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  (tmp_path / "run" / "summary.json").unlink()
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  lines = []
  cfg = load_config(cli.resolve_config("quickstart"), small + ["workers=1"])
  summary = trainer.train(cfg, resume=True, progress=False,
                          log=lines.append)["summary"]
  assert lines[0].startswith("resumed from step 3 on 1 worker from 2 "
                             "workers: momenta averaged in pairs;")
  assert np.isfinite(summary["test_loss"])


def test_a_new_layout_of_as_many_voters_says_so(tmp_path):
  """2 workers -> 2 nodes of 4: as many rows, each node's momentum its old
  worker's, and the line says the layout changed."""
  tiny = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0",
          "train.log_every=2", "model.hidden=[8]", "train.keep_checkpoints=5",
          f"run_dir={tmp_path / 'run'}"]
  base = load_config(cli.resolve_config("quickstart"), tiny + ["workers=2"])
  old = trainer.train(base, progress=False, log=lambda *_: None)["summary"]
  (tmp_path / "run" / "summary.json").unlink()
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
  lines = []
  new = trainer.train(load_config(cli.resolve_config("quickstart"),
                                  tiny + ["mesh.nodes=2"]),
                      resume=True, progress=False, log=lines.append)["summary"]
  assert lines[0] == (
      "resumed from step 2 on 2 nodes of 4 from 2 workers: momenta kept; "
      "the global batch of 256 kept, 32 examples a worker (was 128)")
  # The totals add each layout's steps at its own rate.
  for key in ("sent_bytes", "fp32_allreduce_bytes"):
    rates = old[f"{key}_per_step"], new[f"{key}_per_step"]
    assert rates[0] != rates[1]
    assert new[f"{key}_total"] == pytest.approx(2 * rates[0] + 2 * rates[1])


@pytest.mark.parametrize("before,after,what", [
    (["optimizer.name=lion", "workers=2"], ["optimizer.name=lion"],
     "on 8 workers from 2 workers: the optimizer state, alike on every "
     "worker, kept;"),
    (["mesh.nodes=2"], ["mesh.nodes=2", "mesh.shard_params=true"],
     "on 2 nodes of 4, params sharded from 2 nodes of 4: momenta kept;"),
    (["mesh.nodes=2"], ["mesh.nodes=1"],
     "on 1 node of 8 from 2 nodes of 4: momenta averaged in pairs;"),
], ids=["global_optimizer", "shard_params", "one_node"])
def test_the_resume_line_names_the_change(tmp_path, before, after, what):
  tiny = ["train.steps=2", "train.checkpoint_every=1", "train.eval_every=0",
          "train.log_every=1", "model.hidden=[8]", "train.keep_checkpoints=5",
          f"run_dir={tmp_path / 'run'}"]
  trainer.train(load_config(cli.resolve_config("quickstart"), tiny + before),
                progress=False, log=lambda *_: None)
  (tmp_path / "run" / "summary.json").unlink()
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "2")
  lines = []
  trainer.train(load_config(cli.resolve_config("quickstart"), tiny + after),
                resume=True, progress=False, log=lines.append)
  assert lines[0].startswith(f"resumed from step 1 {what}")


def _saved_for_8(tmp_path):
  """A Checkpointer holding step 1 of an 8-worker state, and the optimizer."""
  import dlion_jax as dl
  from dlion_jax import devices
  from dlion_jax import parallel
  from dlion_jax.train import checkpoint
  tx = dl.distributed_lion(1e-2, axis_name="data")
  mesh = devices.data_mesh(8)
  params = devices.replicate({"w": np.ones((4, 3), np.float32)}, mesh)
  ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints")
  ckpt.save(1, {"params": params,
                "opt_state": parallel.init_worker_states(tx, params, mesh)},
            {"step": 1})
  return ckpt, tx


def test_restoring_onto_another_worker_count_points_to_elastic(tmp_path):
  """Checkpointer.restore onto the 4-worker run's own state names both
  counts and dl.elastic's two calls, which then resume it. Was: "does not
  fit this run ... Resume with the config that wrote it"."""
  from dlion_jax import elastic
  from dlion_jax import devices
  from dlion_jax import parallel
  from dlion_jax.train import checkpoint
  from messages import assert_names
  ckpt, tx = _saved_for_8(tmp_path)
  mesh = devices.data_mesh(4)
  params = devices.replicate({"w": np.zeros((4, 3), np.float32)}, mesh)
  with pytest.raises(checkpoint.CheckpointError) as e:
    ckpt.restore({"params": params,
                  "opt_state": parallel.init_worker_states(tx, params, mesh)})
  assert_names(e, "stacked for 8 workers", "the target for 4",
               "dl.elastic.restore_target(tx, params, mesh, 8)",
               "dl.elastic.resize_worker_states(tx, state, params, mesh)")
  state, _ = ckpt.restore({"params": params, "opt_state":
                           elastic.restore_target(tx, params, mesh, 8)})
  state = elastic.resize_worker_states(tx, state["opt_state"],
                                       state["params"], mesh)
  assert state[0].mu["w"].shape == (4, 4, 3)
  ckpt.close()


# Orbax's reads, cut short, leave coroutines that complain when collected
# (one may still print once the test is over).
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")
def test_orbax_shape_error_is_not_called_corrupt(tmp_path, monkeypatch):
  """Should the shape check before orbax miss, orbax's own shape error
  says the same, not "corrupt or truncated ... delete that directory"."""
  from dlion_jax import devices
  from dlion_jax import parallel
  from dlion_jax.train import checkpoint
  from messages import assert_names
  ckpt, tx = _saved_for_8(tmp_path)
  monkeypatch.setattr(ckpt, "_check_fits", lambda *_: None)
  mesh = devices.data_mesh(4)
  params = devices.replicate({"w": np.zeros((4, 3), np.float32)}, mesh)
  with pytest.raises(checkpoint.CheckpointError) as e:
    ckpt.restore({"params": params,
                  "opt_state": parallel.init_worker_states(tx, params, mesh)})
  assert_names(e, "stacked for 8 workers", "the target for 4",
               "dl.elastic.restore_target(tx, params, mesh, 8)")
  assert "corrupt" not in str(e.value)
  ckpt.close()
