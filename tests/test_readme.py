"""The README's example runs as written and trains."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
