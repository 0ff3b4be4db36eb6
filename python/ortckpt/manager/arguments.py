"""The checks of a :class:`~ortckpt.CheckpointManager`'s own arguments, made when it is
created, before anything is opened or written (the general ones: :mod:`ortckpt.arguments`)."""

from __future__ import annotations

import datetime
from typing import Any, Literal

import numpy as np

from ..arguments import count, text
from ..errors import InvalidArgumentError, InvalidArgumentTypeError


def save_every(value: Any) -> int | datetime.timedelta | None:
    """Steps (an int from 1), a time (a ``timedelta`` of 0 or more), or None."""
    if value is None or isinstance(value, datetime.timedelta):
        if value is not None and value < datetime.timedelta(0):
            raise InvalidArgumentError(f"save_every is a time of 0 or more, got {value}", "save_every")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentTypeError(
            f"save_every is a number of steps (an int) or a datetime.timedelta, got {value!r} ({type(value).__name__})",
            "save_every",
        )
    return count("save_every", value)


def keep_best(value: Any) -> tuple[str, Literal["min", "max"], int] | None:
    """``(metric name, "min" or "max", count)``, or None."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise InvalidArgumentTypeError(f"keep_best is (metric name, 'min' or 'max', count), got {value!r}", "keep_best")
    metric, mode, how_many = value
    if not isinstance(mode, str) or mode not in ("min", "max"):
        raise InvalidArgumentError(f"keep_best's mode is 'min' or 'max', got {mode!r}", "keep_best")
    return (
        text("keep_best's metric name", metric, "keep_best"),
        "min" if mode == "min" else "max",
        count("keep_best's count", how_many, argument="keep_best"),
    )


def verify_after_save(value: Any) -> bool | Literal["process"]:
    if isinstance(value, str) and value == "process":
        return "process"
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(
            f"verify_after_save is False, True or 'process', got {value!r}", "verify_after_save"
        )
    return bool(value)


def track(value: Any) -> Any:
    """``"mlflow"``, a :class:`~ortckpt.manager.tracking.Tracker` (its ``timeout`` checked), or None."""
    from .tracking import Tracker, tracker_timeout

    if isinstance(value, Tracker):
        tracker_timeout(value)
        return value
    if value is None or (isinstance(value, str) and value == "mlflow"):
        return value
    if isinstance(value, str):
        raise InvalidArgumentError(f"track is 'mlflow' or a Tracker object, got {value!r}", "track")
    raise InvalidArgumentTypeError(f"track is 'mlflow' or a Tracker object, got {type(value).__name__}", "track")
