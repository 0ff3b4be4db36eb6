"""docs/flower.md's example runs as written: a ServerApp whose main() trains, commits each round,
and, started again, resumes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from conftest import FakeGrid, deterministic_client
from ortckpt import CheckpointManager, CheckpointState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from readme_blocks import block


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
