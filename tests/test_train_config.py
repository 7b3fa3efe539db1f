"""Config loading: shipped configs parse, overrides apply, mistakes are
named."""

import pytest

pytest.importorskip("yaml")

from dlion_jax.train import cli  # noqa: E402
from dlion_jax.train.config import ConfigError  # noqa: E402
from dlion_jax.train.config import load_config  # noqa: E402
from dlion_jax.train.config import parse_override  # noqa: E402

pytestmark = pytest.mark.integration

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
    (["optimizer.bucket_bytes=0"], r"optimizer\.bucket_bytes=0 must be a "
     r"positive number of gradient bytes, or null"),
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


@pytest.mark.parametrize("sets, message", [
    (["data.limit_test=5"], "data.limit_test=5 does nothing for "
     "data.name='digits' (it takes no limits): remove it."),
    (["data.name=text", "data.path=x.txt", "data.limit_train=5"],
     "data.limit_train=5 does nothing for data.name='text' (it takes "
     "limit_test): remove it."),
])
def test_a_limit_the_dataset_ignores_is_a_config_error(capsys, sets,
                                                        message):
  argv = [a for s in sets for a in ("--set", s)]
  assert cli.main(argv) == 2
  assert f"config error: --set {sets[-1]}: {message}" in (
      capsys.readouterr().err)


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


BROKEN_YAML = [
    ("name: mine\nmodel:\n  name: mlp\n  hidden: [8\ntrain:\n  steps: 4\n",
     "line 5, column 6: not valid YAML (expected ',' or ']', but got ':', "
     "while parsing a flow sequence that starts on line 4)"),
    ("name: mine\nmodel:\n  name: mlp\n   hidden: 8\n",
     "line 4, column 10: not valid YAML (mapping values are not allowed "
     "here)"),
    ('name: "mine\n', "line 2, column 1: not valid YAML (found unexpected "
     "end of stream, while scanning a quoted scalar that starts on line 1)"),
]


@pytest.mark.parametrize("text, where", BROKEN_YAML)
def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys, text,
                                                where):
  bad = tmp_path / "bad.yaml"
  bad.write_text(text)
  assert cli.main(["--config", str(bad)]) == 2
  assert capsys.readouterr().err.splitlines() == [
      f"config error: {bad}, {where}. Check the indentation there, the ':' "
      "after each key, and close brackets and quotes."]


def test_malformed_override_is_a_config_error(capsys):
  assert cli.main(["--set", "model.hidden=[8"]) == 2
  assert capsys.readouterr().err.splitlines() == [
      "config error: --set 'model.hidden=[8': the value is not valid YAML "
      "(expected ',' or ']', but got '<stream end>', while parsing a flow "
      "sequence); close brackets and braces, and quote strings with ':' or "
      "'#'."]


@pytest.mark.parametrize("text, sets, message", [
    ("name: mine\nmodel:\n  name: mlp\n", [],
     "{file}, line 2: model.hidden is missing: model 'mlp' needs it. Add it "
     "to the model section, or pass --set model.hidden=VALUE."),
    ("name: mine\n", [],
     "{file}: model.hidden is missing: model 'mlp' needs it. Add it to the "
     "model section, or pass --set model.hidden=VALUE."),
    ("model:\n  name: mlp\n  hiden: [8]\n", [],
     "{file}, line 3: model.hiden is not a setting of model 'mlp'; its "
     "settings are in_features, hidden, num_classes."),
    ("model: {name: mlp, hidden: [8]}\n", ["model.hidden=8"],
     "--set model.hidden=8: model (mlp): hidden must be a sequence of ints "
     "(e.g. [8]), got the int 8."),
    ("model: {name: rnn}\n", [],
     "{file}, line 1: model.name='rnn' is not one of mlp, cnn, vit, gpt."),
])
def test_model_mistakes_are_config_errors(tmp_path, capsys, text, sets,
                                          message):
  """Found when the model is built (the data supplies some arguments), yet
  reported like any config error, with where the key is set."""
  config = tmp_path / "mine.yaml"
  config.write_text(text)
  run_dir = tmp_path / "run"
  argv = ["--config", str(config), "--no-progress",
          "--set", f"run_dir={run_dir}"]
  assert cli.main(argv + [a for s in sets for a in ("--set", s)]) == 2
  assert capsys.readouterr().err.splitlines() == [
      "config error: " + message.format(file=config)]
  assert not run_dir.exists()            # nothing written


def test_locate_finds_keys_and_their_sections(tmp_path):
  from dlion_jax.train.config import locate  # pylint: disable=g-import-not-at-top
  path = tmp_path / "c.yaml"
  path.write_text("seed: 1\n\nmodel:\n  name: mlp\n  hidden: [8]\n")
  assert locate(path, "model.hidden") == f"{path}, line 5"
  assert locate(path, "model.dim") == f"{path}, line 3"
  assert locate(path, "train.steps") is None
  assert locate(None, "seed") is None


def test_binary_config_file_is_a_config_error(tmp_path, capsys):
  binary = tmp_path / "model.bin"
  binary.write_bytes(b"name: x\n\xff\xfe")
  assert cli.main(["--config", str(binary)]) == 2
  assert capsys.readouterr().err.splitlines() == [
      f"config error: {binary}: not a UTF-8 text file (byte 8); --config "
      "takes a YAML file."]


def test_a_warmup_longer_than_the_run_warns(tmp_path, capsys):
  """fashion_mnist_mlp has warmup_steps=100; a 50-step run of it never
  reaches its learning rate (was: no word about it)."""
  pytest.importorskip("flax", reason="trains: the [examples] extra")
  sets = ["train.steps=50", "data.name=digits", "model.hidden=[8]",
          "train.eval_every=0", f"run_dir={tmp_path}"]
  assert cli.main(["--config", "fashion_mnist_mlp", "--no-progress",
                   *[a for s in sets for a in ("--set", s)]]) == 0
  assert capsys.readouterr().err.splitlines() == [
      "warning: optimizer.warmup_steps=100 is not below train.steps=50: the "
      "learning rate rises for the whole run and ends at 0.00049, never "
      "reaching optimizer.learning_rate=0.001, and the cosine decay never "
      "starts. Lower it, e.g. --set optimizer.warmup_steps=5."]


def test_schedule_warning_only_for_a_warmup_as_long_as_the_run():
  from dlion_jax.train.config import schedule_warning  # pylint: disable=g-import-not-at-top
  path = cli.resolve_config("quickstart")          # warmup_steps: 20
  assert schedule_warning(load_config(path)) is None
  assert schedule_warning(load_config(path, ["train.steps=21"])) is None
  assert schedule_warning(load_config(path, ["train.steps=4",
                                             "optimizer.warmup_steps=0"])
                          ) is None
  assert schedule_warning(load_config(path, [
      "train.steps=20", "optimizer.schedule=constant"])).startswith(
          "optimizer.warmup_steps=20 is not below train.steps=20: the "
          "learning rate rises for the whole run and ends at 0.00285, never "
          "reaching optimizer.learning_rate=0.003. Lower it")
