"""Faulty and hostile workers, injected for the studies (not the library).

:func:`faulty_workers` is an optax transform that goes first in a chain and
replaces the gradients of the first ``workers`` workers of the data axis
before the optimizer sees them, as a worker gone wrong would send them:

* ``sign_flip``: ``-g``, a hostile worker pulling the other way;
* ``random``: Gaussian noise with each leaf's own root mean square, a
  worker whose gradients carry no information;
* ``scale``: ``1e6 g``, silent data corruption in a GPU;
* ``nonfinite``: NaN on a step with probability ``nan_rate``, an overflow in
  one replica's bf16.

docs/guides/faulty_workers.md measures what each does to each
aggregation (``benchmarks/faults.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

FAULTS = ("none", "sign_flip", "random", "scale", "nonfinite")


class FaultState(NamedTuple):
  """The step count, the same on every worker (it seeds the faults)."""
  count: jax.Array


def faulty_workers(kind: str, workers: int, *, axis_name: str = "data",
                   scale: float = 1e6, nan_rate: float = 0.5,
                   seed: int = 0) -> optax.GradientTransformation:
  """The gradients of workers ``0 .. workers - 1`` of ``axis_name`` made
  faulty of ``kind`` (see the module); the others' passed as they are.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from dlion_jax.train import faults
    >>> tx = faults.faulty_workers("sign_flip", 1)
    >>> jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(
    ...     jnp.array([[1.0], [2.0]]))
    Array([[-1.],
           [ 2.]], dtype=float32)
  """
  if kind not in FAULTS:
    raise ValueError(f"kind={kind!r} is not one of {', '.join(FAULTS)}.")

  def init_fn(params):
    del params
    return FaultState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    me = lax.axis_index(axis_name)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed),
                                                state.count), me)
    leaves, treedef = jax.tree.flatten(updates)
    keys = jax.random.split(key, len(leaves) + 1)
    bad = [_fault(kind, g, k, scale) for g, k in zip(leaves, keys[1:])]
    faulty = me < workers
    if kind == "nonfinite":
      faulty &= jax.random.bernoulli(keys[0], nan_rate)
    out = [jnp.where(faulty, b, g) for b, g in zip(bad, leaves)]
    return treedef.unflatten(out), FaultState(
        count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def _fault(kind: str, g: jax.Array, key: jax.Array, scale: float):
  if kind == "sign_flip":
    return -g
  if kind == "scale":
    return g * jnp.asarray(scale, g.dtype)
  if kind == "nonfinite":
    return jnp.full_like(g, jnp.nan)
  if kind == "random":
    rms = jnp.sqrt(jnp.mean(jnp.square(g.astype(jnp.float32))))
    return (rms * jax.random.normal(key, g.shape)).astype(g.dtype)
  return g
