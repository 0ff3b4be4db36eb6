"""The checks of a :class:`~ortckpt.CheckpointManager`'s arguments, made when it is created,
before anything is opened or written: each refusal names the argument, as a
:class:`~ortckpt.InvalidArgumentTypeError` (a TypeError) for a value of the wrong type and an
:class:`~ortckpt.InvalidArgumentError` (a ValueError) for one out of range. Counts are ints
(NumPy integers too), never bools nor floats (``1.5`` steps is no count); flags are bools
(NumPy's too), never strings (``"False"`` is true)."""

from __future__ import annotations

import datetime
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _boundary
from ..errors import InvalidArgumentError, InvalidArgumentTypeError

# The most bytes a size may say: the core counts them in 64-bit integers.
MAX_BYTES = 2**63 - 1


def count(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int from ``minimum`` (to ``maximum``)."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(f"{name} is an int, got {value!r} (a bool)", name)
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentTypeError(f"{name} is an int, got {value!r} ({type(value).__name__})", name) from None
    if number < minimum or (maximum is not None and number > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise InvalidArgumentError(f"{name} must be {bounds}, got {number}", name)
    return number


def optional_count(name: str, value: Any, minimum: int = 1) -> int | None:
    return None if value is None else count(name, value, minimum)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(f"{name} is True or False, got {value!r} ({type(value).__name__})", name)
    return bool(value)


def text(name: str, value: Any) -> str:
    """A non-empty str that a file can hold (no lone surrogate)."""
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} is a str, got {type(value).__name__}", name)
    if not value:
        raise InvalidArgumentError(f"{name} is a non-empty str, got ''", name)
    at = _boundary.unencodable_at(value)
    if at is not None:
        raise InvalidArgumentError(
            f"{name} is {value!r}, which is not text: the character {value[at]!r} at position {at} is a lone surrogate",
            name,
        )
    return value


def save_every(value: Any) -> int | datetime.timedelta | None:
    """Steps (an int from 1), a time (a ``timedelta`` of 0 or more), or None."""
    if value is None or isinstance(value, datetime.timedelta):
        if value is not None and value < datetime.timedelta(0):
            raise InvalidArgumentError(f"save_every is a time of 0 or more, got {value}", "save_every")
        return value
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise InvalidArgumentTypeError(
            f"save_every is a number of steps (an int) or a datetime.timedelta, got {value!r} ({type(value).__name__})",
            "save_every",
        )
    return count("save_every", value)


def keep_best(value: Any) -> tuple[str, str, int] | None:
    """``(metric name, "min" or "max", count)``, or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") or len(value) != 3:
        raise InvalidArgumentTypeError(
            f"keep_best is (metric name, 'min' or 'max', count), got {value!r}", "keep_best"
        )
    metric, mode, how_many = value
    metric = text("keep_best's metric name", metric)
    if mode not in ("min", "max") or not isinstance(mode, str):
        raise InvalidArgumentError(f"keep_best's mode is 'min' or 'max', got {mode!r}", "keep_best")
    return metric, mode, count("keep_best's count", how_many)


def verify_after_save(value: Any) -> bool | str:
    if isinstance(value, str) and value == "process":
        return "process"
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(
            f"verify_after_save is False, True or 'process', got {value!r}", "verify_after_save"
        )
    return bool(value)


def mapping(name: str, value: Any) -> dict[str, Any]:
    """A mapping (None: empty), as a dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentTypeError(f"{name} is a mapping (a dict), got {type(value).__name__}", name)
    return dict(value)


def track(value: Any) -> Any:
    """``"mlflow"``, a :class:`~ortckpt.manager.tracking.Tracker`, or None."""
    from .tracking import Tracker

    if value is None or (isinstance(value, str) and value == "mlflow") or isinstance(value, Tracker):
        return value
    if isinstance(value, str):
        raise InvalidArgumentError(f"track is 'mlflow' or a Tracker object, got {value!r}", "track")
    raise InvalidArgumentTypeError(f"track is 'mlflow' or a Tracker object, got {type(value).__name__}", "track")
