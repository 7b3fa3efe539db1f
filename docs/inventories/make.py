"""Writes the intersphinx inventories of docs/inventories/ (``*.inv``).

The site links jax, optax, flax, numpy and the Python standard library
with ``sphinx.ext.intersphinx`` and must build with no network, so their
inventories are kept here, built from what those projects document
rather than downloaded from their sites:

* jax, optax, flax and numpy: the reStructuredText sources of each
  project's documentation (a checkout of its repository, ``--src``) say
  which page documents each name: ``.. autosummary::`` with ``:toctree:``
  lists make a page of their own per name, ``<toctree>/<name>.html``
  (jax's ``_autosummary/jax.lax.cond.html``, optax's
  ``api/generated/optax.lion.html``); ``.. autofunction::``,
  ``.. autoclass::`` (and flax's ``.. flax_module::``) document the name
  on the page that holds them (``jax.sharding.html#jax.sharding.Mesh``,
  ``api_reference/flax.nnx/module.html#flax.nnx.Module``); ``:members:``
  adds the members the installed package's class or module has. Each name
  the installed package resolves is also entered under the path its object
  reports (``jax.Array`` as ``jax.jaxlib._jax.Array``,
  ``optax.GradientTransformation`` as ``optax._src.base.
  GradientTransformation``), which is what autodoc writes in signatures.
* Python: no sources needed; each public name of the modules in
  ``STDLIB`` is on ``library/<module>.html#<module>.<name>``, the layout of
  docs.python.org/3 (an assumption: a name the module exports but the docs
  do not describe gets a link to the module's page with a dead anchor).

Checked against (the sources that wrote the committed inventories):
jax-ml/jax cec06d1 (2026-08-08, jax 0.11.1), google-deepmind/optax
2edbcbe (2026-08-07), google/flax 18f8f31 (2026-07-02, docs_nnx, the
site flax.readthedocs.io serves), numpy/numpy 1f90bbb (2026-08-21); the
page layouts were checked against links to the live sites (e.g.
https://optax.readthedocs.io/en/latest/api/generated/optax.lion.html,
https://docs.jax.dev/en/latest/_autosummary/jax.lax.cond.html,
https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/nn/
normalization.html#flax.nnx.BatchNorm); names resolved with jax 0.10.2,
optax 0.2.8, flax 0.12.8, numpy 2.4.6 and Python 3.11 installed. The
sites' ``latest`` pages move with each project's main branch; rerun this
after upgrading them:

  git clone --depth 1 https://github.com/jax-ml/jax /tmp/jax   # etc.
  python docs/inventories/make.py --src jax=/tmp/jax \\
      --src optax=/tmp/optax --src flax=/tmp/flax --src numpy=/tmp/numpy

Projects not given a ``--src`` keep their committed inventory; python's is
always rewritten (from the running interpreter's standard library).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import pathlib
import re
import sys
import typing
import zlib

HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Project:
  docs: str        # the Sphinx source folder inside the project's repository
  url: str         # where the site serves that folder
  version: str     # the inventory header's version: the site's
  packages: tuple  # the top-level packages its aliases may name


PROJECTS = {
    "jax": Project("docs", "https://docs.jax.dev/en/latest/", "latest",
                   ("jax", "jaxlib")),
    "optax": Project("docs", "https://optax.readthedocs.io/en/latest/",
                     "latest", ("optax",)),
    "flax": Project("docs_nnx", "https://flax.readthedocs.io/en/latest/",
                    "latest", ("flax",)),
    "numpy": Project("doc/source", "https://numpy.org/doc/stable/", "stable",
                     ("numpy",)),
}
STDLIB = ("abc", "argparse", "collections", "collections.abc", "contextlib",
          "dataclasses", "enum", "functools", "itertools", "numbers",
          "pathlib", "types", "typing")

# (directive, role) of the directives that document one object where they
# stand; automodule and module are handled apart.
DIRECT = {
    "autofunction": "function", "function": "function",
    "autoclass": "class", "class": "class",
    "autoexception": "exception", "exception": "exception",
    "autodata": "data", "data": "data",
    "autodecorator": "function", "decorator": "function",
    "autoattribute": "attribute", "attribute": "attribute",
    "automethod": "method", "method": "method",
}
DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:py:)?([\w-]+)::\s*(.*?)\s*$")
OPTION = re.compile(r"^\s*:([\w-]+):\s*(.*?)\s*$")


@dataclasses.dataclass
class Entry:
  name: str
  role: str        # a py domain object type: function, class, module, ...
  uri: str         # relative to the project's url
  priority: int = 1


def resolve(dotted: str):
  """The installed object ``dotted`` names, or None."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except Exception:  # noqa: BLE001 (any failure: not importable here)
      continue
    try:
      for part in parts[i:]:
        obj = getattr(obj, part)
    except Exception:  # noqa: BLE001
      return None
    return obj
  return None


