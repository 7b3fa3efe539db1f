"""The README's example runs as written and trains; its commands work as a
reader runs them, one after the other."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "dlion_jax"


def test_readme_example_runs(tmp_path):
  readme = (ROOT / "README.md").read_text()
  code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  script = tmp_path / "example.py"
  script.write_text(code)
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300, check=True).stdout
  loss = float(re.search(r"loss (\S+);", out).group(1))
  assert loss < 1.0, out           # starts near 340
  bits = float(re.search(r"sent (\S+) bits/param/step", out).group(1))
  assert 2.2 < bits < 3.0, out     # votes (+ padding and the loss mean)
  # The README explains the figure it prints beside the example.
  assert f"sent {bits:.2f} bits/param/step" in readme.replace("\n", " ")


def test_readme_example_runs_with_a_schedule(tmp_path):
  """Was: JAX's "out_specs ... could not infer replication" (the Example's
  shard_map checks replication, and a schedule read the per-worker count)."""
  code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                   re.S).group(1)
  lr = "optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 300)"
  scheduled = code.replace("dl.distributed_lion(1e-2,",
                           f"dl.distributed_lion({lr},")
  assert scheduled != code
  script = tmp_path / "example.py"
  script.write_text(scheduled)
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert float(re.search(r"loss (\S+);", out.stdout).group(1)) < 5.0


def test_readme_example_runs_with_the_chain_of_pieces(tmp_path):
  """The documented chain of pieces, a schedule read by optax's own
  ``scale_by_learning_rate`` after the vote, in the Example's
  ``shard_map(check_vma=True)`` step. Was: JAX's bare "out_specs ... could
  not infer replication" (the step took its row without typed_alike)."""
  code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                   re.S).group(1)
  pieces = ("optax.chain(optax.clip_by_global_norm(1.0), "
            "dl.scale_by_distributed_lion(axis_name='data'), "
            "optax.add_decayed_weights(1e-2), optax.scale_by_learning_rate("
            "optax.warmup_cosine_decay_schedule(0.0, 1e-2, 30, 300)))\n")
  start = code.index("tx = optax.chain(")
  end = code.index("\n\n", start) + 1
  script = tmp_path / "example.py"
  script.write_text(code[:start] + "tx = " + pieces + code[end:])
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert float(re.search(r"loss (\S+);", out.stdout).group(1)) < 5.0


def _run_after_the_example(tmp_path, block: str, check: str) -> str:
  """The stdout of the README's Example, then ``block``, then ``check``,
  run as one script (which must exit 0)."""
  example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S).group(1)
  script = tmp_path / "after_example.py"
  script.write_text(example + "\n" + block + check)
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout


def test_readme_plain_step_runs_after_the_example(tmp_path):
  """The README's plain jitted step (dl.workers), run from the Example's
  params on: it trains on, and sends what the Example's step sends."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
  plain = blocks[1]
  assert "dl.workers.update(tx)" in plain
  check = (
      "\nprint(f'plain loss {float(loss):.4f}')\n"
      "with jax.set_mesh(mesh):\n"
      "  plain_sent = dl.collective_bytes(\n"
      "      plain_step.lower(params, state, x, y).compile())\n"
      "print(f'plain sent {plain_sent:.0f}')\n")
  out = _run_after_the_example(tmp_path, plain, check)
  assert float(re.search(r"plain loss (\S+)", out).group(1)) < 1.0
  first = float(re.search(r"sent (\S+) bits/param/step", out).group(1))
  plain_sent = float(re.search(r"plain sent (\S+)", out).group(1))
  # The votes' bytes, and each step's mean of its 8 losses (7 bytes by a
  # pmean, 28 by the plain step's gather): within 0.25 bits/param.
  assert abs(8 * plain_sent / 1024 - first) < 0.25, out


def _clone_folder(readme: str) -> str:
  """The folder the README's ``git clone ... && cd ...`` line creates."""
  line = re.search(r"^git clone .*$", readme, re.M).group(0)
  clone, _, cd = line.partition("&&")
  folder = shlex.split(clone)[-1]
  # Without a folder argument git names it after the repository: dlion_jax.
  assert not re.search(r"[/:>]", folder), f"name the folder in {line!r}"
  assert shlex.split(cd) == ["cd", folder], line
  return folder


