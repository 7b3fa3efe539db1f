"""What ``abstain_nonfinite=True`` sends, read off the compiled step.

A step no worker abstains from sends the default's message and the
abstainers' count (one int32 all-reduce); what ``dl.wire_bits(...,
abstain_nonfinite=True)`` models and what ``comm='auto'`` weighs, as
``dl.accounting.cheapest_comm(..., abstain_nonfinite=True)`` names it. The
other steps' messages sit in conditionals, which ``dl.collective_bytes`` counts
at their largest: alltoall's radix-3 results at odd N, and the lone
worker's flags of its zeros beside the vote.
"""

import jax.numpy as jnp
import pytest

import dlion_jax as dl
from dlion_jax import _message
from dlion_jax import _packing
from dlion_jax import _quantize
from dlion_jax import devices
from dlion_jax import parallel
from tiers import slow_but

LR = 1e-2


def compiled_step(n, shape, tx):
  """A make_train_step of ``tx`` on N workers, compiled, for a model of a
  ``shape`` matrix and a bias of its columns."""
  mesh = devices.data_mesh(n, axis_name="data")
  params = {"w": jnp.zeros(shape), "b": jnp.zeros(shape[1])}
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(
      lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, mesh,
      donate=False)
  batch = devices.shard_batch(jnp.ones((n, shape[0])), mesh)
  return step.lower(p, s, batch).compile()


def leaf_sizes(shape):
  return [shape[1], shape[0] * shape[1]]


def loss_mean(n):
  return 2 * (n - 1) / n * 4     # the step's pmean of the loss


def count_bytes(n):
  return 2 * (n - 1) / n * 4     # the abstainers' int32 psum


def everyday_bytes(n, shape, **options):
  return (dl.wire_bits(n, leaf_sizes=leaf_sizes(shape),
                       abstain_nonfinite=True, **options)
          * sum(leaf_sizes(shape)) / 8 + loss_mean(n))


@pytest.mark.parametrize("n", slow_but([3, 5, 7, 8], 0, 3))
def test_a_step_no_worker_abstains_from_sends_the_defaults_and_the_count(n):
  """comm='auto', 2,186 and 100,100 parameters: with every gradient finite
  the step sends the default's bytes and the count's all-reduce (at 5
  workers it had sent 198 B more at 2,186 parameters, +44%: the message
  was padded for radix-3 results on every step), what dl.wire_bits models
  with abstain_nonfinite=True."""
  for shape in ((84, 26), (1000, 100)):
    on = compiled_step(n, shape, dl.distributed_lion(
        LR, axis_name="data", abstain_nonfinite=True))
    off = compiled_step(n, shape, dl.distributed_lion(LR, axis_name="data"))
    everyday = dl.collective_bytes(on, conditional=False)
    assert everyday == pytest.approx(
        dl.collective_bytes(off) + count_bytes(n)), shape
    assert everyday == pytest.approx(everyday_bytes(n, shape)), shape


def test_the_count_costs_a_few_bytes_at_a_million_parameters():
  """8 workers, 1M parameters: 7 bytes a step more (4 bytes all-reduced),
  the conditional messages aside."""
  shape = (1000, 1000)
  on = compiled_step(8, shape, dl.distributed_lion(
      LR, axis_name="data", abstain_nonfinite=True))
  off = compiled_step(8, shape, dl.distributed_lion(LR, axis_name="data"))
  assert dl.collective_bytes(on, conditional=False) - dl.collective_bytes(
      off) == pytest.approx(count_bytes(8))


def lone_bytes(n, sizes, *, comm, aggregation="mavo", vote="binary",
               quantizer="sign", bits=None, min_compress_size=0):
  """What the step one worker alone votes in sends beside the vote. Its
  codes ride in the vote; binary codes have no 0, so its flags where its
  ``c`` is not 0, laid out as the codes, are all-reduced (the others'
  are 0); ternary codes say 0 themselves. Where the levels are L1-scaled,
  or summed as ints (``psum_int8``), its ternary signs: a message of
  ternary MaVo through the vote's strategy (the exact leaves' one sum
  carries its values on that step)."""
  voted = tuple(s for s in sizes if s >= min_compress_size)
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  if comm == "auto":
    comm = _message.choose_comm(n, aggregation=aggregation,
                                leaf_sizes=voted, spec=spec)
  layout = _message.MessageLayout(voted, n, spec, aggregation, comm)
  if spec.scaled or layout.radix is None and spec.radix == 2:
    return _message.MessageLayout(voted, n, _quantize.TERNARY, "mavo",
                                  comm).sent_bytes()
  if spec.radix != 2:
    return 0.0
  return 2 * (n - 1) / n * layout.used_words * jnp.dtype(
      layout.word_dtype).itemsize


