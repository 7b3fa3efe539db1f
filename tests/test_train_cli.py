"""The training CLI end to end: quickstart, resume, optimizers, errors."""

import argparse
import json
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from jax.errors import JaxRuntimeError

pytest.importorskip("flax")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration

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
       "--set", f"run_dir={tmp_path}",
       *[a for s in FAST for a in ("--set", s)]],
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
  # Another number of workers resumes (tests/test_train_elastic.py), but a
  # finished run has nothing left to train.
  with pytest.raises(ValueError, match="already reached step 2"):
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


@pytest.mark.parametrize("module, package, program, argv", [
    ("yaml", "pyyaml", "dlion_jax.train", ["--help"]),
    ("flax", "flax", "dlion_jax.train", ["--no-progress"]),
    ("sklearn", "scikit-learn", "dlion_jax.train", ["--no-progress"]),
    ("flax", "flax", "dlion_jax.train.pmap_example", ["--steps", "1"]),
])
def test_without_the_examples_extra_says_how_to_install_it(
    tmp_path, module, package, program, argv):
  """``sys.modules[module] = None`` makes its import fail as it does when
  the package is not installed (was: a ModuleNotFoundError traceback)."""
  if program == "dlion_jax.train" and argv != ["--help"]:
    argv += ["--set", "train.steps=2", "--set", f"run_dir={tmp_path}"]
  code = (f"import runpy, sys; sys.modules[{module!r}] = None; "
          f"sys.argv = ['x', *{argv!r}]; "
          f"runpy.run_module({program!r}, run_name='__main__')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 1, out.stderr
  assert out.stderr.splitlines() == [
      f"error: python -m {program} needs the [examples] extra (flax, "
      "orbax-checkpoint, pyyaml, tqdm, matplotlib, scikit-learn), and "
      f'{package} is not installed. Install it with: pip install '
      '"dlion_jax[examples]" (in a clone of the repository: pip install -e '
      '".[examples]")']


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


# What a survivor's collectives raise when the other process is gone
# (docs/reliability.md, section 3; tests/test_faults.py).
PEER_LOST = [
    "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/"
    "pair.cc:538] Read error [127.0.0.1]:50397: Connection reset by peer",
    "UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    "heartbeats):\n/job:jax_worker/replica:0/task:1",
    "Terminating process because the JAX distributed service detected fatal "
    "errors. This most likely indicates that another task died",
    "INTERNAL: Failed to send RPC to coordination service. Either the leader "
    "task was preempted/died/restarted unexpectedly",
    "Gloo all-reduce failed: [pair.cc:589] Socket closed",
    "UNAVAILABLE: failed to connect to all addresses; last error: "
    "ipv4:127.0.0.1:4711: Connection refused",
]
NOT_PEER_LOST = {
    "out of memory": JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "4294967296 bytes."),
    "invalid argument": JaxRuntimeError(
        "INVALID_ARGUMENT: Executable expected shape f32[8,128] for "
        "argument 0 but got incompatible shape f32[8,64]"),
    "barrier in another sense": ValueError(
        "data.barrier must be a fraction in [0, 1], got 3"),
    "gloo named": ValueError("jax_cpu_collectives_implementation 'gloo2' "
                             "is not one of ['gloo', 'mpi']"),
    "own socket": ConnectionRefusedError(111, "Connection refused"),
}


def _raised_from(error, outer):
  """``outer`` as ``raise outer from error`` leaves it."""
  try:
    try:
      raise error
    except type(error) as inner:
      raise outer from inner
  except type(outer) as caught:
    return caught


@pytest.mark.parametrize("message", PEER_LOST)
def test_lost_peer_recognises_a_dead_process(message):
  assert cli.lost_peer(JaxRuntimeError(message))
  wrapped = _raised_from(JaxRuntimeError(message), RuntimeError("step 7"))
  assert cli.lost_peer(wrapped)


@pytest.mark.parametrize("error", NOT_PEER_LOST.values(),
                         ids=NOT_PEER_LOST.keys())
def test_other_errors_are_not_a_lost_peer(error):
  assert not cli.lost_peer(error)
  assert not cli.lost_peer(_raised_from(error, RuntimeError("step 7")))


def _two_process_run(tmp_path, monkeypatch, error):
  """cli._train as process 0 of 2 whose training raises ``error``;
  ``os._exit`` raises SystemExit instead of ending pytest."""
  def train(*args, **kwargs):
    raise error

  def exit_now(code):
    raise SystemExit(f"os._exit({code})")

  monkeypatch.setattr(trainer, "train", train)
  monkeypatch.setattr(cli.os, "_exit", exit_now)
  args = argparse.Namespace(num_processes=2, process_id=0, resume=False,
                            overwrite=False, no_progress=True,
                            resize_policy="mean")
  return lambda: cli._train(quick_config(tmp_path), args)  # pylint: disable=protected-access


def test_cli_reports_other_errors_as_themselves(tmp_path, monkeypatch,
                                                capsys):
  oom = NOT_PEER_LOST["out of memory"]
  with pytest.raises(JaxRuntimeError) as caught:     # with its traceback
    _two_process_run(tmp_path, monkeypatch, oom)()
  assert caught.value is oom
  assert "lost contact" not in capsys.readouterr().err
  barrier = NOT_PEER_LOST["barrier in another sense"]
  assert _two_process_run(tmp_path, monkeypatch, barrier)() == 1
  assert capsys.readouterr().err == f"error: {barrier}\n"


def test_cli_reports_a_lost_peer_and_exits_at_once(tmp_path, monkeypatch,
                                                   capsys):
  with pytest.raises(SystemExit, match=r"os\._exit\(1\)"):
    _two_process_run(tmp_path, monkeypatch, JaxRuntimeError(PEER_LOST[0]))()
  err = capsys.readouterr().err
  assert err.startswith("error: process 0 of 2 lost contact with the other "
                        "processes")
  assert "Connection reset by peer" in err and "restart without --resume" \
      in err
