"""A preloaded shim (LD_PRELOAD) that lets a test stop, kill or fail a process at one exact
rename: the moments between the two renames of a commit are microseconds wide, too narrow for a
kill from outside to land in reliably, and a failure of the second rename cannot be provoked on
a healthy filesystem.

The shim wraps ``rename``, ``renameat`` and ``renameat2`` (what Rust's ``std::fs::rename``, the
core's ``renameat2`` and Python's ``os.rename`` call). The environment of the process says what
to do:

- ``ADV_RENAME_MATCH``: a suffix of the destination path (e.g. ``/ck.data``);
- ``ADV_RENAME_NTH``: which matching rename (1 by default);
- ``ADV_RENAME_ACTION``: ``kill-before``/``kill-after`` (SIGKILL itself just before or just after
  that rename), ``stop-before``/``stop-after`` (SIGSTOP itself: the test continues it with
  SIGCONT), or ``eio-before`` (the rename fails with EIO, as on a flaky network filesystem).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

static int matches(const char *path) {
    const char *want = getenv("ADV_RENAME_MATCH");
    if (!want || !path) return 0;
    size_t n = strlen(path), m = strlen(want);
    if (n < m || strcmp(path + n - m, want) != 0) return 0;
    static int seen = 0;
    const char *nth = getenv("ADV_RENAME_NTH");
    return ++seen == (nth ? atoi(nth) : 1);
}

static int action_is(const char *what) {
    const char *action = getenv("ADV_RENAME_ACTION");
    return action && strcmp(action, what) == 0;
}

static void before(void) {
    if (action_is("kill-before")) raise(SIGKILL);
    if (action_is("stop-before")) raise(SIGSTOP);
}

static void after(void) {
    if (action_is("kill-after")) raise(SIGKILL);
    if (action_is("stop-after")) raise(SIGSTOP);
}

#define WRAP(call, target, ...) do { \
    int hit = matches(target); \
    if (hit) before(); \
    if (hit && action_is("eio-before")) { errno = EIO; return -1; } \
    int rc = call(__VA_ARGS__); \
    if (hit && rc == 0) after(); \
    return rc; } while (0)

int rename(const char *old, const char *new) {
    static int (*real)(const char *, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "rename");
    WRAP(real, new, old, new);
}

int renameat(int od, const char *old, int nd, const char *new) {
    static int (*real)(int, const char *, int, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "renameat");
    WRAP(real, new, od, old, nd, new);
}

int renameat2(int od, const char *old, int nd, const char *new, unsigned flags) {
    static int (*real)(int, const char *, int, const char *, unsigned);
    if (!real) real = dlsym(RTLD_NEXT, "renameat2");
    WRAP(real, new, od, old, nd, new, flags);
}
"""


def build(directory: Path) -> Path:
    """Compiles the shim into ``directory`` with the C compiler every machine of this project has
    (gcc: cargo builds C with it too); a missing or failing compiler fails the test that needs it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None, "the rename shim needs a C compiler (cc or gcc) on PATH"
    source, library = directory / "adversary_shim.c", directory / "adversary_shim.so"
    source.write_text(SOURCE)
    done = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"the rename shim does not compile: {done.stderr[-2000:]}"
    return library


def environment(shim: Path, match: str, action: str, nth: int = 1) -> dict[str, str]:
    return {
        **os.environ,
        "LD_PRELOAD": str(shim),
        "ADV_RENAME_MATCH": match,
        "ADV_RENAME_ACTION": action,
        "ADV_RENAME_NTH": str(nth),
    }


def run(shim: Path, match: str, action: str, code: str, *args: Any, nth: int = 1) -> subprocess.CompletedProcess:
    """Runs ``code`` in a new Python with the shim set to ``action`` at the ``nth`` rename whose
    destination ends with ``match``."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=environment(shim, match, action, nth),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_stopped(shim: Path, match: str, code: str, *args: Any, when: str = "before") -> subprocess.Popen:
    """Starts ``code`` and returns once it has stopped itself at the matching rename (SIGSTOP):
    the caller does what it likes meanwhile, then :func:`resume`."""
    child = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=environment(shim, match, f"stop-{when}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        pid, status = os.waitpid(child.pid, os.WNOHANG | os.WUNTRACED)
        if pid and os.WIFSTOPPED(status):
            return child
        if pid:  # it ended without reaching the rename
            child.returncode = os.waitstatus_to_exitcode(status)
            raise AssertionError(f"the child never reached the rename: {child.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            child.kill()
            raise AssertionError("the child never reached the rename in a minute")
        time.sleep(0.005)


def resume(child: subprocess.Popen) -> tuple[int, str, str]:
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=120)
    return child.returncode, out, err
