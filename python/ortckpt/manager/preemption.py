"""Preemption: a SIGTERM (or Ctrl-C) becomes one last checkpoint at the step the run is at.

A cloud preemption notice, Kubernetes, SLURM or a spot instance sends SIGTERM and, a grace
period later, SIGKILL. With ``CheckpointManager(..., preemption=True)`` the manager's handler
(:class:`Preemption`) only notes the signal; the training loop goes on to the end of its
step, where ``should_save(step)`` is true whatever ``save_every`` says, the save is
synchronous (pending async saves and tracker reports flushed), and ``manager.preempted``
tells the loop to stop::

    for step in range(start, steps):
        ...
        if manager.should_save(step):
            manager.save(state, step)
            if manager.preempted:
                break                   # the step it was at is committed: exit 0

``preempted`` is asked right after a save: asked after the ``if``, a signal that lands between
``should_save`` (false) and the question would stop the loop one step past its last save.

What the handler does with each signal:

- The first: ``preempted`` becomes True; a Python handler of the user's installed before is
  called too (Python's own SIGINT handler is not: a Ctrl-C no longer raises KeyboardInterrupt).
- Another one while the preemption save runs: noted, nothing else. The save completes (or, if
  it fails, nothing is committed and the previous step stands).
- Another one before the loop reaches its save: the handler installed before runs (Python's
  SIGINT raises KeyboardInterrupt, ``SIG_DFL`` ends the process as the signal would): a run
  that does not get to its save can still be stopped.
- With ``grace`` seconds: if the manager is not closed that long after the first signal (a
  loop that never calls ``should_save``, a save stuck on a dead disk), a watchdog thread ends
  the process with status 128 + the signal's number (as a shell reports a process the signal
  ended), what the scheduler's SIGKILL would do a little later. Steps are transactions: a save
  cut there leaves the previous step, whole.

Handlers are installed when the manager is created and put back by ``close()`` (if nobody
replaced them meanwhile); Python lets only the main thread install them, so a manager created
in another thread with ``preemption`` raises ``ValueError``: create it in the main thread, or
call :meth:`Preemption.notice` (``manager.preempt()``) yourself from whatever learns of the
preemption (a thread polling the cloud's metadata service, say).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

from .. import interrupts
from ..errors import InvalidArgumentError, InvalidArgumentTypeError

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signals_of(preemption: Any) -> tuple[signal.Signals, ...]:
    """The signals ``preemption=`` asks for: True (SIGTERM and SIGINT), False/None (none), or a
    collection of signals (``signal.Signals`` or their numbers)."""
    if preemption is None or preemption is False:
        return ()
    if preemption is True:
        return DEFAULT_SIGNALS
    if isinstance(preemption, (str, bytes)) or not isinstance(preemption, Iterable):
        raise InvalidArgumentTypeError(
            f"preemption is True, False or a collection of signals, got {type(preemption).__name__}", "preemption"
        )
    out: list[signal.Signals] = []
    for value in preemption:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentTypeError(
                f"preemption: signals are signal.Signals or ints, got {type(value).__name__}", "preemption"
            )
        try:
            sig = signal.Signals(value)
        except ValueError:
            raise InvalidArgumentError(f"preemption: {value} is not a signal", "preemption") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidArgumentError(f"preemption: {sig.name} cannot be caught", "preemption")
        if sig not in out:
            out.append(sig)
    if not out:
        raise InvalidArgumentError("preemption: an empty collection of signals (use False for none)", "preemption")
    return tuple(out)


def check_grace(grace: Any) -> float | None:
    if grace is None:
        return None
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
        raise InvalidArgumentError(f"preemption_grace is None or seconds > 0, got {grace!r}", "preemption_grace")
    return float(grace)


class Preemption:
    """The state of one manager's preemption: installed handlers, the signal noticed, the
    watchdog. ``saving`` is set by the manager around its preemption save."""

    def __init__(self, signals: tuple[signal.Signals, ...], grace: float | None, where: str) -> None:
        self.signals = signals
        self.grace = grace
        self.where = where
        self.signal: int | None = None  # the first signal noticed (0: manager.preempt())
        self.saving = False
        self._previous: dict[signal.Signals, Any] = {}
        self._watchdog: threading.Timer | None = None
        self._lock = threading.RLock()  # (the handler may run in the main thread while it holds it)
        if signals and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                f"{where}: preemption= installs signal handlers, which Python allows only in the main thread: "
                "create the manager there, or leave preemption off and call manager.preempt() yourself"
            )
        self._handler = _Handler(self)
        try:
            for sig in signals:
                self._previous[sig] = interrupts.underlying(signal.signal(sig, self._handler))
        except BaseException:
            self.restore()
            raise

    @property
    def noticed(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: Any) -> None:
        """The installed handler (runs in the main thread, between two bytecodes)."""
        if self.noticed:
            if self.saving:
                return  # the preemption save completes (see the module's docstring)
            self._escalate(signum, frame)
            return
        self.notice(signum)
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # a handler of the user's (logging, say) hears of it too

    def notice(self, signum: int = 0) -> None:
        """Marks the run preempted (as a signal would: ``manager.preempt()``) and starts the
        grace period's watchdog."""
        with self._lock:
            if self.signal is not None:
                return
            self.signal = signum
            if self.grace is not None:
                self._watchdog = threading.Timer(self.grace, self._expire)
                self._watchdog.daemon = True
                self._watchdog.start()

    def _escalate(self, signum: int, frame: Any) -> None:
        """A second signal before the save: the handler installed before, as if the manager
        had none."""
        sig = signal.Signals(signum)
        previous = self._previous.get(sig, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            self.restore()
            signal.raise_signal(sig)  # the default action (SIGTERM, SIGINT's SIG_DFL: the process ends)

    def _expire(self) -> None:
        """The grace period is over and the manager is not closed: the process ends."""
        signum = self.signal or signal.SIGTERM
        try:
            sys.stderr.write(
                f"ortckpt: {self.where}: preempted {self.grace:g} s ago and not closed since "
                f"(preemption_grace): ending the process\n"
            )
            sys.stderr.flush()
        finally:
            os._exit(128 + int(signum))

    def restore(self) -> None:
        """Stops the watchdog; puts back each handler this one replaced, where it is still ours."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if threading.current_thread() is not threading.main_thread():
            return  # (Python cannot: they stay, and a signal still marks this run preempted)
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if signal.getsignal(sig) is self._handler:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _Handler:
    """The installed handler; ``defers_itself``: it never raises, so a save need not hold
    SIGINT from it (see ortckpt.interrupts)."""

    defers_itself = True

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption

    def __call__(self, signum: int, frame: Any) -> None:
        self.preemption._handle(signum, frame)
