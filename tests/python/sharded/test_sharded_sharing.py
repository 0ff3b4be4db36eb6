"""CheckpointManager(comm=..., share_unchanged=True) in a directory: each rank's shard shares its
unchanged tensors with its shard of the previous step (the previous shard's data file hard-linked,
the changed tensors inline), as a plain manager's checkpoint does; each step still restores,
verifies and reshards on its own. Ranks are threads of this process (distributed_model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from distributed_model import ThreadComm, on_ranks, rank_state, whole_tensors
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.distributed import INDEX_NAME, ShardedCheckpointError, shard_file_name
from ortckpt.distributed import sharded as sharded_module

FROZEN = 6  # frozen tensors of 64 KiB per rank: most of each shard, the same at every step


def frozen_part(rank: int, changed: str | None = None) -> dict[str, np.ndarray]:
    """Rank ``rank``'s own frozen tensors (other names on every rank: each rank writes its own);
    ``changed`` names one whose values differ (a frozen tensor that changed after all)."""
    rng = np.random.default_rng(100 + rank)
    out = {f"frozen{rank}_{i}": rng.standard_normal(16384).astype(np.float32) for i in range(FROZEN)}
    if changed is not None:
        out[changed] = out[changed] + 1
    return out


def save_steps(root: Path, world: int, steps: list[int], **options: Any) -> list[Any]:
    """Saves ``steps`` with a manager on ``world`` ranks (the split tensors and momentums new at
    every step, the frozen part unchanged; values in each shard's data file unless ``options``
    say otherwise); returns each rank's result or error."""
    options = {"durable": False, "external_data_threshold": 0, **options}

    def work(comm: ThreadComm) -> None:
        with CheckpointManager(root, comm=comm, **options) as manager:
            for step in steps:
                state, slices = rank_state(step, comm.rank, world, extra_frozen=frozen_part(comm.rank))
                manager.save(state, step, slices=slices)

    return on_ranks(world, work)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def inodes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in folder.iterdir()}


def new_bytes(folder: Path, earlier: Path) -> int:
    """Bytes of ``folder``'s files that are not (by inode) files of ``earlier``: what its save wrote."""
    old = set(inodes(earlier).values())
    return sum(p.stat().st_size for p in folder.iterdir() if p.stat().st_ino not in old)


def expected_whole(step: int, world: int) -> dict[str, np.ndarray]:
    whole = whole_tensors(step, world)
    for rank in range(world):
        whole.update(frozen_part(rank))
    return whole


def assert_whole_state(state: CheckpointState, step: int, world: int) -> None:
    """Every value of the one-process state of a step, bit for bit, with its momentums."""
    whole = expected_whole(step, world)
    assert sorted(state.parameters.names()) == sorted(n for n in whole if "/" not in n)
    for name in state.parameters.names():
        got, want = state.parameters[name].data, whole[name]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    for param, moms in state.optimizer_groups["group0"].momentums.items():
        for m, value in moms.items():
            assert np.asarray(value).tobytes() == whole[f"{param}/{m}"].tobytes(), (param, m)


def restore_on_ranks(root: Path, step: int, saved_world: int, world: int) -> list[Any]:
    """Each of ``world`` ranks restores its part of ``step`` through a manager (resharded when
    ``world`` is not ``saved_world``) and compares it with the whole values: problems, [] when none."""
    whole = expected_whole(step, saved_world)

    def work(comm: ThreadComm) -> list[str]:
        with CheckpointManager(root, comm=comm, read_only=True) as manager:
            state, slices = manager.restore_sharded(step)
        problems = [] if slices else ["nothing loaded"]
        momentums = state.optimizer_groups["group0"].momentums
        for name, part in slices.items():
            if state.parameters[name].data.tobytes() != whole[name][part.index].tobytes():
                problems.append(f"{name}{part.index}: values differ")
            for m, value in momentums.get(name, {}).items():
                if np.asarray(value).tobytes() != whole[f"{name}/{m}"][part.index].tobytes():
                    problems.append(f"{name}/{m}{part.index}: values differ")
        return problems

    return on_ranks(world, work)


