"""Starts ``n`` local processes of a multi-process JAX command, and with
``--restarts`` starts them again when one dies or hangs.

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

With ``--restarts K`` a process that dies (a non-zero exit or a signal) or
stops responding (no heartbeat for ``--watchdog`` seconds; it is killed)
costs a restart instead of the run: the launcher kills the others at once
(SIGKILL: their collectives wait for the lost process) and starts the
command again on the survivors, one process fewer for each one lost (with
``--replace``, a fresh process takes each lost one's place), up to ``K``
times. Each restart is logged with its cause and the new process count.
The train CLI resumes by itself from the last checkpoint, on the survivors'
workers. An exit with code 2 (a usage or config error, which a restart
would repeat) is not restarted. The processes share jax's persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``, unless set; removed at
the end): a restart on as many processes compiles nothing again.

The restarted processes learn of it from the environment (set with
``--restarts``; :func:`dlion_jax.processes.restart_info` reads it)::

  DLION_LAUNCH_ID=hex                # this launcher's run, alike in every start
  DLION_RESTART=r                    # 0 at the first start, then 1 .. K
  DLION_FIRST_NUM_PROCESSES=n0       # the process count of the first start
  DLION_MIN_PROCESSES=m              # the fewest a restart may leave
  DLION_STARTED_AT=t                 # when the launcher started them (epoch s)

and, with the watchdog on, ``DLION_HEARTBEAT_FILE``: a file that process
touches at least once a second (:func:`dlion_jax.processes.start_processes`
does it from a thread of its own). Only a process that has touched its file
is watched.

Usage::

  python -m dlion_jax.launch -n 2 -- python -m dlion_jax.train \\
      --set workers=2 --set run_dir=runs/quickstart-2proc
  python -m dlion_jax.launch -n 4 --restarts 2 -- python -m dlion_jax.train \\
      --set data.global_batch=240 --set run_dir=runs/quickstart-restarts
  python -m dlion_jax.launch -n 4 --port 12345 --timeout 600 -- python my.py

Options:
  -n, --num-processes N  how many processes (required).
  --port PORT            the coordinator's port on 127.0.0.1 (default: a
                         free one, another at each restart).
  --timeout S            stop every process and exit 124 if the command has
                         not finished after S seconds, restarts included
                         (default: no limit).
  --restarts K           restart the processes up to K times after one dies
                         or hangs (default 0: the first failure ends it).
  --replace              restart on as many processes as before, a fresh one
                         in place of each one lost (default: the survivors).
  --watchdog S           declare a process hung after S seconds without a
                         heartbeat (default 30 with --restarts, else off; 0:
                         off).

Everything after ``--`` is the command, run as is (no shell) in every
process. Exit status: 0 when every process exits 0; the first failing
process's code (128 + signal if it was killed by a signal; 137 for a hung
process, which is killed) once no restart is left; 124 on timeout; 130 on
Ctrl-C (143 on SIGTERM, also forwarded); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
_WATCHDOG_S = 30.0   # --watchdog's default with --restarts
_USAGE_ERROR = 2     # an exit code no restart would change
# The environment a restartable process reads
# (dlion_jax.processes.restart_info; the same names there).
_HEARTBEAT_ENV = "DLION_HEARTBEAT_FILE"
_RESTART_ENV = ("DLION_LAUNCH_ID", "DLION_RESTART",
               "DLION_FIRST_NUM_PROCESSES", "DLION_MIN_PROCESSES",
               "DLION_STARTED_AT")


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
others are stopped at once. With --restarts K, a process that dies or
hangs (no heartbeat for --watchdog seconds) costs a restart instead: the
others are killed and the command starts again on the survivors (with
--replace, on N again), up to K times; the train CLI resumes by itself
from its last checkpoint. An exit with code 2 (a usage or config error) is
not restarted."""
_EPILOG = f"""\
exit status: 0 when every process exits 0; the first failing process's code
(128 + the signal's number if a signal killed it; 137 for a hung process,
killed) once no restart is left; 124 after --timeout; 130 on Ctrl-C and
143 on SIGTERM, both forwarded to every process (SIGKILL {_GRACE_S:g} s
later); 2 for a usage error.

examples:
  {_PROG} -n 2 -- python -m dlion_jax.train \\
      --set workers=2 --set run_dir=runs/quickstart-2proc
  {_PROG} -n 4 --restarts 2 -- python -m dlion_jax.train \\
      --set data.global_batch=240 --set run_dir=runs/quickstart-restarts
  {_PROG} -n 4 --port 12345 --timeout 600 -- python my.py"""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog=_PROG,
      usage="%(prog)s -n N [--port PORT] [--timeout S] [--restarts K "
      "[--replace] [--watchdog S]] -- COMMAND [ARG ...]",
      description=_DESCRIPTION,
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      metavar="N", help="how many processes to start")
  parser.add_argument("--port", type=int,
                      help=f"coordinator port on {_HOST} (default: a free "
                      "one, another at each restart)")
  parser.add_argument("--timeout", type=float, metavar="S",
                      help="stop everything and exit 124 after S seconds, "
                      "restarts included")
  parser.add_argument("--restarts", type=int, default=0, metavar="K",
                      help="restart the processes up to K times after one "
                      "dies or hangs (default 0)")
  parser.add_argument("--replace", action="store_true",
                      help="restart on N processes, a fresh one in place of "
                      "each one lost (default: on the survivors)")
  parser.add_argument("--watchdog", type=float, metavar="S",
                      help="a process without a heartbeat for S seconds is "
                      f"hung (default {_WATCHDOG_S:g} with --restarts, else "
                      "off; 0: off)")
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
  if args.restarts < 0:
    parser.error(f"--restarts {args.restarts}: must be 0 or more (how many "
                 "times to restart after a failure).")
  if args.watchdog is not None and args.watchdog != 0 and not (
      args.watchdog >= 2):
    parser.error(f"--watchdog {args.watchdog:g}: must be 0 (off) or at "
                 "least 2 seconds (a process beats once a second).")
  if args.replace and not args.restarts:
    parser.error("--replace needs --restarts K (it says how a restart "
                 "replaces a lost process).")
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


