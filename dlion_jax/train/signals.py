"""SIGTERM, what schedulers and :mod:`dlion_jax.launch` send to stop a run,
handled like Ctrl-C.

The CLI makes SIGTERM raise :class:`Terminated` (a ``KeyboardInterrupt``,
so it ends a run the way Ctrl-C does); the training loop holds it back until
the step it is in ends, saves a checkpoint there and then raises it
(:func:`held`). A multi-process run leaves SIGTERM to jax's preemption
service instead, which agrees on the step to stop at across the processes.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
  """SIGTERM arrived."""
  signum = signal.SIGTERM


def _raise_terminated(*_):
  raise Terminated


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handler(signum: int, handler):
  """Installs ``handler`` for ``signum`` in the block (main thread only)."""
  if not _main_thread():
    yield
    return
  previous = signal.signal(signum, handler)
  try:
    yield
  finally:
    if previous is not None:        # None: a handler not set from Python
      signal.signal(signum, previous)


def raising():
  """A block in which SIGTERM raises :class:`Terminated`."""
  return _handler(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def held():
  """A block in which SIGTERM is only recorded: yields a list that holds
  the signal number once one arrived."""
  caught: list[int] = []
  with _handler(signal.SIGTERM, lambda signum, _: caught.append(signum)):
    yield caught


@contextlib.contextmanager
def deferred(signums=(signal.SIGINT, signal.SIGTERM)):
  """Holds ``signums`` back until the block ends, then delivers them again
  to the handlers that were in place (a Ctrl-C then raises
  ``KeyboardInterrupt`` there)."""
  if not _main_thread():
    yield
    return
  caught: list[int] = []
  previous = {s: signal.signal(s, lambda signum, _: caught.append(signum))
              for s in signums}
  try:
    yield
  finally:
    for signum, handler in previous.items():
      if handler is not None:
        signal.signal(signum, handler)
  for signum in dict.fromkeys(caught):
    signal.raise_signal(signum)
