"""One writer per CheckpointManager directory, proven by a held lock (issue 15, finding 2): a
second writer gets CheckpointDirectoryInUseError naming the holder instead of deleting a save
in progress; readers need no lock; leftovers are removed only when the lock proves their writer
gone; deletion, retention and same-step collisions fail cleanly."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import (
    CheckpointDirectoryInUseError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointState,
    _boundary,
    targets,
)
from ortckpt.steps import WRITER_LOCK_NAME


def small_state(value: float = 0.0) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full((4, 4), value, np.float32)})


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != WRITER_LOCK_NAME)


def test_a_second_writer_in_the_same_process_is_refused_and_the_running_save_survives(tmp_path, monkeypatch):
    """Two managers of one process (or two containers whose trainers are both pid 1) used to see
    each other's temporary directory as their own crash leftover and delete it mid-save."""
    first = CheckpointManager(tmp_path, async_save=True)
    writing, release = threading.Event(), threading.Event()
    real_save = targets.LocalFile.save

    def slow_save(*args, **kwargs):
        real_save(*args, **kwargs)
        writing.set()
        assert release.wait(30)

    monkeypatch.setattr(targets.LocalFile, "save", slow_save)
    first.save(small_state(1.0), 1)
    assert writing.wait(30)
    with pytest.raises(CheckpointDirectoryInUseError) as e:
        CheckpointManager(tmp_path)
    assert str(os.getpid()) in str(e.value) and socket.gethostname() in str(e.value)
    assert e.value.holder["pid"] == os.getpid() and e.value.filename == str(tmp_path)
    release.set()
    first.close()
    assert first.all_steps() == [1]
    assert CheckpointManager(tmp_path, read_only=True).restore().parameters["w"].data[0, 0] == 1.0


def test_a_second_writer_process_is_refused_until_the_first_closes(tmp_path):
    code = (
        "import sys; from ortckpt import CheckpointManager, CheckpointDirectoryInUseError\n"
        "try:\n    CheckpointManager(sys.argv[1])\nexcept CheckpointDirectoryInUseError as e:\n"
        "    print('in use:', e); sys.exit(3)\nprint('writer')\n"
    )
    with CheckpointManager(tmp_path):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
        assert done.returncode == 3, done.stderr
        assert f"pid {os.getpid()}" in done.stdout
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "writer", done.stderr
    assert visible(tmp_path) == [] and not (tmp_path / WRITER_LOCK_NAME).exists()


def test_a_killed_writer_releases_the_directory_and_its_leftovers_go(tmp_path):
    code = (
        "import os, sys; from ortckpt import CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1])\n"
        "os.mkdir(os.path.join(sys.argv[1], '.step_00000007.tmp-1-abc'))\n"
        "print('ready', flush=True)\nimport time; time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointDirectoryInUseError, match=f"pid {child.pid}"):
            CheckpointManager(tmp_path)
        assert visible(tmp_path) == [".step_00000007.tmp-1-abc"]  # the refused writer removed nothing
    finally:
        child.kill()
        child.wait()
    with CheckpointManager(tmp_path) as manager:
        assert visible(tmp_path) == []
        manager.save(small_state(), 1)


def test_leftover_names_with_absurd_pids_are_removed_without_overflow(tmp_path):
    for name in (
        ".step_00000002.tmp-99999999999999999999-abc",
        ".step_00000003.tmp-0-0",
        ".step_00000004.deleting-xyz",
        ".step_1.tmp-",
    ):
        (tmp_path / name).mkdir()
    with CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == []
        assert visible(tmp_path) == []


def test_readers_need_no_lock_and_see_new_steps(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=1) as writer:
        reader = CheckpointManager(tmp_path, read_only=True)
        assert reader.latest() is None
        writer.save(small_state(1.0), 1)
        assert reader.latest_step() == 1
        writer.save(small_state(2.0), 2)
        assert reader.all_steps() == [2]
        assert reader.restore().parameters["w"].data[0, 0] == 2.0
        with pytest.raises(ValueError, match="read-only"):
            reader.save(small_state(), 3)
        with pytest.raises(ValueError, match="read-only"):
            reader.delete(2)
        assert CheckpointManager(tmp_path / "missing", read_only=True).all_steps() == []
        assert not (tmp_path / "missing").exists()


def test_a_reader_restoring_while_retention_deletes_gets_a_complete_checkpoint(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path, max_to_keep=1) as writer:
        writer.save(small_state(1.0), 1)
        reader = CheckpointManager(tmp_path, read_only=True)
        stale = reader.latest()
        writer.save(small_state(2.0), 2)  # deletes step 1 behind the reader's back
        assert not stale.directory.exists()
        real_reload = reader.reload
        calls = []

        def reload_once_stale():
            calls.append(1)
            if len(calls) == 1:  # the reader's view is out of date once
                return
            real_reload()

        monkeypatch.setattr(reader, "reload", reload_once_stale)
        reader._checkpoints = {1: stale}
        assert reader.restore().parameters["w"].data[0, 0] == 2.0


def test_saving_a_step_whose_directory_exists_unlisted_raises_checkpoint_exists(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "step_00000005" / "something").write_text("not ours")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointExistsError, match="step_00000005"):
        manager.save(small_state(), 5)
    assert visible(tmp_path) == ["step_00000005"]  # and no temporary directory left
    manager.close()