def _exit_status(code: int) -> int:
  """The launcher's status for a child's return code (negative: a signal)."""
  return code if code > 0 else 128 - code


def _listed(indices: Sequence[int]) -> str:
  return (f"process{'es' if len(indices) > 1 else ''} "
          f"{', '.join(map(str, indices))}")


@dataclasses.dataclass
class _Outcome:
  """How a start of the processes ended.

  ``lost`` are the processes that failed on their own (the first to die,
  or every hung one), ``why`` says how; empty when it did not fail."""
  status: int
  lost: list[int] = dataclasses.field(default_factory=list)
  why: str = ""


class _Group:
  """One start of the command on ``n`` processes."""

  def __init__(self, n: int, command: Sequence[str], *, env: dict,
               printer: _Printer, stdout, stderr, heartbeats: str | None):
    self.procs: list[subprocess.Popen] = []
    self.pumps: list[threading.Thread] = []
    self.beats = [None if heartbeats is None else
                  os.path.join(heartbeats, f"process{i}") for i in range(n)]
    for i in range(n):
      child = dict(env, JAX_PROCESS_ID=str(i))
      if self.beats[i]:
        child[_HEARTBEAT_ENV] = self.beats[i]
      try:
        # Own process group: we deliver signals (and kill whole trees).
        proc = subprocess.Popen(
            list(command), env=child, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
      except OSError:
        _stop(self.procs)
        raise
      self.procs.append(proc)
      prefix = f"[{i}] ".encode()
      for source, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
        t = threading.Thread(target=printer.pump, args=(source, sink, prefix),
                             daemon=True)
        t.start()
        self.pumps.append(t)

  def hung(self, watchdog: float | None) -> list[int]:
    """The running processes whose heartbeat is older than ``watchdog``."""
    if not watchdog:
      return []
    now, found = time.time(), []
    for i, (proc, beat) in enumerate(zip(self.procs, self.beats)):
      try:
        if proc.poll() is None and now - os.stat(beat).st_mtime > watchdog:
          found.append(i)
      except OSError:
        pass                               # not beating (yet): not watched
    return found

  def close(self) -> None:
    for t in self.pumps:
      t.join(timeout=2.0)


def _failure(codes: list[int | None], hung: list[int], watchdog: float | None
             ) -> _Outcome | None:
  """The outcome of the first failure among ``codes`` (return codes, None
  while running) or the ``hung`` processes, or None if none failed."""
  if hung:
    return _Outcome(128 + signal.SIGKILL, hung,
                    f"stopped responding: no heartbeat for {watchdog:g} s")
  failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
  if not failed:
    return None
  # Two seen at once: a signal's death first (the others' errors follow it).
  i, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
  return _Outcome(_exit_status(code), [i], _describe(code))


def _wait(group: _Group, *, received: list[int], deadline: float | None,
          timeout: float | None, watchdog: float | None, restarting: bool,
          note) -> _Outcome:
  """Polls ``group`` until it ends, fails, hangs, times out or a signal
  arrives; stops what still runs."""
  procs = group.procs
  while True:
    if received:
      sig = received[0]
      note(f"got {signal.Signals(sig).name}: forwarding it to every "
           "process")
      _stop(procs, sig)
      return _Outcome(128 + sig)            # 130 for Ctrl-C
    codes = [p.poll() for p in procs]
    failure = _failure(codes, group.hung(watchdog), watchdog)
    if failure:
      _fail(procs, failure, codes, restarting=restarting, note=note)
      return failure
    if all(c == 0 for c in codes):
      return _Outcome(0)
    if deadline is not None and time.monotonic() > deadline:
      note(f"timed out after {timeout:g} s; stopping every process")
      _stop(procs)
      return _Outcome(124)
    time.sleep(_POLL_S)


def _fail(procs: list[subprocess.Popen], failure: _Outcome,
          codes: list[int | None], *, restarting: bool, note) -> None:
  """Says which processes failed and how; kills a hung one, and stops the
  others (at once where a restart follows: they wait on the lost one)."""
  hung = [i for i in failure.lost if codes[i] is None]
  others = [j for j, c in enumerate(codes)
            if c is None and j not in failure.lost]
  verb = "killing" if restarting or hung else "stopping"
  them = [("them" if len(hung) > 1 else "it")] if hung else []
  if others:
    them.append(_listed(others))
  note(f"{_listed(failure.lost)} {failure.why}"
       + (f"; {verb} {' and '.join(them)}" if them else ""))
  for i in hung:
    _signal_group(procs[i], signal.SIGKILL)
  if restarting:
    _stop(procs, signal.SIGKILL, grace=0.0)
  else:
    _stop(procs)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What ``--restarts``, ``--replace`` and ``--watchdog`` ask for."""
  restarts: int = 0
  replace: bool = False
  watchdog: float | None = None

  def next_count(self, n: int, outcome: _Outcome) -> int:
    return n if self.replace else n - len(outcome.lost)


def launch(num_processes: int, command: Sequence[str], *,
           port: int | None = None, timeout: float | None = None,
           restarts: int = 0, replace: bool = False,
           watchdog: float | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None
           ) -> int:
  """Runs ``command`` in ``num_processes`` local processes; see the module.

  Args:
    num_processes: how many processes to start.
    command: the command each runs, as is (no shell).
    port: the coordinator's port (default: a free one at each start).
    timeout: seconds until everything is stopped (exit 124), restarts
      included; None: no limit.
    restarts: how many times to start the command again after a process
      died or hung.
    replace: restart on ``num_processes`` processes, not on the survivors.
    watchdog: seconds without a heartbeat after which a process is hung;
      None: 30 with ``restarts``, else off; 0: off.
    stdout: where the processes' stdout goes (default ``sys.stdout``).
    stderr: where their stderr and the launcher's notes go (default
      ``sys.stderr``).

  Returns:
    The exit status the launcher exits with.

  Example:
    >>> import sys
    >>> from dlion_jax import launch
    >>> launch.launch(2, [sys.executable, "-c", "pass"])
    0
  """
  if watchdog is None:
    watchdog = _WATCHDOG_S if restarts else 0.0
  plan = _Plan(restarts, replace, watchdog or None)
  stdout = sys.stdout if stdout is None else stdout
  stderr = sys.stderr if stderr is None else stderr

  def note(text: str) -> None:
    print(f"launch: {text}", file=stderr, flush=True)

  received: list[int] = []

  def on_signal(signum, frame):  # pylint: disable=unused-argument
    received.append(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous[sig] = signal.signal(sig, on_signal)
  work = tempfile.mkdtemp(prefix="dlion-launch-") if (
      plan.watchdog or plan.restarts) else None
  try:
    return _attempts(num_processes, command, plan=plan, port=port,
                     timeout=timeout, received=received, note=note,
                     work=work, stdout=stdout, stderr=stderr)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    if work:
      shutil.rmtree(work, ignore_errors=True)


def _attempts(num_processes: int, command: Sequence[str], *, plan: _Plan,
              port: int | None, timeout: float | None, received: list[int],
              note, work: str | None, stdout, stderr) -> int:
  """Starts the command, and again after each failure that ``plan``
  restarts; returns the exit status. ``work``: a directory for the
  heartbeats and the restarts' compilation cache."""
  deadline = None if timeout is None else time.monotonic() + timeout
  printer = _Printer()
  launch_id = secrets.token_hex(8)
  n, restart = num_processes, 0
  while True:
    address = f"{_HOST}:{_free_port() if port is None else port}"
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address,
               JAX_NUM_PROCESSES=str(n))
    env.setdefault("PYTHONUNBUFFERED", "1")   # lines as they come
    if plan.restarts:
      lowest = num_processes if plan.replace else max(
          1, num_processes - plan.restarts)
      env.update(zip(_RESTART_ENV, (
          launch_id, str(restart), str(num_processes), str(lowest),
          repr(time.time()))))
      env.update({k: v for k, v in _compilation_cache(work).items()
                  if k not in os.environ})
    beats = os.path.join(work, f"start{restart}") if plan.watchdog else None
    if beats:
      os.makedirs(beats)
    try:
      group = _Group(n, command, env=env, printer=printer, stdout=stdout,
                     stderr=stderr, heartbeats=beats)
    except OSError as e:
      note(f"cannot start {command[0]!r}: {e}")
      return 127 if isinstance(e, FileNotFoundError) else 126
    try:
      outcome = _wait(group, received=received, deadline=deadline,
                      timeout=timeout, watchdog=plan.watchdog,
                      restarting=restart < plan.restarts, note=note)
    finally:
      _stop(group.procs, grace=1.0)
      group.close()
    if not outcome.lost:
      return outcome.status
    following = _restart_or_not(n, restart, outcome, plan, note)
    if following is None:
      return outcome.status
    n, restart = following, restart + 1


