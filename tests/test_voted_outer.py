"""The voted outer steps of local steps (dl.rounds.voted_outer) against
numpy, in the steps users build.

Each worker runs SGD alone for a round; at its end every worker's
pseudo-gradient plus its residual is voted on (dense: Distributed Lion's
codes with a scale a leaf; sparse: the largest entries of each chunk), the
workers' mean is decoded, and an outer step (none, Nesterov's or Lion's)
moves the anchor, with the residual of what each worker could not say
carried into its next vote. The numpy reference is written from that
description (tests/reference.py's votes); the outer step one round late
(``late=True``) is checked the same way. Every comm agrees bit for bit;
numpy agrees to float32 rounding (the workers' mean scale is an
all-reduce, whose order of summation is XLA's).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import dlion_jax as dl
from dlion_jax import _message as message
from dlion_jax import devices
from dlion_jax import elastic
from dlion_jax import parallel
from dlion_jax import rounds
from messages import assert_names
from reference import _l1_scale
from reference import aggregate
from reference import l1_vote
from reference import max_level
from reference import worker_vote
from test_doors import DOORS
from test_doors import mesh_of
from test_doors import problem as door_problem
from test_doors import run as run_door
from test_rounds import EVERY
from test_rounds import INNER_LR
from test_rounds import SHAPES
from test_rounds import mean_loss
from test_rounds import numpy_rounds
from test_rounds import problem
from test_rounds import run_step

OUTER_LR = 0.75
STEPS = 3 * EVERY + 1    # three rounds, and a step into the fourth


class VotedMean:
  """numpy's :func:`dl.rounds.scale_by_voted_mean`: each worker's residual
  and the mean every worker decodes. A worker whose pseudo-gradient is not
  all finite abstains (``abstain_nonfinite``): the mean is the others',
  its residual stays; none present, nothing moves (``abstained``)."""

  def __init__(self, n, *, aggregation="mavo", vote="binary",
               quantizer="sign", bits=None, sparse=None,
               error_feedback=True, parts=1, error_decay=1.0,
               scale_chunk=None, fragments=1, value_bits=1, scale_clip=2.0,
               fit_scale=False, fp32_mean=False):
    self.n, self.aggregation, self.vote = n, aggregation, vote
    self.parts = parts     # the sparse vote: a leaf's cut over a node
    self.quantizer, self.bits, self.sparse = quantizer, bits, sparse
    self.error_feedback, self.errors = error_feedback, None
    self.error_decay, self.scale_chunk = error_decay, scale_chunk
    self.fragments, self.value_bits, self.steps = fragments, value_bits, 0
    self.scale_clip, self.abstained = scale_clip, 0
    self.fit_scale, self.fp32_mean = fit_scale, fp32_mean

  def _clipped(self, scales):
    """The present workers' scales (one array each), each at most
    scale_clip times their median (elementwise)."""
    if self.scale_clip is None or not scales:
      return scales
    limit = np.float32(self.scale_clip) * np.median(np.abs(np.stack(scales)),
                                                    0)
    return [np.sign(s) * np.minimum(np.abs(s), limit.astype(np.float32))
            for s in scales]

  @staticmethod
  def _mean_of(rows, k):
    """The sum of ``rows`` in order, times float32 1 / k (0 for none)."""
    total = np.zeros_like(rows[0]) if rows else 0
    for r in rows:
      total = (total + r).astype(np.float32)
    return total * np.float32(1 / k) if k else total

  def _scales(self, p):
    """A worker's scales of flat ``p``, one an entry."""
    if self.scale_chunk is None:
      return np.full(p.size, _l1_scale(p), np.float32)
    c = self.scale_chunk
    return np.concatenate([np.full(len(p[i:i + c]), _l1_scale(p[i:i + c]),
                                   np.float32) for i in range(0, p.size, c)])

  def _fitted(self, p, v):
    """A worker's <p, v> / <v, v> of flat ``p`` (its leaf's or each of its
    chunks'), one an entry; 0 where ``v`` is."""
    c = self.scale_chunk or p.size
    out = []
    for i in range(0, p.size, c):
      x, y = p[i:i + c].astype(np.float64), v[i:i + c].astype(np.float64)
      norm = (y * y).sum()
      out.append(np.full(len(x), (x * y).sum() / norm if norm else 0,
                         np.float32))
    return np.concatenate(out)

  def _exact(self, ps, present):
    """No vote: the present workers' mean (the sum in order, over N
    where all are present as pmean divides), each said exactly."""
    live = [ps[i] for i, ok in enumerate(present) if ok]
    if len(live) < self.n:
      return self._mean_of(live, len(live)), ps
    total = np.zeros_like(ps[0])
    for p in ps:
      total = (total + p).astype(np.float32)
    return total / np.float32(self.n), ps

  def _dense(self, ps, present):
    if self.fp32_mean:
      return self._exact(ps, present)
    shape = ps[0].shape
    ps = [p.ravel() for p in ps]
    level = max_level(self.quantizer, self.bits)
    if self.quantizer == "sign":
      qs = [worker_vote(p, self.vote) for p in ps]
    else:
      qs = [l1_vote(p, level) for p in ps]
    scales = [self._scales(p) for p in ps]
    live = [i for i, ok in enumerate(present) if ok]
    votes = (aggregate([qs[i] for i in live], self.aggregation, np.float32,
                       level) if live else None)
    fits = ([self._fitted(p, votes) for p in ps] if self.fit_scale and live
            else scales)
    mean_scale = self._mean_of(
        self._clipped([fits[i] for i in live]), len(live))
    mean = (mean_scale * votes if live
            else np.zeros(ps[0].size, np.float32))
    said = [s * (q.astype(np.float32) / np.float32(level))
            for s, q in zip(scales, qs)]
    return mean.reshape(shape), [x.reshape(shape) for x in said]

  def _fragment(self, ps, present):
    """The dense vote on entries k, k + M, ... of each flat leaf (zero
    padded to whole rows of M), k the step's turn."""
    m, k = self.fragments, self.steps % self.fragments
    rows = [np.pad(p.ravel(), (0, -p.size % m)).reshape(-1, m) for p in ps]
    mean, said = self._dense([r[:, k] for r in rows], present)

    def spread(x, p):
      full = np.zeros_like(rows[0])
      full[:, k] = x
      return full.ravel()[:p.size].reshape(p.shape)
    return spread(mean, ps[0]), [spread(s, p) for s, p in zip(said, ps)]

  def _sparse_values(self, r, w, scales=None):
    """A part's ``[chunks, chunk]`` values ``r`` -> what its top entries
    ``w`` say, by the scales of its groups (or of ``self._leaf``), or
    decoded by ``scales`` (one row a group) instead; and its own scales,
    one row a group (its mean, or with 2-bit values its two sides')."""
    chunk, keep = self.sparse
    m = np.where(np.isfinite(r), np.abs(r), 0)
    top = np.take_along_axis(m, w, 1)
    group = (self.scale_chunk // chunk if self.scale_chunk
             else r.shape[0])
    out, own = np.zeros_like(r), []
    for g in range(0, r.shape[0], group):
      t = top[g:g + group]
      if self.scale_chunk is None:
        mean, above = self._leaf
      else:
        mean = np.float32(t.sum(dtype=np.float64) / t.size)
        above = self._sides(t, mean)
      own.append([mean] if self.value_bits == 1 else list(above))
      said = own[-1] if scales is None else scales[len(own) - 1]
      values = np.full(t.shape, said[0], np.float32)
      if self.value_bits == 2:
        high = t > mean
        values = np.where(high, said[1], said[0]).astype(np.float32)
      sign = np.take_along_axis(r[g:g + group], w[g:g + group], 1) > 0
      block = np.zeros_like(r[g:g + group])
      np.put_along_axis(block, w[g:g + group], np.where(sign, values,
                                                        -values), 1)
      out[g:g + group] = block
    return out, np.array(own, np.float32).reshape(-1, self.value_bits)

  @staticmethod
  def _sides(t, mean):
    """The mean of the entries of ``t`` at or below ``mean`` and above it
    (``mean`` where a side is empty)."""
    out = []
    for side in (t <= mean, t > mean):
      out.append(np.float32(t[side].sum(dtype=np.float64) / side.sum())
                 if side.any() else mean)
    return out

  def _sparse(self, ps, present):
    chunk, keep = self.sparse
    said, coded = [], []
    for p in ps:
      # Each device of a node its equal part of the flat leaf, in chunks.
      width = -(-p.size // self.parts)
      parts = np.pad(p.ravel(), (0, self.parts * width - p.size)).reshape(
          self.parts, width)
      rows = [np.pad(x, (0, -width % chunk)).reshape(-1, chunk)
              for x in parts]
      size = [np.where(np.isfinite(r), np.abs(r), 0) for r in rows]
      where = [np.argsort(-m, axis=1, kind="stable")[:, :keep] for m in size]
      tops = [np.take_along_axis(m, w, 1) for m, w in zip(size, where)]
      total = np.float32(sum(t.sum(dtype=np.float64) for t in tops))
      kept = sum(t.size for t in tops)
      s = (total * np.float32(1 / kept) if self.parts == 1
           else total / np.float32(kept))
      every = np.concatenate([t.ravel() for t in tops])
      self._leaf = s, self._sides(every, s)
      values = [self._sparse_values(r, w) for r, w in zip(rows, where)]
      q = [v.ravel()[:width] for v, _ in values]
      said.append(np.concatenate(q)[:p.size].reshape(p.shape))
      coded.append((rows, where, [own for _, own in values], self._leaf))
    live = [i for i, ok in enumerate(present) if ok]
    clipped = self._clipped([np.concatenate(coded[i][2]) for i in live])
    decoded = []
    for i, scales in zip(live, clipped):
      rows, where, own, self._leaf = coded[i]
      cut = np.cumsum([len(o) for o in own])[:-1]
      q = [self._sparse_values(r, w, part)[0].ravel()[:width] for r, w, part
           in zip(rows, where, np.split(scales, cut))]
      decoded.append(np.concatenate(q)[:ps[i].size].reshape(ps[i].shape))
    mean = self._mean_of(decoded, len(live))
    return (mean if live else np.zeros_like(ps[0])), said

  def mean(self, deltas):
    if self.errors is None:
      self.errors = [{k: np.zeros(v.shape, np.float32) for k, v in d.items()}
                     for d in deltas]
    out = {}
    vote = (self._sparse if self.sparse else
            self._fragment if self.fragments > 1 else self._dense)
    present = [all(np.isfinite(np.asarray(v, np.float32)).all()
                   for v in d.values()) for d in deltas]
    for k in deltas[0]:
      ps = [d[k].astype(np.float32) + (
          np.float32(self.error_decay) * e[k] if self.error_feedback
          else 0) for d, e in zip(deltas, self.errors)]
      if self.error_decay == 1:     # as the library: no product by 1
        ps = [d[k].astype(np.float32) + (e[k] if self.error_feedback else 0)
              for d, e in zip(deltas, self.errors)]
      ps = [p if ok else np.zeros_like(p) for p, ok in zip(ps, present)]
      out[k], said = vote(ps, present)
      for e, p, s, ok in zip(self.errors, ps, said, present):
        r = p - s
        if ok:        # an abstainer keeps its residual
          e[k] = np.where(np.isfinite(r), r, 0).astype(np.float32)
    self.abstained = self.n - sum(present)
    self.steps += self.abstained < self.n
    return out


def outer_of(mean: VotedMean, step="sgd", *, momentum=0.9, b1=0.95,
             b2=0.98):
  """anchor, deltas -> the new anchor: ``step`` on the voted mean."""
  state = {}

  def outer(anchor, deltas):
    u = mean.mean(deltas)
    if mean.abstained == mean.n:       # nothing moves, the momentum kept
      return anchor
    new = {}
    for k, a in anchor.items():
      m = state.get(k, np.zeros_like(u[k]))
      if step == "nesterov":
        state[k] = momentum * m + u[k]
        d = momentum * state[k] + u[k]
      elif step == "lion":
        d = np.sign((1 - b1) * u[k] + b1 * m)
        state[k] = b2 * m + (1 - b2) * u[k]
      else:
        d = u[k]
      # As optax rounds: the update in the leaf's dtype, then the sum.
      moved = (d.astype(a.dtype).astype(np.float32)
               * np.float32(-OUTER_LR)).astype(a.dtype)
      new[k] = (a.astype(np.float32) + moved.astype(np.float32)).astype(
          a.dtype)
    return new
  return outer


def assert_close(got, want, what):
  for t, (g, w) in enumerate(zip(got, want), start=1):
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(g[k], np.float32),
                                 np.asarray(w[k], np.float32), rtol=2e-6,
                                 atol=1e-6, err_msg=f"{what} step {t} {k}")


