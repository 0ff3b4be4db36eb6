"""The edges of the one commit (issue 28): every way ortckpt publishes bytes goes through the
core's commit, and each edge an adversarial round broke is held here: raw streams, a user's own
``<name>.data``, killed and concurrent arithmetic, decompressing a damaged archive, locks held
too long or by another user, readers that would keep a crashed trainer from resuming, the core's
staging. (Readers that must never see a hole while retention deletes: manager/test_conformance.py.)"""

from __future__ import annotations

import io
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import (
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointState,
    _boundary,
    targets,
)
from ortckpt.steps import WRITER_LOCK_NAME
from privileges import needs_root

NOBODY = 65534


def state_of(value: float, n: int = 1 << 10) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full(n, value, np.float32), "b": np.full(7, value, np.float32)})


def value_of(path: Path) -> float:
    state = CheckpointState.load_checkpoint(path)
    w, b = state.parameters["w"].data, state.parameters["b"].data
    assert np.all(w == w[0]) and np.all(b == w[0]), "a checkpoint mixing two saves"
    return float(w[0])


# --- streams -------------------------------------------------------------------------------------


class Trickle(io.RawIOBase):
    """A raw stream that takes at most ``most`` bytes a call (a pipe, a socket)."""

    def __init__(self, most: int) -> None:
        self.most, self.data = most, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b):  # type: ignore[no-untyped-def]
        taken = memoryview(b).cast("B")[: self.most]
        self.data += taken
        return len(taken)


def test_a_save_to_a_raw_stream_writes_every_byte_or_raises():
    state = state_of(1.0, n=4 << 20)  # 16 MiB: one write() of it took 219 KiB and the save returned
    sink = Trickle(219 << 10)
    ortckpt.save_checkpoint(state, sink)
    assert bytes(sink.data) == state.to_bytes()

    class WouldBlock(Trickle):
        def write(self, b):  # type: ignore[no-untyped-def]
            return None

    class Refuses(Trickle):
        def write(self, b):  # type: ignore[no-untyped-def]
            return 0

    with pytest.raises(BlockingIOError):
        ortckpt.save_checkpoint(state, WouldBlock(1))
    with pytest.raises(OSError, match="returned 0"):
        ortckpt.save_checkpoint(state, Refuses(1))


class Endless(io.RawIOBase):
    """A stream that never ends (a hostile peer), counting what it gave."""

    def __init__(self, head: bytes) -> None:
        self.head, self.given = head, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer):  # type: ignore[no-untyped-def]
        view = memoryview(buffer).cast("B")
        chunk = (self.head + bytes(len(view)))[: len(view)] if self.given == 0 else bytes(len(view))
        view[: len(chunk)] = chunk
        self.given += len(chunk)
        return len(chunk)


def test_a_stream_is_read_no_further_than_a_checkpoint_can_reach(monkeypatch):
    not_a_checkpoint = Endless(b"\0\0\0\0JUNK")
    with pytest.raises(CheckpointFormatError, match="file identifier"):
        ortckpt.load_checkpoint(not_a_checkpoint)
    assert not_a_checkpoint.given <= 16 << 20  # refused at its first chunk
    monkeypatch.setattr(targets, "MAX_CHECKPOINT_BYTES", 1 << 20)  # (the real limit is 2 GiB)
    endless = Endless(b"\x10\0\0\0ODTC")
    with pytest.raises(CheckpointFormatError, match="more than"):
        ortckpt.load_checkpoint(endless)
    assert endless.given <= (1 << 20) + 1


# --- what an inline save removes -----------------------------------------------------------------


def test_an_inline_save_removes_only_the_data_file_of_the_checkpoint_it_replaces(tmp_path):
    path, data = tmp_path / "train", tmp_path / "train.data"
    data.write_bytes(b"a user's own training data")
    ortckpt.save_checkpoint(state_of(1.0), path)
    assert data.read_bytes() == b"a user's own training data"

    ortckpt.save_checkpoint(state_of(2.0), path, external_data_threshold=0)  # its own train.data
    ortckpt.save_checkpoint(state_of(3.0), path)  # inline: the replaced checkpoint's data goes
    assert not data.exists() and value_of(path) == 3.0

    other = tmp_path / "other"  # the data file of another checkpoint, beside this one
    ortckpt.save_checkpoint(state_of(4.0), other, external_data_threshold=0)
    shutil.copy(f"{other}.data", data)
    ortckpt.save_checkpoint(state_of(5.0), path)
    assert data.read_bytes() == Path(f"{other}.data").read_bytes()


# --- arithmetic and decompress through the one commit ------------------------------------------------

