"""The fused vote kernels (dlion_jax.fused) in Pallas' interpreter against
numpy, the optimizer through them against the numpy reference, and their
TPU compiles (``tpu_aot``)."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from dlion_jax import _collectives
from dlion_jax import _exchange
from dlion_jax import _fused as fused
from dlion_jax import _message as message
from dlion_jax import _packing as packing
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies
import dlion_jax as dl
from messages import assert_names
from tiers import slow_but

BF16 = ml_dtypes.bfloat16


def planes_of(x, m):
  """numpy: the leaf as ``[m, H, C]``: plane ``j`` is rows ``j H ..`` of
  the leaf with its leading axes merged (a flat leaf in rows of 128)."""
  lanes = x.shape[-1] if x.ndim > 1 else 128
  return x.reshape(m, -1, lanes)


def np_words(codes, radix):
  """numpy: digit ``j`` of word ``(r, c)`` is ``codes[j, r, c]``."""
  out = np.zeros(codes.shape[1:], np.uint64)
  for j in range(codes.shape[0]):
    out += codes[j].astype(np.uint64) * radix**j
  return out


def np_codes(c, radix):
  """numpy: sign-vote codes, 1 for c > 0 (binary); sign(c) + 1 (ternary)."""
  if radix == 2:
    return (c > 0).astype(np.uint8)
  return (np.sign(c) + 1).astype(np.uint8)


# (vote radix, word radix): binary into bytes, ternary into bytes (5 trits),
# binary counters of 8 workers (radix 9, 10 digits a uint32).
RADICES = [(2, 2), (3, 3), (2, 9)]


@pytest.mark.parametrize("vote_radix,radix", RADICES)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_encode_matches_numpy(vote_radix, radix, dtype):
  m = packing.digits_per_word(radix)
  rng = np.random.default_rng(radix)
  spec = quantize.VoteSpec(vote_radix)
  for shape in [(m * 32, 256), (m * 2, 16, 128), (m * 32 * 128,)]:
    assert fused.fits(shape, [dtype], radix), shape
    g = rng.standard_normal(shape).astype(dtype)
    mom = rng.standard_normal(shape).astype(dtype)
    g.flat[:5] = 0                       # ties: +0 votes -1 (binary) or 0
    combine = lambda g, m: g + m
    also = lambda g, m: m - g
    words, new_m = jax.jit(lambda g, m: fused.encode(
        combine, (g, m), spec=spec, radix=radix, also=also,
        interpret=True))(g, mom)
    c = (g.astype(np.float32) + mom.astype(np.float32)).astype(dtype)
    want = np_words(planes_of(np_codes(c, vote_radix), m), radix)
    assert words.dtype == packing.word_dtype(radix)
    np.testing.assert_array_equal(np.asarray(words).reshape(want.shape),
                                  want, err_msg=str(shape))
    np.testing.assert_array_equal(np.asarray(new_m), mom - g)
    # The words the XLA path packs, bit for bit.
    xla = packing.pack_planes(packing.leaf_planes(
        quantize.encode(jnp.asarray(c), spec), m), radix)
    np.testing.assert_array_equal(np.asarray(words).ravel(),
                                  np.asarray(xla).ravel())


@pytest.mark.parametrize("vote_radix,dtype", [(2, np.int8), (3, np.int16)])
def test_encode_writes_psum_int8_levels(vote_radix, dtype):
  """radix=None: no packing, each code's level a word of the container
  (psum_int8's message), the XLA path's bit for bit."""
  spec = quantize.VoteSpec(vote_radix)
  rng = np.random.default_rng(vote_radix)
  g, mom = (rng.standard_normal((64, 256)).astype(np.float32)
            for _ in range(2))
  g[0, :5] = -mom[0, :5]                 # c = 0: binary -1, ternary 0
  words, _ = fused.encode(lambda g, m: g + m, (g, mom), spec=spec,
                          radix=None, levels_dtype=dtype, interpret=True)
  c = g + mom
  want = (np.where(c > 0, 1, -1) if vote_radix == 2
          else np.sign(c)).astype(dtype)
  assert words.dtype == dtype
  np.testing.assert_array_equal(np.asarray(words), want)


def np_outcome(codes, num_workers, spec, aggregation):
  """numpy: the sum of levels over workers, or its sign."""
  levels = codes.astype(np.int64) * (2 if spec.radix == 2 else 1) - (
      1 if spec.radix == 2 else spec.max_level)
  s = levels.sum(axis=0)
  return np.sign(s) if aggregation == "mavo" else s


@pytest.mark.parametrize("num_workers", [3, 8])
@pytest.mark.parametrize("vote_radix", [2, 3])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
@pytest.mark.parametrize("summed", [False, True])
def test_tally_matches_numpy(num_workers, vote_radix, aggregation, summed):
  """Every worker's words (allgather) or their sum as counters (psum)."""
  spec = quantize.VoteSpec(vote_radix)
  radix = (vote_radix - 1) * num_workers + 1 if summed else vote_radix
  m = packing.digits_per_word(radix)
  shape = (m * 32, 256)
  rng = np.random.default_rng(num_workers)
  codes = rng.integers(0, vote_radix, (num_workers,) + shape, np.uint8)
  words = np.stack([np_words(planes_of(c, m), radix).ravel() for c in codes])
  if summed:
    words = words.sum(axis=0, keepdims=True)
  words = words.astype(packing.word_dtype(radix))
  out = jax.jit(lambda w: fused.tally(
      w, shape, radix=radix, num_workers=num_workers, spec=spec,
      aggregation=aggregation, interpret=True))(words)
  want = np_outcome(codes, num_workers, spec, aggregation)
  assert out.shape == shape and out.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(out), want)
  if aggregation == "mavo" and num_workers % 2 == 0:
    assert (want == 0).any()             # ties are in the draw


