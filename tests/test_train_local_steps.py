"""The train CLI with optimizer.local_steps: what it sends, what it learns,
its resume and its config errors (dlion_jax.rounds in the trainer)."""

import shutil

import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

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


@pytest.mark.parametrize("outer,bits,more", [
    ("dlion", dl.wire_bits(8), []), ("nesterov", dl.allreduce_bits(8), []),
    ("voted", dl.wire_bits(8), []),
    ("voted", dl.sparse_vote_bits(8, sparse_chunk=32),
     ["optimizer.outer_sparse_chunk=32"]),
    ("voted", dl.allreduce_bits(8) / 4,
     ["optimizer.outer_fp32_mean=true", "optimizer.outer_fragments=4"])],
    ids=["dlion", "nesterov", "voted", "voted-sparse", "fp32-fragments"])
def test_the_outer_step_is_sent_once_a_round(tmp_path, outer, bits, more):
  out, lines = run(tmp_path, "optimizer.local_steps=8",
                   f"optimizer.outer={outer}", "model.hidden=[128,128]",
                   *more)
  summary = out["summary"]
  # 8 rounds in 64 steps: the outer step's bits / 8, plus the loss's mean
  # and the padding of 26,122 params' message.
  assert summary["analytic_bits_per_param"] == pytest.approx(bits / 8)
  # The voted mean's float32 scales, gathered from every worker (six,
  # a leaf's), add 3 to 4 % more here.
  assert summary["sent_bits_per_param"] == pytest.approx(
      bits / 8, rel=0.06 if outer == "voted" else 0.03)
  assert summary["test_accuracy"] > 0.5          # it learns: 10 classes
  label = (f"{outer} (fp32 mean, no vote)" if any("fp32" in x for x in more)
           else outer)
  assert f"dlion alone for 8 steps then a {label} outer step" in lines[0]
  # The model is the anchor, the same on every worker.
  anchor = dl.rounds.anchor(out["opt_state"])
  for leaf, rows in zip(jax.tree.leaves(out["params"]),
                        jax.tree.leaves(anchor)):
    np.testing.assert_array_equal(leaf, rows[0])
    np.testing.assert_array_equal(rows, np.broadcast_to(rows[0], rows.shape))


@pytest.mark.parametrize("outer", [[], [
    "optimizer.outer=voted", "optimizer.outer_late=true",
    "optimizer.outer_sparse_chunk=16"]], ids=["dlion", "voted-late"])
