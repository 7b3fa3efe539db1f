"""The training examples' Flax models, their param split and losses."""

import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dlion_jax.train import data
from dlion_jax.train import models

pytestmark = pytest.mark.integration

# Tiny configs: (name, kwargs, example input, expected output shape).
TINY = {
    "mlp": (dict(in_features=64, hidden=(16, 8), num_classes=10),
            np.zeros((3, 8, 8, 1), np.float32), (3, 10)),
    "cnn": (dict(in_channels=1, num_classes=5, channels=(2, 3), dense=4),
            np.zeros((3, 8, 8, 1), np.float32), (3, 5)),
    "vit": (dict(image_size=8, patch_size=4, in_channels=1, num_classes=10,
                 dim=16, depth=1, heads=2),
            np.zeros((3, 8, 8, 1), np.float32), (3, 10)),
    "gpt": (dict(context=8, dim=16, depth=1, heads=2),
            np.zeros((3, 6), np.int32), (3, 6, 256)),
}

# By hand. MLP 64-16-8-10: weights + biases of each layer.
MLP_COUNT = 64 * 16 + 16 + 16 * 8 + 8 + 8 * 10 + 10
# CNN: conv 3x3 1->2, conv 3x3 2->3, dense 3->4, head 4->5.
CNN_COUNT = (9 * 1 * 2 + 2) + (9 * 2 * 3 + 3) + (3 * 4 + 4) + (4 * 5 + 5)
# One pre-LN block of width 16, MLP 64: 2 LNs, q/k/v/out, fc1, fc2.
BLOCK_COUNT = 2 * 32 + 4 * (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16)
# ViT: patch conv 4x4x1->16, pos (4 patches + cls), cls, block, LN, head.
VIT_COUNT = (16 * 16 + 16) + 5 * 16 + 16 + BLOCK_COUNT + 32 + (16 * 10 + 10)
# GPT (tied): token embedding, pos (context 8), block, final LN.
GPT_COUNT = 256 * 16 + 8 * 16 + BLOCK_COUNT + 32
COUNTS = {"mlp": MLP_COUNT, "cnn": CNN_COUNT, "vit": VIT_COUNT,
          "gpt": GPT_COUNT}


@functools.lru_cache(maxsize=None)
def _split(name):
  kwargs, _, _ = TINY[name]
  return models.split_params(
      models.build_model(name, rngs=nnx.Rngs(0), **kwargs))


def _loss(name, graphdef, params, x):
  logits = models.apply(graphdef, params, x)
  if name == "gpt":
    return models.lm_loss(logits, x)
  return models.classification_loss(logits, jnp.zeros(len(x), jnp.int32))


