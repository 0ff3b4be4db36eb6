"""The examples of README.md and docs/*.md run as written, each by name (readme_blocks.py's tags), and every
one of them is run by some test."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import ROOT, RUN_BY, all_blocks, block, blocks_of, shell_block


def test_every_example_of_the_documentation_is_run_by_a_test():
    """Every python block is tagged, every tag is claimed in RUN_BY, and the test RUN_BY names asks for
    that block by name (a literal `block("NAME")` in its body): none can be added, renamed or left unrun."""
    named = all_blocks()  # (an untagged block or a tag given twice fails here)
    assert not set(named) - set(RUN_BY), f"examples no test claims in RUN_BY: {sorted(set(named) - set(RUN_BY))}"
    assert not set(RUN_BY) - set(named), f"RUN_BY names examples that are gone: {sorted(set(RUN_BY) - set(named))}"
    for name, where in RUN_BY.items():
        path, function = where.split("::")
        tree = ast.parse((ROOT / path).read_text())
        (test,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == function] or [None]
        assert test is not None, f"{where}: no such test (for the example {name!r})"
        asked = {
            call.args[0].value
            for call in ast.walk(test)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "block"
            and call.args
            and isinstance(call.args[0], ast.Constant)
        }
        assert name in asked, f"{where} does not run the example {name!r} (no block({name!r}) in it)"


@pytest.mark.parametrize(
    "document",
    [
        "Text.\n\n```python\nprint(1)\n```\n",  # no tag
        "<!-- test: a -->\n\n```python\nprint(1)\n```\n",  # the tag not on the line before
        "- item\n<!-- test: a -->\n  ```python\n  print(1)\n  ```\n",  # the tag not indented as its block
        "<!-- test: a -->\n```python\nprint(1)\n",  # never closed
        "```py\nprint(1)\n```\n",  # another spelling of a python block, untagged
    ],
)
def test_an_example_the_registry_cannot_see_is_refused(tmp_path, document):
    (tmp_path / "doc.md").write_text(document)
    with pytest.raises(AssertionError):
        blocks_of(tmp_path / "doc.md")


def test_tagged_examples_are_read_as_a_user_pastes_them(tmp_path):
    (tmp_path / "doc.md").write_text(
        "<!-- test: top -->\n```python\nx = 1\n```\n- item:\n  <!-- test: in-a-list -->\n  ```python\n"
        "  if x:\n      y = 2\n  ```\n```sh\nnot python\n```\n"
    )
    assert [(b.name, b.line, b.code) for b in blocks_of(tmp_path / "doc.md")] == [
        ("top", 2, "x = 1\n"),
        ("in-a-list", 7, "if x:\n    y = 2\n"),
    ]


def test_the_import_line_gives_ortckpts_class():
    namespace: dict = {}
    exec(compile(block("import-line"), "import line", "exec"), namespace)
    assert namespace["CheckpointState"].__module__ == "ortckpt.checkpoint_state"


def test_the_quick_start_runs_as_written_in_an_empty_directory(tmp_path):
    """As a user runs it: pasted into a fresh interpreter in an empty directory (it makes what it loads)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", block("quick-start")],
        cwd=empty,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ("5\nfc.bias True (16,) float32\nfc.weight True (16, 8) float32\npos False (8,) int64\n")
    assert sorted(p.name for p in empty.iterdir()) == ["checkpoint", "checkpoint_with_optimizer"]
    import numpy as np
    from ortckpt import CheckpointState

    for name, optimizer in (("checkpoint", False), ("checkpoint_with_optimizer", True)):
        state = CheckpointState.load_checkpoint(empty / name)
        assert state.properties["epoch"] == 5
        assert ("group0" in state.optimizer_groups) == optimizer
        assert (state.parameters["fc.weight"].data == 0.5).all() and (state.parameters["fc.bias"].data == 1).all()
        assert not state.parameters["pos"].requires_grad
        assert np.array_equal(state.parameters["pos"].data, np.arange(8))


