"""The package in layers: every module of ``dlion_jax/**`` imports only
from lower layers (imports inside functions included), the two doors to a
step never reach each other, and no module but the HLO reader is over 750
lines. The table is the design notes' "Where each concept lives"."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dlion_jax"

# Lowest first. A module may import modules of lower layers only; two
# modules of one layer never import each other.
LAYERS = [
    ("foundation: option checks, old paths, mesh and spec arithmetic, "
     "the platforms the commands start on",
     ["_checks", "_deprecations", "_mesh", "_platforms"]),
    ("readers: the traced step's jaxpr, the compiled step's HLO",
     ["_drift", "hlo"]),
    ("the collectives both doors use", ["_collectives"]),
    ("blocks: a leaf's part on each device of the fast axes", ["_blocks"]),
    ("codec: vote codes, digits packed into words",
     ["_quantize", "_packing", "_sparse"]),
    ("codec: the comm strategies", ["_strategies"]),
    ("codec: the message, the fused kernels", ["_message", "_fused"]),
    ("codec: what a worker sends; a lone worker's step",
     ["_sending", "_lone"]),
    ("codec: the vote over an axis", ["_exchange"]),
    ("codec: the voted mean's dense vote and scales", ["_voted"]),
    ("transforms: momentum syncs, wrappers across workers",
     ["sync", "transforms"]),
    ("optimizers: Lion, local steps, the cost model, the state's "
     "placement, optax's extra arguments",
     ["lion", "rounds", "accounting", "_placement", "_extra_args"]),
    ("the worker core; meshes and arrays", ["_core", "devices"]),
    ("the checks of what a step returns replicated", ["_replication"]),
    ("the doors: per_worker's map | the plain jitted step",
     ["_per_worker", "workers"]),
    ("the shard_map door: its steps and the worker update they run",
     ["_steps"]),
    ("the shard_map door: its builders", ["parallel"]),
    ("elastic resize, processes, the launcher",
     ["elastic", "processes", "launch"]),
    ("the package's face and the old paths",
     ["__init__", "packing", "strategies", "message", "exchange",
      "quantize", "fused", "shards"]),
    ("the training CLI", ["train"]),
    ("the benchmarks you run", ["bench"]),
]


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts)] = path
  return out


def _layer_of(module: str) -> int:
  top = module.split(".")[0]
  for i, (_, names) in enumerate(LAYERS):
    if module in names or (top in ("train", "bench") and top in names):
      return i
  raise AssertionError(f"dlion_jax.{module} is in no layer of LAYERS")


def _imports(module: str, path: pathlib.Path, known) -> set[str]:
  """The package's modules ``module`` imports, anywhere in it."""
  package = module.split(".")[:-1] if not path.name == "__init__.py" else (
      module.split(".")[:-1])
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(["dlion_jax"] + package[:len(package) - node.level
                                              + 1] + [base])
      names = [f"{base}.{a.name}" for a in node.names] + [base]
    for name in names:
      name = name.removeprefix("dlion_jax").lstrip(".").rstrip(".")
      if name in known and name != module:
        out.add(name)
        break
  return {m for m in out if m}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_imports_only_from_lower_layers(graph):
  wrong = []
  for module, imported in graph.items():
    for other in imported:
      same_tool = module.split(".")[0] == other.split(".")[0] in (
          "train", "bench")
      if not same_tool and _layer_of(other) >= _layer_of(module):
        wrong.append(f"{module} ({LAYERS[_layer_of(module)][0]}) imports "
                     f"{other} ({LAYERS[_layer_of(other)][0]})")
  assert not wrong, "\n".join(wrong)


def test_no_import_circle(graph):
  """Counting every import, the tools' among themselves included."""
  seen, done = set(), set()
  def visit(module, trail):
    if module in done:
      return
    assert module not in seen, " -> ".join(trail + [module])
    seen.add(module)
    for other in sorted(graph[module]):
      visit(other, trail + [module])
    done.add(module)
  for module in sorted(graph):
    visit(module, [])


def _reach(graph, module) -> set[str]:
  out, todo = set(), [module]
  while todo:
    for other in graph[todo.pop()]:
      if other not in out:
        out.add(other)
        todo.append(other)
  return out


def test_the_two_doors_never_reach_each_other(graph):
  """The module that defines make_train_step and the one that defines
  dl.workers.stacked share the core below them and nothing else."""
  assert "workers" not in _reach(graph, "parallel")
  assert "parallel" not in _reach(graph, "workers")


def test_no_module_is_over_750_lines_but_the_hlo_reader():
  long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 750
          and p.name != "hlo.py"}
  assert not long, long
