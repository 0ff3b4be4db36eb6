"""CheckpointManager(share_unchanged=True): a step stores again only what changed since the previous
step. Its unchanged tensors stay in the previous step's data file, hard-linked into the new step; the
changed ones are inline in its checkpoint. Each step stays a whole checkpoint on its own."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import (
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    OptimizerGroup,
    _boundary,
    safe_io,
    verify,
)

FROZEN = 8  # frozen tensors of 64 KiB each: most of the state, as on a device that trains the last layers


def frozen_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"frozen{i}": rng.standard_normal(16384).astype(np.float32) for i in range(FROZEN)}


def training_state(step: int, frozen: dict[str, np.ndarray] | None = None) -> CheckpointState:
    """The state at ``step``: the frozen part as given (the same every step by default), the head
    and its AdamW moments different at every step."""
    rng = np.random.default_rng(1000 + step)
    head = {"head.weight": rng.standard_normal((64, 16)).astype(np.float32), "head.bias": np.full(16, step, np.float32)}
    state = CheckpointState.from_arrays(head, frozen if frozen is not None else frozen_arrays(), {"lr": 0.5})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=step,
        initial_learning_rate=1e-3,
        momentums={n: {"momentum0": a * 0.5, "momentum1": a * a} for n, a in head.items()},
    )
    return state


def assert_same(a: CheckpointState, b: CheckpointState) -> None:
    assert a.parameters.names() == b.parameters.names()
    for name in a.parameters.names():
        x, y = a.parameters[name].data, b.parameters[name].data
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    ga, gb = a.optimizer_groups["group0"], b.optimizer_groups["group0"]
    assert ga.step == gb.step
    for param, moms in ga.momentums.items():
        for m, value in moms.items():
            assert value.tobytes() == gb.momentums[param][m].tobytes(), (param, m)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def read_metadata(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / "metadata.json").read_text())


def data_of(root: Path, step: int) -> os.stat_result:
    return os.stat(step_dir(root, step) / "checkpoint.data")


def where(path: Path) -> dict[str, bool]:
    """Whether each parameter's values are in the data file (True) or inline (False)."""
    loaded = _boundary.load(path)
    return {name: stored[2] for name, _code, _dims, stored in [*loaded.trainable, *loaded.frozen]}


def flip_byte(path: Path, offset: int) -> None:
    """Changes one byte of ``path`` in place, as another process would (a step's file is
    read-only: made writable first, as its owner would have to)."""
    os.chmod(path, os.stat(path).st_mode | 0o200)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def offset_of(checkpoint: Path, name: str) -> int:
    """Where ``name``'s values start in ``checkpoint``'s data file."""
    loaded = _boundary.load(checkpoint)
    return next(stored[0] for n, _c, _d, stored in [*loaded.trainable, *loaded.frozen] if n == name and stored[2])


