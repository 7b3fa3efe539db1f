"""The train CLI on a hybrid mesh (``mesh: {nodes: n}``): the key and its
checks, the global optimizers and Lion Cub's options on shards,
``--resume`` bit for bit with the sharded state, and the wire report."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from messages import assert_names

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from dlion_jax import devices  # noqa: E402
from dlion_jax import parallel  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import optimizers  # noqa: E402
from dlion_jax.train import rundir  # noqa: E402
from dlion_jax.train import trainer  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

TINY = ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=0",
        "train.log_every=4", "model.hidden=[8]", "train.keep_checkpoints=5",
        "mesh.nodes=2"]


def _config(run_dir, *overrides):
  return load_config(cli.resolve_config("quickstart"),
                     TINY + [f"run_dir={run_dir}", *overrides])


def test_no_hybrid_layout_by_default():
  cfg = load_config(cli.resolve_config(None))
  assert cfg.mesh.nodes is None
  assert rundir.comparable(cfg)["mesh.nodes"] is None
  assert trainer.make_mesh(cfg).axis_names == ("data",)
  shipped = load_config(cli.resolve_config("fashion_mlp_hybrid"))
  assert shipped.mesh.nodes == 2
  assert trainer.make_mesh(shipped).shape == {"data": 2, "fsdp": 4}


def test_checkpoints_from_before_the_key_resume_as_unhybrid():
  cfg = load_config(cli.resolve_config(None))
  old = {k: v for k, v in rundir.comparable(cfg).items() if k != "mesh.nodes"}
  saved = trainer._saved_config({"config": old})  # pylint: disable=protected-access
  assert rundir.differences(saved, cfg) == []
  assert saved["mesh.nodes"] is None
  # The layout may change on resume (the trainer resizes the state).
  hybrid = load_config(cli.resolve_config(None), ["mesh.nodes=2"])
  assert rundir.differences(saved, hybrid) == []


# override, the key the error names (for the CLI to locate), its message
BAD_LAYOUTS = [
    (["mesh.nodes=3"], "mesh.nodes", r"^mesh\.nodes=3 must be a positive "
     r"divisor of workers=8: each node gets workers / nodes devices\. Use one "
     r"of 1, 2, 4, 8, or null for no hybrid layout\.$"),
    (["mesh.nodes=0"], "mesh.nodes", r"mesh\.nodes=0 must be a positive"),
    (["mesh.nodes=4", "workers=6", "data.global_batch=252"], "mesh.nodes",
     r"mesh\.nodes=4 .* workers=6: .* Use one of 1, 2, 3, 6,"),
    (["mesh.nodes=true"], None, r"mesh\.nodes=True has type bool"),
    (["mesh=2"], None, r"mesh must be a mapping"),
    (["mesh.rows=2"], None, r"Unknown config key 'mesh\.rows'.*nodes"),
]


@pytest.mark.parametrize("override,key,message", BAD_LAYOUTS)
def test_bad_layouts_are_config_errors(override, key, message):
  with pytest.raises(ConfigError, match=message) as error:
    load_config(cli.resolve_config(None), override)
  assert error.value.key == key


def test_cli_names_the_file_and_line(tmp_path, capsys):
  config = tmp_path / "mine.yaml"
  config.write_text("name: mine\nmodel: {name: mlp}\nmesh:\n  nodes: 3\n")
  assert cli.main(["--config", str(config)]) == 2
  assert capsys.readouterr().err.splitlines() == [
      f"config error: {config}, line 4: mesh.nodes=3 must be a positive "
      "divisor of workers=8: each node gets workers / nodes devices. Use one "
      "of 1, 2, 4, 8, or null for no hybrid layout."]
  assert cli.main(["--config", str(config), "--set", "mesh.nodes=5"]) == 2
  assert capsys.readouterr().err.startswith(
      "config error: --set mesh.nodes=5: mesh.nodes=5 must be")


def _linear_loss(params, batch):
  """Gradient: the mean of the worker's batch rows (here one row each)."""
  return sum(jnp.sum(params[k] * batch[k].mean(0)) for k in params)


