"""Local steps' voted and Nesterov outer steps with ``abstain_nonfinite``,
and the voted mean's clipped scales (``scale_clip``).

A worker whose round ended non-finite (its pseudo-gradient not all
finite) is left out of the outer step: the anchor is the run of the other
workers alone on their own batches, bit for bit (XLA:CPU's all-reduces
sum in the workers' order, so the abstainers' zeros add nothing), in both
doors and on nodes; its residual stays as it was; a round every worker
abstains from moves nothing. Against numpy (``test_voted_outer``'s
``VotedMean``, which leaves the abstainers out) where some rounds have
abstainers and one has all. A worker whose scale is huge counts as
``scale_clip`` times the workers' median; honest workers' runs are the
plain mean's bit for bit. The bytes of the compiled step are the
accounting docs/using.md states.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import dlion_jax as dl
from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import rounds
from dlion_jax import transforms
from messages import assert_names
from test_abstain import batch_of
from test_abstain import others_of
from test_doors import DOORS
from test_doors import mesh_of
from test_doors import run
from test_rounds import EVERY
from test_rounds import INNER_LR
from test_rounds import SHAPES
from test_rounds import numpy_rounds
from test_rounds import run_step
from test_voted_outer import OUTER_LR
from test_voted_outer import STEPS
from test_voted_outer import VotedMean
from test_voted_outer import assert_close
from test_voted_outer import outer_of
from test_voted_outer import problem_apart
from tiers import slow_but


def some_slow(combos, fast):
  """pytest params of ``combos`` (tuples of names), those not in ``fast``
  in the slow tier."""
  return slow_but([pytest.param(*c, id="-".join(map(str, c)))
                   for c in combos], *map(combos.index, fast))


def voted(**options):
  return lambda **kw: rounds.voted_outer(0.5, axis_name="data", **options,
                                         **kw)


def nesterov(**kw):
  return rounds.nesterov_outer(0.5, axis_name="data", **kw)


def params_of(dtype=np.float32):
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(5, 3)).astype(dtype),
          "b": np.zeros(3, dtype)}


def runs_apart(door, outer, n, bad, *, dtype=np.float32, late=False,
               mesh=mesh_of, steps=6):
  """Local steps of Lion, 2 a round, with ``outer``: ``n`` workers, those
  of ``bad`` NaN on every step (abstaining), and the others alone; each
  run's params and state."""
  params = params_of(dtype)
  batch = {k: v.astype(dtype) for k, v in batch_of(n, 4, bad).items()}
  tx = lambda **kw: dl.local_steps(optax.lion(1e-2), outer(**kw), every=2,
                                   late=late)
  together = run(door, tx(abstain_nonfinite=True), mesh(n), params, batch,
                 steps=steps, params_per_worker=True, with_state=True)
  alone = run(door, tx(), mesh(n - len(bad)), params,
              others_of(batch, n, bad), steps=steps, params_per_worker=True,
              with_state=True)
  return together, alone


def assert_equal(a, b, what=""):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def anchor_of(state):
  """The anchor, checked the same on every worker."""
  rows = rounds.anchor(state)
  for x in jax.tree.leaves(rows):
    assert (np.asarray(x) == np.asarray(x)[0]).all()
  return jax.tree.map(lambda x: np.asarray(x)[0], rows)


def counted(first):
  """The abstainers' counts in the state of an outer step's mean: it, or
  the second of the voted mean's pair."""
  if isinstance(first, transforms.AbstainingMeanState):
    return first
  return first[1]


def counts_of(state, late=False):
  """The abstainers' counts of local steps' outer step."""
  outer = state.outer_state.outer_state if late else state.outer_state
  return counted(outer[0])


def residuals_of(state, late=False):
  """The voted mean's VotedMeanState (beside the counts or alone), or
  None (DiLoCo's mean, the voted mean without error feedback)."""
  outer = state.outer_state.outer_state if late else state.outer_state
  first = outer[0]
  if isinstance(first, (rounds.VotedMeanState,
                        transforms.AbstainingMeanState, optax.EmptyState)):
    return first if isinstance(first, rounds.VotedMeanState) else None
  return first[0] if isinstance(first[0], rounds.VotedMeanState) else None


