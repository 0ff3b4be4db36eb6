"""Flower's deployment engine on 127.0.0.1 for the tests: a SuperLink and SuperNodes (real
processes, each in a session of its own), an app directory, `flwr run`, and the kills the tests
make (a ServerApp, the whole SuperLink); everything started is ended at teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlflow_server import free_port  # below the kernel's ephemeral range, which outgoing connections take from

BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parents[1]

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "ortckptapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "ortckpt"

[tool.flwr.app.components]
serverapp = "server_app:app"
clientapp = "client_app:app"

[tool.flwr.app.config]
{config}

[tool.flwr.federations]
default = "local"

[tool.flwr.federations.local]
address = "127.0.0.1:{port}"
insecure = true
"""


def wait_for_port(port: int, process: subprocess.Popen, log: Path, deadline: float = 180) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port} after {deadline} s: {log.read_text()[-2000:]}")


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes below ``root``: Flower's daemons start their
    SuperExec in a session of its own, which starts the apps (so a process group misses them)."""
    table = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in table.splitlines():
        pid, ppid, stat, *args = line.split(None, 3)
        if not stat.startswith("Z"):
            children.setdefault(int(ppid), []).append((int(pid), args[0] if args else ""))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def sigkill(pids: list[int]) -> None:
    for pid in pids:  # (each by its id)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


class Federation:
    """A SuperLink on a free port (or ``port``) and one SuperNode per partition (``partition-id``),
    an app in ``tmp_path/app`` (its files given by the test; a pyproject.toml of ours with its run
    ``config`` unless one is given), the processes started in ``cwd`` and their logs in ``tmp_path``."""

    def __init__(
        self,
        tmp_path: Path,
        files: dict[str, str],
        config: str = "",
        partitions: int = 2,
        *,
        port: int | None = None,
        cwd: Path | None = None,
        **env: str,
    ) -> None:
        self.tmp_path, self.partitions, self.cwd = tmp_path, partitions, cwd
        # (sys.path but tests/ itself, whose folder torch would pass for the torch package in the apps)
        path = [p for p in sys.path if p and Path(p).resolve() != TESTS]
        self.env = {
            **os.environ,
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_HOME": str(tmp_path / "flwr-home"),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(path),
            **env,
        }
        self.port = port or free_port()
        self.started: list[subprocess.Popen] = []
        self.below: set[int] = set()
        self.app = tmp_path / "app"
        self.app.mkdir()
        (self.app / "pyproject.toml").write_text(PYPROJECT.format(port=self.port, config=config))
        for name, text in files.items():
            (self.app / name).write_text(text)
        self.superlink = self.start_superlink()
        self.supernodes = self.start_supernodes()

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = self.tmp_path / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.cwd,
            )
        self.started.append(process)
        return process

    def start_superlink(self) -> subprocess.Popen:
        link = self._start(
            "superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.port)
        )
        wait_for_port(self.port, link, self.tmp_path / "superlink.log")
        return link

    def start_supernodes(self) -> list[subprocess.Popen]:
        return [
            self._start(
                f"supernode{partition}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(free_port()),
                "--node-config",
                f"partition-id={partition}",
            )
            for partition in range(self.partitions)
        ]

    def serverapp_pids(self) -> list[int]:
        """The ServerApp processes our SuperLink started (through its SuperExec)."""
        return [pid for pid, args in descendants(self.superlink.pid) if "flwr-serverapp" in args]

    def kill_superlink(self) -> None:
        """SIGKILL to the SuperLink and everything below it (its SuperExec, the ServerApp)."""
        below = [pid for pid, _ in descendants(self.superlink.pid)]
        sigkill([self.superlink.pid, *below])
        self.superlink.wait()

    def kill_supernodes(self) -> None:
        for node in self.supernodes:
            below = [pid for pid, _ in descendants(node.pid)]
            sigkill([node.pid, *below])
            node.wait()

    def run_command(self, rounds: int, *config: str) -> list[str]:
        pairs = " ".join([f"num-server-rounds={rounds}", *config])
        return [str(BIN / "flwr"), "run", str(self.app), "local", "--stream", "--run-config", pairs]

    def run(self, rounds: int, *config: str) -> str:
        """``flwr run`` to the end of the run: its output (it streams the run's log)."""
        done = subprocess.run(
            self.run_command(rounds, *config),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            cwd=self.cwd,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    def stop(self) -> None:
        below = [pid for process in self.started for pid, _ in descendants(process.pid)]
        for process in reversed(self.started):
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        sigkill(below)  # (the SuperExecs and their apps)
        for process in self.started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
