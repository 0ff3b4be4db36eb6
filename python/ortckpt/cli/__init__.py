"""The ``ortckpt`` command: ``commands`` (click: parsing, printing, exit codes) over ``summary``
(``inspect``) and ``compare`` (``diff``)."""

from .commands import DIFFERENT, FAILED, OK, USAGE, main, run

__all__ = ["DIFFERENT", "FAILED", "OK", "USAGE", "main", "run"]
