"""Distributed Lion in a ``jax.pmap`` script, for users of pmap-style code.

``python -m dlion_jax.train.pmap_example [--workers 8] [--steps 200]``

The same MLP on scikit-learn's digits as the quickstart, without the config
machinery: every array carries a leading device axis, the optimizer state
holds each device's own momentum, and the step votes over the ``pmap`` axis.
"""

from __future__ import annotations

import argparse
import sys

from dlion_jax.train import missing_extra


def main(argv=None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args(argv)

  from dlion_jax import devices  # pylint: disable=g-import-not-at-top
  from dlion_jax import parallel  # pylint: disable=g-import-not-at-top
  devices.use_cpu_devices(args.workers)   # before jax touches a device
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import dlion_jax as dl  # pylint: disable=g-import-not-at-top
  from dlion_jax.train import data, models  # pylint: disable=g-import-not-at-top

  n = args.workers
  digits = data.load_digits()
  model = models.MLP(64, [64], 10, rngs=nnx.Rngs(0))
  graphdef, params = models.split_params(model)

  def loss_fn(params, batch):
    logits = models.apply(graphdef, params, batch["x"])
    return models.classification_loss(logits, batch["y"])

  tx = dl.distributed_lion(3e-3, weight_decay=1e-2, axis_name="data")
  step = parallel.make_pmap_train_step(loss_fn, tx, axis_name="data",
                                       devices=jax.devices()[:n])
  params, state = (devices.replicate_for_pmap(params, n),
                   parallel.init_pmap_states(tx, params, n))
  batches = data.Batches(digits.train, global_batch=32 * n, seed=0,
                         kind="classification")
  for _ in range(args.steps):
    batch = jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]),
                         next(batches))          # [devices, 32, ...]
    params, state, loss = step(params, state, batch)   # not awaited
  one = jax.tree.map(lambda x: x[0], params)     # replicas are identical
  logits = models.apply(graphdef, one, digits.test["x"])
  accuracy = float(np.mean(np.argmax(logits, -1) == digits.test["y"]))
  print(f"pmap over {n} devices, {args.steps} steps: loss {float(loss[0]):.4f}"
        f", test accuracy {accuracy:.4f}")
  return accuracy


if __name__ == "__main__":
  try:
    main()
  except ModuleNotFoundError as e:
    line = missing_extra(e, "python -m dlion_jax.train.pmap_example")
    if line is None:
      raise
    sys.exit(line)
