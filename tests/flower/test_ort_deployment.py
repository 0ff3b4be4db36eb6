"""Federated rounds with ONNX Runtime-trained clients on Flower's deployment engine: a SuperLink and
two SuperNodes on 127.0.0.1 (real processes), each client an OrtClient on generate_artifacts'
output with a client-side manager, the server ortckpt's FedAvg with a manager. A SIGKILL of the
ServerApp inside a round's commit, then one of the whole SuperLink, each followed by a new
`flwr run`: the run resumes and ends where an uninterrupted in-process run ends, bit for bit."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import MessageGrid
from federation import Federation
from ort_model import STEPS, batches
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.flower import FedAvg, OrtClient, to_arrayrecord

ROUNDS = 3

SERVER_APP = """
import os
import signal
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.flower import FedAvg, to_arrayrecord
from ortckpt.stepstore import directory

app = ServerApp()


def kill_inside_commit(server_round):
    # SIGKILL of this process inside the commit of the round's step: its checkpoint and metadata
    # written into the staging folder, the commit document not.
    commit = directory.DirectoryStore.commit

    def killing(self, attempt, *args, **kwargs):
        if attempt.step == server_round:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(self, attempt, *args, **kwargs)

    directory.DirectoryStore.commit = killing


@app.main()
def main(grid: Grid, context: Context) -> None:
    if int(context.run_config["kill-in-commit"]):
        kill_inside_commit(int(context.run_config["kill-in-commit"]))
    artifacts = Path(os.environ["ORTCKPT_ARTIFACTS"])
    state = CheckpointState.load_checkpoint(artifacts / "checkpoint")
    strategy = FedAvg(manager=CheckpointManager(os.environ["ORTCKPT_FLOWER_DIR"]), like=state)
    strategy.start(grid, to_arrayrecord(state), num_rounds=int(context.run_config["num-server-rounds"]))
"""

CLIENT_APP = """
import os
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from ort_model import batches
from ortckpt import CheckpointManager
from ortckpt.flower import OrtClient

app = ClientApp()


