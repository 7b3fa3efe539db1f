"""Lock-step on a real device mesh, exact: hypothesis pytrees (empty,
one-element, fp32/bf16 mixed), N in 1..8, every aggregation x vote x comm in
one ``shard_map`` step; every worker's params equal the numpy reference bit
for bit (tests/test_lockstep.py runs more examples under ``vmap``, where XLA
may round intermediates elsewhere, so it compares within one rounding)."""

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st

import dlion_jax as dl
from drawn import drawn
from harness import AXIS
from harness import run_on_mesh
from reference import DistributedLionReference
from dlion_jax import _exchange as exchange

CONFIGS = list(itertools.product(("mavo", "avg"), ("binary", "ternary"),
                                 exchange.COMM_CHOICES))
STEPS = 3
LR = 1e-2
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
trees = st.dictionaries(
    st.sampled_from("abcdef"),
    st.tuples(shapes, st.sampled_from((np.float32, ml_dtypes.bfloat16))),
    min_size=1, max_size=4)


BF16 = ml_dtypes.bfloat16


# Always: empty, scalar and one-element leaves, bf16 next to fp32, odd and
# even N (MaVo ties).
EXAMPLES = [({"a": ((0,), BF16), "b": ((), np.float32), "c": ((1,), BF16),
              "d": ((3, 5), np.float32)}, 7, 1),
            ({"e": ((2, 0, 3), np.float32), "f": ((9,), BF16),
              "g": ((1, 1), np.float32)}, 8, 2)]


@drawn(trees, EXAMPLES, max_examples=1)
def test_every_worker_equals_numpy_bit_for_bit(spec, num_workers, seed):
  """Every aggregation x vote x comm, every worker: numpy's params bit for
  bit (two explicit pytrees and one drawn; the slow test draws 8)."""
  check_bit_for_bit(spec, num_workers, seed)


@pytest.mark.slow
@drawn(trees, EXAMPLES, max_examples=8)
def test_every_worker_equals_numpy_bit_for_bit_many_pytrees(spec, num_workers,
                                                             seed):
  """test_every_worker_equals_numpy_bit_for_bit on 8 drawn pytrees."""
  check_bit_for_bit(spec, num_workers, seed)


def check_bit_for_bit(spec, num_workers, seed):
  rng = np.random.default_rng(seed)
  params = {k: rng.normal(size=s).astype(d) for k, (s, d) in spec.items()}
  grads = [{k: rng.normal(size=(num_workers,) + s).astype(d)
            for k, (s, d) in spec.items()} for _ in range(STEPS)]
  txs = {f"{a} {v} {c}": dl.distributed_lion(LR, axis_name=AXIS,
                                             aggregation=a, vote=v, comm=c)
         for a, v, c in CONFIGS}
  out = run_on_mesh(txs, params, grads, num_workers)
  for aggregation, vote, comm in CONFIGS:
    ref = DistributedLionReference(params, num_workers, learning_rate=LR,
                                   aggregation=aggregation, vote=vote)
    for g in grads:
      ref.step([{k: v[i] for k, v in g.items()} for i in range(num_workers)])
    got = out[f"{aggregation} {vote} {comm}"][0]
    for k in spec:
      for i in range(num_workers):
        np.testing.assert_array_equal(
            got[k][i], ref.params[k],
            err_msg=f"{aggregation} {vote} {comm} N={num_workers} {k} "
            f"worker {i}")
