"""Deterministic Flax NNX models for the training examples, and their losses.

Every model here is a pure function of its parameters: no dropout, no batch
statistics (normalization is :class:`flax.nnx.LayerNorm`), no RNG state. A
model is split once into a static ``graphdef`` and a plain nested ``dict`` of
float32 arrays, and the train step differentiates :func:`apply` with respect
to that dict::

  graphdef, params = split_params(model)
  grads = jax.grad(lambda p: classification_loss(apply(graphdef, p, x), y))(
      params)

Models (``MODELS``, built by name with :func:`build_model`):

* :class:`MLP`: flatten + GELU hidden layers, for any input shape.
* :class:`CNN`: 3x3 conv + GELU + 2x2 average pool stages, global average
  pool, a dense layer; NHWC images (8x8 digits, 28x28 Fashion-MNIST).
* :class:`ViT`: patch embedding, learned positions, pre-LN transformer.
* :class:`GPT`: byte-level causal pre-LN transformer language model.

Example:

>>> from flax import nnx
>>> import jax.numpy as jnp
>>> model = build_model("mlp", in_features=64, hidden=(16, 8),
...                     num_classes=10, rngs=nnx.Rngs(0))
>>> graphdef, params = split_params(model)
>>> count_params(params)  # 64*16 + 16 + 16*8 + 8 + 8*10 + 10
1266
>>> apply(graphdef, params, jnp.ones((3, 8, 8, 1))).shape
(3, 10)
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Params = dict[str, Any]

_INIT_STD = 0.02  # positional embeddings and the cls token


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _check_sizes(name: str, values: Any) -> tuple[int, ...]:
  """Returns ``values`` as a tuple of positive ints, or raises naming them."""
  if isinstance(values, int):
    raise TypeError(
        f"{name} must be a sequence of ints (e.g. [{values}]), got the int "
        f"{values!r}.")
  values = tuple(values)
  for v in values:
    _check_positive(f"every entry of {name}", v)
  return values


class MLP(nnx.Module):
  """Multi-layer perceptron on flattened inputs.

  Args:
    in_features: size of one flattened example (e.g. 64 for 8x8x1 images).
    hidden: widths of the hidden layers, each followed by GELU; may be empty
      (logistic regression).
    num_classes: number of output logits.
    rngs: the initialization RNGs.

  Example:

  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> MLP(64, (16, 8), 10, rngs=nnx.Rngs(0))(jnp.ones((3, 8, 8, 1))).shape
  (3, 10)
  """

  def __init__(self, in_features: int, hidden: Sequence[int],
               num_classes: int, *, rngs: nnx.Rngs):
    _check_positive("in_features", in_features)
    _check_positive("num_classes", num_classes)
    widths = (in_features, *_check_sizes("hidden", hidden), num_classes)
    self.in_features = in_features
    self.layers = nnx.List([
        nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    if x.shape[1] != self.in_features:
      raise ValueError(
          f"MLP(in_features={self.in_features}) got inputs with "
          f"{x.shape[1]} features per example; set in_features to the "
          "product of the per-example input shape.")
    for layer in self.layers[:-1]:
      x = nnx.gelu(layer(x))
    return self.layers[-1](x)


class CNN(nnx.Module):
  """Small convolutional classifier on NHWC images.

  Each stage is a 3x3 SAME convolution, GELU and a 2x2 average pool
  (stride 2, so the image must be at least ``2 ** len(channels)`` pixels on
  each side); then a global average pool, a GELU dense layer and the head.

  Args:
    in_channels: channels of the input images (1 for grayscale).
    num_classes: number of output logits.
    channels: output channels of the conv stages.
    dense: width of the dense layer before the head.
    rngs: the initialization RNGs.

  Example:

  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> model = CNN(1, 5, channels=(2, 3), dense=4, rngs=nnx.Rngs(0))
  >>> model(jnp.ones((3, 8, 8, 1))).shape
  (3, 5)
  """

  def __init__(self, in_channels: int, num_classes: int, *,
               channels: Sequence[int] = (32, 64), dense: int = 128,
               rngs: nnx.Rngs):
    _check_positive("in_channels", in_channels)
    _check_positive("num_classes", num_classes)
    _check_positive("dense", dense)
    widths = (in_channels, *_check_sizes("channels", channels))
    self.in_channels = in_channels
    self.convs = nnx.List([
        nnx.Conv(a, b, kernel_size=(3, 3), padding="SAME", rngs=rngs)
        for a, b in zip(widths[:-1], widths[1:])])
    self.dense = nnx.Linear(widths[-1], dense, rngs=rngs)
    self.head = nnx.Linear(dense, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim != 4 or x.shape[-1] != self.in_channels:
      raise ValueError(
          f"CNN(in_channels={self.in_channels}) expects NHWC images "
          f"[batch, height, width, {self.in_channels}], got shape {x.shape}.")
    for conv in self.convs:
      if x.shape[1] < 2 or x.shape[2] < 2:
        raise ValueError(
            f"CNN with {len(self.convs)} stages pools the image below 2x2 "
            f"(reached {x.shape[1]}x{x.shape[2]}); use fewer entries in "
            "channels or larger images.")
      x = nnx.avg_pool(nnx.gelu(conv(x)), window_shape=(2, 2), strides=(2, 2))
    x = x.mean(axis=(1, 2))
    return self.head(nnx.gelu(self.dense(x)))


class Block(nnx.Module):
  """Pre-LN transformer block: ``x + attn(ln(x))``, ``x + mlp(ln(x))``.

  Args:
    dim: model width.
    heads: attention heads; must divide ``dim``.
    mlp_dim: hidden width of the GELU MLP.
    rngs: the initialization RNGs.
  """

  def __init__(self, dim: int, heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=heads, in_features=dim, decode=False, deterministic=True,
        keep_rngs=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
    self.fc1 = nnx.Linear(dim, mlp_dim, rngs=rngs)
    self.fc2 = nnx.Linear(mlp_dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


def _check_transformer(dim: int, depth: int, heads: int,
                       mlp_dim: int | None) -> int:
  """Validates the transformer sizes; returns ``mlp_dim`` (4 * dim default)."""
  for name, value in (("dim", dim), ("depth", depth), ("heads", heads)):
    _check_positive(name, value)
  if dim % heads:
    raise ValueError(
        f"dim={dim} is not divisible by heads={heads}; pick heads that "
        f"divide dim (e.g. heads={math.gcd(dim, heads)}).")
  mlp_dim = 4 * dim if mlp_dim is None else mlp_dim
  _check_positive("mlp_dim", mlp_dim)
  return mlp_dim


class ViT(nnx.Module):
  """Vision transformer (Dosovitskiy et al. 2021) with pre-LN blocks.

  Non-overlapping ``patch_size`` patches are embedded by a strided conv,
  a learned position embedding is added, ``depth`` pre-LN blocks run, and the
  final LayerNorm + linear head reads the cls token (``pool='cls'``) or the
  mean of the patch tokens (``pool='mean'``). The Distributed Lion paper's
  CIFAR ViT is ``dim=512, depth=6, heads=8``, the defaults here.

  Args:
    image_size: height and width of the (square) input images.
    patch_size: side of a patch; must divide ``image_size``.
    in_channels: channels of the input images.
    num_classes: number of output logits.
    dim: model width.
    depth: number of transformer blocks.
    heads: attention heads; must divide ``dim``.
    mlp_dim: hidden width of the block MLPs (default ``4 * dim``).
    pool: ``'cls'`` or ``'mean'``.
    rngs: the initialization RNGs.

  Example:

  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> model = ViT(8, 4, 1, 10, dim=16, depth=1, heads=2, rngs=nnx.Rngs(0))
  >>> model(jnp.ones((3, 8, 8, 1))).shape
  (3, 10)
  """

  def __init__(self, image_size: int, patch_size: int, in_channels: int,
               num_classes: int, *, dim: int = 512, depth: int = 6,
               heads: int = 8, mlp_dim: int | None = None, pool: str = "cls",
               rngs: nnx.Rngs):
    for name, value in (("image_size", image_size), ("patch_size", patch_size),
                        ("in_channels", in_channels),
                        ("num_classes", num_classes)):
      _check_positive(name, value)
    if image_size % patch_size:
      raise ValueError(
          f"patch_size={patch_size} does not divide image_size={image_size}; "
          "pick a patch_size that divides the image side (e.g. 4 for 8 or "
          "28, 7 for 28).")
    if pool not in ("cls", "mean"):
      raise ValueError(f"Unknown pool={pool!r}. Valid values are: 'cls', "
                       "'mean'.")
    mlp_dim = _check_transformer(dim, depth, heads, mlp_dim)
    self.image_size, self.in_channels, self.pool = image_size, in_channels, pool
    num_tokens = (image_size // patch_size) ** 2 + (pool == "cls")
    init = nnx.initializers.normal(_INIT_STD)
    self.patch = nnx.Conv(in_channels, dim, kernel_size=(patch_size,) * 2,
                          strides=(patch_size,) * 2, padding="VALID",
                          rngs=rngs)
    self.pos = nnx.Param(init(rngs.params(), (1, num_tokens, dim)))
    if pool == "cls":
      self.cls = nnx.Param(init(rngs.params(), (1, 1, dim)))
    self.blocks = nnx.List(
        [Block(dim, heads, mlp_dim, rngs=rngs) for _ in range(depth)])
    self.ln = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    expected = (self.image_size, self.image_size, self.in_channels)
    if x.ndim != 4 or tuple(x.shape[1:]) != expected:
      raise ValueError(
          f"ViT expects NHWC images [batch, {', '.join(map(str, expected))}], "
          f"got shape {x.shape}.")
    x = self.patch(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    if self.pool == "cls":
      cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
      x = jnp.concatenate([cls, x], axis=1)
    x = x + self.pos[...]
    for block in self.blocks:
      x = block(x)
    x = self.ln(x)
    x = x[:, 0] if self.pool == "cls" else x.mean(axis=1)
    return self.head(x)


class GPT(nnx.Module):
  """Byte-level decoder-only transformer language model.

  Token + learned position embeddings, ``depth`` causal pre-LN blocks, a final
  LayerNorm and an output head that reuses the token embedding
  (``tie_embeddings=True``) or is its own bias-free linear layer.

  Args:
    vocab_size: number of tokens (256 for bytes).
    context: the longest sequence the model accepts.
    dim: model width.
    depth: number of transformer blocks.
    heads: attention heads; must divide ``dim``.
    mlp_dim: hidden width of the block MLPs (default ``4 * dim``).
    tie_embeddings: share the token embedding with the output head.
    rngs: the initialization RNGs.

  Example:

  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> model = GPT(context=8, dim=16, depth=1, heads=2, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((3, 6), jnp.int32)).shape
  (3, 6, 256)
  """

  def __init__(self, vocab_size: int = 256, context: int = 128, *,
               dim: int = 256, depth: int = 4, heads: int = 4,
               mlp_dim: int | None = None, tie_embeddings: bool = True,
               rngs: nnx.Rngs):
    _check_positive("vocab_size", vocab_size)
    _check_positive("context", context)
    mlp_dim = _check_transformer(dim, depth, heads, mlp_dim)
    self.context, self.tie_embeddings = context, bool(tie_embeddings)
    self.embed = nnx.Embed(
        vocab_size, dim, embedding_init=nnx.initializers.normal(_INIT_STD),
        rngs=rngs)
    self.pos = nnx.Param(
        nnx.initializers.normal(_INIT_STD)(rngs.params(), (context, dim)))
    self.blocks = nnx.List(
        [Block(dim, heads, mlp_dim, rngs=rngs) for _ in range(depth)])
    self.ln = nnx.LayerNorm(dim, rngs=rngs)
    if not self.tie_embeddings:
      self.head = nnx.Linear(dim, vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          "GPT expects integer tokens of shape [batch, time], got "
          f"{tokens.dtype} {tokens.shape}.")
    length = tokens.shape[1]
    if length > self.context:
      raise ValueError(
          f"Sequence length {length} exceeds the model's context="
          f"{self.context}; pass at most {self.context} tokens or build the "
          "model with a larger context.")
    x = self.embed(tokens) + self.pos[:length]
    mask = jnp.tril(jnp.ones((1, 1, length, length), bool))
    for block in self.blocks:
      x = block(x, mask)
    x = self.ln(x)
    return self.embed.attend(x) if self.tie_embeddings else self.head(x)


MODELS: dict[str, type[nnx.Module]] = {
    "mlp": MLP, "cnn": CNN, "vit": ViT, "gpt": GPT}


def model_arguments(name: str) -> tuple[list[str], list[str]]:
  """The keyword arguments of model ``name``: all of them, and those
  without a default.

  Raises:
    ValueError: for an unknown ``name``.

  Example:

  >>> valid, required = model_arguments("cnn")
  >>> required
  ['in_channels', 'num_classes']
  """
  if name not in MODELS:
    raise ValueError(
        f"Unknown model name={name!r}. Valid names are: "
        f"{', '.join(repr(n) for n in MODELS)}.")
  params = inspect.signature(MODELS[name].__init__).parameters
  valid = [p for p in params if p not in ("self", "rngs")]
  required = [p for p in valid
              if params[p].default is inspect.Parameter.empty]
  return valid, required


def build_model(name: str, *, rngs: nnx.Rngs, **kwargs: Any) -> nnx.Module:
  """Builds ``MODELS[name](**kwargs, rngs=rngs)``, checking the keywords.

  Args:
    name: one of ``MODELS`` (``'mlp'``, ``'cnn'``, ``'vit'``, ``'gpt'``).
    rngs: the initialization RNGs.
    **kwargs: the model's constructor arguments, by keyword.

  Returns:
    The model.

  Raises:
    ValueError: for an unknown ``name``.
    TypeError: for a keyword the model does not take, or a missing one.

  Example:

  >>> from flax import nnx
  >>> model = build_model("cnn", in_channels=1, num_classes=5,
  ...                     channels=[2, 3], dense=4, rngs=nnx.Rngs(0))
  >>> type(model).__name__
  'CNN'
  """
  valid, required = model_arguments(name)
  cls = MODELS[name]
  for key in kwargs:
    if key not in valid:
      raise TypeError(
          f"Model {name!r} ({cls.__name__}) got an unexpected keyword "
          f"argument {key!r}. Valid keywords are: {', '.join(valid)}.")
  missing = [p for p in required if p not in kwargs]
  if missing:
    raise TypeError(
        f"Model {name!r} ({cls.__name__}) is missing required keyword "
        f"argument(s): {', '.join(missing)}.")
  return cls(**kwargs, rngs=rngs)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, Params]:
  """Splits a model into its static graph and a plain dict of parameters.

  ``params`` is a nested ``dict`` of arrays (``nnx.to_pure_dict``; list
  indices of ``nnx.List`` become int keys), with no ``nnx.Variable`` wrappers,
  ready for optax, ``jax.grad`` and checkpointing. The models of this module
  hold only ``nnx.Param`` variables, so nothing else needs threading through
  a train step.

  Args:
    model: an NNX module.

  Returns:
    ``(graphdef, params)``; :func:`apply` runs the model on them.

  Raises:
    ValueError: if the model holds state other than ``nnx.Param`` (batch
      statistics, RNG streams, caches), which :func:`apply` would not update.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError(
        f"{type(model).__name__} holds state other than nnx.Param "
        f"({sorted(map(str, nnx.to_flat_state(rest).paths))[:5]}...); "
        "split_params/apply only handle deterministic models. Remove "
        "dropout/BatchNorm/RNG state (e.g. keep_rngs=False in attention).")
  return graphdef, nnx.to_pure_dict(params)


