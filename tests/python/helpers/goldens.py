"""Golden files and hashing helpers shared by the pytest modules."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "data"
GOLDEN = DATA / "ort-vectors"

# ONNX Runtime's training artifacts (generate_artifacts): the trained checkpoint and its eval model,
# whose only output is the MSE loss, with a batch to run it on.
ARTIFACTS = GOLDEN / "artifacts"
EVAL_MODEL = ARTIFACTS / "eval_model.onnx"
LOSS = "onnx::reducemean_output::6"
INPUTS = {
    "x": np.linspace(-1, 1, 3 * 8, dtype=np.float32).reshape(3, 8),
    "target": np.linspace(0, 1, 3 * 4, dtype=np.float32).reshape(3, 4),
}


def golden_checkpoints() -> list[Path]:
    """Every checkpoint ONNX Runtime wrote for us (each has a .json beside it)."""
    # (v1/ holds format version 1 and its version-2 twins: test_deployment.py covers them)
    files = sorted(
        p
        for p in GOLDEN.rglob("*")
        if p.is_file() and p.suffix not in (".json", ".md", ".onnx") and "v1" not in p.parts
    )
    assert len(files) == 25, files
    return files


def sha256(data) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def load_json(path: Path) -> dict:
    return json.loads(Path(f"{path}.json").read_text())