def _compilation_cache(work: str) -> dict[str, str]:
  """jax's persistent compilation cache for the restarts, in ``work``
  (where the user has set none): a restart on as many processes compiles
  nothing again."""
  return {"JAX_COMPILATION_CACHE_DIR": os.path.join(work, "xla-cache"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _restart_or_not(n: int, restart: int, outcome: _Outcome, plan: _Plan,
                    note) -> int | None:
  """The process count to restart on after ``outcome``, or None (said why)
  where there is no restart."""
  if outcome.status == _USAGE_ERROR and plan.restarts:
    note(f"not restarting: exit code {_USAGE_ERROR} is a usage or config "
         "error, which a restart would repeat")
    return None
  if restart >= plan.restarts:
    if plan.restarts:
      note(f"no restart left (--restarts {plan.restarts} used)")
    return None
  following = plan.next_count(n, outcome)
  if following < 1:
    note("not restarting: no process survived")
    return None
  lost = f"{_listed(outcome.lost)} {outcome.why}"
  how = (f"{_listed(outcome.lost)} replaced" if plan.replace else
         f"was {n}")
  note(f"restart {restart + 1} of {plan.restarts} on {following} "
       f"process{'es' if following > 1 else ''}, {how} ({lost})")
  return following


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m dlion_jax.launch``: :func:`launch` with the command line's
  options (``argv``, default ``sys.argv[1:]``); returns its exit code."""
  args, command = _parse_args(sys.argv[1:] if argv is None else argv)
  _platforms.quiet_tpu_probe()       # the processes inherit the choice
  return launch(args.num_processes, command, port=args.port,
                timeout=args.timeout, restarts=args.restarts,
                replace=args.replace, watchdog=args.watchdog)


if __name__ == "__main__":
  sys.exit(main())
