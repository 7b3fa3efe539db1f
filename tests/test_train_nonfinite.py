"""The training CLI and non-finite values: optimizer.abstain_nonfinite only
where a vote abstains, and no checkpoint of non-finite params (docs/
reliability.md, section 5)."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")

from dlion_jax.train import checkpoint  # noqa: E402
from dlion_jax.train import cli  # noqa: E402

pytestmark = pytest.mark.integration

SMALL = ("train.steps=4", "train.log_every=2", "train.eval_every=0",
         "model.hidden=[8]", "optimizer.warmup_steps=0")


def _args(*settings):
  return ["--no-progress", *[a for s in (*SMALL, *settings)
                             for a in ("--set", s)]]


def _checkpointed_params(run_dir):
  """Every checkpoint's params in ``run_dir``, by step, as numpy."""
  ckpt = checkpoint.Checkpointer(run_dir / "checkpoints")
  return {step: ckpt.read_arrays(step)[0]["params"]
          for step in ckpt.all_steps()}


def _finite(tree):
  import jax   # pylint: disable=g-import-not-at-top
  return all(np.isfinite(x).all() for x in jax.tree.leaves(tree))


def test_abstaining_with_an_optimizer_that_cannot_is_refused(tmp_path):
  """The review's run, as a user starts it: adamw with abstain_nonfinite
  and a NaN worker exited 0 with an all-NaN model in both checkpoints it
  kept. Now a config error names the key, the optimizer and the fix, and
  nothing runs."""
  run_dir = tmp_path / "run"
  done = subprocess.run(
      [sys.executable, "-m", "dlion_jax.train", *_args(
          "optimizer.name=adamw", "optimizer.abstain_nonfinite=true",
          "faults.kind=nonfinite", "faults.workers=1",
          "faults.nan_rate=1.0", "train.checkpoint_every=2",
          f"run_dir={run_dir}")],
      capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("config error: --set optimizer.abstain_nonfinite="
                         "true: optimizer.abstain_nonfinite=true does "
                         "nothing for optimizer.name=adamw"), last
  assert "Set optimizer.name=dlion or signum, or drop" in last, last
  assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("settings,named", [
    (("optimizer.name=lion",), "optimizer.name=lion"),
    (("optimizer.name=sgd",), "optimizer.name=sgd"),
])
def test_abstain_nonfinite_is_refused_where_no_vote_abstains(
    tmp_path, capsys, settings, named):
  code = cli.main(_args(*settings, "optimizer.abstain_nonfinite=true",
                        f"run_dir={tmp_path}"))
  err = capsys.readouterr().err
  assert code == 2, err
  assert "optimizer.abstain_nonfinite=true does nothing" in err, err
  assert named in err and "drop optimizer.abstain_nonfinite" in err, err


@pytest.mark.parametrize("settings", [
    ("optimizer.name=signum",),
    ("optimizer.name=adamw", "optimizer.local_steps=2",
     "optimizer.outer=dlion"),
    ("optimizer.local_steps=2",),
    ("optimizer.local_steps=2", "optimizer.outer_sparse_chunk=8"),
    ("optimizer.name=adamw", "optimizer.local_steps=2",
     "optimizer.outer=nesterov"),
])
def test_abstain_nonfinite_runs_where_a_vote_abstains(tmp_path, capsys,
                                                      settings):
  """signum's vote, and every outer step of local steps (dlion's vote, the
  voted mean dense and sparse, DiLoCo's Nesterov step) under any inner
  optimizer: a NaN worker abstains, the run ends with a finite model
  (was, for voted and nesterov: refused, as they did not abstain)."""
  code = cli.main(_args(*settings, "optimizer.abstain_nonfinite=true",
                        "faults.kind=nonfinite", "faults.workers=1",
                        "faults.nan_rate=1.0", f"run_dir={tmp_path}"))
  err = capsys.readouterr().err
  assert code == 0, err
  saved = _checkpointed_params(tmp_path)
  assert list(saved) == [4] and _finite(saved[4])


def test_non_finite_params_are_never_checkpointed(tmp_path, capsys):
  """adamw averages a NaN worker's gradients into every worker's params at
  step 1, whose loss was still finite: the checkpoint of step 1 would hold
  them. The run stops there instead, naming the step and the fix, and
  writes no checkpoint of NaN params."""
  code = cli.main(_args("optimizer.name=adamw", "faults.kind=nonfinite",
                        "faults.workers=1", "faults.nan_rate=1.0",
                        "train.checkpoint_every=1", f"run_dir={tmp_path}"))
  err = capsys.readouterr().err
  saved = _checkpointed_params(tmp_path)
  assert all(_finite(p) for p in saved.values()), list(saved)
  assert code == 1, err
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: the params at step 1 hold NaN or Inf"), last
  assert "no checkpoint of them is written" in last, last
  assert "Lower optimizer.learning_rate (now 0.003)" in last, last
  assert "optimizer.abstain_nonfinite=true with dlion or signum" in last


def test_a_diverging_run_names_its_last_good_checkpoint(tmp_path, capsys):
  """sgd at a learning rate far too high: the checkpoints written before
  the divergence stay, each finite, and the error names the last."""
  code = cli.main(_args("optimizer.name=sgd", "optimizer.learning_rate=1e4",
                        "train.steps=40", "train.checkpoint_every=1",
                        "train.keep_checkpoints=40", f"run_dir={tmp_path}"))
  err = capsys.readouterr().err
  assert code == 1, err
  last = err.strip().splitlines()[-1]
  saved = _checkpointed_params(tmp_path)
  assert saved and all(_finite(p) for p in saved.values()), list(saved)
  good = max(saved)
  assert f"The last checkpoint, step {good} in " in last, last
  assert f"step {good + 1}" in last, last
  assert "Lower optimizer.learning_rate (now 10000)" in last, last
