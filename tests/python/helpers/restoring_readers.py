"""Readers that restore a run's latest step as fast as they can while a test writes and retires steps
(the object-store attacks: a reader never sees a missing object nor a mix of two steps)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ortckpt import CheckpointManager


@contextmanager
def restoring_readers(
    url: str, options: dict, check: Callable[[Any], int], count: int = 1
) -> Iterator[tuple[list[int], list[str]]]:
    """``count`` read-only managers restore the latest step in a loop while the body runs; ``check``
    returns the step a restored state holds and raises when the state is not that step's, whole.
    Yields (the steps seen, the failures), complete once the block has ended and the readers stopped."""
    done = threading.Event()
    seen: list[int] = []
    failures: list[str] = []

    def read() -> None:
        with CheckpointManager(url, storage_options=options, read_only=True) as reader:
            while not done.is_set():
                try:
                    seen.append(check(reader.restore()))
                except Exception as e:  # (any: what the test reports)
                    failures.append(f"{type(e).__name__}: {e}")

    readers = [threading.Thread(target=read) for _ in range(count)]
    for thread in readers:
        thread.start()
    try:
        yield seen, failures
    finally:
        done.set()
        for thread in readers:
            thread.join()
