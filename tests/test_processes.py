"""Process start-up lives in dlion_jax.processes, which the rest of the
library does not import: the vote path opens no socket and starts no
thread. The old names still work, with a DeprecationWarning."""

import json
import pathlib
import subprocess
import sys

import pytest

from dlion_jax import devices
from dlion_jax import parallel
from dlion_jax import processes

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The modules `import dlion_jax` loads, and each one's imports of socket
# or threading (read off its source, wherever in the file they stand).
_LOADED = """
import ast, json, sys
import dlion_jax
found = {}
for name, module in sorted(sys.modules.items()):
  if name.split(".")[0] != "dlion_jax" or not getattr(module, "__file__", ""):
    continue
  tree = ast.parse(open(module.__file__).read())
  names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
           for a in node.names]
  names += [node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module]
  found[name] = sorted({n for n in names
                        if n.split(".")[0] in ("socket", "threading")})
print(json.dumps(found))
"""


def test_import_dlion_jax_imports_no_socket_or_threading_code():
  out = subprocess.run([sys.executable, "-c", _LOADED], cwd=ROOT,
                       capture_output=True, text=True, check=True)
  found = json.loads(out.stdout)
  assert "dlion_jax.parallel" in found and "dlion_jax.devices" in found
  assert "dlion_jax.processes" not in found
  assert not {name: names for name, names in found.items() if names}


@pytest.mark.parametrize("module,name", [
    (devices, "start_processes"),
    (devices, "check_processes"),
    (devices, "coordinator_problem"),
    (parallel, "start_processes"),
], ids=lambda x: getattr(x, "__name__", x))
def test_the_paths_public_in_0_2_0_warn_and_work(module, name):
  """Public in 0.2.0, deprecated since, removed in 0.4.0 (CHANGELOG)."""
  with pytest.warns(DeprecationWarning,
                    match=f"use dlion_jax.processes.{name} .*0.4.0"):
    assert getattr(module, name) is getattr(processes, name)


def test_other_missing_names_are_still_attribute_errors():
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    devices.nothing  # pylint: disable=pointless-statement
  assert not hasattr(parallel, "check_processes")


def test_coordinator_problem_names_a_malformed_address():
  assert "expected host:port" in processes.coordinator_problem("localhost")
  assert processes.coordinator_problem("127.0.0.1:1234", process_id=1) is None