def _run(tx, mesh, shard_axis, params, batches):
  step = parallel.make_train_step(_linear_loss, tx, mesh,
                                  shard_axis=shard_axis, donate=False)
  p = devices.replicate(params, mesh)
  state = parallel.init_worker_states(tx, p, mesh, shard_axis=shard_axis)
  spec = jax.P(("data", "fsdp") if shard_axis else "data")
  for rows in batches:
    p, state, _ = step(p, state, jax.device_put(
        rows, jax.sharding.NamedSharding(mesh, spec)))
  return p, state


@pytest.mark.parametrize("name", ["lion", "adamw", "sgd"])
def test_global_optimizers_on_shards_equal_them_whole(name):
  """pmean_gradients over "data" on node means is the global mean: on
  small integers (exact means) the same gradients, so the same params and
  the same state in each node's row, up to the rounding where XLA fuses
  optax's own update unlike the flat step's (a multiply-add contracted in
  one and not the other: AdamW's second moment, SGD's trace)."""
  cfg = load_config(cli.resolve_config(None), [
      f"optimizer.name={name}", "optimizer.learning_rate=0.1",
      "optimizer.weight_decay=0.1", "optimizer.warmup_steps=0"]).optimizer
  tx = optimizers.build_optimizer(cfg, total_steps=3)
  rng = np.random.default_rng(0)
  params = {"b": rng.normal(size=7).astype(np.float32),
            "w": rng.normal(size=(3, 5)).astype(np.float32)}
  batches = [{k: rng.integers(-3, 4, size=(8,) + v.shape).astype(np.float32)
              for k, v in params.items()} for _ in range(3)]
  flat, flat_state = _run(tx, devices.data_mesh(8), None, params, batches)
  hybrid, state = _run(tx, devices.hybrid_mesh(2, devices=jax.devices()[:8]),
                       "fsdp", params, batches)
  for k in params:
    np.testing.assert_allclose(np.asarray(hybrid[k]), np.asarray(flat[k]),
                               rtol=1e-6, atol=1e-7)
  for whole, nodes in zip(jax.tree.leaves(flat_state),
                          jax.tree.leaves(state)):
    whole, nodes = np.asarray(whole), np.asarray(nodes)
    assert nodes.shape == (2,) + whole.shape[1:]   # a row per node
    for node in nodes:             # the global state, on every worker
      if node.dtype.kind == "f":
        np.testing.assert_allclose(node, whole[0], rtol=1e-6, atol=1e-7)
      else:
        np.testing.assert_array_equal(node, whole[0])


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
  """A hybrid dlion run of 8 steps with checkpoints at 4 and 8."""
  run_dir = tmp_path_factory.mktemp("hybrid") / "run"
  lines = []
  out = trainer.train(_config(run_dir), progress=False, log=lines.append)
  return run_dir, out, "\n".join(lines)


