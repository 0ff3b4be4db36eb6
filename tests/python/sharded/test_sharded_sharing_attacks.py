"""Attacks on sharded steps that share their unchanged shards with the previous step: the previous
step removed by another process just before the shards are linked, its shard data file swapped for
one of the same size and pair id with a value edited. Each new step still restores and verifies on
its own, bit for bit."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from distributed_model import ThreadComm, on_ranks, rank_state
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.distributed import shard_file_name
from ortckpt.distributed import sharded as sharded_module
from test_sharded_sharing import (
    assert_whole_state,
    expected_whole,
    frozen_part,
    inodes,
    restore_on_ranks,
    save_steps,
    step_dir,
)


def remove_step(folder: Path) -> None:
    """Removes a committed (read-only) step folder as another process's retention would."""
    for path in [folder, *folder.iterdir()]:
        if path.is_dir():
            path.chmod(stat.S_IRWXU)
    shutil.rmtree(folder)


def test_a_previous_step_removed_just_before_the_shards_link_it(tmp_path: Path, monkeypatch: Any) -> None:
    """Another process deletes step 1 after the manager chose it to share with, before any rank
    writes: each rank's shard is written whole (nothing left to link), and step 2 is whole."""
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    write, once = sharded_module.write_shards, threading.Lock()

    def removing_first(*args: Any, **kwargs: Any) -> None:
        assert kwargs["share_with"] is not None  # (the manager meant to share with step 1)
        with once:
            if step_dir(tmp_path, 1).exists():
                remove_step(step_dir(tmp_path, 1))
        write(*args, **kwargs)

    monkeypatch.setattr(sharded_module, "write_shards", removing_first)
    assert save_steps(tmp_path, 2, [2]) == [None, None]
    assert all(data.stat().st_nlink == 1 for data in step_dir(tmp_path, 2).glob("*.data"))
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [2]
        reader.verify(2)
        info = reader.latest()
        assert info is not None
        assert_whole_state(info.load(), 2, 2)
    assert restore_on_ranks(tmp_path, 2, 2, 2) == [[], []]


def test_a_previous_shard_swapped_for_an_edited_one_of_the_same_size(tmp_path: Path) -> None:
    """Rank 0's data file of step 1 replaced (a rename over it, this user's, read-only as a step
    file) by a copy with one frozen value's bytes edited: same size, same pair id. The edited value
    no longer matches the state's, so step 2 writes it inline and reads every value right."""
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    data = step_dir(tmp_path, 1) / f"{shard_file_name(0, 2)}.data"
    planted = bytearray(data.read_bytes())
    frozen = frozen_part(0)["frozen0_0"].tobytes()
    at = bytes(planted).find(frozen)
    assert at >= 0
    planted[at + 8] ^= 0xFF
    copy = tmp_path / "planted.data"
    copy.write_bytes(bytes(planted))
    copy.chmod(stat.S_IMODE(data.stat().st_mode))
    folder_mode = stat.S_IMODE(step_dir(tmp_path, 1).stat().st_mode)
    step_dir(tmp_path, 1).chmod(stat.S_IRWXU)
    os.replace(copy, data)
    step_dir(tmp_path, 1).chmod(folder_mode)
    assert save_steps(tmp_path, 2, [2]) == [None, None]
    assert (step_dir(tmp_path, 2) / data.name).stat().st_ino == data.stat().st_ino  # (shared, planted bytes and all)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        reader.verify(2)
        info = reader.latest()
        assert info is not None
        assert_whole_state(info.load(), 2, 2)
    assert restore_on_ranks(tmp_path, 2, 2, 2) == [[], []]
    assert restore_on_ranks(tmp_path, 2, 2, 3) == [[], [], []]


