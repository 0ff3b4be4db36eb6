"""Progress bars (tqdm, an optional dependency: ``pip install ortckpt[progress]``).

A save runs in Rust with the GIL released; a thread here polls its byte counter
(``_boundary.SaveProgress``) and moves the bar. Bars appear only for operations that
last longer than half a second.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _boundary

POLL_SECONDS = 0.1
DELAY_SECONDS = 0.5


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError("progress bars need tqdm: pip install 'ortckpt[progress]' (or tqdm)") from None
    return tqdm


def bar(description: str, total: int | None = None) -> Any:
    """A byte-counting tqdm bar (shown after DELAY_SECONDS)."""
    return _tqdm()(
        total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, delay=DELAY_SECONDS, leave=False
    )


@contextmanager
def save_progress(show: bool, description: str) -> Iterator[_boundary.SaveProgress | None]:
    """Yields the counter to hand to ``_boundary.save`` (None when not shown) and shows its bar."""
    if not show:
        yield None
        return
    progress = bar(description)
    counter = _boundary.SaveProgress()
    done = threading.Event()

    def follow() -> None:
        while True:
            finished = done.wait(POLL_SECONDS)
            if counter.total and progress.total != counter.total:
                progress.total = counter.total
            progress.update(counter.written - progress.n)
            if finished:
                return

    thread = threading.Thread(target=follow, name="ortckpt-progress", daemon=True)
    thread.start()
    try:
        yield counter
    finally:
        done.set()
        thread.join()
        progress.close()
