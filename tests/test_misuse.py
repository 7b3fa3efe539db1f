"""Misuse the rest of the suite does not cover (docs/reliability.md, section
5): each case is one row of the table there, with the exact text the user
sees. ``…`` in an expected message stands for a part that varies (orbax's
own diagnosis, file hashes); temporary paths read ``<tmp>``.
"""

import pathlib
import re
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

import dlion_jax as dl  # noqa: E402
from dlion_jax import parallel  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration

TINY = ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0",
        "train.log_every=2", "model.hidden=[8]"]


def _cli(capsys, tmp_path, *argv):
  """Runs the train CLI in this process: (exit code, last stderr line)."""
  code = cli.main(["--no-progress", "--set", f"run_dir={tmp_path}",
                   *[a for s in TINY for a in ("--set", s)], *argv])
  err = capsys.readouterr().err.strip().splitlines()
  return code, err[-1] if err else ""


def _train(tmp_path, *overrides):
  cfg = load_config(cli.resolve_config("quickstart"),
                    TINY + [f"run_dir={tmp_path}", *overrides])
  return trainer.train(cfg, progress=False, log=lambda *_: None)


def _damage(tmp_path, how):
  """Damages every file of the latest checkpoint's arrays."""
  for f in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
    if f.is_file():
      f.write_bytes(b"\0garbage" * 4 if how == "garbage"
                    else f.read_bytes()[:f.stat().st_size // 2])


def corrupt_checkpoint(tmp_path, capsys):
  _train(tmp_path)
  _damage(tmp_path, "garbage")
  return _cli(capsys, tmp_path, "--resume")


def truncated_checkpoint(tmp_path, capsys):
  _train(tmp_path)
  _damage(tmp_path, "truncate")
  return _cli(capsys, tmp_path, "--resume")


def damaged_checkpoint_metadata(tmp_path, capsys):
  _train(tmp_path)
  (tmp_path / "checkpoints" / "4" / "meta" / "metadata").write_text("{oops")
  return _cli(capsys, tmp_path, "--resume")


def deleted_checkpoint_arrays(tmp_path, capsys):
  _train(tmp_path)
  shutil.rmtree(tmp_path / "checkpoints" / "4" / "state")
  return _cli(capsys, tmp_path, "--resume")


def resume_with_another_model(tmp_path, capsys):
  _train(tmp_path)
  return _cli(capsys, tmp_path, "--resume", "--set", "model.hidden=[9]")


def resume_with_another_worker_count(tmp_path, capsys):
  _train(tmp_path)
  return _cli(capsys, tmp_path, "--resume", "--set", "workers=4")


def resume_with_another_optimizer(tmp_path, capsys):
  _train(tmp_path)
  return _cli(capsys, tmp_path, "--resume", "--set", "optimizer.name=adamw")


def resume_without_checkpoint(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--resume")


def loss_becomes_nan(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--set", "optimizer.learning_rate=1e30",
              "--set", "optimizer.warmup_steps=0", "--set", "train.steps=20")


def missing_text_file(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--config", "charlm_gpt",
              "--set", f"data.path={tmp_path}/missing.txt")


def text_without_path(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--set", "data.name=text",
              "--set", "data.path=null")


def processes_do_not_divide_workers(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--num-processes", "3",
              "--coordinator", "127.0.0.1:1")


def bad_heartbeat_timeout(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--num-processes", "2", "--process-id", "1",
              "--coordinator", "127.0.0.1:1", "--heartbeat-timeout", "0",
              "--set", "workers=2")


def bad_coordinator_address(tmp_path, capsys):
  return _cli(capsys, tmp_path, "--num-processes", "2", "--process-id", "1",
              "--coordinator", "localhost", "--set", "workers=2")


def _raised(fn):
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    return type(e).__name__, str(e)
  pytest.fail("no error raised")


def micro_batches_zero(tmp_path, capsys):
  del tmp_path, capsys
  mesh = parallel.data_mesh(2)
  return _raised(lambda: parallel.make_train_step(
      lambda p, b: 0.0, optax.sgd(1.0), mesh, micro_batches=0))


def negative_min_compress_size(tmp_path, capsys):
  del tmp_path, capsys
  return _raised(lambda: dl.distributed_lion(1e-3, min_compress_size=-1))


def params_not_a_float_array(tmp_path, capsys):
  del tmp_path, capsys
  tx = dl.distributed_lion(1e-3)
  return _raised(lambda: tx.init({"w": jnp.zeros(3), "tag": "conv"}))


def state_of_another_options(tmp_path, capsys):
  del tmp_path, capsys
  params = {"w": jnp.zeros(3)}
  state = dl.scale_by_distributed_lion().init(params)
  tx = dl.scale_by_distributed_lion(error_feedback=True)
  return _raised(lambda: tx.update(params, state))


def grads_for_other_params(tmp_path, capsys):
  del tmp_path, capsys
  tx = dl.scale_by_distributed_lion()
  state = tx.init({"w": jnp.zeros(3), "b": jnp.zeros(2)})
  return _raised(lambda: tx.update({"w": jnp.zeros(3)}, state))


def replicated_state_not_per_worker(tmp_path, capsys):
  del tmp_path, capsys
  mesh = parallel.data_mesh(2)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  params = parallel.replicate({"w": jnp.ones(4)}, mesh)
  step = parallel.make_train_step(lambda p, b: jnp.sum(p["w"] * b), tx, mesh)
  batch = parallel.shard_batch(np.ones((2, 4), np.float32), mesh)
  return _raised(lambda: step(params, tx.init(params), batch))


# case -> (exit code or exception type, exact message with … wildcards).
UNREADABLE = ("error: Checkpoint <tmp>/checkpoints/4 is unreadable: it is "
        "corrupt or truncated (…). Orbax never finalizes a half-written "
        "checkpoint, so its files were damaged afterwards; delete that "
        "directory to resume from step 2.")
OTHER_CONFIG = ("error: --resume: checkpoint <tmp>/checkpoints/4 was written "
                "with another config: {}. Resume with the checkpoint's "
                "values, or start a new run instead of --resume "
                "(--overwrite, or --set run_dir=...).")
EXPECTED = {
    "corrupt_checkpoint": (1, UNREADABLE),
    "truncated_checkpoint": (1, UNREADABLE),
    "damaged_checkpoint_metadata": (1, UNREADABLE),
    "deleted_checkpoint_arrays": (1, UNREADABLE),
    "resume_with_another_model": (1, OTHER_CONFIG.format(
        "model.hidden=[8] there, [9] here")),
    "resume_with_another_worker_count": (1, OTHER_CONFIG.format(
        "workers=8 there, 4 here")),
    "resume_with_another_optimizer": (1, OTHER_CONFIG.format(
        "optimizer.name='dlion' there, 'adamw' here")),
    "resume_without_checkpoint": (
        1, "error: --resume: no checkpoint in <tmp>/checkpoints; run without "
        "--resume first (checkpoints are written every "
        "train.checkpoint_every steps and at the end)."),
    "loss_becomes_nan": (1, "error: loss became nan at step 2; lower "
                         "optimizer.learning_rate (now 1e+30)."),
    "missing_text_file": (
        1, "error: Text file '<tmp>/missing.txt' not found; set data.path in "
        "the config to a file whose bytes to train on (any text file, e.g. a "
        "book or source code)."),
    "text_without_path": (
        1, "error: data.name='text' needs data.path: the file to model (any "
        "text file, read as bytes)."),
    "processes_do_not_divide_workers": (
        2, "config error: workers=8 must be divisible by --num-processes=3."),
    "bad_heartbeat_timeout": (
        2, "config error: --heartbeat-timeout=0 must be at least 1 "
        "(seconds)."),
    "bad_coordinator_address": (
        2, "config error: --coordinator 'localhost': expected host:port, "
        "e.g. 127.0.0.1:1234."),
    "micro_batches_zero": (
        "ValueError", "micro_batches must be a positive int, got "
        "micro_batches=0."),
    "negative_min_compress_size": (
        "ValueError", "min_compress_size must be an int >= 0 (leaves with "
        "fewer elements skip the vote), got min_compress_size=-1."),
    "params_not_a_float_array": (
        "TypeError", "params leaf ['tag'] has dtype str; distributed Lion "
        "only updates floating-point leaves. Keep integer/bool state out of "
        "the optimized pytree, or exclude it with optax.masked / "
        "optax.partition."),
    "state_of_another_options": (
        "TypeError", "state must be the ErrorFeedbackState made by this "
        "transform's `init`, got DistributedLionState. Re-create the "
        "optimizer state with `tx.init(params)` when switching optimizers or "
        "options (error_feedback changes the state)."),
    "grads_for_other_params": (
        "ValueError", "The gradient pytree does not match the optimizer "
        "state's momentum: updates have structure PyTreeDef({'w': *}), "
        "state.mu has PyTreeDef({'b': *, 'w': *}). Call `init` on the same "
        "parameters whose gradients you pass to `update`."),
    "replicated_state_not_per_worker": (
        "ValueError", "optimizer state leaf [0].count has shape (); the step "
        "wants every worker's state stacked on a leading axis of size 2. "
        "Build it with parallel.init_worker_states(tx, params, mesh), not "
        "tx.init(params)."),
}


CASES = [corrupt_checkpoint, truncated_checkpoint, damaged_checkpoint_metadata,
         deleted_checkpoint_arrays, resume_with_another_model,
         resume_with_another_worker_count, resume_with_another_optimizer,
         resume_without_checkpoint, loss_becomes_nan, missing_text_file,
         text_without_path, processes_do_not_divide_workers,
         bad_heartbeat_timeout, bad_coordinator_address, micro_batches_zero,
         negative_min_compress_size, params_not_a_float_array,
         state_of_another_options, grads_for_other_params,
         replicated_state_not_per_worker]


def _pattern(message: str) -> str:
  return ".*".join(re.escape(part) for part in message.split("…"))


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_misuse_gives_the_documented_error(case, tmp_path, capsys):
  kind, message = case(tmp_path, capsys)
  message = message.replace(str(tmp_path), "<tmp>")
  print(f"\nCASE {case.__name__}\t{kind}\t{message}")
  want_kind, want = EXPECTED[case.__name__]
  assert kind == want_kind, message
  assert re.fullmatch(_pattern(want), message, flags=re.S), message


DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


def test_reliability_doc_lists_every_case_and_real_tests():
  """docs/reliability.md's misuse table: every case here is a row, and every
  test a row names exists."""
  text = DOC.read_text(encoding="utf-8")
  table = text.split("## 5. Misuse", 1)[1].split("\n## ", 1)[0]
  rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
  assert len(rows) >= 15
  for case in CASES:
    assert f"[{case.__name__}]" in table, case.__name__
  tests_dir = DOC.parent.parent / "tests"
  for row in rows:
    named = re.findall(r"tests/(test_\w+\.py)::(test_\w+)", row)
    assert named or "test_misuse.py::…[" in row, row
    for file, test in named:
      assert f"def {test}(" in (tests_dir / file).read_text(), (file, test)
