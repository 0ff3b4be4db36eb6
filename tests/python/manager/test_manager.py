"""CheckpointManager over a local directory, what only that backend has: the metadata it records,
should_save, retention against the reference model on real directories, verify's messages, leftovers of
crashed saves, SIGKILLs of a writer, a full disk, read-only files and edits in place, step folders
loaded by name. What every backend does alike is in test_conformance.py."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortckpt import (
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    InvalidArgumentError,
    OptimizerGroup,
    _boundary,
    capture_rng_state,
    restore_rng_state,
    verify,
)
from ortckpt.manager.metadata import git_commit_of
from ortckpt.steps import WRITER_LOCK_NAME
from ortckpt.stepstore import DirectoryStore
from test_retention import reference_kept


def make_state(seed: int = 0, size: int = 64) -> CheckpointState:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((size, 4)).astype(np.float32)
    state = CheckpointState.from_arrays({"w": w, "b": np.zeros(4, np.float32)}, {"emb": np.arange(6, dtype=np.int64)})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=3,
        initial_learning_rate=1e-3,
        momentums={
            "w": {"momentum0": w * 0.5, "momentum1": w * w},
            "b": {"momentum0": np.ones(4, np.float32), "momentum1": np.ones(4, np.float32)},
        },
    )
    state.properties["note"] = "hello"
    return state


def assert_same(a: CheckpointState, b: CheckpointState) -> None:
    assert a.parameters.names() == b.parameters.names()
    for name in a.parameters.names():
        np.testing.assert_array_equal(a.parameters[name].data, b.parameters[name].data)
    ga, gb = a.optimizer_groups["group0"], b.optimizer_groups["group0"]
    assert ga.step == gb.step and np.float32(ga.initial_learning_rate) == np.float32(gb.initial_learning_rate)
    for p, moms in ga.momentums.items():
        for m, v in moms.items():
            np.testing.assert_array_equal(v, gb.momentums[p][m])


def test_metadata_records_the_run(tmp_path):
    config = {"lr": 1e-3, "layers": [4, 4]}
    with CheckpointManager(tmp_path, config=config) as manager:
        manager.save(
            make_state(),
            5,
            epoch=1,
            metrics={"loss": float("nan"), "acc": 0.9},
            metadata={"note": "x"},
            dataset_fingerprint="sha256:abc",
        )
    meta = json.loads((tmp_path / "step_00000005" / "metadata.json").read_text())
    assert meta["step"] == 5 and meta["epoch"] == 1 and meta["config"] == config
    assert meta["metrics"] == {"loss": "nan", "acc": 0.9}  # NaN kept readable by every JSON parser
    assert meta["user"] == {"note": "x"} and meta["dataset_fingerprint"] == "sha256:abc"
    assert meta["versions"]["ortckpt"] == ortckpt.__version__ and meta["versions"]["numpy"] == np.__version__
    assert meta["host"] and meta["timestamp"].endswith("+00:00") and len(meta["run_id"]) == 32
    checkpoint = tmp_path / "step_00000005" / "checkpoint"
    assert meta["files"]["checkpoint"]["bytes"] == checkpoint.stat().st_size
    # Recorded by the checksums the core wrote into the file, not by reading it back.
    assert meta["files"]["checkpoint"]["xxh3"] == f"{_boundary.checksum_root(checkpoint)[1]:016x}"
    assert "sha256" not in meta["files"]["checkpoint"]
    # A new manager on the same directory continues the run: same run id.
    assert CheckpointManager(tmp_path).run_id == meta["run_id"]
    assert CheckpointManager(tmp_path, run_id="other").run_id == "other"


def test_git_commit_is_found_for_code_in_a_repository(tmp_path):
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    (tmp_path / "train.py").write_text("print(1)\n")
    for args in (["init", "-q"], ["add", "train.py"], ["commit", "-qm", "first"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout
    assert git_commit_of(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "train.py").write_text("print(2)\n")
    assert git_commit_of(tmp_path)["dirty"] is True
    assert git_commit_of(tmp_path / "..") is None or git_commit_of(tmp_path / "..")["commit"] != head.strip()


def test_should_save_every_n_steps_and_never_for_an_old_step(tmp_path):
    manager = CheckpointManager(tmp_path, save_every=5)
    assert [s for s in range(1, 16) if manager.should_save(s)] == [5, 10, 15]
    manager.save(make_state(), 10)
    assert not manager.should_save(10) and not manager.should_save(5) and manager.should_save(15)


def test_should_save_by_time(tmp_path):
    assert CheckpointManager(tmp_path / "a", save_every=datetime.timedelta(0)).should_save(1)
    hourly = CheckpointManager(tmp_path / "b", save_every=datetime.timedelta(hours=1))
    assert not hourly.should_save(1)  # the hour counts from the manager's start
    hourly._last_save -= 3601
    assert hourly.should_save(1)
    hourly.save(make_state(), 1)
    assert not hourly.should_save(2)


@settings(max_examples=25, deadline=None)
@given(
    max_to_keep=st.one_of(st.none(), st.integers(1, 3)),
    keep_best=st.one_of(st.none(), st.tuples(st.just("loss"), st.sampled_from(["min", "max"]), st.integers(1, 2))),
    keep_every=st.one_of(st.none(), st.integers(2, 4)),
    losses=st.lists(st.one_of(st.none(), st.integers(0, 3).map(float)), min_size=1, max_size=10),
)
def test_a_real_directory_holds_what_the_reference_keeps(tmp_path_factory, max_to_keep, keep_best, keep_every, losses):
    directory = tmp_path_factory.mktemp("run")
    state = make_state(size=2)
    manager = CheckpointManager(
        directory, max_to_keep=max_to_keep, keep_best=keep_best, keep_every=keep_every, durable=False
    )
    history = []
    for i, loss in enumerate(losses):
        step = (i + 1) * 2
        manager.save(state, step, metrics=None if loss is None else {"loss": loss})
        history.append((step, loss))
    expected = reference_kept(history, max_to_keep, keep_best, keep_every)
    on_disk = sorted(int(p.name.split("_")[1]) for p in directory.iterdir() if p.name.startswith("step_"))
    assert on_disk == sorted(expected) == manager.all_steps()
    assert CheckpointManager(directory, read_only=True).all_steps() == sorted(expected)  # a reader sees the same
    manager.close()
    assert CheckpointManager(directory).all_steps() == sorted(expected)  # and so does the next writer


def test_the_context_manager_waits_for_the_pending_save(tmp_path):
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(make_state(size=1 << 18), 1)
    assert (tmp_path / "step_00000001" / "metadata.json").exists()
    assert CheckpointManager(tmp_path).latest_step() == 1


@pytest.mark.parametrize("how", [True, "process"])
def test_verify_after_save_refuses_to_commit_a_bad_checkpoint(tmp_path, monkeypatch, how):
    manager = CheckpointManager(tmp_path, verify_after_save=how)
    manager.save(make_state(), 1)
    assert manager.all_steps() == [1]
    real_describe = DirectoryStore.describe

    def corrupting_describe(store, attempt, *args, **kwargs):  # the checkpoint changes after it was described
        described = real_describe(store, attempt, *args, **kwargs)
        with open(attempt.folder / "checkpoint", "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\xff")
        return described

    monkeypatch.setattr(DirectoryStore, "describe", corrupting_describe)
    with pytest.raises(CheckpointIntegrityError, match="checksum block or the trailer after it is damaged"):
        manager.save(make_state(), 2)
    assert manager.all_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [WRITER_LOCK_NAME, "step_00000001"]


def test_verify_names_what_is_wrong(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(make_state(), 1)
    step_dir = tmp_path / "step_00000001"
    good = verify(step_dir)
    assert good.step == 1 and good.tensors == 7 and set(good.files) == {"checkpoint"}
    assert manager.verify().step == 1
    checkpoint = step_dir / "checkpoint"
    original = checkpoint.read_bytes()

    checkpoint.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(CheckpointIntegrityError) as e:
        verify(step_dir)
    assert e.value.problems == [f"{checkpoint}: the checksum block or the trailer after it is damaged"]

    checkpoint.write_bytes(original[:100])
    with pytest.raises(CheckpointIntegrityError, match="100 bytes, metadata says"):
        verify(step_dir)
    # A bare file has no hashes: decoding is what is checked.
    with pytest.raises(CheckpointIntegrityError, match="checkpoint"):
        verify(checkpoint)
    checkpoint.write_bytes(original)
    assert verify(checkpoint).tensors == 7

    meta = json.loads((step_dir / "metadata.json").read_text())
    meta["step"] = 2
    (step_dir / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointIntegrityError, match="property step=1, metadata says step=2"):
        verify(step_dir)
    (step_dir / "metadata.json").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"metadata.json: missing"):
        verify(step_dir)


def test_external_data_is_hashed_and_verified(tmp_path):
    manager = CheckpointManager(tmp_path, external_data_threshold=0, async_save=True)
    manager.save(make_state(), 1)
    manager.close()
    info = manager.latest()
    assert set(info.metadata["files"]) == {"checkpoint", "checkpoint.data"}
    assert verify(info.directory).files.keys() == {"checkpoint", "checkpoint.data"}
    assert_same(make_state(), manager.restore())
    data = info.directory / "checkpoint.data"
    original = data.read_bytes()
    data.write_bytes(original[:64] + bytes([original[64] ^ 0x10]) + original[65:])
    with pytest.raises(CheckpointIntegrityError) as e:
        verify(info.directory)
    # The data file is recorded by its size and pair id; its tensors by the checkpoint's checksums.
    assert info.metadata["files"]["checkpoint.data"] == {"bytes": len(original), "pair": original[-16:].hex()}
    [problem] = e.value.problems
    assert problem.startswith(f"{data}: tensor '") and "bytes differ from their checksum" in problem
    data.write_bytes(original[:-40])  # a bare file has no hashes, but a cut data file does not decode
    with pytest.raises(CheckpointIntegrityError, match="checkpoint"):
        verify(info.path)


def test_leftovers_of_crashed_saves_and_deletions_are_removed_on_start(tmp_path):
    """A writer that holds the directory's lock is its only writer: every temporary or
    half-deleted directory is then a leftover, whatever pid its name carries (a live writer
    elsewhere would hold the lock: tests/python/manager/test_manager_liveness.py)."""
    CheckpointManager(tmp_path).save(make_state(), 1)
    stale = tmp_path / ".step_00000002.tmp-1234-abc123"
    mine_before_restart = tmp_path / f".step_00000003.tmp-{os.getpid()}-abc123"
    new_style = tmp_path / ".step_00000004.tmp-0123456789abcdef0123456789abcdef"
    deleting = tmp_path / ".step_00000000.deleting-abc123"
    unrelated = tmp_path / "notes.txt"
    for d in (stale, mine_before_restart, new_style, deleting):
        d.mkdir()
        (d / "checkpoint").write_bytes(b"partial")
    unrelated.write_text("keep me")
    (tmp_path / ".step_00000005.tmp-file").write_text("not a directory: not ours")
    with CheckpointManager(tmp_path) as manager:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [".step_00000005.tmp-file", WRITER_LOCK_NAME, "notes.txt", "step_00000001"]
        )
        assert manager.all_steps() == [1]


def test_rng_state_round_trips_through_the_metadata(tmp_path):
    gen, legacy, py = np.random.default_rng(1), np.random.RandomState(2), random.Random(3)
    np.random.seed(4)
    random.seed(5)
    manager = CheckpointManager(tmp_path)
    manager.save(make_state(), 1, rng_state=capture_rng_state(gen, legacy, py))

    def draws():
        return (
            gen.random(3).tolist(),
            legacy.rand(3).tolist(),
            [py.random() for _ in range(3)],
            np.random.rand(3).tolist(),
            [random.random() for _ in range(3)],
        )

    expected = draws()
    draws()  # move every generator on
    restore_rng_state(CheckpointManager(tmp_path, read_only=True).latest().rng_state, gen, legacy, py)
    assert draws() == expected
    with pytest.raises(ValueError, match="3 generator"):
        restore_rng_state(manager.latest().rng_state, gen)
    with pytest.raises(TypeError, match=r"numpy.Generator"):
        restore_rng_state(manager.latest().rng_state, py, legacy, gen)


def test_manager_checkpoints_load_in_the_checkpoint_state_api_unchanged(tmp_path):
    """The file in a step directory is an ordinary checkpoint (ONNX Runtime loads it: tests/interop)."""
    CheckpointManager(tmp_path).save(make_state(), 42, epoch=7)
    state = CheckpointState.load_checkpoint(tmp_path / "step_00000042" / "checkpoint")
    assert state.properties["step"] == 42 and state.properties["epoch"] == 7


# A process that forks the savers: each trial's saver is a process of its own, killed by SIGKILL, but
# forked from one that has imported ortckpt already (no thread started), so a trial costs the kill, not
# an interpreter's start and imports (two thirds of the test's time when each saver was a new interpreter).
# It reads "save DIRECTORY START MODE" (the saver answers "ready PID") and "reap PID" (it answers "reaped"
# once the killed saver is gone: a zombie would still answer kill(pid, 0), as a live writer does).
SAVER = """
import os, sys, time
import numpy as np
from ortckpt import CheckpointManager, CheckpointState

