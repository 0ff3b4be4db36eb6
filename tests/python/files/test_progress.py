"""Progress of a save: the core's byte counter, and the tqdm bars built on it."""

from __future__ import annotations

import contextlib
import os
import pty
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointManager, CheckpointState, _boundary, _core, compression
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
    tensors = [("w", 1, tuple(w.shape), w.view(np.uint8).reshape(-1))]
    _boundary.save(path, _boundary.CoreState(tensors, [], [], {}), external_data_threshold=threshold, progress=counter)
    files = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert counter.written == counter.total == files


def test_bars_show_for_saves_and_hashing(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(progress_module, "DELAY_SECONDS", 0)  # show even fast operations
    CheckpointState.save_checkpoint(state_of(8), tmp_path / "plain", progress=True)
    assert "saving plain" in capfd.readouterr().err
    CheckpointManager(tmp_path / "run", progress=True).save(state_of(8), 1)
    err = capfd.readouterr().err
    assert "saving checkpoint" in err and "describing step_00000001" in err
    assert CheckpointManager(tmp_path / "run").restore().parameters["w"].data.sum() == 8 << 18


def test_without_tqdm_the_error_says_what_to_install(tmp_path, monkeypatch):
    for module in ("tqdm", "tqdm.auto"):
        monkeypatch.setitem(sys.modules, module, None)  # (an import of it fails as if it were not installed)
    with pytest.raises(ImportError, match=r"ortckpt\[progress\]"):
        CheckpointState.save_checkpoint(state_of(1), tmp_path / "x", progress=True)
    assert not (tmp_path / "x").exists()


# --- a bar never holds up or fails the work it shows ----------------------------------------

# Saves with every kind of bar, run by a child whose stderr nobody reads any more; "done" on
# stdout once they all returned. Bars show at once (DELAY_SECONDS 0) so each one writes.
EVERY_BAR = """
import os, sys
import numpy as np
from ortckpt import CheckpointManager, CheckpointState, compression, progress
progress.DELAY_SECONDS = 0
where = sys.argv[1]
state = CheckpointState.from_arrays({"w": np.ones(32 << 18, np.float32)})
for i in range(3):
    CheckpointState.save_checkpoint(state, os.path.join(where, "plain"), progress=True)
with CheckpointManager(os.path.join(where, "run"), progress=True) as manager:
    manager.save(state, 1)
compression.compress(os.path.join(where, "plain"), os.path.join(where, "plain.zst"), progress=True)
compression.decompress(os.path.join(where, "plain.zst"), os.path.join(where, "back"), progress=True)
assert CheckpointState.load_checkpoint(os.path.join(where, "back")).parameters["w"].data.sum() == 32 << 18
print("done", flush=True)
os._exit(0)  # (the interpreter's own flush of a broken stderr at exit is not ours to test)
"""


def test_saves_finish_when_stderr_has_no_reader(tmp_path):
    """`python train.py 2>&1 | head -c 100`: once head exits, every write to stderr fails
    (EPIPE). The bars stop showing; the saves go on (they used to hang for ever, tqdm's lock
    left taken by the failed write)."""
    script = tmp_path / "train.py"
    script.write_text(EVERY_BAR)
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child.stderr.close()  # the log reader goes away before the first bar
    try:
        out, _ = child.communicate(timeout=180)
    finally:
        child.kill()
    assert child.returncode == 0, out
    assert out.split() == [b"done"]


LOCK_LEFT_TAKEN = """
import sys, threading, time
import numpy as np
import tqdm
from ortckpt import CheckpointState, progress
progress.DELAY_SECONDS = 0
# Another tqdm user holds tqdm's write lock for good (its write blocked on a pipe nobody drains).
taken = threading.Event()
def hold():
    tqdm.tqdm.get_lock().acquire()
    taken.set()
    threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
taken.wait()
state = CheckpointState.from_arrays({"w": np.ones(1 << 18, np.float32)})
start = time.monotonic()
for i in range(5):
    CheckpointState.save_checkpoint(state, sys.argv[1], progress=True)
bars = [t for t in threading.enumerate() if t.name == "ortckpt-progress"]
print(len(bars), round(time.monotonic() - start), flush=True)
"""


@contextlib.contextmanager
def terminal() -> Iterator[int]:
    """A pseudo-terminal's follower end, to hand a child as its stderr; what it shows is drained
    (so the child never blocks on it)."""
    leader, follower = pty.openpty()
    drained = threading.Thread(target=_drain, args=(leader,), daemon=True)
    drained.start()
    try:
        yield follower
    finally:
        os.close(follower)
        drained.join(10)
        os.close(leader)


def _drain(fd: int) -> None:
    with contextlib.suppress(OSError):  # (EIO once every follower is closed)
        while os.read(fd, 65536):
            pass


def test_a_tqdm_lock_left_taken_costs_one_bar_not_the_saves(tmp_path):
    """A bar thread stuck on tqdm's lock is let go after CLOSE_SECONDS; the bars after it
    show nothing rather than start more stuck threads."""
    script = tmp_path / "lock.py"
    script.write_text(LOCK_LEFT_TAKEN)
    with terminal() as stderr:  # (bars are tqdm's on a terminal only)
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ck")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0
    threads, seconds = map(int, done.stdout.split())
    assert threads == 1  # the first bar's, still waiting on the lock; no other started
    assert seconds < 60  # five saves of 1 MiB: the stuck bar cost one CLOSE_SECONDS, not ever
    assert CheckpointState.load_checkpoint(tmp_path / "ck").parameters["w"].data.sum() == 1 << 18


def test_bars_show_for_uploads(s3_server, s3_url, monkeypatch, capfd):
    """Saves to object storage show a bar over the bytes uploaded, with external data too;
    so does a manager of an s3:// prefix."""
    monkeypatch.setattr(progress_module, "DELAY_SECONDS", 0)
    options = s3_server.storage_options()
    state = state_of(8)
    for threshold in (0, 1 << 40):
        url = f"{s3_url}/plain-{threshold}"
        CheckpointState.save_checkpoint(
            state, url, progress=True, storage_options=options, external_data_threshold=threshold
        )
        assert f"uploading plain-{threshold}" in capfd.readouterr().err
        loaded = CheckpointState.load_checkpoint(url, storage_options=options)
        assert loaded.parameters["w"].data.sum() == 8 << 18
    with CheckpointManager(f"{s3_url}/run", storage_options=options, progress=True) as manager:
        manager.save(state, 1)
    assert "uploading checkpoint" in capfd.readouterr().err
    assert (
        CheckpointManager(f"{s3_url}/run", storage_options=options, read_only=True).restore().parameters["w"].data.sum()
        == 8 << 18
    )


def test_bars_show_for_streams_and_compression(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(progress_module, "DELAY_SECONDS", 0)
    state = state_of(8)
    with open(tmp_path / "streamed", "wb") as stream:
        CheckpointState.save_checkpoint(state, stream, progress=True)
    assert "saving " in capfd.readouterr().err
    compression.compress(tmp_path / "streamed", tmp_path / "c.zst", progress=True)
    assert "compressing streamed" in capfd.readouterr().err
    compression.decompress(tmp_path / "c.zst", tmp_path / "back", progress=True)
    assert "decompressing c.zst" in capfd.readouterr().err
    assert CheckpointState.load_checkpoint(tmp_path / "back").parameters["w"].data.sum() == 8 << 18


@pytest.mark.parametrize("out", [None, "mean"])
def test_bars_show_for_arithmetic(tmp_path, monkeypatch, capfd, out):
    monkeypatch.setattr(progress_module, "DELAY_SECONDS", 0)
    target = None if out is None else tmp_path / out
    mean = ortckpt.average([state_of(8), state_of(8)], progress=True, out=target)
    assert "average" in capfd.readouterr().err
    assert mean.parameters["w"].data.sum() == 8 << 18
    ortckpt.apply(mean, mean, 0.5, progress=True, out=target)
    assert "apply" in capfd.readouterr().err
    with pytest.raises(TypeError, match="progress"):
        ortckpt.average([state_of(1)], progress="yes")


def test_a_bar_counts_from_any_thread():
    bar = progress_module.Bar("counting", 4000)
    threads = [threading.Thread(target=lambda: [bar.update(1) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar.n == 4000


def test_a_log_gets_plain_lines_a_terminal_gets_the_bar(tmp_path):
    # Where stderr is no terminal (a log file), no bar frames (carriage returns): a line now and then and
    # one at the end; on a terminal (a pty), tqdm's bar.
    script = (
        "import numpy as np\n"
        "from ortckpt import CheckpointState, progress\n"
        "progress.DELAY_SECONDS = 0\n"
        "state = CheckpointState.from_arrays({'w': np.ones(8 << 18, np.float32)})\n"
        f"CheckpointState.save_checkpoint(state, {str(tmp_path / 'x')!r}, progress=True)\n"
    )
    with open(tmp_path / "log", "wb") as log:
        subprocess.run([sys.executable, "-c", script], stderr=log, check=True, timeout=60)
    logged = (tmp_path / "log").read_text()
    assert "\r" not in logged and "\x1b" not in logged, repr(logged)
    assert logged.endswith("(done)\n") and all(line.startswith("saving x: ") for line in logged.splitlines())
    leader, follower = pty.openpty()
    done = subprocess.Popen([sys.executable, "-c", script], stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # (EIO: the follower closed)
            break
        if not chunk:
            break
        seen += chunk
    assert done.wait(60) == 0
    os.close(leader)
    assert b"\r" in seen and b"saving x" in seen and b"(done)" not in seen, seen