CASES = {
    "mavo-8": (voted(), 8, (3,)),
    "avg-5": (voted(aggregation="avg"), 5, (1,)),
    "levers-5-of-2": (voted(fragments=2, scale_chunk=4, error_decay=0.5),
                      5, (0, 3)),
    "sparse-8": (voted(sparse_chunk=4), 8, (3,)),
    "sparseloco-5": (voted(sparse_chunk=4, sparse_keep=2,
                           sparse_value_bits=2, scale_chunk=8,
                           error_decay=0.75), 5, (1,)),
    "fit-8": (voted(fit_scale=True), 8, (3,)),
    "nesterov-8": (nesterov, 8, (3,)),
    "nesterov-5-of-2": (nesterov, 5, (0, 3)),
}


@pytest.mark.parametrize("door,case", some_slow(
    [(d, c) for c in CASES for d in DOORS],
    [("shard_map", "mavo-8"), ("plain", "mavo-8"),
     ("shard_map", "nesterov-5-of-2"), ("plain", "nesterov-8")]))
def test_an_abstainer_leaves_the_others_run(door, case):
  """The issue's case (8 workers, worker 3 NaN on every step): every
  worker's params, at the anchor after the third round, and the anchor
  itself equal a run of the other workers on their own batches, bit for
  bit (was: all 64 of 64 anchor coordinates differed). The voted mean's
  present workers' residuals are the others' run's; the abstainer's stays
  as it was (0); the count is in the state."""
  outer, n, bad = CASES[case]
  (p, state), (p_alone, alone) = runs_apart(door, outer, n, bad)
  assert_equal(p, p_alone, "params")
  assert_equal(anchor_of(state), anchor_of(alone), "anchor")
  assert np.isfinite(p["w"]).all()
  counts = counts_of(state)
  np.testing.assert_array_equal(counts.abstained, len(bad))
  np.testing.assert_array_equal(counts.abstentions, 3 * len(bad))
  if residuals_of(state) is not None:
    for k in p:
      error = np.asarray(residuals_of(state).error[k])
      np.testing.assert_array_equal(np.delete(error, bad, axis=0),
                                    residuals_of(alone).error[k], err_msg=k)
      np.testing.assert_array_equal(error[list(bad)], 0.0, err_msg=k)


LATE = {"nesterov": voted(momentum=0.9), "lion": voted(lion=(0.95, 0.98)),
        "sparse": voted(sparse_chunk=4), "diloco": nesterov}


@pytest.mark.parametrize("door,outer", some_slow(
    [(d, o) for o in LATE for d in DOORS],
    [("shard_map", "sparse"), ("plain", "diloco")]))
def test_one_round_late_and_bf16_leave_the_others_run(door, outer):
  """The outer step one round late, bf16 params, the voted mean's Nesterov
  and Lion steps, DiLoCo's: 8 workers, worker 5 NaN, against the other
  7."""
  (p, state), (p_alone, alone) = runs_apart(
      door, LATE[outer], 8, (5,), dtype=ml_dtypes.bfloat16, late=True)
  assert_equal(p, p_alone, "params")
  assert_equal(anchor_of(state), anchor_of(alone), "anchor")
  assert bool(state.outer_state.ready.all())
  assert p["w"].dtype == ml_dtypes.bfloat16


NODES = {"dense": voted(), "sparse": voted(sparse_chunk=4),
         "nesterov": nesterov}


@pytest.mark.parametrize("door,outer", some_slow(
    [(d, o) for o in NODES for d in DOORS],
    [("shard_map", "dense"), ("plain", "sparse"), ("plain", "nesterov")]))
def test_a_node_with_nan_leaves_the_other_nodes_run(door, outer):
  """Nodes of 2 devices (a hybrid mesh in the shard_map door, Explicit
  (data, fsdp) axes in the plain one), each device voting on its block:
  node 1's NaN rows make the whole node abstain, and the 3 others' run
  is the run of those nodes alone."""
  def nodes(count):
    if door == "shard_map":
      return devices.hybrid_mesh(count, devices=jax.devices()[:2 * count])
    return jax.make_mesh((count, 2), ("data", "fsdp"),
                         axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:2 * count])
  (p, state), (p_alone, alone) = runs_apart(door, NODES[outer], 4, (1,),
                                            mesh=nodes, steps=4)
  assert_equal(p, p_alone, "params")
  assert_equal(anchor_of(state), anchor_of(alone), "anchor")
  np.testing.assert_array_equal(counts_of(state).abstentions, 2)


FINITE = {"dense": voted(), "sparse": voted(sparse_chunk=4),
          "fragments": voted(fragments=3, scale_chunk=2, momentum=0.9),
          "nesterov": nesterov}