def problem_apart(n, steps, dtype=np.float32, seed=0):
  """test_rounds' problem, with each worker's gradient of one sign on
  each entry for the whole run: a pseudo-gradient is never within
  rounding of 0, where a binary vote would turn on the last bit of the
  workers' mean scale (an all-reduce, summed in XLA's order)."""
  params, grads = problem(n, steps, dtype, seed)
  rng = np.random.default_rng(seed + 1)
  signs = {k: rng.choice([-1, 1], (n,) + s) for k, s in SHAPES.items()}
  return params, [{k: (signs[k] * (np.abs(g[k]) + 1)).astype(dtype)
                   for k in g} for g in grads]


def check(n, vote_options, *, step="sgd", late=False, comms=("auto",),
          dtype=np.float32):
  params, grads = problem_apart(n, STEPS, dtype)
  options = {k: v for k, v in vote_options.items()
             if k not in ("sparse", "value_bits")}
  if "sparse" in vote_options:
    options.update(sparse_chunk=vote_options["sparse"][0],
                   sparse_keep=vote_options["sparse"][1],
                   sparse_value_bits=vote_options.get("value_bits", 1))
  want = numpy_rounds(params, grads, n, outer_of(
      VotedMean(n, **vote_options), step), late=late)
  runs = {}
  for comm in comms:
    outer = rounds.voted_outer(
        OUTER_LR, axis_name="data",
        momentum=0.9 if step == "nesterov" else 0.0,
        lion=(0.95, 0.98) if step == "lion" else None, comm=comm, **options)
    tx = dl.local_steps(optax.sgd(INNER_LR), outer, every=EVERY, late=late)
    runs[comm], state = run_step(tx, params, grads, n)
    assert_close(runs[comm], want, comm)
  for comm in comms[1:]:                 # the strategies agree bit for bit
    for a, b in zip(runs[comms[0]], runs[comm]):
      for k in SHAPES:
        np.testing.assert_array_equal(a[k], b[k], err_msg=comm)
  # The outer step moved the anchor, and every worker holds the same one.
  anchor = rounds.anchor(state)["w"]
  assert not np.array_equal(anchor[0], params["w"])
  assert (anchor == anchor[0]).all()
  return state


