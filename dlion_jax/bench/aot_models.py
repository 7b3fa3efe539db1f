"""The models :mod:`dlion_jax.bench.aot` compiles, as abstract shapes.

Nothing here allocates a model's weights: every model is a
:class:`Problem` of ``jax.ShapeDtypeStruct`` params (from
:func:`jax.eval_shape` of its initializer), a loss and a batch of the right
shape, so that a 1B-parameter step can be compiled on a laptop.

* ``mlp``: a small MLP (leaves 512x384, 384, 384x256, 256, 256x10), for
  tests.
* ``gpt``: the train CLI's ``charlm_gpt`` model (a 4-layer byte-level GPT of
  :mod:`dlion_jax.train.models`; needs flax, the ``[examples]`` extra).
* ``gpt1b``: a GPT of about 1B params in plain JAX (:func:`gpt1b_problem`),
  its layers stacked and run with ``lax.scan`` (each layer rematerialized in
  the backward pass) so that it compiles in a minute or two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Problem:
  """A model to compile: ``loss_fn(params, batch)``, abstract params and
  ``batch(num_chips)``, the abstract global batch for that many chips."""
  name: str
  loss_fn: Callable[[Any, Any], jax.Array]
  params: Any
  batch: Callable[[int], Any]

  @property
  def count(self) -> int:
    """Parameters in the model."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.params))


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _tokens(rows: int, context: int) -> dict:
  tokens = jax.ShapeDtypeStruct((rows, context), jnp.int32)
  return {"x": tokens, "y": tokens}


def mlp_problem(per_chip: int = 8) -> Problem:
  """A 512-384-256-10 MLP (no bias on the last layer) on random inputs."""
  shapes = {"w1": (512, 384), "b1": (384,), "w2": (384, 256), "b2": (256,),
            "w3": (256, 10)}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}

  def loss_fn(p, batch):
    h = jax.nn.gelu(batch["x"] @ p["w1"] + p["b1"])
    h = jax.nn.gelu(h @ p["w2"] + p["b2"])
    logits = h @ p["w3"]
    labels = jax.nn.one_hot(batch["y"], 10)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

  def batch(chips):
    rows = per_chip * chips
    return {"x": jax.ShapeDtypeStruct((rows, 512), jnp.float32),
            "y": jax.ShapeDtypeStruct((rows,), jnp.int32)}
  return Problem("mlp", loss_fn, params, batch)


def gpt_problem():
  """The train CLI's ``charlm_gpt`` model (a 4-layer byte-level GPT):
  ``(loss_fn, params, batch(num_workers))``; needs flax."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import models  # pylint: disable=g-import-not-at-top
  model = models.build_model("gpt", rngs=nnx.Rngs(0), vocab_size=256,
                             context=128, dim=128, depth=4, heads=4)
  graphdef, params = models.split_params(model)

  def loss_fn(p, batch):
    return models.lm_loss(models.apply(graphdef, p, batch["x"]), batch["y"])
  def batch(num_workers):
    tokens = jnp.zeros((8 * num_workers, 128), jnp.int32)
    return {"x": tokens, "y": tokens}
  return loss_fn, params, batch


def cli_gpt_problem(per_chip: int = 8) -> Problem:
  """The train CLI's ``charlm_gpt`` model (dim 128, depth 4, context 128);
  needs flax."""
  loss_fn, params, _ = gpt_problem()
  return Problem("gpt", loss_fn, _abstract(params),
                 lambda chips: _tokens(per_chip * chips, 128))


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of :func:`gpt1b_problem`'s model: 0.98B params by default."""
  vocab: int = 32768
  context: int = 1024
  dim: int = 2048
  depth: int = 18
  heads: int = 16
  per_chip: int = 2          # sequences a chip processes a step


def _init_gpt(key: jax.Array, cfg: GPTConfig) -> dict:
  d, n = cfg.dim, cfg.depth
  keys = iter(jax.random.split(key, 6))
  normal = lambda shape, fan_in: (jax.random.normal(next(keys), shape)
                                  / math.sqrt(fan_in))
  layers = {
      "ln1": jnp.ones((n, d)), "ln1_bias": jnp.zeros((n, d)),
      "qkv": normal((n, d, 3 * d), d), "proj": normal((n, d, d), d),
      "ln2": jnp.ones((n, d)), "ln2_bias": jnp.zeros((n, d)),
      "fc1": normal((n, d, 4 * d), d), "fc1_bias": jnp.zeros((n, 4 * d)),
      "fc2": normal((n, 4 * d, d), 4 * d), "fc2_bias": jnp.zeros((n, d)),
  }
  return {"embed": normal((cfg.vocab, d), 1.0),
          "pos": normal((cfg.context, d), 1.0) * 0.02,
          "layers": layers, "ln_f": jnp.ones(d), "ln_f_bias": jnp.zeros(d)}


def _layer_norm(x, scale, bias):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


def _block(cfg: GPTConfig, x: jax.Array, w: dict) -> jax.Array:
  """One pre-LN transformer layer, bf16 matmuls on fp32 weights."""
  b, t, d = x.shape
  h = cfg.heads
  bf16 = lambda a: a.astype(jnp.bfloat16)
  y = bf16(_layer_norm(x, w["ln1"], w["ln1_bias"]))
  q, k, v = jnp.split(y @ bf16(w["qkv"]), 3, axis=-1)
  q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
  scores = scores / math.sqrt(d // h)
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores, -1e30)
  attn = bf16(jax.nn.softmax(scores, -1))
  out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
  x = x + (out @ bf16(w["proj"])).astype(jnp.float32)
  y = bf16(_layer_norm(x, w["ln2"], w["ln2_bias"]))
  y = jax.nn.gelu(y @ bf16(w["fc1"]) + bf16(w["fc1_bias"]))
  return x + (y @ bf16(w["fc2"])).astype(jnp.float32) + w["fc2_bias"]


def gpt_loss(cfg: GPTConfig, params: dict, batch: dict) -> jax.Array:
  """Next-token cross-entropy of the scanned GPT (embedding tied to the
  output head)."""
  x = params["embed"][batch["x"]] + params["pos"][: batch["x"].shape[1]]
  layer = jax.checkpoint(lambda h, w: (_block(cfg, h, w), None))
  x, _ = lax.scan(layer, x, params["layers"])
  x = _layer_norm(x, params["ln_f"], params["ln_f_bias"])
  logits = (x.astype(jnp.bfloat16)
            @ params["embed"].T.astype(jnp.bfloat16)).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(logp, batch["y"][..., None], -1)
  return -jnp.mean(picked)


def gpt1b_problem(cfg: GPTConfig = GPTConfig()) -> Problem:
  """A GPT of about 1B params (:class:`GPTConfig`), layers under
  ``lax.scan``; params as shapes only."""
  params = jax.eval_shape(lambda k: _init_gpt(k, cfg), jax.random.key(0))
  return Problem("gpt1b", lambda p, b: gpt_loss(cfg, p, b), params,
                 lambda chips: _tokens(cfg.per_chip * chips, cfg.context))


PROBLEMS = {"mlp": mlp_problem, "gpt": cli_gpt_problem, "gpt1b": gpt1b_problem}