def test_a_failed_delete_keeps_the_step_listed(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path) as manager:
        manager.save(small_state(), 1)
        manager.save(small_state(), 2)

        def refuse(src, dst, *, durable=False):
            raise PermissionError(errno.EACCES, "Permission denied", str(src))

        monkeypatch.setattr(_boundary, "rename_directory", refuse)
        with pytest.raises(PermissionError):
            manager.delete(1)
        monkeypatch.undo()
        assert manager.all_steps() == [1, 2]
        manager.delete(1)
        assert manager.all_steps() == [2]


def test_retention_that_fails_after_a_commit_does_not_fail_the_save(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path, max_to_keep=1) as manager:
        manager.save(small_state(), 1)
        real_rename = _boundary.rename_directory

        def refuse_deletions(src, dst, *, durable=False):
            if ".deleting-" in str(dst):
                raise PermissionError(errno.EACCES, "Permission denied", str(src))
            return real_rename(src, dst, durable=durable)

        monkeypatch.setattr(_boundary, "rename_directory", refuse_deletions)
        with pytest.warns(RuntimeWarning, match="could not delete"):
            manager.save(small_state(), 2)  # committed: the failed deletion is a warning
        assert manager.all_steps() == [1, 2]
        monkeypatch.undo()
        manager.save(small_state(), 3)  # retention catches up
        assert manager.all_steps() == [3] and visible(tmp_path) == ["step_00000003"]


def test_a_step_removed_by_hand_is_forgotten_by_retention(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=1) as manager:
        manager.save(small_state(), 1)
        shutil.rmtree(tmp_path / "step_00000001")
        manager.save(small_state(), 2)  # retention would delete step 1: it is already gone
        assert manager.all_steps() == [2]


def test_the_writer_lock_file_goes_when_the_manager_closes_or_is_collected(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert (tmp_path / WRITER_LOCK_NAME).exists()
    manager.close()
    assert not (tmp_path / WRITER_LOCK_NAME).exists()
    assert manager.all_steps() == []  # queries still work after close
    with pytest.raises(ValueError, match="closed"):
        manager.save(small_state(), 1)
    CheckpointManager(tmp_path).save(small_state(), 1)  # collected at once: the lock is released
    with CheckpointManager(tmp_path) as again:
        assert again.all_steps() == [1]


def test_a_planted_symlink_as_the_writer_lock_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / WRITER_LOCK_NAME).symlink_to(victim)
    with pytest.raises(OSError) as e:
        CheckpointManager(directory)
    assert e.value.errno == errno.ELOOP and e.value.filename == str(directory / WRITER_LOCK_NAME)
    assert victim.read_text() == "precious"


