"""The warm interpreter the suite starts its many short processes from (helpers/warm_python.py: the CLI's
subprocess runs, ONNX Runtime's loops, the `ort` fixture) answers as ``subprocess`` with a fresh
``python`` would: exit statuses, output, directory, environment, signals, deadlines, and no state
carried from one command to the next."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_python import WarmPython


@pytest.fixture
def python():
    server = WarmPython(sys.executable, ("json",))
    yield server
    server.close()


def test_exits_are_an_interpreters(python, tmp_path):
    assert python.run(["-c", "import sys; sys.exit(3)"]).returncode == 3
    assert python.run(["-c", "import sys; sys.exit('bye')"]).returncode == 1
    failed = python.run(["-c", "raise ValueError('no')"])
    assert failed.returncode == 1
    # The traceback starts at the command, as a fresh interpreter's does: none of the server's frames.
    assert failed.stderr.splitlines()[1:] == ['  File "<string>", line 1, in <module>', "ValueError: no"]
    assert python.run(["-c", "raise KeyboardInterrupt"]).returncode == -signal.SIGINT
    ending = "import atexit, threading, time\natexit.register(print, 'atexit')\n"
    ending += "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
    assert python.run(["-c", ending]).stdout == "thread\natexit\n"


def test_argv_path_directory_and_environment_are_the_callers(python, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(sys.argv, sys.path[0], os.getcwd(), os.environ['ASKED'], __name__)\n")
    done = python.run([str(script), "a", "b"], cwd=tmp_path, env=dict(os.environ, ASKED="yes"))
    assert done.stdout.split() == [f"['{script}',", "'a',", "'b']", str(tmp_path), str(tmp_path), "yes", "__main__"]
    (tmp_path / "mod.py").write_text("import sys\nprint(sys.argv[1:], __name__)\n")
    assert python.run(["-m", "mod", "x"], cwd=tmp_path).stdout == "['x'] __main__\n"
    code = "import sys, tempfile\nprint(sys.argv, repr(sys.path[0]), tempfile.gettempdir())"
    done = python.run(["-c", code, "z"], env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.stdout == f"['-c', 'z'] '' {tmp_path}\n"


def test_no_command_sees_what_an_earlier_one_changed(python):
    python.run(["-c", "import json, os; json.CHANGED = 1; os.environ['LEFT'] = '1'"])
    done = python.run(["-c", "import json, os; print(hasattr(json, 'CHANGED'), 'LEFT' in os.environ)"])
    assert done.stdout == "False False\n"


def test_signals_go_to_the_command_and_pipes_read_live(python):
    code = (
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\nprint('ready', flush=True)\n"
    )
    child = python.popen(["-c", code + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    child.terminate()
    assert child.wait(30) == 7
    child.stdout.close()
    child = python.popen(["-c", code + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.stdout.close()


def test_a_pid_stays_the_commands_until_its_status_is_read(python):
    # As subprocess's child, a zombie until reaped: a signal sent before the status is read cannot
    # reach another process that took the pid.
    child = python.popen(["-c", "pass"])
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 30
    state = "running"
    while state not in ("Z", "gone") and time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        time.sleep(0.01)
    assert state == "Z"
    assert child.wait(30) == 0
    assert python.run(["-c", "pass"]).returncode == 0
    assert not stat.exists()  # (reaped once the caller asked for the next command)


def test_a_command_past_its_deadline_is_killed_and_the_next_runs(python, tmp_path):
    pid_file = tmp_path / "pid"
    hang = f"import os, time; os.setsid(); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired):
        python.run(["-c", hang], timeout=2)
    pid = int(pid_file.read_text())
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break  # (dead: a zombie until its new parent reaps it, the server that forked it gone)
        time.sleep(0.05)
    else:
        assert not stat.exists(), "the command outlived its deadline"
    assert python.run(["-c", "print('next')"]).stdout == "next\n"


def test_a_command_whose_start_up_variables_differ_is_refused(python):
    with pytest.raises(ValueError, match="PYTHONPATH"):
        python.run(["-c", "pass"], env=dict(os.environ, PYTHONPATH="/elsewhere"))


def fresh(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """What a fresh interpreter gives for ``python ARGV``."""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False, **kwargs)


def same(done: subprocess.CompletedProcess, fresh_done: subprocess.CompletedProcess) -> bool:
    return (done.returncode, done.stdout, done.stderr) == (fresh_done.returncode, fresh_done.stdout, fresh_done.stderr)


def test_an_interpreters_end_flushes_and_finalizes_what_the_command_left_open(python, tmp_path):
    # A file never closed is written, __del__ runs, a named temporary is removed, sys.__stdout__ is flushed.
    code = (
        "import sys, tempfile\nf = open('unclosed', 'w')\nf.write('kept')\n"
        "class A:\n    def __del__(self):\n        print('finalized')\na = A()\n"
        "t = tempfile.NamedTemporaryFile(dir='.', prefix='named')\nsys.__stdout__.write('via __stdout__\\n')\n"
    )
    done = python.run(["-c", code], cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "via __stdout__\nfinalized\n"), done.stderr
    assert (tmp_path / "unclosed").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["unclosed"]


def test_the_main_module_lives_until_the_end_as_a_fresh_interpreters_does(python, tmp_path):
    # atexit handlers and threads find the command's __main__ (a pickle of its classes, `import __main__`).
    (tmp_path / "mainmod.py").write_text(
        "import atexit, sys\nX = 1\natexit.register(lambda: print(getattr(sys.modules['__main__'], 'X', 'gone')))\n"
    )
    for argv in (["-m", "mainmod"], ["mainmod.py"], ["-c", (tmp_path / "mainmod.py").read_text()]):
        assert python.run(argv, cwd=tmp_path).stdout == "1\n", argv
    code = "import __main__, sys\nprint(sorted(vars(__main__)), __main__.__loader__, sys.orig_argv[1:])"
    assert same(python.run(["-c", code]), fresh(["-c", code]))


def test_streams_and_buffering_are_an_interpreters(python, tmp_path):
    code = (
        "import os, sys\nprint(sys.stdin, sys.stdout, sys.stderr, sys.stderr.errors, sys.__stdout__ is sys.stdout,"
        " type(sys.stdout.buffer).__name__, sys.stdout.write_through, repr(sys.stdin.read()))\n"
        "print('printed')\nos.write(1, b'written\\n')\nprint('last', end='')\nos._exit(0)\n"
    )
    for unbuffered in ("", "1"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env.update({"PYTHONUNBUFFERED": unbuffered} if unbuffered else {})
        server = WarmPython(sys.executable, ("json",), env)
        try:
            child = server.popen(["-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            child.stdin.write("a\r\nb")
            warm_out = child.communicate(30)[0]
            child.stdout.close()
        finally:
            server.close()
        fresh_out = fresh(["-c", code], env=env, input="a\r\nb").stdout
        assert warm_out == fresh_out, unbuffered


def test_an_uncaught_exception_goes_through_sys_excepthook(python):
    code = "import sys\nsys.excepthook = lambda kind, error, tb: print('hook', kind.__name__)\nraise ValueError"
    done = python.run(["-c", code])
    assert (done.returncode, done.stdout, done.stderr) == (1, "hook ValueError\n", "")
    code = "import atexit, sys\natexit.register(sys.exit, 4)"  # (reported as an interpreter reports it)
    assert same(python.run(["-c", code]), fresh(["-c", code]))


def test_random_states_and_the_clock_are_each_commands_own(tmp_path):
    # A fresh interpreter seeds random, numpy.random and tempfile's names from the OS, and reads TZ.
    server = WarmPython(sys.executable, ("numpy.random", "tempfile", "time"))
    try:
        code = "import numpy, random, tempfile\nprint(numpy.random.random(), random.random(), tempfile.mktemp())"
        outputs = {server.run(["-c", code]).stdout for _ in range(3)}
        assert len(outputs) == 3, outputs
        code = "import time; print(time.tzname, time.localtime(0).tm_hour)"
        env = dict(os.environ, TZ="Asia/Tokyo")
        assert server.run(["-c", code], env=env).stdout == fresh(["-c", code], env=env).stdout
    finally:
        server.close()


def test_a_deadline_is_kept_while_a_grandchild_holds_the_pipes(python, tmp_path):
    pid_file = tmp_path / "pid"
    hang = (
        "import os, subprocess, time\nos.setsid()\n"
        f"open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid))\ntime.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        python.run(["-c", hang], timeout=2)
    grandchild = int(pid_file.read_text())
    try:
        assert Path(f"/proc/{grandchild}").exists()  # (run returned at its deadline, not at the pipes' end)
    finally:
        os.kill(grandchild, signal.SIGKILL)
    assert python.run(["-c", "print('next')"]).stdout == "next\n"


def test_an_exception_while_waiting_kills_the_command_and_frees_the_server(python, tmp_path):
    # As pytest-timeout's signal, or a Ctrl-C: subprocess.run kills its child; the next command runs.
    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(Interrupted):
            python.run(["-c", f"import time; open({str(tmp_path / 'began')!r}, 'w'); time.sleep(60)"])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not python.lock.locked()
    assert python.run(["-c", "print('next')"], timeout=30).stdout == "next\n"


def test_a_server_that_dies_mid_command_fails_that_command_and_the_next_runs(python):
    child = python.popen(["-c", "print('ready', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"ready\n"
    os.kill(python.process.pid, signal.SIGKILL)
    with pytest.raises(AssertionError, match="ended"):
        child.wait(30)
    child.stdout.close()
    assert python.run(["-c", "print('next')"], timeout=30).stdout == "next\n"
    # Dead between two commands: the next starts another, the dead one's socket closed.
    dead, channel = python.process, python.channel
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(30)
    assert python.run(["-c", "print('after')"], timeout=30).stdout == "after\n"
    assert channel.fileno() == -1


def test_a_second_command_while_one_runs_runs_at_once_as_with_subprocess(python):
    # (not a wait for the first's end: forever, when the same thread would wait for it after)
    child = python.popen(["-c", "import time; time.sleep(60)"])
    assert python.run(["-c", "print('meanwhile')"], timeout=60).stdout == "meanwhile\n"
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    assert python.run(["-c", "print('next')"]).stdout == "next\n"


def test_what_a_child_cannot_be_is_refused(python):
    with pytest.raises(ValueError, match="-u"):
        python.run(["-u", "-c", "pass"])  # (an interpreter's options are its start's)
    with pytest.raises(ValueError, match="LC_ALL"):  # (the locale is read at an interpreter's start)
        python.run(["-c", "pass"], env=dict(os.environ, LC_ALL="C"))


def test_the_umask_signal_mask_and_ignored_signals_are_the_callers_of_the_moment(python):
    # What exec passes from the caller: its umask, its thread's blocked signals, its ignored ones.
    code = (
        "import os, signal\nmask = os.umask(0)\n"
        "print(oct(mask), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),"
        " [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)])"
    )
    python.run(["-c", "pass"])  # (the server started before the caller changes them)
    old_mask = os.umask(0o027)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        changed = python.run(["-c", code]).stdout, fresh(["-c", code]).stdout
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
        signal.signal(signal.SIGHUP, previous)
        os.umask(old_mask)
    assert changed[0] == changed[1]
    assert python.run(["-c", code]).stdout == fresh(["-c", code]).stdout  # (and back)


def test_what_c_code_printed_through_its_own_buffers_comes_out(tmp_path):
    # C's stdio (printf, ONNX Runtime's logging) is block-buffered on a pipe unless -u: exit() flushes it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    server = WarmPython(sys.executable, ("ctypes",), env)
    try:
        code = "import ctypes\nctypes.CDLL(None).printf(b'from C\\n')"
        assert server.run(["-c", code], env=env).stdout == "from C\n" == fresh(["-c", code], env=env).stdout
    finally:
        server.close()