@pytest.mark.parametrize("door,outer", some_slow(
    [(d, o) for o in FINITE for d in DOORS],
    [("plain", "dense"), ("shard_map", "sparse"), ("plain", "fragments"),
     ("shard_map", "nesterov")]))
def test_with_every_round_finite_nothing_changes(door, outer):
  """No worker abstains: params, anchor and every residual are those of
  the step without abstention, bit for bit (the test of the
  pseudo-gradient changes no rounding)."""
  params, batch = params_of(), batch_of(5, 4)
  outer = FINITE[outer]
  runs = [run(door, dl.local_steps(optax.lion(1e-2), outer(**kw), every=2),
              mesh_of(5), params, batch, steps=6, params_per_worker=True,
              with_state=True) for kw in ({}, {"abstain_nonfinite": True})]
  (p, state), (p_on, state_on) = runs
  assert_equal(p, p_on)
  assert_equal(anchor_of(state), anchor_of(state_on))
  off, on = residuals_of(state), residuals_of(state_on)
  if off is not None:
    assert_equal(off, on)
  np.testing.assert_array_equal(counts_of(state_on).abstentions, 0)


NUMPY = {
    "mavo-3": (3, {}, "sgd"),
    "avg-4": (4, {"aggregation": "avg"}, "nesterov"),
    "levers-5": (5, {"fragments": 2, "scale_chunk": 4, "error_decay": 0.5},
                 "sgd"),
    "pbit3-lion-3": (3, {"quantizer": "pbit_l1", "bits": 3}, "lion"),
    "2bit-3": (3, {"sparse": (8, 2), "value_bits": 2}, "sgd"),
    "sparse-chunks-4": (4, {"sparse": (4, 1), "scale_chunk": 8},
                        "nesterov"),
    "no-ef-3": (3, {"error_feedback": False}, "sgd"),
    "fit-chunks-5": (5, {"fit_scale": True, "scale_chunk": 4}, "sgd"),
    "fp32-fragments-4": (4, {"fp32_mean": True, "fragments": 2}, "sgd"),
}


def voted_options(options):
  """The reference's options as voted_outer's keywords."""
  kw = {k: v for k, v in options.items() if k not in ("sparse",
                                                      "value_bits")}
  if "sparse" in options:
    kw.update(sparse_chunk=options["sparse"][0],
              sparse_keep=options["sparse"][1],
              sparse_value_bits=options.get("value_bits", 1))
  return kw


@pytest.mark.parametrize("case,late", some_slow(
    [(c, late) for late in (False, True) for c in NUMPY],
    [(c, False) for c in NUMPY] + [("mavo-3", True), ("2bit-3", True)]))
def test_abstainers_match_numpy(case, late):
  """Round 1: worker 1 NaN at one step; round 2: workers 0 and N - 1;
  round 3: every worker (nothing moves: the anchor, the outer momentum,
  the fragments' turn). numpy's rounds of the voted mean that leaves the
  abstainers out, their residuals kept; the counts in the state."""
  n, options, step = NUMPY[case]
  params, grads = problem_apart(n, STEPS)
  nan_at = {(0, 1), *((EVERY, i) for i in (0, n - 1)),
            *((2 * EVERY + 1, i) for i in range(n))}
  for t, g in enumerate(grads):
    for i in range(n):
      if (t, i) in nan_at:
        g["b"][i, 2] = np.nan
  reference = VotedMean(n, **options)
  want = numpy_rounds(params, grads, n, outer_of(reference, step),
                      late=late)
  kw = voted_options(options)
  tx = dl.local_steps(optax.sgd(INNER_LR), rounds.voted_outer(
      OUTER_LR, axis_name="data", momentum=0.9 if step == "nesterov" else 0.0,
      lion=(0.95, 0.98) if step == "lion" else None,
      abstain_nonfinite=True, **kw), every=EVERY, late=late)
  got, state = run_step(tx, params, grads, n)
  assert_close(got, want, f"n={n}")
  np.testing.assert_array_equal(counts_of(state, late).abstentions,
                                3 + n if not late else 3)
  if options.get("error_feedback", True):
    residuals = residuals_of(state, late)
    np.testing.assert_array_equal(residuals.count, 2)
    for i in range(n):
      for k in SHAPES:
        np.testing.assert_allclose(residuals.error[k][i],
                                   reference.errors[i][k], rtol=1e-5,
                                   atol=1e-6, err_msg=f"worker {i} {k}")


