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

The handler takes no lock that the code it interrupts may hold, and starts no thread: it runs
between two bytecodes of the main thread, which may be inside ``threading``'s own code (a
watchdog Timer's cancel, in ``close()``, held its Event's lock when a second SIGTERM came, and the
handler, cancelling it again, waited for that lock forever: seen in CI). So the watchdog is a
thread started with the manager that waits on a pipe, which the handler only writes a byte to.

Handlers are installed when the manager is created and put back by ``close()`` (if nobody
replaced them meanwhile); Python lets only the main thread install them, so a manager created
in another thread with ``preemption`` raises ``ValueError``: create it in the main thread, or
call :meth:`Preemption.notice` (``manager.preempt()``) yourself from whatever learns of the
preemption (a thread polling the cloud's metadata service, say).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
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
        self._lock = threading.RLock()  # (the handler may run in the main thread while it holds it)
        if signals and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                f"{where}: preemption= installs signal handlers, which Python allows only in the main thread: "
                "create the manager there, or leave preemption off and call manager.preempt() yourself"
            )
        self._watchdog = _Watchdog(grace, self._expire) if grace is not None else None
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
            if self._watchdog is not None:
                self._watchdog.start_grace()

    def _escalate(self, signum: int, frame: Any) -> None:
        """A second signal before the save: the handler installed before, as if the manager
        had none."""
        sig = signal.Signals(signum)
        previous = self._previous.get(sig, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            # The default action (SIGTERM, SIGINT's SIG_DFL: the process ends), before anything else:
            # this may have interrupted close() itself.
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
            self.restore()  # (a signal whose default is to be ignored: the manager's handlers go)

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
            self._watchdog.stop()
        if threading.current_thread() is not threading.main_thread():
            return  # (Python cannot: they stay, and a signal still marks this run preempted)
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if signal.getsignal(sig) is self._handler:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _Watchdog:
    """The grace period's watchdog: a daemon thread, started with the manager, that waits on a
    pipe. ``start_grace`` (the signal handler's: it writes a byte, no more) starts the grace
    period, ``stop`` ends the thread; if the grace period ends first, ``expire`` is called."""

    _GRACE = b"g"
    _STOP = b"s"

    def __init__(self, grace: float, expire: Any) -> None:
        self._grace = grace
        self._expire = expire
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # (a full pipe: the watchdog has a byte to read already)
        # Reentrant: the handler may run in the main thread while stop() holds it there (and then
        # finds it stopped, or writes before the close); another thread's call waits for stop().
        self._lock = threading.RLock()
        self._stopped = False
        threading.Thread(target=self._run, name="ortckpt-preemption-watchdog", daemon=True).start()

    def start_grace(self) -> None:
        with self._lock:
            if not self._stopped:
                self._send(self._GRACE)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True  # (first: a handler running from here on writes nothing)
            self._send(self._STOP)
            os.close(self._write)  # (the read end is the thread's, closed as it ends)

    def _send(self, byte: bytes) -> None:
        with contextlib.suppress(OSError):  # (full: the watchdog has a byte to read already)
            os.write(self._write, byte)

    def _run(self) -> None:
        try:
            deadline: float | None = None
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([self._read], [], [], wait)[0]:
                    self._expire()
                    return
                news = os.read(self._read, 64)
                if not news or self._STOP in news:  # (end of file: stopped with a full pipe)
                    return
                if deadline is None:
                    deadline = time.monotonic() + self._grace
        finally:
            os.close(self._read)


class _Handler:
    """The installed handler; ``defers_itself``: it never raises, so a save need not hold
    SIGINT from it (see ortckpt.interrupts)."""

    defers_itself = True

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption

    def __call__(self, signum: int, frame: Any) -> None:
        self.preemption._handle(signum, frame)