def test_docstring_examples():
  result = doctest.testmod(models, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("name", list(TINY))
def test_shapes_params_and_count(name):
  _, x, shape = TINY[name]
  graphdef, params = _split(name)
  assert models.apply(graphdef, params, x).shape == shape
  leaves = jax.tree.leaves(params)
  assert leaves and all(isinstance(p, jax.Array) and p.dtype == jnp.float32
                        for p in leaves)
  # A plain pytree: nested dicts of arrays, no nnx.Variable wrappers.
  assert all(isinstance(v, dict) or isinstance(v, jax.Array)
             for v in params.values())
  assert models.count_params(params) == COUNTS[name]


@pytest.mark.parametrize("name", list(TINY))
def test_jitted_grad_is_finite(name):
  _, x, _ = TINY[name]
  graphdef, params = _split(name)
  grad_fn = jax.jit(jax.grad(functools.partial(_loss, name, graphdef)))
  grads = grad_fn(params, x + 1)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


def test_untied_gpt_count():
  kwargs = dict(TINY["gpt"][0], tie_embeddings=False)
  _, params = models.split_params(
      models.build_model("gpt", rngs=nnx.Rngs(0), **kwargs))
  assert models.count_params(params) == GPT_COUNT + 16 * 256


def test_gpt_is_causal():
  graphdef, params = _split("gpt")
  fn = jax.jit(functools.partial(models.apply, graphdef))
  tokens = jnp.array([[5, 17, 99, 3, 250, 42, 7, 1]], jnp.int32)
  base = fn(params, tokens)
  for t in (0, 3, 7):
    changed = fn(params, tokens.at[0, t].set((tokens[0, t] + 128) % 256))
    np.testing.assert_array_equal(changed[0, :t], base[0, :t])
    assert not np.allclose(changed[0, t:], base[0, t:])


def test_params_roundtrip_through_apply():
  graphdef, params = _split("mlp")
  x = jnp.ones((2, 64))
  shifted = jax.tree.map(lambda p: p + 1.0, params)
  assert not np.allclose(models.apply(graphdef, shifted, x),
                         models.apply(graphdef, params, x))


def test_split_params_rejects_non_param_state():
  class WithDropout(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(2, 2, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

  with pytest.raises(ValueError, match="other than nnx.Param"):
    models.split_params(WithDropout(nnx.Rngs(0)))


def test_build_model_errors():
  with pytest.raises(ValueError, match="'mlp', 'cnn', 'vit', 'gpt'"):
    models.build_model("resnet", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="'width'.*Valid keywords"):
    models.build_model("mlp", in_features=4, hidden=(), num_classes=2,
                       width=3, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="missing.*num_classes"):
    models.build_model("mlp", in_features=4, hidden=(), rngs=nnx.Rngs(0))


def test_config_errors():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="patch_size=3 does not divide "
                     "image_size=8"):
    models.ViT(8, 3, 1, 10, dim=16, depth=1, heads=2, rngs=rngs)
  with pytest.raises(ValueError, match="dim=18 is not divisible by heads=4"):
    models.ViT(8, 4, 1, 10, dim=18, depth=1, heads=4, rngs=rngs)
  with pytest.raises(ValueError, match="dim=10 is not divisible by heads=4"):
    models.GPT(dim=10, heads=4, rngs=rngs)
  with pytest.raises(ValueError, match="pool"):
    models.ViT(8, 4, 1, 10, dim=16, depth=1, heads=2, pool="max", rngs=rngs)
  with pytest.raises(TypeError, match="hidden must be a sequence"):
    models.MLP(4, 8, 2, rngs=rngs)
  with pytest.raises(ValueError, match="num_classes must be a positive int"):
    models.CNN(1, 0, rngs=rngs)


def test_input_errors():
  graphdef, params = _split("gpt")
  with pytest.raises(ValueError, match="exceeds the model's context=8"):
    models.apply(graphdef, params, jnp.zeros((1, 9), jnp.int32))
  with pytest.raises(ValueError, match="integer tokens"):
    models.apply(graphdef, params, jnp.zeros((1, 4), jnp.float32))
  graphdef, params = _split("vit")
  with pytest.raises(ValueError, match="ViT expects NHWC images"):
    models.apply(graphdef, params, jnp.zeros((1, 16, 16, 1)))
  graphdef, params = _split("mlp")
  with pytest.raises(ValueError, match="in_features=64"):
    models.apply(graphdef, params, jnp.zeros((1, 28, 28, 1)))
  graphdef, params = _split("cnn")
  with pytest.raises(ValueError, match="in_channels=1"):
    models.apply(graphdef, params, jnp.zeros((1, 8, 8, 3)))
  with pytest.raises(ValueError, match="below 2x2"):
    models.apply(graphdef, params, jnp.zeros((1, 2, 2, 1)))


def test_losses():
  logits = jnp.array([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
  labels = jnp.array([0, 1, 1])
  assert float(models.accuracy(logits, labels)) == pytest.approx(2 / 3)
  expected = np.mean([math.log1p(math.exp(-2)), math.log1p(math.exp(-3)),
                      math.log1p(math.exp(1))])
  assert float(models.classification_loss(logits, labels)) == pytest.approx(
      expected, rel=1e-5)
  lm_logits = jnp.zeros((2, 3, 256))
  lm = models.lm_loss(lm_logits, jnp.zeros((2, 3), jnp.int32))
  assert float(lm) == pytest.approx(math.log(256), rel=1e-6)
  assert float(models.bits_per_byte(lm)) == pytest.approx(8.0, rel=1e-6)


def test_mlp_learns_digits():
  ds = data.load_digits()
  x, y = jnp.asarray(ds.train["x"]), jnp.asarray(ds.train["y"])
  graphdef, params = models.split_params(models.MLP(
      64, (64,), 10, rngs=nnx.Rngs(0)))
  tx = optax.adam(1e-2)

  def loss_fn(p):
    return models.classification_loss(models.apply(graphdef, p, x), y)

  @jax.jit
  def train(params):
    def step(carry, _):
      p, s = carry
      grads = jax.grad(loss_fn)(p)
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None
    (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None,
                                  length=200)
    return params

  params = train(params)
  acc = float(models.accuracy(models.apply(graphdef, params, x), y))
  assert acc > 0.8, acc


def test_grad_through_apply_in_shard_map():
  # As dlion_jax.parallel does (check_vma=False): each worker differentiates
  # its local loss; the mean of the 8 local gradients is the global one.
  graphdef, params = _split("mlp")
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  x = jax.random.normal(jax.random.key(1), (16, 8, 8, 1))
  y = jnp.arange(16, dtype=jnp.int32) % 10

  def loss(p, x, y):
    return models.classification_loss(models.apply(graphdef, p, x), y)

  def local(p, x, y):
    return jax.lax.pmean(jax.grad(loss)(p, x, y), "data")

  sharded = jax.jit(jax.shard_map(local, mesh=mesh,
                                  in_specs=(P(), P("data"), P("data")),
                                  out_specs=P(), check_vma=False))(
                                      params, x, y)
  expected = jax.jit(jax.grad(loss))(params, x, y)
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
