"""Lion Cub's options against the numpy reference, on simulated devices.

Quantized votes are checked bit for bit: the gradients lie on a dyadic grid
and ``b1 = 0`` makes ``c`` the gradient, so every worker's ``sum |c|`` is
exact in float32 whatever the summation order, and the reference reproduces
the scale ``a`` and every level exactly.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import dlion_jax as dl
from harness import AXIS
from harness import random_tree
from harness import run_on_mesh
from messages import assert_names
from reference import l1_vote
from test_lion import SHAPES
from test_lion import make_grads
from test_lion import run_reference
from trajectory import trajectory_on_mesh
from dlion_jax import _message as message
from dlion_jax import _quantize as quantize
from dlion_jax import _strategies as strategies

COMMS = ("alltoall", "allgather", "psum", "psum_int8")
LR, WD = 1e-2, 1e-3
QUANTIZERS = [("ternary_l1", None), ("pbit_l1", 3), ("pbit_l1", 4)]


def dyadic_grads(rng, num_workers, steps):
  """Gradients k / 1024, |k| < 4096: sums of |c| are exact in float32."""
  grads = []
  for _ in range(steps):
    g = {k: (rng.integers(-4096, 4096, size=(num_workers,) + s)
             / 1024.0).astype(np.float32) for k, s in SHAPES.items()}
    g["zero"][:] = 0
    grads.append(g)
  return grads


def assert_params_match(out, ref, num_workers, keys=SHAPES):
  for name, (params, _, _) in out.items():
    for k in keys:
      for i in range(num_workers):
        np.testing.assert_array_equal(params[k][i], ref.params[k],
                                      err_msg=f"{name} params[{k}] worker {i}")


def test_l1_levels_examples():
  """The levels of one leaf, worked by hand: a = mean |c| = 1."""
  c = jnp.array([-2.5, -1.0, -0.25, 0.0, 0.75, 1.5])
  def levels(spec, level):
    return list(np.asarray(quantize.encode(c, spec)).astype(int) - level)
  assert levels(quantize.TERNARY, 1) == [-1, -1, -1, 0, 1, 1]  # sign(c)
  ternary_l1 = quantize.vote_spec("ternary_l1")
  assert levels(ternary_l1, 1) == [-1, -1, 0, 0, 1, 1]      # dead zone
  assert levels(quantize.vote_spec("pbit_l1", bits=3), 3) == [
      -3, -3, -1, 0, 2, 3]                                # round(3c), clipped
  for bits in (2, 4, 8):
    level = 2 ** (bits - 1) - 1
    got = levels(quantize.vote_spec("pbit_l1", bits=bits), level)
    assert got == list(l1_vote(np.asarray(c), level)), bits
  assert levels(quantize.vote_spec("pbit_l1", bits=3), 3) == list(
      l1_vote(np.asarray(c), 3))
  zeros = quantize.encode(jnp.zeros(4), ternary_l1)      # a = 0: abstain
  assert list(np.asarray(zeros)) == [1, 1, 1, 1]


def check_quantized_votes(num_workers, configs):
  """Every comm of each (aggregation, quantizer, bits) in ``configs``, all in
  one program, gives the reference's params bit for bit."""
  rng = np.random.default_rng(num_workers)
  params = random_tree(rng, SHAPES)
  grads = dyadic_grads(rng, num_workers, steps=4)
  txs = {f"{a} {q} {b} {c}": dl.distributed_lion(
      LR, b1=0.0, weight_decay=WD, axis_name=AXIS, aggregation=a, comm=c,
      quantizer=q, bits=b) for a, q, b in configs for c in COMMS + ("auto",)}
  out = run_on_mesh(txs, params, grads, num_workers)
  for a, q, b in configs:
    ref = run_reference(params, grads, num_workers, b1=0.0, aggregation=a,
                        quantizer=q, bits=b)
    assert_params_match({k: v for k, v in out.items()
                         if k.startswith(f"{a} {q} {b} ")}, ref, num_workers)


# Each aggregation and quantizer through every comm, each quantizer with an
# odd and an even N; N = 7 with 4-bit levels packs counters of radix 99,
# four to a uint32 word. The slow test below runs the whole product.
COVERING = {2: [("mavo", "ternary_l1", None), ("avg", "pbit_l1", 4)],
            3: [("mavo", "pbit_l1", 3), ("avg", "ternary_l1", None)],
            7: [("mavo", "pbit_l1", 4)],
            8: [("avg", "pbit_l1", 3)]}


