"""The README's Python examples run as written (the building example first, as it makes the file)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) == 4, "import line, quick start, building example, CheckpointManager"
    _import_line, quick_start, building, _manager = blocks
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
