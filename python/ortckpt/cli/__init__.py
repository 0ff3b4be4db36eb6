"""The ``ortckpt`` command: ``commands`` (click: parsing, printing, exit codes; with ``transform`` and
``combine``, on the group and helpers of ``common``) over ``summary`` (``inspect``) and
:mod:`ortckpt.compare` (``diff``)."""

from .commands import DIFFERENT, FAILED, INTERRUPTED, OK, USAGE, console, main, run

__all__ = ["DIFFERENT", "FAILED", "INTERRUPTED", "OK", "USAGE", "console", "main", "run"]