@pytest.mark.parametrize("n,options", [
    (3, {}),
    (8, {"aggregation": "avg"}),
    pytest.param(8, {"vote": "ternary"}, marks=pytest.mark.slow),
    (3, {"quantizer": "pbit_l1", "bits": 3, "aggregation": "avg"}),
    (3, {"quantizer": "ternary_l1"}),
], ids=["mavo-3", "avg-8", "ternary-8", "pbit3-avg-3", "ternary_l1-3"])
def test_dense_vote_matches_numpy(n, options):
  check(n, options)


@pytest.mark.parametrize("n,options", [
    (3, {"error_decay": 0.75}),
    (8, {"scale_chunk": 5}),
    (3, {"fragments": 3}),
    (8, {"fragments": 2, "scale_chunk": 4, "error_decay": 0.5,
         "aggregation": "avg"}),
    (3, {"fragments": 4, "quantizer": "ternary_l1"}),
    (3, {"fit_scale": True}),
    (8, {"fit_scale": True, "scale_chunk": 6, "scale_clip": None}),
    (5, {"fit_scale": True, "aggregation": "avg", "fragments": 2}),
    (3, {"fp32_mean": True, "fragments": 3, "error_decay": 0.5}),
    (8, {"fp32_mean": True, "fragments": 4}),
], ids=["decay-3", "chunk-scales-8", "fragments-3", "all-avg-8",
        "fragments-ternary_l1-3", "fit-3", "fit-chunks-8",
        "fit-avg-fragments-5", "fp32-fragments-3", "fp32-fragments-8"])