@pytest.mark.parametrize("outer", [
    pytest.param(rounds.voted_outer(0.5, axis_name="data", momentum=0.9,
                                    abstain_nonfinite=True),
                 id="nesterov", marks=pytest.mark.slow),
    pytest.param(rounds.voted_outer(
        optax.linear_schedule(0.5, 0.1, 4), axis_name="data",
        lion=(0.9, 0.99), fragments=2, abstain_nonfinite=True),
                 id="lion-schedule-fragments"),
    pytest.param(rounds.voted_outer(
        0.5, axis_name="data", sparse_chunk=4, error_feedback=False,
        momentum=0.9, abstain_nonfinite=True), id="sparse-no-ef",
                 marks=pytest.mark.slow),
    pytest.param(rounds.nesterov_outer(optax.linear_schedule(0.5, 0.1, 4),
                                       abstain_nonfinite=True),
                 id="diloco-schedule")])
def test_a_round_every_worker_abstains_from_moves_nothing(outer):
  """After a round that moved the momenta and residuals, a round where
  every worker's pseudo-gradient holds a NaN: the update is 0 and the
  state is as it was (outer momentum, residuals, fragments' turn,
  schedule's count), but for the abstainers' count."""
  params = {"w": jnp.zeros((2, 5)), "b": jnp.zeros(3)}
  rng = np.random.default_rng(0)
  good = jax.tree.map(lambda p: jnp.asarray(rng.normal(
      size=(3,) + p.shape), jnp.float32), params)
  bad = jax.tree.map(lambda d: d.at[:, 0].set(np.nan), good)

  def worker(good, bad):
    state = outer.init(params)
    _, state = outer.update(good, state, params)
    updates, after = outer.update(bad, state, params)
    return updates, state, after
  updates, before, after = jax.vmap(worker, axis_name="data")(good, bad)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(u, 0.0)
  counts = counted(after[0])
  np.testing.assert_array_equal(counts.abstained, 3)
  np.testing.assert_array_equal(counts.abstentions, 3)
  counts_out = lambda tree: jax.tree.map(
      lambda x: None if isinstance(x, transforms.AbstainingMeanState)
      else x, tree,
      is_leaf=lambda x: isinstance(x, transforms.AbstainingMeanState))
  assert_equal(counts_out(after), counts_out(before))
  assert any(np.any(x != 0) for x in jax.tree.leaves(before[1:]))


def test_a_pseudo_gradient_every_worker_abstains_from_is_the_skip():
  """``transforms.pmean_gradients(abstain_nonfinite=True)``: the present
  workers' mean, 0 where none is, the count in the state."""
  tx = transforms.pmean_gradients("data", abstain_nonfinite=True)
  g = jnp.array([[1.0, 2.0], [3.0, np.nan], [5.0, 6.0]])
  mean, state = jax.vmap(lambda g: tx.update(g, tx.init(g)),
                         axis_name="data")(g)
  np.testing.assert_array_equal(mean, [[3.0, 4.0]] * 3)
  np.testing.assert_array_equal(state.abstained, 1)
  none, state = jax.vmap(lambda g: tx.update(g, tx.init(g)),
                         axis_name="data")(g * np.nan)
  np.testing.assert_array_equal(none, 0.0)
  np.testing.assert_array_equal(state.abstained, 3)


def test_a_resize_clears_or_maps_the_abstaining_residuals():
  """8 workers to 4: the residuals of the abstaining voted mean are
  cleared (error='clear') or mapped as the voted mean's are; the counts
  and the anchor kept."""
  from dlion_jax import elastic   # pylint: disable=import-outside-toplevel
  tx = dl.local_steps(optax.sgd(0.1), rounds.voted_outer(
      0.5, axis_name="data", abstain_nonfinite=True), every=2)
  params, grads = problem_apart(8, 5)
  grads[0]["w"][2, 0, 0] = np.nan
  _, state = run_step(tx, params, grads, 8)
  mesh = devices.data_mesh(4)
  target = devices.replicate(jax.tree.map(jnp.zeros_like, params), mesh)
  old = residuals_of(state)
  for error in ("clear", "map"):
    resized = elastic.resize_worker_states(tx, state, target, mesh,
                                           error=error)
    new = residuals_of(resized)
    want = (np.asarray(old.error["w"]).reshape(4, 2, *SHAPES["w"]).mean(1)
            if error == "map" else 0.0)
    np.testing.assert_allclose(np.asarray(new.error["w"]), np.broadcast_to(
        want, (4, *SHAPES["w"])), rtol=1e-6)
    np.testing.assert_array_equal(counts_of(resized).abstentions, 1)