def test_each_save_takes_the_umask_of_its_moment(tmp_path):
    """The umask is read at every save, not once at the first: a program that tightens it (or
    loosens it) between saves gets files of the new mode, as any file it creates would be."""
    old = os.umask(0o022)
    try:
        ortckpt.save_checkpoint(small_state(), tmp_path / "open", external_data_threshold=0)
        with CheckpointManager(tmp_path / "run", external_data_threshold=0) as manager:
            manager.save(small_state(), 1)
            os.umask(0o077)
            ortckpt.save_checkpoint(small_state(), tmp_path / "private", external_data_threshold=0)
            manager.save(small_state(1.0), 2)
    finally:
        os.umask(old)
    for name in ("open", "open.data"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    for name in ("private", "private.data"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name
    assert (tmp_path / "run" / "step_00000001").stat().st_mode & 0o077 == 0o055
    step = tmp_path / "run" / "step_00000002"
    assert step.stat().st_mode & 0o077 == 0
    for child in step.iterdir():
        assert child.stat().st_mode & 0o077 == 0, (child, oct(child.stat().st_mode))


def test_step_directories_are_not_writable_by_others(tmp_path):
    old = os.umask(0o000)
    try:
        with CheckpointManager(tmp_path) as manager:
            manager.save(small_state(), 1)
    finally:
        os.umask(old)
    mode = (tmp_path / "step_00000001").stat().st_mode & 0o777
    assert mode & 0o022 == 0, oct(mode)
    for child in (tmp_path / "step_00000001").iterdir():
        assert child.stat().st_mode & 0o022 == 0, (child, oct(child.stat().st_mode))


def test_two_managers_started_at_once_elect_one_writer(tmp_path):
    outcomes: list[str] = []
    barrier = threading.Barrier(8)
    all_tried = threading.Event()

    def start() -> None:
        barrier.wait()
        try:
            manager = CheckpointManager(tmp_path)
        except CheckpointDirectoryInUseError:
            outcomes.append("refused")
            if len(outcomes) == 8:
                all_tried.set()
            return
        outcomes.append("writer")
        if len(outcomes) == 8:
            all_tried.set()
        all_tried.wait(60)  # the writer holds the directory until every other has tried
        manager.close()

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["writer"]


def test_sharded_saves_without_a_manager_take_the_same_lock(tmp_path):
    from ortckpt.distributed import ShardedCheckpointError, save_sharded

    with CheckpointManager(tmp_path):
        with pytest.raises(ShardedCheckpointError, match="another writer holds") as e:
            save_sharded(small_state(), tmp_path, step=1)  # (raised alike on every rank)
        assert isinstance(e.value.__cause__, CheckpointDirectoryInUseError)
    save_sharded(small_state(), tmp_path, step=1)
    assert visible(tmp_path) == ["step_00000001"]


def test_ortckpt_exports_the_new_error():
    assert issubclass(ortckpt.CheckpointDirectoryInUseError, ortckpt.CheckpointError)


def test_a_fifo_planted_as_a_lock_file_is_refused_without_blocking(tmp_path):
    from ortckpt import SpecialFileError

    os.mkfifo(tmp_path / WRITER_LOCK_NAME)
    with pytest.raises(SpecialFileError):
        CheckpointManager(tmp_path)
    os.mkfifo(tmp_path / ".ck.ortckpt-lock")
    with pytest.raises(SpecialFileError):
        CheckpointState.save_checkpoint(small_state(), tmp_path / "ck", external_data_threshold=0)
    assert not (tmp_path / "ck").exists()


def test_the_holder_record_is_shown_without_control_characters(tmp_path):
    code = (
        "import sys, time; from ortckpt import CheckpointManager\n"
        "sys.argv = ['train.py', '\\x1b[2J\\x1b]0;owned\\x07']\n"
        "m = CheckpointManager(sys.argv[0] and __import__('os').environ['DIR'])\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "DIR": str(tmp_path)}
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(CheckpointDirectoryInUseError) as e:
            CheckpointManager(tmp_path)
        assert "\x1b" not in str(e.value) and "\x07" not in str(e.value) and "train.py" in str(e.value)
    finally:
        child.kill()
        child.wait()


def test_a_lock_file_left_by_another_user_does_not_stop_the_next_writer():
    """A writer that died leaves its lock file, owned by its user; the next writer, another user
    who cannot open it for writing, finds it held by nobody and replaces it with its own."""
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="ortckpt-shared-"))  # (pytest's tmp_path is private to its user)
    os.chmod(shared, 0o777)
    lock = shared / WRITER_LOCK_NAME
    lock.write_text('{"pid": 1}')
    code = (
        "import os, sys\n"
        "from ortckpt import CheckpointManager\n"  # (imported first: nobody cannot read root's Python)
        "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
        "with CheckpointManager(sys.argv[1]) as m:\n    print('writer', os.access(sys.argv[2], os.W_OK))\n"
    )
    if os.geteuid() != 0:
        os.chmod(lock, 0o444)  # not ours to write, as another user's would be
    else:
        os.chmod(lock, 0o644)  # root's: the subprocess runs as nobody
    import ortckpt as package

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(package.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, str(shared), str(lock)], capture_output=True, text=True, env=env, check=False
    )
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "writer True"  # the lock file is now the new writer's
        assert not lock.exists()  # released as usual: removed by the writer that held it
    finally:
        shutil.rmtree(shared)


def test_without_file_locks_a_writer_warns_and_removes_no_leftovers(tmp_path, monkeypatch):
    """Some network filesystems have no locks (ENOLCK): then nothing proves a leftover's writer
    gone, so none is removed (a guess could delete a live save), and the writer says so."""
    from ortckpt.stepstore import directory

    leftover = tmp_path / ".step_00000002.tmp-0123456789abcdef"
    leftover.mkdir()
    monkeypatch.setattr(directory, "acquire_lock", lambda path, record: None)  # as the core answers ENOLCK
    with pytest.warns(RuntimeWarning, match="no file locks"):
        manager = CheckpointManager(tmp_path)
    with manager:
        manager.save(small_state(), 1)
        assert manager.all_steps() == [1]
    assert leftover.exists()