def state_of(mode, start):
    rng = np.random.default_rng(start)
    arrays = {f"t{i}": rng.standard_normal(50_000 + i).astype(np.float32) for i in range(8)}
    # "frozen": a larger part that never changes, so that steps share it (share_unchanged)
    frozen = {f"f{i}": np.full(100_000 + i, i, np.float32) for i in range(8)} if mode == "frozen" else {}
    return arrays, CheckpointState.from_arrays(arrays, frozen)

def save_until_killed(directory, start, mode):
    arrays, state = state_of(mode, start)
    manager = CheckpointManager(directory, max_to_keep=2, durable=False, async_save=mode == "async")
    step = start
    print("ready", os.getpid(), flush=True)
    while True:
        step += 1
        for a in arrays.values():
            a += 1.0  # each step's checkpoint differs from the last
        manager.save(state, step, metrics={"loss": 1.0 / step})

# Saves first, as a saver makes them (a new manager's first save of the mode's state), so that what a
# process does once (lazy imports, the git lookup) is done before the forks and the kills land in the
# savers' saves (sync managers, closed: no thread is left running to fork beside); the slowest after the
# first, the time from a saver's "ready" to its first commit on this machine now, is the first line.
took = []
for step in (1, 2, 3, 4):
    arrays, state = state_of(sys.argv[2], step)
    with CheckpointManager(sys.argv[1], max_to_keep=2, durable=False) as warm_up:
        began = time.perf_counter()
        warm_up.save(state, step)
        took.append(time.perf_counter() - began)
