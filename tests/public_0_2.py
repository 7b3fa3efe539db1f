"""The paths 0.2.0 made public, read off its sources in git.

``python tests/public_0_2.py`` writes them to ``tests/data/public_0_2.txt``,
which ``tests/test_deprecations.py`` reads (and checks against git where the
history is there). 0.2.0 is two commits: ``RELEASE``, where the CHANGELOG
dates 0.2.0, and ``LAST``, the last commit before 0.3.0's layering, while
``__version__`` still read "0.2.0" (what an install from the repository
gave until then).

A path is public when its module's dotted name has no part with a leading
underscore and is not a command's (``dlion_jax.train.*``, a
``dlion_jax.bench.<tool>``), and its name has none either, and the module
defines it at top level (``def``, ``class``, an assignment), re-exports it
(an import marked ``noqa: F401``), lists it in ``__all__``, or kept it as
an old path of its own (the keys of ``moved(__name__, {...})``).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

RELEASE = "b84cd9a"
LAST = "3186fdc"
REVS = (RELEASE, LAST)
LIST = pathlib.Path(__file__).parent / "data" / "public_0_2.txt"


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True,
                        check=True,
                        cwd=pathlib.Path(__file__).parents[1]).stdout


def has_history() -> bool:
  """Whether this checkout holds both commits (a shallow clone may not)."""
  try:
    for rev in REVS:
      _git("cat-file", "-e", f"{rev}^{{commit}}")
  except (OSError, subprocess.CalledProcessError):
    return False
  return True


def _module(path: str) -> str | None:
  parts = path[:-len(".py")].split("/")
  if parts[-1] == "__init__":
    parts = parts[:-1]
  if any(p.startswith("_") for p in parts):
    return None
  if parts[1:2] == ["train"] or (parts[1:2] == ["bench"] and len(parts) > 2):
    return None
  return ".".join(parts)


def _moved_keys(call: ast.Call) -> set[str]:
  if len(call.args) < 2:
    return set()
  # The library's own table: literals, comprehensions, dict.fromkeys.
  expr = compile(ast.Expression(call.args[1]), "<moved>", "eval")
  scope = {"__builtins__": {}, "dict": dict}
  return set(eval(expr, scope))  # pylint: disable=eval-used


def names(source: str) -> set[str]:
  """The public names one module's ``source`` holds."""
  tree = ast.parse(source)
  lines = source.splitlines()
  found = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
      found.add(node.name)
    elif isinstance(node, ast.ImportFrom):
      if "noqa: F401" in "".join(lines[node.lineno - 1:node.end_lineno]):
        found |= {a.asname or a.name for a in node.names}
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [
          node.target]
      for target in targets:
        found |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
      value = node.value
      if isinstance(value, ast.Call) and getattr(
          value.func, "id", getattr(value.func, "attr", "")) == "moved":
        found |= _moved_keys(value)
      if any(getattr(t, "id", "") == "__all__" for t in targets):
        found |= set(ast.literal_eval(value))
  return {n for n in found if not n.startswith("_")}


def public_paths(rev: str) -> set[str]:
  """Every public path of the library at commit ``rev``."""
  paths = set()
  for path in _git("ls-tree", "-r", "--name-only", rev, "dlion_jax").split():
    module = _module(path) if path.endswith(".py") else None
    if module:
      source = _git("show", f"{rev}:{path}")
      paths |= {f"{module}.{n}" for n in names(source)}
  return paths


def listed() -> list[str]:
  """The paths of :data:`LIST`."""
  return [line for line in LIST.read_text().splitlines()
          if line and not line.startswith("#")]


def main() -> None:
  paths = sorted(set().union(*map(public_paths, REVS)))
  LIST.write_text(
      f"# The public paths of 0.2.0 ({RELEASE} and {LAST}), written by\n"
      "# python tests/public_0_2.py: do not edit.\n" + "\n".join(paths)
      + "\n")
  print(f"{len(paths)} paths -> {LIST}", file=sys.stderr)


if __name__ == "__main__":
  main()
