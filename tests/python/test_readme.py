"""The README's Python examples run as written (the building example first, as it makes the file)."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


# The examples that run inside ONNX Runtime's training loop (onnxruntime-training, its artifacts): run by
# tests/interop/test_ort_loop.py in ONNX Runtime's interpreter.
ORT_TRAINING = re.compile(r"^\s*(from|import) onnxruntime\.training|artifacts/", re.M)


def python_blocks(with_torch: bool = False) -> list[str]:
    """The README's Python examples; those that import torch only when asked (`make test-torch` runs them)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if ("import torch" in b) == with_torch and not ORT_TRAINING.search(b)]


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) == 12, (
        "import line, quick start, building, CheckpointManager, validation, compression, tracking, sharded, ONNX, "
        "safetensors, deployment, object storage"
    )
    _import, quick_start, building, _manager, _validation, _compression, _tracking, *_rest = blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(building, "README building example", "exec"), namespace)
    exec(compile(quick_start, "README quick start", "exec"), namespace)
    assert (tmp_path / "checkpoint").exists() and (tmp_path / "checkpoint_with_optimizer").exists()
    from ortckpt import CheckpointState

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint_with_optimizer")
    assert state.properties["epoch"] == 5
    assert "group0" in state.optimizer_groups
    assert (state.parameters["fc.bias"].data == 1).all()
    assert "fc.weight True (16, 8) float32" in capsys.readouterr().out


def test_readme_checkpoint_manager_example_runs_and_resumes(tmp_path, monkeypatch, capsys):
    example = python_blocks()[3]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README CheckpointManager example", "exec"), {})
    first = capsys.readouterr().out
    assert first.startswith("[800, 900, 1000] 1000\nVerified(") and "step=1000" in first
    from ortckpt import CheckpointManager

    weights = CheckpointManager(tmp_path / "checkpoints").restore().parameters["fc.weight"].data.copy()
    # Run again: it resumes at step 1000, with nothing left to do, and changes nothing.
    exec(compile(example, "README CheckpointManager example", "exec"), {})
    assert capsys.readouterr().out == first
    again = CheckpointManager(tmp_path / "checkpoints").restore().parameters["fc.weight"].data
    assert (again == weights).all() and weights.any()


def test_readme_validation_example_refuses_the_nan_step(tmp_path, monkeypatch, capsys):
    example = python_blocks()[4]
    assert "validate=Forward(" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README validation example", "exec"), {})
    assert capsys.readouterr().out == "['output loss is not finite (1 NaN or Inf values)']\n1\n"
    assert sorted(p.name for p in (tmp_path / "validated").iterdir()) == ["step_00000001"]


def test_readme_compression_example_compresses_the_kept_steps(tmp_path, monkeypatch, capsys):
    example = python_blocks()[5]
    assert "compress_kept=True" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README compression example", "exec"), {})
    assert capsys.readouterr().out == "[(2, True), (4, True), (5, False)]\n(256, 256)\n"
    kept = tmp_path / "kept" / "step_00000002"
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoint.zst", "metadata.json"]


def test_readme_tracking_example_logs_to_mlflow_and_registers_the_best(tmp_path, monkeypatch, capsys, mlflow_uri):
    validation, _compression, example = python_blocks()[4:7]
    assert 'track="mlflow"' in example
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # MLflow's own "View run at" line
    exec(compile(validation, "README validation example", "exec"), {})  # writes eval_model.onnx
    capsys.readouterr()
    exec(compile(example, "README tracking example", "exec"), {})
    assert capsys.readouterr().out == "tiny-regressor 1 2\n"
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_uri)
    version = client.get_model_version("tiny-regressor", "1")
    assert [(m.step, m.value) for m in client.get_metric_history(version.run_id, "loss")] == [
        (1, 4.0),
        (2, 0.5),
        (3, 1.0),
    ]
    assert client.get_run(version.run_id).data.params == {"lr": "0.01"}


def test_readme_onnx_and_safetensors_examples_run(tmp_path, monkeypatch):
    onnx_example, safetensors_example = python_blocks()[8:10]
    monkeypatch.chdir(tmp_path)
    exec(compile(onnx_example, "README ONNX example", "exec"), {})
    exec(compile(safetensors_example, "README safetensors example", "exec"), {})
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from ortckpt import CheckpointState

    exported = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "inference.onnx").graph.initializer}
    assert (exported["fc.weight"] == 0.5).all() and (exported["fc.bias"] == 0).all()
    assert [n for n, _ in CheckpointState.load_checkpoint(tmp_path / "fc.ckpt").parameters] == ["fc.bias", "fc.weight"]
    state = CheckpointState.load_checkpoint(tmp_path / "from_safetensors.ckpt")
    assert not state.parameters["fc.bias"].requires_grad
    assert np.array_equal(state.parameters["fc.weight"].data, np.full((4, 8), 0.5, np.float32))


def test_readme_sharded_example_runs_under_mpirun_and_resumes_on_another_world_size(tmp_path):
    import shutil
    import subprocess
    import sys

    from ortckpt import CheckpointState
    from ortckpt.distributed import Slice, committed_steps

    (example,) = [b for b in python_blocks() if "save_sharded(" in b]
    (tmp_path / "train.py").write_text(example)
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for ranks in (2, 3):  # a fresh run on 2 ranks, then a restart on 3
        done = subprocess.run(
            [mpirun, "-n", str(ranks), "--oversubscribe", sys.executable, "train.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert committed_steps(tmp_path / "sharded") == [100, 200]
    merged = CheckpointState.load_checkpoint(tmp_path / "model.ckpt")
    embedding = merged.parameters["embedding"].data
    for rank in range(2):  # the values the 2 ranks of the first run held, wherever they went since
        assert (embedding[Slice.split((1000, 64), rank, 2).index] == rank).all()
    assert merged.optimizer_groups["group0"].step == 200
    assert merged.optimizer_groups["group0"].momentums["embedding"]["momentum1"].shape == (1000, 64)


def test_readme_deployment_example_runs(tmp_path, monkeypatch, capsys):
    example = python_blocks()[10]
    assert "ortckpt.average" in example and "export_model" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README deployment example", "exec"), {})
    assert capsys.readouterr().out == "['x'] (2, 4)\n"
    from ortckpt import CheckpointState

    assert CheckpointState.load_checkpoint(tmp_path / "global.ckpt").properties["num_samples"] == 1000


def test_readme_object_storage_example_runs_against_s3(capsys, aws_environment):
    example = python_blocks()[11]
    assert "s3://ckpt/runs/demo/checkpoint" in example
    exec(compile(example, "README object storage example", "exec"), {})
    assert capsys.readouterr().out == "1 32.0\n[2, 3] 3 3\n"
    import ortckpt.object_store as object_store
    from ortckpt import targets

    listed = [k for k, _ in object_store.list_keys(targets.object_location("s3://ckpt/runs/demo"))]
    assert (
        listed[0] == "checkpoint"
        and [k.split("/")[0] for k in listed[1:]] == ["step_00000002"] * 2 + ["step_00000003"] * 2
    )  # each kept step: its metadata and the checkpoint in its attempt folder
