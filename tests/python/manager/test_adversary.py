"""An adversarial review of the transaction layer: the step stores' and the manager's part (the one commit of
local files is files/test_adversary_commit.py; ADVERSARY_FINDINGS.md beside this file lists every finding).

Every test marked FINDING failed when it was written: it asserts what should happen when a process is killed,
a second process or thread interleaves, another user or a forked child is involved, or an S3 writer dies, and
something else happened then (see each docstring). Tests marked HELD are attacks the code withstood, kept for
the coverage they add.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState
from ortckpt.steps import WRITER_LOCK_NAME
from ortckpt.stepstore import ObjectStore
from privileges import needs_root

NOBODY = 65534


def state_of(value: float, n: int = 1 << 10) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full(n, value, np.float32), "b": np.full(7, value, np.float32)})


def value_of(state: CheckpointState) -> float:
    """The one value a checkpoint of :func:`state_of` holds (an assertion if it mixes two)."""
    w, b = state.parameters["w"].data, state.parameters["b"].data
    assert np.all(w == w[0]) and np.all(b == w[0]), "a checkpoint mixing two saves"
    return float(w[0])


# --- the writer lock -------------------------------------------------------------------------------------


FORKED_CHILD_EXITS = textwrap.dedent(
    """
    import os, subprocess, sys
    import ortckpt
    directory = sys.argv[1]
    manager = ortckpt.CheckpointManager(directory)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked helper (an uploader, a daemonised job) that simply ends
    os.waitpid(pid, 0)
    second = (
        "import sys, ortckpt\\n"
        "try:\\n"
        "    ortckpt.CheckpointManager(sys.argv[1]); print('admitted')\\n"
        "except ortckpt.CheckpointDirectoryInUseError:\\n"
        "    print('refused')\\n"
    )
    other = subprocess.run([sys.executable, "-c", second, directory], check=False, capture_output=True, text=True)
    print(other.stdout.strip() or other.stderr, flush=True)
    manager.close()
    """
)


def test_finding_a_forked_child_that_ends_does_not_release_the_writers_lock(tmp_path):
    """FINDING (two writers of one directory; the second's start-up sweep would remove the
    first's step in progress). The writer lock is released by a weakref.finalize, which runs at exit: in a
    child forked by the writer it runs too when the child exits normally (sys.exit, the end of
    the script). LockFile's Drop then removes the lock file (its name still refers to the inode)
    and unlocks it, and flock locks belong to the open file description the child shares with
    its parent: the parent loses its lock while it runs, and a second writer is admitted. Every
    time."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD_EXITS, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused", f"a second writer while the first runs: {done.stdout!r}"


KILLED_TRAINER = (
    "import sys, time, ortckpt\nm = ortckpt.CheckpointManager(sys.argv[1])\nprint('open', flush=True)\ntime.sleep(60)\n"
)
NEXT_WRITER_AS_NOBODY = textwrap.dedent(
    f"""
    import os, sys
    from ortckpt import CheckpointManager  # (imported first: nobody may not read root's Python)
    os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
    try:
        CheckpointManager(sys.argv[1]).close()
        print("writer")
    except Exception as e:
        print(type(e).__name__, e)
    """
)


@needs_root
def test_finding_a_killed_writers_lock_file_does_not_stop_another_users_writer_for_ever():
    """FINDING (liveness: refused for ever, naming a holder that is dead). A writer that dies
    leaves its lock file, created mode 0600. The next writer of another user (a shared project
    directory) cannot open it, so replace_foreign refuses it as "cannot be read, so nothing
    tells whether it is held": CheckpointDirectoryInUseError ("another writer holds this
    checkpoint directory"), at every try, until someone removes the file by hand. The code and
    README promise that a lock file another user left is replaced when nobody holds it "so that
    it can never stop the next writer"; the existing test of that promise plants a 0644 file,
    which ortckpt itself never creates. Every time."""
    shared = Path(tempfile.mkdtemp(prefix="ortckpt-shared-"))
    os.chmod(shared, 0o777)
    try:
        trainer = subprocess.Popen(
            [sys.executable, "-c", KILLED_TRAINER, str(shared)], stdout=subprocess.PIPE, text=True
        )
        assert trainer.stdout.readline().strip() == "open"
        trainer.kill()  # OOM-killed, preempted: its lock file stays, held by nobody
        trainer.wait()
        assert (shared / WRITER_LOCK_NAME).exists()
        env = {**os.environ, "PYTHONPATH": str(Path(ortckpt.__file__).parents[1])}
        done = subprocess.run(
            [sys.executable, "-c", NEXT_WRITER_AS_NOBODY, str(shared)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
        )
        assert done.stdout.strip() == "writer", done.stdout + done.stderr
    finally:
        shutil.rmtree(shared)


# --- the manager in a directory -------------------------------------------------------------------


def test_finding_a_readers_verify_while_retention_deletes_is_no_integrity_alarm(tmp_path, monkeypatch):
    """FINDING (wrong error: a false corruption alarm). A read-only manager's verify() takes the
    latest step, then hashes its files; when the writer commits a newer step and retention
    deletes that one meanwhile (max_to_keep=1), verify raises CheckpointIntegrityError
    ("checkpoint: missing"), the error that means a damaged checkpoint, about a step that was
    deleted whole. restore() looks again in that case; verify() should too (or say the step is
    gone). Every time (the writer's save is run at that moment)."""
    from ortckpt.manager import checkpoint_manager

    writer = CheckpointManager(tmp_path, max_to_keep=1)
    writer.save(state_of(1.0), 1)
    reader = CheckpointManager(tmp_path, read_only=True)
    real = checkpoint_manager.verify_step

    def writer_saves_meanwhile(store, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(checkpoint_manager, "verify_step", real)
        writer.save(state_of(2.0), 2)  # retention deletes step 1
        return real(store, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint_manager, "verify_step", writer_saves_meanwhile)
    try:
        verified = reader.verify()
    except FileNotFoundError:
        pass  # "the step is gone": an honest answer
    except CheckpointIntegrityError as e:
        pytest.fail(f"a deleted step reported as damaged: {e}")
    else:
        assert verified.step == 2
    writer.close()


# --- S3 ------------------------------------------------------------------------------------------------


KILLED_AFTER_THE_DATA_OBJECT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import ortckpt
    import ortckpt.object_store as object_store
    url, options = sys.argv[1], json.loads(sys.argv[2])
    real = object_store.put_stream

    def put_stream(location, pieces, digest=None, on_bytes=None):
        size = real(location, pieces, digest, on_bytes)
        if location.key.endswith(".data"):  # the data object is up; the checkpoint is next
            os.kill(os.getpid(), signal.SIGKILL)
        return size

    object_store.put_stream = put_stream
    state = ortckpt.CheckpointState.from_arrays({"w": np.full(1024, 2.0, np.float32), "b": np.full(7, 2.0, np.float32)})
    ortckpt.save_checkpoint(state, url, storage_options=options, external_data_threshold=0)
    """
)


def test_finding_s3_a_save_killed_after_its_data_object_keeps_the_previous_checkpoint(s3_server, s3_url):
    """FINDING (unloadable: the previous checkpoint lost). A save to ``s3://.../ckpt`` with external
    data uploads ``ckpt.data`` first, then ``ckpt``. Killed (or failing: a lost connection) between
    the two, it leaves the previous ``ckpt`` beside the new ``ckpt.data``; the pair trailers make
    that a CheckpointFormatError, and unlike a local save nothing holds the new checkpoint to
    recover it. The README says "a killed one stays invisible, and the previous object stays
    whole": the object does, the checkpoint does not load. Every time."""
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    ortckpt.save_checkpoint(state_of(1.0), url, storage_options=options, external_data_threshold=0)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_THE_DATA_OBJECT, url, json.dumps(options)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # Fixed: the killed save's checkpoint went up first beside its key; the load finds it there,
    # the one that matches the data object in place: the new checkpoint, whole.
    assert value_of(ortckpt.load_checkpoint(url, storage_options=options)) == 2.0


def test_finding_s3_a_sweep_racing_a_zombie_commit_never_leaves_a_step_naming_gone_objects(
    s3_server, s3_url, monkeypatch
):
    """FINDING (unloadable: the latest committed step's objects deleted). The sweep lists the
    prefix, decides what no document names, then deletes it. A zombie writer that commits between
    the sweep's listing and its DELETE passes both of its presence checks (the objects are still
    there before and after its PUT) and commits; then the sweep's DELETE lands and removes the
    objects the new metadata.json names. Readers list step 2 as the latest and every restore()
    fails with FileNotFoundError (a read-only reader does not fall back: the step is still
    listed). The README promises "a zombie job beside its restart never commits a step naming
    objects that are gone". Here the sweep's DELETE is held until the zombie's save has returned
    (on a real prefix the window is the sweep's listing, document reads and batches). Every time."""
    options = s3_server.storage_options()
    zombie = CheckpointManager(s3_url, storage_options=options)
    zombie.save(state_of(1.0), 1)
    real_describe, real_remove = ObjectStore.describe, object_store.remove
    deleting, landed = threading.Event(), threading.Event()
    sweep: list[threading.Thread] = []

    def slow_delete(locations):  # type: ignore[no-untyped-def]
        if threading.current_thread() is sweep[0] and not landed.is_set():
            deleting.set()  # the sweep's DELETE is on its way, and lands only once the zombie has committed
            assert landed.wait(60)
        return real_remove(locations)

    def restart_sweeps_meanwhile(store, attempt, *args, **kwargs):  # type: ignore[no-untyped-def]
        described = real_describe(store, attempt, *args, **kwargs)  # the zombie's objects are up, uncommitted

        def restart() -> None:
            with CheckpointManager(s3_url, storage_options=options) as restarted:
                restarted.remove_leftovers()

        sweep.append(threading.Thread(target=restart))
        sweep[0].start()
        assert deleting.wait(60)  # listed, decided, its DELETE sent
        return described

    monkeypatch.setattr(object_store, "remove", slow_delete)
    monkeypatch.setattr(ObjectStore, "describe", restart_sweeps_meanwhile)
    try:
        zombie.save(state_of(2.0), 2)  # commits: its objects are there before and after its PUT
    finally:
        landed.set()  # the sweep's DELETE lands; the sweep goes on
        if sweep:
            sweep[0].join(60)
    monkeypatch.undo()
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    try:
        restored = reader.restore()
    except FileNotFoundError as e:
        pytest.fail(f"the latest committed step (of {reader.all_steps()}) names objects that are gone: {e}")
    assert value_of(restored) in (1.0, 2.0)


KILLED_DELETE = textwrap.dedent(
    """
    import json, os, signal, sys
    import ortckpt
    import ortckpt.object_store as object_store
    url, options = sys.argv[1], json.loads(sys.argv[2])
    manager = ortckpt.CheckpointManager(url, storage_options=options)

    def remove(locations):  # the retirement marker is up; killed before any deletion
        os.kill(os.getpid(), signal.SIGKILL)

    object_store.remove = remove
    manager.delete(2)  # going back: the newest step deleted, as the error of save() suggests
    """
)


def test_finding_s3_a_restart_after_a_killed_delete_of_the_latest_step_can_save_it_again(s3_server, s3_url):
    """FINDING (liveness, wrong error). delete(latest) first creates the retirement marker, which
    hides the step at once, then deletes its metadata.json and objects. Killed between the two,
    the step stays hidden but its metadata.json stays too: the restarted writer lists step 1 as
    the latest, resumes from it, and its save of step 2 then fails for ever with
    CheckpointExistsError "another writer committed step 2 first" (its conditional PUT meets the
    retired step's document), though no other writer exists; only a manual remove_leftovers()
    frees it. Every time."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(state_of(1.0), 1)
        manager.save(state_of(2.0), 2)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DELETE, s3_url, json.dumps(options)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with CheckpointManager(s3_url, storage_options=options) as restarted:
        assert restarted.all_steps() == [1]  # hidden at once: what the marker is for
        restarted.save(state_of(3.0), 2)
        assert value_of(restarted.restore()) == 3.0


KILLED_RESTORE = textwrap.dedent(
    """
    import json, os, signal, sys
    import ortckpt
    import ortckpt.object_store as object_store
    url, options = sys.argv[1], json.loads(sys.argv[2])
    real = object_store.download_to

    def download_to(location, fd, **kwargs):  # killed once the local copy is (partly) written
        real(location, fd, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    object_store.download_to = download_to
    ortckpt.CheckpointManager(url, storage_options=options, read_only=True).restore()
    """
)


def test_finding_s3_a_restore_killed_mid_download_leaves_no_copy_behind(s3_server, s3_url, tmp_path):
    """FINDING (leak: a checkpoint-sized file in the temporary directory per killed restore). On
    S3, restore() streams the checkpoint into ``$TMPDIR/ortckpt-restored-*/checkpoint``, maps it
    and removes the directory in a ``finally``, which a SIGKILL (OOM killer, preemption: what
    happens to jobs while they restore) skips. Nothing else ever removes it: a job that crash-loops
    in its restore fills /tmp (often a RAM-backed tmpfs) a checkpoint at a time. (A file unlinked
    as soon as it is created, or O_TMPFILE, would go with the process.) Every time."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(state_of(1.0, 1 << 16), 1)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RESTORE, s3_url, json.dumps(options)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # Fixed: the copy is in a scratch directory holding its process's lock; the next user of one
    # (here a restore that completes) proves that process dead and removes what it left.
    again = subprocess.run(
        [sys.executable, "-c", "import json, sys, ortckpt; ortckpt.CheckpointManager(sys.argv[1], "
         "storage_options=json.loads(sys.argv[2]), read_only=True).restore()", s3_url, json.dumps(options)],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    left = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*"))
    assert left == [], f"left for ever by a killed restore: {left}"


# --- attacks that held ---------------------------------------------------------------------------------


def test_held_s3_a_retirement_marker_planted_for_the_latest_step_shows_the_previous_one(s3_server, s3_url):
    """HELD. A ``retired-<attempt>`` marker planted (or left) for the latest step hides it: a
    reader sees the previous step, never "no checkpoint", and restores it whole."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(state_of(1.0), 1)
        manager.save(state_of(2.0), 2)
        attempt = manager.latest().metadata["attempt"]
    location = ortckpt.targets.object_location(f"{s3_url}/step_00000002/retired-{attempt}", options)
    object_store.put(location, b"")
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    assert reader.all_steps() == [1]
    assert value_of(reader.restore()) == 1.0