KILLED_AVERAGE = textwrap.dedent(
    """
    import sys, time
    import ortckpt
    from ortckpt import _boundary, arithmetic
    real = _boundary.combine
    def slow(operation, coefficients, jobs, progress):
        # killed once the first chunk of the result is in the staged file
        def stop(n):
            print("writing", flush=True)
            time.sleep(60)
        return real(operation, coefficients, jobs, stop)
    _boundary.combine = slow
    arithmetic.average(sys.argv[1:3], out=sys.argv[3], external_data_threshold=0)
    """
)


def test_a_killed_average_leaves_nothing_for_ever(tmp_path):
    sources = [tmp_path / "a", tmp_path / "b"]
    for i, source in enumerate(sources):
        ortckpt.save_checkpoint(state_of(float(i)), source)
    out = tmp_path / "out"
    ortckpt.save_checkpoint(state_of(9.0), out, external_data_threshold=0)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_AVERAGE, *map(str, sources), str(out)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left and all(".ortckpt-tmp." in name for name in left), left  # locked temporaries, no staging dirs
    assert value_of(out) == 9.0  # untouched
    ortckpt.average(sources, out=out)  # the next commit of out proves them dead and sweeps them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]
    assert value_of(out) == 0.5


CONCURRENT_AVERAGES = textwrap.dedent(
    """
    import sys
    import ortckpt
    sources, out, rounds = sys.argv[1:3], sys.argv[3], int(sys.argv[4])
    for _ in range(rounds):
        ortckpt.average(sources, out=out, external_data_threshold=0)
    print("done", flush=True)
    """
)


