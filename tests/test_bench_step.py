"""bench.step's table: the ratios of medians and of each round's pair."""

import types

import jax
import numpy as np
import pytest

from dlion_jax.bench import step


def runners(**times):
  return {name.replace("_", " "): types.SimpleNamespace(times=t)
          for name, t in times.items()}


def test_per_round_ratios_pair_each_round_with_the_floors():
  """Each round's pair gives one ratio; their median and quartiles are not
  the ratio of the medians (5x here, where no round is above 5x)."""
  r = runners(dlion_mavo_psum=[0.002, 0.010, 0.011],
              global_lion=[0.0015, 0.003, 0.015],
              local_lion=[0.001, 0.002, 0.010])
  np.testing.assert_allclose(
      step.paired_ratios(r, "dlion mavo psum", step.FLOOR), [2.0, 5.0, 1.1])
  cells = {line.split("|")[1].strip(): [c.strip() for c in
                                        line.split("|")[2:-1]]
           for line in step.table(r, 8).splitlines()[2:]}
  assert cells["dlion mavo psum"][-2:] == ["5.00x", "2.00x (1.55-3.50)"]
  assert cells["global lion"][-1] == "1.50x (1.50-1.50)"
  assert cells["local lion"][-1] == "1.00x (1.00-1.00)"


SHAPES = {"w": (37, 11), "v": (1001,)}


def test_vmapped_workers_step_as_the_mesh_does_and_agree():
  """``--vmap`` (all workers on one device, as on a GPU) gives the mesh
  step's parameters bit for bit, and its agreement line reads both the
  strategies' and the workers' copies."""
  vmapped = step.build(8, SHAPES, vmap=True)
  meshed = step.build(8, SHAPES)
  for name in ("dlion mavo auto", "dlion avg auto"):
    for leaf_v, leaf_m in zip(jax.tree.leaves(vmapped[name].params),
                              jax.tree.leaves(meshed[name].params)):
      assert leaf_v.shape == (8,) + leaf_m.shape
      np.testing.assert_array_equal(leaf_v[3], leaf_m)
  line = step.agreement(vmapped)
  assert "bit for bit alike" in line and "same parameters" in line
  assert "same parameters" not in step.agreement(meshed)


def test_agreement_names_a_strategy_and_workers_that_differ():
  runners = step.build(8, SHAPES, vmap=True)
  psum = runners["dlion mavo psum"]
  psum.params = jax.tree.map(lambda x: x.at[5].add(1.0), psum.params)
  line = step.agreement(runners)
  assert "NOT alike: dlion mavo psum differ" in line
  assert "drifted apart in ['dlion mavo psum']" in line