def test_looking_at_checkpoints_runs_in_the_quick_starts_folder(tmp_path):
    """The statistics example, then its command lines, each as a user runs them after the Quick start."""
    import json

    def run(*command: str) -> subprocess.CompletedProcess:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return subprocess.run(
            command,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PATH": path},
        )

    for example in (block("quick-start"), block("looking")):
        done = run(sys.executable, "-c", example)
        assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (
        "fc.weight 3 NaN, finite values from 0.5 to 0.5\n"
        "fc.weight 3 changed (3 to or from NaN/Inf), L2 of the change 0.0\n"
    )
    inspect, diff, report = shell_block("looking-cli")
    assert inspect.startswith("ortckpt inspect --stats") and report.startswith("ortckpt report")
    (tmp_path / "report.html").unlink()
    done = run("bash", "-c", inspect)
    assert done.returncode == 0, done.stderr
    assert "! 1 tensor holds NaN or Inf: fc.weight" in done.stdout
    [row] = [line for line in done.stdout.splitlines() if line.startswith("! fc.weight")]
    assert row.split()[-2:] == ["3", "0"]  # NaN, Inf
    done = run("bash", "-c", diff)
    assert done.returncode == 1, done.stderr  # they differ
    changes = {c["name"]: c for c in json.loads(done.stdout)["changes"]}
    assert changes["fc.weight"]["changed"] == 3 and changes["fc.weight"]["nonfinite"] == 3
    assert all(c["changed"] == 0 for name, c in changes.items() if name != "fc.weight")
    done = run("bash", "-c", report)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "report.html").read_text()
    assert "fc.weight" in page and "checkpoint_with_optimizer" in page and "<svg" in page


def test_readme_checkpoint_manager_example_runs_and_resumes(tmp_path, monkeypatch, capsys):
    example = block("manager")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "CheckpointManager example", "exec"), {})
    first = capsys.readouterr().out
    assert first.startswith("[800, 900, 1000] 1000\nVerified(") and "step=1000" in first
    from ortckpt import CheckpointManager

    weights = CheckpointManager(tmp_path / "checkpoints").restore().parameters["fc.weight"].data.copy()
    # Run again: it resumes at step 1000, with nothing left to do, and changes nothing.
    exec(compile(example, "CheckpointManager example", "exec"), {})
    assert capsys.readouterr().out == first
    again = CheckpointManager(tmp_path / "checkpoints").restore().parameters["fc.weight"].data
    assert (again == weights).all() and weights.any()


def test_readme_validation_example_refuses_the_nan_step(tmp_path, monkeypatch, capsys):
    example = block("validation")
    assert "validate=Forward(" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "validation example", "exec"), {})
    assert capsys.readouterr().out == "['output loss is not finite (1 NaN or Inf values)']\n1\n"
    assert sorted(p.name for p in (tmp_path / "validated").iterdir()) == ["step_00000001"]


def test_the_run_graphs_example_shares_the_graphs_and_a_step_copied_alone_verifies(tmp_path, monkeypatch, capsys):
    example = block("graphs")
    assert 'artifacts="artifacts"' in example
    shutil.copytree(ROOT / "tests" / "data" / "ort-vectors" / "artifacts", tmp_path / "artifacts")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "graphs example", "exec"), {})
    assert capsys.readouterr().out == "['eval', 'optimizer', 'training']\n3\nTrue\n"
    assert sorted(p.name for p in (tmp_path / "graphs-run").iterdir()) == [
        "artifacts",
        "step_00000002",
        "step_00000003",
    ]


def test_readme_compression_example_compresses_the_kept_steps(tmp_path, monkeypatch, capsys):
    example = block("compression")
    assert "compress_kept=True" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "compression example", "exec"), {})
    assert capsys.readouterr().out == "[(2, True), (4, True), (5, False)]\n(256, 256)\n"
    kept = tmp_path / "kept" / "step_00000002"
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoint.zst", "metadata.json"]


