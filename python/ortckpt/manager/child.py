"""A check of a new checkpoint in a fresh Python process, before the manager commits it.

``verify_after_save="process"`` and ``validate=Forward(..., process=True)`` run their check in a
child, so that a crash in a kernel cannot take the training down. Each way in or out of the
child is a channel of its own:

- what to run travels in a file of a private scratch directory, with this process's
  ``sys.path`` (each entry as this process resolved it, then the folders of the modules it
  imported from entries it has removed since) and the file of every top-level package the
  check needs (ortckpt, the module of a user's ``check``), which the child loads from that
  very file: a vendored ortckpt, reached through a ``sys.path`` entry made at run time, a
  relative one this process has left by ``chdir``, or one removed once imported, is the one the
  child runs;
- the verdict (the problems found, or what the child raised) comes back in a file of that
  directory, read only once the child has exited with the status that says it is whole;
- whatever the child prints (stdout and stderr, one pipe) is drained as it comes and logged
  line by line by the logger ``ortckpt.manager.child`` (INFO), never read as a verdict.

The child runs in a session of its own: at its deadline, or as soon as it is done, its whole
process group is killed, so neither a hung check nor a helper it started outlives the save. Nor
does it outlive this process killed outright (SIGKILL, where no cleanup runs): a watcher forked in
the child holds the read end of a pipe whose write end only this process has, and kills the
child's group when the pipe reports end-of-file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from .. import arguments, documents, interrupts, safe_io
from ..errors import (
    CheckpointFormatError,
    CheckpointIntegrityError,
    ValidationTimeoutError,
)

log = logging.getLogger(__name__)

# The default deadline: a fixed allowance (starting Python, importing ONNX Runtime, a forward
# pass) plus the time to read the checkpoint at a slow disk's pace.
BASE_TIMEOUT = 120.0
BYTES_PER_SECOND = 64 << 20

_LOGGED_LINES = 1000  # of one child's output; past it, lines are drained and counted
_LINE_CHARS = 4096  # a longer line is logged cut
_OUTPUT_GRACE = 5.0  # seconds to finish reading the output once the child's group is gone
_HELD_SIGNAL_POLL = 0.1  # seconds between looks at a Ctrl-C a save holds, while a check runs

# Runs in the child with nothing imported but the standard library: restores the parent's
# sys.path and packages, runs the check and writes its verdict, then exits at once (a thread the
# check left running would otherwise hold the child until its deadline).
_BOOTSTRAP = """
import importlib.util, json, os, pickle, sys, traceback
request, verdict_file, lifeline = sys.argv[1], sys.argv[2], int(sys.argv[3])
if os.fork() == 0:  # the watcher: single-threaded, so it runs whatever the check holds
    os.closerange(0, lifeline)  # (it holds no end of the output pipe, which the check writes)
    try:
        while os.read(lifeline, 1):
            pass
    finally:  # the parent is gone (even SIGKILLed): nothing of its check outlives it
        os.killpg(0, 9)
os.close(lifeline)
def cut(text, limit=65536):  # a message of megabytes would make a verdict too large to read
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
try:
    with open(request, "rb") as f:
        sys.path[:] = pickle.load(f)
        for name, origin, locations in pickle.load(f):
            spec = importlib.util.spec_from_file_location(name, origin, submodule_search_locations=locations)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        function, args = pickle.load(f)
    verdict = {"problems": [cut(str(p)) for p in function(*args)]}
except BaseException as e:
    verdict = {"raised": cut(f"{type(e).__name__}: {e}".strip()), "traceback": cut(traceback.format_exc())}
