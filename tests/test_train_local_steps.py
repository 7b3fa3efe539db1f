"""The train CLI with optimizer.local_steps: what it sends, what it learns,
its resume and its config errors (dlion_jax.rounds in the trainer)."""

import shutil

import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

import jax  # noqa: E402

import dlion_jax as dl  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402
from messages import assert_names  # noqa: E402

pytestmark = pytest.mark.integration

SMALL = ["train.steps=64", "train.eval_every=0", "train.log_every=8",
         "train.checkpoint_every=0", "model.hidden=[32]"]


def run(tmp_path, *overrides, resume=False):
  cfg = load_config(cli.resolve_config("quickstart"),
                    [*SMALL, f"run_dir={tmp_path}", *overrides])
  lines = []
  out = trainer.train(cfg, resume=resume, progress=False, log=lines.append)
  return out, lines


@pytest.mark.parametrize("outer,bits", [("dlion", dl.wire_bits(8)),
                                        ("nesterov", dl.allreduce_bits(8))])
def test_the_outer_step_is_sent_once_a_round(tmp_path, outer, bits):
  out, lines = run(tmp_path, "optimizer.local_steps=8",
                   f"optimizer.outer={outer}", "model.hidden=[128,128]")
  summary = out["summary"]
  # 8 rounds in 64 steps: the outer step's bits / 8, plus the loss's mean
  # and the padding of 26,122 params' message.
  assert summary["analytic_bits_per_param"] == pytest.approx(bits / 8)
  assert summary["sent_bits_per_param"] == pytest.approx(bits / 8, rel=0.03)
  assert summary["test_accuracy"] > 0.5          # it learns: 10 classes
  assert f"dlion alone for 8 steps then a {outer} outer step" in lines[0]
  # The model is the anchor, the same on every worker.
  anchor = dl.rounds.anchor(out["opt_state"])
  for leaf, rows in zip(jax.tree.leaves(out["params"]),
                        jax.tree.leaves(anchor)):
    np.testing.assert_array_equal(leaf, rows[0])
    np.testing.assert_array_equal(rows, np.broadcast_to(rows[0], rows.shape))


def test_resume_in_the_middle_of_a_round_is_bit_for_bit(tmp_path):
  """Rounds end at steps 3 and 6; the run resumes from step 4, each
  worker's own params, the anchor and every state restored."""
  flags = ["optimizer.local_steps=3", "train.steps=8",
           "train.checkpoint_every=4"]
  straight, _ = run(tmp_path, *flags)
  shutil.rmtree(tmp_path / "checkpoints" / "8")     # as if killed after 4
  resumed, lines = run(tmp_path, *flags, resume=True)
  assert "resumed from step 4" in lines
  for a, b in zip(jax.tree.leaves((straight["params"],
                                   straight["opt_state"])),
                  jax.tree.leaves((resumed["params"], resumed["opt_state"]))):
    np.testing.assert_array_equal(a, b)


def test_resume_on_another_number_of_workers_says_it_is_not_supported(
    tmp_path):
  flags = ["optimizer.local_steps=3", "train.steps=8",
           "train.checkpoint_every=4"]
  run(tmp_path, *flags)
  shutil.rmtree(tmp_path / "checkpoints" / "8")
  with pytest.raises(ValueError) as e:
    run(tmp_path, *flags, "workers=4", resume=True)
  assert_names(e, "written by 8 workers", "resume with workers=8")


def test_config_mistakes_name_the_key(tmp_path):
  base = [*SMALL, f"run_dir={tmp_path}"]
  quickstart = cli.resolve_config("quickstart")
  with pytest.raises(ConfigError) as e:
    load_config(quickstart, [*base, "optimizer.local_steps=4",
                             "mesh.nodes=2"])
  assert_names(e, "optimizer.local_steps=4", "mesh.nodes=2",
               "mesh.nodes=null")
  with pytest.raises(ConfigError) as e:
    load_config(quickstart, [*base, "optimizer.local_steps=4",
                             "optimizer.momentum_sync=5"])
  assert_names(e, "optimizer.momentum_sync=5", "optimizer.momentum_sync=0")
  with pytest.raises(ConfigError, match="optimizer.local_steps=0"):
    load_config(quickstart, [*base, "optimizer.local_steps=0"])
  with pytest.raises(ConfigError, match="optimizer.outer='adam'"):
    load_config(quickstart, [*base, "optimizer.outer=adam"])