def apply(graphdef: nnx.GraphDef, params: Params, x: jax.Array) -> jax.Array:
  """Runs the model described by ``graphdef`` with ``params`` on ``x``.

  A pure function of ``params`` (a fresh module is merged on every call, so
  it can be traced by ``jax.jit``/``jax.grad``/``shard_map``).

  Args:
    graphdef: from :func:`split_params`.
    params: the dict from :func:`split_params`, or any pytree of the same
      structure (e.g. updated parameters, or tracers).
    x: the model's input batch.

  Returns:
    The model's output (logits).
  """
  return nnx.merge(graphdef, params)(x)


def count_params(params: Any) -> int:
  """Total number of scalars in a pytree of arrays."""
  return sum(int(math.prod(jnp.shape(p))) for p in jax.tree.leaves(params))


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of ``[B, C]`` logits and int ``[B]`` labels.

  Example:

  >>> import jax.numpy as jnp
  >>> round(float(classification_loss(jnp.zeros((2, 4)), jnp.array([0, 3]))),
  ...       4)  # ln 4
  1.3863
  """
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Fraction of rows whose arg-max logit is the label (float32 scalar)."""
  return (jnp.argmax(logits, axis=-1) == labels).mean(dtype=jnp.float32)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in nats of ``[B, T, V]`` logits."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def bits_per_byte(loss_nats: Any) -> Any:
  """Converts a byte-level loss in nats to bits per byte (``loss / ln 2``).

  Example:

  >>> import math
  >>> bits_per_byte(math.log(256))
  8.0
  """
  return loss_nats / math.log(2)
