"""An independent numpy reference of Distributed Lion (Liu et al., Alg. 1).

Written from the paper, not from the library: plain loops over workers and
numpy arithmetic in the leaf dtype (ml_dtypes for bf16).

To compare bit for bit, the arithmetic rounds where XLA on CPU rounds: it
contracts ``a * x + y`` into a fused multiply-add (see :func:`mul_add`). That
models the compiler, not the algorithm; on a backend that rounds otherwise
the votes still agree but the parameters may differ in the last bit.
"""

from __future__ import annotations

import numpy as np


def _as(x, dtype):
  return np.asarray(x, dtype=dtype)


def mul_add(a, x, y):
  """``a * x + y`` as XLA on CPU evaluates it, for a Python scalar ``a``.

  JAX rounds ``a`` to ``x``'s dtype (weak typing) and computes in the result
  dtype of ``x`` and ``y``. When that is float32 and ``x`` is natively
  float32, XLA contracts the product and the sum into one fused multiply-add:
  a float32 product is exact in float64, so one rounding of the float64 sum
  reproduces it. Otherwise (bf16 operands, which XLA widens without rounding
  the product back) the product and the sum round separately.
  """
  dt = np.result_type(x.dtype, y.dtype)
  a = _as(a, x.dtype).astype(dt)
  if dt == np.float32 and x.dtype == np.float32:
    return (a.astype(np.float64) * x + y.astype(np.float64)).astype(dt)
  return a * x.astype(dt) + y.astype(dt)


def lin_comb(a, x, b, y):
  """``a * x + b * y`` as XLA on CPU evaluates it (see :func:`mul_add`).

  XLA fuses the first product whose operand is natively float32.
  """
  dt = np.result_type(x.dtype, y.dtype)
  if x.dtype != dt and y.dtype == dt:
    a, x, b, y = b, y, a, x
  return mul_add(a, x, (_as(b, y.dtype).astype(dt) * y.astype(dt)))


def vote_input(b1, g, m):
  """c = (1 - b1) g + b1 m as a worker votes on it: in float32 at least.

  Each rate rounds to its operand's dtype first (a Python scalar's weak
  type). Two bf16 (or f16) operands multiply exactly in float32, so ``c``
  rounds once; with a float32 operand, XLA's contraction (:func:`lin_comb`).
  """
  if np.result_type(g.dtype, m.dtype).itemsize >= 4:
    return lin_comb(1.0 - b1, g, b1, m)
  a = _as(1.0 - b1, g.dtype).astype(np.float32)
  b = _as(b1, m.dtype).astype(np.float32)
  return a * g.astype(np.float32) + b * m.astype(np.float32)


def worker_vote(c: np.ndarray, vote: str) -> np.ndarray:
  """d_i: +1/-1 (binary, c <= 0 and NaN vote -1) or sign(c) (ternary)."""
  if vote == "binary":
    return np.where(c > 0, 1, -1).astype(np.int64)
  return np.where(c > 0, 1, np.where(c < 0, -1, 0)).astype(np.int64)


def max_level(quantizer: str, bits: int | None) -> int:
  """L, the largest level a worker sends (Lion Cub's p-bit votes)."""
  if quantizer == "pbit_l1":
    return 2 ** (bits - 1) - 1
  return 1


def _l1_scale(x: np.ndarray) -> np.float32:
  """mean |x| with non-finite entries counted as 0: float32 sum * (1/size)."""
  finite = np.where(np.isfinite(x), np.abs(x), 0)
  total = np.float32(np.sum(finite, dtype=np.float64))
  return total * np.float32(1.0 / max(x.size, 1))


def l1_vote(c: np.ndarray, level: int) -> np.ndarray:
  """clip(round(L c / a), -L, L), a = mean |c| as float32 sum * (1 / size).

  The float64 sum is the float32 sum whenever that is exact (the tests feed
  values on a coarse dyadic grid so that it is).
  """
  x = np.asarray(c, np.float32)
  scale = _l1_scale(x)
  if not scale > 0:
    return np.zeros(x.shape, np.int64)
  with np.errstate(invalid="ignore"):
    q = np.clip(np.round(x * (np.float32(level) / scale)), -level, level)
  return np.where(np.isnan(q), 0, q).astype(np.int64)


def aggregate(votes: list[np.ndarray], aggregation: str, dtype,
              level: int = 1) -> np.ndarray:
  total = np.sum(votes, axis=0)
  if aggregation == "mavo":
    return np.sign(total).astype(dtype)
  n = len(votes)
  return (total.astype(np.float32) / np.float32(n * level)).astype(dtype)