# --- what a step writes -----------------------------------------------------------------------------


def test_a_mostly_frozen_sharded_step_writes_only_what_changed(tmp_path: Path) -> None:
    assert save_steps(tmp_path, 2, [1, 2]) == [None, None]
    first, second = step_dir(tmp_path, 1), step_dir(tmp_path, 2)
    for rank in range(2):
        data = f"{shard_file_name(rank, 2)}.data"
        assert (second / data).stat().st_ino == (first / data).stat().st_ino  # the same file, linked
        assert (second / data).stat().st_nlink == 2
    frozen_bytes = 2 * FROZEN * 16384 * 4
    written_first = sum(p.stat().st_size for p in first.iterdir())
    written_second = new_bytes(second, first)
    assert written_first > frozen_bytes  # step 1: every value
    assert written_second < frozen_bytes / 10  # step 2: the changed tensors (a few KiB) and documents
    # The shared data files' entries are the previous step's, copied; index.json records their sizes.
    meta1 = json.loads((first / "metadata.json").read_text())
    meta2 = json.loads((second / "metadata.json").read_text())
    for rank in range(2):
        data = f"{shard_file_name(rank, 2)}.data"
        assert meta2["files"][data] == meta1["files"][data]
    index = json.loads((second / INDEX_NAME).read_text())
    assert [s["files"][f"{shard_file_name(s['rank'], 2)}.data"] for s in index["shards"]] == [
        (first / f"{shard_file_name(r, 2)}.data").stat().st_size for r in range(2)
    ]


def test_with_the_default_threshold_a_mostly_unchanged_step_keeps_its_values_for_the_next(tmp_path: Path) -> None:
    """As a plain manager's: the first step's shards hold their values inline (under the
    threshold), the second (mostly unchanged) puts them in its data files, the third shares those."""
    assert save_steps(tmp_path, 2, [1, 2, 3], external_data_threshold=1800 * 2**20) == [None, None]
    assert not list(step_dir(tmp_path, 1).glob("*.data"))
    for data in step_dir(tmp_path, 2).glob("*.data"):
        assert (step_dir(tmp_path, 3) / data.name).stat().st_ino == data.stat().st_ino
    assert len(list(step_dir(tmp_path, 3).glob("*.data"))) == 2
    assert restore_on_ranks(tmp_path, 3, 2, 2) == [[], []]


def test_sha256_entries_are_proven_and_shared(tmp_path: Path) -> None:
    assert save_steps(tmp_path, 2, [1, 2], digest="sha256") == [None, None]
    meta1, meta2 = (json.loads((step_dir(tmp_path, s) / "metadata.json").read_text()) for s in (1, 2))
    for rank in range(2):
        data = f"{shard_file_name(rank, 2)}.data"
        assert "sha256" in meta2["files"][data] and meta2["files"][data] == meta1["files"][data]
        assert (step_dir(tmp_path, 2) / data).stat().st_nlink == 2
    with CheckpointManager(tmp_path, read_only=True) as reader:
        reader.verify(1)
        reader.verify(2)


def test_share_unchanged_false_writes_every_sharded_step_whole(tmp_path: Path) -> None:
    assert save_steps(tmp_path, 2, [1, 2], share_unchanged=False) == [None, None]
    assert not set(inodes(step_dir(tmp_path, 2)).values()) & set(inodes(step_dir(tmp_path, 1)).values())


