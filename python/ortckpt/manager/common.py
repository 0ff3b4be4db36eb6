"""The manager's helpers: the copy an async save writes from, the report of an async save
nobody waited for, and how a step number is checked."""

from __future__ import annotations

import operator
import warnings
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..dtypes import PackedBits
from ..tensor_keys import TensorKey


class Staging:
    """Where an async save's copy of the state goes: one array per tensor, reused from one
    save to the next while its shape and dtype match, so a copy is a plain memcpy into
    memory already mapped (fresh memory costs a page fault per 4 KiB). A value that cannot
    change is not copied: a read-only view of a Python ``bytes`` object (immutable, and NumPy
    refuses to make such a view writeable), as a Flower ``Array``'s values are."""

    def __init__(self) -> None:
        self.arrays: dict[TensorKey, np.ndarray] = {}

    def copy(self, key: TensorKey, value: Any) -> Any:
        if is_immutable(value):
            return value
        if isinstance(value, PackedBits) or value.dtype == object:  # rare types: a fresh copy
            return value.copy()
        target = self.arrays.get(key)
        if target is None or target.shape != value.shape or target.dtype != value.dtype:
            target = self.arrays[key] = np.empty(value.shape, value.dtype)
        np.copyto(target, value)
        return target


def is_immutable(value: Any) -> bool:
    """Whether ``value`` is an array whose bytes nothing can change: read-only views all the
    way down to a ``bytes`` object."""
    while isinstance(value, np.ndarray):
        if value.flags.writeable:
            return False
        value = value.base
    return isinstance(value, bytes)


def as_step(step: Any) -> int:
    """A step as an int: ints and NumPy integers (not bools) from 0 up."""
    step = as_integer("step", step)
    if step < 0:
        raise ValueError(f"step must be an int >= 0, got {step}")
    return step


def as_integer(what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


class UnwaitedSave:
    """The async save nobody has waited for yet: if it failed and the manager is collected or
    the program ends first, its failure is reported (a warning on stderr) instead of lost."""

    def __init__(self, where: object) -> None:
        self.where = where
        self.future: Future[None] | None = None
        self.step = 0

    def watch(self, future: Future[None], step: int) -> None:
        self.future, self.step = future, step

    def clear(self) -> None:
        self.future = None

    def report(self) -> None:
        future, self.future = self.future, None
        if future is None:
            return
        if not future.done():  # collected mid-save (only from a finalizer thread): report when done
            future.add_done_callback(self._warn)
            return
        self._warn(future)

    def _warn(self, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            warnings.warn(
                f"{self.where}: the async save of step {self.step} failed and was never waited for "
                f"(wait() or close()): that checkpoint was lost: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=1,
            )
