"""Misuse the rest of the suite does not cover (docs/reliability.md, section
5): each case is one row of the table there. Each checks the exit code or
exception type and that the message names what the user acts on: the
argument, its value and the fix (temporary paths read ``<tmp>``); the
wording around them may change.
"""

import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

import dlion_jax as dl  # noqa: E402
from dlion_jax import devices  # noqa: E402
from dlion_jax import parallel  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402
from messages import assert_names  # noqa: E402

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


def resume_on_workers_that_cannot_share_the_batch(tmp_path, capsys):
  """Another worker count resumes (tests/test_train_elastic.py); one that
  does not divide the global batch cannot."""
  _train(tmp_path)
  return _cli(capsys, tmp_path, "--resume", "--set", "workers=3")


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
  mesh = devices.data_mesh(2)
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
  mesh = devices.data_mesh(2)
  tx = dl.distributed_lion(1e-2, axis_name="data")
  params = devices.replicate({"w": jnp.ones(4)}, mesh)
  step = parallel.make_train_step(lambda p, b: jnp.sum(p["w"] * b), tx, mesh)
  batch = devices.shard_batch(np.ones((2, 4), np.float32), mesh)
  return _raised(lambda: step(params, tx.init(params), batch))


def pmap_state_from_stacked_params(tmp_path, capsys):
  del tmp_path, capsys
  tx = dl.distributed_lion(1e-2, axis_name="data")
  params = devices.replicate_for_pmap({"w": jnp.ones(4)}, 2)
  state = parallel.init_pmap_states(tx, params, 2)    # stacked twice
  step = parallel.make_pmap_train_step(
      lambda p, b: jnp.sum(p["w"] * b), tx, devices=jax.devices()[:2])
  return _raised(lambda: step(params, state, jnp.ones((2, 4))))


def optimizer_without_axis_in_per_worker(tmp_path, capsys):
  del tmp_path, capsys
  mesh = devices.data_mesh(2)
  tx = dl.distributed_lion(1e-2)                      # no axis_name
  params = devices.replicate({"w": jnp.ones(3)}, mesh)

  def step(p, s, x):
    u, s = tx.update(jax.grad(lambda p: jnp.sum(p["w"] * x))(p), s, p)
    return optax.apply_updates(p, u), s
  fn = parallel.per_worker(step, mesh, ins=("replicated", "stacked", "split"),
                           outs=("replicated", "stacked"))
  state = parallel.init_worker_states(tx, params, mesh)
  return _raised(lambda: jax.jit(fn)(params, state, jnp.ones((2, 3))))


# case -> (exit code or exception type, what the message must name: the
# argument and its value, and the fix).
UNREADABLE = ("<tmp>/checkpoints/4", "corrupt or truncated",
              "delete that directory", "step 2")
OTHER_CONFIG = ("--resume", "<tmp>/checkpoints/4", "--overwrite",
                "--set run_dir=")
EXPECTED = {
    "corrupt_checkpoint": (1, UNREADABLE),
    "truncated_checkpoint": (1, UNREADABLE),
    "damaged_checkpoint_metadata": (1, UNREADABLE),
    "deleted_checkpoint_arrays": (1, UNREADABLE),
    "resume_with_another_model": (
        1, OTHER_CONFIG + ("model.hidden=[8] there, [9] here",)),
    "resume_on_workers_that_cannot_share_the_batch": (
        2, ("data.global_batch=", "workers=3", "divisible")),
    "resume_with_another_optimizer": (
        1, OTHER_CONFIG + ("optimizer.name='dlion' there, 'adamw' here",)),
    "resume_without_checkpoint": (
        1, ("--resume", "<tmp>/checkpoints", "run without --resume first")),
    "loss_becomes_nan": (1, ("nan", "step 2", "optimizer.learning_rate",
                             "1e+30")),
    "missing_text_file": (1, ("'<tmp>/missing.txt'", "data.path")),
    "text_without_path": (1, ("data.name='text'", "data.path")),
    "processes_do_not_divide_workers": (
        2, ("workers=8", "--num-processes=3", "divisible")),
    "bad_heartbeat_timeout": (2, ("--heartbeat-timeout=0", "at least 1")),
    "bad_coordinator_address": (
        2, ("--coordinator='localhost'", "host:port", "127.0.0.1:1234")),
    "micro_batches_zero": ("ValueError", ("micro_batches=0", "positive int")),
    "negative_min_compress_size": (
        "ValueError", ("min_compress_size=-1", ">= 0")),
    "params_not_a_float_array": (
        "TypeError", ("params leaf ['tag']", "dtype str", "optax.masked",
                      "optax.partition")),
    "state_of_another_options": (
        "TypeError", ("ErrorFeedbackState", "got DistributedLionState",
                      "tx.init(params)", "error_feedback")),
    "grads_for_other_params": (
        "ValueError", ("PyTreeDef({'w': *})", "PyTreeDef({'b': *, 'w': *})",
                       "Call `init` on the same parameters")),
    "pmap_state_from_stacked_params": (
        "ValueError", ("leaf ['w']", "shape (4,)", "shape (2, 4)",
                       "init_pmap_states(tx, params)", "replicate_for_pmap")),
    "optimizer_without_axis_in_per_worker": (
        "ValueError", ("leaf ['w']", "exchanges nothing over 'data'",
                       "axis_name='data'")),
    "replicated_state_not_per_worker": (
        "ValueError", ("leaf [0].count", "shape ()", "size 2",
                       "parallel.init_worker_states(tx, params, mesh)")),
}


CASES = [corrupt_checkpoint, truncated_checkpoint, damaged_checkpoint_metadata,
         deleted_checkpoint_arrays, resume_with_another_model,
         resume_on_workers_that_cannot_share_the_batch,
         resume_with_another_optimizer,
         resume_without_checkpoint, loss_becomes_nan, missing_text_file,
         text_without_path, processes_do_not_divide_workers,
         bad_heartbeat_timeout, bad_coordinator_address, micro_batches_zero,
         negative_min_compress_size, params_not_a_float_array,
         state_of_another_options, grads_for_other_params,
         replicated_state_not_per_worker, pmap_state_from_stacked_params,
         optimizer_without_axis_in_per_worker]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_misuse_gives_the_documented_error(case, tmp_path, capsys):
  kind, message = case(tmp_path, capsys)
  message = message.replace(str(tmp_path), "<tmp>")
  print(f"\nCASE {case.__name__}\t{kind}\t{message}")
  want_kind, names = EXPECTED[case.__name__]
  assert kind == want_kind, message
  assert_names(message, *names)


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
