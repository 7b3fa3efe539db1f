"""The fused kernels with ``abstain_nonfinite=True``: the count of
abstainers enters the tallies and whether a worker votes enters the
encoding (its ``c = 0``, its momentum kept in the pass), as scalars.

``kernels='pallas'`` (Pallas' interpreter here) against ``kernels='xla'``
on the same gradients, bit for bit: the params, every worker's momentum,
the updates and the counts, through every comm, at odd and even N, in
float32 and bfloat16, on leaves the kernels take and leaves they leave to
XLA (sizes not multiples of 8 N). The steps: every worker finite, one
abstaining, an odd count (a binary majority of the present may tie), one
worker left (one worker's Lion: its codes in the vote, and the flags
of its zeros, written by the encoding kernel, summed beside it), every
worker (skipped), every worker finite again.
"""

import ml_dtypes
import numpy as np
import pytest

import dlion_jax as dl
from dlion_jax import _fused
from harness import run_on_mesh

LR = 1e-2
# (256, 256): 8 planes of 32 rows (binary words) and of 64 (the counters
# of 3 workers, 4 a byte); (32768,): flat; (37, 5) and (300,): for XLA.
SHAPES = {"w": (256, 256), "flat": (32768,), "odd": (37, 5), "v": (300,)}


def abstaining(n):
  """Who abstains on each step: none, one, an odd count, all but worker
  0, all, none."""
  odd = tuple(range(1, n, 2))[:3 if n > 5 else 1]
  return [(), (1,), odd, tuple(range(1, n)), tuple(range(n)), ()]


def grads_seq(n, dtype, seed=0):
  """Per-worker gradients, non-finite where :func:`abstaining` says."""
  rng = np.random.default_rng(seed)
  seq = []
  for t, out in enumerate(abstaining(n)):
    g = {k: rng.normal(size=(n,) + s).astype(dtype)
         for k, s in SHAPES.items()}
    for i in out:
      g["w"][i, t, i] = np.nan if i % 2 else np.inf
    g["odd"][:, :3] = 0.0      # c = 0 there: the lone worker's sign is 0
    g["w"][:, :, 250:] = 0.0   # ... on leaves the kernels take too
    g["flat"][:, -300:] = 0.0
    seq.append(g)
  return seq


def kernels_ran(monkeypatch):
  """The kernels called, each with whether it was given the abstention's
  scalars (the count, or whether this worker votes)."""
  ran = set()
  for name in ("encode", "tally", "decode", "vote_shard"):
    def counted(*args, _kernel=getattr(_fused, name), _name=name, **kw):
      ran.add((_name, kw.get("abstained") is not None
               or bool(kw.get("scalars"))))
      return _kernel(*args, **kw)
    monkeypatch.setattr(_fused, name, counted)
  return ran


CASES = [
    # (N, comm, aggregation, vote, dtype, kernels that must run)
    (8, "alltoall", "mavo", "binary", np.float32,
     {"encode", "vote_shard", "decode"}),
    (8, "allgather", "avg", "binary", ml_dtypes.bfloat16,
     {"encode", "tally"}),
    (3, "alltoall", "mavo", "binary", ml_dtypes.bfloat16, {"encode"}),
    (3, "psum", "avg", "binary", np.float32, {"encode", "tally"}),
    (5, "psum_int8", "mavo", "binary", np.float32, {"encode"}),
    (3, "alltoall", "avg", "binary", np.float32,
     {"encode", "vote_shard", "decode"}),
]
SLOW = [
    (8, "psum_int8", "avg", "binary", ml_dtypes.bfloat16, {"encode"}),
    (5, "allgather", "mavo", "binary", ml_dtypes.bfloat16,
     {"encode", "tally"}),
    (8, "alltoall", "avg", "binary", ml_dtypes.bfloat16,
     {"encode", "vote_shard", "decode"}),
]


