"""ortckpt.flower.FedAvg on Flower's deployment engine: a SuperLink and two SuperNodes on
127.0.0.1 (real processes, started and stopped here), `flwr run` of a ServerApp with a manager,
its process killed by SIGKILL once round 1 is committed; run again, it resumes after its last
commit and ends where an uninterrupted in-process run does, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeGrid
from federation import Federation
from flwr.app import Array, ArrayRecord
from ortckpt import CheckpointManager
from ortckpt.flower import FedAvg

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


@pytest.fixture
def federation(tmp_path):
    """A SuperLink and two SuperNodes (partitions 0 and 1) on 127.0.0.1 (federation.py)."""
    files = {"common.py": COMMON, "server_app.py": SERVER_APP, "client_app.py": CLIENT_APP}
    running = Federation(
        tmp_path, files, "num-server-rounds = 2", ORTCKPT_FLOWER_DIR=str(tmp_path / "server-checkpoints")
    )
    try:
        yield running
    finally:
        running.stop()


def test_a_serverapp_killed_by_sigkill_on_flowers_engine_resumes_bit_identical(federation, tmp_path):
    app, env = federation.app, federation.env
    checkpoints = Path(env["ORTCKPT_FLOWER_DIR"])
    with open(tmp_path / "first-run.log", "wb") as log:
        first = subprocess.Popen(federation.run_command(3), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (checkpoints / "step_00000001").exists():  # round 1 committed: kill the ServerApp
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "first-run.log").read_text()
            time.sleep(0.1)
        (pid,) = federation.serverapp_pids()
        os.kill(pid, signal.SIGKILL)
    finally:
        first.kill()  # (flwr run only streams the run's log)
        first.wait()
    committed = CheckpointManager(checkpoints, read_only=True).all_steps()
    assert committed and committed == list(range(1, len(committed) + 1)) and len(committed) < 3

    again = federation.run(3)
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
