"""Config loading: shipped configs parse, overrides apply, mistakes are named."""

import pytest

pytest.importorskip("yaml")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402
from dlion_jax.train.config import parse_override  # noqa: E402

SHIPPED = sorted(p.stem for p in cli.CONFIG_DIR.glob("*.yaml"))


def test_the_issue_configs_are_shipped():
  assert set(SHIPPED) >= {"quickstart", "fashion_mnist_mlp",
                          "fashion_mnist_cnn", "fashion_mnist_vit",
                          "charlm_gpt"}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
  cfg = load_config(cli.resolve_config(name))
  assert cfg.name == name
  assert cfg.data.global_batch % cfg.workers == 0


def test_default_is_quickstart_and_overrides_apply():
  cfg = load_config(cli.resolve_config(None),
                    ["train.steps=7", "optimizer.learning_rate=1e-3",
                     "model.hidden=[8, 8]", "optimizer.b2=null"])
  assert cfg.name == "quickstart"
  assert cfg.train.steps == 7
  assert cfg.optimizer.learning_rate == 1e-3
  assert cfg.model == {"name": "mlp", "hidden": [8, 8]}
  assert cfg.optimizer.b2 is None


@pytest.mark.parametrize("override,message", [
    (["optimizer.lr=1"], r"Unknown config key 'optimizer\.lr'.*learning_rate"),
    (["trian.steps=3"], r"Unknown config key 'trian'"),
    (["train.steps=many"], r"train\.steps='many' has type str; expected int"),
    (["train.steps=2.5"], r"train\.steps=2\.5 has type float; expected int"),
    (["optimizer.name=adam"], r"optimizer\.name='adam' is not one of dlion"),
    (["optimizer.comm=ring"], r"optimizer\.comm='ring' is not one of auto"),
    (["data.global_batch=100"], r"divisible by workers=8"),
    (["train.steps=0"], r"train\.steps=0 must be positive"),
    (["optimizer.learning_rate=-1"], r"must be >= 0"),
    (["data=3"], r"data must be a mapping"),
    (["noequals"], r"--set expects key=value"),
    (["optimizer.quantizer=pbit_l1"], r"optimizer: quantizer='pbit_l1' needs"),
    (["optimizer.quantizer=int4"], r"optimizer\.quantizer='int4' is not one"),
    (["optimizer.bits=4"], r"bits=4 only applies to quantizer='pbit_l1'"),
    (["optimizer.sync_schedule=rare"], r"optimizer\.sync_schedule='rare'"),
    (["optimizer.momentum_sync=-2"], r"optimizer\.momentum_sync=-2 must be"),
    (["optimizer.sync_leaves=(embed"], r"not a regular expression"),
    (["optimizer.min_compress_size=-1"], r"min_compress_size=-1 must be"),
])
def test_bad_configs_are_named(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(cli.resolve_config(None), override)


def test_missing_config_lists_shipped(tmp_path):
  with pytest.raises(ConfigError, match="shipped: charlm_gpt"):
    cli.resolve_config("no_such_config")
  bad = tmp_path / "bad.yaml"
  bad.write_text("model: {name: mlp}\nwokers: 4\n")
  with pytest.raises(ConfigError, match="'wokers'.*workers"):
    load_config(bad)


def test_override_values_are_yaml():
  assert parse_override("a.b=1e-3") == ("a.b", 1e-3)
  assert parse_override("a=[1, 2]") == ("a", [1, 2])
  assert parse_override("a=psum") == ("a", "psum")
  assert parse_override("a=") == ("a", None)


def test_cli_reports_config_errors(capsys):
  assert cli.main(["--set", "optimizer.name=adam"]) == 2
  assert "config error: optimizer.name='adam'" in capsys.readouterr().err


def test_lion_cub_options_reach_the_optimizer():
  from dlion_jax.train import optimizers  # pylint: disable=g-import-not-at-top
  cfg = load_config(cli.resolve_config(None), [
      "optimizer.quantizer=pbit_l1", "optimizer.bits=3",
      "optimizer.momentum_sync=4", "optimizer.sync_schedule=growing",
      "optimizer.sync_leaves=bias", "optimizer.min_compress_size=64",
      "optimizer.error_feedback=true"])
  options = optimizers.lion_cub_options(cfg.optimizer)
  assert options["quantizer"] == "pbit_l1" and options["bits"] == 3
  assert options["momentum_sync"].steps[:4] == (1, 2, 3, 4)
  assert options["momentum_sync_mask"]({"bias": 0, "kernel": 0}) == {
      "bias": True, "kernel": False}
  assert options["min_compress_size"] == 64 and options["error_feedback"]
  bits = optimizers.analytic_bits_per_param(cfg.optimizer, 8, steps=100)
  plain = optimizers.analytic_bits_per_param(
      load_config(cli.resolve_config(None), []).optimizer, 8)
  assert bits > plain
