"""A manager's values at their edges (issue 15, findings 9 and 10): non-finite metrics round-trip and rank,
steps are integers, a full disk names metadata.json, a failed async save is reported once, a damaged RNG state
is refused before any generator changes."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import numpy as np
import pytest
from ortckpt import (
    CheckpointManager,
    CheckpointState,
)

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


@pytest.mark.parametrize(("mode", "value"), [("max", float("inf")), ("min", float("-inf"))])
def test_non_finite_metrics_round_trip_and_rank_after_a_restart(tmp_path, mode, value):
    with CheckpointManager(tmp_path, keep_best=("score", mode, 1), max_to_keep=1) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1, metrics={"score": value})
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 2, metrics={"score": 0.0})
    restarted = CheckpointManager(tmp_path, keep_best=("score", mode, 1), max_to_keep=1)
    assert restarted.latest().metrics["score"] == 0.0
    assert restarted.all()[0].metrics["score"] == value
    restarted.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 3, metrics={"score": 1.0})
    assert restarted.all_steps() == [1, 3], "keep_best deleted the best checkpoint after a restart"
    assert restarted.best().step == 1
    restarted.close()
    text = (tmp_path / "step_00000001" / "metadata.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in metadata.json"))  # strict JSON still


def test_nan_metrics_round_trip_unranked(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1, metrics={"loss": float("nan")})
    restarted = CheckpointManager(tmp_path, read_only=True)
    assert np.isnan(restarted.latest().metrics["loss"])
    assert restarted.best("loss", "min") is None


@pytest.mark.parametrize("step", [np.int64(5), np.int32(5), np.uint8(5)])
def test_integral_numpy_steps_are_accepted(tmp_path, step):
    with CheckpointManager(tmp_path) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), step, epoch=np.int64(1))
        assert manager.all_steps() == [5] and type(manager.all_steps()[0]) is int
        assert manager.restore(np.int64(5)).properties["step"] == 5
    meta = json.loads((tmp_path / "step_00000005" / "metadata.json").read_text())
    assert meta["step"] == 5 and meta["epoch"] == 1


@pytest.mark.parametrize("step", [True, np.bool_(True), 5.0, np.float64(5), -1, "5"])
def test_other_steps_are_refused(tmp_path, step):
    with CheckpointManager(tmp_path) as manager, pytest.raises((TypeError, ValueError)):
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), step)


def test_a_full_disk_while_writing_metadata_names_the_file(tmp_path, monkeypatch):
    from ortckpt import safe_io

    real_write = safe_io.os.write

    def full(fd, data):
        if b'"run_id"' in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(safe_io.os, "write", full)
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(OSError) as e:
            manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1)
        assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("metadata.json"), e.value
        monkeypatch.undo()
        assert manager.all_steps() == []
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ortckpt")) == []


FORGOTTEN_ASYNC_SAVE = """
import sys
import numpy as np
from ortckpt import CheckpointManager, CheckpointState, targets
manager = CheckpointManager(sys.argv[1], async_save=True)
def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")
targets.LocalFile.save = disk_full
manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass", "del manager", "import gc; manager = None; gc.collect()"])
def test_a_failed_async_save_never_waited_for_is_reported(tmp_path, ending):
    script = FORGOTTEN_ASYNC_SAVE.replace("{ending}", ending)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, timeout=60, check=False
    )
    assert "step 1" in done.stderr and "No space left on device" in done.stderr, done.stderr
    assert "never" in done.stderr or "lost" in done.stderr, done.stderr


def test_a_failed_async_save_that_was_waited_for_is_not_reported_twice(tmp_path):
    script = FORGOTTEN_ASYNC_SAVE.replace("{ending}", "try:\n    manager.close()\nexcept OSError:\n    print('caught')")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "caught" and "No space" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: {**s, "numpy_global": {"ndarray": [1], "dtype": "S2000000000"}},
        lambda s: {**s, "python": [3, "x", None]},
        lambda s: {k: v for k, v in s.items() if k != "generators"},
        lambda s: {**s, "generators": [{"kind": "os.system", "state": 1}]},
        lambda s: {**s, "torch": "!!not base64!!"},
        lambda s: [],
    ],
    ids=["huge-dtype", "python-state", "no-generators", "unknown-kind", "torch-base64", "not-a-dict"],
)
def test_a_damaged_rng_state_is_refused_before_any_generator_changes(damage):
    import random

    from ortckpt import capture_rng_state, restore_rng_state

    gen = np.random.default_rng(1)
    state = capture_rng_state(gen)
    before = (random.getstate(), gen.bit_generator.state)
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state(damage(state), gen)
    assert (random.getstate(), gen.bit_generator.state) == before