@pytest.mark.parametrize("num_workers", sorted(COVERING))
def test_quantized_votes_match_reference(num_workers):
  """Every comm gives the reference's params, bit for bit, for the
  configurations of COVERING."""
  check_quantized_votes(num_workers, COVERING[num_workers])


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, 3, 7, 8])
@pytest.mark.parametrize("aggregation", ["mavo", "avg"])
@pytest.mark.parametrize("quantizer,bits", QUANTIZERS,
                         ids=["ternary_l1", "pbit3", "pbit4"])
def test_quantized_votes_match_reference_everywhere(num_workers, aggregation,
                                                    quantizer, bits):
  """test_quantized_votes_match_reference on every N x aggregation x
  quantizer."""
  check_quantized_votes(num_workers, [(aggregation, quantizer, bits)])


def test_eight_bit_levels_widen_the_int_container():
  """255 levels from 8 workers sum to +-1016: psum_int8 widens to int16."""
  rng = np.random.default_rng(5)
  params = random_tree(rng, SHAPES)
  grads = dyadic_grads(rng, 8, steps=2)
  txs = {c: dl.distributed_lion(LR, b1=0.0, axis_name=AXIS, comm=c,
                                aggregation="avg", quantizer="pbit_l1",
                                bits=8) for c in COMMS}
  out = run_on_mesh(txs, params, grads, 8)
  ref = run_reference(params, grads, 8, b1=0.0, aggregation="avg",
                      quantizer="pbit_l1", bits=8)
  assert_params_match(out, ref, 8)
  spec = quantize.vote_spec("pbit_l1", bits=8)
  assert strategies.int_container(8, spec) == jnp.int16


def test_ternary_l1_is_pbit_2():
  assert quantize.vote_spec("ternary_l1") == quantize.vote_spec(
      "pbit_l1", bits=2) == quantize.VoteSpec(3, scaled=True)


def _momenta_equal(state, names):
  return {k: bool(np.all(state[0].mu[k] == state[0].mu[k][:1]))
          for k in names}


@pytest.mark.parametrize("schedule,expected", [
    (3, {3, 6}),
    (dl.sync.growing_intervals(2), {1, 2, 3, 5, 7}),
])
def test_momenta_become_equal_exactly_at_sync_steps(schedule, expected):
  """After each step the momenta are all equal or all differ, equal exactly
  at the schedule's sync steps; the params are the reference's."""
  num_workers, steps = 4, 7
  rng = np.random.default_rng(1)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, num_workers, steps=steps)
  tx = dl.distributed_lion(LR, axis_name=AXIS, momentum_sync=schedule)
  params_t, states_t = trajectory_on_mesh(tx, params, grads, num_workers)
  synced = set()
  names = ("odd", "mat", "big")
  for t in range(1, steps + 1):
    state = jax.tree.map(lambda x, t=t: x[:, t - 1], states_t)
    equal = _momenta_equal(state, names)
    assert len(set(equal.values())) == 1, equal
    if all(equal.values()):
      synced.add(t)
  assert synced == expected
  last = jax.tree.map(lambda x: x[:, -1], (params_t, states_t))
  ref = run_reference(params, grads, num_workers, sync_steps=expected)
  assert_params_match({"s": (*last, None)}, ref, num_workers)
  for i in range(num_workers):     # the mean: one rounding of the float sum
    np.testing.assert_allclose(last[1][0].mu["big"][i], ref.mu[i]["big"],
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("as_function", [False, True])
def test_sync_mask_limits_which_momenta_are_averaged(as_function):
  num_workers = 3
  rng = np.random.default_rng(2)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, num_workers, steps=2)
  chosen = ("odd", "one")
  mask = (dl.sync.leaves_matching("odd|one") if as_function
          else {k: k in chosen for k in SHAPES})
  tx = dl.distributed_lion(LR, axis_name=AXIS, momentum_sync=2,
                           momentum_sync_mask=mask)
  out = run_on_mesh({"s": tx}, params, grads, num_workers)
  equal = _momenta_equal(out["s"][1], ("odd", "one", "mat", "big"))
  assert equal == {"odd": True, "one": True, "mat": False, "big": False}
  ref = run_reference(params, grads, num_workers, sync_steps={2},
                      sync_leaves=chosen)
  assert_params_match(out, ref, num_workers)


