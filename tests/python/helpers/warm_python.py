"""A Python interpreter kept warm for the tests that start many processes: imported modules paid once.

Starting an interpreter that imports NumPy and ortckpt costs about 0.35 CPU s, ONNX Runtime's training
API with them about 0.7, more than most of the commands the tests run take. ``WarmPython(python,
preload)`` starts ``python`` once on this file (the server), which imports ``preload`` and then forks a
child per command. Each child is a process of its own that no earlier command touched: the caller's
working directory, environment and stdin/stdout/stderr (the descriptors themselves, passed over a
UNIX socket, so pipes read live), ``python``'s own argument forms (``-m MODULE``, ``-c CODE``,
``SCRIPT``), the exit an interpreter gives (``SystemExit``'s code, 1 and a traceback for an exception,
death by SIGINT for an unhandled KeyboardInterrupt, non-daemon threads joined and ``atexit`` run). The
caller gets its pid (signals go to it directly) and its exit status, as from ``subprocess``.

What a warm child cannot have is a fresh interpreter's start: the modules in ``preload`` are imported
before the command's environment is set. So the server is keyed by the variables an interpreter reads
at its start (``PYTHON*``): a command whose environment differs in them is refused, not run wrong.
Tests of import-time behaviour, or of the interpreter's start itself, start their own.

Protocol: one request a line on the socket, ``{"argv", "cwd", "env", "new_session"}`` with three
descriptors (stdin, stdout, stderr); the server answers ``{"pid": ...}`` when it has forked, then
``{"returncode": ...}`` (negative: the signal that ended the child) when the child ends. One command at
a time. The server ends when the socket closes; a caller past a deadline kills the server's process
group, the child with it, and the next command starts a new server.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
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
import traceback
import types

# ---- the server (this file run as a script) ---------------------------------------------------------


def _std_stream(fd: int, mode: str, template: io.TextIOWrapper) -> io.TextIOWrapper:
    """A text stream on ``fd`` as an interpreter's start makes one: stdout line-buffered only on a
    terminal, stderr line-buffered always (3.9+), the encoding of the server's own."""
    line = fd == 2 or (fd == 1 and os.isatty(fd))
    return open(
        fd, mode, encoding=template.encoding, errors=template.errors, closefd=False, buffering=1 if line else -1
    )


def _exit_code(exit_: SystemExit) -> int:
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _run_command(argv: list[str], cwd: str) -> None:
    """``python ARGV`` in this (forked) interpreter: sys.argv, sys.path[0] and __main__ as python sets them."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, cwd)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        script = os.path.join(cwd, argv[0])
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
        runpy.run_path(script, run_name="__main__")


def _print_exception(error: BaseException) -> None:
    """The traceback an interpreter prints: from the command's first frame (none of the server's)."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb)


def _child(request: dict, fds: list[int], channel: socket.socket) -> None:
    """In the forked child: the caller's descriptors, directory and environment, the command, the exit."""
    code = 1
    try:
        channel.close()
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, encoding=sys.stdin.encoding, errors=sys.stdin.errors, closefd=False)  # noqa: SIM115
        sys.stdout = _std_stream(1, "w", sys.stdout)  # type: ignore[arg-type]
        sys.stderr = _std_stream(2, "w", sys.stderr)  # type: ignore[arg-type]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # (TMPDIR read again, from this environment)
        _run_command(request["argv"], request["cwd"])
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_)
    except KeyboardInterrupt as error:
        _print_exception(error)
        code = -signal.SIGINT
    except BaseException as error:  # whatever the command raised, printed as an interpreter prints it
        _print_exception(error)
    finally:
        # What an interpreter does on its way out: join the non-daemon threads, run atexit.
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        if code == -signal.SIGINT:  # (an unhandled KeyboardInterrupt ends an interpreter by SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _send(channel: socket.socket, message: dict) -> None:
    channel.sendall((json.dumps(message) + "\n").encode())


def serve(channel_fd: int, preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    channel = socket.socket(fileno=channel_fd)
    pending = b""
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
        pid = os.fork()
        if pid == 0:
            _child(request, received, channel)
        for fd in received:
            os.close(fd)
        _send(channel, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(channel, {"returncode": os.waitstatus_to_exitcode(status)})


# ---- the client ----------------------------------------------------------------------------------------

# What an interpreter reads of its environment as it starts: the server's must be the command's.
STARTUP_VARIABLES = ("PYTHON",)


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES)}


class WarmProcess:
    """One command's child, as ``subprocess.Popen`` shows one: pid, stdin/stdout/stderr (the pipes
    asked for), send_signal, kill, poll, wait, returncode."""

    def __init__(self, server: WarmPython, pid: int, stdin, stdout, stderr) -> None:
        self.server, self.pid = server, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; past ``timeout``, ``subprocess.TimeoutExpired`` and the child still runs."""
        if self.returncode is None:
            try:
                reply = self.server.reply(None if timeout is None else time.monotonic() + timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(["<warm>", str(self.pid)], timeout or 0) from None
            except BaseException:
                self.server.stop()
                self.server.lock.release()
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
        ``subprocess.TimeoutExpired`` and the child still runs."""
        if self.stdin is not None:
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        read: dict[int, object] = {}
        readers = [
            threading.Thread(target=lambda n=n, s=stream: read.__setitem__(n, s.read()), daemon=True)
            for n, stream in enumerate((self.stdout, self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(["<warm>", str(self.pid)], timeout or 0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        return read.get(0), read.get(1)

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
        """Kills the server and the child it runs (a command past its deadline)."""
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
        env = dict(os.environ if env is None else env)
        if startup_environment(env) != startup_environment(self.env):
            raise ValueError(
                f"{startup_environment(env)} is not the warm interpreter's {startup_environment(self.env)}: "
                "start a process of its own"
            )
        ends, ours = [], []
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
        self.lock.acquire()
        try:
            if self.process is None or self.process.poll() is not None:
                self.start()
            assert self.channel is not None
            request = {"argv": list(map(str, argv)), "cwd": os.path.abspath(cwd or os.getcwd()), "env": env}
            request["new_session"] = start_new_session
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
        except subprocess.TimeoutExpired:
            process.kill()  # (in a session of its own, the server's group is not its)
            self.stop()
            self.lock.release()
            raise
        finally:
            process.stdout.close()
            process.stderr.close()
        return subprocess.CompletedProcess([self.python, *argv], process.returncode, out, err)

    def close(self) -> None:
        if self.process is None or self.channel is None:
            return
        self.channel.shutdown(socket.SHUT_WR)  # (the server ends when its socket does)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self.stop()


_SERVERS: dict[tuple, WarmPython] = {}


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