def test_dense_levers_match_numpy(n, options):
  """A decayed residual, a scale a chunk, the vote in fragments (each
  entry once every M outer steps, the others keeping theirs), the
  scale fitted to the workers' mean after the vote, and the fp32 mean in
  the vote's place."""
  check(n, options)


@pytest.mark.parametrize("n,options", [
    (3, {"sparse": (8, 2), "value_bits": 2}),
    (8, {"sparse": (4, 1), "scale_chunk": 8}),
    (3, {"sparse": (8, 1), "value_bits": 2, "scale_chunk": 16,
         "error_decay": 0.75}),
], ids=["2bit-3", "chunk-scales-8", "sparseloco-3"])
def test_sparse_levers_match_numpy(n, options):
  """SparseLoCo's values: 2-bit (sign and magnitude side), a scale a
  group of chunks, a decayed residual."""
  check(n, options)


@pytest.mark.parametrize("n,aggregation", [
    (3, "mavo"), pytest.param(8, "avg", marks=pytest.mark.slow)])
def test_every_comm_gives_the_same_steps(n, aggregation):
  check(n, {"aggregation": aggregation}, comms=message.COMMS)


@pytest.mark.parametrize("n,sparse", [(3, (8, 2)), (8, (16, 1))])
def test_sparse_vote_matches_numpy(n, sparse):
  check(n, {"sparse": sparse})


