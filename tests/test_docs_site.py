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
