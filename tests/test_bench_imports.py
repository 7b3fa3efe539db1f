"""The benchmark modules import one another without a cycle, lazy imports
(inside functions) included: read off their source, nothing imported."""

import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "dlion_jax" / "bench"


def _imports(path: pathlib.Path) -> set[str]:
  """The dlion_jax.bench modules ``path`` imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.ImportFrom) and node.module == "dlion_jax.bench":
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "dlion_jax.bench."):
      found.add(node.module.split(".")[2])
  return found


def test_no_import_cycle_among_the_benchmarks():
  graph = {p.stem: _imports(p) & {q.stem for q in BENCH.glob("*.py")}
           for p in BENCH.glob("*.py") if p.stem != "__init__"}
  assert graph["compile"] >= {"aot_models"}, graph   # the parser sees them

  def visit(name, path):
    assert name not in path, " -> ".join(path + [name])
    for dep in graph.get(name, ()):
      visit(dep, path + [name])
  for name in graph:
    visit(name, [])
