"""Past ONNX Runtime's 1800 MiB threshold, both ways (`make test-large`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ortckpt import CheckpointState, OptimizerGroup

pytestmark = pytest.mark.large


def sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def test_ortckpt_checkpoint_over_the_default_threshold_loads_in_onnx_runtime(ort, tmp_path):
    big = np.full(1900 * 2**20 // 4, 0.25, np.float32)
    big[::9973] = np.arange(big[::9973].size, dtype=np.float32)
    small = {f"fc{i}.weight": np.random.default_rng(i).standard_normal((256, 64)).astype(np.float32) for i in range(3)}
    state = CheckpointState.from_arrays({"embed": big, **small}, properties={"epoch": 9})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=7, initial_learning_rate=1e-4,
        momentums={n: {"momentum0": a * 0.5, "momentum1": a * a} for n, a in small.items()},
    )  # fmt: skip
    ours = tmp_path / "ours.ckpt"
    CheckpointState.save_checkpoint(state, ours, include_optimizer_state=True)  # default threshold
    assert (tmp_path / "ours.ckpt.data").stat().st_size > 1800 * 2**20
    assert ours.stat().st_size < 2**20

    seen = ort("describe", ours)
    want = {n: sha256(p.data) for n, p in state.parameters}
    assert {p["name"]: p["sha256"] for p in seen["parameters"]} == want
    assert seen["properties"] == {"epoch": 9}

    # ONNX Runtime re-saves it (external, momentums inline): every byte, momentums included, comes back.
    theirs = tmp_path / "theirs.ckpt"
    ort("resave", ours, theirs)
    back = CheckpointState.load_checkpoint(theirs)
    assert {n: sha256(p.data) for n, p in back.parameters} == want
    group = back.optimizer_groups["group0"]
    assert group.step == 7
    for name, moms in state.optimizer_groups["group0"].momentums.items():
        for m, value in moms.items():
            assert sha256(group.momentums[name][m]) == sha256(value)


def test_onnx_runtime_tensorproto_checkpoint_over_the_threshold_loads_in_ortckpt(ort, tmp_path):
    path = tmp_path / "protos.ckpt"
    written = ort("write_protos", path, 1900)
    assert Path(f"{path}.data").exists()
    state = CheckpointState.load_checkpoint(path)
    assert {n: sha256(p.data) for n, p in state.parameters} == written["sha256"]
    assert state.parameters["small"].requires_grad is False and state.parameters["layer1.weight"].requires_grad
