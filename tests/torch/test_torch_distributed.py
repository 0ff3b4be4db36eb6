"""Sharded checkpoints over torch.distributed (gloo), ranks started by torchrun: the same
worker and model as the MPI tests (tests/distributed), through ortckpt's torch adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ortckpt.distributed import committed_steps

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "worker.py"


def torchrun(ranks: int, mode: str, directory: Path, step: int, saved_world: int = 0) -> dict[int, list[str]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(WORKER),
        "torch",
        mode,
        str(directory),
        str(step),
        str(saved_world),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"torchrun {mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in lines) == list(range(ranks)), done.stdout
    return {r["rank"]: r["problems"] for r in lines if r["problems"]}


def test_save_reshard_and_manager_over_gloo(tmp_path: Path) -> None:
    assert torchrun(2, "save", tmp_path / "run", step=10) == {}
    assert committed_steps(tmp_path / "run") == [10]
    assert torchrun(2, "load", tmp_path / "run", step=10, saved_world=2) == {}
    assert torchrun(1, "load", tmp_path / "run", step=10, saved_world=2) == {}  # reshard 2 -> 1
    assert torchrun(2, "manager", tmp_path / "managed", step=5) == {}