print("warm", max(took[1:]), flush=True)
for line in sys.stdin:
    command, *args = line.split()
    if command == "save":
        if os.fork() == 0:
            try:
                save_until_killed(args[0], int(args[1]), args[2])
            except BaseException as e:  # (never: it saves until killed) said, not left to a blocked read
                print("failed", repr(e), flush=True)
            finally:
                os._exit(1)
    else:
        os.waitpid(int(args[0]), 0)
        print("reaped", flush=True)
"""


class Savers:
    """The forking process of SAVER (its saves in ``warm_up`` done, the slowest ``step_seconds``):
    ``start`` forks a saver and returns its pid once it is ready; ``kill`` SIGKILLs it and returns
    once it is gone."""

    def __init__(self, script: Path, warm_up: Path, mode: str):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # no thread to fork beside
        self.process = subprocess.Popen(
            [sys.executable, str(script), str(warm_up), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        answer = self.process.stdout.readline().split()
        assert answer[0] == "warm", answer
        self.step_seconds = float(answer[1])

    def ask(self, line: str) -> str:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def start(self, directory: Path, start: int, mode: str) -> int:
        answer = self.ask(f"save {directory} {start} {mode}").split()
        assert answer[0] == "ready", answer
        return int(answer[1])

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        assert self.ask(f"reap {pid}") == "reaped"

    def close(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0


@pytest.mark.parametrize("async_save", [False, True])
def test_no_process_is_forked_while_the_writer_lock_is_held(tmp_path, monkeypatch, async_save):
    """A child forked while the lock is held shares it until it execs: a writer killed in that
    moment would leave its directory locked after it is gone (seen once in the kill test). The
    git commit the metadata records is asked for before the lock is taken."""
    from ortckpt.manager import metadata

    metadata.git_commit.cache_clear()
    with CheckpointManager(tmp_path / "ckpts", async_save=async_save) as manager:

        def no_fork(*args, **kwargs):
            raise AssertionError(f"a subprocess while the writer lock is held: {args}")

        monkeypatch.setattr(metadata.subprocess, "run", no_fork)
        manager.save(CheckpointState.from_arrays({"w": np.ones(4, np.float32)}), 1)
        manager.wait()
        assert manager.latest_step() == 1


@pytest.mark.once
@pytest.mark.parametrize("mode, trials", [("sync", 100), ("async", 60), ("frozen", 80)])
def test_sigkill_during_saves_leaves_latest_complete_and_verifiable(tmp_path, mode, trials):
    """Kills a process that saves in a loop (retention deleting behind it; with async saves, in
    the background thread; with a frozen part, each step sharing the previous step's data file)
    at random moments; each time, a fresh manager must find a latest checkpoint that verifies,
    and no leftovers; with a frozen part, every step kept restores its frozen values exactly."""
    rng = random.Random(20261122)
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    directory = tmp_path / "ckpts"
    latest_steps, mid_save, shared_steps, kept_before = [], 0, 0, 0
    savers = Savers(script, tmp_path / "warm-up", mode)
    for trial in range(trials):
        start = latest_steps[-1] if latest_steps else 0
        saver = savers.start(directory, start, mode)
        # At random in the first 0.15 s, or in three first saves' time where one takes longer (a loaded
        # machine): else every kill would come before the saver's first commit, and test nothing.
        time.sleep(rng.uniform(0.0, max(0.15, 3 * savers.step_seconds)))
        savers.kill(saver)
        mid_save += any(p.name.startswith(".step") for p in directory.iterdir()) if directory.exists() else 0
        with CheckpointManager(directory) as manager:  # the killed writer's lock is free again
            leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".") and p.name != WRITER_LOCK_NAME]
            assert leftovers == [], f"trial {trial}: leftovers after restart: {leftovers}"
            latest = manager.latest()
            if latest is None:
                continue
            checked = manager.verify()
            assert checked.step == latest.step and checked.tensors == (16 if mode == "frozen" else 8)
            if mode == "frozen":
                for step in manager.all_steps():
                    restored = manager.restore(step)
                    for i in range(8):
                        assert np.array_equal(restored.parameters[f"f{i}"].data, np.full(100_000 + i, i, np.float32))
                    manager.verify(step)
                shared_steps += (latest.directory / "checkpoint.data").exists() and os.stat(
                    latest.directory / "checkpoint.data"
                ).st_nlink > 1
            # max_to_keep=2, plus one for a saver killed between a commit and its retention, which the next
            # retention deletes with the rest: so one more only after a trial that left more (two kills in a
            # row in that window, as under load, leave four steps).
            kept = len(manager.all_steps())
            assert kept <= max(3, kept_before + 1), (trial, kept_before, manager.all_steps())
            kept_before = kept
            latest_steps.append(latest.step)
    savers.close()
    # Retention catches up: one save that is not killed leaves max_to_keep steps, whatever kills left.
    with CheckpointManager(directory, max_to_keep=2) as manager:
        step = manager.latest_step() + 1
        manager.save(CheckpointState.from_arrays({f"t{i}": np.zeros(4, np.float32) for i in range(8)}), step)
        assert manager.all_steps() == [step - 1, step]
    print(f"{mode}: {trials} kills, {mid_save} inside a save or deletion, latest steps reached {latest_steps[-1]}")
    assert len(latest_steps) > trials // 2, "the kills came too early to test anything"
    assert mid_save > trials // 10, "too few kills landed inside a save to test anything"
    if mode == "frozen":
        assert shared_steps > trials // 4, "too few latest steps shared their data file to test anything"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_names_the_step_not_its_staging_folder(tmp_path, async_save):
    from privileges import needs_root

    @needs_root
    def check() -> None:
        disk = tmp_path / "disk"
        disk.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)]
        mounted = subprocess.run(mount, check=False, capture_output=True)
        assert mounted.returncode == 0, mounted.stderr
        try:
            manager = CheckpointManager(disk / "run", async_save=async_save)
            manager.save(CheckpointState.from_arrays({"w": np.ones(1 << 16, np.float32)}), 1)  # 256 KiB: fits
            manager.wait()
            with pytest.raises(OSError) as e:
                manager.save(CheckpointState.from_arrays({"w": np.ones(1 << 19, np.float32)}), 2)  # 2 MiB: never
                manager.wait()
            assert e.value.errno == 28 and e.value.filename == str(disk / "run" / "step_00000002" / "checkpoint")
            assert "saving step 2: nothing was committed" in str(e.value)
            assert manager.all_steps() == [1] and sorted(os.listdir(disk / "run")) == [
                ".ortckpt-writer.lock",
                "step_00000001",
            ]
            manager.close()
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)

    check()


@pytest.mark.parametrize("replacement", ["another size", "another save's"])
def test_restore_refuses_a_data_file_that_is_not_the_one_its_step_recorded(tmp_path, replacement):
    """A step's checkpoint.data replaced (by a file of another size without a pair trailer, or by
    another save's data file of the same size) is refused by restore, naming the file, as
    verify refuses it: never restored as the step (zeros, or the other save's values). Checked
    by size and pair id, from the file's last bytes: no read of the file."""
    with CheckpointManager(tmp_path / "run", external_data_threshold=0) as manager:
        manager.save(make_state(1), 1)
        data = manager.latest().directory / "checkpoint.data"
    with CheckpointManager(tmp_path / "other", external_data_threshold=0) as other:
        other.save(make_state(2), 1)
        theirs = other.latest().directory / "checkpoint.data"
    size = data.stat().st_size
    os.unlink(data)  # (a read-only file: replaced, as `cp --remove-destination` or an unpacked archive would)
    if replacement == "another size":
        data.write_bytes(bytes(size + 4096))
    else:
        assert theirs.stat().st_size == size
        data.write_bytes(theirs.read_bytes())
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    expected = "bytes, metadata says" if replacement == "another size" else "pair id [0-9a-f]+ differs"
    with pytest.raises(CheckpointIntegrityError, match=expected) as caught:
        reader.restore(1)
    assert str(data) in str(caught.value) and "step_00000001" in caught.value.filename
    with pytest.raises(CheckpointIntegrityError, match=expected):
        reader.verify(1)


def test_files_of_a_step_are_read_only_and_an_edit_in_place_is_noticed(tmp_path):
    """A step's files are read-only once committed (0444 less the umask: a writable memmap, `cp`
    onto them or ONNX Runtime's saver fail for their owner), since steps share data files by
    hard link. Root ignores modes: a file changed in place after its step's commit (its mtime
    later than metadata.json's) is then read in full against the checkpoint's checksums, and
    every step that shares it is refused, not restored with the edit."""
    with CheckpointManager(tmp_path / "run", external_data_threshold=0) as manager:
        for step in (1, 2):
            state = make_state(1)
            state.parameters["b"].data = np.full(4, step, np.float32)  # changed each step, the rest shared
            manager.save(state, step)
        first, second = (info.directory for info in manager.all())
    assert (first / "checkpoint.data").stat().st_ino == (second / "checkpoint.data").stat().st_ino
    for step in (first, second):
        for child in step.iterdir():
            assert child.stat().st_mode & 0o777 == 0o444 & ~ortckpt.safe_io.current_umask(), child
    if os.geteuid() != 0:
        with pytest.raises(PermissionError):
            np.memmap(first / "checkpoint.data", mode="r+")
        return
    for directory in (first, second):  # (committed a second before the edit: file times have a coarse clock)
        committed = (first / "checkpoint.data").stat().st_mtime_ns - 10**9
        os.utime(directory / "metadata.json", ns=(committed, committed))
    mapped = np.memmap(first / "checkpoint.data", mode="r+")  # root: the mode does not stop it
    mapped[:64] ^= 0xFF
    mapped.flush()
    del mapped
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    for step, directory in ((1, first), (2, second)):
        with pytest.raises(CheckpointIntegrityError, match="changed since its step was saved") as caught:
            reader.restore(step)
        assert str(directory / "checkpoint.data") in str(caught.value)
        with pytest.raises(CheckpointIntegrityError):
            reader.verify(step)


def test_a_run_copied_without_its_times_restores(tmp_path):
    """What notices an edit in place (a file newer than its step's metadata.json) only makes
    restore read the file in full: a run copied file by file, its times not kept, restores."""
    with CheckpointManager(tmp_path / "run", external_data_threshold=0) as manager:
        for step in (1, 2):
            manager.save(make_state(step), step)
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(tmp_path / "run", copy, copy_function=shutil.copy)  # (mtimes: the copy's)
    for step_dir in copy.glob("step_*"):
        os.utime(step_dir / "metadata.json", ns=(0, 0))  # metadata.json older than every file
    reader = CheckpointManager(copy, read_only=True)
    for step in (1, 2):
        assert_same(reader.restore(step), make_state(step))


def test_load_checkpoint_takes_a_step_folder_as_the_command_line_does(tmp_path):
    # One resolver (ortckpt.resolve) for the library and the CLI: a step folder names its checkpoint (was
    # IsADirectoryError), checked as restore checks it; a compressed step decompressed; a run names its latest.
    run_dir = tmp_path / "run"
    with CheckpointManager(run_dir, max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        for step in (2, 3):
            manager.save(CheckpointState.from_arrays({"w": np.full(64, step, np.float32)}), step)
        folders = {info.step: info.directory for info in manager.all()}
        assert manager.all()[0].compressed  # step 2: kept by keep_every only, compressed
    for step, folder in folders.items():
        loaded = ortckpt.load_checkpoint(folder)
        np.testing.assert_array_equal(loaded.parameters["w"].data, np.full(64, step, np.float32))
        # ONNX Runtime's method reads files; for a step folder it says what does read one (was IsADirectoryError).
        with pytest.raises(ortckpt.CheckpointFormatError, match=r"a CheckpointManager step folder.*load_checkpoint"):
            CheckpointState.load_checkpoint(folder)
    with pytest.raises(ortckpt.CheckpointFormatError, match=r"a run of steps \(2\), not one checkpoint: name a step"):
        ortckpt.load_checkpoint(run_dir)
    plain = folders[3] / "checkpoint"
    os.chmod(plain, 0o644)
    with open(plain, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ortckpt.CheckpointIntegrityError, match="metadata says"):
        ortckpt.load_checkpoint(folders[3])


def test_a_manager_of_an_empty_directory_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for read_only in (False, True):
        with pytest.raises(InvalidArgumentError, match="directory") as refused:
            CheckpointManager("", read_only=read_only)
        assert refused.value.argument == "directory"
    assert list(tmp_path.iterdir()) == []


def test_an_async_save_does_not_copy_values_that_cannot_change(tmp_path):
    """Read-only views of ``bytes`` (a Flower Array's values) are written from where they are;
    any other value (writable, or read-only over writable memory) is copied, so changing it after
    ``save`` returns never reaches the step."""
    immutable = np.arange(64, dtype=np.float32).tobytes()
    frozen_view = np.frombuffer(immutable, dtype=np.uint8, offset=16).view(np.float32)
    writable = np.ones(8, np.float32)
    owner = np.full(8, 2.0, np.float32)
    readonly_over_writable = owner.view()
    readonly_over_writable.flags.writeable = False
    state = CheckpointState.from_arrays({"b": frozen_view, "w": writable, "r": readonly_over_writable})
    with CheckpointManager(tmp_path / "run", async_save=True) as manager:
        manager.save(state, 1)
        staged = set(manager._staging.arrays)
        writable[:] = 7.0
        owner[:] = 9.0  # (a read-only view's owner may still write it)
        manager.wait()
        restored = manager.restore(1)
    assert {key.parameter for key in staged} == {"w", "r"}  # "b" was not copied
    np.testing.assert_array_equal(restored.parameters["b"].data, np.arange(4, 64, dtype=np.float32))
    np.testing.assert_array_equal(restored.parameters["w"].data, np.ones(8, np.float32))
    np.testing.assert_array_equal(restored.parameters["r"].data, np.full(8, 2.0, np.float32))