def test_clone_folder_does_not_shadow_the_package(tmp_path):
  """A folder named like the package, in the directory a script runs from,
  is imported as an empty namespace package instead of the installed one."""
  folder = _clone_folder((ROOT / "README.md").read_text())
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

  def probe(parent):
    return subprocess.run(
        [sys.executable, "-c",
         f"import {PACKAGE}; print({PACKAGE}.distributed_lion.__name__)"],
        cwd=parent, capture_output=True, text=True, timeout=120, env=env)
  (tmp_path / "empty").mkdir()
  if "ModuleNotFoundError" in probe(tmp_path / "empty").stderr:
    pytest.skip(f"{PACKAGE} is not installed (pip install -e .)")
  (tmp_path / folder / PACKAGE).mkdir(parents=True)    # the clone's layout
  ran = probe(tmp_path)
  assert ran.returncode == 0, ran.stderr
  # The probe does detect shadowing: next to a folder named like the package.
  (tmp_path / "shadow" / PACKAGE / PACKAGE).mkdir(parents=True)
  shadowed = probe(tmp_path / "shadow")
  assert shadowed.returncode != 0 and "AttributeError" in shadowed.stderr


def _train_commands(text: str) -> list[list[str]]:
  """The ``python -m dlion_jax.train`` commands of a doc's bash blocks, as
  arguments after ``dlion_jax.train``."""
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for line in block.splitlines():
      line = line.split("#", 1)[0]
      if "-m dlion_jax.train" in line and "--help" not in line:
        commands.append(shlex.split(line.split("-m dlion_jax.train", 1)[1]))
  return commands


def _run_dir(args: list[str]) -> str:
  sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
  dirs = [s.split("=", 1)[1] for s in sets if s.startswith("run_dir=")]
  if dirs:
    return dirs[-1]
  config = args[args.index("--config") + 1] if "--config" in args else (
      "quickstart")
  return f"runs/{config}"


def test_doc_commands_run_in_order_never_reuse_a_run_dir():
  """A reader running the README's (or docs/training.md's) commands one
  after the other: each new run has its own run_dir (a run refuses one
  that holds another), unless it continues or overwrites it."""
  for doc in (ROOT / "README.md", ROOT / "docs" / "training.md"):
    commands = _train_commands(doc.read_text())
    assert commands, doc
    fresh = [_run_dir(c) for c in commands
             if "--resume" not in c and "--overwrite" not in c]
    assert len(fresh) == len(set(fresh)), (doc.name, fresh)


def test_readme_local_steps_run_after_the_example(tmp_path):
  """The README's local steps, run from the Example's params on: they
  train on, the workers end on one model, and a step sends the vote over
  a round of 32."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
  local = next(b for b in blocks if "dl.local_steps" in b)
  check = (
      "\nimport numpy as np\n"
      "rows = np.asarray(model['w'])\n"
      "assert (rows == rows[0]).all()\n"
      "print(f'local loss {float(loss):.4f}')\n"
      "c = step.lower(params, state, (x, y)).compile()\n"
      "always = dl.collective_bytes(c, conditional=False)\n"
      "rounds = always + (dl.collective_bytes(c) - always) / 32\n"
      "print(f'local sent {8 * rounds / 1024:.4f}')\n")
  out = _run_after_the_example(tmp_path, local, check)
  first = float(re.search(r"loss (\S+);", out).group(1))
  assert float(re.search(r"local loss (\S+)", out).group(1)) < first
  sent = float(re.search(r"local sent (\S+)", out).group(1))
  # The padded votes (2.84 bits a parameter) and the leaf's scale,
  # gathered from the 7 other workers for the clip (28 bytes), once in 32
  # steps, and every step the loss's mean (7 bytes: 0.055 bits a
  # parameter of 1,024).
  scales = 8 * 4 * 7 / 1024
  assert sent == pytest.approx((2.84 + scales) / 32 + 0.055, abs=0.005), out