def role_of_name(name: str) -> str:
  """The role of the installed object ``name`` names (a member's, where
  its owner is a class), else a guess from the name."""
  obj = resolve(name)
  if obj is None:
    return guess_role(name)
  owner, _, member = name.rpartition(".")
  parent = resolve(owner) if owner else None
  return role_of(obj, parent if inspect.isclass(parent) else None, member)


def is_type_alias(obj) -> bool:
  """A typing construct (``optax.Updates``, ``jax.typing.DTypeLike``,
  ``typing.Literal``), neither class nor function."""
  return (not inspect.isclass(obj) and not inspect.isroutine(obj)
          and type(obj).__module__ in ("typing", "types"))


def role_of(obj, in_class=None, name: str = "") -> str:
  if inspect.ismodule(obj):
    return "module"
  if is_type_alias(obj):
    return "data"
  if in_class is not None:
    raw = inspect.getattr_static(in_class, name, None)
    if isinstance(raw, property):
      return "property"
    if inspect.isclass(obj):
      return "class"
    return "method" if callable(obj) else "attribute"
  if inspect.isclass(obj):
    return "exception" if issubclass(obj, BaseException) else "class"
  return "function" if callable(obj) else "data"


def guess_role(name: str) -> str:
  """For names the installed package lacks (newer than it): CamelCase a
  class, else a function."""
  return "class" if name.rpartition(".")[2][:1].isupper() else "function"


def public_members(obj, listed: str) -> list[str]:
  """What ``:members:`` documents: the names it lists, else the public
  names the object defines itself (autodoc's default)."""
  if listed:
    return [m.strip() for m in listed.split(",") if m.strip()]
  if inspect.ismodule(obj):
    names = getattr(obj, "__all__", None)
    if names is None:
      names = [n for n, v in vars(obj).items()
               if getattr(v, "__module__", None) == obj.__name__]
  else:
    names = list(vars(obj))
  return [n for n in names if not n.startswith("_")]


def parse_page(text: str, page: str, module: str | None = None
               ) -> list[Entry]:
  """The entries one page of reStructuredText documents; ``page`` is its
  path under the docs folder without the suffix."""
  lines = text.splitlines()
  folder = page.rpartition("/")[0]
  entries = []
  i = 0
  while i < len(lines):
    match = DIRECTIVE.match(lines[i])
    i += 1
    if not match:
      continue
    indent, directive, argument = len(match[1]), match[2], match[3]
    options, body = {}, []
    while i < len(lines):
      line = lines[i]
      if line.strip() and len(line) - len(line.lstrip()) <= indent:
        break
      option = OPTION.match(line)
      if option and not body:
        options[option[1]] = option[2]
      elif line.strip():
        body.append(line.strip())
      i += 1
    if directive in ("currentmodule", "module", "automodule"):
      module = None if argument in ("None", "") else argument
      if directive != "currentmodule" and module:
        entries.append(Entry(module, "module", f"{page}.html#module-$"))
        if directive == "automodule" and "members" in options:
          entries += members(module, options["members"], page)
      continue
    if directive == "autosummary":
      toctree = options.get("toctree")
      for item in body:
        if item.startswith((":", "..")):
          continue
        name = full_name(item.split()[0].lstrip("~"), module)
        if toctree:
          where = "/".join(p for p in (folder, toctree.strip("/")) if p)
          entries.append(Entry(name, role_of_name(name),
                               f"{where}/{name}.html#$"))
      continue
    if directive == "flax_module":
      directive = "class"
      argument = f"{options.get('module', module)}.{options.get('class')}"
      module = options.get("module", module)
    if directive in DIRECT and argument:
      name = full_name(argument.split("(")[0].strip(), module)
      entries.append(Entry(name, DIRECT[directive], f"{page}.html#$"))
      if directive == "autoclass" and "members" in options:
        entries += members(name, options["members"], page)
  return entries


