"""Starts ``n`` local processes of a multi-process JAX command.

Every process gets the environment that :func:`jax.distributed.initialize`
and ``python -m dlion_jax.train`` read::

  JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT   # process 0 serves it
  JAX_NUM_PROCESSES=n
  JAX_PROCESS_ID=i                         # 0 .. n-1

Each line a process prints is prefixed with ``[i]`` and a space (stdout to
stdout, stderr to stderr). If any process exits with a non-zero code, the
launcher stops the others at once (their collectives would otherwise wait
for the missing process until jax's own timeouts) and exits with that code,
naming the process. Ctrl-C and SIGTERM are forwarded to every process (the train
CLI then checkpoints the step its processes agree on and says how to
resume).

Usage::

  python -m dlion_jax.launch -n 2 -- python -m dlion_jax.train \\
      --set workers=2 --set run_dir=runs/quickstart-2proc
  python -m dlion_jax.launch -n 4 --port 12345 --timeout 600 -- python my.py

Options:
  -n, --num-processes N  how many processes (required).
  --port PORT            the coordinator's port on 127.0.0.1 (default: a
                         free one).
  --timeout S            stop every process and exit 124 if the command has
                         not finished after S seconds (default: no limit).

Everything after ``--`` is the command, run as is (no shell) in every
process. Exit status: 0 when every process exits 0; the first failing
process's code (128 + signal if it was killed by a signal); 124 on timeout;
130 on Ctrl-C (143 on SIGTERM, also forwarded); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Sequence

from dlion_jax import _deprecations
from dlion_jax import _platforms

# Old paths (dlion_jax._deprecations.MOVED).
__getattr__ = _deprecations.old_paths(__name__)

_HOST = "127.0.0.1"
_GRACE_S = 5.0       # after SIGTERM / SIGINT, before SIGKILL
_POLL_S = 0.05


def _free_port(host: str = _HOST) -> int:
  """A TCP port nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


_PROG = "python -m dlion_jax.launch"
# --help's text: the module docstring's, without its reStructuredText.
_DESCRIPTION = """\
Starts N local processes of a multi-process JAX command (everything after
--, run as is, without a shell). Each gets the environment that
jax.distributed.initialize and python -m dlion_jax.train read:
  JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT   (process 0 serves it)
  JAX_NUM_PROCESSES=N
  JAX_PROCESS_ID=i                         (0 .. N-1)
Each line a process prints is prefixed with [i]. If one process fails, the
others are stopped at once."""
_EPILOG = f"""\
exit status: 0 when every process exits 0; the first failing process's code
(128 + the signal's number if a signal killed it); 124 after --timeout; 130
on Ctrl-C and 143 on SIGTERM, both forwarded to every process (SIGKILL
{_GRACE_S:g} s later); 2 for a usage error.

examples:
  {_PROG} -n 2 -- python -m dlion_jax.train \\
      --set workers=2 --set run_dir=runs/quickstart-2proc
  {_PROG} -n 4 --port 12345 --timeout 600 -- python my.py"""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=_PROG,
      usage="%(prog)s -n N [--port PORT] [--timeout S] -- COMMAND [ARG ...]",
      description=_DESCRIPTION,
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      metavar="N", help="how many processes to start")
  parser.add_argument("--port", type=int,
                      help=f"coordinator port on {_HOST} (default: a free one)")
  parser.add_argument("--timeout", type=float, metavar="S",
                      help="stop everything and exit 124 after S seconds")
  return parser


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """Splits ``argv`` at the first ``--``: launcher options, then command."""
  parser = _parser()
  argv = list(argv)
  if "--" not in argv:
    if any(a in ("-h", "--help") for a in argv):
      parser.parse_args(argv)             # prints help, exits 0
    parser.error("missing '--' before the command, e.g. "
                 "python -m dlion_jax.launch -n 2 -- python -m "
                 "dlion_jax.train")
  cut = argv.index("--")
  args = parser.parse_args(argv[:cut])
  command = argv[cut + 1:]
  if not command:
    parser.error("no command after '--'.")
  if args.num_processes < 1:
    parser.error(f"-n {args.num_processes}: need at least 1 process.")
  if args.port is not None and not 0 < args.port < 65536:
    parser.error(f"--port {args.port}: must be in 1..65535.")
  if args.timeout is not None and not args.timeout > 0:
    parser.error(f"--timeout {args.timeout:g}: must be positive.")
  return args, command


