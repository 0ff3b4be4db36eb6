"""Steps that cost what changed (issue 41): a tensor whose bytes *are* the previous step's data file
at the offset that step keeps it at (a state restored from the previous step, its frozen part never
written since) cannot have changed, so a shared step does not even compare it. Every other tensor is
compared as before; a wrong skip would be silent data loss, so each test here changes a tensor some
way (in place, through a view, by swapping its array, by restoring another step) and shows that the
step holds the new bytes and restores and verifies on its own."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState, unchanged, verify
from test_shared_steps import (
    FROZEN,
    assert_same,
    data_of,
    flip_byte,
    frozen_arrays,
    offset_of,
    step_dir,
    training_state,
    where,
)

FROZEN_BYTES = FROZEN * 16384 * 4
HEAD_BYTES = 3 * (64 * 16 + 16) * 4  # the head and its two moments


def trained(state: CheckpointState, step: int) -> CheckpointState:
    """``state`` after a training step: the head and its moments set to step ``step``'s (written
    into the state's own arrays, as a trainer updates them), the frozen part left alone."""
    target = training_state(step)
    for name in ("head.weight", "head.bias"):
        state.parameters[name] = target.parameters[name].data
    group, new = state.optimizer_groups["group0"], target.optimizer_groups["group0"]
    group.step = new.step
    for param, moments in new.momentums.items():
        for m, value in moments.items():
            group.momentums[param][m][...] = value
    return state


def expected(step: int, frozen: dict[str, np.ndarray] | None = None) -> CheckpointState:
    return training_state(step, frozen)


def assert_whole(manager: CheckpointManager, root: Path, step: int, state: CheckpointState) -> None:
    assert_same(manager.restore(step), state)
    assert manager.verify(step).step == step
    assert verify(step_dir(root, step)).tensors == 2 + FROZEN + 4


def test_a_restored_frozen_part_is_shared_without_being_compared(tmp_path: Path, compared: list[int]) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        compared.clear()
        state = manager.restore(3)
        for step in (4, 5, 6):
            manager.save(trained(state, step), step)
        # Only the head and its moments were compared: the frozen part is step 3's data file.
        assert compared == [HEAD_BYTES] * 3
        for step in (4, 5, 6):
            assert data_of(tmp_path, step).st_ino == data_of(tmp_path, 2).st_ino
            assert where(step_dir(tmp_path, step) / "checkpoint")["frozen0"] is True
        for step in range(1, 7):
            assert_whole(manager, tmp_path, step, expected(step))
        # Each step stands alone: the steps that wrote and first shared the file deleted.
        manager.delete(2)
        manager.delete(3)
        assert_whole(manager, tmp_path, 6, expected(6))


def test_a_frozen_array_of_a_restored_state_changed_in_place_is_saved_with_its_new_bytes(
    tmp_path: Path, compared: list[int]
) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        state = manager.restore(3)  # (its head inline: only the frozen part is in checkpoint.data)
        view = state.parameters["frozen3"].data
        view[8192] += 1.0  # in place, through the view the state hands out (mid-tensor: one page)
        frozen["frozen3"][8192] += 1.0
        compared.clear()
        manager.save(trained(state, 4), 4)
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen3"] is False  # inline: changed
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen2"] is True
        # The written tensor is compared (a page of it is this process's own now), the others not.
        assert compared == [HEAD_BYTES + 16384 * 4]
        assert_whole(manager, tmp_path, 4, expected(4, frozen))
        # Written back to its old value: still this process's own page, compared with step 4's
        # (inline) copy, and the step holds the old value again.
        view[8192] -= 1.0
        frozen["frozen3"][8192] -= 1.0
        manager.save(trained(state, 5), 5)
        assert compared[1] == HEAD_BYTES + 16384 * 4
        assert_whole(manager, tmp_path, 5, expected(5, frozen))


def test_frozen_values_assigned_or_swapped_in_are_saved_with_their_new_bytes(tmp_path: Path) -> None:
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        state = manager.restore(2)
        frozen["frozen0"] = frozen["frozen0"] * 2
        state.parameters["frozen0"] = frozen["frozen0"]  # values copied in
        manager.save(trained(state, 3), 3)
        assert_whole(manager, tmp_path, 3, expected(3, frozen))
        # The whole state swapped for fresh arrays holding other frozen values.
        frozen["frozen1"] = -frozen["frozen1"]
        manager.save(training_state(4, frozen), 4)
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen1"] is False
        assert_whole(manager, tmp_path, 4, expected(4, frozen))


def test_a_state_restored_from_an_older_step_is_compared_against_the_newest(
    tmp_path: Path, compared: list[int]
) -> None:
    """Step 2's data file mapped, step 4 written whole with other frozen values: the mapping is
    another file's, so nothing of it is taken as unchanged without comparing."""
    other = {n: a + 1 for n, a in frozen_arrays().items()}
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(training_state(step), step)
        for step in (3, 4):
            manager.save(training_state(step, other), step)
        assert data_of(tmp_path, 4).st_ino != data_of(tmp_path, 2).st_ino
        state = manager.restore(2)
        compared.clear()
        manager.save(trained(state, 5), 5)
        assert compared == [HEAD_BYTES + FROZEN_BYTES]
        assert_whole(manager, tmp_path, 5, expected(5))
        # The next step's previous is step 5, written whole from step 2's values: compared again.
        manager.save(trained(state, 6), 6)
        assert_whole(manager, tmp_path, 6, expected(6))


