"""ortckpt.flower.FedAvg on Flower's deployment engine: a SuperLink and two SuperNodes on
127.0.0.1 (real processes, started and stopped here), `flwr run` of a ServerApp with a manager,
its process killed by SIGKILL at a random moment (seeded); run again, it resumes after its last
commit and ends where an uninterrupted in-process run does, bit for bit."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeGrid
from federation import Federation, sigkill
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


def random_kill(seed: int) -> tuple[int, float]:
    """A random moment of a 3-round run: after how many commits (0: once the ServerApp runs),
    then how long after (a round here takes a second or more: inside the next round's
    training, aggregation or commit, or, now and then, after the run ends)."""
    rng = random.Random(seed)
    return rng.randrange(3), rng.uniform(0.0, 2.0)


def kill_serverapp_at(federation: Federation, seed: int, log: Path, kill: Callable[[], None] | None = None) -> None:
    """Starts a 3-round ``flwr run`` and SIGKILLs its ServerApp at :func:`random_kill`'s moment
    (or calls ``kill`` then: benches/flower_kills.py kills the whole SuperLink)."""
    checkpoints = Path(federation.env["ORTCKPT_FLOWER_DIR"])
    commits, delay = random_kill(seed)
    with open(log, "wb") as out:
        first = subprocess.Popen(federation.run_command(3), env=federation.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        pids: list[int] = []
        while not pids or (commits and not (checkpoints / f"step_{commits:08d}").exists()):
            assert time.monotonic() < deadline and first.poll() is None, f"seed {seed}: {log.read_text()[-3000:]}"
            time.sleep(0.05)
            pids = pids or federation.serverapp_pids()
        time.sleep(delay)
        if kill is None:
            sigkill(federation.serverapp_pids())
        else:
            kill()
    finally:
        first.kill()  # (flwr run only streams the run's log)
        first.wait()


def test_a_serverapp_killed_by_sigkill_on_flowers_engine_resumes_bit_identical(federation, tmp_path):
    """The kill lands at a random moment (seeded: ORTCKPT_FLOWER_KILL_SEED repeats one; the
    seed is in every failure's message)."""
    app, env = federation.app, federation.env
    checkpoints = Path(env["ORTCKPT_FLOWER_DIR"])
    seed = int(os.environ.get("ORTCKPT_FLOWER_KILL_SEED", random.randrange(1 << 32)))
    kill_serverapp_at(federation, seed, tmp_path / "first-run.log")
    committed = CheckpointManager(checkpoints, read_only=True).all_steps()
    assert committed == list(range(1, len(committed) + 1)), f"seed {seed} {random_kill(seed)}: {committed}"

    again = federation.run(3)
    said = f"Resuming FedAvg at round {len(committed) + 1}" if committed else "Starting FedAvg strategy"
    assert said in again, f"seed {seed} {random_kill(seed)}: {again[-3000:]}"
    manager = CheckpointManager(checkpoints, read_only=True)
    assert manager.all_steps() == [1, 2, 3], f"seed {seed} {random_kill(seed)}"
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
        assert served.parameters[key].data.tobytes() == array.numpy().tobytes(), (
            f"seed {seed} {random_kill(seed)}: {key}"
        )
    assert not np.isnan(served.parameters["fc.weight"].data).any()
