"""Wire accounting: analytic bits, and the HLO-measured bits against them.

Compile-only: nothing here runs a collective, so the file stays fast. The
HLO reader's own tests are in test_hlo.py, MessageLayout's in
test_message.py.
"""

import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import devices
from dlion_jax import hlo
import dlion_jax as dl
from compiled import AXIS
from compiled import SIZES
from compiled import compile_on_mesh
from compiled import compile_update
from tiers import slow_but

COMMS = message.COMMS
D = sum(SIZES)
CONFIGS = [(a, v) for a in message.AGGREGATIONS for v in quantize.VOTES]


# --- HLO-measured bits against wire_bits and message_bytes -----------------


@pytest.mark.parametrize("comm", COMMS + ("auto",))
@pytest.mark.parametrize("n", slow_but([2, 3, 5, 8], 1, 3))
def test_hlo_bits_match_wire_bits(n, comm):
  for aggregation, vote in CONFIGS:
    kw = dict(aggregation=aggregation, vote=vote, comm=comm)
    compiled = compile_update(n, **kw)
    sent = hlo.collective_bytes(compiled)
    # Exact, padding included.
    spec = quantize.vote_spec(vote=vote)
    picked = exchange.resolve_comm(comm, n, aggregation=aggregation,
                                   spec=spec, leaf_sizes=SIZES)
    expected = message.message_bytes(SIZES, n, aggregation=aggregation,
                                     spec=spec, comm=picked)
    assert sent == pytest.approx(expected, rel=1e-12), kw
    # Per parameter: the analytic figure, up to padding (< 320 digits of ~1e5).
    bits = sent * 8 / D
    analytic = dl.wire_bits(n, **kw)
    assert analytic - 1e-9 <= bits <= analytic * (1 + 320 / D), (kw, bits)


def test_auto_counts_padding_on_small_models():
  """64 parameters at N=8: alltoall's shard padding costs more than it saves."""
  kw = dict(aggregation="mavo", spec=quantize.BINARY)
  small = {c: message.message_bytes([64], 8, comm=c, **kw) for c in COMMS}
  picked = exchange.resolve_comm("auto", 8, leaf_sizes=[64], **kw)
  assert small[picked] == min(small.values())
  assert picked != "alltoall" and small["alltoall"] > small[picked]
  # Large models: the asymptotic choice.
  assert exchange.resolve_comm("auto", 8, leaf_sizes=[10**6], **kw) == (
      "alltoall")


@pytest.mark.parametrize("comm", COMMS)
def test_hlo_ops_per_strategy(comm):
  """The compiled update issues the collectives its strategy's record
  says, each sending the record's bits a parameter (up to padding)."""
  ops = {"alltoall": ["all-to-all", "all-gather"],
         "allgather": ["all-gather"],
         "psum": ["all-reduce"],
         "psum_int8": ["all-reduce"]}[comm]
  compiled = compile_update(5, aggregation="mavo", vote="binary", comm=comm)
  found = hlo.collectives(compiled.as_text())
  assert [c.op for c in found] == ops
  assert all(c.group_size == 5 for c in found)
  record = message.collective_bits(5, aggregation="mavo",
                                      spec=quantize.BINARY, comm=comm)
  assert [op for op, _ in record] == ops
  for c, (_, bits) in zip(found, record):
    assert bits - 1e-9 <= c.sent_bytes * 8 / D <= bits * (1 + 320 / D), (
        c, bits)


def test_single_worker_sends_nothing():
  compiled = compile_update(1, aggregation="mavo", vote="binary",
                            comm="alltoall")
  assert hlo.collectives(compiled.as_text()) == []
  assert hlo.collective_bytes(compiled) == 0
  assert dl.wire_bits(1) == 0.0


def test_fp32_pmean_matches_allreduce_bits():
  mesh = devices.data_mesh(8, axis_name=AXIS)
  compiled = compile_on_mesh(lambda g: lax.pmean(g, AXIS), mesh, P(AXIS),
                             (8 * 1000,))
  bits = hlo.collective_bytes(compiled) * 8 / 1000
  assert bits == pytest.approx(dl.allreduce_bits(8)) == pytest.approx(56.0)
  assert dl.allreduce_bits(8, jnp.bfloat16) == 28.0


# --- wire_bits: values, auto, errors ----------------------------------------


def test_wire_bits_known_values():
  assert dl.wire_bits(8) == pytest.approx(2.275)
  assert dl.wire_bits(8, comm="psum_int8") == 14.0
  assert dl.wire_bits(8, comm="allgather") == 7.0
  assert dl.wire_bits(8, comm="psum") == pytest.approx(2 * 7 / 8 * 3.2)
  assert dl.wire_bits(8, aggregation="avg") == pytest.approx(7 / 8 * 4.2)
  assert dl.wire_bits(2) == 1.0         # allgather of 1 bit beats alltoall
  assert dl.wire_bits(200, comm="psum_int8") == pytest.approx(
      2 * 199 / 200 * 16)               # int8 cannot sum 200 votes


@pytest.mark.parametrize("aggregation,vote", CONFIGS)
def test_auto_is_min_over_strategies(aggregation, vote):
  for n in range(1, 70):
    each = {c: dl.wire_bits(n, aggregation=aggregation, vote=vote, comm=c)
            for c in COMMS}
    auto = dl.wire_bits(n, aggregation=aggregation, vote=vote)
    assert auto == min(each.values()), n
    picked = exchange.resolve_comm("auto", n, aggregation=aggregation,
                                   spec=quantize.vote_spec(vote=vote))
    assert each[picked] == pytest.approx(auto, abs=1e-9), (n, picked)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_workers=0), "num_workers"),
    (dict(num_workers=-3), "num_workers"),
    (dict(num_workers=2.0), "num_workers"),
    (dict(num_workers="8"), "num_workers"),
    (dict(num_workers=8, aggregation="mean"), "aggregation"),
    (dict(num_workers=8, vote="sign"), "vote"),
    (dict(num_workers=8, comm="ring"), "comm"),
    (dict(num_workers=8, comm=None), "comm"),
])
def test_wire_bits_errors(kwargs, match):
  n = kwargs.pop("num_workers")
  with pytest.raises(ValueError, match=match):
    dl.wire_bits(n, **kwargs)
