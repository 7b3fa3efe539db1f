"""The training progress bar where its output is kept (a notebook without
widgets, a log file, the launcher's pipes): a few redraws a run."""

import pytest

pytest.importorskip("flax", reason="trains: the [examples] extra")
pytest.importorskip("tqdm", reason="the progress bar is tqdm's")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration


def test_progress_bar_off_a_terminal_redraws_a_few_times(tmp_path, capsys):
  """300 steps logged every 10: the bar was redrawn 37 times, each
  kept as a chunk of the notebook's output (was: one per log line plus one
  every 0.1 s)."""
  cfg = load_config(cli.resolve_config("quickstart"), [
      "train.steps=300", "train.log_every=10", "train.eval_every=0",
      "model.hidden=[8]", f"run_dir={tmp_path}"])
  trainer.train(cfg, progress=True, log=lambda *_: None)
  err = capsys.readouterr().err
  assert "300/300" in err and "loss=" in err, err
  assert err.count("\r") <= 4, err