def test_readme_tracking_example_logs_to_mlflow_and_registers_the_best(tmp_path, monkeypatch, capsys, mlflow_uri):
    validation, example = block("validation"), block("tracking")
    assert 'track="mlflow"' in example
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # MLflow's own "View run at" line
    exec(compile(validation, "validation example", "exec"), {})  # writes eval_model.onnx
    capsys.readouterr()
    exec(compile(example, "tracking example", "exec"), {})
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
    onnx_example, safetensors_example = block("onnx"), block("safetensors")
    monkeypatch.chdir(tmp_path)
    exec(compile(onnx_example, "ONNX example", "exec"), {})
    exec(compile(safetensors_example, "safetensors example", "exec"), {})
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

    from ortckpt import CheckpointState
    from ortckpt.distributed import Slice, committed_steps

    example = block("sharded")
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
    example = block("deployment")
    assert "ortckpt.average" in example and "export_model" in example
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "deployment example", "exec"), {})
    assert capsys.readouterr().out == "['x'] (2, 4)\n"
    from ortckpt import CheckpointState

    assert CheckpointState.load_checkpoint(tmp_path / "global.ckpt").properties["num_samples"] == 1000


def test_readme_object_storage_example_runs_against_s3(capsys, aws_environment):
    example = block("object-storage")
    assert "s3://ckpt/runs/demo/checkpoint" in example
    exec(compile(example, "object storage example", "exec"), {})
    assert capsys.readouterr().out == "1 32.0\n[2, 3] 3 3\n"
    import ortckpt.object_store as object_store
    from ortckpt import targets

    listed = [k for k, _ in object_store.list_keys(targets.object_location("s3://ckpt/runs/demo"))]
    assert (
        listed[0] == "checkpoint"
        and [k.split("/")[0] for k in listed[1:]] == ["step_00000002"] * 2 + ["step_00000003"] * 2
    )  # each kept step: its metadata and the checkpoint in its attempt folder


def _two_checkpoints(directory: Path) -> None:
    """docs/report.md's inputs: ``previous_checkpoint``, then ``checkpoint`` with a NaN in fc.weight."""
    import numpy as np
    from ortckpt import CheckpointState

    weights = {"fc.weight": np.ones((4, 8), np.float32), "fc.bias": np.zeros(4, np.float32)}
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(weights), directory / "previous_checkpoint")
    weights["fc.weight"][1, 2] = np.nan
    weights["fc.bias"] += 0.5
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(weights), directory / "checkpoint")


def test_the_reports_python_example_writes_the_page(tmp_path, monkeypatch, capsys):
    _two_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block("report-python"), "report example", "exec"), namespace)
    assert capsys.readouterr().out == "['fc.weight']\n"
    assert namespace["stats"]["fc.weight"].nan == 1 and namespace["stats"]["fc.bias"].mean == 0.5
    page = (tmp_path / "report.html").read_text()
    assert "previous_checkpoint" in page and "fc.weight" in page and "<svg" in page
    assert "fc.bias" in namespace["html"] and "previous_checkpoint" not in namespace["html"]


def test_the_reports_mlflow_example_uploads_each_steps_report(tmp_path, monkeypatch, mlflow_uri):
    import numpy as np
    from mlflow import MlflowClient
    from ortckpt import CheckpointState

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"docs-report-{tmp_path.name}")
    namespace: dict = {}
    exec(compile(block("report-mlflow"), "report MLflow example", "exec"), namespace)
    manager = namespace["manager"]
    for step in (1, 2):
        manager.save(CheckpointState.from_arrays({"w": np.full(8, step, np.float32)}), step, metrics={"loss": 1 / step})
    manager.close()
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(f"docs-report-{tmp_path.name}")
    (run,) = client.search_runs([experiment.experiment_id])
    for step in (1, 2):
        listed = client.list_artifacts(run.info.run_id, f"checkpoints/step_{step:08d}")
        assert sorted(a.path.rsplit("/", 1)[1] for a in listed) == ["metadata.json", "report.html"]
    page = Path(client.download_artifacts(run.info.run_id, "checkpoints/step_00000002/report.html", str(tmp_path)))
    assert "Changes from" in page.read_text()
