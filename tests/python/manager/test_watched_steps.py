"""Steps that cost what changed, for a state in the trainer's own arrays (issue 41, item 2): a
manager's synchronous save watches the pages of each value of 64 KiB or more (Linux's asynchronous
userfaultfd write protection, read with PAGEMAP_SCAN: the core's untouched.rs), and the next step
does not compare a value none of whose whole pages was written since, only the part pages at its
ends. A wrong skip would be silent data loss, so each test writes a value some way (in place, at a
part page, by the kernel, through memory given back and zeroed, in a forked child, by swapping
arrays between names) and shows the step holds the new bytes and restores and verifies alone."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointManager, CheckpointState, verify
from test_shared_steps import assert_same, flip_byte, frozen_arrays, offset_of, step_dir, training_state, where
from test_unchanged_steps import HEAD_BYTES, part_page_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")


def saved_whole(manager: CheckpointManager, root: Path, step: int, expected: CheckpointState) -> None:
    assert_same(manager.restore(step), expected)
    assert manager.verify(step).step == step
    verify(step_dir(root, step))


def test_own_frozen_arrays_are_compared_only_at_their_part_pages(tmp_path: Path, compared: list[int]) -> None:
    frozen = frozen_arrays()
    part_pages = sum(part_page_bytes(a) for a in frozen.values())
    with CheckpointManager(tmp_path) as manager:
        for step in range(1, 8):
            manager.save(training_state(step, frozen), step)
        # Step 2 compares everything with step 1 (kept inline) and finds the frozen part unchanged:
        # saved whole with its values in checkpoint.data. Step 3 watches the frozen arrays from
        # before it reads them (compared still: nothing recorded yet) and records where step 2's
        # data file keeps them; steps 4-7 share that file unread.
        frozen_bytes = sum(a.nbytes for a in frozen.values())
        assert compared[:2] == [HEAD_BYTES + frozen_bytes] * 2
        assert compared[2:] == [HEAD_BYTES + part_pages] * 4
        assert all(where(step_dir(tmp_path, 7) / "checkpoint")[n] for n in frozen)
        saved_whole(manager, tmp_path, 7, training_state(7, frozen))


def read_into(array: np.ndarray, index: int, value: float) -> None:
    """The kernel writes ``value`` into ``array[index]``: a read() from a pipe into its memory."""
    read, write = os.pipe()
    os.write(write, np.float32(value).tobytes())
    os.close(write)
    os.readv(read, [memoryview(array).cast("B")[4 * index : 4 * index + 4]])
    os.close(read)


WRITES = {
    "in a whole page": lambda a: a.__setitem__(8000, 1.5),
    "at its first byte": lambda a: a.__setitem__(0, 2.5),
    "at its last byte": lambda a: a.__setitem__(16383, 3.5),
    "the value it held": lambda a: a.__setitem__(5000, a[5000]),
    "by the kernel": lambda a: read_into(a, 9000, 4.5),
}


@pytest.mark.parametrize("how", WRITES)
def test_a_value_written_in_place_is_saved_with_its_new_bytes(tmp_path: Path, compared: list[int], how: str) -> None:
    """Written in a whole page, the watch sees it: compared whole. At a part page (its first or
    last byte, unless the array starts or ends at a page's edge), the comparison there does."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
        written = frozen["frozen5"]
        before = written.copy()
        WRITES[how](written)
        compared.clear()
        manager.save(training_state(4, frozen), 4)
        saved_whole(manager, tmp_path, 4, training_state(4, frozen))
        changed = np.flatnonzero(before.view(np.uint32) != written.view(np.uint32))
        at = written.ctypes.data + 4 * (changed[0] if changed.size else 5000)
        in_whole_page = written.ctypes.data <= at // PAGE * PAGE and (at // PAGE + 1) * PAGE <= (
            written.ctypes.data + written.nbytes
        )
        others = sum(part_page_bytes(a) for n, a in frozen.items() if n != "frozen5")
        seen = written.nbytes if in_whole_page else part_page_bytes(written)
        assert compared == [HEAD_BYTES + others + seen]
        assert where(step_dir(tmp_path, 4) / "checkpoint")["frozen5"] is (changed.size == 0)


