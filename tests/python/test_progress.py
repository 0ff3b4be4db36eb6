"""Progress of a save: the core's byte counter, and the tqdm bars built on it."""

from __future__ import annotations

import numpy as np
import pytest
from ortckpt import CheckpointManager, CheckpointState, _core
from ortckpt import progress as progress_module


def state_of(mib: int) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.ones(mib << 18, np.float32), "b": np.zeros(3, np.float32)})


@pytest.mark.parametrize("threshold", [0, 1 << 40], ids=["external", "inline"])
def test_the_counter_ends_at_the_bytes_of_both_files(tmp_path, threshold):
    counter = _core.SaveProgress()
    assert (counter.written, counter.total) == (0, 0)
    state = state_of(70)  # more than two 32 MiB pieces
    path = tmp_path / "ckpt"
    with progress_module.save_progress(False, "unused") as none:
        assert none is None
    w = state.parameters["w"].data
    _core.save(
        str(path),
        [("w", 1, list(w.shape), w.view(np.uint8).reshape(-1))],
        [],
        [],
        [],
        [],
        [],
        external_data_threshold=threshold,
        progress=counter,
    )
    files = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert counter.written == counter.total == files


def test_bars_show_for_saves_and_hashing(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(progress_module, "DELAY_SECONDS", 0)  # show even fast operations
    CheckpointState.save_checkpoint(state_of(8), tmp_path / "plain", progress=True)
    assert "saving plain" in capfd.readouterr().err
    CheckpointManager(tmp_path / "run", progress=True).save(state_of(8), 1)
    err = capfd.readouterr().err
    assert "saving checkpoint" in err and "hashing step_00000001" in err
    assert CheckpointManager(tmp_path / "run").restore().parameters["w"].data.sum() == 8 << 18


def test_without_tqdm_the_error_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    with pytest.raises(ImportError, match=r"ortckpt\[progress\]"):
        CheckpointState.save_checkpoint(state_of(1), tmp_path / "x", progress=True)
    assert not (tmp_path / "x").exists()