@pytest.mark.parametrize("step", ["nesterov", "lion"])
def test_outer_steps_on_the_voted_mean_match_numpy(step):
  check(3, {}, step=step)


def test_bf16_params_vote_their_float32_residuals():
  state = check(3, {}, dtype=ml_dtypes.bfloat16)
  error = state.outer_state[0].error["w"]
  assert error.dtype == np.float32 and np.abs(error).max() > 0


def test_fp32_mean_without_fragments_is_dilocos_plain_step():
  """With no fragments the fp32 mean leaves no residual, and the step is
  DiLoCo's outer step without momentum (to a rounding: XLA may fuse its
  multiply-add otherwise)."""
  params, grads = problem_apart(3, STEPS)
  state = check(3, {"fp32_mean": True})
  np.testing.assert_array_equal(state.outer_state[0].error["w"], 0)
  plain = dl.local_steps(optax.sgd(INNER_LR), rounds.nesterov_outer(
      OUTER_LR, momentum=0.0), every=EVERY)
  voted = dl.local_steps(optax.sgd(INNER_LR), rounds.voted_outer(
      OUTER_LR, fp32_mean=True), every=EVERY)
  assert_close(run_step(voted, params, grads, 3)[0],
               run_step(plain, params, grads, 3)[0], "fp32 mean")


@pytest.mark.parametrize("option", [
    {"aggregation": "avg"}, {"quantizer": "ternary_l1"}, {"vote": "ternary"},
    {"scale_chunk": 64}, {"sparse_chunk": 128}, {"fit_scale": True},
    {"scale_clip": None}, {"comm": "allgather"}])