def full_name(name: str, module: str | None) -> str:
  root = (module or "").split(".")[0]
  if not module or (root and name.split(".")[0] == root):
    return name
  return f"{module}.{name}"


def members(owner: str, listed: str, page: str) -> list[Entry]:
  obj = resolve(owner)
  if obj is None:
    return []
  out = []
  for m in public_members(obj, listed):
    value = getattr(obj, m, None)
    if value is None:
      continue
    in_class = obj if inspect.isclass(obj) else None
    out.append(Entry(f"{owner}.{m}", role_of(value, in_class, m),
                     f"{page}.html#$"))
  return out


def project_entries(project: Project, source: pathlib.Path) -> list[Entry]:
  root = source / project.docs
  entries = []
  for path in sorted(root.rglob("*.rst")):
    if "_templates" in path.parts or "_build" in path.parts:
      continue
    page = path.relative_to(root).with_suffix("").as_posix()
    entries += parse_page(path.read_text(errors="replace"), page)
  return with_aliases(entries, project.packages)


def with_aliases(entries: list[Entry], packages: tuple) -> list[Entry]:
  """The first entry of each (name, role) (a type alias's also as a
  ``py:type``, which ``:class:`` references in signatures resolve to); and
  each resolvable name again under the path its object reports, where
  that differs and lies in ``packages``: the shortest name of an object
  documented under several (``jax.Array``, not ``jax.numpy.ndarray``)."""
  out, seen = [], {}
  def add(entry):
    key = (entry.name, entry.role)
    if key not in seen:
      seen[key] = len(out)
      out.append(entry)
    elif entry.role == "module" and module_page(entry) > module_page(
        out[seen[key]]):
      out[seen[key]] = entry
  for entry in entries:
    if not re.search(r"\s", entry.name):
      add(entry)
      if entry.role == "data" and is_type_alias(resolve(entry.name)):
        add(Entry(entry.name, "type", entry.uri, entry.priority))
  names = {e.name for e in out}
  aliases = {}
  for entry in sorted(out, key=lambda e: (e.name.count("."), len(e.name),
                                          e.name)):
    alias = reported_path(entry.name)
    if (alias and alias not in names and alias.split(".")[0] in packages
        and (alias, entry.role) not in aliases):
      uri = entry.uri.replace("$", entry.name)
      aliases[alias, entry.role] = Entry(alias, entry.role, uri, priority=-1)
  for entry in aliases.values():
    add(entry)
  for entry in reexports(out, packages) + alias_parts(out, packages):
    add(entry)
  return out


def alias_parts(entries: list[Entry], packages: tuple) -> list[Entry]:
  """The classes of ``packages`` a documented type alias is a union of
  where the docs describe them nowhere else (``jax._src.typing.
  SupportsDType``, a part of ``jax.typing.DTypeLike``): on the alias's
  page. Autodoc writes the union out in signatures."""
  names = {e.name for e in entries}
  out = []
  for entry in entries:
    obj = resolve(entry.name) if entry.role == "type" else None
    for part in typing.get_args(obj) if obj is not None else ():
      path = (f"{part.__module__}.{part.__qualname__}"
              if inspect.isclass(part) else None)
      if path and path.split(".")[0] in packages and path not in names:
        names.add(path)
        out.append(Entry(path, "class", entry.uri.replace("$", entry.name),
                         priority=-1))
  return out


