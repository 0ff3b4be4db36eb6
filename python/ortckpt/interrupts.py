"""Ctrl-C during a save: an exception out of a save means that nothing was committed.

CPython runs a Python signal handler (SIGINT's raises ``KeyboardInterrupt``) in the main
thread, at the interpreter's next check. A Ctrl-C that comes while the core writes a
checkpoint (the GIL released, for seconds) is therefore raised once the core returns: after
the commit, when it commits as it writes, so the caller read "not saved" for a save that was.

So a save in the main thread *holds* SIGINT (:func:`held`): the handler is swapped for one
that only notes the signal; the files are written staged, and just before the commit
(:func:`before_commit`) a noted signal is handed to the handler of before, which (Python's)
raises ``KeyboardInterrupt``: the staged files are discarded and the old checkpoint stands.
A signal that comes during the commit (a rename, and with ``durable`` its fsyncs) cannot stop
it: the save returns normally and the signal is handed back to Python as the saving call
returns (:class:`_boundary.SignalOnDrop`, freed with the outermost saving frame), so the
``KeyboardInterrupt`` surfaces in the caller, at its next call, not out of the save (but for
a signal in the few bytecodes between the end of the hold and the return: under a microsecond).
The caller must call the save plainly: ``f(**kwargs)`` checks for signals as the call returns.

SIGINT's handler stays ortckpt's forwarder after a save (``signal.getsignal`` shows it): it
hands any SIGINT outside a save to the handler it replaced, and puts that one back then.
Restoring it as each save ends would leave a moment, after the commit, where a Ctrl-C would
again surface in the saving call. A handler installed later replaces the forwarder, and the
next save forwards to that one. Outside the main thread (where Python runs no handler), or
when SIGINT's handler is not a Python function (``SIG_IGN``, ``SIG_DFL``), nothing is held.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from . import _boundary


class Hold:
    """A save's hold on SIGINT (one per outermost save; nested saves share it)."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.pending = False
        # Set when a signal came during the commit: handed back to Python when this hold,
        # a local of the outermost saving frame, is freed as that frame returns.
        self.on_return: Any = None


class _State:
    hold: Hold | None = None  # the main thread's hold, while a save holds SIGINT
    replaced: Any = None  # the handler the forwarder replaced (the one to call outside a save)


_state = _State()


def _forwarder(signum: int, frame: Any) -> None:
    """SIGINT's handler while (and after) a save holds it."""
    hold = _state.hold
    if hold is not None and hold.active:
        hold.pending = True
        return
    _deliver(signum, frame)


def _deliver(signum: int, frame: Any) -> None:
    """Puts the replaced handler back and calls it (Python's raises KeyboardInterrupt)."""
    replaced = _state.replaced
    if signal.getsignal(signal.SIGINT) is _forwarder:
        signal.signal(signal.SIGINT, replaced)
    if callable(replaced):
        replaced(signum, frame)


@contextlib.contextmanager
def held(wanted: bool = True) -> Iterator[Hold]:
    """Holds SIGINT for a save (see the module's docstring); keep what it yields
    as a local of the outermost saving function (``with held() as hold:``), so that a signal
    which came during the commit is handed back as that function returns. ``wanted`` False:
    nothing held (not around what Python code writes bit by bit, an upload or a stream: a
    Ctrl-C stops that at once)."""
    if _state.hold is not None:  # (a save within a save: the outer one holds it)
        yield _state.hold
        return
    if not wanted or threading.current_thread() is not threading.main_thread():
        yield Hold(active=False)
        return
    current = signal.getsignal(signal.SIGINT)
    if getattr(current, "defers_itself", False):  # (a handler that never raises: a manager's preemption)
        yield Hold(active=False)
        return
    if current is not _forwarder:
        if not callable(current):  # SIG_IGN or SIG_DFL: no Python handler to defer
            yield Hold(active=False)
            return
        _state.replaced = current
        signal.signal(signal.SIGINT, _forwarder)
    hold = Hold(active=True)
    _state.hold = hold
    try:
        yield hold
    except BaseException:
        # Failed: nothing was committed, so a signal held meanwhile is raised now (after this error).
        _state.hold = None
        if hold.pending:
            hold.pending = False
            _deliver(signal.SIGINT, None)
        raise
    if hold.pending:
        hold.on_return = _boundary.SignalOnDrop(signal.SIGINT)  # (a signal now is noted: this covers it)
    _state.hold = None  # (a plain store, no check: nothing runs between this and the caller's next call)


def underlying(handler: Any) -> Any:
    """The handler the forwarder stands for (``handler`` itself if it is not the forwarder)."""
    return _state.replaced if handler is _forwarder else handler


def before_commit() -> None:
    """Called by a save just before its commit: a SIGINT held so far goes to the handler of
    before now, which (Python's) raises KeyboardInterrupt, so the save commits nothing."""
    hold = _state.hold
    if hold is None or not hold.pending or threading.current_thread() is not threading.main_thread():
        return
    hold.pending = False
    _call_replaced(signal.SIGINT)  # (a signal meanwhile is noted again)


def _call_replaced(signum: int) -> None:
    replaced = _state.replaced
    if callable(replaced):
        replaced(signum, None)
