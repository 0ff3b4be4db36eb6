"""The ``ortckpt`` command (also ``python -m ortckpt``)."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from . import __version__


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ortckpt",
        description="Fast, zero-copy ONNX Runtime training checkpoints.",
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"ortckpt {__version__} (Python {platform.python_version()}, {platform.machine()})",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser().parse_args(argv)
    parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
