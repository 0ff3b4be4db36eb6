"""The ``ortckpt`` command: ``commands`` (click: parsing, printing, exit codes) over ``summary``
(``inspect``) and :mod:`ortckpt.compare` (``diff``)."""

from .commands import DIFFERENT, FAILED, INTERRUPTED, OK, USAGE, console, main, run

__all__ = ["DIFFERENT", "FAILED", "INTERRUPTED", "OK", "USAGE", "console", "main", "run"]
