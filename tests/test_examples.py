"""The examples in examples/ run as written: a Flax NNX model sharded over
FSDP and tensor-parallel axes through nnx.Optimizer, and a Linen
TrainState with FSDP params; each trains, keeps its params where it placed
them, and sends across the nodes only its own shard's votes."""

import importlib.util
import pathlib

import pytest

import dlion_jax as dl

pytest.importorskip("flax")
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
