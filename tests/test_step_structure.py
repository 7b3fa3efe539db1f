"""The compiled step's packing and unpacking stay straight passes (XLA:CPU).

A timing assertion would be noise on a shared 2-core machine, so these read
the compiled optimizer step's HLO and fail when a known slow form comes
back (``python -m dlion_jax.bench.step`` measures what they cost):

* a ``pad`` longer than a plane of a run's words. XLA:CPU fuses a pad with
  its producer, the vote's encoding, into one loop that checks bounds per
  element and is not vectorised: the first write of the message into zeros
  rewritten as a pad of the whole message (``psum_int8`` took 4.6x the
  step without exchange), or the codes of a whole run padded to a multiple
  of the digits a word holds (``psum`` 2.7x);
* digit planes stacked in the word dtype, written out at 4 bytes a digit of
  ``uint32`` words instead of 1;
* a copy of the momentum: donated, and read by the vote's
  encoding before its update writes it in place, it is copied unless the
  update is ordered after the vote (8 bytes a parameter; ``optax.lion``'s
  step pays it: D-Lion MaVo ``auto`` went from 1.35-1.41x its time to
  0.86-0.94x on ``--tree two``, Avg from 1.59-1.90x to 1.13-1.43x).
"""

import math
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dlion_jax import _exchange as exchange
from dlion_jax import _message as message
from dlion_jax import _packing as packing
from dlion_jax import _quantize as quantize
from dlion_jax import devices
from dlion_jax import parallel
import dlion_jax as dl

N = 8
# Leaf sizes no word's digits divide (8 binary votes, 10 digits of the
# psum's radix 9, 5 trits a byte), big enough to be packed on their own.
SHAPES = {"w": (181, 401), "v": (70_001,), "b": (37,)}
CASES = [("mavo", c, "binary") for c in message.COMMS] + [
    ("avg", "alltoall", "binary"), ("mavo", "alltoall", "ternary"),
    ("mavo", "psum", "ternary")]


def optimizer_step(tx, mesh):
  """The step ``bench.step`` times: each worker's update of its own
  gradients, the params once; params and states donated."""
  def local(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(parallel.per_worker(
      local, mesh, ins=("replicated", "stacked", "stacked"),
      outs=("replicated", "stacked"), check_replicated=False),
                 donate_argnums=(0, 1))


def compiled_text(aggregation, comm, vote, tx=None):
  mesh = devices.data_mesh(N)
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32)
            for k, s in SHAPES.items()}
  grads = jax.device_put(
      {k: rng.standard_normal((N,) + s).astype(np.float32)
       for k, s in SHAPES.items()}, NamedSharding(mesh, P("data")))
  if tx is None:
    tx = dl.distributed_lion(1e-3, axis_name="data",
                             aggregation=aggregation, comm=comm, vote=vote)
  step = optimizer_step(tx, mesh)
  params = devices.replicate(params, mesh)
  states = parallel.init_worker_states(tx, params, mesh)
  return step.lower(params, states, grads).compile().as_text()


def plane_words(comm, aggregation, vote) -> int:
  """Words of one plane of the largest run: what a pad may fill."""
  spec = quantize.vote_spec(vote=vote)
  radix = message.message_radix(comm, N, spec)
  per_word = 1 if radix is None else packing.digits_per_word(radix)
  biggest = max(math.prod(s) for s in SHAPES.values())
  return -(-biggest // per_word)


_PAD = re.compile(r"= \w+\[(?P<dims>[\d,]*)\]\S* pad\(")


@pytest.mark.parametrize("aggregation,comm,vote", CASES, ids=str)
def test_no_pad_longer_than_a_plane(aggregation, comm, vote):
  text = compiled_text(aggregation, comm, vote)
  limit = plane_words(comm, aggregation, vote)
  pads = [math.prod(int(d) for d in m["dims"].split(",") if d)
          for m in _PAD.finditer(text)]
  assert all(size <= limit for size in pads), (pads, limit)


@pytest.mark.parametrize("aggregation,comm,vote", CASES, ids=str)
def test_digit_planes_are_stacked_narrow(aggregation, comm, vote):
  spec = quantize.vote_spec(vote=vote)
  radix = message.message_radix(comm, N, spec)
  if radix is None or packing.word_dtype(radix) == packing.digit_dtype(radix):
    pytest.skip("digits and words share a dtype")
  m = packing.digits_per_word(radix)
  word = "u32" if packing.word_dtype(radix) == np.uint32 else "u8"
  text = compiled_text(aggregation, comm, vote)
  wide_planes = re.findall(rf"= {word}\[(?:\d+,)*{m},\d+\]", text)
  assert not wide_planes, wide_planes


@pytest.mark.parametrize("aggregation,comm,vote",
                         [c for c in CASES if c[1] == "alltoall"], ids=str)
def test_gathered_results_are_transposed_as_words(aggregation, comm, vote):
  """``alltoall``'s gathered ``[worker, place, word]`` results reach the
  message's order as words, never unpacked first into a ``[N, m, S]``
  array of digits (ternary MaVo's were: 1.8-1.9x the floor, not 1.0x)."""
  m = packing.digits_per_word(quantize.vote_spec(vote=vote).radix)
  entry = compiled_text(aggregation, comm, vote).split("\nENTRY", 1)[1]
  digits = re.findall(rf"= u8\[{N},{m},\d+\]", entry)
  assert not digits, digits


def momentum_copies(text: str) -> list[str]:
  """The float32 copies, in the entry computation, of arrays shaped like a
  worker's momentum leaf (``[1, *leaf]``) of the leaves packed on their
  own (the small ones' updates come out of one run's: copied out of it)."""
  entry = text.split("\nENTRY", 1)[1]
  shapes = {",".join(map(str, (1,) + s)) for s in SHAPES.values()
            if math.prod(s) >= exchange.OWN_PACKING}
  return [dims for dims in re.findall(r"= f32\[([\d,]*)\]\S* copy\(", entry)
          if dims in shapes]


@pytest.mark.parametrize("aggregation,comm,vote", CASES, ids=str)
def test_the_momentum_is_not_copied(aggregation, comm, vote):
  assert not momentum_copies(compiled_text(aggregation, comm, vote))


def test_the_momentum_is_not_copied_in_buckets():
  """Every bucket's momenta wait for every bucket's vote (one ``done``)."""
  tx = dl.distributed_lion(1e-3, axis_name="data", bucket_bytes=300_000)
  text = compiled_text(None, None, None, tx=tx)
  assert text.count(" all-to-all(") >= 2   # the leaves were split
  assert not momentum_copies(text)


def test_the_checks_catch_the_slow_forms():
  """The patterns match what the slow forms compile to (so a pass above
  is not a pattern that matches nothing)."""
  assert _PAD.search("%bitcast_pad_fusion = s8[4194304]{0} pad(%x, %c), "
                     "padding=0_3145728")
  assert re.findall(r"= u32\[(?:\d+,)*10,\d+\]",
                    "%stack.87 = u32[10,314573]{1,0} concatenate(%a)")
  # optax.lion's step: both its fusions read the donated momentum.
  lion = compiled_text(None, None, None, tx=optax.lion(1e-3))
  assert sorted(momentum_copies(lion)) == ["1,181,401", "1,70001"]
