"""The examples in examples/ run as written: a Flax NNX model sharded over
FSDP and tensor-parallel axes through nnx.Optimizer, and a Linen
TrainState with FSDP params; each trains, keeps its params where it placed
them, and sends across the nodes only its own shard's votes."""

import importlib.util
import pathlib

import pytest

import dlion_jax as dl

pytest.importorskip("flax")
pytestmark = pytest.mark.integration      # trains Flax models
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name,spec", [
    ("nnx_fsdp_tp", ("fsdp", "model")), ("linen_train_state", ("fsdp",))])
def test_example_trains_and_votes_on_its_shard(name, spec):
  out = load(name).main(steps=12)
  assert out["losses"][-1] < 0.8 * out["losses"][0]
  assert tuple(out["kernel_spec"]) == spec
  # 2 nodes: a flat vote of binary signs sends about 1 bit/param; each of a
  # node's 4 devices votes on a quarter (plus padding and the loss).
  flat = dl.wire_bits(2)
  assert flat / 4 <= out["data_bits_per_param"] < flat / 3


def test_nnx_example_step_equals_the_shard_map_step():
  """The example's nnx.jit step (dl.workers.value_and_grad, nnx.Optimizer
  over dl.workers.stacked) against the same model and chain stepped by
  dl.parallel.per_worker: the same votes, params a rounding apart (each
  program fuses the clip's scale and the weight decay into its own
  roundings; one vote apart would be 2 lr = 6e-3)."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  example = load("nnx_fsdp_tp")
  mesh, tx = example.make_mesh(), example.make_optimizer()
  with jax.set_mesh(mesh):
    model = example.MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dl.workers.stacked(tx), wrt=nnx.Param)
    reference = example.MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(reference, tx, wrt=nnx.Param)
  model_def, model_state = nnx.split(reference)
  opt_def, opt_state = nnx.split(opt)
  opt_state = dl.devices.stack_for_workers(opt_state, mesh)

  def one_worker(model_state, opt_state, batch):
    model = nnx.merge(model_def, model_state)
    optimizer = nnx.merge(opt_def, opt_state)
    loss, grads = nnx.value_and_grad(example.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return (nnx.state(model), nnx.state(optimizer),
            jax.lax.pmean(loss, "data"))
  manual = dl.parallel.per_worker(
      one_worker, mesh, ins=("replicated", "stacked", "split"),
      outs=("replicated", "stacked", "replicated"))
  rng = np.random.default_rng(0)
  spread = NamedSharding(mesh, P(("data", "fsdp", "model")))
  with jax.set_mesh(mesh):
    for _ in range(3):
      x = rng.normal(size=(32, 16)).astype(np.float32)
      batch = jax.device_put({"x": x, "y": x[:, :4] ** 2}, spread)
      loss = example.train_step(model, optimizer, batch)
      model_state, opt_state, theirs = manual(model_state, opt_state, batch)
      # Each program sums a worker's rows across fsdp x model in its own
      # order: the losses to a rounding.
      np.testing.assert_allclose(loss, theirs, rtol=1e-6)
  for mine, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                          jax.tree.leaves(nnx.state(model_state,
                                                    nnx.Param))):
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