@pytest.mark.parametrize(
    "n,comm,aggregation,vote,dtype,kernels",
    CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW],
    ids=lambda x: ("+".join(sorted(x)) if isinstance(x, (set, frozenset))
                   else getattr(x, "__name__", str(x))))
def test_kernels_with_abstainers_match_the_xla_path(
    monkeypatch, n, comm, aggregation, vote, dtype, kernels):
  ran = kernels_ran(monkeypatch)
  rng = np.random.default_rng(1)
  params = {k: rng.normal(size=s).astype(dtype) for k, s in SHAPES.items()}
  txs = {k: dl.distributed_lion(LR, weight_decay=1e-2, axis_name="data",
                                comm=comm, aggregation=aggregation,
                                vote=vote, abstain_nonfinite=True,
                                kernels=k) for k in ("pallas", "xla")}
  out = run_on_mesh(txs, params, grads_seq(n, dtype), n, check_vma=False)
  (p_fused, s_fused, u_fused), (p_xla, s_xla, u_xla) = (out["pallas"],
                                                        out["xla"])
  for k in params:
    np.testing.assert_array_equal(p_fused[k], p_xla[k], err_msg=k)
    np.testing.assert_array_equal(s_fused[0].mu[k], s_xla[0].mu[k],
                                  err_msg=k)
  for step, (a, b) in enumerate(zip(u_fused, u_xla)):
    for k in params:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"{step} {k}")
  for field in ("count", "abstained", "abstentions"):
    np.testing.assert_array_equal(getattr(s_fused[0], field),
                                  getattr(s_xla[0], field), err_msg=field)
  np.testing.assert_array_equal(s_fused[0].abstentions,
                                sum(map(len, abstaining(n))))
  assert {(name, True) for name in kernels} <= ran, ran
  assert not {name for name, given in ran if not given}, ran


def test_an_abstainer_keeps_its_momentum_through_the_kernels():
  """The encoding kernel keeps an abstainer's momentum as it was (its
  new momentum selected in the pass, not after it), every other
  worker's the XLA path's."""
  n = 3
  rng = np.random.default_rng(2)
  params = {"w": rng.normal(size=(256, 256)).astype(np.float32)}
  seq = [{"w": rng.normal(size=(n, 256, 256)).astype(np.float32)}
         for _ in range(2)]
  seq[1]["w"][2, 5, 7] = np.nan
  txs = {k: dl.scale_by_distributed_lion(axis_name="data",
                                         abstain_nonfinite=True, kernels=k)
         for k in ("pallas", "xla")}
  out = run_on_mesh(txs, params, seq, n, check_vma=False)
  one = run_on_mesh(txs, params, seq[:1], n, check_vma=False)
  mu = out["pallas"][1].mu["w"]
  np.testing.assert_array_equal(mu[2], one["pallas"][1].mu["w"][2])
  np.testing.assert_array_equal(mu, out["xla"][1].mu["w"])
  assert np.isfinite(mu).all()


@pytest.mark.tpu_aot
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_the_abstaining_step_takes_the_kernels_on_tpu(aggregation):
  """Compiled for 8 v5e chips (libtpu, no TPU): the abstaining step's
  encodings, shard vote and decodings are Mosaic kernels, whether the
  worker votes and the count their scalar operands (was: refused)."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  from jax.sharding import Mesh   # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import aot, step   # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(aot.tpu_devices("v5e:2x4", 1)[:8]), ("data",))
  tx = dl.distributed_lion(LR, axis_name="data", aggregation=aggregation,
                           abstain_nonfinite=True, kernels="pallas")
  text = step.tpu_compiled(tx, mesh, {"w": (256, 256), "v": (32768,),
                                      "b": (37,)}).as_text()
  calls = [line for line in text.splitlines()
           if 'custom_call_target="tpu_custom_call"' in line]
  assert len(calls) >= 4, len(calls)      # 2 encodings, a vote, a decoding
  assert sum("operand_layout_constraints={s32[1]" in line
             for line in calls) >= 3, calls
