"""Sharded checkpoints, with ranks as threads of this process (the MPI and torch.distributed
runs are in tests/distributed): the save protocol, resharding, merge, failures on one rank."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from distributed_model import ThreadComm, check_part, on_ranks, rank_state, save_model, whole_tensors
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.distributed import (
    INDEX_NAME,
    ShardedCheckpointError,
    SingleProcess,
    Slice,
    committed_steps,
    communicator,
    latest_step,
    load_sharded,
    merge,
    save_sharded,
    shard_file_name,
    step_directory,
)
from ortckpt.distributed import sharded as sharded_module
from ortckpt.stepstore import DirectoryStore

# --- slices ----------------------------------------------------------------------------------------


def test_split_follows_array_split_and_tiles_the_tensor() -> None:
    for length, world in [(13, 4), (4, 4), (3, 5), (10, 1)]:
        parts = [Slice.split((length, 2), r, world) for r in range(world)]
        expected = np.array_split(np.arange(length), world)
        assert [p.shape[0] for p in parts] == [len(e) for e in expected]
        assert [p.offset[0] for p in parts] == [int(e[0]) if len(e) else length for e in expected]
    column = Slice.split((3, 10), 1, 3, dim=1)
    assert (column.offset, column.shape, column.index) == ((0, 4), (3, 3), (slice(0, 3), slice(4, 7)))


def test_intersection_and_bounds() -> None:
    a, b = Slice((10, 4), (0, 0), (6, 4)), Slice((10, 4), (4, 2), (6, 2))
    assert a.intersection(b) == Slice((10, 4), (4, 2), (2, 2))
    assert a.intersection(Slice((10, 4), (6, 0), (4, 4))) is None
    assert Slice.whole(()).intersection(Slice.whole(())) == Slice.whole(())
    with pytest.raises(ValueError, match="outside"):
        Slice((10,), (8,), (3,))
    with pytest.raises(ValueError, match="dimensions"):
        Slice((10, 2), (0,), (10,))


# --- saving and loading on the same world size ----------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_gets_back_what_it_saved(tmp_path: Path, world: int) -> None:
    where = save_model(tmp_path, step=100, world=world)
    assert where == [step_directory(tmp_path, 100)] * world
    assert latest_step(tmp_path) == 100
    files = sorted(p.name for p in where[0].iterdir())
    assert files == sorted([INDEX_NAME] + [shard_file_name(r, world) for r in range(world)])

    def work(comm: ThreadComm) -> list[str]:
        state, slices = load_sharded(tmp_path, comm=comm)
        expected = rank_state(100, comm.rank, world)[1]
        problems = check_part(state, slices, 100, world)
        if {n: s for n, s in slices.items() if n in expected} != expected:
            problems.append(f"slices {slices}")
        if {"bias", f"scale_{comm.rank}"} - set(slices):
            problems.append("bias or own scale missing")
        return problems

    assert on_ranks(world, work) == [[]] * world


def test_each_shard_is_an_ordinary_checkpoint_and_replicas_are_written_once(tmp_path: Path) -> None:
    save_model(tmp_path, step=7, world=2)
    step_dir = step_directory(tmp_path, 7)
    zero = CheckpointState.load_checkpoint(step_dir / shard_file_name(0, 2))
    one = CheckpointState.load_checkpoint(step_dir / shard_file_name(1, 2))
    assert sorted(zero.parameters.names()) == ["bias", "embedding", "proj", "scale_0"]
    assert sorted(one.parameters.names()) == ["embedding", "proj", "scale_1"]  # bias: rank 0 wrote it
    assert one.parameters["embedding"].shape == (6, 4) and one.parameters["proj"].shape == (3, 5)
    assert sorted(one.optimizer_groups["group0"].momentums) == ["embedding", "proj"]
    index = json.loads((step_dir / INDEX_NAME).read_text())
    assert index["world_size"] == 2 and index["step"] == 7
    assert index["tensors"]["bias"]["pieces"] == [{"shard": 0, "holders": [0, 1], "offset": [0], "shape": [4]}]
    assert [p["offset"] for p in index["tensors"]["proj"]["pieces"]] == [[0, 0], [0, 5]]
    assert index["optimizer_groups"] == {"group0": {"step": 7, "initial_learning_rate": 1e-3}}
    assert ortckpt.verify(step_dir).tensors == 4 + 3 + 3 * 2 + 2 * 2


def test_loaded_piece_is_a_view_of_the_mapped_shard(tmp_path: Path) -> None:
    save_model(tmp_path, step=1, world=2)
    state, _ = on_ranks(2, lambda comm: load_sharded(tmp_path, comm=comm))[1]
    embedding = state.parameters["embedding"].data
    assert not embedding.flags.owndata  # exactly a saved piece: no copy
    resharded, _ = on_ranks(1, lambda comm: load_sharded(tmp_path, comm=comm))[0]
    assert resharded.parameters["embedding"].data.flags.owndata  # assembled from two pieces


# --- resharding and merging -----------------------------------------------------------------------


@pytest.mark.parametrize(("saved", "loading"), [(4, 2), (2, 4), (4, 3), (2, 1)])
def test_loading_on_another_world_size_reshards(tmp_path: Path, saved: int, loading: int) -> None:
    save_model(tmp_path, step=5, world=saved)

    def work(comm: ThreadComm) -> list[str]:
        state, slices = load_sharded(tmp_path, comm=comm)
        problems = check_part(state, slices, 5, saved)
        for name, dim in (("embedding", 0), ("proj", 1)):
            if slices[name] != Slice.split(slices[name].global_shape, comm.rank, loading, dim):
                problems.append(f"{name}: {slices[name]}")
        scales = {n for n in slices if n.startswith("scale_")}
        if scales != {f"scale_{r}" for r in range(saved) if r % loading == comm.rank}:
            problems.append(f"scales {scales}")
        if "bias" not in slices:
            problems.append("bias (held by every rank) missing")
        return problems

    assert on_ranks(loading, work) == [[]] * loading


def test_resharded_state_saves_again_and_loads_back(tmp_path: Path) -> None:
    save_model(tmp_path / "four", step=3, world=4)

    def resave(comm: ThreadComm) -> Any:
        state, slices = load_sharded(tmp_path / "four", comm=comm)
        return save_sharded(state, tmp_path / "two", step=3, comm=comm, slices=slices, durable=False)

    on_ranks(2, resave)
    merge(tmp_path / "four", tmp_path / "four.ckpt")
    merge(tmp_path / "two", tmp_path / "two.ckpt")
    assert (tmp_path / "four.ckpt").read_bytes() == (tmp_path / "two.ckpt").read_bytes()


def test_explicit_slices_load_any_box(tmp_path: Path) -> None:
    save_model(tmp_path, step=2, world=4)
    box = Slice((13, 4), (2, 1), (9, 2))  # across three saved row pieces
    state, slices = load_sharded(tmp_path, comm=SingleProcess(), slices={"embedding": box, "bias": None})
    whole = whole_tensors(2, 4)
    assert np.array_equal(state.parameters["embedding"].data, whole["embedding"][2:11, 1:3])
    assert np.array_equal(
        state.optimizer_groups["group0"].momentums["embedding"]["momentum1"], whole["embedding/momentum1"][2:11, 1:3]
    )
    assert slices["bias"] == Slice.whole((4,)) and set(state.parameters.names()) == {"embedding", "bias"}
    with pytest.raises(KeyError, match="no tensor nope"):
        load_sharded(tmp_path, comm=SingleProcess(), slices={"nope": None})


def test_merge_gives_the_whole_state(tmp_path: Path) -> None:
    save_model(tmp_path, step=9, world=4)
    merged = CheckpointState.load_checkpoint(merge(tmp_path, tmp_path / "merged.ckpt"))
    whole = whole_tensors(9, 4)
    assert sorted(merged.parameters.names()) == sorted(n for n in whole if "/" not in n)
    for name, param in merged.parameters:
        assert np.array_equal(param.data, whole[name]), name
        assert param.requires_grad == (not name.startswith("scale_"))
    group = merged.optimizer_groups["group0"]
    assert group.step == 9
    for name, moms in group.momentums.items():
        for m, value in moms.items():
            assert np.array_equal(value, whole[f"{name}/{m}"]), (name, m)
    assert dict(merged.properties) == {"epoch": 0, "run": "sharded-test"}


# --- failures: nothing committed, every rank told ---------------------------------------------------


def test_a_rank_failing_to_write_commits_nothing_and_every_rank_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_model(tmp_path, step=1, world=2)
    real = sharded_module._write_own_shard

    def failing(store, attempt, state, names, rank, *args):  # type: ignore[no-untyped-def]
        files = real(store, attempt, state, names, rank, *args)
        if rank == 1:
            raise OSError(28, "No space left on device")
        return files

    monkeypatch.setattr(sharded_module, "_write_own_shard", failing)
    results = on_ranks(
        2,
        lambda comm: save_sharded(
            rank_state(2, comm.rank, 2)[0],
            tmp_path,
            step=2,
            comm=comm,
            slices=rank_state(2, comm.rank, 2)[1],
            durable=False,
        ),
    )
    assert all(isinstance(r, ShardedCheckpointError) for r in results)
    assert all(r.failures.keys() == {1} and "No space left" in r.failures[1] for r in results)
    assert "rank 1: OSError" in str(results[0]) and str(results[0]) == str(results[1])
    assert committed_steps(tmp_path) == [1] and not step_directory(tmp_path, 2).exists()


def test_disagreeing_ranks_fail_before_anything_is_written(tmp_path: Path) -> None:
    def work(comm: ThreadComm) -> Any:
        state, slices = rank_state(4, comm.rank, 2)
        if comm.rank == 1:  # the same name with another type
            state = CheckpointState.from_arrays(
                {**{n: p.data for n, p in state.parameters}, "bias": np.zeros(4, np.float64)}
            )
        return save_sharded(state, tmp_path, step=4, comm=comm, slices=slices, durable=False)

    results = on_ranks(2, work)
    assert all(isinstance(r, ShardedCheckpointError) for r in results)
    assert "bias: ONNX data type" in str(results[0]) and str(results[0]) == str(results[1])
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("slices_of", "message"),
    [
        (lambda rank: Slice((8,), (0,), (5,)) if rank == 0 else Slice((8,), (4,), (4,)), "overlap"),
        (lambda rank: Slice((9,), (0,), (4,)) if rank == 0 else Slice((9,), (4,), (4,)), "cover 8 of its 9"),
    ],
)
def test_pieces_must_tile_the_tensor(tmp_path: Path, slices_of: Callable[[int], Slice], message: str) -> None:
    def work(comm: ThreadComm) -> Any:
        part = slices_of(comm.rank)
        state = CheckpointState.from_arrays({"w": np.ones(part.shape, np.float32)})
        return save_sharded(state, tmp_path, step=1, comm=comm, slices={"w": part}, durable=False)

    results = on_ranks(2, work)
    assert all(isinstance(r, ShardedCheckpointError) and message in str(r) for r in results), results
    assert latest_step(tmp_path) is None


def test_bad_input_on_one_rank_names_it(tmp_path: Path) -> None:
    def work(comm: ThreadComm) -> Any:
        state, slices = rank_state(1, comm.rank, 2)
        if comm.rank == 1:
            slices = {**slices, "embedding": Slice((13, 4), (0, 0), (7, 4))}  # its array has 6 rows
        return save_sharded(state, tmp_path, step=1, comm=comm, slices=slices, durable=False)

    results = on_ranks(2, work)
    assert all(isinstance(r, ShardedCheckpointError) and r.failures.keys() == {1} for r in results)
    assert "embedding: the slice is (7, 4) but this rank's array is (6, 4)" in str(results[0])


def test_a_commit_that_fails_on_rank_0_abandons_the_step_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_model(tmp_path, step=1, world=2)

    def full_disk(store: Any, attempt: Any, document: str, data: bytes, *, durable: bool) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DirectoryStore, "commit", full_disk)
    results = on_ranks(
        2,
        lambda comm: save_sharded(
            rank_state(2, comm.rank, 2)[0], tmp_path, step=2, comm=comm, slices=rank_state(2, comm.rank, 2)[1]
        ),
    )
    assert all(isinstance(r, ShardedCheckpointError) and r.failures.keys() == {0} for r in results), results
    assert "rank 0: committing: OSError" in str(results[1]) and str(results[0]) == str(results[1])
    assert isinstance(results[0].__cause__, OSError) and results[1].__cause__ is None  # rank 0's own error
    assert committed_steps(tmp_path) == [1] and not step_directory(tmp_path, 2).exists()


def test_a_missing_checkpoint_is_rank_0s_error_and_named_on_the_others(tmp_path: Path) -> None:
    results = on_ranks(2, lambda comm: load_sharded(tmp_path, comm=comm))
    assert isinstance(results[0], FileNotFoundError), results
    assert isinstance(results[1], ShardedCheckpointError) and results[1].failures.keys() == {0}
    assert "sharded load (reading the index)" in str(results[1]) and "FileNotFoundError" in str(results[1])


def test_an_existing_step_is_refused_and_leftovers_are_cleared(tmp_path: Path) -> None:
    save_model(tmp_path, step=1, world=2)
    with pytest.raises(ShardedCheckpointError, match="step 1 exists"):
        save_model(tmp_path, step=1, world=2)
    crashed = tmp_path / ".step_00000002.tmp-0123456789abcdef"  # what a save killed mid-write leaves
    crashed.mkdir()
    (crashed / shard_file_name(0, 2)).write_bytes(b"half a shard")
    assert latest_step(tmp_path) == 1
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_sharded(tmp_path, step=2, comm=SingleProcess())
    save_model(tmp_path, step=2, world=2)  # the writer's lock proves the crashed save dead: removed
    assert committed_steps(tmp_path) == [1, 2] and not crashed.exists()
    assert on_ranks(2, lambda c: check_part(*load_sharded(tmp_path, comm=c), 2, 2)) == [[], []]
    foreign = step_directory(tmp_path, 3)  # not ours to delete: refused, kept
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ShardedCheckpointError, match="not as a sharded checkpoint") as e:
        save_model(tmp_path, step=3, world=2)
    assert e.value.failures.keys() == {0} and (foreign / "notes.txt").read_text() == "mine"
    assert committed_steps(tmp_path) == [1, 2] and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_sharded_step_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the index is in, the step's name does not exist: a reader never sees half a step."""
    seen: list[list[str]] = []
    real = DirectoryStore.commit

    def watching(store: Any, attempt: Any, document: str, data: bytes, *, durable: bool) -> Any:
        seen.append(sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ortckpt")))
        return real(store, attempt, document, data, durable=durable)

    monkeypatch.setattr(DirectoryStore, "commit", watching)
    where = save_sharded(CheckpointState.from_arrays({"w": np.ones(4, np.float32)}), tmp_path, step=7)
    assert where == step_directory(tmp_path, 7) and (where / INDEX_NAME).is_file()
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith(".step_00000007.tmp-"), seen


def test_damaged_index_is_a_format_error(tmp_path: Path) -> None:
    save_model(tmp_path, step=1, world=1)
    index = step_directory(tmp_path, 1) / INDEX_NAME
    index.write_text("{}")
    with pytest.raises(ortckpt.CheckpointFormatError, match="not a sharded checkpoint index"):
        load_sharded(tmp_path, comm=SingleProcess())
    index.write_text('{"format": "ortckpt.sharded", "version": 99}')
    with pytest.raises(ortckpt.CheckpointFormatError, match="version 99"):
        merge(tmp_path, tmp_path / "out")


def test_shard_size_mismatch_fails_verification(tmp_path: Path) -> None:
    save_model(tmp_path, step=1, world=2)
    shard = step_directory(tmp_path, 1) / shard_file_name(1, 2)
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(ortckpt.CheckpointIntegrityError, match=r"bytes, index.json says"):
        ortckpt.verify(step_directory(tmp_path, 1))


# --- the engine, and the checkpoint manager --------------------------------------------------------


def test_without_an_engine_the_world_is_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(__import__("sys").modules, "mpi4py.MPI", raising=False)
    assert isinstance(communicator(None), SingleProcess)
    with pytest.raises(TypeError, match="expected an mpi4py communicator"):
        communicator(object())


def test_manager_drives_sharded_saves(tmp_path: Path) -> None:
    def work(comm: ThreadComm) -> Any:
        with CheckpointManager(tmp_path, comm=comm, max_to_keep=2, durable=False) as manager:
            for step in (10, 20, 30):
                state, slices = rank_state(step, comm.rank, 2)
                manager.save(state, step, metrics={"loss": 1.0 / step}, slices=slices)
            problems = check_part(*manager.restore_sharded(), 30, 2)
            return manager.all_steps(), manager.run_id, problems

    results = on_ranks(2, work)
    assert [r[0] for r in results] == [[20, 30]] * 2 and results[0][1] == results[1][1]
    assert [r[2] for r in results] == [[], []]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "step_00000030"]
    reopened = CheckpointManager(tmp_path)
    latest = reopened.latest()
    assert latest is not None and latest.sharded and latest.metrics == {"loss": 1.0 / 30}
    whole = latest.load()  # every piece, in one process
    assert np.array_equal(whole.parameters["embedding"].data, whole_tensors(30, 2)["embedding"])
    assert whole.properties["step"] == 30
    verified = reopened.verify()
    assert set(verified.files) == {INDEX_NAME, shard_file_name(0, 2), shard_file_name(1, 2)}


def test_manager_refuses_what_sharded_saves_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not available for sharded saves"):
        CheckpointManager(tmp_path, comm=SingleProcess(), async_save=True)
    with CheckpointManager(tmp_path) as manager, pytest.raises(ValueError, match="create the manager with comm"):
        manager.save(rank_state(1, 0, 1)[0], 1, slices={})
