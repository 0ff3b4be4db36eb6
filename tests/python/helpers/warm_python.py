"""A Python interpreter kept warm for the tests that start many processes: imported modules paid once.

Starting an interpreter that imports NumPy and ortckpt costs about 0.35 CPU s, ONNX Runtime's training
API with them about 0.7, more than most of the commands the tests run take. ``WarmPython(python,
preload)`` starts ``python`` once on this file (the server), which imports ``preload`` and then forks a
child per command. Each child is a process of its own that no earlier command touched: the caller's
working directory, environment (TMPDIR and TZ read again), umask, ignored signals and signal mask, and
stdin/stdout/stderr (the descriptors themselves, passed over a UNIX socket, so pipes read live; no other
descriptor of the server's), streams buffered as an interpreter buffers them, ``python``'s own argument
forms (``-m MODULE``, ``-c CODE``, ``SCRIPT``) in a ``__main__`` of its own, random, numpy.random and
tempfile's names seeded anew, and the end an interpreter has: its own, the server's interpreter
finalized in the child (``SystemExit``'s code, 1 and ``sys.excepthook`` for an exception, death by
SIGINT for an unhandled KeyboardInterrupt, non-daemon threads joined, ``atexit`` run, open files
flushed, objects finalized). The caller gets its pid (signals go to it directly) and its exit status,
as from ``subprocess``.

What a warm child cannot have is a fresh interpreter's start: the modules in ``preload`` are imported
before the command's environment is set, and the hash seed (``str`` hashes, set order) is the server's,
the same for every command. So the server is keyed by the variables an interpreter reads at its start
(``PYTHON*``, the locale's): a command whose environment differs in them is refused, as is an option
(``-u``, ``-X``) of the interpreter's, not run wrong. Its parent is the server, its resource limits the
server's. Tests of import-time behaviour, or of the interpreter's start itself, start their own.

Protocol: one request a line on the socket, ``{"argv", "cwd", "env", "new_session", "umask", "ignored",
"mask"}`` with three descriptors (stdin, stdout, stderr); the server answers ``{"pid": ...}`` when it
has forked, then ``{"returncode": ...}`` (negative: the signal that ended the child) when the child
ends. One command at a time: one started while another's exit status is unread runs in a spare server.
The server ends when the socket closes; a caller past a deadline, or interrupted while it waits, kills
the command and the server's process group, and the next command starts a new server.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

# ---- the server (this file run as a script) ---------------------------------------------------------


def _std_stream(fd: int, name: str, template: io.TextIOWrapper) -> io.TextIOWrapper:
    """A standard stream on ``fd`` as an interpreter's start makes one (create_stdio): named
    ``<stdin>``, no newline translation, stdin always buffered; with ``-u``/PYTHONUNBUFFERED stdout
    and stderr unbuffered (write-through), else stdout line-buffered only on a terminal and stderr
    always (3.9+); the encoding, errors and that choice of the server's own stream (``template``)."""
    raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
    raw.name = f"<{name}>"  # type: ignore[misc]
    buffered = fd == 0 or not template.write_through  # (sys.flags does not show -u)
    stream = (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)) if buffered else raw
    line = buffered and fd != 0 and (fd == 2 or raw.isatty())
    text = io.TextIOWrapper(
        stream,  # type: ignore[arg-type]
        encoding=template.encoding,
        errors=template.errors,
        newline="\n",
        line_buffering=line,
        write_through=not buffered,
    )
    text.mode = "r" if fd == 0 else "w"  # type: ignore[misc]
    return text


