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
    ("api/parallel.html", "dlion_jax.parallel.make_train_step"),
    ("api/parallel.html", "dlion_jax.parallel.make_pmap_train_step"),
    ("api/parallel.html", "dlion_jax.parallel.init_worker_states"),
    ("api/parallel.html", "dlion_jax.parallel.shard_batch"),
    ("api/parallel.html", "dlion_jax.parallel.hybrid_mesh"),
    ("api/parallel.html", "dlion_jax.parallel.limit_in_flight"),
    ("api/accounting.html", "dlion_jax.hlo.collective_bytes_by_axis"),
    ("api/accounting.html", "dlion_jax.accounting.wire_bits"),
    ("api/elastic.html", "dlion_jax.elastic.resize_worker_states"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  for module in ("sphinx", "myst_parser", "furo"):
    pytest.importorskip(module)
  out = tmp_path_factory.mktemp("html")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", str(DOCS), str(out)], capture_output=True, text=True,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return out


@pytest.mark.integration
@pytest.mark.parametrize("page,anchor", ENTRIES, ids=[a for _, a in ENTRIES])
def test_the_api_reference_has_an_entry_for(site, page, anchor):
  assert f'id="{anchor}"' in (site / page).read_text()


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
  assert len(guides) == 8 and guides <= set(links)


PUBLIC_MODULES = ["dlion_jax", "dlion_jax.parallel", "dlion_jax.devices",
                  "dlion_jax.sync", "dlion_jax.quantize", "dlion_jax.hlo",
                  "dlion_jax.accounting", "dlion_jax.elastic",
                  "dlion_jax.transforms"]


def _public(module_name):
  import importlib   # pylint: disable=g-import-not-at-top
  import inspect     # pylint: disable=g-import-not-at-top
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None) or [
      n for n, v in vars(module).items() if not n.startswith("_")
      and (inspect.isfunction(v) or inspect.isclass(v))
      and v.__module__ == module_name]
  return {n: getattr(module, n) for n in names
          if not inspect.ismodule(getattr(module, n))}


def _resolve(dotted):
  import importlib   # pylint: disable=g-import-not-at-top
  module, _, name = dotted.rpartition(".")
  try:
    return getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError):
    return None


@pytest.mark.integration
@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_an_entry(site, module):
  """Each public function or class, under some path it is importable by
  (``dl.parallel.shard_batch`` documents ``dl.devices.shard_batch``)."""
  ids = set(re.findall(r'id="(dlion_jax\.[\w.]+)"', "".join(
      p.read_text() for p in site.rglob("*.html"))))
  documented = {id(_resolve(i)) for i in ids}
  missing = [n for n, obj in _public(module).items()
             if f"{module}.{n}" not in ids and id(obj) not in documented]
  assert not missing, missing