def test_unchanged_tensors_are_shared_by_hard_link_and_every_step_restores_exactly(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in range(1, 6):
            manager.save(training_state(step), step)
        # Step 1 has nothing to compare with: whole, as the threshold says (inline). Step 2 finds
        # most of it unchanged but nothing to share from: whole, with its values in checkpoint.data.
        assert not (step_dir(tmp_path, 1) / "checkpoint.data").exists()
        shared = data_of(tmp_path, 2)
        # Steps 3-5 link step 2's data file: one inode, four names.
        for step in (3, 4, 5):
            assert data_of(tmp_path, step).st_ino == shared.st_ino
        assert data_of(tmp_path, 5).st_nlink == 4
        # Only the changed head (and its moments) is written by a shared step: inline.
        placed = where(step_dir(tmp_path, 5) / "checkpoint")
        assert placed == {"head.bias": False, "head.weight": False, **{n: True for n in frozen_arrays()}}
        head_bytes = 3 * (64 * 16 + 16) * 4
        assert os.stat(step_dir(tmp_path, 5) / "checkpoint").st_size < head_bytes + 16384
        for step in range(1, 6):
            assert_same(manager.restore(step), training_state(step))
            assert manager.verify(step).step == step
            assert verify(step_dir(tmp_path, step)).tensors == 2 + FROZEN + 4
        # The shared file's metadata entry is the step's that wrote it, copied, not recomputed.
        entries = [c.metadata["files"]["checkpoint.data"] for c in manager.all()[1:]]
        assert all(e == entries[0] for e in entries)
        shared = (step_dir(tmp_path, 2) / "checkpoint.data").read_bytes()
        assert entries[0] == {"bytes": len(shared), "pair": shared[-16:].hex()}


def test_a_tensor_changed_by_one_byte_is_never_shared(tmp_path: Path) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        manager.save(training_state(1, frozen), 1)
        manager.save(training_state(2, frozen), 2)
        frozen["frozen3"].view(np.uint8)[40_001] ^= 0x01  # one bit of one frozen tensor
        manager.save(training_state(3, frozen), 3)
        placed = where(step_dir(tmp_path, 3) / "checkpoint")
        assert placed["frozen3"] is False and placed["frozen2"] is True
        assert data_of(tmp_path, 3).st_ino == data_of(tmp_path, 2).st_ino
        assert_same(manager.restore(3), training_state(3, frozen))
        assert manager.restore(2).parameters["frozen3"].data.tobytes() != frozen["frozen3"].tobytes()
        # Every frozen tensor changed: nothing to share, the step is written whole as the
        # threshold says (inline), and step 3's link is left as it was.
        for array in frozen.values():
            array.view(np.uint8)[0] ^= 0x80
        manager.save(training_state(4, frozen), 4)
        assert not (step_dir(tmp_path, 4) / "checkpoint.data").exists()
        assert set(where(step_dir(tmp_path, 4) / "checkpoint").values()) == {False}
        assert data_of(tmp_path, 3).st_nlink == 2
        assert_same(manager.restore(4), training_state(4, frozen))


def test_a_tensor_of_the_same_bytes_under_other_dims_or_type_is_not_shared(tmp_path: Path) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        manager.save(training_state(1, frozen), 1)
        manager.save(training_state(2, frozen), 2)
        frozen["frozen1"] = frozen["frozen1"].reshape(128, 128)
        frozen["frozen2"] = frozen["frozen2"].view(np.int32)
        manager.save(training_state(3, frozen), 3)
        placed = where(step_dir(tmp_path, 3) / "checkpoint")
        assert placed["frozen1"] is False and placed["frozen2"] is False and placed["frozen0"] is True
        restored = manager.restore(3)
        assert restored.parameters["frozen1"].data.shape == (128, 128)
        assert restored.parameters["frozen2"].data.dtype == np.int32
        assert_same(restored, training_state(3, frozen))


def test_retention_deletes_older_steps_and_the_newer_ones_stay_whole(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for step in range(1, 8):
            manager.save(training_state(step), step)
        assert manager.all_steps() == [6, 7]
        # Step 2 wrote the shared file and is gone; its inode lives on in 6 and 7 alone.
        assert data_of(tmp_path, 7).st_nlink == 2
        manager.delete(6)
        assert data_of(tmp_path, 7).st_nlink == 1
        assert_same(manager.restore(7), training_state(7))
        assert manager.verify(7).step == 7
        manager.save(training_state(8), 8)  # still shares the surviving link
        assert data_of(tmp_path, 8).st_ino == data_of(tmp_path, 7).st_ino
    reader = CheckpointManager(tmp_path, read_only=True)
    for step in reader.all_steps():
        assert_same(reader.restore(step), training_state(step))


def test_an_async_save_verified_in_a_fresh_process_shares_too(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=True, verify_after_save="process") as manager:
        for step in range(1, 4):
            manager.save(training_state(step), step)
        manager.wait()
        assert data_of(tmp_path, 3).st_ino == data_of(tmp_path, 2).st_ino
        assert_same(manager.restore(3), training_state(3))


def test_share_unchanged_false_writes_every_step_whole(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, share_unchanged=False, external_data_threshold=0) as manager:
        for step in range(1, 4):
            manager.save(training_state(step), step)
    assert {data_of(tmp_path, s).st_nlink for s in (1, 2, 3)} == {1}
    assert len({data_of(tmp_path, s).st_ino for s in (1, 2, 3)}) == 3
    with pytest.raises(ortckpt.InvalidArgumentTypeError, match="share_unchanged"):
        CheckpointManager(tmp_path / "x", share_unchanged="yes")  # type: ignore[arg-type]


def test_a_tampered_previous_step_shares_only_what_still_compares_equal(tmp_path: Path) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(training_state(step, frozen), step)
        # Another process changes one byte of a frozen tensor in step 2's data file, in place.
        data = step_dir(tmp_path, 2) / "checkpoint.data"
        loaded = _boundary.load(step_dir(tmp_path, 2) / "checkpoint")
        offset = next(stored[0] for name, _c, _d, stored in loaded.frozen if name == "frozen5")
        os.chmod(data, 0o644)  # (read-only, as a step's file is)
        with open(data, "r+b") as f:
            f.seek(offset + 99)
            byte = f.read(1)
            f.seek(offset + 99)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CheckpointIntegrityError, match=r"checkpoint\.data"):
            manager.verify(2)
        manager.save(training_state(3, frozen), 3)
        # The tampered tensor no longer compares equal: written inline, with the caller's values.
        placed = where(step_dir(tmp_path, 3) / "checkpoint")
        assert placed["frozen5"] is False and placed["frozen4"] is True
        assert_same(manager.restore(3), training_state(3, frozen))
        # Step 3 references none of the damaged bytes: each tensor it has checks against its own
        # checksum (a data file is verified tensor by tensor, through the checkpoint that reads it).
        assert manager.verify(3).step == 3


def test_a_previous_step_that_became_a_symlink_is_not_shared_from(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        real = tmp_path / "elsewhere"
        shutil.move(step_dir(tmp_path / "run", 2), real)
        os.symlink(real, step_dir(tmp_path / "run", 2))
        manager.save(training_state(3), 3)
        # Not even compared with: written whole, as the threshold says.
        assert not (step_dir(tmp_path / "run", 3) / "checkpoint.data").exists()
        assert os.stat(real / "checkpoint.data").st_nlink == 1
        assert_same(manager.restore(3), training_state(3))


def test_compress_kept_never_changes_a_shared_file(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=1, keep_every=3, compress_kept=True) as manager:
        for step in range(1, 5):
            manager.save(training_state(step), step)
        # Step 3 was shared into step 4, then compressed: its link removed, the inode left as it was.
        assert [c.compressed for c in manager.all()] == [True, False]
        assert data_of(tmp_path, 4).st_nlink == 1
        assert manager.verify(4).step == 4 and manager.verify(3).step == 3
        assert_same(manager.restore(3), training_state(3))
        assert_same(manager.restore(4), training_state(4))
        manager.save(training_state(5), 5)  # a compressed previous step: nothing to share from it
        assert_same(manager.restore(5), training_state(5))


def test_a_failed_shared_save_leaves_the_previous_steps_and_no_link(tmp_path: Path, monkeypatch) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        before = data_of(tmp_path, 3).st_nlink

        def failing(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_boundary._core, "save_sharing", failing)
        with pytest.raises(OSError, match="No space left"):
            manager.save(training_state(4), 4)
        monkeypatch.undo()
        assert manager.all_steps() == [1, 2, 3] and data_of(tmp_path, 3).st_nlink == before
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step")) == []
        manager.save(training_state(4), 4)
        assert_same(manager.restore(4), training_state(4))


@pytest.mark.parametrize("damage", ["truncated", "symlink", "fifo"])
def test_a_previous_data_file_that_is_damaged_or_not_a_file_is_never_shared(tmp_path: Path, damage: str) -> None:
    with CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        data = step_dir(tmp_path / "run", 2) / "checkpoint.data"
        if damage == "truncated":  # its pair trailer gone
            os.truncate(data, data.stat().st_size - 1)
        elif damage == "symlink":  # the same bytes, but through a symlink
            shutil.copy(data, tmp_path / "copy")
            data.unlink()
            data.symlink_to(tmp_path / "copy")
        else:
            data.unlink()
            os.mkfifo(data)
        manager.save(training_state(3), 3)  # never blocks on the FIFO, never follows the symlink
        assert not (step_dir(tmp_path / "run", 3) / "checkpoint.data").exists()  # whole, inline
        assert_same(manager.restore(3), training_state(3))
        assert manager.verify(3).step == 3


def test_a_shared_step_carries_checksums_and_a_flipped_bit_in_a_shared_tensor_names_it(tmp_path: Path) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
    checkpoint = step_dir(tmp_path, 3) / "checkpoint"
    assert where(checkpoint)["frozen3"] is True  # shared: in the hard-linked data file
    assert verify(step_dir(tmp_path, 3)).checksums
    loaded = _boundary.load(checkpoint)
    offset = next(stored[0] for name, _c, _d, stored in loaded.frozen if name == "frozen3")
    data = step_dir(tmp_path, 3) / "checkpoint.data"
    os.chmod(data, 0o644)  # (read-only, as a step's file is)
    with open(data, "r+b") as f:  # the same inode as step 2's (and step 1's)
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    for step in (2, 3):
        with pytest.raises(CheckpointIntegrityError) as e:
            ortckpt.load_checkpoint(step_dir(tmp_path, step) / "checkpoint", verify=True)
        assert e.value.tensor == "frozen3" and e.value.problems[0].startswith(
            f"{step_dir(tmp_path, step)}/checkpoint.data"
        )


def test_a_data_file_without_checksums_is_not_shared_from(tmp_path: Path) -> None:
    """A previous step whose data file carries no checksum block's mark in its pair id (an older
    ortckpt's): the new step takes the data file's pair id when it shares, and its block must be
    marked, so it is written whole instead."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        manager.save(training_state(1, frozen), 1)
        manager.save(training_state(2, frozen), 2)  # whole, its values in a data file to share
        for name in ("checkpoint", "checkpoint.data"):  # both ends of the pair: an unmarked id
            path = step_dir(tmp_path, 2) / name
            raw = bytearray(path.read_bytes())
            raw[-4:] = b"old!"
            path.write_bytes(bytes(raw))
        manager.save(training_state(3, frozen), 3)
    assert data_of(tmp_path, 2).st_nlink == 1  # not linked: step 3 is written whole
    assert verify(step_dir(tmp_path, 3)).checksums
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert_same(reader.restore(3), training_state(3, frozen))


def _another_runs_step(root: Path) -> None:
    """Step 2 replaced by a step 2 of another run: the same frozen values, other files and digests."""
    with CheckpointManager(root.parent / "other") as other:
        for step in (1, 2):
            other.save(training_state(step), step)
    shutil.rmtree(step_dir(root, 2))
    shutil.copytree(step_dir(root.parent / "other", 2), step_dir(root, 2))


def _stale_byte(root: Path) -> None:
    """A byte no later step compares: the head's values in step 2's data file (the next step
    writes its own head inline)."""
    flip_byte(step_dir(root, 2) / "checkpoint.data", offset_of(step_dir(root, 2) / "checkpoint", "head.weight"))


def _replaced(root: Path) -> None:
    """A new file in its place, one stale byte different, pair trailer and all."""
    data = step_dir(root, 2) / "checkpoint.data"
    values = bytearray(data.read_bytes())
    values[offset_of(step_dir(root, 2) / "checkpoint", "head.weight")] ^= 1
    data.unlink()
    data.write_bytes(bytes(values))


def _extended(root: Path) -> None:
    """Bytes inserted before the pair trailer (kept at the end): every tensor still where it was."""
    data = step_dir(root, 2) / "checkpoint.data"
    values = data.read_bytes()
    data.write_bytes(values[:-64] + bytes(4096) + values[-64:])


@pytest.mark.parametrize(
    ("damage", "shared"), [(_stale_byte, True), (_replaced, True), (_extended, False), (_another_runs_step, False)]
)
@pytest.mark.parametrize("verify_after_save", [False, True])
def test_a_previous_data_file_unlike_its_record_never_gives_a_later_step_a_wrong_record(
    tmp_path: Path, damage, shared: bool, verify_after_save: bool
) -> None:
    """Sharing copies the previous step's record of the file (its size and pair id): a file that
    is not what that record says (extended, another run's) is not shared, else every later step
    would inherit a record wrong from birth (and with verify_after_save every later save would
    fail). A stale byte no later step reads (or the file replaced by such a copy) changes neither:
    it is shared, and each later step verifies through its own checksums of what it reads."""
    root = tmp_path / "run"
    with CheckpointManager(root, verify_after_save=verify_after_save) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        damage(root)
        for step in (3, 4):
            manager.save(training_state(step), step)
            assert manager.verify(step).step == step
            assert_same(manager.restore(step), training_state(step))
        assert (data_of(root, 3).st_ino == data_of(root, 2).st_ino) is shared
        assert data_of(root, 4).st_ino == data_of(root, 3).st_ino


@pytest.mark.parametrize("change", ["world-writable", "group-writable", "another user's"])
def test_a_previous_data_file_of_other_permissions_or_owner_is_not_shared(tmp_path: Path, monkeypatch, change) -> None:
    """A linked file keeps its owner and mode in every step that shares it: one another user owns
    or may write could change every later step; one of odd permissions would make them read
    unlike a whole step."""
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        data = step_dir(tmp_path, 2) / "checkpoint.data"
        if change == "world-writable":
            os.chmod(data, 0o666)
        elif change == "group-writable":
            os.chmod(data, 0o664)
        else:  # (seen from another uid: chown would need root)
            uid = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
        manager.save(training_state(3), 3)
        monkeypatch.undo()
        assert data_of(tmp_path, 3).st_ino != data_of(tmp_path, 2).st_ino
        assert data_of(tmp_path, 3).st_mode & 0o777 == 0o444 & ~safe_io.current_umask()  # (a step's: read-only)
        assert_same(manager.restore(3), training_state(3))
        assert manager.verify(3).step == 3


@pytest.mark.parametrize("digest", [None, "sha256"])
def test_a_resumed_run_shares_the_previous_file_hashing_it_at_most_once(tmp_path: Path, monkeypatch, digest) -> None:
    """Checksummed entries are proven from the file's last bytes (never hashed); a SHA-256 entry
    (``digest="sha256"``) is hashed once by a resumed run, at its first shared save."""
    with CheckpointManager(tmp_path, digest=digest) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
    hashed = []
    real = safe_io.sha256_of

    def counting(path, *args):
        hashed.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(safe_io, "sha256_of", counting)
    with CheckpointManager(tmp_path, digest=digest) as manager:  # a new process knows nothing of step 2's file
        for step in (3, 4, 5):
            manager.save(training_state(step), step)
    assert hashed.count("checkpoint.data") == (0 if digest is None else 1)
    assert {data_of(tmp_path, s).st_ino for s in (2, 3, 4, 5)} == {data_of(tmp_path, 2).st_ino}
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for step in (3, 4, 5):
            assert reader.verify(step).step == step


def test_digest_sha256_records_the_sha256_of_a_shared_file_first_written_without_it(
    tmp_path: Path, monkeypatch
) -> None:
    """A run resumed with ``digest="sha256"`` shares the data file a save without the digest
    wrote: each step's entry for it carries its SHA-256 all the same (hashed once, at the first
    such step; the next steps copy it, the file unchanged)."""
    import hashlib

    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
    assert "sha256" not in read_metadata(tmp_path, 2)["files"]["checkpoint.data"]
    hashed = []
    real = safe_io.sha256_of

    def counting(path, *args):
        hashed.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(safe_io, "sha256_of", counting)
    with CheckpointManager(tmp_path, digest="sha256") as manager:
        for step in (3, 4):
            manager.save(training_state(step), step)
    monkeypatch.undo()
    assert data_of(tmp_path, 4).st_ino == data_of(tmp_path, 2).st_ino  # shared all along
    digest = hashlib.sha256((step_dir(tmp_path, 4) / "checkpoint.data").read_bytes()).hexdigest()
    for step in (3, 4):
        entry = read_metadata(tmp_path, step)["files"]["checkpoint.data"]
        assert entry["sha256"] == digest and "pair" in entry, (step, entry)
        assert CheckpointManager(tmp_path, read_only=True).verify(step).files["checkpoint.data"] == digest
    assert hashed.count("checkpoint.data") == 1


def test_a_shared_file_changed_through_an_outside_link_damages_its_steps_and_the_next_does_not_read_it(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        os.link(step_dir(tmp_path, 3) / "checkpoint.data", tmp_path / "outside")
        flip_byte(tmp_path / "outside", offset_of(step_dir(tmp_path, 3) / "checkpoint", "frozen0"))
        # One inode: both steps that share it are damaged, and verify says so of each.
        for step in (2, 3):
            with pytest.raises(CheckpointIntegrityError, match=r"checkpoint\.data"):
                manager.verify(step)
        manager.save(training_state(4), 4)
        # The changed tensor no longer compares equal: step 4 holds it inline, its own values.
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen0"] is False
        assert manager.verify(4).step == 4
        assert_same(manager.restore(4), training_state(4))


def test_a_data_file_with_as_many_links_as_the_filesystem_allows_is_not_shared_but_saved_whole(tmp_path: Path) -> None:
    """A run that keeps every step links one data file into each (ext4 allows 65,000 links): once
    no more links can be made, a step is written whole (and the next ones share its file), not
    failed, nor every save after it. The links are made outside the run here, to get there fast."""
    with CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        shared = step_dir(tmp_path / "run", 2) / "checkpoint.data"
        links = tmp_path / "links"
        links.mkdir()
        made = 0
        with contextlib.suppress(OSError):  # EMLINK on ext4 and xfs; a filesystem without a limit stops at 70,000
            while made < 70_000:
                os.link(shared, links / str(made))
                made += 1
        for step in (3, 4):
            manager.save(training_state(step), step)
            assert_same(manager.restore(step), training_state(step))
            assert manager.verify(step).step == step
        assert (data_of(tmp_path / "run", 3).st_ino == data_of(tmp_path / "run", 2).st_ino) is (made == 70_000)
        assert data_of(tmp_path / "run", 4).st_ino == data_of(tmp_path / "run", 3).st_ino
    shutil.rmtree(links)
