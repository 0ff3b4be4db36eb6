"""Checkpoint arguments at the public edge (ortckpt.targets): a name ending with a slash names a directory,
never a file to write (issue 29, adversarial review)."""

from __future__ import annotations

import numpy as np
import pytest
from ortckpt import CheckpointState, InvalidArgumentError


def state() -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.arange(4, dtype=np.float32)})


@pytest.mark.parametrize("write", ["save", "average", "convert", "compress", "export"])
def test_an_output_name_ending_with_a_slash_is_refused_not_written_as_a_file(tmp_path, monkeypatch, write):
    """`newdir/` names a directory: a path made of it drops the slash, and the checkpoint used to
    be written as a file named `newdir`. Refused, naming the argument, and nothing written."""
    import ortckpt
    from goldens import EVAL_MODEL
    from ortckpt import compression
    from ortckpt.convert.files import save_any

    monkeypatch.chdir(tmp_path)
    state = CheckpointState.from_arrays({"w": np.ones(4, np.float32)})
    CheckpointState.save_checkpoint(state, "source")
    calls = {
        "save": lambda: CheckpointState.save_checkpoint(state, "newdir/"),
        "average": lambda: ortckpt.average(["source", "source"], out="newdir/"),
        "convert": lambda: save_any(state, "newdir/", "safetensors"),
        "compress": lambda: compression.compress("source", "newdir/"),
        "export": lambda: ortckpt.export_model(state, EVAL_MODEL, "newdir/"),
    }
    with pytest.raises(InvalidArgumentError, match="newdir/: names a directory"):
        calls[write]()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