def test_a_changed_frozen_tensor_is_written_inline_and_read_back(tmp_path: Path) -> None:
    def work(comm: ThreadComm) -> None:
        with CheckpointManager(tmp_path, comm=comm, durable=False, external_data_threshold=0) as manager:
            for step, changed in ((1, None), (2, "frozen1_3" if comm.rank == 1 else None)):
                state, slices = rank_state(step, comm.rank, 2, extra_frozen=frozen_part(comm.rank, changed))
                manager.save(state, step, slices=slices)

    assert on_ranks(2, work) == [None, None]
    data = f"{shard_file_name(1, 2)}.data"
    assert (step_dir(tmp_path, 2) / data).stat().st_ino == (step_dir(tmp_path, 1) / data).stat().st_ino
    whole = CheckpointManager(tmp_path, read_only=True).latest()
    assert whole is not None
    state = whole.load()
    assert state.parameters["frozen1_3"].data.tobytes() == frozen_part(1, "frozen1_3")["frozen1_3"].tobytes()
    assert state.parameters["frozen1_2"].data.tobytes() == frozen_part(1)["frozen1_2"].tobytes()
    assert ortckpt.verify(step_dir(tmp_path, 2)).tensors == ortckpt.verify(step_dir(tmp_path, 1)).tensors


# --- each step on its own ---------------------------------------------------------------------------


@pytest.mark.parametrize("deleted", [1, 2])
def test_each_step_restores_and_verifies_after_the_other_is_deleted(tmp_path: Path, deleted: int) -> None:
    assert save_steps(tmp_path, 2, [1, 2]) == [None, None]
    shards = {INDEX_NAME} | {f"{shard_file_name(r, 2)}{suffix}" for r in range(2) for suffix in ("", ".data")}
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for step in (1, 2):  # both verify while they share
            assert set(reader.verify(step).files) == shards
    with CheckpointManager(tmp_path) as manager:
        manager.delete(deleted)
    kept = 3 - deleted
    assert not step_dir(tmp_path, deleted).exists()
    for data in step_dir(tmp_path, kept).glob("*.data"):
        assert data.stat().st_nlink == 1
    with CheckpointManager(tmp_path, read_only=True) as reader:
        reader.verify(kept)
        info = reader.latest()
        assert info is not None and info.step == kept
        assert_whole_state(info.load(), kept, 2)
    assert restore_on_ranks(tmp_path, kept, 2, 2) == [[], []]
    assert restore_on_ranks(tmp_path, kept, 2, 3) == [[], [], []]  # resharded


def test_shared_shards_load_in_onnx_runtime_on_their_own(ort: Any, tmp_path: Path) -> None:
    """Each shard of a step that shares is an ordinary checkpoint ONNX Runtime loads, with its
    values (parameters by SHA-256, momentums through ONNX Runtime's re-save), once the step that
    wrote the shared data files is deleted."""
    assert save_steps(tmp_path, 2, [1, 2]) == [None, None]
    assert [p.stat().st_nlink for p in sorted(step_dir(tmp_path, 2).glob("*.data"))] == [2, 2]  # shared
    with CheckpointManager(tmp_path) as manager:
        manager.delete(1)
    for rank in range(2):
        shard = step_dir(tmp_path, 2) / shard_file_name(rank, 2)
        assert Path(f"{shard}.data").stat().st_nlink == 1
        state, _ = rank_state(2, rank, 2, extra_frozen=frozen_part(rank))
        held = {name: p for name, p in state.parameters if not (rank and name == "bias")}  # (rank 0 wrote it)
        described = ort("describe", shard)
        assert {p["name"]: p["sha256"] for p in described["parameters"]} == {
            name: hashlib.sha256(np.ascontiguousarray(p.data).tobytes()).hexdigest() for name, p in held.items()
        }
        ort("resave", shard, tmp_path / f"resaved{rank}")
        resaved = CheckpointState.load_checkpoint(tmp_path / f"resaved{rank}").optimizer_groups["group0"]
        for param, moms in resaved.momentums.items():
            for m, value in moms.items():
                expected = state.optimizer_groups["group0"].momentums[param][m]
                assert np.asarray(value).tobytes() == np.asarray(expected).tobytes(), (rank, param, m)
        assert sorted(resaved.momentums) == sorted(name for name, p in held.items() if p.requires_grad)


# --- when nothing is shared -------------------------------------------------------------------------


