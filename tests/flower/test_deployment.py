"""ortckpt.flower.FedAvg on Flower's deployment engine: a SuperLink and two SuperNodes on
127.0.0.1 (real processes, started and stopped here), `flwr run` of a ServerApp with a manager,
its process killed by SIGKILL once round 1 is committed; run again, it resumes after its last
commit and ends where an uninterrupted in-process run does, bit for bit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeGrid
from flwr.app import Array, ArrayRecord
from ortckpt import CheckpointManager
from ortckpt.flower import FedAvg

BIN = Path(sys.executable).parent

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
num-server-rounds = 2

[tool.flwr.federations]
default = "local"

[tool.flwr.federations.local]
address = "127.0.0.1:{port}"
insecure = true
"""

# The clients and the model, shared by the apps and by the in-process reference run.
COMMON = """
import numpy as np

def initial():
    return {"fc.weight": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "fc.bias": np.zeros(4, np.float16)}

def train(partition, server_round, arrays):
    rng = np.random.default_rng(partition * 100 + server_round)
    new = {k: (v + rng.standard_normal(v.shape).astype(v.dtype)).astype(v.dtype) for k, v in arrays.items()}
    return new, 5 + 3 * partition
"""

SERVER_APP = """
import os
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from ortckpt import CheckpointManager
from ortckpt.flower import FedAvg
from common import initial

app = ServerApp()

@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_evaluate=0.0, manager=CheckpointManager(os.environ["ORTCKPT_FLOWER_DIR"]))
    arrays = ArrayRecord({k: Array(v) for k, v in initial().items()})
    strategy.start(grid, arrays, num_rounds=int(context.run_config["num-server-rounds"]))
"""

CLIENT_APP = """
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from common import train as train_arrays

app = ClientApp()

@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = {k: v.numpy() for k, v in msg.content["arrays"].items()}
    server_round = int(msg.content["config"]["server-round"])
    new, examples = train_arrays(int(context.node_config["partition-id"]), server_round, arrays)
    record = ArrayRecord({k: Array(v) for k, v in new.items()})
    content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": examples})})
    return Message(content=content, reply_to=msg)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, log: Path, deadline: float = 60) -> None:
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


@pytest.fixture
def federation(tmp_path):
    """A SuperLink and two SuperNodes (partitions 0 and 1) on 127.0.0.1; each started in a session
    of its own, whose process group (it and the processes it starts) is ended at teardown."""
    env = {
        **os.environ,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "ORTCKPT_FLOWER_DIR": str(tmp_path / "server-checkpoints"),
    }
    port = free_port()
    started: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(process)
        return process

    try:
        link = start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port))
        wait_for_port(port, link, tmp_path / "superlink.log")
        for partition in (0, 1):
            start(
                f"supernode{partition}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{port}",
                "--port",
                str(free_port()),
                "--node-config",
                f"partition-id={partition}",
            )
        app = tmp_path / "app"
        app.mkdir()
        (app / "pyproject.toml").write_text(PYPROJECT.format(port=port))
        (app / "common.py").write_text(COMMON)
        (app / "server_app.py").write_text(SERVER_APP)
        (app / "client_app.py").write_text(CLIENT_APP)
        yield app, env, link
    finally:
        below = [pid for process in started for pid, _ in descendants(process.pid)]
        for process in reversed(started):
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for pid in below:  # (the SuperExecs and their apps, each by its id)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        for process in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def flwr_run(app: Path, env: dict, rounds: int) -> str:
    done = subprocess.run(
        [str(BIN / "flwr"), "run", str(app), "local", "--stream", "--run-config", f"num-server-rounds={rounds}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def serverapp_pids(superlink: int) -> list[int]:
    """The ServerApp processes our SuperLink started (through its SuperExec)."""
    return [pid for pid, args in descendants(superlink) if "flwr-serverapp" in args]


def test_a_serverapp_killed_by_sigkill_on_flowers_engine_resumes_bit_identical(federation, tmp_path):
    app, env, superlink = federation
    checkpoints = Path(env["ORTCKPT_FLOWER_DIR"])
    command = [str(BIN / "flwr"), "run", str(app), "local", "--stream", "--run-config", "num-server-rounds=3"]
    with open(tmp_path / "first-run.log", "wb") as log:
        first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not (checkpoints / "step_00000001").exists():  # round 1 committed: kill the ServerApp
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "first-run.log").read_text()
            time.sleep(0.1)
        (pid,) = serverapp_pids(superlink.pid)
        os.kill(pid, signal.SIGKILL)
    finally:
        first.kill()  # (flwr run only streams the run's log)
        first.wait()
    committed = CheckpointManager(checkpoints, read_only=True).all_steps()
    assert committed and committed == list(range(1, len(committed) + 1)) and len(committed) < 3

    again = flwr_run(app, env, 3)
    assert f"Resuming FedAvg at round {len(committed) + 1}" in again, again[-3000:]
    manager = CheckpointManager(checkpoints, read_only=True)
    assert manager.all_steps() == [1, 2, 3]
    served = manager.latest().load()

    # The same clients in-process, three rounds uninterrupted: the same bits.
    sys.path.insert(0, str(app))
    try:
        import common
    finally:
        sys.path.remove(str(app))
    nodes = {101: 0, 202: 1}  # (two nodes: a sum of two is the same in either order)
    grid = FakeGrid(nodes, lambda node, r, arrays: common.train(nodes[node], r, arrays))
    strategy = FedAvg(fraction_evaluate=0.0)
    reference = strategy.start(grid, ArrayRecord({k: Array(v) for k, v in common.initial().items()}), num_rounds=3)
    for key, array in reference.arrays.items():
        assert served.parameters[key].data.tobytes() == array.numpy().tobytes(), key
    assert not np.isnan(served.parameters["fc.weight"].data).any()