def test_a_restored_state_of_a_deleted_step_still_shares_its_file_by_identity(
    tmp_path: Path, compared: list[int]
) -> None:
    """The restored step deleted (retention): its data file lives on in the steps that link it."""
    with CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        state = manager.restore(3)
        compared.clear()
        for step in range(4, 8):
            manager.save(trained(state, step), step)
        assert manager.all_steps() == [6, 7]
        assert compared == [HEAD_BYTES] * 4
        for step in (6, 7):
            assert_whole(manager, tmp_path, step, expected(step))


def test_a_plain_state_written_in_place_is_compared_and_its_changes_kept(tmp_path: Path, compared: list[int]) -> None:
    """Arrays of this process's own memory are watched page by page (test_watched_steps.py): the one
    written is compared whole, the others only at their part pages, and the step keeps the new bytes."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
        frozen["frozen5"][8000] = 42.0  # in place, in the caller's own array, a page in its middle
        compared.clear()
        manager.save(training_state(4, frozen), 4)
        part_pages = sum(part_page_bytes(a) for n, a in frozen.items() if n != "frozen5")
        assert compared == [HEAD_BYTES + frozen["frozen5"].nbytes + part_pages]
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen5"] is False
        assert_whole(manager, tmp_path, 4, expected(4, frozen))


def part_page_bytes(array: np.ndarray) -> int:
    """The bytes of ``array`` outside its whole pages: what a watched value still compares."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = array.ctypes.data
    whole = (first + array.nbytes) // page * page - (first + page - 1) // page * page
    return array.nbytes - max(whole, 0)


def test_frozen_views_swapped_between_names_are_compared_and_saved_as_swapped(
    tmp_path: Path, compared: list[int]
) -> None:
    """Two views of the previous step's data file, each under the other's name: each is that file's
    bytes, but not at the offset the previous step keeps its name at, so both are compared."""
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        restored = manager.restore(3)
        frozen = {n: restored.parameters[n].data for n in frozen_arrays()}
        frozen["frozen0"], frozen["frozen1"] = frozen["frozen1"], frozen["frozen0"]
        compared.clear()
        manager.save(training_state(4, frozen), 4)
        assert compared == [HEAD_BYTES + 2 * 16384 * 4]
        placed = where(step_dir(tmp_path, 4) / "checkpoint")
        assert (placed["frozen0"], placed["frozen1"], placed["frozen2"]) == (False, False, True)
        swapped = frozen_arrays()
        swapped["frozen0"], swapped["frozen1"] = swapped["frozen1"], swapped["frozen0"]
        assert_whole(manager, tmp_path, 4, expected(4, swapped))


def test_file_span_proves_a_restored_view_is_its_data_file_until_it_is_written(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        state = manager.restore(3)
    data = step_dir(tmp_path, 3) / "checkpoint.data"
    at = offset_of(step_dir(tmp_path, 3) / "checkpoint", "frozen4")
    view = state.parameters["frozen4"].data
    assert unchanged.file_span(view) == unchanged.FileSpan(data.stat().st_dev, data.stat().st_ino, at)
    assert unchanged.is_file_bytes(view, data, at) and unchanged.is_file_bytes(view[10:20], data, at + 40)
    assert not unchanged.is_file_bytes(view, data, at + 4)
    assert not unchanged.is_file_bytes(view, step_dir(tmp_path, 2) / "checkpoint", at)
    assert unchanged.file_span(view[::2]) is None  # (strided: its bytes would be a copy)
    assert unchanged.file_span(view.copy()) is None  # this process's own memory
    assert unchanged.file_span(frozen_arrays()["frozen4"]) is None
    assert unchanged.file_span(view[:0]) is None
    view[8192] = view[8192]  # written with the value it held: this process's own page now
    assert unchanged.file_span(view) is None
    assert unchanged.is_file_bytes(view[:1024], data, at)  # (the pages before it are still the file's)


def test_a_shared_file_changed_outside_under_a_restored_state_makes_the_next_step_fail_verify(
    tmp_path: Path,
) -> None:
    """The restored state reads the file itself, so a byte changed in the file from outside (its
    owner through another link) is the state's too. The step after shares that file unread, with
    the checksum the file's bytes had when written: verify names the tensor, never a silent pass."""
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step), step)
        state = manager.restore(3)
        os.link(step_dir(tmp_path, 3) / "checkpoint.data", tmp_path / "outside")
        flip_byte(tmp_path / "outside", offset_of(step_dir(tmp_path, 3) / "checkpoint", "frozen6") + 8)
        manager.save(trained(state, 4), 4)
        with pytest.raises(CheckpointIntegrityError, match="frozen6"):
            manager.verify(4)
