"""Checks of the arguments that calls take, made before any work: each refusal names the
argument, as an :class:`~ortckpt.InvalidArgumentTypeError` (a TypeError) for a value of the
wrong type and an :class:`~ortckpt.InvalidArgumentError` (a ValueError) for one out of range.
Counts are ints (NumPy integers too), never bools nor floats (``1.5`` steps is no count);
flags are bools (NumPy's too), never strings (``"False"`` is true); numbers are real and
finite."""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _boundary
from .errors import InvalidArgumentError, InvalidArgumentTypeError

# The most bytes a size may say: the core counts them in 64-bit integers.
MAX_BYTES = 2**63 - 1


def count(name: str, value: Any, minimum: int = 1, maximum: int | None = None, argument: str | None = None) -> int:
    """``value`` as an int from ``minimum`` (to ``maximum``); ``name`` says what it is in
    messages, ``argument`` which argument it is part of (by default, ``name``)."""
    argument = argument or name
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(f"{name} is an int, got {reprlib.repr(value)} (a bool)", argument)
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgumentTypeError(
            f"{name} is an int, got {reprlib.repr(value)} ({type(value).__name__})", argument
        ) from None
    if number < minimum or (maximum is not None and number > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise InvalidArgumentError(f"{name} must be {bounds}, got {number}", argument)
    return number


def optional_count(name: str, value: Any, minimum: int = 1) -> int | None:
    return None if value is None else count(name, value, minimum)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentTypeError(
            f"{name} is True or False, got {reprlib.repr(value)} ({type(value).__name__})", name
        )
    return bool(value)


def text(name: str, value: Any, argument: str | None = None) -> str:
    """A non-empty str that a file can hold (no lone surrogate)."""
    argument = argument or name
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{name} is a str, got {type(value).__name__}", argument)
    if not value:
        raise InvalidArgumentError(f"{name} is a non-empty str, got ''", argument)
    at = _boundary.unencodable_at(value)
    if at is not None:
        raise InvalidArgumentError(
            f"{name} is {value!r}, which is not text: the character {value[at]!r} at position {at} is a lone surrogate",
            argument,
        )
    return value


def mapping(name: str, value: Any) -> dict[str, Any]:
    """A mapping (None: empty), as a dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentTypeError(f"{name} is a mapping (a dict), got {type(value).__name__}", name)
    return dict(value)


def finite(name: str, value: Any, argument: str | None = None) -> float:
    """A real number (not a bool), finite once a float."""
    argument = argument or name
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentTypeError(
            f"{name} is a number, got {reprlib.repr(value)} ({type(value).__name__})", argument
        )
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidArgumentError(f"{name} must be a finite number, got {reprlib.repr(value)}", argument)
    return number


def seconds(name: str, value: Any, argument: str | None = None) -> float:
    """A deadline: a real number of seconds (NumPy's too, not a bool), above 0 and finite."""
    argument = argument or name
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgumentTypeError(f"{name} is a number of seconds, got {type(value).__name__}", argument)
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidArgumentError(f"{name} must be a finite number of seconds, got {reprlib.repr(value)}", argument)
    if number <= 0:
        raise InvalidArgumentError(f"{name} is a number of seconds above 0, got {reprlib.repr(value)}", argument)
    return number