def _main_module(**names: object) -> types.ModuleType:
    """A new ``__main__`` with what an interpreter's start puts in it, in sys.modules for the command's life."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter)
    main.__dict__.update(names)
    sys.modules["__main__"] = main
    return main


def _run_command(argv: list[str], cwd: str) -> None:
    """``python ARGV`` in this (forked) interpreter: sys.argv, sys.path[0] and __main__ as python sets them."""
    sys.orig_argv = [sys.orig_argv[0], *argv]
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path.insert(0, cwd)
        _main_module()
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined] (what `python -m` runs)
        return
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        code = compile(argv[1], "<string>", "exec")
        main = _main_module()
    else:
        script = os.path.abspath(os.path.join(cwd, argv[0]))
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        with io.open_code(script) as source:
            code = compile(source.read(), script, "exec")
        loader = importlib.machinery.SourceFileLoader("__main__", script)
        main = _main_module(__file__=script, __cached__=None, __loader__=loader)
    exec(code, main.__dict__)


# The signals whose disposition exec passes on (an ignored one stays ignored, a handled one is reset), but
# those subprocess restores (SIGPIPE, SIGXFSZ) and python's start then sets again.
_INHERITED_SIGNALS = sorted(
    set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
)


def _signals_from(ignored: list[int], mask: list[int]) -> None:
    """The caller's ignored signals and its thread's signal mask, as exec would leave them; SIGINT,
    unless ignored, with python's own handler."""
    for signum in _INHERITED_SIGNALS:
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, signal.SIG_IGN if signum in ignored else default)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _command_traceback(error: BaseException) -> types.TracebackType | None:
    """The traceback from the command's first frame, as an interpreter prints it (none of the server's)."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _child(request: dict, fds: list[int], channel: socket.socket) -> None:
    """In the forked child: the caller's descriptors, directory and environment, the command, then
    the interpreter's own end: SystemExit raised out of the server's main module, and the interpreter
    finalized as a fresh one is (threads joined, atexit run, buffers flushed, objects finalized)."""
    channel.close()
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    templates = (sys.__stdin__, sys.__stdout__, sys.__stderr__)  # (stderr's errors are backslashreplace)
    streams = [_std_stream(fd, name, templates[fd]) for fd, name in enumerate(("stdin", "stdout", "stderr"))]
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    _signals_from(request["ignored"], request["mask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # (TMPDIR read again, from this environment)
    time.tzset()  # (and TZ)
    # A fresh interpreter seeds its generators from the OS: `random` and tempfile's names reseed
    # themselves in a forked child, numpy.random's global state does not.
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    try:
        _run_command(request["argv"], request["cwd"])
    except SystemExit:
        raise  # (the interpreter's own: its code, or its message and 1)
    except BaseException as error:
        error.__traceback__ = _command_traceback(error)  # (the hook prints the exception's own)
        sys.excepthook(type(error), error, error.__traceback__)
        if type(error) is KeyboardInterrupt:  # (an interpreter then ends by SIGINT, after its finalization)
            sys.excepthook = lambda *_: None  # (printed above)
            raise
        raise SystemExit(1) from None
    raise SystemExit(0)


def _send(channel: socket.socket, message: dict) -> None:
    channel.sendall((json.dumps(message) + "\n").encode())


def serve(channel_fd: int, preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    # What preload made outside the collector's reach: each child's collections and its finalization
    # then skip it (half a child's end, 75 -> 30 ms of CPU, its pages not copied to be walked).
    gc.freeze()
    channel = socket.socket(fileno=channel_fd)
    pending = b""
    ended: int | None = None
    while True:
        received: list[int] = []
        while b"\n" not in pending:
            data, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
            if not data:
                return
            pending += data
            received += fds  # (they come with the request's first bytes)
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        if ended is not None:  # (its status read: the caller asks for the next command)
            os.waitpid(ended, 0)
        pid = os.fork()
        if pid == 0:
            _child(request, received, channel)  # (never returns: it raises the child's end)
        for fd in received:
            os.close(fd)
        _send(channel, {"pid": pid})
        # Left a zombie until the caller has read its status (as subprocess's child is until reaped): a
        # signal the caller sends meanwhile cannot reach another process given its pid.
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        assert info is not None  # (None only with WNOHANG)
        ended = pid
        _send(channel, {"returncode": info.si_status if info.si_code == os.CLD_EXITED else -info.si_status})


# ---- the client ----------------------------------------------------------------------------------------

# What an interpreter reads of its environment as it starts (its flags and paths, its locale and so
# its streams' encoding): the server's must be the command's.
STARTUP_VARIABLES = ("PYTHON", "LC_", "LANG")


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES)}


def _exec_state() -> dict:
    """What exec passes from the caller besides descriptors, directory and environment: the umask,
    the ignored signals, this thread's signal mask."""
    with open("/proc/self/status") as status:  # (read, not set and set back: another thread may create a file)
        umask = int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    ignored = [s for s in _INHERITED_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]
    return {"umask": umask, "ignored": ignored, "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}


class WarmProcess:
    """One command's child, as ``subprocess.Popen`` shows one: pid, stdin/stdout/stderr (the pipes
    asked for), send_signal, kill, poll, wait, communicate, returncode. The server is this command's
    until its exit status is read."""

    def __init__(self, server: WarmPython, pid: int, stdin, stdout, stderr) -> None:
        self.server, self.pid = server, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._read: dict[int, object] = {}
        self._readers: list[threading.Thread] | None = None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def abandon(self) -> None:
        """Kills the child and the server (a deadline passed, or an exception came while waiting: as
        ``subprocess.run`` kills its child), and lets the server go; the next command starts another."""
        if self.returncode is None:
            self.kill()  # (in a session of its own, the server's group is not its)
            self.server.stop()
            self.returncode = -signal.SIGKILL
            self.server.lock.release()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; past ``timeout``, ``subprocess.TimeoutExpired`` and the child still runs
        (any other exception: the child and the server killed)."""
        if self.returncode is None:
            try:
                reply = self.server.reply(None if timeout is None else time.monotonic() + timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(["<warm>", str(self.pid)], timeout or 0) from None
            except BaseException:
                self.abandon()
                raise
            self.returncode = reply["returncode"]
            self.server.lock.release()  # (the server takes the next command)
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def communicate(self, timeout: float | None = None) -> tuple:
        """Reads stdout and stderr to their ends, then waits; past ``timeout``,
        ``subprocess.TimeoutExpired`` and the child still runs (a later call reads on)."""
        if self.stdin is not None:
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:  # (threads: a grandchild holding a pipe blocks a reader, not a deadline)
            self._readers = [
                threading.Thread(target=lambda n=n, s=stream: self._read.__setitem__(n, s.read()), daemon=True)
                for n, stream in enumerate((self.stdout, self.stderr))
                if stream is not None
            ]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(["<warm>", str(self.pid)], timeout or 0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        return self._read.get(0), self._read.get(1)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        if self.returncode is None:
            self.kill()
            self.wait(60)


class WarmPython:
    """``python`` started once with ``preload`` imported (the server above), then forking a child per
    command: :meth:`popen` and :meth:`run` take what ``subprocess`` does for ``[python, *argv]``."""

    def __init__(self, python: str, preload: tuple[str, ...], env: dict[str, str] | None = None) -> None:
        self.python, self.preload = python, preload
        self.env = dict(os.environ if env is None else env)
        self.process: subprocess.Popen | None = None
        self.channel: socket.socket | None = None
        self.pending = b""
        self.lock = threading.Lock()
        self.spare: WarmPython | None = None  # (for a command while this one runs one)

    def start(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's stderr, for its life)
        self.pending = b""
        ours, theirs = socket.socketpair()
        self.channel = ours
        self.process = subprocess.Popen(
            [self.python, __file__, str(theirs.fileno()), *self.preload],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            pass_fds=[theirs.fileno()],
            env=self.env,
            start_new_session=True,
        )
        theirs.close()

    def server_log(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def reply(self, deadline: float | None) -> dict:
        assert self.channel is not None
        while b"\n" not in self.pending:
            self.channel.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0))
            try:
                chunk = self.channel.recv(65536)
            except (TimeoutError, BlockingIOError):  # (a timeout of 0 makes the socket non-blocking)
                raise TimeoutError from None
            if not chunk:
                raise AssertionError(f"the warm interpreter {self.python} ended:\n{self.server_log()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        """Kills the server and the child it runs (a command past its deadline, a server that died)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None
        assert self.channel is not None
        self.channel.close()
        self.log.close()

    def popen(
        self,
        argv: list[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stdin=None,
        stdout=None,
        stderr=None,
        text: bool = False,
        start_new_session: bool = False,
    ) -> WarmProcess:
        """``subprocess.Popen([python, *argv], ...)`` with stdin/stdout/stderr None (this process's),
        ``subprocess.PIPE`` or ``subprocess.DEVNULL``."""
        argv = list(map(str, argv))
        if not argv or argv[0] == "-" or (argv[0].startswith("-") and argv[0] not in ("-m", "-c")):
            raise ValueError(f"{argv[:1]}: a warm child runs -m MODULE, -c CODE or SCRIPT, no option of python's")
        env = dict(os.environ if env is None else env)
        if startup_environment(env) != startup_environment(self.env):
            raise ValueError(
                f"{startup_environment(env)} is not the warm interpreter's {startup_environment(self.env)}: "
                "start a process of its own"
            )
        if not self.lock.acquire(blocking=False):
            # Busy (until its command's exit status is read): this command runs at once, as with
            # subprocess, in a second warm interpreter (waiting could be forever: in this thread).
            with _SPARES:
                if self.spare is None:
                    self.spare = WarmPython(self.python, self.preload, self.env)
            return self.spare.popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                start_new_session=start_new_session,
            )
        ends, ours = [], []
        try:
            for fd, spec in enumerate((stdin, stdout, stderr)):
                if spec is None:
                    ends.append(os.dup(fd))
                    ours.append(None)
                elif spec == subprocess.DEVNULL:
                    ends.append(os.open(os.devnull, os.O_RDWR))
                    ours.append(None)
                elif spec == subprocess.PIPE:
                    read, write = os.pipe()
                    theirs, mine = (read, write) if fd == 0 else (write, read)
                    ends.append(theirs)
                    mode = ("w" if fd == 0 else "r") + ("" if text else "b")
                    ours.append(open(mine, mode))  # noqa: SIM115 (the caller's end, closed by the caller)
                else:
                    raise ValueError(f"{spec!r}: None, PIPE or DEVNULL")
            if self.process is not None and self.process.poll() is not None:
                self.stop()  # (it died between commands: its socket and log closed)
            if self.process is None:
                self.start()
            assert self.channel is not None
            request = {"argv": argv, "cwd": os.path.abspath(cwd or os.getcwd()), "env": env}
            request.update(new_session=start_new_session, **_exec_state())
            socket.send_fds(self.channel, [(json.dumps(request) + "\n").encode()], ends)
            pid = self.reply(time.monotonic() + 120)["pid"]
        except BaseException:
            self.stop()
            self.lock.release()
            for stream in ours:
                if stream is not None:
                    stream.close()
            raise
        finally:
            for fd in ends:
                os.close(fd)
        return WarmProcess(self, pid, *ours)

    def run(
        self,
        argv: list[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        text: bool = True,
    ) -> subprocess.CompletedProcess:
        """``subprocess.run([python, *argv], capture_output=True, ...)``; past ``timeout`` the child is
        killed with the server and ``subprocess.TimeoutExpired`` raised."""
        process = self.popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text
        )
        try:
            out, err = process.communicate(timeout)
        except BaseException:
            # (its pipes left to the readers: one a grandchild keeps open would block a close here)
            process.abandon()
            raise
        process.stdout.close()
        process.stderr.close()
        return subprocess.CompletedProcess([self.python, *argv], process.returncode, out, err)

    def close(self) -> None:
        if self.spare is not None:
            self.spare.close()
        if self.process is None or self.channel is None:
            return
        self.channel.shutdown(socket.SHUT_WR)  # (the server ends when its socket does)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self.stop()


_SERVERS: dict[tuple, WarmPython] = {}
_SPARES = threading.Lock()  # (one spare made for a busy server, when two threads find it busy at once)


def warm(python: str, preload: tuple[str, ...], env: dict[str, str] | None = None) -> WarmPython:
    """The one warm interpreter of ``python`` with ``preload`` and ``env``'s start-up variables, started
    at its first command; :func:`close_all` ends them (tests/conftest.py, as the session ends)."""
    key = (python, preload, tuple(sorted(startup_environment(dict(os.environ if env is None else env)).items())))
    if key not in _SERVERS:
        _SERVERS[key] = WarmPython(python, preload, env)
    return _SERVERS[key]


def close_all() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


if __name__ == "__main__":
    del sys.path[0]  # (this folder: each command puts its own first, as python does)
    serve(int(sys.argv[1]), sys.argv[2:])