def test_another_world_size_is_written_whole_and_restores(tmp_path: Path) -> None:
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    assert save_steps(tmp_path, 3, [2, 3]) == [None, None, None]
    first, second, third = (step_dir(tmp_path, s) for s in (1, 2, 3))
    assert not set(inodes(second).values()) & set(inodes(first).values())  # another world: whole
    assert {p.name for p in third.glob("*.data")} == {f"{shard_file_name(r, 3)}.data" for r in range(3)}
    for data in third.glob("*.data"):  # the same world again: shared
        assert data.stat().st_ino == (second / data.name).stat().st_ino
    with CheckpointManager(tmp_path) as manager:
        manager.delete(3)
        for step in (1, 2):
            manager.verify(step)
    assert restore_on_ranks(tmp_path, 2, 3, 3) == [[], [], []]
    assert restore_on_ranks(tmp_path, 2, 3, 2) == [[], []]
    assert restore_on_ranks(tmp_path, 1, 2, 2) == [[], []]


def test_a_failed_sharded_save_leaves_the_previous_step_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    write = sharded_module._write_own_shard

    def failing_after_rank_0(store, attempt, state, names, rank, *args):  # type: ignore[no-untyped-def]
        written = write(store, attempt, state, names, rank, *args)  # (rank 0's link made, then)
        if rank == 1:
            raise OSError(28, "No space left on device")
        return written

    monkeypatch.setattr(sharded_module, "_write_own_shard", failing_after_rank_0)
    results = save_steps(tmp_path, 2, [2])
    assert all(isinstance(r, ShardedCheckpointError) for r in results)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    for data in step_dir(tmp_path, 1).glob("*.data"):
        assert data.stat().st_nlink == 1  # the abandoned attempt's links are gone with it
    with CheckpointManager(tmp_path, read_only=True) as reader:
        reader.verify(1)
        info = reader.latest()
        assert info is not None
        assert_whole_state(info.load(), 1, 2)
    monkeypatch.setattr(sharded_module, "_write_own_shard", write)
    assert save_steps(tmp_path, 2, [2]) == [None, None]  # and the next save shares again
    assert (step_dir(tmp_path, 2) / f"{shard_file_name(0, 2)}.data").stat().st_nlink == 2


def test_a_changed_layout_is_written_whole_and_restores(tmp_path: Path) -> None:
    """The same world size, but each rank now holds the other's frozen part: no tensor of a
    rank's shard is in its shard of the previous step, so every shard is written whole."""

    def work(comm: ThreadComm) -> None:
        with CheckpointManager(tmp_path, comm=comm, durable=False, external_data_threshold=0) as manager:
            for step, holder in ((1, comm.rank), (2, 1 - comm.rank)):
                state, slices = rank_state(step, comm.rank, 2, extra_frozen=frozen_part(holder))
                manager.save(state, step, slices=slices)

    assert on_ranks(2, work) == [None, None]
    assert not set(inodes(step_dir(tmp_path, 2)).values()) & set(inodes(step_dir(tmp_path, 1)).values())
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for info in reader.all():
            reader.verify(info.step)
            assert_whole_state(info.load(), info.step, 2)


def test_a_previous_shard_not_proven_is_not_shared_and_the_others_are(tmp_path: Path) -> None:
    """Rank 1's shard of step 1 made writable (0600: not a step file's permissions, so it may
    change under the steps sharing it): rank 1 writes its shard whole, rank 0 still shares."""
    assert save_steps(tmp_path, 2, [1]) == [None, None]
    first = step_dir(tmp_path, 1)
    (first / f"{shard_file_name(1, 2)}.data").chmod(0o600)
    assert save_steps(tmp_path, 2, [2]) == [None, None]
    second = step_dir(tmp_path, 2)
    zero, one = (f"{shard_file_name(r, 2)}.data" for r in range(2))
    assert (second / zero).stat().st_ino == (first / zero).stat().st_ino
    assert (second / one).stat().st_ino != (first / one).stat().st_ino
    with CheckpointManager(tmp_path, read_only=True) as reader:
        for info in reader.all():
            reader.verify(info.step)
            assert_whole_state(info.load(), info.step, 2)