def reexports(entries: list[Entry], packages: tuple) -> list[Entry]:
  """The names that ``packages`` and their documented modules give classes
  and functions the docs describe under another path
  (``optax.inject_hyperparams`` on the page of
  ``optax.schedules.inject_hyperparams``, ``flax.nnx.Optimizer`` on
  ``flax.nnx.optimizer.Optimizer``'s)."""
  documented = {}
  for entry in entries:
    obj = resolve(entry.name) if entry.priority == 1 else None
    if inspect.isclass(obj) or inspect.isfunction(obj):
      documented.setdefault(id(obj), entry)
  names = {e.name for e in entries}
  out = []
  modules = sorted({e.name for e in entries if e.role == "module"
                    and e.name.split(".")[0] in packages} | set(packages))
  for package in modules:
    module = resolve(package)
    if not inspect.ismodule(module):
      continue
    for name, obj in sorted(vars(module).items()):
      entry = documented.get(id(obj))
      full = f"{package}.{name}"
      if entry and not name.startswith("_") and full not in names:
        out.append(Entry(full, entry.role, entry.uri.replace("$", entry.name),
                         priority=-1))
  return out


def module_page(entry: Entry) -> int:
  """How well a module's entry's page fits it: 2 the module's own page
  (``jax.sharding.html``), 1 its folder's index, 0 another page that runs
  ``automodule`` (flax's every ``flax.nnx`` page)."""
  page = entry.uri.partition(".html")[0]
  if page == entry.name or page.endswith("/" + entry.name):
    return 2
  return 1 if page.endswith(f"{entry.name}/index") else 0


def reported_path(name: str) -> str | None:
  """``__module__.__qualname__`` of the class or function ``name`` names
  (of its class, then the member, for a member)."""
  owner, _, member = name.rpartition(".")
  obj = resolve(name)
  if obj is None or not (inspect.isclass(obj) or inspect.isfunction(obj)):
    parent = resolve(owner) if owner else None
    if not inspect.isclass(parent):
      return None
    base = reported_path(owner)
    return f"{base}.{member}" if base else None
  module = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not isinstance(module, str) or not isinstance(qualname, str):
    return None
  if "<" in qualname:
    return None
  path = f"{module}.{qualname}"
  return None if path == name else path


def python_entries() -> list[Entry]:
  entries = []
  for module_name in STDLIB:
    module = importlib.import_module(module_name)
    page = f"library/{module_name}"
    entries.append(Entry(module_name, "module", f"{page}.html#module-$"))
    for name in public_members(module, ""):
      obj = getattr(module, name, None)
      if obj is None or inspect.ismodule(obj):
        continue
      entries.append(Entry(f"{module_name}.{name}", role_of(obj),
                           f"{page}.html#$"))
  return with_aliases(entries, STDLIB)


def write(path: pathlib.Path, project: str, version: str,
          entries: list[Entry]) -> None:
  """Sphinx's inventory format, version 2."""
  header = ("# Sphinx inventory version 2\n"
            f"# Project: {project}\n"
            f"# Version: {version}\n"
            "# The remainder of this file is compressed using zlib.\n")
  body = "".join(f"{e.name} py:{e.role} {e.priority} {e.uri} -\n"
                 for e in sorted(entries, key=lambda e: (e.name, e.role)))
  path.write_bytes(header.encode() + zlib.compress(body.encode(), 9))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--src", action="append", default=[],
                      metavar="PROJECT=CHECKOUT",
                      help=f"one of {', '.join(PROJECTS)}: a checkout of "
                      "its repository")
  parser.add_argument("--out", type=pathlib.Path, default=HERE)
  args = parser.parse_args(argv)
  for item in args.src:
    name, _, checkout = item.partition("=")
    if name not in PROJECTS:
      parser.error(f"unknown project {name!r}")
    entries = project_entries(PROJECTS[name], pathlib.Path(checkout))
    write(args.out / f"{name}.inv", name, PROJECTS[name].version, entries)
    print(f"{name}: {len(entries)} names", file=sys.stderr)
  entries = python_entries()
  write(args.out / "python.inv", "Python",
        f"{sys.version_info[0]}.{sys.version_info[1]}", entries)
  print(f"python: {len(entries)} names", file=sys.stderr)


if __name__ == "__main__":
  main()
