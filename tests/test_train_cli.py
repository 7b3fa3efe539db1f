"""The training CLI end to end: quickstart, resume, optimizers, errors."""

import json
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

pytest.importorskip("flax")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

FAST = ["train.steps=12", "train.log_every=4", "train.eval_every=6",
        "model.hidden=[32]", "optimizer.warmup_steps=2",
        "optimizer.learning_rate=1e-2"]


def quick_config(tmp_path, *overrides):
  return load_config(cli.resolve_config("quickstart"),
                     FAST + [f"run_dir={tmp_path}", *overrides])


def test_quickstart_cli_end_to_end(tmp_path):
  """What a newcomer runs: exit 0, accuracy and wire figures, files."""
  out = subprocess.run(
      [sys.executable, "-m", "dlion_jax.train", "--no-progress",
       "--set", f"run_dir={tmp_path}", *[a for s in FAST for a in ("--set", s)]],
      capture_output=True, text=True, timeout=300, check=True).stdout
  assert "test accuracy" in out
  assert "bits/param/step" in out and "fp32 gradient all-reduce would send 56" \
      in out
  records = [json.loads(line) for line in
             (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [4, 8, 12]
  assert [r["step"] for r in records if "test_loss" in r] == [6, 12]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["test_accuracy"] > 0.5
  # Read off HLO: the vote exchange plus one small metrics all-reduce.
  assert 2.2 < summary["sent_bits_per_param"] < 3.0
  assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_resume_equals_uninterrupted(tmp_path):
  cfg = quick_config(tmp_path / "a", "train.checkpoint_every=6")
  full = trainer.train(cfg, progress=False, log=lambda *_: None)
  # Interrupted after step 6: only the step-6 checkpoint survives.
  for step_dir in (tmp_path / "a" / "checkpoints").iterdir():
    if step_dir.name == "12":
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(step_dir)
  resumed = trainer.train(cfg, resume=True, progress=False,
                          log=lambda *_: None)
  chex.assert_trees_all_equal(full["params"],
               resumed["params"])
  chex.assert_trees_all_equal(full["opt_state"],
               resumed["opt_state"])
  mu = full["opt_state"][0].mu
  first = jax.tree.leaves(mu)[0]
  assert not np.array_equal(first[0], first[1])   # per-worker momenta saved


def test_two_runs_are_bit_identical(tmp_path):
  """The README's claim: on one machine, the same config trains the same
  parameters to the last bit (seeded split, data order and weights)."""
  runs = [trainer.train(quick_config(tmp_path / name), progress=False,
                        log=lambda *_: None) for name in ("a", "b")]
  chex.assert_trees_all_equal(runs[0]["params"], runs[1]["params"])
  assert runs[0]["summary"] == runs[1]["summary"]


@pytest.mark.parametrize("name", ["lion", "adamw", "sgd", "signum"])
def test_every_optimizer_trains(tmp_path, name):
  cfg = quick_config(tmp_path, f"optimizer.name={name}", "train.steps=6",
                     "train.eval_every=0")
  summary = trainer.train(cfg, progress=False, log=lambda *_: None)["summary"]
  assert np.isfinite(summary["test_loss"])
  bits = summary["sent_bits_per_param"]
  if name == "signum":
    assert bits < 3.0
  else:
    assert 56 <= bits < 57         # fp32 gradient all-reduce (+ metrics)


def test_resume_checks(tmp_path, capsys):
  assert cli.main(["--set", f"run_dir={tmp_path}", "--resume",
                   "--no-progress"] + [x for s in FAST for x in ("--set", s)]
                  ) == 1
  assert "no checkpoint" in capsys.readouterr().err
  cfg = quick_config(tmp_path, "train.steps=2", "workers=4")
  trainer.train(cfg, progress=False, log=lambda *_: None)
  with pytest.raises(ValueError, match="workers=4 there, 8 here"):
    trainer.train(quick_config(tmp_path, "train.steps=2"), resume=True,
                  progress=False, log=lambda *_: None)


def test_missing_data_names_the_package(tmp_path, capsys):
  code = cli.main(["--config", "fashion_mnist_mlp", "--no-progress",
                   "--set", f"run_dir={tmp_path}",
                   "--set", "data.path=/nonexistent/fashion"])
  assert code == 1
  assert "dataset-fashion-mnist" in capsys.readouterr().err


def test_model_and_data_must_fit(tmp_path):
  with pytest.raises(ValueError, match="needs text data"):
    trainer.train(quick_config(tmp_path, "model={name: gpt}"),
                  progress=False, log=lambda *_: None)


def test_pmap_example_script():
  out = subprocess.run(
      [sys.executable, "-m", "dlion_jax.train.pmap_example", "--steps", "40",
       "--workers", "4"], capture_output=True, text=True, timeout=300,
      check=True).stdout
  accuracy = float(out.rsplit("test accuracy", 1)[1])
  assert accuracy > 0.6, out


def test_help_is_plain_text_listing_configs_and_optimizers(capsys,
                                                           monkeypatch):
  from dlion_jax.train.config import OPTIMIZER_NAMES  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("COLUMNS", "80")
  with pytest.raises(SystemExit) as exit_info:
    cli.parse_args(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  assert "``" not in text and "::" not in text
  assert max(len(line) for line in text.splitlines()) <= 80
  configs = text.split("shipped configs", 1)[1].split("\n\n", 1)[0]
  shipped = sorted(cli.CONFIG_DIR.glob("*.yaml"))
  assert len(configs.splitlines()) == 1 + len(shipped)
  for path in shipped:
    summary = cli.config_summary(path)
    assert summary and f"  {path.stem}" in configs and summary in configs
  optimizers = text.split("optimizers (", 1)[1].split("\n\n", 1)[0]
  names = [line.split()[0] for line in optimizers.splitlines()[1:]]
  assert names == list(OPTIMIZER_NAMES)
  assert "--overwrite" in text and "--resume" in text
