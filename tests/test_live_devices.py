"""Where JAX keeps going without a restart: ``jax.live_devices`` on GPUs
(docs/reliability.md, section 3.2).

With ``jax_enable_recoverability``, a step run inside ``with
multihost_utils.live_devices(jax.devices()) as live:`` either completes on
every process of ``live`` or raises on every one of them. When a process
is lost, the survivors drop the step, make a mesh of the live devices,
keep their own rows of the optimizer state (the lost workers' momenta go
with them: from then on they abstain) and the params, compile the step for
the live workers and go on, with no restart and no checkpoint read.

JAX documents this as working fully only on GPUs; on CPU with gloo the
survivors hung inside ``live_devices`` (3 processes, one killed), so the
CPU path is the launcher's restart (tests/test_restarts.py). One process
per GPU: NCCL refuses two ranks on one device, so the test needs 2 GPUs or
more, and is skipped without them.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


def _gpus() -> int:
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True,
                         timeout=30).stdout
  except (OSError, subprocess.TimeoutExpired):
    return 0
  return sum(line.startswith("GPU ") for line in out.splitlines())


SCRIPT = textwrap.dedent("""
    import os, sys
    i = int(os.environ["JAX_PROCESS_ID"])
    os.environ["CUDA_VISIBLE_DEVICES"] = str(i)     # one GPU a process
    os.environ["JAX_PLATFORMS"] = "cuda"
    import numpy as np
    import jax, jax.numpy as jnp
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(heartbeat_timeout_seconds=10)
    from jax.experimental import multihost_utils
    import dlion_jax as dl
    from dlion_jax import devices, parallel

    STEPS, VICTIM, AT = 30, int(sys.argv[1]), 10
    tx = dl.distributed_lion(1e-2, axis_name="data")
    teacher = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)

    def loss_fn(params, batch):
      return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    def on(mesh, params, state):
      # The params (replicated: each process has them whole) and this
      # process's own rows of the state, on the live workers' mesh.
      params = devices.global_array(
          jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params),
          jax.NamedSharding(mesh, jax.P()))
      rows = jax.NamedSharding(mesh, jax.P("data"))
      def own(x):
        local = [np.asarray(s.data) for s in x.addressable_shards]
        shape = (mesh.shape["data"],) + x.shape[1:]
        return jax.make_array_from_single_device_arrays(
            shape, rows, [jax.device_put(a, d) for a, d in
                          zip(local, mesh.local_devices)])
      return params, jax.tree.map(own, state)

    live, step_no, lost = None, 0, []
    host = {"w": np.zeros((16, 4), np.float32)}
    while step_no < STEPS:
      if jax.process_index() == VICTIM and step_no == AT:
        os._exit(1)                                  # a host is lost
      try:
        with multihost_utils.live_devices(jax.devices()) as now:
          if live is None:
            mesh = devices.data_mesh(len(now), devices=now)
            params = devices.global_array(host, jax.NamedSharding(mesh,
                                                                  jax.P()))
            state = parallel.init_worker_states(tx, params, mesh)
          elif now != live:
            mesh = devices.data_mesh(len(now), devices=now)
            params, state = on(mesh, params, state)
          if now != live:
            step = parallel.make_train_step(loss_fn, tx, mesh)
            live = now
          x = np.random.default_rng(step_no).normal(size=(64, 16))
          x = x.astype(np.float32)
          batch = devices.shard_batch({"x": x, "y": x @ teacher}, mesh)
          params, state, loss = step(params, state, batch)
          loss = float(loss)
      except Exception as e:  # the step is dropped on every survivor
        lost.append(sorted(d.id for d in getattr(e, "failed_devices", [])))
        continue
      step_no += 1
    w = np.asarray(params["w"].addressable_data(0))
    print(f"done {jax.process_index()} workers {len(live)} lost {lost} "
          f"loss {loss:.4f} sum {float(np.abs(w).sum()):.6f}", flush=True)
""")


@pytest.mark.skipif(_gpus() < 2, reason="jax.live_devices works fully on "
                    "GPUs only, one process a GPU: needs 2 GPUs or more")
def test_the_vote_goes_on_on_the_live_workers(tmp_path):
  """3 processes (one a GPU, or fewer where fewer GPUs); one exits at step
  10: the others drop that step, go on voting among themselves and finish
  alike, without a restart."""
  from dlion_jax import launch  # pylint: disable=g-import-not-at-top
  n = min(3, _gpus())
  victim = n - 1
  port = launch._free_port()
  procs = []
  for i in range(n):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i),
               PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    procs.append(subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(victim)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert procs[victim].returncode == 1
  done = []
  for i in range(n - 1):
    assert procs[i].returncode == 0, outs[i]
    line = [x for x in outs[i].splitlines() if x.startswith("done ")]
    assert len(line) == 1, outs[i]
    done.append(line[0].split(" ", 2)[2])
  assert len(set(done)) == 1, done            # the survivors agree
  assert done[0].startswith(f"workers {n - 1} lost [["), done