class _Printer:
  """Copies a child's stream to ours, ``[i] `` before every line."""

  def __init__(self):
    self._lock = threading.Lock()

  def pump(self, source: IO[bytes], sink: IO[str], prefix: bytes) -> None:
    out = getattr(sink, "buffer", None)
    pending = b""
    while True:
      chunk = source.read1(65536) if hasattr(source, "read1") else (
          source.read(65536))
      if not chunk:
        break
      pending += chunk
      # Progress bars redraw with \r: pass those through as line ends too.
      lines = pending.replace(b"\r", b"\r\0").replace(b"\n", b"\n\0").split(
          b"\0")
      pending = lines.pop()
      self._write(sink, out, b"".join(prefix + line for line in lines))
    if pending:
      self._write(sink, out, prefix + pending + b"\n")
    source.close()

  def _write(self, sink, out, data: bytes) -> None:
    if not data:
      return
    with self._lock:
      try:
        if out is not None:
          sink.flush()
          out.write(data)
          out.flush()
        else:
          sink.write(data.decode(errors="replace"))
          sink.flush()
      except (OSError, ValueError):
        pass                              # our own output went away


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _stop(procs: list[subprocess.Popen], sig: int = signal.SIGTERM,
          grace: float = _GRACE_S) -> None:
  """Sends ``sig`` to every running process group, SIGKILL after ``grace``."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    _signal_group(p, sig)
  deadline = time.monotonic() + grace
  for p in running:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.poll() is None:
      _signal_group(p, signal.SIGKILL)
  for p in procs:
    p.wait()


def _describe(code: int) -> str:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"was killed by {name}"
  return f"exited with code {code}"


def launch(num_processes: int, command: Sequence[str], *,
           port: int | None = None, timeout: float | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None
           ) -> int:
  """Runs ``command`` in ``num_processes`` local processes; see the module.

  Returns:
    The exit status the launcher exits with.
  """
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr
  port = _free_port() if port is None else port
  address = f"{_HOST}:{port}"

  def note(text: str) -> None:
    print(f"launch: {text}", file=stderr, flush=True)

  printer = _Printer()
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  received: list[int] = []

  def on_signal(signum, frame):  # pylint: disable=unused-argument
    received.append(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous[sig] = signal.signal(sig, on_signal)
  try:
    for i in range(num_processes):
      env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address,
                 JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i))
      env.setdefault("PYTHONUNBUFFERED", "1")   # lines as they come
      try:
        # Own process group: we deliver signals (and kill whole trees).
        proc = subprocess.Popen(
            list(command), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
      except OSError as e:
        note(f"cannot start {command[0]!r}: {e}")
        _stop(procs)
        return 127 if isinstance(e, FileNotFoundError) else 126
      procs.append(proc)
      prefix = f"[{i}] ".encode()
      for source, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
        t = threading.Thread(target=printer.pump, args=(source, sink, prefix),
                             daemon=True)
        t.start()
        pumps.append(t)

    start = time.monotonic()
    status = None
    while status is None:
      if received:
        sig = received[0]
        note(f"got {signal.Signals(sig).name}: forwarding it to every "
             "process")
        _stop(procs, sig)
        status = 128 + sig                  # 130 for Ctrl-C
        break
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        others = [j for j, c in enumerate(codes) if c is None]
        note(f"process {i} {_describe(code)}"
             + (f"; stopping process{'es' if len(others) > 1 else ''} "
                f"{', '.join(map(str, others))}" if others else ""))
        _stop(procs)
        status = code if code > 0 else 128 - code
      elif all(c == 0 for c in codes):
        status = 0
      elif timeout is not None and time.monotonic() - start > timeout:
        note(f"timed out after {timeout:g} s; stopping every process")
        _stop(procs)
        status = 124
      else:
        time.sleep(_POLL_S)
    for t in pumps:
      t.join(timeout=2.0)
    return status
  finally:
    if procs:
      _stop(procs, grace=1.0)
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m dlion_jax.launch``: :func:`launch` with the command line's
  options (``argv``, default ``sys.argv[1:]``); returns its exit code."""
  args, command = _parse_args(sys.argv[1:] if argv is None else argv)
  _platforms.quiet_tpu_probe()       # the processes inherit the choice
  return launch(args.num_processes, command, port=args.port,
                timeout=args.timeout)


if __name__ == "__main__":
  sys.exit(main())
