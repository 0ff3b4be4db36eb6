"""The README's Python examples run as written (the building example first, as it makes the file)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) == 3, "import line, quick start, building example"
    _import_line, quick_start, building = blocks
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
