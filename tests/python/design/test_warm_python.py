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