@pytest.mark.integration
def test_resume_equals_uninterrupted(hybrid_run, tmp_path):
  run_dir, full, _ = hybrid_run
  shutil.copytree(run_dir, tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")    # killed after 4
  (tmp_path / "run" / "summary.json").unlink()
  resumed = trainer.train(_config(tmp_path / "run"), resume=True,
                          progress=False, log=lambda *_: None)
  chex.assert_trees_all_equal(full["params"], resumed["params"])
  chex.assert_trees_all_equal(full["opt_state"], resumed["opt_state"])
  mu = jax.tree.leaves(full["opt_state"][0].mu)
  assert [m.shape for m in mu] == [
      (2,) + x.shape for x in jax.tree.leaves(full["params"])]
  first = np.asarray(mu[0])
  assert not np.array_equal(first[0], first[1])    # each node's momentum


@pytest.mark.integration
def test_resume_on_another_layout_resizes(hybrid_run, tmp_path, capsys):
  """Was: refused ("mesh.nodes=2 there, 4 here"). The state's rows (one a
  node) are resized (dlion_jax.elastic) and the run says how."""
  run_dir, _, _ = hybrid_run
  argv = ["--no-progress", "--resume"] + [
      a for s in TINY + [f"run_dir={tmp_path / 'run'}"] for a in ("--set", s)]
  for nodes, what in (("4", "on 4 nodes of 2 from 2 nodes of 4: each "
                       "momentum copied to 2 nodes"),
                      ("null", "on 8 workers from 2 nodes of 4: each "
                       "momentum copied to 4 workers")):
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")
    (tmp_path / "run" / "summary.json").unlink()
    assert cli.main(argv + ["--set", f"mesh.nodes={nodes}"]) == 0
    assert f"resumed from step 4 {what}" in capsys.readouterr().out


@pytest.mark.integration
def test_resume_refuses_a_state_of_a_row_per_device(hybrid_run, tmp_path):
  """A checkpoint of the earlier hybrid layout, its state a row per device
  (its metadata without "state_rows"), is refused with the fix, not
  restored into the wrong shapes."""
  run_dir, _, _ = hybrid_run
  shutil.copytree(run_dir, tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")
  metas = [f for f in (tmp_path / "run" / "checkpoints" / "4").rglob("*")
           if f.is_file() and b'"state_rows"' in f.read_bytes()]
  assert len(metas) == 1
  meta = json.loads(metas[0].read_text())
  assert meta.pop("state_rows") == 2
  metas[0].write_text(json.dumps(meta))
  with pytest.raises(ValueError) as e:
    trainer.train(_config(tmp_path / "run"), resume=True, progress=False,
                  log=lambda *_: None)
  assert_names(e, "step 4", "8 rows, one per device", "cannot be resumed",
               "--overwrite", "--set run_dir=...")


@pytest.mark.integration
def test_wire_report_counts_both_axes(hybrid_run):
  run_dir, out, text = hybrid_run
  summary = out["summary"]
  assert summary == json.loads((run_dir / "summary.json").read_text())
  # Votes of 2 nodes on 1/4 of the params, fp32 inside a node (48 bits).
  assert summary["analytic_bits_per_param_across_nodes"] == 0.25
  assert summary["analytic_bits_per_param_inside_nodes"] == 48
  assert summary["analytic_bits_per_param"] == 48.25
  # Read off the HLO: those, plus the means of the loss and accuracy over
  # both axes, and the bias of 10 that 4 devices cannot divide: its
  # gradient all-reduced and its vote's 3-entry chunks gathered, a tiny
  # model's overhead.
  assert 48.25 <= summary["sent_bits_per_param"] < 49.25
  assert "dlion on 8 workers as 2 nodes of 4 (cpu)" in text
  # Measured per axis (dl.collective_bytes_by_axis): the vote across the
  # nodes (plus padding to words: a tiny model) and the metrics' mean; fp32
  # inside a node (the 610 params: 600 reduce-scattered and gathered, the
  # bias of 10 as above, the metrics); together the total.
  across = summary["sent_bits_per_param_over_data"]
  inside = summary["sent_bits_per_param_over_fsdp"]
  assert 0.25 <= across < 0.4
  assert inside == pytest.approx(
      (2 * 3 / 4 * 4 * 600 + 2 * 3 / 4 * 4 * 10 + 3 * 3 * 4 + 2 * 6) * 8 / 610)
  assert "sent_bits_per_param_over_data+fsdp" not in summary
  assert across + inside == pytest.approx(summary["sent_bits_per_param"])
  assert (f"of which {across:.3f} bits/param/step across the 2 nodes "
          "(analytic 0.250), ") in text
  assert (f"across the nodes, what the slow links carry: {across:.3f} "
          "bits/param/step; an fp32 all-reduce of the shards (global Lion "
          f"on this layout) would send 8.000 ({8 / across:.1f}x more)") in text


@pytest.mark.integration
def test_global_optimizer_trains_on_the_layout(tmp_path):
  cfg = _config(tmp_path, "optimizer.name=adamw", "train.steps=4")
  summary = trainer.train(cfg, progress=False, log=lambda *_: None)["summary"]
  assert np.isfinite(summary["test_loss"])
  # Reduce-scatter and all-gather in a node, an fp32 all-reduce of 1/4 of
  # the params across 2 nodes: what a flat fp32 all-reduce over 8 sends
  # (plus, on this tiny model, the metrics and the bias of 10 above).
  assert summary["analytic_bits_per_param"] == 56
  assert 56 <= summary["sent_bits_per_param"] < 57


@pytest.mark.integration
def test_lion_cub_options_train_on_the_layout(tmp_path):
  """Whole-leaf options (L1 scales, error feedback) and momentum syncs run
  on the shards; the wire report still matches the analytic count (which
  leaves out per-leaf scales and padding: hence a model of 4,810 params)."""
  cfg = _config(tmp_path, "train.steps=4", "optimizer.quantizer=pbit_l1",
                "optimizer.bits=3", "optimizer.error_feedback=true",
                "optimizer.momentum_sync=2", "model.hidden=[64]")
  summary = trainer.train(cfg, progress=False, log=lambda *_: None)["summary"]
  assert np.isfinite(summary["test_loss"])
  across = summary["analytic_bits_per_param_across_nodes"]
  assert across == optimizers.analytic_bits_per_param(cfg.optimizer, 2,
                                                      steps=4) / 4
  assert 0 <= summary["sent_bits_per_param"] - (48 + across) < 0.25


def test_shard_params_needs_nodes():
  with pytest.raises(ConfigError, match=r"mesh\.shard_params=true shards "
                     r"the params over each node's devices, but mesh\.nodes "
                     r"is not set") as error:
    load_config(cli.resolve_config(None), ["mesh.shard_params=true"])
  assert error.value.key == "mesh.shard_params"
  shipped = load_config(cli.resolve_config("fashion_mlp_fsdp"))
  assert shipped.mesh.nodes == 2 and shipped.mesh.shard_params


@pytest.mark.integration
def test_fsdp_run_shards_params_votes_across_nodes_and_resumes(hybrid_run,
                                                               tmp_path):
  """mesh.shard_params: params and momenta sharded over each node's
  devices at rest, 1/4 of the vote across the nodes, the same bytes as
  replicated params, --resume bit for bit with the sharded state."""
  fsdp = ["mesh.shard_params=true"]
  full = trainer.train(_config(tmp_path / "run", *fsdp), progress=False,
                       log=lambda *_: None)
  placed = {tuple(x.sharding.spec) for x in jax.tree.leaves(full["params"])}
  assert ("fsdp",) in placed or (None, "fsdp") in placed
  mu = jax.tree.leaves(full["opt_state"][0].mu)
  assert {m.shape[1:] for m in mu} == {
      x.shape for x in jax.tree.leaves(full["params"])}   # whole leaves
  # The vote of a quarter of each leaf and the metrics' mean over the
  # nodes, as with replicated params; inside a node the params' all-gather
  # takes the place of the updates'.
  hand = hybrid_run[1]["summary"]
  assert full["summary"]["sent_bits_per_param_over_data"] == (
      hand["sent_bits_per_param_over_data"])
  assert full["summary"]["sent_bits_per_param_over_fsdp"] == pytest.approx(
      hand["sent_bits_per_param_over_fsdp"])
  shutil.copytree(tmp_path / "run", tmp_path / "again")
  shutil.rmtree(tmp_path / "again" / "checkpoints" / "8")
  (tmp_path / "again" / "summary.json").unlink()
  resumed = trainer.train(_config(tmp_path / "again", *fsdp), resume=True,
                          progress=False, log=lambda *_: None)
  chex.assert_trees_all_equal(full["params"], resumed["params"])
  chex.assert_trees_all_equal(full["opt_state"], resumed["opt_state"])