# The clipped scales.


def scaled_problem(n, scale=1e6, worker=1):
  params, grads = problem_apart(n, STEPS)
  for g in grads:
    for k in g:
      g[k][worker] = g[k][worker] * np.float32(scale)
  return params, grads


HUGE = {"mavo-3": (3, {}), "chunks-4": (4, {"scale_chunk": 5}),
        "avg-5": (5, {"aggregation": "avg"}),
        "sparse-3": (3, {"sparse": (8, 2)}),
        "sparse-2bit-4": (4, {"sparse": (4, 1), "value_bits": 2,
                              "scale_chunk": 8})}


@pytest.mark.parametrize("case", some_slow(
    [(c,) for c in HUGE], [("chunks-4",), ("sparse-3",)]))
def test_a_huge_scale_is_clipped_at_twice_the_median(case):
  """Worker 1's gradients 1e6 times the others' (its pseudo-gradients and
  scales so): numpy's voted mean with each worker's scale at most twice
  the workers' median. The plain mean moves the anchor about 1e6 / N
  times as far."""
  n, options = HUGE[case]
  params, grads = scaled_problem(n)
  want = numpy_rounds(params, grads, n, outer_of(VotedMean(n, **options)))
  kw = voted_options(options)
  moved = {}
  for clip in (2.0, None):
    tx = dl.local_steps(optax.sgd(INNER_LR), rounds.voted_outer(
        OUTER_LR, axis_name="data", scale_clip=clip, **kw), every=EVERY)
    got, state = run_step(tx, params, grads, n)
    moved[clip] = np.abs(rounds.anchor(state)["w"][0] - params["w"]).max()
    if clip:
      assert_close(got, want, f"n={n}")
  assert moved[None] > 1e4 * moved[2.0], moved


HONEST = {"dense": {},
          "sparse": {"sparse_chunk": 4, "sparse_value_bits": 2,
                     "scale_chunk": 8},
          "levers": {"scale_chunk": 4, "fragments": 2}}


@pytest.mark.parametrize("door,options,n", some_slow(
    [(d, o, n) for n in (5, 8) for o in HONEST for d in DOORS],
    [("plain", "dense", 8), ("shard_map", "sparse", 5)]))
def test_honest_scales_are_the_plain_means_bit_for_bit(door, options, n):
  """Every worker honest (scales within twice the median): the clipped
  run is the plain mean's (scale_clip=None) bit for bit, params and
  state."""
  params, batch = params_of(), batch_of(n, 4)
  runs = [run(door, dl.local_steps(optax.lion(1e-2), rounds.voted_outer(
      0.5, axis_name="data", scale_clip=clip, **HONEST[options]), every=2),
              mesh_of(n), params, batch, steps=6, params_per_worker=True,
              with_state=True) for clip in (2.0, None)]
  assert_equal(runs[0], runs[1])


@pytest.mark.parametrize("value,named", [
    (0.5, "scale_clip=0.5"), (True, "scale_clip=True"),
    ("2", "scale_clip='2'"), (float("inf"), "scale_clip=inf")])
def test_a_bad_scale_clip_is_named(value, named):
  with pytest.raises(ValueError) as e:
    rounds.voted_outer(0.5, scale_clip=value)
  assert_names(e, named, "1 or more", "None")


def test_a_bad_abstain_flag_is_named():
  for call in (lambda: rounds.voted_outer(0.5, abstain_nonfinite="yes"),
               lambda: rounds.nesterov_outer(0.5, abstain_nonfinite=1)):
    with pytest.raises(ValueError) as e:
      call()
    assert_names(e, "abstain_nonfinite=", "True or False")


# The bytes.


def sent(n, outer, rows=300, cols=70):
  """The bytes the compiled local-steps step sends (dl.collective_bytes:
  the outer step's branch, the largest) for leaves of ``rows x cols`` and
  ``cols`` entries, less its loss pmean's."""
  mesh = devices.data_mesh(n)
  params = {"w": jnp.zeros((rows, cols)), "b": jnp.zeros(cols)}
  tx = dl.local_steps(optax.sgd(0.1), outer, every=2)
  p = devices.replicate(params, mesh)
  s = parallel.init_worker_states(tx, p, mesh)
  step = parallel.make_train_step(
      lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, mesh,
      donate=False, params_per_worker=True)
  compiled = step.lower(devices.stack_for_workers(p, mesh), s,
                        devices.shard_batch(jnp.ones((n, rows)), mesh)
                        ).compile()
  return dl.collective_bytes(compiled) - 2 * (n - 1) / n * 4


