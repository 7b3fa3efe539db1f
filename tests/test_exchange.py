"""The exchange's public entry points, called the way a user building a
vote of their own would, inside jax.shard_map: exchange_votes and
aggregate_updates against numpy, through every strategy, at an odd and an
even number of workers, with leaves no packing unit divides."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize

SIZES = (37, 1, 130)


def _per_worker(n, fn, values):
  """``fn(rows of worker i)`` on each of ``n`` devices, its outputs
  replicated."""
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  mapped = jax.shard_map(lambda *v: fn([x[0] for x in v]), mesh=mesh,
                         in_specs=P("data"), out_specs=P(), check_vma=False)
  values = jax.device_put(values, jax.NamedSharding(mesh, P("data")))
  return jax.device_get(jax.jit(mapped)(*values))


def _values(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((n, s)).astype(np.float32) for s in SIZES]


@pytest.mark.parametrize("comm", message.COMM_CHOICES)
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
def test_exchange_votes_is_the_vote_of_the_signs(n, comm, aggregation):
  values = _values(n)
  got = _per_worker(n, lambda v: exchange.exchange_votes(
      v, axis_name="data", num_workers=n, spec=quantize.BINARY,
      aggregation=aggregation, comm=comm), values)
  for mine, v in zip(got, values):
    total = np.sign(v).sum(0).astype(np.int32)        # sum of +-1 levels
    want = np.sign(total) if aggregation == "mavo" else total
    np.testing.assert_array_equal(mine, want)


@pytest.mark.parametrize("comm", message.COMM_CHOICES)
@pytest.mark.parametrize("n", [3, 4])
def test_aggregate_updates_is_distributed_lions_update(n, comm):
  """MaVo: sign of the vote; Avg: the vote's sum over N, in each leaf's
  dtype; a leaf under min_compress_size: sign of the values' sum."""
  values = _values(n, seed=1)
  for aggregation in ("mavo", "avg"):
    got = _per_worker(n, lambda v: exchange.aggregate_updates(
        v, axis_name="data", num_workers=n, spec=quantize.BINARY,
        aggregation=aggregation, comm=comm, min_compress_size=2), values)
    for size, mine, v in zip(SIZES, got, values):
      total = np.sign(v).sum(0)
      if size < 2:
        want = np.sign(v.sum(0))
      elif aggregation == "mavo":
        want = np.sign(total)
      else:
        want = (total / n).astype(np.float32)
      assert mine.dtype == np.float32
      np.testing.assert_array_equal(mine, want, err_msg=(aggregation, size))
