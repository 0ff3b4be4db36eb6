"""Tests that need root: they play another user (root dropping its user) or mount a filesystem."""

from __future__ import annotations

import functools
import os


def needs_root(test):  # type: ignore[no-untyped-def]
    """A test that plays another user (root dropping its user) or mounts a filesystem: the suite
    runs as root (as CI does); without root it fails, saying so, rather than passing unchecked."""

    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert os.geteuid() == 0, f"{test.__name__} needs root (it plays user nobody, or mounts a tmpfs)"
        return test(*args, **kwargs)

    return functools.wraps(test)(checked)