def test_arrays_swapped_between_names_are_compared_and_saved_as_swapped(tmp_path: Path) -> None:
    """Each array's pages are unwritten, but its record is of where the other name is kept."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
        swapped = dict(frozen, frozen0=frozen["frozen1"], frozen1=frozen["frozen0"])
        manager.save(training_state(4, swapped), 4)
        saved_whole(manager, tmp_path, 4, training_state(4, swapped))


def test_memory_given_back_and_zeroed_behind_a_dead_array_is_saved_as_zeros(tmp_path: Path) -> None:
    """What an allocator does between two steps: the array is freed, its pages given back (read
    as zeros after, with no write to see), and a new array at the same address takes its place."""
    size = 256 * 1024
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # private anonymous: watched
    frozen = np.frombuffer(memory, np.float32)
    frozen[:] = 3.0

    def state(step: int, values: np.ndarray) -> CheckpointState:
        return CheckpointState.from_arrays({"head": np.full(64 * 1024, step, np.float32)}, {"frozen": values}, {})

    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(state(step, frozen), step)
        del frozen
        memory.madvise(mmap.MADV_DONTNEED)
        again = np.frombuffer(memory, np.float32)  # the same address and length
        manager.save(state(4, again), 4)
        restored = manager.restore(4).parameters["frozen"].data
        assert restored.tobytes() == bytes(size)


def test_a_forked_child_saves_what_it_wrote(tmp_path: Path) -> None:
    """The watch is the parent's: a forked child's records and page tables are not its own."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
    pid = os.fork()
    if pid == 0:  # the child: writes a frozen value, then saves step 4 in the same directory
        status = 1
        try:
            frozen["frozen6"][9000] = 6.5
            with CheckpointManager(tmp_path) as manager:
                manager.save(training_state(4, frozen), 4)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    written = {**frozen, "frozen6": frozen["frozen6"].copy()}
    written["frozen6"][9000] = 6.5
    with CheckpointManager(tmp_path) as manager:
        saved_whole(manager, tmp_path, 4, training_state(4, written))
        manager.save(training_state(5, frozen), 5)  # the parent's own arrays, unwritten here
        saved_whole(manager, tmp_path, 5, training_state(5, frozen))


def test_an_async_save_writes_its_copy_and_the_next_step_is_right(tmp_path: Path) -> None:
    """An async save writes from a copy, which is never watched; steps stay whole either way."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path, async_save=True) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
            manager.wait()
        frozen["frozen7"][4000] = 7.5
        manager.save(training_state(4, frozen), 4)
        manager.wait()
        saved_whole(manager, tmp_path, 4, training_state(4, frozen))


def _through_an_outside_link(data: Path, offset: int) -> None:
    os.link(data, data.parent.parent / "outside")
    flip_byte(data.parent.parent / "outside", offset)


def _replaced_by_an_altered_copy(data: Path, offset: int) -> None:
    values = bytearray(data.read_bytes())  # (pair trailer and all: the same pair id)
    values[offset] ^= 1
    data.unlink()
    data.write_bytes(bytes(values))


@pytest.mark.parametrize("damage", [_through_an_outside_link, _replaced_by_an_altered_copy])
def test_a_previous_data_file_changed_since_its_record_proves_nothing(
    tmp_path: Path, compared: list[int], damage
) -> None:
    """The record says where the previous data file keeps a value, not that the file still holds
    it: one written in place (through another link) or replaced by an altered copy since must not
    stand for the unwritten array, else every later step keeps the damaged bytes (and, with
    verify_after_save, every later save fails)."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path, verify_after_save=True) as manager:
        for step in (1, 2, 3):
            manager.save(training_state(step, frozen), step)
        checkpoint = step_dir(tmp_path, 3) / "checkpoint"
        damage(checkpoint.parent / "checkpoint.data", offset_of(checkpoint, "frozen3") + 20_000)
        compared.clear()
        for step in (4, 5):
            manager.save(training_state(step, frozen), step)
            saved_whole(manager, tmp_path, step, training_state(step, frozen))
        assert compared[0] > frozen["frozen3"].nbytes  # (step 4 read it)


def test_an_array_resized_in_place_between_steps_is_saved_as_it_is_now(tmp_path: Path) -> None:
    """Nothing holds a watched array between saves (not even weakly: NumPy would refuse the resize),
    so it can be resized in place; its memory moved, the step saves what it holds now."""
    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3, 4):
            manager.save(training_state(step, frozen), step)
        grown = frozen["frozen2"]
        grown.resize(2 * grown.size, refcheck=False)  # (realloc: the old pages are freed, maybe reused)
        grown[grown.size // 2 :] = 2.0
        manager.save(training_state(5, frozen), 5)
        saved_whole(manager, tmp_path, 5, training_state(5, frozen))


def test_a_proven_step_loads_in_onnx_runtime_alone(tmp_path: Path, compared: list[int], ort) -> None:
    """A step whose frozen part was proven (not compared), and one value of it written since, loads in
    ONNX Runtime with every parameter's bytes once the steps before it are deleted."""
    import hashlib

    frozen = frozen_arrays()
    with CheckpointManager(tmp_path) as manager:
        for step in range(1, 6):
            manager.save(training_state(step, frozen), step)
        frozen["frozen3"][9000] = 3.25
        compared.clear()
        manager.save(training_state(6, frozen), 6)
        others = sum(part_page_bytes(a) for n, a in frozen.items() if n != "frozen3")
        assert compared == [HEAD_BYTES + frozen["frozen3"].nbytes + others]  # (the rest proven)
        for step in range(1, 6):
            manager.delete(step)
    described = ort("describe", step_dir(tmp_path, 6) / "checkpoint")
    digests = {p["name"]: p["sha256"] for p in described["parameters"]}
    assert len(digests) == len(frozen) + 2  # the frozen part and the head
    expected = training_state(6, frozen)
    assert digests == {
        name: hashlib.sha256(np.ascontiguousarray(p.data).tobytes()).hexdigest() for name, p in expected.parameters
    }