def test_sync_is_a_conditional_all_reduce_of_the_masked_momenta():
  """The sync's bytes appear in a lax.cond branch, apart from the vote."""
  mesh = dl.devices.data_mesh(4)
  params = {"w": jnp.zeros(1000), "b": jnp.zeros(10)}
  tx = dl.distributed_lion(1e-2, axis_name="data", momentum_sync=5,
                           momentum_sync_mask={"w": True, "b": False})
  state = dl.parallel.init_worker_states(tx, params, mesh)
  step = dl.parallel.make_train_step(
      lambda p, x: jnp.mean((x @ p["w"] + p["b"].sum()) ** 2), tx, mesh)
  hlo = step.lower(params, state, jnp.ones((8, 1000))).compile().as_text()
  found = dl.hlo.collectives(hlo)
  synced = [c for c in found if c.conditional]
  assert [c.op for c in synced] == ["all-reduce"]
  assert synced[0].sent_bytes == 2 * 3 / 4 * 4 * 1000     # fp32 'w' only
  assert dl.collective_bytes(hlo) - dl.collective_bytes(
      hlo, conditional=False) == synced[0].sent_bytes


def test_small_leaves_are_exchanged_exactly():
  """Below min_compress_size, D = sign(sum_i c_i), even against the
  majority: two workers slightly positive, one strongly negative."""
  num_workers = 3
  rng = np.random.default_rng(3)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, num_workers, steps=3)
  grads[0]["odd"][:, 0] = [0.1, 0.1, -5.0]
  txs = {c: dl.distributed_lion(LR, axis_name=AXIS, comm=c,
                                min_compress_size=40) for c in COMMS}
  out = run_on_mesh(txs, params, grads, num_workers)
  ref = run_reference(params, grads, num_workers, min_compress_size=40)
  assert_params_match(out, ref, num_workers)
  voted = run_reference(params, grads[:1], num_workers)
  exact = run_reference(params, grads[:1], num_workers, min_compress_size=40)
  assert voted.params["odd"][0] < params["odd"][0] < exact.params["odd"][0]


def test_min_compress_size_costs_an_exact_all_reduce():
  sizes = [1000, 37, 5]
  packed = message.message_bytes(sizes[:1], 4, comm="psum")
  assert message.message_bytes(sizes, 4, comm="psum",
                                  min_compress_size=40) == (
                                         packed + 2 * 3 / 4 * 4 * 42)


@pytest.mark.parametrize("quantizer,bits", [("sign", None),
                                            ("ternary_l1", None)])
def test_error_feedback_matches_reference(quantizer, bits):
  num_workers = 5
  rng = np.random.default_rng(4)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, num_workers, steps=5)
  kwargs = dict(quantizer=quantizer, bits=bits)
  txs = {c: dl.distributed_lion(LR, axis_name=AXIS, comm=c,
                                error_feedback=True, **kwargs)
         for c in ("psum", "alltoall")}
  out = run_on_mesh(txs, params, grads, num_workers)
  if quantizer == "sign":      # the levels never depend on the scale
    ref = run_reference(params, grads, num_workers, error_feedback=True)
    assert_params_match(out, ref, num_workers)
    error = out["psum"][1][0].error
    for i in range(num_workers):
      np.testing.assert_allclose(error["big"][i], ref.error[i]["big"],
                                 rtol=1e-5, atol=1e-7)
  p_a, p_b = out["psum"][0], out["alltoall"][0]
  for k in SHAPES:
    np.testing.assert_array_equal(p_a[k], p_b[k])
    assert np.all(p_a[k] == p_a[k][:1])
  assert isinstance(out["psum"][1][0], dl.ErrorFeedbackState)


def test_error_feedback_changes_the_vote():
  """A worker whose small votes keep losing carries them until they win."""
  rng = np.random.default_rng(6)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, 3, steps=4)
  plain = run_reference(params, grads, 3)
  fed = run_reference(params, grads, 3, error_feedback=True)
  assert any(not np.array_equal(plain.params[k], fed.params[k])
             for k in SHAPES)


def test_one_worker_ignores_lion_cub_options():
  """No vote with one worker: exact Lion, nothing quantized or synced."""
  rng = np.random.default_rng(7)
  params = random_tree(rng, SHAPES)
  grads = make_grads(rng, 1, steps=3)
  txs = {"cub": dl.distributed_lion(LR, axis_name=AXIS, quantizer="pbit_l1",
                                    bits=4, momentum_sync=1,
                                    min_compress_size=100,
                                    error_feedback=True),
         "plain": dl.distributed_lion(LR, axis_name=AXIS)}
  out = run_on_mesh(txs, params, grads, 1, check_vma=False)
  for k in SHAPES:
    np.testing.assert_array_equal(out["cub"][0][k], out["plain"][0][k])