class DistributedLionReference:
  """N workers' momenta and shared params, stepped with numpy.

  Args:
    params: dict name -> array (the replicated parameters).
    num_workers: N.
    mu_dtype: numpy dtype of the momenta, or None for the params' dtype.

  Lion Cub's options: ``quantizer``/``bits`` (what a worker sends),
  ``sync_steps`` (1-based steps after which the momenta of ``sync_leaves``,
  all by default, become their mean), ``min_compress_size`` (smaller leaves
  get sign(sum_i c_i)), ``error_feedback`` (vote on c + e, keep
  e <- p - mean|p| * D), ``abstain_nonfinite`` (a worker whose gradients
  are not all finite is left out of the step: the vote and a momentum
  sync are the others', its momentum and residual unchanged; one left,
  the step is that worker's one-worker Lion, ``sign(c)``, its residual
  kept and no sync; none left, the step is skipped).
  """

  def __init__(self, params, num_workers, *, b1=0.9, b2=0.99, mu_dtype=None,
               learning_rate=1e-2, weight_decay=1e-3, aggregation="mavo",
               vote="binary", quantizer="sign", bits=None, sync_steps=(),
               sync_leaves=None, min_compress_size=0, error_feedback=False,
               abstain_nonfinite=False):
    self.params = {k: np.array(v) for k, v in params.items()}
    self.n = num_workers
    self.b1, self.b2 = b1, b2
    self.lr, self.wd = learning_rate, weight_decay
    self.aggregation, self.vote = aggregation, vote
    self.quantizer, self.level = quantizer, max_level(quantizer, bits)
    self.sync_steps = set(sync_steps)
    self.sync_leaves = set(sync_leaves or params)
    self.min_compress_size = min_compress_size
    self.error_feedback = error_feedback
    self.abstain_nonfinite = abstain_nonfinite
    self.abstained = 0
    self.t = 0
    self.mu = [{k: np.zeros(v.shape, mu_dtype or v.dtype)
                for k, v in params.items()} for _ in range(num_workers)]
    self.error = [{k: np.zeros(v.shape, mu_dtype or v.dtype)
                   for k, v in params.items()} for _ in range(num_workers)]
    self.mu_dtype = mu_dtype

  def worker_vote(self, c):
    if self.quantizer == "sign":
      return worker_vote(c, self.vote)
    return l1_vote(c, self.level)

  def combine(self, cs, dtype):
    """D of one leaf, in ``dtype``, from every worker's (error-corrected)
    c."""
    if cs[0].size < self.min_compress_size:
      total = np.sum([c.astype(np.float64) for c in cs], axis=0)
      return np.sign(total).astype(dtype)
    return aggregate([self.worker_vote(c) for c in cs], self.aggregation,
                     dtype, self.level)

  def feed_back(self, k, cs, d, present):
    """p_i = c_i + e_i before the vote; e_i <- p_i - mean|p_i| * D after."""
    for i, c in zip(present, cs):
      p = np.asarray(c, np.float32)
      with np.errstate(invalid="ignore"):
        e = p - _l1_scale(p) * d.astype(np.float32)
      self.error[i][k] = np.where(np.isfinite(e), e, 0).astype(
          self.error[i][k].dtype)

  def sync(self, present=None):
    """The momenta of ``present`` (all workers: None) become their mean."""
    mu = self.mu if present is None else [self.mu[i] for i in present]
    for k in self.sync_leaves:
      mean = np.mean([np.where(np.isfinite(m[k]), m[k], 0).astype(np.float64)
                      for m in mu], axis=0)
      for m in mu:
        m[k] = mean.astype(m[k].dtype)

  def present(self, grads):
    """The workers that vote: all, or those whose gradients are finite."""
    if not self.abstain_nonfinite:
      return list(range(self.n))
    return [i for i in range(self.n) if all(
        np.isfinite(np.asarray(g, np.float64)).all()
        for g in grads[i].values())]

  def direction(self, grads):
    """D for one step, given grads[i][name] of every worker; updates mu."""
    out = {}
    present = self.present(grads)
    self.abstained = self.n - len(present)
    if not present:
      return None
    self.t += 1
    alone = len(present) == 1     # one worker's Lion (N = 1, or the rest out)
    for k in self.params:
      cs = []
      for i in present:
        g, m = grads[i][k], self.mu[i][k]
        c = (lin_comb(1.0 - self.b1, g, self.b1, m) if alone
             else vote_input(self.b1, g, m))
        if self.error_feedback and not alone:
          c = c + self.error[i][k]
        cs.append(c)
        new_m = lin_comb(1.0 - self.b2, g, self.b2, m)
        self.mu[i][k] = new_m.astype(self.mu_dtype or new_m.dtype)
      if alone:
        out[k] = np.sign(cs[0]).astype(
            np.result_type(grads[0][k].dtype, self.mu[0][k].dtype))
        continue
      out[k] = self.combine(
          cs, np.result_type(grads[0][k].dtype, self.mu[0][k].dtype))
      if self.error_feedback:
        self.feed_back(k, cs, out[k], present)
    if self.t in self.sync_steps and not alone:
      self.sync(present)
    return out

  def step(self, grads):
    """x <- x - lr * (D + wd * x), in the params' dtype."""
    direction = self.direction(grads)
    if direction is None:      # every worker abstained: skipped
      return None
    for k, p in self.params.items():
      u = mul_add(self.wd, p, direction[k])
      self.params[k] = mul_add(-self.lr, u, p).astype(p.dtype)
    return direction
