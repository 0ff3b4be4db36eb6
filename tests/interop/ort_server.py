"""ONNX Runtime's interpreter kept warm for the `ort` fixture (tests/conftest.py).

Starting ONNX Runtime's interpreter costs about 0.7 CPU seconds (importing NumPy and ONNX Runtime),
more than most ort_helper.py commands take, and the suite runs over a hundred of them. This process
imports ort_helper.py once, then forks a child for each request: every command still runs in a
process of its own that no earlier command touched, with the caller's working directory and
environment, its stdout and stderr in files the caller names, at the cost of a fork.

Requests on stdin, one JSON object a line: {"argv": [...], "cwd": ..., "env": {...}, "stdout": path,
"stderr": path}; each is answered on stdout with {"returncode": ...} when its child ends (negative: the
signal that ended it, as subprocess gives it). A caller past its deadline kills the server's process
group, the child with it. The server ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import ort_helper  # imports NumPy and ONNX Runtime: the cost every child is spared


def run_child(request: dict, replies: int) -> None:
    """In the forked child: the caller's directory, environment and files, then ort_helper.main."""
    code = 1
    try:
        os.close(replies)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [ort_helper.__file__, *request["argv"]]
        ort_helper.main(request["argv"])
        code = 0
    except SystemExit as exit_:
        if isinstance(exit_.code, int):
            code = exit_.code
        elif exit_.code is not None:
            print(exit_.code, file=sys.stderr)
    except BaseException:  # whatever the command raised, printed as an interpreter would
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    # Replies go through a descriptor of their own: fd 1 is each child's stdout.
    replies = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (fd 1 for the life of the process)

    def reply(message: dict) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request, replies)
        _, status = os.waitpid(pid, 0)
        reply({"returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
