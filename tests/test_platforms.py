"""The commands start quiet on a machine with no TPU where libtpu is
installed (the [tpu-aot] extra), and leave a TPU or GPU machine as it is
(dlion_jax._platforms)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from dlion_jax import _platforms

# What libtpu's probe prints on a machine with no TPU.
LIBTPU = re.compile(r"libtpu|TPU_|InitGoogle|Source Location Trace|tpu",
                    re.IGNORECASE)

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None
    or not sys.platform.startswith("linux") or _platforms.accelerator_present(),
    reason="needs libtpu installed on a Linux machine with no accelerator")


def _as_a_user(**extra):
  """The environment of a user's shell: no JAX_PLATFORMS (the tests set
  it); no other process's libtpu lock in the way (on this machine another
  job may hold it, where the probe fails before it prints)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return {**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **extra}


def _run(*command, timeout=300):
  return subprocess.run([sys.executable, *command], env=_as_a_user(),
                        capture_output=True, text=True, timeout=timeout)


def _libtpu_lines(text):
  return [line for line in text.splitlines() if LIBTPU.search(line)]


@pytest.fixture(scope="module")
def probe_prints():
  """A plain JAX process here prints libtpu's errors (else the tests below
  would prove nothing)."""
  done = _run("-c", "import jax; jax.devices()")
  lines = _libtpu_lines(done.stderr)
  if not lines:
    pytest.skip("libtpu's probe prints nothing on this machine")
  return lines


@needs_libtpu
@pytest.mark.integration
def test_the_quickstart_starts_quiet_without_a_tpu(tmp_path, probe_prints):
  """The README's first command: was ~5 lines of libtpu errors on stderr
  ("could not determine TPU accelerator type", ...) before its headline."""
  assert len(probe_prints) >= 3, probe_prints
  done = _run("-m", "dlion_jax.train", "--no-progress",
              *[a for s in ("workers=2", "data.global_batch=32",
                            "train.steps=2", "optimizer.warmup_steps=0",
                            "model.hidden=[8]", "train.eval_every=0",
                            f"run_dir={tmp_path}") for a in ("--set", s)])
  assert done.returncode == 0, done.stderr[-2000:]
  assert "test accuracy" in done.stdout
  assert "(cpu)" in done.stdout.splitlines()[0]
  assert not _libtpu_lines(done.stderr), done.stderr


@needs_libtpu
@pytest.mark.integration
def test_launch_and_its_processes_start_quiet_without_a_tpu(probe_prints):
  """``python -m dlion_jax.launch`` and its processes, whatever they run;
  ``dlion_jax.bench``, where ``python -m dlion_jax.bench.*`` starts."""
  del probe_prints
  done = _run("-m", "dlion_jax.launch", "-n", "2", "--", sys.executable,
              "-c", "import jax; print(jax.devices())")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.count("CpuDevice") == 2, done.stdout
  assert not _libtpu_lines(done.stderr), done.stderr
  done = _run("-c", "import dlion_jax.bench, jax; print(jax.devices())")
  assert done.returncode == 0 and "CpuDevice" in done.stdout, done.stderr
  assert not _libtpu_lines(done.stderr), done.stderr


@needs_libtpu
@pytest.mark.slow
def test_a_bench_command_starts_quiet_without_a_tpu(probe_prints):
  del probe_prints
  done = _run("-m", "dlion_jax.bench.compile", "--leaves", "10", "--reps",
              "1")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "dlion mavo auto" in done.stdout
  assert not _libtpu_lines(done.stderr), done.stderr


def _machine(tmp_path, *files, pci=None):
  """A fake root: device files, and PCI devices as {name: (vendor, device,
  class)}."""
  for name in files:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).touch()
  for name, (vendor, device, klass) in (pci or {}).items():
    where = tmp_path / "sys/bus/pci/devices" / name
    where.mkdir(parents=True)
    for key, value in (("vendor", vendor), ("device", device),
                       ("class", klass)):
      (where / key).write_text(value + "\n")
  return str(tmp_path)


NIC = {"0000:00:04.0": ("0x1ae0", "0x0042", "0x020000")}   # Google's gVNIC


@pytest.mark.parametrize("files,pci", [
    (("dev/accel0",), NIC),                                   # TPU v2-v4
    (("dev/vfio/0", "dev/vfio/vfio"), NIC),                   # TPU v5 on
    ((), {"0000:00:05.0": ("0x1ae0", "0x0063", "0x120000")}),  # v5e on PCI
    ((), {"0000:00:05.0": ("0x1ae0", "0x9999", "0x120000")}),  # a new one
    (("dev/nvidia0", "dev/nvidiactl"), {}),                   # a GPU
    (("dev/kfd",), {}),                                       # an AMD GPU
])
def test_a_tpu_or_gpu_machine_is_left_as_it_is(tmp_path, monkeypatch, files,
                                               pci):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  root = _machine(tmp_path, *files, pci=pci)
  assert _platforms.accelerator_present(root)
  assert not _platforms.quiet_tpu_probe(root)
  assert "JAX_PLATFORMS" not in os.environ


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None
                    or not sys.platform.startswith("linux"),
                    reason="needs libtpu installed on Linux")
@pytest.mark.parametrize("chosen", [None, ("JAX_PLATFORMS", ""),
                                    ("JAX_PLATFORMS", "tpu,cpu"),
                                    ("JAX_FORCE_TPU_INIT", "1")])
def test_no_accelerator_means_cpu_unless_the_user_chose(tmp_path, monkeypatch,
                                                         chosen):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  if chosen:
    monkeypatch.setenv(*chosen)
  root = _machine(tmp_path, "dev/null", pci=NIC)
  assert not _platforms.accelerator_present(root)
  assert _platforms.quiet_tpu_probe(root) is (chosen is None)
  assert os.environ.get("JAX_PLATFORMS") == (
      "cpu" if chosen is None else dict([chosen]).get("JAX_PLATFORMS"))