@pytest.mark.parametrize("kwargs,names", [
    (dict(quantizer="int4"), ("quantizer='int4'", "'sign'", "'pbit_l1'")),
    (dict(quantizer="pbit_l1"), ("bits=None", "2..8")),
    (dict(quantizer="pbit_l1", bits=9), ("bits=9", "2..8")),
    (dict(quantizer="sign", bits=4),
     ("bits=4", "quantizer='sign'", "quantizer='pbit_l1'")),
    (dict(quantizer="pbit_l1", bits=4, vote="ternary"),
     ("vote='ternary'", "quantizer='pbit_l1'", "quantizer='sign'")),
    (dict(momentum_sync=0),
     ("momentum_sync=0", "positive int", "every_k_steps", "growing_intervals")),
    (dict(momentum_sync="often"), ("momentum_sync='often'", "None")),
    (dict(min_compress_size=-1), ("min_compress_size=-1", ">= 0")),
])
def test_bad_lion_cub_options_name_the_argument(kwargs, names):
  """The error names the argument, its value and what to pass instead."""
  with pytest.raises(ValueError) as e:
    dl.distributed_lion(LR, axis_name=AXIS, **kwargs)
  assert_names(e, *names)


def _update_under_vmap(tx, params):
  def step(g):
    return tx.update(g, tx.init(params), params)[0]
  grads = jax.tree.map(lambda x: jnp.stack([x, -x]), params)
  return jax.vmap(step, axis_name=AXIS)(grads)


@pytest.mark.parametrize("mask,error,names", [
    ({"a": True}, ValueError, ("momentum_sync_mask", "structure")),
    ({"a": True, "b": jnp.bool_(True)}, TypeError,
     ("momentum_sync_mask", "Python bools")),
])
def test_bad_sync_mask(mask, error, names):
  """A mask of the wrong structure or of traced bools is named."""
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  tx = dl.distributed_lion(LR, axis_name=AXIS, momentum_sync=1,
                           momentum_sync_mask=mask)
  with pytest.raises(error) as e:
    _update_under_vmap(tx, params)
  assert_names(e, *names)


def test_error_feedback_state_is_checked():
  params = {"a": jnp.ones(3)}
  plain = dl.distributed_lion(LR, axis_name=AXIS)
  fed = dl.distributed_lion(LR, axis_name=AXIS, error_feedback=True)
  with pytest.raises(TypeError) as e:
    fed.update(params, plain.init(params), params)
  assert_names(e, "ErrorFeedbackState", "DistributedLionState",
               "tx.init(params)")


def check_message_bytes(num_workers, quantizer, bits, aggregation):
  """What the compiled step sends, comm by comm, is what
  message.message_bytes says."""
  mesh = dl.devices.data_mesh(num_workers)
  params = {"w": jnp.zeros(1001), "b": jnp.zeros(13)}
  spec = quantize.vote_spec(quantizer, bits=bits)
  for comm in COMMS:
    tx = dl.scale_by_distributed_lion(axis_name="data", comm=comm,
                                      aggregation=aggregation,
                                      quantizer=quantizer, bits=bits)
    state = dl.parallel.init_worker_states(tx, params, mesh)
    step = dl.parallel.make_train_step(
        lambda p, x: jnp.sum(x @ p["w"]) + p["b"].sum(), tx, mesh)
    hlo = step.lower(params, state,
                     jnp.ones((num_workers, 1001))).compile().as_text()
    loss_bytes = 2 * (num_workers - 1) / num_workers * 4   # the loss pmean
    expected = message.message_bytes(
        [13, 1001], num_workers, aggregation=aggregation, spec=spec,
        comm=comm)
    assert dl.collective_bytes(hlo) - loss_bytes == pytest.approx(expected)


BYTES_CONFIGS = [(q, b, a) for (q, b), a in itertools.product(
    QUANTIZERS + [("pbit_l1", 8)], ("mavo", "avg"))]


# Each quantizer x aggregation once, each quantizer with two worker counts.
BYTES_COVERING = [(n, *config) for n, config in zip(
    itertools.cycle((2, 5, 8)), BYTES_CONFIGS)]


@pytest.mark.parametrize("num_workers,quantizer,bits,aggregation",
                         BYTES_COVERING)