def test_resume_in_the_middle_of_a_round_is_bit_for_bit(tmp_path, outer):
  """Rounds end at steps 3 and 6; the run resumes from step 4, each
  worker's own params, the anchor and every state (the voted outer
  step's residuals and the late one's pending round) restored."""
  flags = ["optimizer.local_steps=3", "train.steps=8",
           "train.checkpoint_every=4", *outer]
  straight, _ = run(tmp_path, *flags)
  shutil.rmtree(tmp_path / "checkpoints" / "8")     # as if killed after 4
  resumed, lines = run(tmp_path, *flags, resume=True)
  assert "resumed from step 4" in lines
  for a, b in zip(jax.tree.leaves((straight["params"],
                                   straight["opt_state"])),
                  jax.tree.leaves((resumed["params"], resumed["opt_state"]))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("old,new,line,outer", [
    (8, 4, "momenta averaged in pairs", []),
    (4, 8, "each momentum copied to 2 workers", []),
    (8, 4, "momenta averaged in pairs", [
        "optimizer.outer=voted", "optimizer.outer_late=true",
        "optimizer.outer_sparse_chunk=16"])],
    ids=["8-4", "4-8", "8-4-voted-late"])
def test_resume_on_another_number_of_workers_keeps_the_anchor(
    tmp_path, old, new, line, outer):
  """8 workers to 4, or 4 to 8, in the middle of a round (rounds end at
  steps 3 and 6, the resume is from step 4): the anchor of step 3 goes on
  (with the voted mean, each worker's residual and pending round mapped
  as the momenta), the round ends with every worker on one anchor, and
  the run learns as the uninterrupted one does."""
  flags = ["optimizer.local_steps=3", "train.steps=8",
           "train.checkpoint_every=4", *outer]
  straight, _ = run(tmp_path, *flags, f"workers={old}")
  shutil.rmtree(tmp_path / "checkpoints" / "8")
  resumed, lines = run(tmp_path, *flags, f"workers={new}", resume=True)
  said = next(x for x in lines if x.startswith("resumed from step 4 on"))
  assert (f"{line}, each worker's params likewise, the anchor kept"
          in said), said
  anchor = dl.rounds.anchor(resumed["opt_state"])
  for leaf, rows in zip(jax.tree.leaves(resumed["params"]),
                        jax.tree.leaves(anchor)):
    assert rows.shape[0] == new
    np.testing.assert_array_equal(leaf, rows[0])
    np.testing.assert_array_equal(rows, np.broadcast_to(rows[0], rows.shape))
  losses = [r["summary"]["test_loss"] for r in (straight, resumed)]
  assert abs(losses[1] - losses[0]) < 0.2 * losses[0], losses


def test_nodes_of_several_workers_vote_across_the_nodes_once_a_round(
    tmp_path):
  """mesh.nodes=2: each node of 4 trains params of its own, its gradient
  reduced over its devices every step; the outer vote crosses the nodes
  once a round (wire_bits(2) / 8 a step), and the model is the anchor."""
  out, lines = run(tmp_path, "optimizer.local_steps=8", "mesh.nodes=2",
                   "model.hidden=[128,128]")
  assert "on 8 workers as 2 nodes of 4" in lines[0]
  summary = out["summary"]
  # Each device votes on its block, a quarter of every leaf.
  assert summary["analytic_bits_per_param_across_nodes"] == pytest.approx(
      dl.wire_bits(2) / 8 / 4)
  assert summary["sent_bits_per_param_over_data"] == pytest.approx(
      dl.wire_bits(2) / 8 / 4, rel=0.12)
  assert any("the compiler's fp32 gradient all-reduce" in x
             for x in "\n".join(lines).splitlines())
  assert summary["test_accuracy"] > 0.5
  anchor = dl.rounds.anchor(out["opt_state"])
  for leaf, rows in zip(jax.tree.leaves(out["params"]),
                        jax.tree.leaves(anchor)):
    assert rows.shape[0] == 2
    np.testing.assert_array_equal(leaf, rows[0])
    np.testing.assert_array_equal(rows[1], rows[0])


@pytest.mark.parametrize("sparse,bits", [
    ([], dl.wire_bits(2)),
    (["optimizer.outer_sparse_chunk=32"], dl.sparse_vote_bits(
        2, sparse_chunk=32))], ids=["dense", "sparse"])
def test_the_voted_mean_runs_on_nodes_with_params_sharded(tmp_path, sparse,
                                                          bits):
  """mesh.nodes=2, mesh.shard_params=true: each node's copy sharded over
  its 4 devices, the voted mean (one round late) across the nodes, each
  device voting on its quarter of every leaf; it learns, and the nodes
  end on one anchor."""
  out, lines = run(tmp_path, "optimizer.local_steps=8", "mesh.nodes=2",
                   "mesh.shard_params=true", "optimizer.outer=voted",
                   "optimizer.outer_late=true", "model.hidden=[128,128]",
                   *sparse)
  assert "on 8 workers as 2 nodes of 4" in lines[0]
  # The vote's words (a quarter of each leaf's a device) and, for the
  # sparse vote of this 26,122-parameter model, its six leaves' scales
  # and the pad of each device's last chunk: up to 45 % more.
  sent = out["summary"]["sent_bits_per_param_over_data"]
  assert bits / 8 / 4 < sent < 1.5 * bits / 8 / 4
  assert out["summary"]["test_accuracy"] > 0.3
  anchor = dl.rounds.anchor(out["opt_state"])
  placed = {tuple(x.sharding.spec) for x in jax.tree.leaves(anchor)}
  assert any("fsdp" in spec for spec in placed), placed
  for leaf, rows in zip(jax.tree.leaves(out["params"]),
                        jax.tree.leaves(anchor)):
    np.testing.assert_array_equal(leaf, rows[0])
    np.testing.assert_array_equal(rows[1], rows[0])


def test_config_mistakes_name_the_key(tmp_path):
  base = [*SMALL, f"run_dir={tmp_path}"]
  quickstart = cli.resolve_config("quickstart")
  with pytest.raises(ConfigError) as e:
    load_config(quickstart, [*base, "optimizer.local_steps=4",
                             "optimizer.momentum_sync=5"])
  assert_names(e, "optimizer.momentum_sync=5", "optimizer.momentum_sync=0")
  with pytest.raises(ConfigError, match="optimizer.local_steps=0"):
    load_config(quickstart, [*base, "optimizer.local_steps=0"])
  with pytest.raises(ConfigError, match="optimizer.outer='adam'"):
    load_config(quickstart, [*base, "optimizer.outer=adam"])
  with pytest.raises(ConfigError) as e:
    load_config(quickstart, [*base, "optimizer.local_steps=4",
                             "optimizer.outer=voted",
                             "optimizer.outer_sparse_chunk=100"])
  assert_names(e, "optimizer.outer_sparse_chunk=100", "power of two")
  with pytest.raises(ConfigError, match="optimizer.outer_step='adam'"):
    load_config(quickstart, [*base, "optimizer.outer_step=adam"])
  local = [*base, "optimizer.local_steps=4"]
  for overrides, named in [
      (["optimizer.outer=nesterov", "optimizer.outer_sparse_chunk=128"],
       ["optimizer.outer_sparse_chunk=128", "optimizer.outer=voted"]),
      (["optimizer.outer=dlion", "optimizer.outer_step=lion"],
       ["optimizer.outer_step='lion'", "not dlion"]),
      (["optimizer.outer_sparse_keep=4"],
       ["optimizer.outer_sparse_keep=4", "optimizer.outer_sparse_chunk"]),
      (["optimizer.outer_sparse_chunk=128", "optimizer.aggregation=avg"],
       ["optimizer.aggregation=avg", "optimizer.aggregation=mavo",
        "drop optimizer.outer_sparse_chunk"]),
      (["optimizer.outer_error_decay=1.5"],
       ["optimizer.outer_error_decay", "error_decay=1.5", "(0, 1]"]),
      (["optimizer.outer_error_feedback=false",
        "optimizer.outer_fragments=4"],
       ["optimizer.outer_fragments", "fragments=4", "error_feedback=True"]),
      (["optimizer.outer_sparse_chunk=128", "optimizer.outer_scale_chunk=100"],
       ["optimizer.outer_scale_chunk", "scale_chunk=100", "multiple"]),
      (["optimizer.outer_sparse_value_bits=2"],
       ["optimizer.outer_sparse_value_bits", "needs sparse_chunk"]),
      (["optimizer.outer=nesterov", "optimizer.outer_fragments=4"],
       ["optimizer.outer_fragments=4", "optimizer.outer=voted"]),
      (["optimizer.outer_fp32_mean=true", "optimizer.quantizer=ternary_l1"],
       ["optimizer.quantizer", "quantizer='ternary_l1'",
        "fp32_mean=True"]),
      (["optimizer.outer=nesterov", "optimizer.outer_fp32_mean=true"],
       ["optimizer.outer_fp32_mean=True", "optimizer.outer=voted"])]:
    with pytest.raises(ConfigError) as e:
      load_config(quickstart, [*local, *overrides])
    assert_names(e, *named)


def test_the_vote_steps_take_the_schedule_shape_at_each_round_end():
  """The dlion outer step. Zero gradients: no inner step moves, every
  pseudo-gradient is 0, which the binary vote counts as -1, so the anchor
  rises by the outer learning rate of each round: the peak times the
  cosine at the round's last step."""
  from dlion_jax.train import optimizers    # pylint: disable=import-outside-toplevel
  cfg = load_config(cli.resolve_config("quickstart"), [
      "optimizer.local_steps=4", "train.steps=16", "optimizer.warmup_steps=0",
      "optimizer.weight_decay=0", "optimizer.outer_learning_rate=0.5",
      "optimizer.outer=dlion"])
  cfg = cfg.optimizer
  tx = optimizers.build_optimizer(cfg, total_steps=16)
  schedule = optimizers.make_schedule(cfg, 16)

  def worker(params):
    state, anchors = tx.init(params), []
    for _ in range(16):
      updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state,
                                 params)
      params = dl.rounds.restart_at_anchor(
          optax.apply_updates(params, updates), state)
      anchors.append(params["w"])
    return jnp.stack(anchors)
  # Two workers: one alone would take Lion's own sign(0) = 0.
  anchors = jax.vmap(worker, axis_name="data")(
      {"w": jnp.zeros((2, 1))})[0, :, 0]
  rises = np.diff(np.asarray(anchors)[3::4], prepend=0.0)
  want = [0.5 * schedule(4 * r + 3) / cfg.learning_rate for r in range(4)]
  np.testing.assert_allclose(rises, want, rtol=1e-5)
  assert rises[0] > rises[-1] > 0


