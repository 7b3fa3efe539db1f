"""Faulty workers for the studies (dlion_jax.train.faults), the CLI's
switches (faults.*, optimizer.abstain_nonfinite) and a fast run of
benchmarks.faults."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="the train CLI needs the [examples] extra")

from benchmarks import faults as study  # noqa: E402
from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train import faults  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration


def injected(kind, workers, grads, **kw):
  tx = faults.faulty_workers(kind, workers, **kw)

  def worker(g):
    state = tx.init(g)
    out, state = tx.update(g, state)
    return out, state.count
  return jax.vmap(worker, axis_name="data")(grads)


@pytest.mark.parametrize("kind", ["sign_flip", "scale", "random",
                                  "nonfinite"])
def test_only_the_first_workers_are_faulty(kind):
  grads = {"w": jnp.arange(1.0, 25.0).reshape(4, 6), "b": jnp.ones((4, 2))}
  out, count = injected(kind, 2, grads, nan_rate=1.0)
  for k in grads:
    np.testing.assert_array_equal(out[k][2:], grads[k][2:])   # healthy
    bad, good = np.asarray(out[k][:2]), np.asarray(grads[k][:2])
    if kind == "sign_flip":
      np.testing.assert_array_equal(bad, -good)
    elif kind == "scale":
      np.testing.assert_array_equal(bad, good * 1e6)
    elif kind == "nonfinite":
      assert np.isnan(bad).all()
    else:   # random: not the gradient, of its size
      assert not np.allclose(bad, good)
      assert 0.3 < np.sqrt(np.mean(bad ** 2) / np.mean(good ** 2)) < 3
  np.testing.assert_array_equal(count, 1)


def test_nonfinite_strikes_on_a_share_of_the_steps():
  tx = faults.faulty_workers("nonfinite", 1, nan_rate=0.3)
  g = jnp.ones((2, 3))

  def steps(g):
    state, hit = tx.init(g), []
    for _ in range(100):
      out, state = tx.update(g, state)
      hit.append(jnp.isnan(out).any())
    return jnp.stack(hit)
  hits = np.asarray(jax.vmap(steps, axis_name="data")(g))
  assert not hits[1].any()
  assert 0.15 < hits[0].mean() < 0.45


@pytest.mark.parametrize("setting,named", [
    (["faults.workers=9"], "faults.workers=9 is more than the workers=8"),
    (["faults.kind=flip"], "faults.kind='flip' is not one of"),
    (["faults.on=pseudo_gradients"],
     "faults.on=pseudo_gradients needs local steps"),
    (["faults.on=outer"], "faults.on='outer' is not one of"),
])
def test_bad_fault_settings_are_named(setting, named):
  with pytest.raises(ConfigError, match=named):
    load_config(cli.resolve_config("quickstart"), setting)


def _run(run_dir, *settings):
  code = cli.main(["--no-progress", *[a for s in (
      "train.eval_every=0", "model.hidden=[8]", "optimizer.warmup_steps=0",
      *settings, f"run_dir={run_dir}") for a in ("--set", s)]])
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  return code, [json.loads(line) for line in lines]


def test_a_worker_whose_scale_is_huge_counts_as_twice_the_median(tmp_path):
  """faults.on=pseudo_gradients: worker 0 sends the voted mean a
  pseudo-gradient (and so a scale) 1e6 times its own. Its scale clipped
  at twice the workers' median, the run ends near the honest run's loss;
  with the scales' plain mean (outer_scale_clip=null) it is moved by about
  1e6 / 8 times the step."""
  common = ("train.steps=8", "train.log_every=8", "optimizer.local_steps=2")
  attack = ("faults.kind=scale", "faults.workers=1",
            "faults.on=pseudo_gradients")
  losses = {}
  for name, settings in (("honest", ()), ("clipped", attack),
                         ("plain", (*attack,
                                    "optimizer.outer_scale_clip=null"))):
    code, records = _run(tmp_path / name, *common, *settings)
    losses[name] = records[-1]["test_loss"] if code == 0 else float("inf")
  assert losses["clipped"] < 1.5 * losses["honest"], losses
  assert losses["plain"] > 100 * losses["honest"], losses


def test_the_voted_means_abstentions_are_logged(tmp_path, capsys):
  """Local steps of 3 with the voted mean, 2 of 8 workers NaN on every
  step: each round 2 abstain, the run goes on with a finite anchor."""
  code, records = _run(tmp_path, "train.steps=6", "train.log_every=3",
                       "optimizer.local_steps=3",
                       "optimizer.abstain_nonfinite=true",
                       "faults.kind=nonfinite", "faults.workers=2",
                       "faults.nan_rate=1.0")
  capsys.readouterr()
  assert code == 0
  assert [r["abstentions"] for r in records if "abstentions" in r] == [2, 4]
  assert np.isfinite(records[-1]["test_loss"])


def test_the_log_line_counts_the_abstentions(tmp_path, capsys):
  run_dir = tmp_path / "run"
  code = cli.main(["--no-progress", *[a for s in (
      "train.steps=6", "train.log_every=3", "train.eval_every=0",
      "model.hidden=[8]", "optimizer.warmup_steps=0",
      "optimizer.abstain_nonfinite=true", "faults.kind=nonfinite",
      "faults.workers=2", "faults.nan_rate=1.0", f"run_dir={run_dir}")
      for a in ("--set", s)]])
  capsys.readouterr()
  assert code == 0
  logged = [json.loads(line) for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()
            if "abstentions" in line]
  assert [r["abstentions"] for r in logged] == [6, 12]
  assert all(np.isfinite(r["loss"]) for r in logged)


def test_a_fast_fault_study(tmp_path):
  """Global Lion diverges on NaN gradients; the vote with abstention does
  not, the vote without it counts the NaN as votes and trains on."""
  raw = tmp_path / "faults.json"
  study.main(["--tasks", "digits", "--seeds", "0", "--rows", "D-Lion MaVo",
              "global Lion", study.NO_ABSTENTION, "--kinds", "nonfinite",
              "--faulty", "1", "--json", str(raw), "--out",
              str(tmp_path / "faults.md"), "--plot", str(tmp_path / "f.png")])
  runs = {(r["row"], r["faulty"]): r for r in json.loads(raw.read_text())}
  assert len(runs) == 5
  assert runs["global Lion", 1]["diverged"]
  assert not runs["D-Lion MaVo", 1]["diverged"]
  assert not runs[study.NO_ABSTENTION, 1]["diverged"]
  text = (tmp_path / "faults.md").read_text()
  assert "| global Lion |" in text and "diverged (1/1)" in text
  assert (tmp_path / "f.png").stat().st_size > 10_000


def test_local_steps_with_a_nan_worker_go_on_and_keep_a_finite_anchor(
    tmp_path, capsys):
  """A worker whose own params turn NaN inside a round abstains from the
  outer vote; its loss is NaN, the run warns once and goes on (without
  abstain_nonfinite a non-finite loss stops it)."""
  run_dir = tmp_path / "run"
  code = cli.main(["--no-progress", *[a for s in (
      "train.steps=8", "train.log_every=4", "train.eval_every=0",
      "model.hidden=[8]", "optimizer.warmup_steps=0",
      "optimizer.local_steps=4", "optimizer.outer=dlion",
      "optimizer.abstain_nonfinite=true",
      "faults.kind=nonfinite", "faults.workers=1", "faults.nan_rate=1.0",
      f"run_dir={run_dir}") for a in ("--set", s)]])
  err = capsys.readouterr().err
  assert code == 0
  assert err.count("a worker's loss is not finite") == 1
  final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
  assert np.isfinite(final["test_loss"])