def test_quantized_message_bytes_match_hlo(num_workers, quantizer, bits,
                                           aggregation):
  """What the compiled step sends is what message.message_bytes says,
  for every quantizer x aggregation x comm."""
  check_message_bytes(num_workers, quantizer, bits, aggregation)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, 5, 8])
@pytest.mark.parametrize("quantizer,bits,aggregation", BYTES_CONFIGS)
def test_quantized_message_bytes_match_hlo_everywhere(num_workers, quantizer,
                                                      bits, aggregation):
  """test_quantized_message_bytes_match_hlo on every worker count."""
  check_message_bytes(num_workers, quantizer, bits, aggregation)


def test_shape_options_under_inject_hyperparams_need_static_args():
  params = {"a": jnp.ones(5)}
  def run(tx):
    def step(g):
      return tx.update(g, tx.init(params), params)[0]["a"]
    grads = {"a": jnp.stack([jnp.arange(5.0) - 2, 2 - jnp.arange(5.0),
                             jnp.arange(5.0) - 1])}
    return jax.jit(jax.vmap(step, axis_name=AXIS))(grads)
  make = optax.inject_hyperparams(dl.distributed_lion)
  with pytest.raises(TypeError) as e:
    run(make(learning_rate=0.1, axis_name=AXIS, quantizer="pbit_l1", bits=4))
  assert_names(e, "bits", "static_args=('bits',)")
  static = optax.inject_hyperparams(dl.distributed_lion,
                                    static_args=("bits",))
  plain = dl.distributed_lion(0.1, axis_name=AXIS, quantizer="pbit_l1", bits=4)
  np.testing.assert_array_equal(
      run(static(learning_rate=0.1, axis_name=AXIS, quantizer="pbit_l1",
                 bits=4)), run(plain))


def test_sync_mask_function_under_inject_hyperparams_says_static_args():
  """inject_hyperparams takes a callable for a schedule and calls it with
  the step count; the error says to list the mask in static_args, and with
  it listed the mask works."""
  params = {"embed": jnp.ones(3), "w": jnp.ones(4)}
  grads = jax.tree.map(lambda x: jnp.stack([x, -x]), params)

  def run(static_args):
    tx = optax.inject_hyperparams(dl.distributed_lion,
                                  static_args=static_args)(
        learning_rate=0.1, axis_name="d", momentum_sync=1,
        momentum_sync_mask=dl.sync.leaves_matching("embed"))
    return jax.vmap(lambda g: tx.update(g, tx.init(params), params)[1],
                    axis_name="d")(grads)
  with pytest.raises(ValueError) as e:
    run(())
  assert_names(e, "momentum_sync_mask", "optax.inject_hyperparams",
               "static_args=('momentum_sync_mask',)")
  mu = run(("momentum_sync_mask",)).inner_state[0].mu
  np.testing.assert_array_equal(mu["embed"], 0.0)         # synced: +g - g
  assert (np.asarray(mu["w"][0]) > 0).all()               # not synced


def test_float64_leaves_are_scaled_and_summed_in_float64():
  """Was: exact small leaves were summed in float32 (0.1 + 1e-12 against
  -0.1 gave D = 0; 3e38-sized values gave NaN) and the L1 scale was taken in
  float32 (a finite 1e300 made the worker abstain on the whole leaf)."""
  with jax.enable_x64(True):
    exact = jnp.array([[0.1 + 1e-12, 1e300, 3e38, 2.0],
                       [-0.1, -1e300, 3e38, 1.0]], jnp.float64)
    tx = dl.scale_by_distributed_lion(axis_name="w", b1=0.0,
                                      min_compress_size=10)
    d = jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="w")(exact)
    np.testing.assert_array_equal(d[0], [1.0, 0.0, 1.0, 1.0])
    assert d.dtype == jnp.float64
    big = jnp.array([[1e300, 1.0, -1.0, 2.0]] * 3, jnp.float64)
    for quantizer, bits in (("ternary_l1", None), ("pbit_l1", 4)):
      tx = dl.scale_by_distributed_lion(axis_name="w", b1=0.0, bits=bits,
                                        quantizer=quantizer,
                                        aggregation="avg")
      d = jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="w")(big)
      # mean |c| = 2.5e299: 1e300 saturates, the small entries round to 0.
      np.testing.assert_array_equal(d[0], [1.0, 0.0, 0.0, 0.0])