def test_tensors_that_keep_their_names_but_change_slices_restore_right(tmp_path: Path) -> None:
    """Same world, same shard file names, but the split tensors' slices move between the ranks
    (rank r holds what rank 1-r held): no value of a shard is read where its previous slice was."""

    def work(comm: ThreadComm) -> None:
        with CheckpointManager(tmp_path, comm=comm, durable=False, external_data_threshold=0) as manager:
            for step in (1, 2):
                holder = comm.rank if step == 1 else 1 - comm.rank
                state, slices = rank_state(1, holder, 2, extra_frozen=frozen_part(comm.rank))
                state.properties["step"] = step
                manager.save(state, step, slices=slices)

    assert on_ranks(2, work) == [None, None]
    for rank in range(2):  # (the frozen parts, which stayed, are shared)
        data = f"{shard_file_name(rank, 2)}.data"
        assert (step_dir(tmp_path, 2) / data).stat().st_ino == (step_dir(tmp_path, 1) / data).stat().st_ino
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for step in (1, 2):
            reader.verify(step)
            info = next(i for i in reader.all() if i.step == step)
            assert_whole_state(info.load(), 1, 2)


def test_retention_of_steps_the_next_ones_share(tmp_path: Path) -> None:
    """Retention deletes each step right after the next one linked its shards (keep_every's steps
    kept, shared by the step after them): every kept step verifies and restores bit for bit."""
    options: dict[str, Any] = {"max_to_keep": 1, "keep_every": 2}
    assert save_steps(tmp_path, 2, [1, 2, 3, 4, 5], **options) == [None, None]
    with CheckpointManager(tmp_path, read_only=True) as reader:
        kept = reader.all_steps()
        assert 5 in kept and 1 not in kept and 3 not in kept
        for info in reader.all():
            reader.verify(info.step)
            assert_whole_state(info.load(), info.step, 2)
    for step in kept:
        assert restore_on_ranks(tmp_path, step, 2, 2) == [[], []]


def test_plain_and_sharded_steps_in_turn_share_nothing_across_and_restore(tmp_path: Path) -> None:
    """A plain manager's step, then sharded steps, then a plain step again, in one directory: no
    file of one kind is linked into a step of the other, and each restores as saved."""
    whole = expected_whole(1, 2)
    parameters = {n: v for n, v in whole.items() if "/" not in n}
    with CheckpointManager(tmp_path, durable=False, external_data_threshold=0) as plain:
        plain.save(CheckpointState.from_arrays({}, parameters), 1)
    assert save_steps(tmp_path, 2, [2, 3]) == [None, None]
    with CheckpointManager(tmp_path, durable=False, external_data_threshold=0) as plain:
        plain.save(CheckpointState.from_arrays({}, parameters), 4)
        for earlier, later in ((1, 2), (3, 4)):
            assert not set(inodes(step_dir(tmp_path, later)).values()) & set(
                inodes(step_dir(tmp_path, earlier)).values()
            )
        for step in (1, 4):
            plain.verify(step)
            state = plain.restore(step)
            assert {n: state.parameters[n].data.tobytes() for n in parameters} == {
                n: v.tobytes() for n, v in parameters.items()
            }
        plain.verify(3)
        info = next(i for i in plain.all() if i.step == 3)
        assert_whole_state(info.load(), 3, 2)


@pytest.mark.parametrize("how", ["garbage", "truncated", "missing"])
def test_a_damaged_previous_shard_never_blocks_the_next_save(tmp_path: Path, how: str) -> None:
    """Rank 1's shard checkpoint of step 1 (not its data file) overwritten with garbage of its size,
    truncated, or removed: step 2 still saves, that shard whole, and restores bit for bit."""
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    first = step_dir(tmp_path, 1)
    shard = first / shard_file_name(1, 2)
    mode, folder_mode = stat.S_IMODE(shard.stat().st_mode), stat.S_IMODE(first.stat().st_mode)
    first.chmod(stat.S_IRWXU)
    if how == "missing":
        shard.unlink()
    else:
        shard.chmod(stat.S_IRUSR | stat.S_IWUSR)
        data = shard.read_bytes()
        shard.write_bytes(os.urandom(len(data)) if how == "garbage" else data[: len(data) // 2])
        shard.chmod(mode)
    first.chmod(folder_mode)
    assert save_steps(tmp_path, 2, [2]) == [None, None]
    with CheckpointManager(tmp_path, read_only=True) as reader:
        reader.verify(2)
        info = reader.latest()
        assert info is not None and info.step == 2
        assert_whole_state(info.load(), 2, 2)
    assert restore_on_ranks(tmp_path, 2, 2, 2) == [[], []]
