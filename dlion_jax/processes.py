"""Process start-up: one JAX process per host, joined by a coordinator.

:func:`start_processes` starts jax on this process (its CPU devices and,
for several processes, :func:`jax.distributed.initialize`), and
:func:`check_processes` and :func:`coordinator_problem` say why the
arguments it would get cannot work, before it waits for the others.
Under ``python -m dlion_jax.launch --restarts K`` it also beats the
launcher's watchdog, and :func:`restart_info` says whether this start is a
restart and on how many processes the run began.

The only module of the library that opens sockets and starts threads (the
start-up watchdog, the heartbeat): ``import dlion_jax`` does not import it;
import it as ``from dlion_jax import processes``.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import socket
import sys
import threading
import time

import jax

from dlion_jax import _checks
from dlion_jax import devices


def coordinator_problem(address: str, process_id: int = 0) -> str | None:
  """Why ``address`` cannot be the coordinator's ``host:port``, or None.

  Checks the form and that the host resolves; for process 0, which serves
  the coordinator, also that the port is free here (a busy port would crash
  jax's gRPC server without a word).
  """
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit():
    return "expected host:port, e.g. 127.0.0.1:1234."
  try:
    socket.getaddrinfo(host.strip("[]"), int(port))
  except OSError as e:
    return f"cannot resolve host {host!r} ({e})."
  busy = _port_in_use(int(port)) if process_id == 0 else None
  if busy:
    return (f"process 0 serves the coordinator on port {port}, which is in "
            f"use on this machine ({busy}); pick another port.")
  return None


def _port_in_use(port: int) -> str | None:
  """Why process 0 could not serve on ``port`` (jax binds ``[::]:port``, or
  IPv4 where there is no IPv6); None if it is free."""
  for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    try:
      with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
      return None
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return e.strerror
  return None


def _watchdog(seconds: float, message: str) -> threading.Timer:
  """Exits the process with ``message`` unless cancelled within ``seconds``
  (the C++ call it guards releases the GIL, so the timer thread runs)."""
  def fire():
    print(message, file=sys.stderr, flush=True)
    os._exit(1)  # pylint: disable=protected-access
  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.start()
  return timer


# What dlion_jax.launch sets (the same names there).
_HEARTBEAT_ENV = "DLION_HEARTBEAT_FILE"
_RESTART_ENV = ("DLION_LAUNCH_ID", "DLION_RESTART",
                "DLION_FIRST_NUM_PROCESSES", "DLION_MIN_PROCESSES",
                "DLION_STARTED_AT")
_BEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class RestartInfo:
  """This process's start under ``python -m dlion_jax.launch --restarts``.

  Attributes:
    launch_id: the launcher's run, alike in all its starts (a run directory
      that holds it was begun by this launcher).
    restart: 0 at the first start, then how many restarts came before.
    num_processes: the processes of this start.
    first_num_processes: the processes of the first start.
    min_processes: the fewest processes a restart may leave.
    started_at: when the launcher started this start's processes
      (``time.time()``).
  """
  launch_id: str
  restart: int
  num_processes: int
  first_num_processes: int
  min_processes: int
  started_at: float

  def scaled(self, count: int) -> int:
    """``count`` (e.g. workers, set for the first start) scaled to this
    start's processes; raises ValueError where it does not divide.

    Example:
      >>> from dlion_jax.processes import RestartInfo
      >>> RestartInfo("ab", 1, 3, 4, 2, 0.0).scaled(8)   # 2 a process
      6
    """
    if count % self.first_num_processes:
      raise ValueError(
          f"{count} is not a multiple of the {self.first_num_processes} "
          "processes the run began on.")
    return count // self.first_num_processes * self.num_processes


def restart_info() -> RestartInfo | None:
  """What ``python -m dlion_jax.launch --restarts K`` told this process
  (:class:`RestartInfo`), or None where it was not started so.

  A script that survives restarts checkpoints every few steps and, where
  ``restart_info().restart > 0`` (or simply where a checkpoint exists),
  resumes from the last one on the processes it has: the guide
  docs/guides/multihost_tpu.md, "Surviving a lost process".
  """
  env = os.environ.get
  if env(_RESTART_ENV[0]) is None:
    return None
  launch_id, restart, first, lowest, started = (env(k, "")
                                                for k in _RESTART_ENV)
  try:
    return RestartInfo(launch_id, int(restart),
                       int(env("JAX_NUM_PROCESSES", "1")), int(first),
                       int(lowest), float(started))
  except ValueError:
    raise ValueError(
        "The restart environment dlion_jax.launch sets is malformed: "
        + ", ".join(f"{k}={env(k)!r}" for k in _RESTART_ENV)
        + ". Start the processes with python -m dlion_jax.launch, or unset "
        "these variables.") from None


def _beat(path: str) -> None:
  """Touches ``path`` every second, for the launcher's watchdog (a daemon
  thread: it stops when the process is frozen or gone)."""
  while True:
    try:
      with open(path, "a", encoding="utf-8"):
        os.utime(path)
    except OSError:
      return                            # the launcher went away
    time.sleep(_BEAT_S)


_heartbeat: list[threading.Thread] = []


def start_heartbeat() -> bool:
  """Beats the watchdog of ``python -m dlion_jax.launch`` (its
  ``DLION_HEARTBEAT_FILE``) from a daemon thread, once a second; returns
  whether there is one to beat. :func:`start_processes` calls it: call it
  yourself only in a script that does not."""
  path = os.environ.get(_HEARTBEAT_ENV)
  if not path or _heartbeat:
    return bool(path)
  thread = threading.Thread(target=_beat, args=(path,), daemon=True,
                            name="dlion_jax heartbeat")
  thread.start()
  _heartbeat.append(thread)
  return True


def check_processes(num_processes: int, process_id: int,
                    coordinator: str | None, init_timeout: float,
                    heartbeat_timeout: float | None, *,
                    names: dict[str, str] | None = None) -> None:
  """Raises a ValueError naming the first argument of
  :func:`start_processes` that cannot work, with its value and the fix.

  ``names`` spells the arguments as the caller's user knows them (the
  training CLI passes its flags, e.g. ``{"process_id": "--process-id"}``).
  """
  name = lambda arg: (names or {}).get(arg, arg)
  n = num_processes
  if not 0 <= process_id < n:
    raise ValueError(
        f"{name('process_id')}={process_id} must be in [0, {n}) for "
        f"{name('num_processes')}={n}: give every process its own id (or "
        "set JAX_PROCESS_ID).")
  if not coordinator:
    raise ValueError(
        f"{name('coordinator')}={coordinator!r}: {name('num_processes')}={n} "
        "needs the host:port where process 0 serves the coordinator (or set "
        "JAX_COORDINATOR_ADDRESS; python -m dlion_jax.launch does).")
  problem = coordinator_problem(coordinator, process_id)
  if problem:
    raise ValueError(f"{name('coordinator')}={coordinator!r}: {problem}")
  if not init_timeout > 0:
    raise ValueError(f"{name('init_timeout')}={init_timeout:g} must be "
                     "positive (seconds).")
  if heartbeat_timeout is not None and not heartbeat_timeout >= 1:
    raise ValueError(f"{name('heartbeat_timeout')}={heartbeat_timeout:g} "
                     "must be at least 1 (seconds).")


def start_processes(local_devices: int, *, num_processes: int | None = None,
                    process_id: int | None = None,
                    coordinator: str | None = None,
                    init_timeout: float = 60.0,
                    heartbeat_timeout: float | None = None,
                    timeout_hint: str | None = None) -> None:
  """Starts jax on this process: its CPU devices and, for several processes,
  :func:`jax.distributed.initialize`.

  Must run before anything starts a backend. The arguments left ``None``
  come from the environment :mod:`dlion_jax.launch` sets:
  ``JAX_NUM_PROCESSES`` (default 1), ``JAX_PROCESS_ID`` (default 0) and
  ``JAX_COORDINATOR_ADDRESS``. Cross-process collectives on CPU go over TCP
  with gloo, unless ``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` chose another
  (e.g. mpi): without one, CPU collectives cannot span processes.

  Started by ``python -m dlion_jax.launch`` with its watchdog on, it beats
  the watchdog from a thread (:func:`start_heartbeat`).

  A process that has not joined all the others within ``init_timeout``
  seconds prints one line, ``error: process I of N ...`` naming the
  coordinator, and exits with status 1: jax's own start-up timeout (30 s
  later) aborts with a C++ stack trace that does not say which address it
  waited for.

  Args:
    local_devices: CPU devices on this process (on a machine with
      accelerators, its devices are used instead).
    num_processes: the processes that take part.
    process_id: this process's index, in ``[0, num_processes)``.
    coordinator: ``host:port`` where process 0 serves the coordinator.
    init_timeout: seconds to wait for every process to join.
    heartbeat_timeout: seconds after which a process that stopped answering
      is declared dead and every process fails (``None``: jax's default).
    timeout_hint: what the line printed at ``init_timeout`` suggests, after
      saying what was not reached (default: where to start the others, or
      what to check).

  Raises:
    ValueError: for several processes, a process id out of range, no or a
      malformed coordinator address (or, on process 0, its port in use), a
      timeout too small.
    RuntimeError: the backend is already up with fewer devices.
  """
  local_devices = _checks.positive_int("local_devices", local_devices)
  start_heartbeat()
  env = os.environ.get
  n = int(env("JAX_NUM_PROCESSES", "1")) if num_processes is None else (
      num_processes)
  if n < 1:
    raise ValueError(f"num_processes={n} must be at least 1 (or set "
                     "JAX_NUM_PROCESSES).")
  if n == 1:
    devices.use_cpu_devices(local_devices)
    return
  pid = int(env("JAX_PROCESS_ID", "0")) if process_id is None else process_id
  coordinator = env("JAX_COORDINATOR_ADDRESS") if coordinator is None else (
      coordinator)
  check_processes(n, pid, coordinator, init_timeout, heartbeat_timeout)
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Overrides --xla_force_host_platform_device_count in XLA_FLAGS.
  jax.config.update("jax_num_cpu_devices", local_devices)
  if pid == 0:
    why = (f"started the coordinator at {coordinator}, but not all {n} "
           f"processes joined within {init_timeout:g} s.")
    hint = (f"Start the others with coordinator {coordinator} and process "
            f"ids 1..{n - 1}, or use python -m dlion_jax.launch.")
  else:
    why = (f"could not reach the coordinator at {coordinator}, or not all "
           f"{n} processes joined, within {init_timeout:g} s.")
    hint = (f"Is process 0 running with coordinator {coordinator}, and "
            "reachable from here?")
  hint = hint if timeout_hint is None else timeout_hint
  timer = _watchdog(init_timeout, f"error: process {pid} of {n} {why} {hint}")
  heartbeat = {} if heartbeat_timeout is None else {
      "heartbeat_timeout_seconds": math.ceil(heartbeat_timeout)}
  try:
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid,
                               initialization_timeout=int(init_timeout) + 30,
                               **heartbeat)
    devices.use_cpu_devices(local_devices)  # joins the global topology
  finally:
    timer.cancel()
