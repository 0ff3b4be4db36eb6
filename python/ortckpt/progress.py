"""Progress bars (tqdm, an optional dependency: ``pip install ortckpt[progress]``).

A bar can never hold up or fail the work it shows. tqdm writes under one process-wide lock, and
a write that fails (stderr's reader gone: ``python train.py 2>&1 | head``) can leave that lock
taken for good (tqdm's ``clear`` does not release it on error), after which every tqdm call
waits forever. So the working thread never calls tqdm: it adds bytes to a counter (or the core
counts them, ``_boundary.SaveProgress``), and a thread of the bar's own creates, moves and closes
the tqdm bar, writing through a stream that swallows write errors. Closing a bar waits for that
thread briefly, never longer; a bar thread that is stuck anyway (another tqdm user broke the
lock) silences the bars that follow instead of piling up threads.

Bars appear only for work that lasts longer than half a second.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from . import _boundary, extras

POLL_SECONDS = 0.1
DELAY_SECONDS = 0.5
CLOSE_SECONDS = 1.0  # the longest a finished piece of work waits for its bar to go
LOG_SECONDS = 10.0  # where stderr is no terminal (a log): a line this often, no bar


def _mib(n: int) -> str:
    return f"{n / 1048576:.1f} MiB"


def _tqdm() -> Any:
    return extras.require("tqdm.auto", "progress bars").tqdm


class _Unfailing:
    """The bar's stream: writes that fail (EPIPE, a closed file) are dropped, as are all later
    ones; nothing raises into tqdm."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._broken = stream is None

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                self._stream.write(text)
            except Exception:
                self._broken = True
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except Exception:
                self._broken = True

    def isatty(self) -> bool:
        try:
            return not self._broken and bool(self._stream.isatty())
        except Exception:
            return False

    @property
    def encoding(self) -> str:
        return str(getattr(self._stream, "encoding", None) or "utf-8")


class Bar:
    """A byte-counting progress bar for work in the calling thread: ``update(n)`` as bytes go
    (safe from any thread), ``close()`` (or a ``with`` block) when done. ``follow`` instead
    reads (done, total) from a counter that something else moves."""

    stuck: ClassVar[threading.Thread | None] = None  # a bar thread that did not finish when closed

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        follow: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        tqdm = _tqdm()  # a missing tqdm is the caller's error, raised here, before any work
        self._description = description
        self._done = 0
        self._total = total
        self._follow = follow
        self._count_lock = threading.Lock()  # held for an addition, never around I/O
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        if Bar.stuck is not None and Bar.stuck.is_alive():
            return  # tqdm is unusable in this process: count, show nothing
        stream = _Unfailing(sys.stderr)
        self._thread = threading.Thread(target=self._show, args=(tqdm, stream), name="ortckpt-progress", daemon=True)
        self._thread.start()

    @property
    def n(self) -> int:
        return self._done

    def update(self, n: int) -> None:
        with self._count_lock:
            self._done += n

    def _now(self) -> tuple[int, int | None]:
        return self._follow() if self._follow is not None else (self._done, self._total)

    def _show(self, tqdm: Any, stream: _Unfailing) -> None:
        if not stream.isatty():  # a log: plain lines now and then, never a bar's frames
            self._log(stream)
            return
        bar = None
        try:
            done, total = self._now()
            bar = tqdm(
                total=total or None,
                desc=self._description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                delay=DELAY_SECONDS,
                leave=False,
                file=stream,
            )
            while True:
                finished = self._finished.wait(POLL_SECONDS)
                done, total = self._now()
                if total and bar.total != total:
                    bar.total = total
                bar.update(done - bar.n)
                if finished:
                    return
        except Exception:
            return  # a bar that fails stops showing; the work it shows goes on
        finally:
            if bar is not None:
                with contextlib.suppress(Exception):
                    bar.close()

    def _log(self, stream: _Unfailing) -> None:
        """One line every LOG_SECONDS while the work lasts past DELAY_SECONDS, and one at its end."""
        start = time.monotonic()
        shown = False
        try:
            if self._finished.wait(DELAY_SECONDS) and time.monotonic() - start < DELAY_SECONDS:
                return  # quick work: nothing to say
            while True:
                finished = self._finished.wait(LOG_SECONDS if shown else 0)
                done, total = self._now()
                elapsed = time.monotonic() - start
                of = f" of {_mib(total)}" if total else ""
                end = " (done)" if finished else ""
                stream.write(f"{self._description}: {_mib(done)}{of} in {elapsed:.1f} s{end}\n")
                stream.flush()
                shown = True
                if finished:
                    return
        except Exception:
            return  # a line that fails is not written; the work goes on

    def close(self) -> None:
        self._finished.set()
        if self._thread is not None:
            self._thread.join(CLOSE_SECONDS)
            if self._thread.is_alive():
                Bar.stuck = self._thread

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def bar(description: str, total: int | None = None) -> Bar:
    """A byte-counting bar (shown after DELAY_SECONDS): see :class:`Bar`."""
    return Bar(description, total)


class Hidden:
    """What :func:`maybe_bar` gives when no bar is asked for: counts nothing, shows nothing."""

    n = 0

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Hidden:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def maybe_bar(show: bool, description: str, total: int | None = None) -> Bar | Hidden:
    """A bar when ``show``, else one that shows nothing (so callers need no second path)."""
    return Bar(description, total) if show else Hidden()


@contextmanager
def save_progress(show: bool, description: str) -> Iterator[_boundary.SaveProgress | None]:
    """Yields the counter to hand to ``_boundary.save`` (None when not shown) and shows its bar."""
    if not show:
        yield None
        return
    counter = _boundary.SaveProgress()
    with Bar(description, follow=lambda: (counter.written, counter.total)):
        yield counter
