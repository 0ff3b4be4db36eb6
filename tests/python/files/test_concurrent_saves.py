"""Saves and loads of one path from several processes and threads at once (issue 15, findings 1
and 4): writers of an external-data checkpoint serialize their commits, a reader never sees the
checkpoint of one save beside the data file of another, and no writer removes a temporary file
that a live save is still writing."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

# Beside this file: pytest puts its folder on sys.path.
from concurrency_worker import save_id_of, state_of
from ortckpt import CheckpointState
from ortckpt.convert import load_safetensors, save_safetensors

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "helpers" / "concurrency_worker.py"


def spawn(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def result(process: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_writers_and_a_reader_of_one_external_path_never_see_a_mix(tmp_path):
    path, stop = tmp_path / "ck", tmp_path / "stop"
    reader = spawn("load-loop", path, stop)
    writers = [spawn("save-loop", path, 250, writer) for writer in (1, 2)]
    saves = [result(w) for w in writers]
    stop.touch()
    seen = result(reader)
    assert [s["saves"] for s in saves] == [250, 250]
    assert seen["error_count"] == 0, seen["errors"]
    assert seen["loads"] > 0
    final = save_id_of(CheckpointState.load_checkpoint(path))
    assert final % 1_000_000 == 249  # the last save of one writer or the other
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.data", "stop"]  # no temporary or lock file left


def test_a_commit_waits_for_the_lock_that_another_writer_holds(tmp_path):
    """White-box: the lock external-data saves of ``ck`` commit under is ``.ck.ortckpt-lock``; while
    another process holds it, a save writes its files but does not rename them into place."""
    path = tmp_path / "ck"
    CheckpointState.save_checkpoint(state_of(1), path, True, external_data_threshold=0)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('locked', flush=True)\n"
                "time.sleep(60)\n"
            ),
            str(tmp_path / ".ck.ortckpt-lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        saver = threading.Thread(
            target=CheckpointState.save_checkpoint,
            args=(state_of(2), path, True),
            kwargs={"external_data_threshold": 0},
        )
        saver.start()
        time.sleep(1.0)
        assert saver.is_alive(), "the save committed while another process held the lock"
        assert save_id_of(CheckpointState.load_checkpoint(path)) == 1
        holder.send_signal(signal.SIGKILL)  # a holder that dies releases the lock
        saver.join(30)
        assert not saver.is_alive()
        assert save_id_of(CheckpointState.load_checkpoint(path)) == 2
    finally:
        holder.kill()
        holder.wait()


def test_inline_saves_take_no_lock(tmp_path):
    path = tmp_path / "ck"
    fd = os.open(tmp_path / ".ck.ortckpt-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = threading.Event()
        threading.Thread(target=lambda: (CheckpointState.save_checkpoint(state_of(3), path, True), done.set())).start()
        assert done.wait(30), "an inline save waited for the external-data lock"
    finally:
        os.close(fd)
    assert save_id_of(CheckpointState.load_checkpoint(path)) == 3


def test_an_inline_save_over_an_external_one_removes_the_stale_data_file(tmp_path):
    path = tmp_path / "ck"
    CheckpointState.save_checkpoint(state_of(1), path, True, external_data_threshold=0)
    CheckpointState.save_checkpoint(state_of(2), path, True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert save_id_of(CheckpointState.load_checkpoint(path)) == 2


def test_a_live_save_keeps_its_temporary_file_whatever_its_pid(tmp_path):
    """Liveness is a lock held by the writer, not a pid: a temporary file of a save still running
    (here: locked by this process, named with a pid that does not exist) survives another save's
    cleanup, and one whose writer is gone is removed."""
    path = tmp_path / "ck"
    live = tmp_path / ".ck.ortckpt-tmp.4194304.0"  # a pid above Linux's maximum: never alive
    dead = tmp_path / ".ck.ortckpt-tmp.4194305.0"
    live.write_bytes(b"a save in progress")
    dead.write_bytes(b"a crashed save")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        CheckpointState.save_checkpoint(state_of(1), path)
        assert live.exists(), "a live save's temporary file was removed"
        assert not dead.exists(), "a dead save's temporary file was kept"
    finally:
        os.close(fd)


def test_two_threads_saving_one_safetensors_path_leave_one_whole_file(tmp_path):
    path = tmp_path / "m.safetensors"
    failures = []
    for round_ in range(30):
        states = [CheckpointState.from_arrays({"w": np.full(50_000, 10 * round_ + t, np.float32)}) for t in (1, 2)]
        barrier = threading.Barrier(2)

        def save(state: CheckpointState, barrier: threading.Barrier = barrier, round_: int = round_) -> None:
            barrier.wait()
            try:
                save_safetensors(state, path)
            except Exception as e:
                failures.append(f"round {round_}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=save, args=(s,)) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        values = np.unique(load_safetensors(path).parameters["w"].data)
        assert values.tolist() in ([10 * round_ + 1], [10 * round_ + 2]), f"round {round_}: mixed values {values}"
    assert failures == []
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def saves_racing_loads(path: Path, saves: int, threshold_of: Callable[[int, int], int | None]) -> list[str]:
    """Three threads save ``path`` ``saves`` times each (``threshold_of(writer, i)``: the save's
    external data threshold, None for the default) while two threads load it in a loop; returns
    every error the loads met, each a finding."""
    errors: list[str] = []
    stop = threading.Event()

    def write(writer: int) -> None:
        for i in range(saves):
            threshold = threshold_of(writer, i)
            kwargs = {} if threshold is None else {"external_data_threshold": threshold}
            CheckpointState.save_checkpoint(state_of(writer * 1000 + i), path, True, **kwargs)

    def read() -> None:
        while not stop.is_set():
            try:
                save_id_of(CheckpointState.load_checkpoint(path))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(w,)) for w in (1, 2, 3)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    return errors


@pytest.mark.parametrize("threshold", [0, None])
def test_many_threads_saving_and_loading_one_path(tmp_path, threshold):
    path = tmp_path / "ck"
    CheckpointState.save_checkpoint(state_of(0), path, True)
    assert saves_racing_loads(path, 60, lambda writer, i: threshold) == []
    assert save_id_of(CheckpointState.load_checkpoint(path)) % 1000 == 59


def test_inline_and_external_saves_of_one_path_interleave_safely(tmp_path):
    """Inline saves commit without the lock; a stale data file is removed under it, and only
    while the checkpoint is still the inline save's. Whatever the interleaving, every load is one
    save whole and the final pair is consistent (no data file beside an inline checkpoint that
    another save would need, none missing beside an external one)."""
    path = tmp_path / "ck"
    CheckpointState.save_checkpoint(state_of(0), path, True)
    alternating = lambda writer, i: 0 if (i + writer) % 2 else 2**40  # noqa: E731 - external, inline, ...
    assert saves_racing_loads(path, 80, alternating) == []
    final = CheckpointState.load_checkpoint(path)
    assert save_id_of(final) % 1000 == 79
    names = sorted(os.listdir(tmp_path))
    assert names == (["ck"] if not final.has_external_data else ["ck", "ck.data"]), names
    CheckpointState.save_checkpoint(state_of(5), path, True)  # an inline save cleans up a stale data file
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_python_written_file_killed_mid_save_leaves_no_leftover_after_the_next_save(tmp_path):
    """safetensors files (and index.json) are written by ortckpt's Python side: a save SIGKILLed
    while writing leaves its temporary file; the next save of that path removes it, and leaves
    the temporary file of a save still running (its lock held) alone."""
    path = tmp_path / "m.safetensors"
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom ortckpt import safe_io\n"
        "with safe_io.atomic_file(Path(sys.argv[1])) as f:\n"
        "    f.write(b'half a file'); f.flush(); print('writing', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()
    live = tmp_path / ".m.safetensors.ortckpt-tmp.live"
    live.write_bytes(b"a save in progress")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert len([n for n in os.listdir(tmp_path) if ".ortckpt-tmp." in n]) == 2  # the killed one, the live one
        save_safetensors(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), path)
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, "m.safetensors"])
    finally:
        os.close(fd)


def test_a_full_disk_while_writing_a_safetensors_file_names_it_and_keeps_the_old_one(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk, as in test_crash_safety.py: the write fails with
    EFBIG, the error names the destination, the old file stays and no temporary file is left."""
    path = tmp_path / "m.safetensors"
    save_safetensors(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), path)
    before = path.read_bytes()
    code = (
        "import resource, sys\nimport numpy as np\nfrom ortckpt import CheckpointState\n"
        "from ortckpt.convert import save_safetensors\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "try:\n    save_safetensors(CheckpointState.from_arrays({'w': np.ones(1 << 20, np.float32)}), sys.argv[1])\n"
        "except OSError as e:\n    print(e.errno, e.filename); sys.exit(0)\n"
        "sys.exit('the save succeeded past the file size limit')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    code_, filename = done.stdout.split()
    assert int(code_) in (27, 28) and filename == str(path)  # EFBIG, ENOSPC
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.safetensors"]