def partition(context):
    return int(context.node_config["partition-id"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    part = partition(context)
    with CheckpointManager(Path(os.environ["ORTCKPT_CLIENT_DIR"]) / str(part)) as manager:
        client = OrtClient(os.environ["ORTCKPT_ARTIFACTS"], manager=manager)
        return client.train(msg, batches(part, int(msg.content["config"]["server-round"])))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    client = OrtClient(os.environ["ORTCKPT_ARTIFACTS"])
    return client.evaluate(msg, batches(100 + partition(context), 0))
"""


@pytest.fixture
def federation(tmp_path, ort_artifacts):
    running = Federation(
        tmp_path,
        {"server_app.py": SERVER_APP, "client_app.py": CLIENT_APP},
        f"num-server-rounds = {ROUNDS}\nkill-in-commit = 0",
        ORTCKPT_FLOWER_DIR=str(tmp_path / "server-checkpoints"),
        ORTCKPT_CLIENT_DIR=str(tmp_path / "client-checkpoints"),
        ORTCKPT_ARTIFACTS=str(ort_artifacts),
    )
    try:
        yield running
    finally:
        running.stop()


def uninterrupted(ort_artifacts, tmp_path):
    """The same federation in-process (two OrtClients with their managers), never interrupted."""
    partitions = {101: 0, 202: 1}  # (two nodes: a sum of two is the same in either order)
    managers = {node: CheckpointManager(tmp_path / "reference-clients" / str(p)) for node, p in partitions.items()}

    def answer(node, message):
        part, server_round = partitions[node], int(message.content["config"]["server-round"])
        if message.metadata.message_type.startswith("train"):
            return OrtClient(ort_artifacts, manager=managers[node]).train(message, batches(part, server_round))
        return OrtClient(ort_artifacts).evaluate(message, batches(100 + part, 0))

    state = CheckpointState.load_checkpoint(ort_artifacts / "checkpoint")
    strategy = FedAvg(manager=CheckpointManager(tmp_path / "reference-server"), like=state)
    strategy.start(MessageGrid(partitions, answer), to_arrayrecord(state), num_rounds=ROUNDS)
    return CheckpointManager(tmp_path / "reference-server", read_only=True).latest().load()


def assert_same_run(federation, ort_artifacts, tmp_path):
    server = CheckpointManager(federation.env["ORTCKPT_FLOWER_DIR"], read_only=True)
    assert server.all_steps() == list(range(1, ROUNDS + 1))
    served = server.latest().load()
    reference = uninterrupted(ort_artifacts, tmp_path)
    assert served.parameters.names() == reference.parameters.names() == ["b1", "b2", "w1", "w2"]
    for name in reference.parameters.names():
        assert served.parameters[name].data.tobytes() == reference.parameters[name].data.tobytes(), name
        assert served.parameters[name].requires_grad == reference.parameters[name].requires_grad, name
    # Each client's local optimizer state went on from round to round (AdamW's step counts them all).
    for part in (0, 1):
        clients = CheckpointManager(Path(federation.env["ORTCKPT_CLIENT_DIR"]) / str(part), read_only=True)
        assert clients.all_steps() == list(range(1, ROUNDS + 1))
        assert clients.latest().load().optimizer_groups["group0"].step == ROUNDS * STEPS
    assert served.parameters["b2"].data.tobytes() == (
        CheckpointState.load_checkpoint(ort_artifacts / "checkpoint").parameters["b2"].data.tobytes()
    )  # (frozen: the clients never change it)


def start_run(federation, name: str, *config: str) -> subprocess.Popen:
    with open(federation.tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            federation.run_command(ROUNDS, *config), env=federation.env, stdout=log, stderr=subprocess.STDOUT
        )


def wait_for(condition, run: subprocess.Popen, log: Path, deadline: float = 600) -> None:
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end and run.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


def test_ort_clients_resume_bit_identical_after_a_serverapp_killed_in_a_commit_and_a_superlink_killed(
    federation, ort_artifacts, tmp_path
):
    """One federation, two kills (one federation, not two: each costs a minute of Flower's polling): the
    ServerApp killed inside round 2's commit, then, in the run resumed from round 2, the whole SuperLink
    killed by SIGKILL once round 2 is committed; a third run resumes at round 3 and ends bit-identical."""
    checkpoints = Path(federation.env["ORTCKPT_FLOWER_DIR"])
    first = start_run(federation, "first-run", "kill-in-commit=2")
    try:
        # The ServerApp kills itself in round 2's commit; its run then never ends (flwr run streams).
        wait_for(
            lambda: any(checkpoints.glob(".step_*")) and not federation.serverapp_pids(),
            first,
            tmp_path / "first-run.log",
        )
    finally:
        first.kill()
        first.wait()
    assert CheckpointManager(checkpoints, read_only=True).all_steps() == [1]
    (leftover,) = [p for p in checkpoints.iterdir() if p.name.startswith(".step_")]
    # (its checkpoint written, its commit document, metadata.json, not)
    assert sorted(os.listdir(leftover)) == ["checkpoint"]

    second = start_run(federation, "second-run")
    try:
        wait_for((checkpoints / "step_00000002").exists, second, tmp_path / "second-run.log")
        federation.kill_superlink()  # (and its SuperExec and ServerApp)
    finally:
        second.kill()
        second.wait()
    committed = CheckpointManager(checkpoints, read_only=True).all_steps()
    assert committed[:2] == [1, 2] and committed == list(range(1, len(committed) + 1)) and len(committed) < ROUNDS

    # A new SuperLink on the same port (its state was in memory: the SuperNodes join it again).
    federation.kill_supernodes()
    federation.superlink = federation.start_superlink()
    federation.supernodes = federation.start_supernodes()
    again = federation.run(ROUNDS)
    assert f"Resuming FedAvg at round {len(committed) + 1}" in again, again[-3000:]
    assert_same_run(federation, ort_artifacts, tmp_path)