@pytest.mark.parametrize("num_workers,vote_radix,aggregation", [
    (3, 2, "mavo"),          # results: signs without ties, 8 a byte
    (8, 2, "mavo"),          # signs with ties, 5 trits a byte
    (8, 2, "avg"),           # counts of 8 workers' votes, 10 a uint32
    (3, 3, "avg")])          # counts of 3 ternary votes, radix 7
def test_decode_matches_numpy(num_workers, vote_radix, aggregation):
  """alltoall's gathered results, each worker's shard place by place in
  blocks, to the outcome of every digit of the message in order."""
  spec = quantize.VoteSpec(vote_radix)
  radix = strategies.alltoall_down_radix(
      num_workers, aggregation=aggregation, spec=spec)
  per_word, places = packing.digits_per_word(radix), 3
  shard = 2 * fused.DECODE_BLOCK
  q = -(-shard // per_word // fused.DECODE_BLOCK) * fused.DECODE_BLOCK
  q = max(q, fused.DECODE_BLOCK)
  rng = np.random.default_rng(radix)
  results = rng.integers(0, radix, (num_workers, places, shard))
  padded = np.zeros((num_workers, places, per_word * q), np.int64)
  padded[..., :shard] = results
  words = (padded.reshape(num_workers, places, per_word, q)
           * radix ** np.arange(per_word)[:, None]).sum(axis=2)
  out = jax.jit(lambda w: fused.decode(
      w, shard, radix=radix, num_workers=num_workers, spec=spec,
      aggregation=aggregation, interpret=True))(
          words.astype(packing.word_dtype(radix)))
  flat = results.transpose(1, 0, 2).reshape(places, -1)   # message order
  if aggregation == "avg":
    want = flat * (2 if vote_radix == 2 else 1) - num_workers * (
        1 if vote_radix == 2 else spec.max_level)
  else:
    want = 2 * flat - 1 if radix == 2 else flat - 1
  np.testing.assert_array_equal(np.asarray(out).reshape(places, -1), want)


@pytest.mark.parametrize("first,count", slow_but([
    (0, 33), (4, 2), (5, 2), (10, 3), (2, 25), (32, 1), (11, 11), (6, 1)],
    0, 4, 6))
def test_decode_reads_each_block_of_results_once(first, count):
  """A stretch of the message's outcome (3 shards of 11 blocks, results of
  5 trits a byte in 3 blocks a place), decoded a result block at a time
  and copied to each of its digits' places (TPU; one grid step a result
  block: the stretch wraps around a place, crosses shards) and an outcome
  block at a time (GPU): both the numpy reference's."""
  n, places, shard_blocks, place_blocks = 3, 2, 11, 3
  block, rows = fused.DECODE_BLOCK, fused.BLOCK_ROWS
  rng = np.random.default_rng(first + 40 * count)
  results = rng.integers(0, 3, (n, places, 5 * place_blocks * block))
  results[..., shard_blocks * block:] = 0             # past the shard
  words = (results.reshape(n, places, 5, -1)
           * 3 ** np.arange(5)[:, None]).sum(axis=2).astype(np.uint8)
  want = (results[..., :shard_blocks * block] - 1).transpose(1, 0, 2).reshape(
      places, -1)[:, first * block:(first + count) * block]
  kw = dict(radix=3, num_workers=n, spec=quantize.BINARY, aggregation="mavo",
            dtype=jnp.int8)
  outcome = functools.partial(fused._decoded, **kw)
  by = dict(result=fused._decode_by_result, block=fused._decode_by_block)
  for name, decode in by.items():
    got = decode(jnp.asarray(words.reshape(n, places, -1, 128)),
                 shard_blocks * block, first, count, outcome, jnp.int8,
                 radix=3, interpret=True)
    assert got.shape == (places, count * rows, 128), name
    np.testing.assert_array_equal(np.asarray(got).reshape(places, -1), want,
                                  err_msg=name)


@pytest.mark.parametrize("num_workers,vote_radix,aggregation", [
    (8, 2, "mavo"), (3, 2, "mavo"), (8, 2, "avg"), (3, 3, "avg"),
    (4, 3, "mavo")])
def test_vote_shard_packs_what_the_xla_tally_packs(num_workers, vote_radix,
                                                   aggregation):
  """alltoall's vote on a shard, every worker's words of it to the packed
  results: the words XLA's tally packs, padding included (a shard of 3
  blocks, results of 5, 8 or 10 a word)."""
  n, spec = num_workers, quantize.VoteSpec(vote_radix)
  m = packing.digits_per_word(vote_radix)
  down = strategies.alltoall_down_radix(n, aggregation=aggregation,
                                           spec=spec)
  per_word, shard = packing.digits_per_word(down), 3 * fused.DECODE_BLOCK
  q = -(-shard // per_word // fused.DECODE_BLOCK) * fused.DECODE_BLOCK
  codes = np.random.default_rng(n).integers(0, vote_radix, (n, m, shard))
  mine = (codes * vote_radix ** np.arange(m)[:, None]).sum(axis=1)
  got = fused.vote_shard(
      jnp.asarray(mine.astype(packing.word_dtype(vote_radix))), q,
      radix=vote_radix, down_radix=down, num_workers=n, spec=spec,
      aggregation=aggregation, interpret=True)
  count = codes.sum(axis=0)                          # [m, shard]
  s = (2 * count - n if vote_radix == 2 else count - n * spec.max_level)
  result = count if aggregation == "avg" else (
      (s > 0) if down == 2 else np.sign(s) + 1)
  padded = np.zeros((m, per_word * q), np.int64)
  padded[:, :shard] = result
  want = (padded.reshape(m, per_word, q)
          * down ** np.arange(per_word)[:, None]).sum(axis=1)
  assert got.dtype == packing.word_dtype(down)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_a_stretch_of_the_message_reads_its_own_blocks():
  """decode(blocks=) and tally(first_row=): a leaf's stretch of the
  message, the same outcome as the whole message's cut there."""
  n, spec, places, per_word = 8, quantize.BINARY, 2, 5
  shard = 2 * fused.DECODE_BLOCK
  rng = np.random.default_rng(5)
  words = rng.integers(0, 3 ** per_word, (n, places, fused.DECODE_BLOCK))
  words = jnp.asarray(words.astype(np.uint8))
  run = lambda **kw: np.asarray(fused.decode(
      words, shard, radix=3, num_workers=n, spec=spec, aggregation="mavo",
      interpret=True, **kw))
  whole, rows = run(), fused.BLOCK_ROWS
  np.testing.assert_array_equal(run(blocks=(5, 2)),
                                whole[:, 5 * rows:7 * rows])
  everyone = jnp.asarray(rng.integers(0, 256, (n, 4 * rows * 128), np.uint8))
  tally = lambda w, first_row=0: np.asarray(fused.tally(
      w, (8 * 2 * rows, 128), radix=2, num_workers=n, spec=spec,
      aggregation="mavo", first_row=first_row, interpret=True))
  np.testing.assert_array_equal(
      tally(everyone, first_row=rows),
      tally(everyone.reshape(n, -1, 128)[:, rows:3 * rows]))
  with pytest.raises(ValueError) as err:
    tally(everyone, first_row=3 * rows)
  assert_names(err, "first_row=96", "multiple of 32", "64 rows", "128 given")


@pytest.mark.parametrize("shape,dtype,radix,want", [
    ((256, 128), np.float32, 2, True),
    ((32768,), np.float32, 2, True),          # flat: 256 rows of 128
    ((8, 32, 128), BF16, 2, True),
    ((160, 128), np.float32, 3, True),        # 5 trits a byte
    ((256, 100), np.float32, 2, False),       # lanes not whole
    ((252, 128), np.float32, 2, False),       # planes not whole blocks
    ((4, 64, 128), np.float32, 2, True),      # 256 rows: 8 planes of 32
    ((2, 80, 128), np.float32, 3, False),     # 2 / 5, rows within tiles
    ((256, 128), np.float64, 2, False),
    ((256, 128), np.float32, 3, False),       # 256 rows in 5 planes
    ((), np.float32, 2, False),
])
def test_fits(shape, dtype, radix, want):
  assert fused.fits(shape, [dtype], radix) is want


def test_unknown_kernels_option_names_the_choices():
  with pytest.raises(ValueError) as err:
    dl.distributed_lion(1e-3, axis_name="data", kernels="triton")
  assert_names(err, "kernels", "'triton'", "'auto'", "'pallas'", "'xla'")


def test_encode_refuses_l1_scaled_votes():
  x = jnp.zeros((256, 128))
  with pytest.raises(ValueError, match="scale"):
    fused.encode(lambda g: g, (x,), spec=quantize.vote_spec("ternary_l1"),
                 radix=3, interpret=True)


TOPOLOGIES = ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"]


def tpu_chip(topology):
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology, "tpu").devices[0]


def compiled_for(chip, fn, *args, donate=()):
  """``fn`` compiled for one TPU ``chip`` (a compile-only device) on
  abstract ``args``."""
  placed = [jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(chip))
            for x in args]
  with jax.default_device(chip):   # jnp.sign asks the default device's kind
    return jax.jit(fn, donate_argnums=donate).lower(*placed).compile()


