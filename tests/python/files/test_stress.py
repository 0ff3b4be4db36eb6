"""Concurrency stress (issue 15): for about 15 seconds, at once, two processes save one path
with external data, two load it, and four contend for one CheckpointManager directory (each
writes a few steps when it gets the writer lock, else reads and restores the latest as a
reader). Nothing may fail: no unloadable result, no reader error, no lost step, no warning.

Bounded: under a minute on this project's 2-core machine. `STRESS_SECONDS` makes it longer.
"""

from __future__ import annotations

import os

import pytest

# Beside this file: pytest puts its folder on sys.path.
from concurrency_worker import save_id_of
from ortckpt import CheckpointManager, CheckpointState, verify
from ortckpt.steps import WRITER_LOCK_NAME
from test_concurrent_saves import result, spawn

SECONDS = float(os.environ.get("STRESS_SECONDS", "15"))


@pytest.mark.once
def test_many_processes_saving_loading_and_managing_at_once(tmp_path):
    path, stop, directory = tmp_path / "pair" / "ck", tmp_path / "stop", tmp_path / "run"
    path.parent.mkdir()
    readers = [spawn("load-loop", path, stop) for _ in range(2)]
    writers = [spawn("save-for", path, SECONDS, writer) for writer in (1, 2)]
    managers = [spawn("manager", directory, SECONDS, worker) for worker in range(4)]
    timeout = SECONDS + 60
    saved = [result(w, timeout) for w in writers]
    managed = [result(m, timeout) for m in managers]
    stop.touch()
    seen = [result(r, timeout) for r in readers]

    # One path, two writers, two readers: every load whole, the last save the survivor.
    assert [s["error_count"] for s in seen] == [0, 0], [s["errors"] for s in seen]
    assert all(s["loads"] > 0 for s in seen)
    assert save_id_of(CheckpointState.load_checkpoint(path)) in {s["last"] for s in saved}
    assert sorted(os.listdir(path.parent)) == ["ck", "ck.data"]

    # One manager directory, four processes: no errors, each step committed once, and the
    # directory holds exactly the newest three (max_to_keep=3) of everything committed.
    assert [m["errors"] for m in managed] == [[], [], [], []]
    committed = [step for m in managed for step in m["committed"]]
    assert len(committed) == len(set(committed)) > 3, committed
    assert sum(m["restores"] for m in managed) > 0 and sum(m["busy"] for m in managed) > 0
    with CheckpointManager(directory) as manager:
        assert manager.all_steps() == sorted(committed)[-3:]
        for info in manager.all():
            assert verify(info.directory).step == info.step
            assert save_id_of(info.load()) == info.step
    assert sorted(p.name for p in directory.iterdir()) == [f"step_{s:08d}" for s in sorted(committed)[-3:]]
    assert not (directory / WRITER_LOCK_NAME).exists()
    print(
        f"stress: {sum(s['saves'] for s in saved)} saves and {sum(s['loads'] for s in seen)} loads of one "
        f"path; {len(committed)} manager steps committed by {sum(1 for m in managed if m['committed'])} "
        f"processes, {sum(m['restores'] for m in managed)} reader restores, "
        f"{sum(m['busy'] for m in managed)} writer refusals"
    )