def test_a_run_that_ends_mid_round_is_warned_about():
  from dlion_jax.train.config import local_steps_warning    # pylint: disable=import-outside-toplevel
  quickstart = cli.resolve_config("quickstart")
  warn = lambda *o: local_steps_warning(load_config(quickstart, list(o)))
  assert warn("optimizer.local_steps=8", "train.steps=64") is None
  assert_names(warn("optimizer.local_steps=32", "train.steps=40"),
               "the last 8 steps end no round", "step 32's",
               "train.steps=32 or 64")
  assert_names(warn("optimizer.local_steps=32", "train.steps=20"),
               "shorter than one round", "the untrained one")
  with pytest.raises(ConfigError, match=r"optimizer.outer_momentum=1.5"):
    load_config(quickstart, ["optimizer.local_steps=4",
                             "optimizer.outer_momentum=1.5"])


def test_an_inner_allreduce_is_lookahead(tmp_path):
  """optimizer.inner_allreduce: every worker steps on the mean gradient,
  so the params stay alike, and a plain outer step of rate a is
  Lookahead's slow step (optax.lookahead, sync period H): the anchor is
  its slow params. The wire: the all-reduce every step, the outer step's
  once a round."""
  from dlion_jax.train import optimizers    # pylint: disable=import-outside-toplevel
  overrides = ["optimizer.name=lion", "optimizer.local_steps=4",
               "optimizer.outer=nesterov", "optimizer.outer_momentum=0.0",
               "optimizer.outer_learning_rate=0.5",
               "optimizer.inner_allreduce=true", "optimizer.warmup_steps=0",
               "optimizer.schedule=constant"]
  out, _ = run(tmp_path, *overrides)
  summary = out["summary"]
  assert summary["analytic_bits_per_param"] == pytest.approx(
      dl.allreduce_bits(8) * (1 + 1 / 4))
  assert summary["sent_bits_per_param"] == pytest.approx(
      dl.allreduce_bits(8) * (1 + 1 / 4), rel=0.03)
  assert summary["test_accuracy"] > 0.5
  # Against optax.lookahead on the mean gradient, three workers.
  cfg = load_config(cli.resolve_config("quickstart"), overrides).optimizer
  tx = optimizers.build_optimizer(cfg, total_steps=12)
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(12, 3, 5)).astype(np.float32)
  params = jnp.asarray(rng.normal(size=5), jnp.float32)

  def worker(gs, p):
    state = tx.init(p)
    for g in gs:
      u, state = tx.update(g, state, p)
      p = dl.rounds.restart_at_anchor(optax.apply_updates(p, u), state)
    return p, dl.rounds.anchor(state)
  mine, anchor = jax.vmap(worker, in_axes=(1, None), axis_name="data")(
      grads, params)
  ahead = optax.lookahead(optax.lion(cfg.learning_rate,
                                     weight_decay=cfg.weight_decay),
                          sync_period=4, slow_step_size=0.5)
  both = optax.LookaheadParams.init_synced(params)
  state = ahead.init(both)
  for g in grads.mean(1):
    u, state = ahead.update(jnp.asarray(g), state, both)
    both = optax.apply_updates(both, u)
  np.testing.assert_array_equal(mine[0], mine[1])
  np.testing.assert_allclose(anchor[0], both.slow, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(mine[0], both.fast, rtol=1e-6, atol=1e-7)
