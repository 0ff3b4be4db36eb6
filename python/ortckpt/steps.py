"""Step directories (``step_00000100``), shared by CheckpointManager and sharded checkpoints."""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"step_(\d+)")


def step_directory_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_directory(path: Path) -> None:
    """Makes a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