def test_fp32_mean_refuses_the_votes_options(option):
  (name, value), = option.items()
  with pytest.raises(ValueError, match=(
      f"{name}={value!r} does not apply with fp32_mean=True.*leave {name} "
      "at")):
    rounds.scale_by_voted_mean(fp32_mean=True, **option)


def test_fp32_mean_must_be_a_bool():
  with pytest.raises(ValueError, match="fp32_mean=1"):
    rounds.scale_by_voted_mean(fp32_mean=1)


def test_without_error_feedback_nothing_is_kept():
  state = check(3, {"error_feedback": False})
  assert isinstance(state.outer_state[0], optax.EmptyState)


@pytest.mark.parametrize("options", [{}, {"sparse": (8, 1)}],
                         ids=["dense", "sparse"])
def test_one_round_late_matches_numpy(options):
  """The outer step of round r at the end of round r + 1; the first
  round moves nothing."""
  state = check(3, options, late=True)
  assert bool(state.outer_state.ready.all())


def test_one_round_late_nesterov_is_diloco_delayed():
  params, grads = problem_apart(3, STEPS)

  def nesterov(anchor, deltas, state={}):
    new = {}
    for k, a in anchor.items():
      g = np.mean([d[k] for d in deltas], 0)
      state[k] = 0.9 * state.get(k, 0) + g
      new[k] = (a - np.float32(OUTER_LR) * (0.9 * state[k] + g)).astype(
          a.dtype)
    return new
  want = numpy_rounds(params, grads, 3, nesterov, late=True)
  tx = dl.local_steps(optax.sgd(INNER_LR), rounds.nesterov_outer(
      OUTER_LR, momentum=0.9), every=EVERY, late=True)
  assert_close(run_step(tx, params, grads, 3)[0], want, "nesterov")
  # Without late, the first round already moves the anchor.
  early = numpy_rounds(params, grads, 3, nesterov)
  assert not np.array_equal(early[EVERY - 1]["w"], want[EVERY - 1]["w"])


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("options", [{}, {"sparse_chunk": 8}],
                         ids=["dense", "sparse"])
def test_both_doors_take_the_same_steps(door, options):
  tx = dl.local_steps(optax.sgd(0.05), rounds.voted_outer(
      0.5, axis_name="data", **options), every=2, late=True)
  got = run_door(door, tx, mesh_of(4), *door_problem(), steps=6,
                 params_per_worker=True)
  other = run_door("plain" if door == "shard_map" else "shard_map", tx,
                   mesh_of(4), *door_problem(), steps=6,
                   params_per_worker=True)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(other)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("options", [{}, {"sparse_chunk": 8}],
                         ids=["dense", "sparse"])
