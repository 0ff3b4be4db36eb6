"""docs/flower.md's example runs as written: a ServerApp whose main() trains, commits each round,
and, started again, resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from conftest import FakeGrid, deterministic_client
from federation import BIN, Federation, free_port
from ortckpt import CheckpointManager, CheckpointState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "helpers"))
from readme_blocks import ROOT, block


def test_the_flower_docs_example_runs_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3, 2)).astype(np.float32)
    initial = CheckpointState.from_arrays({"fc.weight": weight}, {"mask": np.ones(2, np.int64)})
    CheckpointState.save_checkpoint(initial, "checkpoint")
    namespace: dict = {}
    exec(compile(block("flower"), "docs/flower.md", "exec"), namespace)
    context = SimpleNamespace(run_config={"num-server-rounds": 2})
    namespace["main"](FakeGrid([1, 2], deterministic_client), context)
    final = CheckpointState.load_checkpoint("final.ckpt")
    assert not np.array_equal(final.parameters["fc.weight"].data, weight)
    assert not final.parameters["mask"].requires_grad
    assert CheckpointManager("server-checkpoints", read_only=True).all_steps() == [1, 2]
    # Started again with more rounds: it resumes at round 3.
    rounds = []
    context.run_config["num-server-rounds"] = 3
    namespace["main"](FakeGrid([1, 2], deterministic_client, rounds.append), context)
    assert set(rounds) == {3}
    assert CheckpointManager("server-checkpoints", read_only=True).all_steps() == [1, 2, 3]


def test_the_runnable_example_runs_three_supernodes_a_kill_and_a_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block("flower-artifacts"), "docs/flower.md", "exec"), {})  # generate_artifacts
    assert CheckpointState.load_checkpoint("artifacts/nominal_checkpoint").is_nominal
    text = (ROOT / "docs" / "flower.md").read_text()
    pyproject = text.split("`app/pyproject.toml`:\n\n```toml\n", 1)[1].split("```", 1)[0]
    port = free_port()
    assert "127.0.0.1:8000" in pyproject
    files = {
        "server_app.py": block("flower-server-app"),
        "client_app.py": block("flower-client-app"),
        "pyproject.toml": pyproject.replace("127.0.0.1:8000", f"127.0.0.1:{port}"),
    }
    federation = Federation(tmp_path, files, partitions=3, port=port, cwd=tmp_path)  # (the app in ./app)
    try:
        command = [str(BIN / "flwr"), "run", "app", "local", "--stream"]
        with open(tmp_path / "first-run.log", "wb") as log:
            first = subprocess.Popen(command, env=federation.env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not Path("server-checkpoints/step_00000001").exists():
                assert time.monotonic() < deadline and first.poll() is None, Path("first-run.log").read_text()[-3000:]
                time.sleep(0.1)
            (pid,) = federation.serverapp_pids()
            os.kill(pid, signal.SIGKILL)  # the ServerApp dies mid-run
        finally:
            first.kill()
            first.wait()
        committed = CheckpointManager("server-checkpoints", read_only=True).all_steps()
        assert committed and committed == list(range(1, len(committed) + 1)) and len(committed) < 3
        again = subprocess.run(
            command, check=False, env=federation.env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"Resuming FedAvg at round {len(committed) + 1}" in again.stdout + again.stderr
    finally:
        federation.stop()
    assert CheckpointManager("server-checkpoints", read_only=True).all_steps() == [1, 2, 3]
    final = CheckpointManager("server-checkpoints", read_only=True).latest().load()
    initial = CheckpointState.load_checkpoint("artifacts/checkpoint")
    assert final.parameters.names() == ["b", "w"]
    assert not np.array_equal(final.parameters["w"].data, initial.parameters["w"].data)
    for partition in range(3):  # each client's optimizer state, round after round
        client = CheckpointManager(f"client-checkpoints/{partition}", read_only=True)
        assert client.all_steps() == [1, 2, 3]
        assert client.latest().load().optimizer_groups["group0"].step == 3 * 4