fd = os.open(verdict_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
with os.fdopen(fd, "wb") as f:
    f.write(json.dumps(verdict).encode())
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # the status that says the verdict is whole
"""


def _checked_verdict(value: Any, where: str) -> dict[str, Any]:
    """{"problems": [str, ...]} or {"raised": str, "traceback": str}."""
    texts = value.get("problems") if isinstance(value, dict) and set(value) == {"problems"} else None
    if isinstance(texts, list) and all(isinstance(p, str) for p in texts):
        return value
    if (
        isinstance(value, dict)
        and set(value) == {"raised", "traceback"}
        and all(isinstance(v, str) for v in value.values())
    ):
        return value
    raise documents.DocumentError(f"{where}: neither a list of problems nor an exception")


# The verdict is a document of its own (problems name files: thousands fit).
_VERDICT = documents.Kind("verdict", max_bytes=16 << 20, max_values=1 << 20, max_depth=2, check=_checked_verdict)


def default_timeout(checkpoint_bytes: int) -> float:
    """The deadline of a check of a checkpoint of this many bytes: 120 s plus 1 s per 64 MiB."""
    return BASE_TIMEOUT + checkpoint_bytes / BYTES_PER_SECOND


def check_timeout(argument: str, timeout: Any) -> float | None:
    """A deadline given as ``argument`` (see :func:`ortckpt.arguments.seconds`), or None (the default)."""
    return None if timeout is None else arguments.seconds(argument, timeout)


def run(
    function: Callable[..., Iterable[str]],
    args: tuple[Any, ...],
    *,
    subject: object,
    what: str,
    timeout: float,
    modules: Iterable[str] = (),
) -> None:
    """Runs ``function(*args)`` (a module-level function returning the problems it found) in a
    fresh Python process, and raises :class:`~ortckpt.CheckpointIntegrityError` naming
    ``subject`` unless it found none: its problems, how the child failed (an exception, a
    signal, an exit without a verdict), or :class:`~ortckpt.ValidationTimeoutError` past
    ``timeout`` seconds. ``what`` names the child in messages and logs; ``modules``, the modules
    besides ortckpt that unpickling ``function`` and ``args`` imports."""
    with safe_io.scratch_directory() as private:  # this user's alone, removed even if this process is killed
        request = private / "request.pickle"
        verdict_file = private / "verdict.json"
        safe_io.write_new(
            request,
            pickle.dumps(_search_path())
            + pickle.dumps(_package_files(["ortckpt", *modules]))
            + pickle.dumps((function, args)),
        )
        # The lifeline: its write end stays here alone (not inheritable); when this process ends,
        # however it ends, the child's watcher reads end-of-file and kills the child's group.
        lifeline, held = os.pipe()
        command = [sys.executable, *_interpreter_flags(), "-c", _BOOTSTRAP, str(request), str(verdict_file)]
        try:
            child = subprocess.Popen(
                [*command, str(lifeline)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(lifeline,),
            )
        except BaseException:
            os.close(held)
            raise
        finally:
            os.close(lifeline)
        assert child.stdout is not None
        output = _Output(child.stdout, what)
        timed_out = False
        try:
            # In slices: a Ctrl-C that a save holds until its commit (ortckpt.interrupts) ends the
            # wait now, not when the check does (the save commits nothing: it stops before its commit).
            deadline = time.monotonic() + timeout
            while child.poll() is None:
                interrupts.before_commit()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(command, timeout)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(min(left, _HELD_SIGNAL_POLL))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also when the wait is interrupted (Ctrl-C): nothing of the child survives the save
            _kill_group(child.pid)
            child.wait()
            os.close(held)
            output.finish()
        if timed_out:
            raise ValidationTimeoutError(
                subject,
                f"the {what} ran past its timeout of {timeout:g} s and was killed (with every process it started)",
                timeout,
            )
        code = child.returncode
        if code == 0 and verdict_file.exists():
            problems = _problems(verdict_file, what)
        else:
            how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
            problems = [f"the {what} {how} without giving a verdict" + output.last_words()]
    if problems:
        raise CheckpointIntegrityError(subject, problems)


def _problems(verdict_file: Path, what: str) -> list[str]:
    """The problems in a child's verdict (what it raised is one)."""
    try:
        verdict = documents.parse(_VERDICT, safe_io.read_regular(verdict_file, limit=_VERDICT.max_bytes), what)
    except (CheckpointFormatError, OSError) as e:
        return [f"the {what} gave a verdict that cannot be read: {e}"]
    if "raised" in verdict:
        log.info("%s failed:\n%s", what, verdict["traceback"])
        return [f"the {what} failed: {verdict['raised']}"]
    return list(verdict["problems"])


def verify(directory: str) -> list[str]:
    """What :func:`ortckpt.verify` finds wrong with ``directory`` (run in the child)."""
    from .integrity import verify as verify_checkpoint

    try:
        verify_checkpoint(directory)
    except CheckpointIntegrityError as e:
        return e.problems
    return []


def _search_path() -> list[str]:
    """This process's sys.path as it resolves it, then the folders its imported top-level
    modules came from that the path no longer names (an entry removed since): after the path,
    so the child finds nothing first that this process would not. A relative entry is bound to
    the directory it named when first used (its finder holds it), though this process may have
    changed directory since; '' is the working directory whenever it is used, here as there."""
    path = []
    for item in sys.path:
        if isinstance(item, (str, os.PathLike)):
            entry = os.fspath(item)
            resolved = getattr(sys.path_importer_cache.get(entry), "path", None)
            path.append(resolved if entry and isinstance(resolved, str) else entry)
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if "." in name or name == "__main__" or not isinstance(origin, str) or not os.path.isabs(origin):
            continue
        folder = os.path.dirname(origin)
        root = os.path.dirname(folder) if hasattr(module, "__path__") else folder
        if root not in path:
            path.append(root)
    return path


def _package_files(names: Iterable[str]) -> list[tuple[str, str, list[str] | None]]:
    """(name, file, package directories) of the top-level package or module of each name, as
    this process imported it: the child loads it from the same file, whatever its sys.path
    finds first. One with no file of its own resolves by sys.path."""
    found: dict[str, tuple[str, str, list[str] | None]] = {}
    for name in names:
        top = name.partition(".")[0]
        module = sys.modules.get(top)
        origin = getattr(module, "__file__", None)
        if top in found or top == "__main__" or not isinstance(origin, str) or not os.path.isfile(origin):
            continue
        locations = getattr(module, "__path__", None)
        found[top] = (top, origin, None if locations is None else list(locations))
    return list(found.values())


def _interpreter_flags() -> list[str]:
    # The flags this interpreter runs with (-S, -I, -E, -O, -X ..., -W ...), as multiprocessing
    # passes them to its children.
    flags: Callable[[], list[str]] = getattr(subprocess, "_args_from_interpreter_flags", list)
    return flags()


def _kill_group(pid: int) -> None:
    # The child's session is its process group: the child and whatever it started and did not
    # move to a session of its own.
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class _Output:
    """Drains the child's stdout and stderr (one pipe) in a thread as they come, logging each
    line: a child that prints a lot never blocks on a full pipe, and nothing it prints is read
    as its verdict."""

    def __init__(self, pipe: IO[bytes], what: str) -> None:
        self._what = what
        self._tail: deque[str] = deque(maxlen=3)
        self._thread = threading.Thread(target=self._drain, args=(pipe,), name="ortckpt-check-output", daemon=True)
        self._thread.start()

    def _drain(self, pipe: IO[bytes]) -> None:
        lines = 0
        partial = b""
        with pipe:
            while chunk := os.read(pipe.fileno(), 1 << 16):
                *complete, partial = (partial + chunk).split(b"\n")
                if len(partial) > _LINE_CHARS:  # a line without end is logged in pieces
                    complete.append(partial)
                    partial = b""
                for line in complete:
                    lines += 1
                    self._line(line, lines)
            if partial:
                lines += 1
                self._line(partial, lines)
        if lines > _LOGGED_LINES:
            log.info("%s: %d more lines of output not logged", self._what, lines - _LOGGED_LINES)

    def _line(self, line: bytes, number: int) -> None:
        text = line[:_LINE_CHARS].decode(errors="replace").rstrip()
        if text:
            self._tail.append(text)
        if number <= _LOGGED_LINES:
            log.info("%s: %s", self._what, text)

    def finish(self) -> None:
        """Waits for the rest of the output; a process that left the child's session may hold
        the pipe open: the thread then ends with it, in the background."""
        self._thread.join(_OUTPUT_GRACE)

    def last_words(self) -> str:
        """The child's last lines of output, for a message (empty if none)."""
        return f"; its last output: {' | '.join(self._tail)}" if self._tail else ""


__all__ = ["BASE_TIMEOUT", "BYTES_PER_SECOND", "check_timeout", "default_timeout", "run", "verify"]