def test_both_doors_take_the_same_steps_on_nodes(options):
  """Two nodes of 4 devices: the shard_map door on the hybrid mesh (Auto
  axes) and the plain step on Explicit ones, each device voting on its
  block of every leaf."""
  from jax.sharding import AxisType
  tx = dl.local_steps(optax.sgd(0.05), rounds.voted_outer(
      0.5, axis_name="data", **options), every=2)
  auto = run_door("shard_map", tx, devices.hybrid_mesh(
      2, devices=jax.devices()[:8]), *door_problem(), steps=4,
                  params_per_worker=True)
  explicit = run_door("plain", tx, jax.make_mesh(
      (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2),
                      *door_problem(), steps=4, params_per_worker=True)
  for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(explicit)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("options", [
    {}, pytest.param({"sparse": (8, 2)}, marks=pytest.mark.slow)],
    ids=["dense", "sparse"])
def test_nodes_of_several_devices_vote_their_mean_across_nodes(options):
  """A hybrid mesh: each node of 4 devices trains on their mean gradient
  and the voted outer step crosses the nodes, each device voting on its
  quarter of every leaf (the sparse vote in chunks of its quarter):
  numpy's rounds of the nodes' mean gradients."""
  nodes, per_node = 2, 4
  rng = np.random.default_rng(3)
  params, _ = problem(nodes, 0)
  rows = [{k: rng.integers(-4, 5, (nodes * per_node,) + s).astype(
      np.float32) for k, s in SHAPES.items()} for _ in range(STEPS)]
  node_means = [{k: r[k].reshape((nodes, per_node) + SHAPES[k]).mean(1)
                 for k in r} for r in rows]
  want = numpy_rounds(params, node_means, nodes,
                      outer_of(VotedMean(nodes, parts=per_node, **options)))
  mesh = devices.hybrid_mesh(nodes, devices=jax.devices()[:nodes * per_node])
  sparse = options.get("sparse")
  tx = dl.local_steps(optax.sgd(INNER_LR), rounds.voted_outer(
      OUTER_LR, axis_name="data",
      **({"sparse_chunk": sparse[0], "sparse_keep": sparse[1]}
         if sparse else {})), every=EVERY)
  state = parallel.init_worker_states(tx, devices.replicate(params, mesh),
                                      mesh)
  ps = devices.stack_for_workers(params, mesh)
  step = parallel.make_train_step(mean_loss, tx, mesh, params_per_worker=True)
  got = []
  for r in rows:
    ps, state, _ = step(ps, state, devices.shard_batch(
        r, mesh, axis_name=("data", "fsdp")))
    got.append(jax.device_get(ps))
  assert_close(got, want, "hybrid")


@pytest.mark.parametrize("error", ["map", "clear"])
def test_a_resize_maps_or_clears_the_residuals(error):
  """8 workers to 4 mid-round: each new worker's residual is its pair's
  mean (or 0 with error='clear'), the anchor kept."""
  tx = dl.local_steps(optax.sgd(0.1), rounds.voted_outer(
      0.5, axis_name="data"), every=2, late=True)
  params, grads = problem_apart(8, 5)
  _, state = run_step(tx, params, grads, 8)
  mesh = devices.data_mesh(4)
  new = elastic.resize_worker_states(
      tx, state, devices.replicate(jax.tree.map(jnp.zeros_like, params),
                                   mesh), mesh, error=error)
  old_error = np.asarray(state.outer_state.outer_state[0].error["w"])
  new_error = np.asarray(new.outer_state.outer_state[0].error["w"])
  want = (old_error.reshape(4, 2, *SHAPES["w"]).mean(1) if error == "map"
          else np.zeros((4, *SHAPES["w"])))
  np.testing.assert_allclose(new_error, want, rtol=1e-6)
  pending = np.asarray(new.outer_state.pending["w"])     # mapped as momenta
  np.testing.assert_allclose(pending, np.asarray(
      state.outer_state.pending["w"]).reshape(4, 2, *SHAPES["w"]).mean(1),
      rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(new.anchor["w"])[0],
                                np.asarray(state.anchor["w"])[0])


def test_sparse_vote_bits():
  assert dl.sparse_vote_bits(8) == 7 * 8 / 128
  assert dl.sparse_vote_bits(8, sparse_chunk=256) == 7 * 16 / 256
  assert dl.sparse_vote_bits(3, sparse_chunk=32, sparse_keep=2) == 2 * 16 / 32


@pytest.mark.parametrize("call,named", [
    (lambda: rounds.voted_outer(1.0, sparse_chunk=100),
     ["sparse_chunk=100", "power of two"]),
    (lambda: rounds.voted_outer(1.0, sparse_chunk=8, sparse_keep=8),
     ["sparse_keep=8", "below sparse_chunk=8"]),
    (lambda: rounds.voted_outer(1.0, sparse_chunk=8, aggregation="avg"),
     ["sparse_chunk=8", "aggregation='avg'", "sparse_chunk=None"]),
    (lambda: rounds.voted_outer(1.0, momentum=0.9, lion=(0.9, 0.99)),
     ["momentum=0.9", "lion=(0.9, 0.99)", "give one"]),
    (lambda: rounds.voted_outer(1.0, momentum=1.0), ["momentum=1.0"]),
    (lambda: rounds.voted_outer(1.0, momentum="0.9"), ["momentum='0.9'"]),
    (lambda: rounds.voted_outer(1.0, lion=0.9), ["lion=0.9", "(b1, b2)"]),
    (lambda: rounds.voted_outer(1.0, sparse_keep=3),
     ["sparse_keep=3", "needs sparse_chunk"]),
    (lambda: rounds.voted_outer(1.0, sparse_chunk=1), ["sparse_chunk=1"]),
    (lambda: rounds.voted_outer(1.0, sparse_chunk=8, quantizer="ternary_l1"),
     ["quantizer='ternary_l1'", "sparse_chunk=8", "'sign'"]),
    (lambda: rounds.voted_outer(1.0, error_feedback="yes"),
     ["error_feedback='yes'"]),
    (lambda: rounds.voted_outer(1.0, sparse_chunk=8, fit_scale=True),
     ["fit_scale=True", "sparse_chunk=8", "sparse_chunk=None"]),
    (lambda: rounds.voted_outer(1.0, fit_scale=1), ["fit_scale=1"]),
    (lambda: dl.local_steps(optax.sgd(0.1), rounds.nesterov_outer(0.7),
                            every=2, late=1), ["late=1", "True or False"]),
])
def test_mistakes_are_named(call, named):
  with pytest.raises(ValueError) as e:
    call()
  assert_names(e, *named)


def test_sparse_words_say_position_and_sign():
  """Position 2 * i + sign in a uint8 up to a chunk of 128, uint16 above;
  ties go to the first position."""
  from dlion_jax import _sparse
  p = jnp.array([0.5, -2.0, 2.0, 0.25, 1.0, -1.0, 0.0, 3.0])
  words, scale, said = _sparse.encode(p, _sparse.sparsity(4, 1))
  assert words.dtype == jnp.uint8
  np.testing.assert_array_equal(words, [[2 * 1 + 0], [2 * 3 + 1]])
  assert scale == 2.5
  np.testing.assert_array_equal(said, [0, -2.5, 0, 0, 0, 0, 0, 2.5])
  words, _, _ = _sparse.encode(jnp.ones(300), _sparse.sparsity(256, 1))
  assert words.dtype == jnp.uint16 and words.shape == (2, 1)


def test_an_empty_leaf_and_injected_hyperparams_vote():
  """A zero-size leaf beside the others (the sparse vote divided by its
  kept count, 0), and optax.inject_hyperparams around voted_outer (its
  momentum traced: Nesterov's trace, at 0 the plain step)."""
  params = {"w": jnp.zeros((2, 3)), "empty": jnp.zeros((0,))}
  deltas = jax.tree.map(lambda x: jnp.ones((2,) + x.shape), params)
  for tx in (rounds.voted_outer(0.5, axis_name="data", sparse_chunk=128),
             optax.inject_hyperparams(rounds.voted_outer)(
                 0.5, axis_name="data"),
             rounds.voted_outer(0.5, axis_name="data")):
    u = jax.vmap(lambda d, tx=tx: tx.update(d, tx.init(params), params)[0],
                 axis_name="data")(deltas)
    assert u["empty"].shape == (2, 0)
    assert np.all(np.isfinite(np.asarray(u["w"]))) and u["w"][0, 0, 0] < 0
  plain, injected = (jax.vmap(
      lambda d, tx=tx: tx.update(d, tx.init(params), params)[0],
      axis_name="data")(deltas)["w"] for tx in (
          rounds.voted_outer(0.5, axis_name="data"),
          optax.inject_hyperparams(rounds.voted_outer)(
              0.5, axis_name="data")))
  np.testing.assert_array_equal(plain, injected)
