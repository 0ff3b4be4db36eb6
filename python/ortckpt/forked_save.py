"""A full save of the state ONNX Runtime trains, taken by a forked process whose copy of ONNX
Runtime's buffer grows in place: synchronous (``save_checkpoint(state, path, True)``: :func:`save`),
or with the trainer blocked only while it forks (``CheckpointManager(async_save="fork")``).

The optimizer's moments are reachable only through ONNX Runtime's ``save_checkpoint``, which
serialises the whole state in the calling thread (seconds, for a large state). A fork gives a
copy-on-write image of the process at that instant, so the child can run that serialisation
while the parent trains on: :func:`start` stages the checkpoint's temporary files, forks, and
returns; the child has ONNX Runtime's saver write the staged files (:func:`ortckpt.live.write_staged`),
reports over a pipe and leaves by ``os._exit``; :meth:`ForkedSave.finish`, in the parent's
background writer, waits for that report with a deadline, then seals and commits the staged
files in the parent (the parent's ``Staging`` stays the one owner of the temporaries: sealing
drops a data file the checkpoint does not use). A child that raised, died or hung means the
save failed: :class:`~ortckpt.ForkedSaveError`, the child killed, the temporaries removed,
nothing committed.

The dangers of forking a process that has threads, and what guards each:

- only the forking thread exists in the child: a lock another thread held at the fork stays
  held there. The child runs nothing but ONNX Runtime's saver (which, for a state in CPU
  memory, copies tensors into a flatbuffers buffer and writes a file: no thread pool, no lock
  of ONNX Runtime's that its Module holds between calls) and a few system calls; glibc's
  malloc is fork-safe. Anything else that would hang there hits the deadline. Not for a state
  on a GPU (a device context does not survive a fork): :func:`available` refuses it;
- the child inherits the process's signal handlers: a Ctrl-C or SIGTERM sent to the process
  group must not run the preemption handler or raise ``KeyboardInterrupt`` there. The signals
  that have Python handlers are blocked across the fork and ignored in the child before they
  are unblocked there (the parent decides what a signal does to its save);
- the child inherits the lock file of the run's directory: it dies with the thread that forked
  it (``PR_SET_PDEATHSIG``), so a trainer killed outright leaves no child holding the lock;
- it must not run ``atexit`` handlers, flush inherited buffers or join threads that do not
  exist: it leaves by ``os._exit``, whatever happens;
- CPython 3.12+ warns on a fork in a process with threads (the danger above): that warning, and
  only it, is silenced for this fork;
- memory: the child's pages are shared with the trainer until either writes them; pages the
  trainer updates during the save are copied (at most the state's size, once), beside what
  ONNX Runtime's serialisation holds in the child. The child runs no garbage collection (it
  would write to every Python object's header, copying the pages they sit on).

In the child, ONNX Runtime's flatbuffers buffer grows in place (``src/io/in_place.rs``): its
library's ``operator new[]`` and ``delete[]`` slots, found in the parent (the child asks the
dynamic loader nothing), are pointed at an allocator that places each larger buffer to end
where the one before ends, in a reserved mapping a helper thread populates ahead. The saver
then touches each page of its buffer once (2.4 GiB of fresh memory and 622,603 page faults
for a 768 MiB checkpoint become 0.95 GiB, populated on the other core), and the child holds
less than ONNX Runtime's own save does. Only for the ONNX Runtime release whose saver was read
for it (1.19: no other array of 1 MiB or more is taken while it saves); any other, or a slot
not as planned, saves as ONNX Runtime does. :func:`save` is a synchronous full save this way.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import _boundary, interrupts, live, safe_io
from .backings.mapped import MappedBacking
from .errors import ForkedSaveError, ForkedSaveTimeoutError

# The deadline of a child's save: a fixed allowance plus the time to write the checkpoint at a
# slow disk's pace (seconds); None: that default. Tests lower it.
TIMEOUT: float | None = None
BASE_TIMEOUT = 120.0
BYTES_PER_SECOND = 64 << 20

# The environment variable that keeps ortckpt from forking (set, and not "0").
NO_FORK = "ORTCKPT_NO_FORK"

# Whether a child grows ONNX Runtime's buffer in place (tests compare with it off).
GROW_IN_PLACE = True
_ORT_LIBRARY = "onnxruntime_pybind11_state"  # (the file ONNX Runtime's saver is compiled into)

_REPORT_LIMIT = 4000  # bytes of a child's error message: its report is one write, under Linux's PIPE_BUF
_POLL = 0.05  # seconds between looks at the child while its report has not come
_PR_SET_PDEATHSIG = 1


def available(ort_state: Any) -> bool:
    """Whether a save of ``ort_state`` can be taken by a fork here: Linux (fork, ``/proc``,
    ``prctl``), a state in CPU memory, and no ``ORTCKPT_NO_FORK`` (set and not ``0``) in the
    environment (a program that must not fork: every save then runs in the process)."""
    if os.environ.get(NO_FORK, "") not in ("", "0"):
        return False
    if not (sys.platform.startswith("linux") and hasattr(os, "fork") and os.path.isdir("/proc/self/fd")):
        return False
    names = ort_state.parameter_names()
    return not names or str(ort_state.get_parameter(names[0]).data.device_name()).lower() == "cpu"


def default_timeout(checkpoint_bytes: int) -> float:
    """120 s plus 1 s per 64 MiB of checkpoint."""
    return BASE_TIMEOUT + checkpoint_bytes / BYTES_PER_SECOND


class ForkedSave:
    """A child writing the staged checkpoint ``target`` (or, with no staging, files in memory);
    :meth:`finish` commits it, :meth:`abandon` drops it."""

    def __init__(
        self,
        pid: int,
        report: int,
        staging: _boundary.Staging | None,
        scratch: contextlib.ExitStack,
        target: Path,
        timeout: float,
    ) -> None:
        self.pid = pid
        self._scratch = scratch  # (the scratch directory the child's saver was given the files through)
        self.target = target
        self.timeout = timeout
        # Bytes ONNX Runtime's buffer took in place in the child (0: it grew as ONNX Runtime's
        # does), once the child has reported.
        self.placed: int | None = None
        self._report = report
        self._staging = staging
        self._started = time.monotonic()
        self._reaped = False

    def finish(
        self,
        *,
        durable: bool,
        lock_timeout: float | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Waits for the child (at most the deadline), then seals and commits its files at the
        target (``before_commit()`` run just before). Any failure: the child killed, the staged
        files removed, then raised."""
        staging = self._staging
        assert staging is not None, "finish() commits staged files"

        def commit() -> None:
            staging.seal()
            if before_commit is not None:
                before_commit()
            staging.commit(durable=durable, lock_timeout=lock_timeout)

        self.completed(then=commit)

    def completed(self, *, then: Callable[[], None] = lambda: None) -> None:
        """Waits for the child's report (at most the deadline), then runs ``then()``; the child
        is reaped after it. Any failure (the child's, as a :class:`ForkedSaveError`, or
        ``then()``'s): the child killed, the staged files removed, then raised."""
        try:
            problem = self._wait()
            if problem is not None:
                try:
                    raise problem
                finally:
                    del problem  # (no cycle through this frame: with the collector off it would hold the caller's)
            then()
        except BaseException:
            self.abandon()
            raise
        finally:
            self._close_report()
        self._reap(block=True)  # (it left once it reported: its exit ran beside then())

    def abandon(self) -> None:
        """Kills the child if it still runs, reaps it and removes the staged files."""
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._reap(block=True)
        if self._staging is not None:
            self._staging.discard()
        self._close_report()

    def _wait(self) -> ForkedSaveError | None:
        """The child's failure, or None once it reported success (its files are written then:
        its exit, tearing down a copy of the trainer's address space, is not waited for)."""
        deadline = self._started + self.timeout
        report = b""
        waiting = select.poll()  # (poll, not select: a descriptor past 1023 is fine)
        waiting.register(self._report, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return ForkedSaveTimeoutError(
                    self.target,
                    f"the forked save ran past its deadline ({self.timeout:g} s) and was killed",
                    self.timeout,
                )
            ready = waiting.poll(min(left, _POLL) * 1000)
            ended = False
            if ready:
                chunk = os.read(self._report, 65536)
                report += chunk
                ended = not chunk  # (end of file: the child is gone)
            if _succeeded(report):  # (one write under PIPE_BUF: read whole)
                return self._verdict(report, None)
            status = self._reap(block=ended)
            if status is not None or ended:
                # (the child's last words may still be in the pipe once it has exited)
                report += self._drain()
                return self._verdict(report, status)

    def _drain(self) -> bytes:
        data = b""
        waiting = select.poll()
        waiting.register(self._report, select.POLLIN)
        while waiting.poll(0):
            chunk = os.read(self._report, 65536)
            if not chunk:
                break
            data += chunk
        return data

    def _verdict(self, report: bytes, status: int | None) -> ForkedSaveError | None:
        if _succeeded(report):
            self.placed = int(report[3:])
            return None  # (the report is written after the files are: the exit status is only the way out)
        if report.startswith(b"error:"):
            return ForkedSaveError(self.target, "the forked save raised " + report[6:].decode(errors="replace"))
        if status is not None and os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name if os.WTERMSIG(status) in signal.valid_signals() else "?"
            return ForkedSaveError(self.target, f"the forked save's process was killed by signal {name}")
        code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else "unknown"
        return ForkedSaveError(self.target, f"the forked save's process exited (status {code}) without saving")

    def _reap(self, *, block: bool) -> int | None:
        """The child's wait status once it has exited (reaped), else None."""
        if self._reaped:
            return None
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # (reaped by someone else: a SIGCHLD handler of the program's)
            self._reaped = True
            return None
        if pid == 0:
            return None
        self._reaped = True
        return status

    def _close_report(self) -> None:
        self._scratch.close()
        if self._report >= 0:
            os.close(self._report)
            self._report = -1


def _succeeded(report: bytes) -> bool:
    """Whether ``report`` is a child's success: ``ok:`` and the bytes its buffer took in place."""
    return report.startswith(b"ok:") and report[3:].isdigit()


class ForkFailed(OSError):
    """``fork()`` itself failed (no process or memory to be had): nothing was started."""


def start(ort_state: Any, target: Path, *, checkpoint_bytes: int, shown: str | None = None) -> ForkedSave:
    """Stages the checkpoint ``target`` (and its data file) and forks a child that has ONNX
    Runtime save ``ort_state`` as it is now into them; returns once forked. ``shown``: the
    checkpoint's name in messages (default: ``target``)."""
    staging = _boundary.stage(target, with_data=True)
    return _fork(
        lambda directory: live.write_staged(ort_state, staging, directory),
        staging,
        Path(shown) if shown is not None else target,
        checkpoint_bytes,
    )


def _fork(
    work: Callable[[Path], None], staging: _boundary.Staging | None, shown: Path, checkpoint_bytes: int
) -> ForkedSave:
    """Forks a child that runs ``work(directory)`` (a scratch directory made here) with ONNX
    Runtime's buffer grown in place, and reports; returns once forked. ``staging`` is discarded
    when this fails."""
    timeout = TIMEOUT if TIMEOUT is not None else default_timeout(checkpoint_bytes)
    read = write = -1
    pid = 0
    scratch = contextlib.ExitStack()
    # Anything raised from here to the return (a SIGTERM handler's SystemExit, run as the signals
    # are unblocked after the fork) leaves nothing behind: no descriptor, no temporary, no child.
    try:
        # The directory through which ONNX Runtime's saver is given the files, made here: the
        # child takes no lock of tempfile's (another thread may have held one at the fork).
        directory = scratch.enter_context(safe_io.scratch_directory())
        read, write = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        handled = _python_handled_signals()
        prctl = _prctl()  # (looked up here: the child asks the dynamic loader nothing)
        plan = _in_place_plan()
        with _signals_blocked(handled), _fork_warning_silenced():
            try:
                pid = os.fork()
            except OSError as e:
                raise ForkFailed(e.errno, f"fork: {e.strerror}") from None
            if pid == 0:  # the child: never returns
                _child(work, directory, read, write, parent, handled, prctl, plan)
        os.close(write)
        write = -1
        return ForkedSave(pid, read, staging, scratch, shown, timeout)
    except BaseException:
        if pid > 0:
            _kill_and_reap(pid)
        for descriptor in (read, write):
            if descriptor >= 0:
                os.close(descriptor)
        if staging is not None:
            staging.discard()
        scratch.close()
        raise


def _kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # (reaped by a SIGCHLD handler of the program's)
        os.waitpid(pid, 0)


def _child(
    work: Callable[[Path], None],
    directory: Path,
    read: int,
    write: int,
    parent: int,
    handled: list[int],
    prctl: Any,
    plan: _boundary.InPlacePlan | None,
) -> None:
    """``work(directory)`` (ONNX Runtime's save), its outcome written to ``write``; then
    ``os._exit`` (no atexit handler, no buffer flushed, no thread joined)."""
    report = b"error: nothing (the child stopped before its save)"
    try:
        gc.disable()  # (a collection writes to every object's header: a copy of each page they share)
        for number in handled:  # (blocked since before the fork: ignored before any is delivered)
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
        os.close(read)
        if prctl is not None:  # (without it, a child whose trainer died finishes its save, then exits)
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # (the trainer died before prctl took effect)
            os._exit(3)
        if plan is not None:
            _boundary.grow_in_place(plan)  # (false, and nothing changed, where it cannot)
        work(directory)
        report = b"ok:%d" % _boundary.placed_in_place()
    except BaseException as e:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        report = b"error:" + text.encode(errors="replace")[:_REPORT_LIMIT]
    finally:
        try:
            os.write(write, report)
        finally:
            os._exit(0 if _succeeded(report) else 1)


def save(
    ort_state: Any,
    target: Path,
    *,
    checkpoint_bytes: int,
    durable: bool = False,
    lock_timeout: float | None = None,
) -> ForkedSave | None:
    """A synchronous full save of ``ort_state`` to the file ``target`` by a forked child (its
    buffer grown in place), sealed and committed here, a Ctrl-C held until just before the
    commit (:mod:`ortckpt.interrupts`); the finished save, or None where no child could take it
    (:func:`available` says no, no fork to be had, or the child failed: the caller then saves
    in this process, where a failure is raised as what it is). Whatever the child wrote is
    removed when it fails; nothing is committed but a sealed file."""
    if not available(ort_state) or live.is_nominal(ort_state):
        return None
    try:
        child = start(ort_state, target, checkpoint_bytes=checkpoint_bytes)
    except ForkFailed:
        return None
    # While the child serialises: the clean page cache of the files it replaces, dropped (their
    # bytes stay), so the child's write reuses that memory as an overwrite in place would.
    try:
        for replaced in (target, Path(f"{target}.data")):
            _boundary.release_clean_cache(replaced)
    except BaseException:  # (a signal handler's exception here: the child killed and reaped, nothing staged left)
        child.abandon()
        raise
    try:
        child.finish(durable=durable, lock_timeout=lock_timeout, before_commit=interrupts.before_commit)
    except ForkedSaveError:
        return None
    return child


def snapshot(ort_state: Any, *, checkpoint_bytes: int) -> MappedBacking | None:
    """A copy of everything ``ort_state`` holds now, its optimizer state included, as ONNX
    Runtime saves it into memory (:func:`ortckpt.live.snapshot`), taken by a forked child (its
    buffer grown in place) while this thread waits; None where no child could take it (the
    caller then has ONNX Runtime save into memory here)."""
    if not available(ort_state) or live.is_nominal(ort_state):
        return None
    with live.memory_files() as files:
        try:
            child = _fork(
                lambda directory: live.write_into(ort_state, files, directory), None, Path("(memory)"), checkpoint_bytes
            )
        except ForkFailed:
            return None
        try:
            child.completed()
        except ForkedSaveError:  # (killed and reaped, one past its deadline too)
            return None
        return live.opened(files)


def _in_place_plan() -> _boundary.InPlacePlan | None:
    """Where ONNX Runtime's saver takes its arrays, for a child to grow its buffer in place;
    None where that is off or not for this ONNX Runtime (module docstring)."""
    if not GROW_IN_PLACE:
        return None
    version = str(getattr(sys.modules.get("onnxruntime"), "__version__", ""))
    if not version.startswith("1.19."):
        return None
    return _boundary.in_place_plan(_ORT_LIBRARY)


def _prctl() -> Any:
    """libc's ``prctl``, or None where it cannot be had."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _python_handled_signals() -> list[int]:
    """The signals whose handler is a Python function (the preemption handler, SIGINT's)."""
    handled = []
    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(number)):
                handled.append(int(number))
    return handled


@contextlib.contextmanager
def _signals_blocked(numbers: list[int]) -> Iterator[None]:
    """``numbers`` blocked in this thread for the block (a signal that comes meanwhile is
    delivered when it ends: in the parent, to its handler; in the child, ignored)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def _fork_warning_silenced() -> Iterator[None]:
    """CPython 3.12+'s DeprecationWarning on a fork in a process with threads, and only it
    (the module docstring says why this fork is safe enough)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning
        )
        yield
