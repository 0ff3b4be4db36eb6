"""Modules imported when a test first uses them, not when pytest collects the file: MLflow's client
takes about 3 CPU seconds to import, and every run of the suite collects every file (the runs that
select only a few tests, like each interpreter's every_python set, pay it for nothing)."""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module `name`, imported at the first public attribute asked of it. Private
    names are refused without importing: collection looks for pytest's own markers on every global."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


def lazy_module(name: str) -> Any:
    return LazyModule(name)
