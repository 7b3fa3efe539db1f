"""A quiet start on a machine with no TPU, where libtpu is installed.

JAX tries every backend it knows when ``JAX_PLATFORMS`` is unset, the TPU
one included wherever the ``libtpu`` package is installed (the
``[tpu-aot]`` extra, for compiling for TPU topologies without a TPU). On a
machine with no TPU libtpu's probe then prints about five lines of errors
to stderr at start-up ("could not determine TPU accelerator type", "Logging
before InitGoogle()", "unexpected worker hostname", ...) before JAX falls
back to the CPU, and takes a lock that other processes' probes fail on. No
log level or ``TPU_*`` variable quiets them; only not probing does.

:func:`quiet_tpu_probe` sets ``JAX_PLATFORMS=cpu`` where nothing else could
run: on Linux, with libtpu installed, ``JAX_PLATFORMS``,
``JAX_FORCE_TPU_INIT`` and ``PJRT_NAMES_AND_LIBRARY_PATHS`` unset, and no
accelerator on the machine (no TPU or GPU device file, no TPU or other
processing accelerator on the PCI bus).
A TPU or GPU machine is left as it is. The library's commands call it
before JAX starts; the library itself never does.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib
import sys

# Device files of TPUs (v2-v4: accel, v5 and later: vfio groups), NVIDIA
# GPUs (WSL2's dxg too) and AMD GPUs.
_DEVICE_FILES = ("dev/accel*", "dev/vfio/[0-9]*", "dev/nvidia[0-9]*",
                 "dev/nvidiactl", "dev/dxg", "dev/kfd")
# PCI: Google's vendor id and its TPUs' device ids (as jax reads them), and
# the class of processing accelerators.
_GOOGLE = "0x1ae0"
_TPU_IDS = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
            "0x0076")
_ACCELERATOR_CLASS = "0x12"


def _read(path: pathlib.Path) -> str:
  try:
    return path.read_text().strip()
  except OSError:
    return ""


def accelerator_present(root: str = "/") -> bool:
  """Whether the machine under ``root`` has a TPU, a GPU or another
  processing accelerator (by its device files and PCI devices)."""
  base = pathlib.Path(root)
  if any(glob.glob(str(base / pattern)) for pattern in _DEVICE_FILES):
    return True
  for device in glob.glob(str(base / "sys/bus/pci/devices/*")):
    device = pathlib.Path(device)
    if _read(device / "class").startswith(_ACCELERATOR_CLASS) or (
        _read(device / "vendor") == _GOOGLE
        and _read(device / "device") in _TPU_IDS):
      return True
  return False


def quiet_tpu_probe(root: str = "/") -> bool:
  """Sets ``JAX_PLATFORMS=cpu`` (for this process, before JAX starts, and
  the processes it starts) where libtpu's probe would only print errors;
  see the module. Returns whether it did."""
  chosen = ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT",
            "PJRT_NAMES_AND_LIBRARY_PATHS")
  if (any(name in os.environ for name in chosen)
      or not sys.platform.startswith("linux")
      or importlib.util.find_spec("libtpu") is None
      or accelerator_present(root)):
    return False
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax = sys.modules.get("jax")
  if jax is not None and jax.config.jax_platforms is None:
    jax.config.update("jax_platforms", "cpu")
  return True
