"""The Sphinx site builds with no warning and documents the public API.

The build needs the ``[docs]`` extra (sphinx, myst-parser, furo); its tests
skip without it.
"""

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
# (page, anchor): the names a new user looks up first.
ENTRIES = [
    ("api/optimizers.html", "dlion_jax.distributed_lion"),
    ("api/optimizers.html", "dlion_jax.scale_by_distributed_lion"),
    ("api/optimizers.html", "dlion_jax.apply_if_finite"),
    ("api/rounds.html", "dlion_jax.local_steps"),
    ("api/rounds.html", "dlion_jax.rounds.nesterov_outer"),
    ("api/workers.html", "dlion_jax.workers.value_and_grad"),
    ("api/workers.html", "dlion_jax.workers.update"),
    ("api/parallel.html", "dlion_jax.parallel.make_train_step"),
    ("api/parallel.html", "dlion_jax.parallel.make_pmap_train_step"),
    ("api/parallel.html", "dlion_jax.parallel.init_worker_states"),
    ("api/parallel.html", "dlion_jax.devices.shard_batch"),
    ("api/parallel.html", "dlion_jax.devices.hybrid_mesh"),
    ("api/parallel.html", "dlion_jax.parallel.limit_in_flight"),
    ("api/processes.html", "dlion_jax.processes.start_processes"),
    ("api/accounting.html", "dlion_jax.hlo.collective_bytes_by_axis"),
    ("api/accounting.html", "dlion_jax.accounting.wire_bits"),
    ("api/elastic.html", "dlion_jax.elastic.resize_worker_states"),
    ("api/lioncub.html", "dlion_jax.sync.growing_intervals"),
]
# (page, link): names of jax, optax, flax and numpy the API pages use,
# linked through the inventories of docs/inventories/ (intersphinx).
LINKS = [
    ("api/optimizers.html", "https://optax.readthedocs.io/en/latest/api/"
     "generated/optax.lion.html#optax.lion"),
    ("api/optimizers.html", "https://optax.readthedocs.io/en/latest/api/"
     "generated/optax.GradientTransformation.html"
     "#optax.GradientTransformation"),
    ("api/parallel.html", "https://docs.jax.dev/en/latest/_autosummary/"
     "jax.shard_map.html#jax.shard_map"),
    ("api/parallel.html", "https://docs.jax.dev/en/latest/jax.sharding.html"
     "#jax.sharding.Mesh"),
    ("api/parallel.html", "https://flax.readthedocs.io/en/latest/"
     "api_reference/flax.nnx/training/optimizer.html"
     "#flax.nnx.optimizer.Optimizer"),
    ("api/lioncub.html", "https://docs.jax.dev/en/latest/_autosummary/"
     "jax.Array.html#jax.Array"),
    ("api/optimizers.html", "https://numpy.org/doc/stable/reference/"
     "generated/numpy.ndarray.html#numpy.ndarray"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  for module in ("sphinx", "myst_parser", "furo"):
    pytest.importorskip(module)
  out = tmp_path_factory.mktemp("html")
  # -n: every cross reference resolves (to this site, or to jax, optax,
  # flax, numpy, Python through the inventories kept in docs/inventories).
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q",
       "-b", "html", str(DOCS), str(out)], capture_output=True, text=True,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return out


@pytest.mark.integration
@pytest.mark.parametrize("page,anchor", ENTRIES, ids=[a for _, a in ENTRIES])
def test_the_api_reference_has_an_entry_for(site, page, anchor):
  assert f'id="{anchor}"' in (site / page).read_text()


@pytest.mark.integration
@pytest.mark.parametrize("page,link", LINKS,
                         ids=[u.rpartition("#")[2] for _, u in LINKS])
def test_the_api_reference_links_the_libraries_it_names(site, page, link):
  assert f'href="{link}"' in (site / page).read_text()


@pytest.mark.integration
def test_no_api_page_has_a_role_it_does_not_link(site):
  """A ``:func:`` (``:class:``, ...) role Sphinx cannot resolve renders as
  code outside a link (and fails the nitpicky build)."""
  for page in (site / "api").glob("*.html"):
    text = page.read_text()
    unlinked = [text[m.end():m.end() + 80]
                for m in re.finditer(r'<code class="xref py', text)
                if not text[text.rfind("<", 0, m.start()):].startswith("<a ")]
    assert not unlinked, (page.name, unlinked)


def _load(path, name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module     # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def _conf():
  return _load(DOCS / "conf.py", "docs_conf")


def test_the_build_is_nitpicky_and_reads_inventories_kept_in_the_repo():
  """No inventory is fetched at build time: each is a file of the repo, in
  Sphinx's format, with the names the API pages link."""
  pytest.importorskip("sphinx")
  import posixpath  # pylint: disable=g-import-not-at-top
  from sphinx.util.inventory import InventoryFile  # pylint: disable=g-import-not-at-top
  conf = _conf()
  assert conf.nitpicky
  assert "sphinx.ext.intersphinx" in conf.extensions
  assert set(conf.intersphinx_mapping) == {"python", "numpy", "jax", "optax",
                                           "flax"}
  want = {"jax": "jax.Array", "optax": "optax.GradientTransformation",
          "flax": "flax.nnx.Module", "numpy": "numpy.ndarray",
          "python": "collections.abc.Callable"}
  for name, (url, inventory) in conf.intersphinx_mapping.items():
    path = pathlib.Path(inventory)
    assert path.is_file() and path.parent == DOCS / "inventories", name
    with path.open("rb") as f:
      inv = InventoryFile.load(f, url, posixpath.join)
    found = {n: getattr(item, "uri", None) or item[2]
             for items in getattr(inv, "data", inv).values()
             for n, item in items.items()}
    assert want[name] in found, name
    assert all(uri.startswith(url) for uri in found.values()), name


def test_the_inventory_script_follows_each_sites_page_layout():
  """docs/inventories/make.py: an autosummary with a toctree gets a page a
  name (jax's _autosummary/, optax's api/generated/), autoclass and
  flax_module the page they stand on; the path an object reports (what
  autodoc writes in signatures) and a package's re-export link the same."""
  pytest.importorskip("optax")
  make = _load(DOCS / "inventories" / "make.py", "make_inventories")
  page = make.parse_page(
      ".. currentmodule:: optax\n\n.. autosummary::\n    :toctree: "
      "generated/\n\n    lion\n    GradientTransformation\n\n"
      ".. currentmodule:: optax.schedules\n\n.. autosummary::\n"
      "    :toctree: generated/\n\n    inject_hyperparams\n\n"
      ".. autoclass:: optax.MultiSteps\n\n"
      ".. flax_module::\n  :module: flax.nnx\n  :class: Linear\n",
      "api/optimizers")
  entries = {(e.name, e.role): e.uri for e in make.with_aliases(
      page, ("optax",))}
  assert entries["optax.lion", "function"] == (
      "api/generated/optax.lion.html#$")
  assert entries["optax.GradientTransformation", "class"] == (
      "api/generated/optax.GradientTransformation.html#$")
  assert entries["optax._src.base.GradientTransformation", "class"] == (
      "api/generated/optax.GradientTransformation.html"
      "#optax.GradientTransformation")
  assert entries["optax.inject_hyperparams", "function"] == (
      "api/generated/optax.schedules.inject_hyperparams.html"
      "#optax.schedules.inject_hyperparams")
  assert entries["optax.MultiSteps", "class"] == "api/optimizers.html#$"
  assert entries["flax.nnx.Linear", "class"] == "api/optimizers.html#$"


@pytest.mark.integration
def test_every_page_of_docs_is_in_the_site(site):
  """No Markdown page of docs/ is left out of the toctrees (Sphinx warns
  only for pages it reads, so check the HTML exists)."""
  pages = [p.relative_to(DOCS).with_suffix(".html")
           for p in DOCS.rglob("*.md") if "_build" not in p.parts]
  assert pages
  missing = [str(p) for p in pages if not (site / p).exists()]
  assert not missing


def test_the_readme_links_every_guide_and_only_files_that_exist():
  root = DOCS.parent
  links = re.findall(r"\]\(([^)#:]+)\)", (root / "README.md").read_text())
  assert not [link for link in links if not (root / link).exists()]
  guides = {f"docs/guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}
  assert len(guides) == 9 and guides <= set(links)


def test_the_readme_gives_the_quickstart_figure_as_one_machines():
  """The quickstart's accuracy depends on the CPU and the XLA build: the
  paragraph after the output names the machine that printed it (its
  ``lscpu`` model name, the jax version) and claims no figure for an
  ``--xla_cpu_max_isa`` flag, which one machine could refute."""
  text = (DOCS.parent / "README.md").read_text()
  block = text[text.index("What a newcomer sees"):]
  accuracy = re.search(r"test accuracy (\d\.\d+)", block)[1]
  paragraph = block[block.index("```\n\n") + 5:].split("\n\n")[0]
  assert accuracy in paragraph
  assert "`lscpu` model name `" in paragraph
  assert "instruction set" in paragraph and "XLA" in paragraph
  assert re.search(r"jax(lib)?\b[^.]*?\d+\.\d+\.\d+", paragraph)
  for sentence in re.split(r"(?<=\.)\s", paragraph):
    if "max_isa" in sentence:
      assert not re.search(r"\b0\.\d{3,}", sentence), sentence


# The public modules of the library (the command-line packages train and
# bench aside): what the API reference documents, and all it documents.
PUBLIC_MODULES = ["dlion_jax", "dlion_jax.accounting", "dlion_jax.devices",
                  "dlion_jax.elastic", "dlion_jax.hlo", "dlion_jax.lion",
                  "dlion_jax.parallel", "dlion_jax.processes",
                  "dlion_jax.rounds", "dlion_jax.sync",
                  "dlion_jax.transforms", "dlion_jax.workers",
                  "dlion_jax.launch"]


def public_names() -> dict[int, str]:
  """Every public function, class and constant of the public modules, by
  object (a name re-exported at the top, ``dl.distributed_lion``, is one
  name): one dotted path for each."""
  import importlib   # pylint: disable=g-import-not-at-top
  import types       # pylint: disable=g-import-not-at-top
  out = {}
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name, value in vars(module).items():
      if name.startswith("_") or isinstance(value, types.ModuleType):
        continue
      home = getattr(value, "__module__", module_name) or module_name
      if not home.startswith("dlion_jax") or name == "annotations":
        continue
      key = id(value) if callable(value) else (module_name, name)
      out.setdefault(key, f"{module_name}.{name}")
  return out


def test_the_public_surface_is_at_most_80_names():
  names = sorted(public_names().values())
  assert 40 <= len(names) <= 80, (len(names), names)


def _resolve(dotted):
  import importlib   # pylint: disable=g-import-not-at-top
  module, _, name = dotted.rpartition(".")
  try:
    return getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError):
    return None


@pytest.mark.integration
def test_the_api_reference_documents_exactly_the_public_names(site):
  """Every public function and class has an entry under some path it is
  importable by (``dl.devices.shard_batch`` under
  ``dlion_jax.devices.shard_batch``), and no entry documents a name of a
  private module."""
  ids = set(re.findall(r'id="(dlion_jax\.[\w.]+)"', "".join(
      p.read_text() for p in (site / "api").glob("*.html"))))
  ids = {i for i in ids if not i.startswith("dlion_jax.train")
         and not i.startswith("dlion_jax.bench")}
  documented = {id(_resolve(i)) for i in ids}
  import inspect   # pylint: disable=g-import-not-at-top
  missing = [path for key, path in public_names().items()
             if isinstance(key, int) and (inspect.isfunction(_resolve(path))
                                          or inspect.isclass(_resolve(path)))
             and path not in ids and key not in documented]
  assert not missing, missing
  private = [i for i in ids if any(
      part.startswith("_") and not part.startswith("__")
      for part in i.split("."))]
  assert not private, private