def declared_and_counted(compiled, nbytes):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return nbytes, cost["bytes accessed"]


# Every radix on v5e; binary votes on the other generations.
COMPILES = [("v5e:2x2", RADICES)] + [(t, RADICES[:1]) for t in TOPOLOGIES[1:]]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology,radices", COMPILES)
def test_kernels_compile_for_tpu_and_declare_their_bytes(topology, radices):
  """Mosaic compiles the four kernels for each TPU generation, float32 and
  bfloat16, binary and ternary codes in bytes and counters in uint32
  words; XLA's cost analysis counts a kernel's bytes as it declares them,
  so each must declare its operands and outputs (and no more). The
  momentum is donated: the new one is written over it (not donated, XLA
  copies it first, 8 bytes a parameter more)."""
  chip = tpu_chip(topology)
  for vote_radix, radix in radices:
    m = packing.digits_per_word(radix)
    shape = (m * 64, 1024)
    size, words = math.prod(shape), math.prod(shape) // m
    word_bytes = np.dtype(packing.word_dtype(radix)).itemsize
    spec = quantize.VoteSpec(vote_radix)
    for dtype in (jnp.float32, jnp.bfloat16):
      g = jax.ShapeDtypeStruct(shape, dtype)
      encode = compiled_for(chip, lambda g, m, r=radix, s=spec: fused.encode(
          lambda g, m: 0.1 * g + 0.9 * m, (g, m), spec=s, radix=r,
          also=lambda g, m: 0.01 * g + 0.99 * m), g, g, donate=1)
      declared = 3 * size * g.dtype.itemsize + words * word_bytes
      counted = declared_and_counted(encode, declared)[1]
      assert declared <= counted <= declared + 1024, (topology, radix, dtype)
      assert "tpu_custom_call" in encode.as_text()
    everyone = jax.ShapeDtypeStruct((8, shape[0] // m, shape[1]),
                                    packing.word_dtype(radix))
    tally = compiled_for(chip, lambda w, r=radix, s=spec: fused.tally(
        w, shape, radix=r, num_workers=8, spec=s, aggregation="mavo"),
                         everyone)
    declared = math.prod(everyone.shape) * word_bytes + size
    counted = declared_and_counted(tally, declared)[1]
    assert declared <= counted <= declared + 1024, (topology, radix)
  # psum_int8's levels: an int8 word a code, no packing.
  shape = (64, 1024)
  g = jax.ShapeDtypeStruct(shape, jnp.float32)
  levels = compiled_for(chip, lambda g, m: fused.encode(
      lambda g, m: 0.1 * g + 0.9 * m, (g, m), spec=quantize.BINARY,
      radix=None, levels_dtype=jnp.int8,
      also=lambda g, m: 0.01 * g + 0.99 * m), g, g, donate=1)
  declared = 3 * math.prod(shape) * 4 + math.prod(shape)
  counted = declared_and_counted(levels, declared)[1]
  assert declared <= counted <= declared + 1024, topology
  # alltoall's results: 5 trits a byte (N = 8), 8 signs a byte (N = 3),
  # 10 counters a uint32 (Avg, N = 8).
  decodes = [(8, "mavo"), (3, "mavo"), (8, "avg")][:len(radices)]
  for n, aggregation in decodes:
    radix = strategies.alltoall_down_radix(
        n, aggregation=aggregation, spec=quantize.BINARY)
    # A shard of 10 blocks: results in 2 blocks a place (1 for Avg's
    # uint32 words), each read once for all its digits.
    place_blocks = -(-10 // packing.digits_per_word(radix))
    results = jax.ShapeDtypeStruct((n, 8, 32 * place_blocks, 128),
                                   packing.word_dtype(radix))
    decode = compiled_for(chip, lambda w, n=n, a=aggregation, r=radix:
                          fused.decode(w.reshape(n, 8, -1),
                                       10 * fused.DECODE_BLOCK, radix=r,
                                       num_workers=n, spec=quantize.BINARY,
                                       aggregation=a), results)
    declared = (math.prod(results.shape) * results.dtype.itemsize
                + 8 * n * 10 * fused.DECODE_BLOCK)
    counted = declared_and_counted(decode, declared)[1]
    assert declared <= counted <= declared + 1024, (topology, n, aggregation)
    # The vote on a shard of 4 blocks, each read once: results of 1 block.
    # In rows of 128 lanes, as the step's all_to_all delivers them.
    mine = jax.ShapeDtypeStruct((n, 4 * 32, 128), jnp.uint8)
    vote = compiled_for(chip, lambda w, n=n, a=aggregation, r=radix:
                        fused.vote_shard(w.reshape(n, -1), fused.DECODE_BLOCK,
                                         radix=2, down_radix=r, num_workers=n,
                                         spec=quantize.BINARY,
                                         aggregation=a).reshape(8, -1, 128),
                        mine)
    declared = math.prod(mine.shape) + 8 * fused.DECODE_BLOCK * np.dtype(
        packing.word_dtype(radix)).itemsize
    counted = declared_and_counted(vote, declared)[1]
    assert declared <= counted <= declared + 1024, (topology, n, aggregation)


@pytest.mark.tpu_aot
def test_a_stack_of_layers_reaches_the_kernels_without_a_copy():
  """A stack of layers (``[L, R, C]``, ``L`` not ``m`` planes), as a
  scanned model's params are: its encoding and its tally move only the
  bytes they declare, in bfloat16 too (merging the stack's axes into
  rows of whole tiles copies nothing on TPU)."""
  chip = tpu_chip("v5e:2x2")
  shape, m = (3, 256, 384), 8
  size = math.prod(shape)
  for dtype in (jnp.float32, jnp.bfloat16):
    g = jax.ShapeDtypeStruct(shape, dtype)
    encode = compiled_for(chip, lambda g, m: fused.encode(
        lambda g, m: 0.1 * g + 0.9 * m, (g, m), spec=quantize.BINARY,
        radix=2, also=lambda g, m: 0.01 * g + 0.99 * m), g, g, donate=1)
    declared = 3 * size * g.dtype.itemsize + size // m
    counted = declared_and_counted(encode, declared)[1]
    assert declared <= counted <= declared + 1024, dtype
  everyone = jax.ShapeDtypeStruct((8, 3 * 256 // m, 384), jnp.uint8)
  tally = compiled_for(chip, lambda w: fused.tally(
      w, shape, radix=2, num_workers=8, spec=quantize.BINARY,
      aggregation="mavo"), everyone)
  declared = math.prod(everyone.shape) + size
  assert declared <= declared_and_counted(tally, declared)[1] <= (
      declared + 1024)


def test_pallas_off_tpu_under_check_vma_is_refused_with_the_fix():
  """Pallas' interpreter cannot run in a shard_map(check_vma=True): the
  step is refused, naming the options that run."""
  mesh = dl.devices.data_mesh(2)
  tx = dl.distributed_lion(1e-3, axis_name="data", kernels="pallas")
  params = {"w": jnp.ones((256, 128))}
  state = dl.parallel.init_worker_states(tx, params, mesh)
  grads = {"w": jnp.ones((2, 256, 128))}

  def update(g, s, p):
    g, s = jax.tree.map(lambda x: x[0], (g, s))
    u, s = tx.update(g, s, p)
    return u, jax.tree.map(lambda x: x[None], s)
  P = jax.sharding.PartitionSpec
  step = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(
      P("data"), P("data"), P()), out_specs=(P(), P("data")),
      check_vma=True))
  with pytest.raises(ValueError) as err:
    step(grads, state, params)
  assert_names(err, "kernels='pallas'", "check_vma=True", "kernels='auto'",
               "check_vma=False")


@pytest.mark.tpu_aot
def test_the_plain_step_takes_the_kernels_on_tpu():
  """The plain jitted step (dl.workers) runs each worker's update in a
  region manual over its axis, where the fused kernels run per device as
  in make_train_step's step: 'auto' takes them on TPU, 'xla' does not
  (was: 'auto' kept XLA there and 'pallas' was refused, the compiler
  unable to partition a Mosaic call)."""
  tpu_chip("v5e:2x2")                        # skips without libtpu
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  chips = topologies.get_topology_desc("v5e:2x2", "tpu").devices
  mesh = jax.sharding.Mesh(np.array(chips), ("data",))
  P = jax.sharding.PartitionSpec
  placed = lambda shape, spec, dtype=jnp.float32: jax.ShapeDtypeStruct(
      shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

  def compiled(kernels):
    tx = dl.distributed_lion(1e-3, axis_name="data", comm="allgather",
                             kernels=kernels)
    params = {"w": placed((256, 128), P())}
    grads = {"w": placed((4, 256, 128), P("data"))}
    states = jax.tree.map(lambda s: placed(s.shape, P("data"), s.dtype),
                          jax.eval_shape(jax.vmap(tx.init), grads))

    def step(params, states, grads):
      return dl.workers.update(tx, axis_name="data")(grads, states, params)
    with jax.set_mesh(mesh):
      return jax.jit(step).lower(params, states, grads).compile()

  assert "tpu_custom_call" in compiled("auto").as_text()
  assert "tpu_custom_call" in compiled("pallas").as_text()
  assert "tpu_custom_call" not in compiled("xla").as_text()


def update_step(n, **options):
  """A jitted step of ``scale_by_distributed_lion(**options)`` over ``n``
  workers: their stacked gradients and momenta in, the update out."""
  tx = dl.scale_by_distributed_lion(axis_name="data", **options)

  def local(grads, mu):
    return tx.update(grads, dl.DistributedLionState(
        jnp.zeros([], jnp.int32), mu))[0]
  return jax.jit(dl.parallel.per_worker(
      local, dl.devices.data_mesh(n), axis_name="data",
      ins=("stacked", "stacked"), outs="replicated", check_vma=False))


def stacked_normal(n, shapes, seed):
  """Gradients and momenta, ``n`` workers' rows of each shape."""
  rng = np.random.default_rng(seed)
  return [{k: jnp.asarray(rng.normal(size=(n,) + s), jnp.float32)
           for k, s in shapes.items()} for _ in range(2)]


@pytest.mark.parametrize("comm,aggregation", slow_but([
    ("alltoall", "mavo"), ("alltoall", "avg"), ("allgather", "mavo"),
    ("psum", "avg")], 0, 3))
def test_blocked_results_send_what_the_layout_counts(comm, aggregation):
  """With the message's outcome from one kernel in blocks (kernels='pallas'
  forces them), the compiled step sends exactly what MessageLayout with
  result_blocks counts: the shards (and alltoall's results) padded."""
  n, shapes = 8, {"w": (256, 256), "flat": (32768,), "odd": (37, 5)}
  step = update_step(n, comm=comm, aggregation=aggregation, kernels="pallas")
  arg = {k: jax.ShapeDtypeStruct((n,) + s, jnp.float32)
         for k, s in shapes.items()}
  sent = dl.hlo.collective_bytes(step.lower(arg, arg).compile())
  sizes = tuple(math.prod(s) for s in shapes.values())
  layout = message.MessageLayout(sizes, n, quantize.BINARY, aggregation,
                                    comm)
  blocked = message.MessageLayout(sizes, n, quantize.BINARY, aggregation,
                                     comm, result_blocks=fused.DECODE_BLOCK)
  assert sent == blocked.sent_bytes() > layout.sent_bytes()
  assert blocked.words % (n * fused.DECODE_BLOCK) == 0


def test_a_user_step_through_the_kernels_matches_the_xla_path():
  """make_train_step as users build it: gradients of a loss, the README's
  chain (clip_by_global_norm, weight decay masked off the bias), leaves
  that fit the kernels and one that does not. The params are the XLA
  path's bit for bit; the momenta within a rounding of each step's
  (XLA:CPU contracts (1 - b2) g + b2 m into a fused multiply-add on one
  product or the other depending on the fusion it lands in)."""
  n = 4
  mesh = dl.devices.data_mesh(n)
  key = jax.random.key(0)
  params = {"w": 0.05 * jax.random.normal(key, (256, 256)),
            "v": 0.05 * jax.random.normal(jax.random.key(1), (256, 1024)),
            "b": jnp.zeros(37)}

  def loss_fn(p, rows):
    x, y = rows
    h = jnp.tanh(x @ p["w"])
    return jnp.mean((h @ p["v"][:, :37] + p["b"] - y) ** 2)
  x = jax.random.normal(jax.random.key(2), (8 * n, 256))
  y = jax.random.normal(jax.random.key(3), (8 * n, 37))

  def run(kernels):
    tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
        1e-2, weight_decay=1e-2, axis_name="data", kernels=kernels,
        mask=lambda p: {"w": True, "v": True, "b": False}))
    step = dl.parallel.make_train_step(loss_fn, tx, mesh)
    state = dl.parallel.init_worker_states(tx, params, mesh)
    p = jax.tree.map(jnp.copy, params)      # the step donates them
    for _ in range(3):
      p, state, _ = step(p, state, (x, y))
    return p, state[1][0].mu
  (p_xla, mu_xla), (p_fused, mu_fused) = run("xla"), run("pallas")
  jax.tree.map(np.testing.assert_array_equal, p_fused, p_xla)
  for k in mu_xla:
    a, b = np.asarray(mu_fused[k]), np.asarray(mu_xla[k])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


def test_a_user_step_lowers_for_cuda_through_triton(monkeypatch):
  """On a GPU (fused.platform() 'gpu'; here the step is exported for CUDA
  from this machine, which has none) kernels='pallas' compiles the kernels
  with Triton, not Pallas' interpreter: a user's make_train_step exports
  for CUDA with a Triton call for each kernel and the interpreter's grid
  loops gone. Not run: Triton compiles them on the GPU itself."""
  monkeypatch.setattr(fused, "platform", lambda: "gpu")
  n = 4
  mesh = dl.devices.data_mesh(n)
  params = {"w": jnp.zeros((256, 256)), "v": jnp.zeros((256, 1024)),
            "b": jnp.zeros(37)}

  def loss_fn(p, rows):
    x, y = rows
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"][:, :37] + p["b"] - y)**2)
  batch = (jnp.zeros((8 * n, 256)), jnp.zeros((8 * n, 37)))

  def exported(kernels, comm):
    tx = optax.chain(optax.clip_by_global_norm(1.0), dl.distributed_lion(
        1e-2, weight_decay=1e-2, axis_name="data", kernels=kernels,
        comm=comm))
    step = dl.parallel.make_train_step(loss_fn, tx, mesh)
    state = dl.parallel.init_worker_states(tx, params, mesh)
    return jax.export.export(
        jax.jit(lambda *args: step(*args)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")])(params, state, batch).mlir_module()
  for comm in ("alltoall", "allgather"):
    text = exported("pallas", comm)
    # w's and v's encodings, and the tally or the decoding of the results.
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 3, comm
    assert "stablehlo.while" not in text, comm       # no interpreter
  # Each kernel's warps, the fewest ptxas held without spills (sm_90).
  assert "num_warps = 8 : i32" in text               # encode
  assert "num_warps = 16 : i32" in text              # tally (allgather)
  # psum_int8: w's and v's levels encoded, the summed levels the outcome.
  text = exported("pallas", "psum_int8")
  assert text.count("custom_call @__gpu$xla.gpu.triton") == 2
  assert "stablehlo.while" not in text
  assert "__gpu$xla.gpu.triton" not in exported("auto", "alltoall")


@pytest.mark.parametrize("comm,words", [("psum_int8", (128, 256)),
                                        ("psum", (32, 256))])
def test_summed_strategies_sum_a_kernel_leaf_in_its_own_shape(monkeypatch,
                                                              comm, words):
  """An all-reduce sums each word where it lies, so ``psum_int8``'s levels
  and ``psum``'s counters (4 a byte at N = 3) of a leaf whose rows are not
  128 lanes go in the shape the kernel wrote them (laid into one flat
  message they were relaid out, on TPU, both ways), the leaves in rows of
  128 and the small ones end to end in one piece; the updates are the XLA
  path's bit for bit. The kernels are taken as ``'auto'`` takes them on
  TPU (``'pallas'`` would tally ``psum``'s message in blocks, whole)."""
  n = 3
  monkeypatch.setattr(_exchange, "_uses_kernels",
                      lambda kernels, constants, axis_name: kernels != "xla")
  summed, psum = [], _collectives.psum
  def recorded(x, *args, **kwargs):
    summed.append(jax.tree.map(lambda a: a.shape, x))
    return psum(x, *args, **kwargs)
  monkeypatch.setattr(_collectives, "psum", recorded)
  rows = stacked_normal(n, {"w": (128, 256), "flat": (8192,), "b": (37,)}, 0)
  run = lambda kernels: update_step(n, comm=comm, kernels=kernels)(*rows)
  xla = run("xla")
  del summed[:]
  jax.tree.map(np.testing.assert_array_equal, run("auto"), xla)
  m = 128 * 256 // math.prod(words)
  assert summed == [{0: words, math.prod(words): (
      8192 // m + -(-37 // m),)}], summed


def test_leaves_that_fit_go_first_and_decode_alone(monkeypatch):
  """A big leaf that fits the kernels after one that does not, in tree
  order (a stack of biases before a stack of layers): it goes first in
  the message, so ``decode`` writes its outcome in a call of its own (a
  slice of the rest's would be a copy on TPU); the updates are the XLA
  path's bit for bit."""
  n = 4
  calls, decode = [], fused.decode
  def recorded(*args, **kwargs):
    calls.append(kwargs.get("blocks"))
    return decode(*args, **kwargs)
  monkeypatch.setattr(fused, "decode", recorded)
  rows = stacked_normal(n, {"a_bias": (18, 1000), "b_layers": (2, 128, 256)},
                        1)
  run = lambda kernels: update_step(n, comm="alltoall", kernels=kernels)(
      *rows)
  xla = run("xla")
  jax.tree.map(np.testing.assert_array_equal, run("pallas"), xla)
  leaf_blocks = 2 * 128 * 256 // 8 // fused.DECODE_BLOCK
  assert (0, leaf_blocks) in calls, calls