def test_tpu_bytes_read_what_a_lion_step_must_move():
  """--tpu: XLA:TPU's bytes a parameter for optax.lion are at least the 20
  its step must move (read g, m, p; write m, p), and D-Lion's are read
  from the same compiled step; too few chips are named."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  import optax  # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import aot  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(aot.tpu_devices("v5e:2x4", 1)),
                           (step.AXIS,))
  shapes = {"w": (2048, 1024)}
  floor, fusions = step.tpu_bytes(optax.lion(1e-3), mesh, shapes)
  assert floor / (2048 * 1024) >= 20 and fusions >= 1
  with pytest.raises(ValueError, match="v5e:2x2 has 4 chips.*--workers 8"):
    step.tpu_table(8, shapes, "v5e:2x2")


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_all_in_hbm_compiles_a_step_with_nothing_staged_on_chip(monkeypatch):
  """--all-in-hbm: with memory-space assignment off no buffer of the step
  is in on-chip memory (``S(1)``), where the default compile of a step
  whose leaves fit on chip stages some there, and the table's column reads
  at least what the step must move and at most the staged figure."""
  pytest.importorskip("libtpu", reason="needs the [tpu-aot] extra")
  import optax  # pylint: disable=g-import-not-at-top
  from dlion_jax.bench import aot  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(aot.tpu_devices("v5e:2x4", 1)),
                           (step.AXIS,))
  shapes = {"w": (2048, 1024)}
  text = lambda **kw: step.tpu_compiled(optax.lion(1e-3), mesh, shapes,
                                        **kw).as_text()
  assert "S(1)" in text()
  assert "S(1)" not in text(options=step.ALL_IN_HBM)
  every = step.variants
  monkeypatch.setattr(step, "variants", lambda *a, **k: {
      name: v for name, v in every(*a, **k).items()
      if name in (step.FLOOR, "dlion mavo auto")})
  lines = step.tpu_table(8, shapes, "v5e:2x4", all_in_hbm=True).splitlines()
  assert lines[0].split("|")[-2].strip() == "all in HBM"
  rows = {line.split("|")[1].strip(): line.split("|") for line in lines[2:]}
  assert set(rows) == {step.FLOOR, "dlion mavo auto"}
  compiled, unstaged = float(rows[step.FLOOR][2]), float(rows[step.FLOOR][5])
  assert 20 <= unstaged <= compiled


def test_the_grid_checks_each_group_of_strategies():
  """``--grid``: every aggregation x comm x vote, each group of strategies
  (aggregation and vote) checked bit for bit on its own."""
  names = [k for k in step.variants(grid=True) if k.startswith("dlion")]
  assert len(names) == 20 and "dlion avg psum_int8 ternary" in names
  assert step._comm_bits("dlion mavo auto ternary", 8) == "2.8 (alltoall)"
  runners = step.build(8, SHAPES, vmap=True, grid=True)
  line = step.agreement(runners)
  assert line.count("bit for bit alike") == 4, line
  one = runners["dlion avg allgather ternary"]
  one.params = jax.tree.map(lambda x: x.at[1].add(1.0), one.params)
  line = step.agreement(runners)
  assert "of Avg ternary auto, alltoall, allgather, psum, psum_int8 are NOT" \
      " alike: dlion avg allgather ternary differ" in line, line
  assert line.count("bit for bit alike") == 3


def test_plain_steps_run_beside_the_shard_map_steps_and_agree():
  """``--plain``: each D-Lion variant also as a plain jitted step
  (dl.workers), the same parameters bit for bit, its wire bits named as
  its shard_map step's, and the agreement line lists both forms."""
  runners = step.build(8, SHAPES, plain=True)
  plain = [k for k in runners if k.endswith(step.PLAIN)]
  assert len(plain) == len([k for k in runners if k.startswith("dlion")]) / 2
  for name in plain:
    for a, b in zip(jax.tree.leaves(runners[name].params),
                    jax.tree.leaves(runners[name.removesuffix(
                        step.PLAIN)].params)):
      np.testing.assert_array_equal(a, b)
    assert step._comm_bits(name, 8) == step._comm_bits(
        name.removesuffix(step.PLAIN), 8)
  line = step.agreement(runners)
  assert "auto (plain jit)" in line and "NOT" not in line
  assert line.count("bit for bit alike") == 2


def test_kernels_and_xla_too_step_side_by_side_and_agree():
  """``--kernels pallas --xla-too`` (on a GPU; here Pallas' interpreter):
  each D-Lion variant through the fused kernels and, named '(XLA)',
  without them, the same parameters bit for bit."""
  runners = step.build(8, {"w": (256, 128), "b": (37,)}, kernels="pallas",
                       xla_too=True)
  xla = [k for k in runners if k.endswith(step.XLA)]
  assert xla and len(xla) == len([k for k in runners
                                  if k.startswith("dlion")]) / 2
  for name in xla:
    for a, b in zip(jax.tree.leaves(runners[name].params),
                    jax.tree.leaves(runners[name.removesuffix(
                        step.XLA)].params)):
      np.testing.assert_array_equal(a, b)
  assert "NOT" not in step.agreement(runners)


def test_abstain_adds_each_dlion_variant_with_abstention():
  """``--abstain``: each D-Lion variant also with abstain_nonfinite=True,
  named '(abstain)' after it; the baselines once."""
  named = {name: tx for name, tx, _, _ in step.named_variants(
      False, "auto", False, False, abstain=True)}
  held = [k for k in named if k.endswith(step.ABSTAIN)]
  assert "dlion mavo auto (abstain)" in held
  assert len(held) == len([k for k in named if k.startswith("dlion")]) / 2
  assert step.FLOOR in named and step.FLOOR + step.ABSTAIN not in named
  state = named["dlion mavo auto (abstain)"].init(
      {"w": np.zeros(3, np.float32)})
  assert hasattr(state[0], "abstentions")


@pytest.mark.parametrize("argv,names", [
    (["--xla-too"], ["--xla-too", "--tpu", "--kernels pallas"]),
    (["--kernels", "pallas"], ["--kernels pallas", "interpreter", "GPU",
                               "--tpu"]),
    (["--kernels", "pallas", "--plain"], ["--kernels pallas", "--plain"]),
    (["--tpu", "v5e:2x4", "--kernels", "xla", "--xla-too"],
     ["--xla-too", "--kernels auto or pallas"]),
    (["--all-in-hbm"], ["--all-in-hbm", "--tpu TOPOLOGY"]),
    (["--abstain"], ["--abstain", "--tpu TOPOLOGY"]),
])
def test_kernel_options_that_cannot_measure_are_refused(argv, names, capsys):
  """Options that would time nothing they name: refused before any
  compile, naming what to do."""
  with pytest.raises(SystemExit):
    step.main(argv)
  err = capsys.readouterr().err
  for name in names:
    assert name in err, (name, err)
