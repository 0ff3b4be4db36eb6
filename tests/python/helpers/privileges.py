"""Tests that need root: they play another user (root dropping its user) or mount a filesystem."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def needs_root(test):  # type: ignore[no-untyped-def]
    """A test that plays another user (root dropping its user) or mounts a filesystem: the suite
    runs as root (as CI does); without root it fails, saying so, rather than passing unchecked."""

    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert os.geteuid() == 0, f"{test.__name__} needs root (it plays user nobody, or mounts a tmpfs)"
        return test(*args, **kwargs)

    return functools.wraps(test)(checked)


@contextlib.contextmanager
def small_tmpfs(options: str) -> Iterator[Path]:
    """A tmpfs mounted (as root) with ``options`` (``size=4M``, ``mode=0700``...) on a fresh
    directory, unmounted and removed after: a full disk on demand."""
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        shutil.rmtree(directory)
        raise AssertionError(f"a tmpfs ({options}) could not be mounted (the suite runs as root): {mounted.stderr}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
        shutil.rmtree(directory, ignore_errors=True)