@pytest.mark.parametrize("n,comm,abstain,clip", some_slow(
    [(n, comm, abstain, clip) for n, comm in (
        (8, "auto"), (4, "alltoall"), (5, "psum"), (5, "allgather"))
     for abstain in (False, True) for clip in (2.0, None)],
    [(8, "auto", True, 2.0), (5, "psum", True, None),
     (4, "alltoall", False, 2.0), (5, "allgather", True, 2.0)]))
def test_the_dense_votes_bytes_are_the_stated_accounting(n, comm, abstain,
                                                         clip):
  """A round's outer step (docs/using.md): the vote's message,
  dl.wire_bits(N, leaf_sizes=...) x P / 8; a float32 scale a leaf,
  gathered (4 (N - 1) bytes) with scale_clip or all-reduced
  (8 (N - 1) / N) without; with abstain_nonfinite the count's int32
  all-reduce (8 (N - 1) / N)."""
  outer = rounds.voted_outer(0.5, axis_name="data", comm=comm,
                             scale_clip=clip, abstain_nonfinite=abstain)
  vote = dl.wire_bits(n, comm=comm, leaf_sizes=[70, 21000]) * 21070 / 8
  allreduce = 2 * (n - 1) / n * 4
  scales = 2 * ((n - 1) * 4 if clip else allreduce)
  assert sent(n, outer) == pytest.approx(
      vote + scales + (allreduce if abstain else 0))


@pytest.mark.parametrize("n", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_the_sparse_votes_and_nesterovs_bytes_are_the_stated_accounting(n):
  """The sparse vote: every worker's words (a uint8 a kept entry at a
  chunk of 128) and float32 scales gathered, (N - 1) times one worker's,
  dl.sparse_vote_bits(N) x P / 8 for leaves of whole chunks; the count's
  all-reduce. Nesterov's: the fp32 all-reduce of the pseudo-gradients and
  the count's, and the fp32 mean's (``fp32_mean``) of its fragment's."""
  size = 256 * 128 + 128
  allreduce = 2 * (n - 1) / n * 4
  sparse = rounds.voted_outer(0.5, axis_name="data", sparse_chunk=128,
                              abstain_nonfinite=True)
  words = dl.sparse_vote_bits(n) * size / 8
  assert sent(n, sparse, 256, 128) == pytest.approx(
      words + 2 * (n - 1) * 4 + allreduce)
  diloco = rounds.nesterov_outer(0.7, abstain_nonfinite=True)
  assert sent(n, diloco, 256, 128) == pytest.approx(
      size * allreduce + allreduce)
  # The fp32 mean in the vote's place: Nesterov's on a quarter of each
  # leaf (its entries padded to whole rows of 4), no scales.
  control = rounds.voted_outer(0.5, axis_name="data", fp32_mean=True,
                               fragments=4, abstain_nonfinite=True)
  assert sent(n, control, 255, 127) == pytest.approx(
      (-(-255 * 127 // 4) + -(-127 // 4)) * allreduce + allreduce)


def test_the_fp32_means_bytes_across_nodes_are_dilocos():
  """On a hybrid mesh with replicated params each device of a node
  averages only its own part of every leaf, as DiLoCo's mean does: the
  fp32 mean in the vote's place sends the same bytes across the nodes."""
  mesh = devices.hybrid_mesh(2)
  params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}

  def across_nodes(outer):
    tx = dl.local_steps(optax.sgd(0.1), outer, every=2)
    p = devices.replicate(params, mesh)
    step = parallel.make_train_step(
        lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, mesh,
        donate=False, params_per_worker=True)
    compiled = step.lower(devices.stack_for_workers(p, mesh),
                          parallel.init_worker_states(tx, p, mesh),
                          devices.shard_batch(jnp.ones((8, 256)), mesh)
                          ).compile()
    return dl.hlo.collective_bytes_by_axis(compiled, mesh)["data"]
  assert across_nodes(rounds.voted_outer(0.5, fp32_mean=True)) == (
      across_nodes(rounds.nesterov_outer(0.5, momentum=0.0)))