def test_two_averages_into_one_path_never_leave_it_unloadable(tmp_path):
    """Two processes average different sources into one ``out`` with external data, while a reader
    loads it: each load is one average whole (today's staging moved the two files into place
    by two renames with no lock between, so a checkpoint could end beside the other's data)."""
    pairs = [[tmp_path / f"{j}{i}" for i in range(2)] for j in "pq"]
    for j, pair in enumerate(pairs):
        for i, source in enumerate(pair):
            ortckpt.save_checkpoint(state_of(10.0 * j + 2 * i, n=1 << 16), source)
    out = tmp_path / "out"
    ortckpt.average(pairs[0], out=out, external_data_threshold=0)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_AVERAGES, *map(str, pair), str(out), "40"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pair in pairs
    ]
    seen = set()
    while any(w.poll() is None for w in writers):
        seen.add(value_of(out))  # a mixed pair raises, or fails value_of's check
    for writer in writers:
        out_text, err = writer.communicate()
        assert writer.returncode == 0 and out_text.strip() == "done", err[-2000:]
    assert seen <= {1.0, 11.0} and value_of(out) in (1.0, 11.0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out", "out.data"]


def test_decompress_checks_the_whole_archive_before_it_replaces_anything(tmp_path):
    from ortckpt.compression import compress, decompress, read_footer

    source, archive, target = tmp_path / "src", tmp_path / "src.zst", tmp_path / "target"
    ortckpt.save_checkpoint(state_of(1.0, n=1 << 16), source, external_data_threshold=0)
    compress(source, archive)
    ortckpt.save_checkpoint(state_of(2.0, n=1 << 16), target, external_data_threshold=0)
    before = (target.read_bytes(), Path(f"{target}.data").read_bytes())
    with open(archive, "rb") as f:
        checkpoint_frame = read_footer(f, str(archive))["files"][0]
    damaged = bytearray(archive.read_bytes())  # the checkpoint's frame: the one the old code wrote last
    damaged[checkpoint_frame["frame_offset"] + checkpoint_frame["frame_size"] // 2] ^= 0xFF
    archive.write_bytes(bytes(damaged))
    with pytest.raises((ortckpt.CheckpointIntegrityError, CheckpointFormatError)):
        decompress(archive, target)
    assert (target.read_bytes(), Path(f"{target}.data").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "src.data", "src.zst", "target", "target.data"]


# --- locks: a deadline, and nobody else's ---------------------------------------------------------

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from ortckpt import _boundary
    lock = _boundary.acquire_lock(sys.argv[1], timeout=0, record="the other save, stuck")
    print("held", flush=True)
    time.sleep(60)
    """
)


def test_a_commit_lock_held_past_its_deadline_is_a_typed_error_naming_the_holder(tmp_path):
    path = tmp_path / "ck"
    ortckpt.save_checkpoint(state_of(1.0), path, external_data_threshold=0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / ".ck.ortckpt-lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(CheckpointLockedError) as e:
            ortckpt.save_checkpoint(state_of(2.0), path, external_data_threshold=0, lock_timeout=0.5)
        assert 0.5 <= time.monotonic() - started < 10
        assert e.value.filename == str(tmp_path / ".ck.ortckpt-lock") and "the other save, stuck" in str(e.value)
        assert e.value.holder == "the other save, stuck"
    finally:
        holder.kill()
        holder.wait()
    assert value_of(path) == 1.0  # the previous checkpoint, whole
    ortckpt.save_checkpoint(state_of(3.0), path, external_data_threshold=0)  # the holder gone: no wait
    assert value_of(path) == 3.0


def shared_directory() -> Path:
    """A directory another user can use (pytest's tmp_path is private to its user)."""
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-shared-"))
    os.chmod(directory, 0o777)
    return directory


def as_nobody(code: str, *args: object) -> subprocess.Popen:
    """Python running as user nobody with no supplementary groups: started as root (this
    interpreter may live where nobody can read it, as pyenv's under /root do), its modules
    imported, then its user dropped before ``code`` runs."""
    drop = f"import fcntl, os, sys, time\nos.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
    return subprocess.Popen(
        [sys.executable, "-c", drop + code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


OTHER_USER_HOLDS = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
    os.fchmod(fd, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
    """
)


@needs_root
def test_a_lock_file_another_user_holds_never_makes_a_save_wait():
    directory = shared_directory()
    try:
        path = directory / "ck"
        ortckpt.save_checkpoint(state_of(1.0), path, external_data_threshold=0)
        other = as_nobody(OTHER_USER_HOLDS, str(directory / ".ck.ortckpt-lock"))
        try:
            assert other.stdout.readline().strip() == "held", other.stderr.read()
            started = time.monotonic()  # (its file is writable by the directory's writers: it may be a co-writer's)
            with pytest.raises(CheckpointLockedError, match="past the deadline") as e:
                ortckpt.save_checkpoint(state_of(2.0), path, external_data_threshold=0, lock_timeout=1)
            assert 1 <= time.monotonic() - started < 10  # the deadline, not for ever
            assert e.value.filename == str(directory / ".ck.ortckpt-lock")
        finally:
            other.kill()
            other.wait()
        assert value_of(path) == 1.0
        ortckpt.save_checkpoint(state_of(3.0), path, external_data_threshold=0)  # held by nobody now: replaced
        assert value_of(path) == 3.0 and not (directory / ".ck.ortckpt-lock").exists()
    finally:
        shutil.rmtree(directory)


READER_TAKES_THE_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    try:
        fd = os.open(sys.argv[1], os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("held", flush=True)
    except OSError as e:
        print("refused", e.errno, flush=True)
    time.sleep(60)
    """
)

TRAINER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from ortckpt import CheckpointManager, CheckpointState
    manager = CheckpointManager(sys.argv[1])
    manager.save(CheckpointState.from_arrays({"w": np.ones(4, np.float32)}), 1)
    print("saved", flush=True)
    time.sleep(60)
    """
)


@needs_root
def test_a_reader_with_read_access_cannot_keep_a_crashed_trainer_from_resuming():
    """flock needs only an open descriptor: a lock file anyone may read is one anyone may hold.
    The writer lock is its owner's alone (0600), so a reader of another user cannot take it."""
    directory = shared_directory()
    os.chmod(directory, 0o755)  # readers may read it, not write it
    try:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(directory)], stdout=subprocess.PIPE, text=True)
        assert trainer.stdout.readline().strip() == "saved"
        trainer.send_signal(signal.SIGKILL)  # crashed: its lock file stays, unheld
        trainer.wait()
        lock = directory / WRITER_LOCK_NAME
        assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600
        reader = as_nobody(READER_TAKES_THE_LOCK, str(lock))
        try:
            assert reader.stdout.readline().split()[0] == "refused", reader.stderr.read()
            with CheckpointManager(directory, max_to_keep=1) as resumed:  # not blocked
                resumed.save(resumed.restore(), 2)
                assert resumed.all_steps() == [2]
        finally:
            reader.kill()
            reader.wait()
    finally:
        shutil.rmtree(directory)


def test_the_core_staging_is_the_only_way_files_replace_each_other(tmp_path):
    """A staged file replaces its target only at commit; discarded, nothing changes."""
    target = tmp_path / "doc"
    target.write_bytes(b"old")
    staging = _boundary.stage(target)
    os.write(staging.fileno(), b"new")
    assert target.read_bytes() == b"old" and Path(staging.temporary()).exists()
    staging.discard()
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["doc"]
    staging = _boundary.stage(target)
    os.write(staging.fileno(), b"new")
    staging.commit()
    assert target.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["doc"]
    with pytest.raises(ortckpt.CheckpointStateError, match="committed or discarded"):
        staging.commit()
