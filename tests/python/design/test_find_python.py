"""`.ci/find-python`, which `make test` uses to find each CPython in PYTHONS: it finds this
interpreter's version (as a base interpreter, not a virtualenv's) and fails loudly for one
that is not installed, never silently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIND = Path(__file__).resolve().parents[3] / ".ci" / "find-python"


def find(version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(FIND), version], capture_output=True, text=True, check=False)


def test_it_finds_the_running_interpreters_version_outside_any_virtualenv():
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = find(version)
    assert found.returncode == 0, found.stderr
    path = found.stdout.strip()
    probe = "import sys; print('%d.%d' % sys.version_info[:2], sys.prefix == sys.base_prefix)"
    assert subprocess.run([path, "-c", probe], capture_output=True, text=True, check=True).stdout.split() == [
        version,
        "True",
    ]


def test_a_missing_or_malformed_version_fails_loudly():
    missing = find("3.99")
    assert missing.returncode == 1 and "no CPython 3.99 here" in missing.stderr and missing.stdout == ""
    malformed = find("../../x")
    assert malformed.returncode == 2 and "not a version" in malformed.stderr