BF16_LEAVES = {"w": (41, 24), "big": (130, 70), "b": (5,)}
BF16_VOTES = {
    "ternary_l1": dict(quantizer="ternary_l1"),
    "pbit_l1": dict(quantizer="pbit_l1", bits=4),
    "sign ef": dict(error_feedback=True),
    "pbit_l1 avg ef": dict(quantizer="pbit_l1", bits=3, aggregation="avg",
                           error_feedback=True),
    # Mixed precision: bf16 params, float32 momenta (was: the plain step
    # on Explicit axes a vote and every momentum apart, (1 - b2) g rounded
    # in bf16 there only).
    "sign f32 momenta": dict(mu_dtype=np.float32),
    "pbit_l1 ef f32 momenta": dict(quantizer="pbit_l1", bits=3,
                                   error_feedback=True, mu_dtype=np.float32),
}


def _bf16_run(tx, params, grads, mesh, door):
  """``tx`` stepped in one of the three step programs a user builds: the
  plain jitted step (dl.workers) on the mesh's axes, or the shard_map step
  (dl.parallel.per_worker)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  with jax.set_mesh(mesh):
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = dl.parallel.init_worker_states(tx, p, mesh)
    if door == "plain":
      step = jax.jit(lambda g, s, p: dl.workers.update(tx)(g, s, p))
    else:
      step = jax.jit(dl.parallel.per_worker(
          lambda g, s, p: tx.update(g, s, p), mesh,
          ins=("stacked", "stacked", "replicated"),
          outs=("replicated", "stacked")))
    for g in grads:
      u, s = step(jax.device_put(g, NamedSharding(mesh, P(AXIS))), s, p)
      p = optax.apply_updates(p, u)
    return jax.device_get(p), jax.device_get(s)


@pytest.mark.parametrize("name", sorted(BF16_VOTES))
def test_bf16_value_dependent_votes_agree_in_every_step_program(name):
  """bf16 params and momenta, 3 workers, 8 steps of random gradients: the
  L1-scaled levels and the residual of error feedback take ``c`` rounded
  once in float32, so the plain step on Explicit and on Auto axes and the
  shard_map step agree bit for bit (params, momenta, residuals; they
  differed by flipped votes when ``c`` was computed in bf16), and with the
  numpy reference on params and momenta, float32 momenta beside bf16
  params included. The residual ``p - a D`` takes the leaf's L1 scale
  ``a``, a float32 sum whose order XLA picks (numpy's is a float64 sum): a
  residual entry may be an ulp of its dtype from numpy's."""
  from jax.sharding import AxisType
  n, options = 3, BF16_VOTES[name]
  rng = np.random.default_rng(55)
  params = random_tree(rng, BF16_LEAVES, ml_dtypes.bfloat16)
  grads = [random_tree(rng, BF16_LEAVES, ml_dtypes.bfloat16, n)
           for _ in range(8)]
  tx = dl.distributed_lion(LR, weight_decay=WD, axis_name=AXIS, **options)
  ref = run_reference(params, grads, n, **options)
  runs = {
      f"{door} {kind.name}": _bf16_run(
          tx, params, grads, jax.make_mesh((n,), (AXIS,), axis_types=(kind,)),
          door)
      for door, kind in (("plain", AxisType.Explicit),
                         ("plain", AxisType.Auto),
                         ("shard_map", AxisType.Explicit))}
  first = runs["plain Explicit"]
  for program, (p, s) in runs.items():
    assert_same_tree(p, first[0], program)
    assert_same_tree(s, first[1], program)
    state = s[0]
    for k in BF16_LEAVES:
      np.testing.assert_array_equal(p[k], ref.params[k],
                                    err_msg=f"{program} params[{k}]")
      for i in range(n):
        np.testing.assert_array_equal(state.mu[k][i], ref.mu[i][k],
                                      err_msg=f"{program} mu[{k}] {i}")
        if options.get("error_feedback"):
          # Ulps of the residual's dtype, from the scale's rounding carried
          # on step to step (bf16: rarely seen after the residual's own
          # rounding; float32: in most entries, a few ulps of the leaf's
          # largest).
          dtype = state.error[k].dtype
          got = np.asarray(state.error[k][i], np.float32)
          want = np.asarray(ref.error[i][k], np.float32)
          ulp = np.abs(want).max() * 2.0**-jnp.finfo(dtype).nmant
          assert np.all(np.abs(got - want) <= 4 * ulp), program
          if dtype == ml_dtypes.bfloat16:
            assert np.sum(got != want) <= max(1, got.size // 1000), program


def assert_same_tree(a, b, name):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=name)