def radix3_extra(n, sizes, *, comm, aggregation="mavo", vote="binary",
                 quantizer="sign", bits=None, min_compress_size=0):
  """How much more a binary MaVo over alltoall at odd N sends on a step an
  odd number abstained from: the message padded to shards of whole words
  of radix-3 results, which go back 5 to a byte rather than 8."""
  spec = _quantize.vote_spec(quantizer, vote=vote, bits=bits)
  if comm == "auto":
    comm = _message.choose_comm(n, aggregation=aggregation, spec=spec,
                                leaf_sizes=sizes)
  if not (comm == "alltoall" and aggregation == "mavo" and spec.radix == 2
          and n % 2):
    return 0.0
  words = _message.MessageLayout(tuple(s for s in sizes
                                       if s >= min_compress_size), n,
                                 spec, aggregation, comm).words
  per_word = _packing.digits_per_word(3)
  padded = -(-words // (n * per_word)) * n * per_word
  planes = _packing.digits_per_word(2)
  return (n - 1) / n * (padded + planes * padded / per_word - 2 * words)


@pytest.mark.parametrize("n,options", [
    (8, {"comm": "alltoall"}), (7, {"comm": "alltoall"}),
    (5, {"comm": "psum"}), (7, {"comm": "auto"}), (2, {"comm": "auto"}),
    (5, {"comm": "psum_int8", "vote": "ternary"}),
    (3, {"comm": "allgather", "quantizer": "pbit_l1", "bits": 3,
         "aggregation": "avg", "min_compress_size": 100}),
])
def test_the_byte_model_reads_what_the_compiled_step_sends(n, options):
  """dl.wire_bits(..., abstain_nonfinite=True) with a model's leaf sizes
  equals dl.collective_bytes(..., conditional=False) of its compiled step
  (a step no worker abstains from), the count's all-reduce included; read
  at its largest (each conditional's biggest branch), the step adds the
  lone worker's signs (a ternary MaVo message through the same comm) and,
  for a binary MaVo over alltoall at odd N, radix-3 results."""
  shape = (300, 70)
  compiled = compiled_step(n, shape, dl.distributed_lion(
      LR, axis_name="data", abstain_nonfinite=True, **options))
  everyday = everyday_bytes(n, shape, **{
      k: v for k, v in options.items() if k != "min_compress_size"}) if (
          "min_compress_size" not in options) else None
  sizes = leaf_sizes(shape)
  if everyday is None:      # wire_bits has no min_compress_size: by layout
    everyday = (count_bytes(n) + loss_mean(n) + _message.message_bytes(
        sizes, n, aggregation=options["aggregation"],
        spec=_quantize.vote_spec(options["quantizer"], bits=options["bits"]),
        comm=options["comm"],
        min_compress_size=options["min_compress_size"]))
  assert dl.collective_bytes(compiled, conditional=False) == pytest.approx(
      everyday)
  assert dl.collective_bytes(compiled) == pytest.approx(
      everyday + radix3_extra(n, sizes, **options)
      + lone_bytes(n, sizes, **options))


def _strategy(compiled):
  """The step's collectives, those of every branch too: (op, bytes,
  whether in a branch) in program order."""
  return [(c.op, c.result_bytes, c.conditional)
          for c in dl.hlo.collectives(compiled)]


def _agree(n, shape, **options):
  tx = lambda comm: dl.distributed_lion(LR, axis_name="data", comm=comm,
                                        abstain_nonfinite=True, **options)
  cheapest = lambda **kw: dl.accounting.cheapest_comm(
      n, leaf_sizes=leaf_sizes(shape), **options, **kw)
  named = cheapest(abstain_nonfinite=True)
  assert named == cheapest()
  assert _strategy(compiled_step(n, shape, tx("auto"))) == _strategy(
      compiled_step(n, shape, tx(named))), (n, shape, named)


@pytest.mark.parametrize("n,shape", [(5, (60, 5)), (8, (84, 26)),
                                     (3, (1000, 30))])
def test_auto_takes_the_strategy_cheapest_comm_names(n, shape):
  """With abstention comm='auto' runs what
  dl.accounting.cheapest_comm(..., abstain_nonfinite=True) names, the
  default's pick (at 5 workers and 305
  parameters it had taken allgather, cheapest_comm alltoall)."""
  _agree(n, shape)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_auto_and_cheapest_comm_agree_across_workers_and_sizes(n):
  for shape in ((60, 5), (84, 26), (1000, 30)):
    for options in ({}, {"aggregation": "avg"}, {"vote": "ternary"}):
      _agree(n, shape, **options)


def test_cheapest_comm_names_a_bad_flag():
  with pytest.raises(ValueError, match="abstain_nonfinite must be True or "
                     "False .*abstain_nonfinite=1"):
    dl.accounting.cheapest_comm(8, abstain_nonfinite=1)
