"""CheckpointManager(comm=...) on s3://: each rank's shard of a mostly frozen model keeps its values
in a data object of the run's shared folder (ortckpt.stepstore.shared), and the next step's shard
uploads only what changed, reading the rest from there, as a plain manager's steps do. Every step
restores (same and another world size), verifies and loads in ONNX Runtime after its neighbours
are deleted; a shared object goes only when no kept step names it; a failed save leaves none of
its objects. Ranks are threads of this process (distributed_model); a real S3 server (SeaweedFS)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import ortckpt.object_store as object_store
import pytest
from distributed_model import ThreadComm, on_ranks, rank_state, whole_tensors
from ortckpt import CheckpointFormatError, CheckpointIntegrityError, CheckpointManager, CheckpointState, targets
from ortckpt.distributed import ShardedCheckpointError, merge, shard_file_name
from ortckpt.distributed import sharded as sharded_module
from ortckpt.stepstore import shared
from restoring_readers import restoring_readers

FROZEN = 6  # frozen tensors of 64 KiB per rank: most of each shard, the same at every step
FROZEN_BYTES = FROZEN * 16384 * 4  # a rank's


@pytest.fixture(autouse=True)
def small_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "SHARE_MIN_BYTES", FROZEN_BYTES // 2)  # (so that shards stay small)


def frozen_part(rank: int, version: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + rank + 1000 * version)
    return {f"frozen{rank}_{i}": rng.standard_normal(16384).astype(np.float32) for i in range(FROZEN)}


def save_steps(url: str, options: dict, world: int, numbers: list[int], version: int = 0, **more: Any) -> list[Any]:
    """Saves ``numbers`` with a manager on ``world`` ranks; returns each rank's error, or None
    (rank 0: the bytes uploaded by each step, all ranks together, as it measured them: a rank
    uploads only after rank 0 entered the save, and rank 0's save returns once all did)."""

    def work(comm: ThreadComm) -> list[int] | None:
        sizes = []
        with CheckpointManager(url, comm=comm, storage_options=options, **more) as manager:
            for step in numbers:
                state, slices = rank_state(step, comm.rank, world, extra_frozen=frozen_part(comm.rank, version))
                before = object_store.bytes_put()
                manager.save(state, step, slices=slices)
                sizes.append(object_store.bytes_put() - before)
        return sizes if comm.rank == 0 else None

    return on_ranks(world, work)


def saved(results: list[Any]) -> list[int]:
    """Rank 0's sizes, every rank having succeeded."""
    assert all(r is None or isinstance(r, list) for r in results), results
    assert results[1:] == [None] * (len(results) - 1), results
    return results[0]  # type: ignore[no-any-return]


def uploaded_by(save: Any) -> tuple[Any, int]:
    before = object_store.bytes_put()
    result = save()
    return result, object_store.bytes_put() - before


def shared_keys(url: str, options: dict) -> list[str]:
    listed = object_store.list_keys(targets.object_location(url, options))
    return sorted(key for key, _ in listed if key.startswith("shared/"))


def all_keys(url: str, options: dict) -> list[str]:
    return sorted(key for key, _ in object_store.list_keys(targets.object_location(url, options)))


def metadata(url: str, options: dict, step: int) -> dict[str, Any]:
    where = targets.object_location(f"{url}/step_{step:08d}/metadata.json", options)
    return json.loads(bytes(object_store.get(where)))  # type: ignore[no-any-return]


def data_objects(url: str, options: dict, step: int, world: int) -> list[str]:
    files = metadata(url, options, step)["files"]
    return [files[f"{shard_file_name(rank, world)}.data"]["object"] for rank in range(world)]


def expected_whole(step: int, world: int, version: int = 0) -> dict[str, np.ndarray]:
    whole = whole_tensors(step, world)
    for rank in range(world):
        whole.update(frozen_part(rank, version))
    return whole


def assert_whole_state(state: CheckpointState, step: int, world: int, version: int = 0) -> None:
    whole = expected_whole(step, world, version)
    assert sorted(state.parameters.names()) == sorted(n for n in whole if "/" not in n)
    for name in state.parameters.names():
        assert state.parameters[name].data.tobytes() == whole[name].tobytes(), name
    for param, moms in state.optimizer_groups["group0"].momentums.items():
        for m, value in moms.items():
            assert np.asarray(value).tobytes() == whole[f"{param}/{m}"].tobytes(), (param, m)


def restore_on_ranks(url: str, options: dict, step: int, saved_world: int, world: int) -> list[Any]:
    """Each of ``world`` ranks restores its part of ``step`` (resharded when ``world`` is not
    ``saved_world``): its problems, [] when none."""
    whole = expected_whole(step, saved_world)

    def work(comm: ThreadComm) -> list[str]:
        with CheckpointManager(url, comm=comm, storage_options=options, read_only=True) as manager:
            state, slices = manager.restore_sharded(step)
        problems = [] if slices else ["nothing loaded"]
        for name, part in slices.items():
            if state.parameters[name].data.tobytes() != whole[name][part.index].tobytes():
                problems.append(f"{name}{part.index}: values differ")
        return problems

    return on_ranks(world, work)


def test_steps_after_the_first_upload_only_what_changed(s3_server, s3_url) -> None:
    options = s3_server.storage_options()
    sizes = saved(save_steps(s3_url, options, 2, [1, 2, 3]))
    assert sizes[0] > 2 * FROZEN_BYTES and all(10 * later < 2 * FROZEN_BYTES for later in sizes[1:]), sizes
    # Each rank's data object, uploaded by step 1, named by every step; the index lists its size.
    first = data_objects(s3_url, options, 1, 2)
    assert first == data_objects(s3_url, options, 2, 2) == data_objects(s3_url, options, 3, 2)
    assert shared_keys(s3_url, options) == sorted(data_objects(s3_url, options, 1, 2))
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        for info in reader.all():
            assert_whole_state(info.load(), info.step, 2)
            assert f"{shard_file_name(1, 2)}.data" in reader.verify(info.step).files


def test_a_resumed_jobs_first_step_shares_what_its_restore_downloaded(s3_server, s3_url) -> None:
    """A new job (a preemption, a redeploy) restores step 2 on its ranks, then saves step 3: each rank's
    shard shares the data object its restore downloaded (hashed as it came, proven by its ETag), as a
    plain manager's restore does. Without the restore, or having restored another step than the
    previous one, the step goes up whole."""
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1, 2]))
    first = data_objects(s3_url, options, 1, 2)

    def resume(restore: int | None, step: int) -> Any:
        def work(comm: ThreadComm) -> int | None:
            with CheckpointManager(s3_url, comm=comm, storage_options=options) as manager:
                if restore is not None:
                    manager.restore_sharded(restore)
                state, slices = rank_state(step, comm.rank, 2, extra_frozen=frozen_part(comm.rank))
                before = object_store.bytes_put()
                manager.save(state, step, slices=slices)
                return object_store.bytes_put() - before if comm.rank == 0 else None

        return on_ranks(2, work)

    shared_step = resume(2, 3)
    assert shared_step[1:] == [None] and 10 * shared_step[0] < 2 * FROZEN_BYTES, shared_step
    assert data_objects(s3_url, options, 3, 2) == first
    whole_step = resume(None, 4)  # (no restore: no basis)
    assert whole_step[1:] == [None] and whole_step[0] > 2 * FROZEN_BYTES, whole_step
    older = resume(3, 5)  # (step 3 restored, but step 4 is the previous one: whole)
    assert older[1:] == [None] and older[0] > 2 * FROZEN_BYTES, older
    for step in (3, 4, 5):
        assert restore_on_ranks(s3_url, options, step, 2, 2) == [[], []]
        assert restore_on_ranks(s3_url, options, step, 2, 3) == [[], [], []]


@pytest.mark.parametrize("kept", [1, 2])
def test_each_step_restores_reshards_verifies_and_loads_in_onnx_runtime_alone(s3_server, s3_url, tmp_path, ort, kept):
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1, 2, 3]))
    with CheckpointManager(s3_url, storage_options=options) as manager:
        for step in {1, 2, 3} - {kept}:
            manager.delete(step)
        assert manager.all_steps() == [kept]
        assert shared_keys(s3_url, options) == sorted(data_objects(s3_url, options, kept, 2))
        manager.verify(kept)
        assert_whole_state(manager.latest().load(), kept, 2)
    assert restore_on_ranks(s3_url, options, kept, 2, 2) == [[], []]
    assert restore_on_ranks(s3_url, options, kept, 2, 3) == [[], [], []]  # resharded
    merged = merge(f"{s3_url}/step_{kept:08d}", tmp_path / "merged", storage_options=options)
    described = ort("describe", merged)
    whole = expected_whole(kept, 2)
    assert {p["name"]: p["sha256"] for p in described["parameters"]} == {
        name: hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        for name, value in whole.items()
        if "/" not in name
    }
    # Each shard, downloaded with its data object (checked against metadata.json), is an ordinary
    # checkpoint ONNX Runtime loads on its own, with the values of the tensors its rank wrote.
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        record = reader.latest().step_record
        for rank in range(2):
            shard = tmp_path / shard_file_name(rank, 2)
            reader.store.download(record.folder, shard.name, shard, recorded=record.document["files"])
            state, _ = rank_state(kept, rank, 2, extra_frozen=frozen_part(rank))
            held = {name: p for name, p in state.parameters if not (rank and name == "bias")}  # (rank 0 wrote it)
            assert {p["name"]: p["sha256"] for p in ort("describe", shard)["parameters"]} == {
                name: hashlib.sha256(np.ascontiguousarray(p.data).tobytes()).hexdigest() for name, p in held.items()
            }
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.delete(kept)
    assert shared_keys(s3_url, options) == []


def test_a_changed_frozen_part_gets_new_objects_and_the_old_go_with_their_steps(s3_server, s3_url) -> None:
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1, 2], max_to_keep=2))
    old = data_objects(s3_url, options, 2, 2)
    saved(save_steps(s3_url, options, 2, [3, 4], version=1, max_to_keep=2))
    new = data_objects(s3_url, options, 4, 2)
    assert not set(new) & set(old) and data_objects(s3_url, options, 3, 2) == new
    assert shared_keys(s3_url, options) == sorted(new)
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        assert reader.all_steps() == [3, 4]
        assert_whole_state(reader.latest().load(), 4, 2, version=1)


def test_another_world_size_uploads_whole_and_restores(s3_server, s3_url) -> None:
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1]))
    _, size = uploaded_by(lambda: save_steps(s3_url, options, 3, [2]))
    assert size > 3 * FROZEN_BYTES
    assert restore_on_ranks(s3_url, options, 2, 3, 2) == [[], []]
    assert restore_on_ranks(s3_url, options, 1, 2, 3) == [[], [], []]


def test_share_unchanged_false_uploads_every_shard_whole_into_its_step(s3_server, s3_url) -> None:
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1, 2], share_unchanged=False))
    assert shared_keys(s3_url, options) == []
    assert restore_on_ranks(s3_url, options, 2, 2, 2) == [[], []]


def in_one_session(url: str, options: dict, world: int, body: Any, **more: Any) -> list[Any]:
    """Runs ``body(save)`` on ``world`` ranks, each with its manager: ``save(step, version=0)``
    saves that step (rank 0 gets the bytes uploaded, all ranks together, the others None; a
    failed save raises). Returns each rank's result or error."""

    def work(comm: ThreadComm) -> Any:
        with CheckpointManager(url, comm=comm, storage_options=options, **more) as manager:

            def save(step: int, version: int = 0) -> int | None:
                state, slices = rank_state(step, comm.rank, world, extra_frozen=frozen_part(comm.rank, version))
                before = object_store.bytes_put()
                manager.save(state, step, slices=slices)
                return object_store.bytes_put() - before if comm.rank == 0 else None

            return body(save)

    return on_ranks(world, work)


def failing_once(save: Any, step: int, version: int = 0) -> str:
    """``save(step)``, which must fail on every rank: the failure's text."""
    with pytest.raises(ShardedCheckpointError) as failed:
        save(step, version)
    return str(failed.value) + str(failed.value.__cause__)


def put_failing_for(monkeypatch: pytest.MonkeyPatch, ending: str, failures: list[str]) -> None:
    """The upload of every object whose key ends with ``ending`` fails (a full disk, a server's
    error), once each; others go up."""
    real = shared.put_hashed

    def put_hashed(where: Any, pieces: Any, progress: bool) -> dict[str, Any]:
        if where.key.endswith(ending) and not failures:
            failures.append(where.key)
            raise OSError(28, "No space left on device")
        return real(where, pieces, progress)

    monkeypatch.setattr(shared, "put_hashed", put_hashed)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_failing_after_its_data_object_went_up_leaves_none_of_the_attempts_objects(
    s3_server, s3_url, monkeypatch, failing
) -> None:
    """Step 2 changes the frozen part (new data objects on both ranks); one rank's shard object
    fails to go up after its data object did: no step 2, neither rank's new object left (the
    failing rank's removed by itself, the other's by rank 0's abandon), step 1 whole; the next
    save goes up and shares again."""
    options = s3_server.storage_options()
    failures: list[str] = []
    before: list[list[str]] = []

    def body(save: Any) -> list[Any]:
        sizes = [save(1)]
        before.append(all_keys(s3_url, options))
        put_failing_for(monkeypatch, shard_file_name(failing, 2), failures)
        text = failing_once(save, 2, version=1)
        assert "No space left" in text, text
        return [*sizes, all_keys(s3_url, options), save(3, version=1), save(4, version=1)]

    results = in_one_session(s3_url, options, 2, body)
    assert len(failures) == 1 and failures[0].endswith(
        f"/step_00000002/{failures[0].split('/')[-2]}/{shard_file_name(failing, 2)}"
    )
    assert not isinstance(results[0], BaseException) and not isinstance(results[1], BaseException), results
    assert results[0][1] == before[0]  # (after the failed save: what step 1 left, nothing more)
    assert results[0][2] > 2 * FROZEN_BYTES and 10 * results[0][3] < 2 * FROZEN_BYTES, results[0]
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        assert reader.all_steps() == [1, 3, 4]
        reader.verify(1)
        assert_whole_state(next(i for i in reader.all() if i.step == 1).load(), 1, 2)
        assert_whole_state(reader.latest().load(), 4, 2, version=1)


def test_a_failing_commit_never_removes_the_objects_the_previous_step_names(s3_server, s3_url, monkeypatch) -> None:
    """Step 2 shares step 1's objects and its commit fails before it is sent: its cleanup removes
    its own attempt, never the objects step 1 reads; the next step still shares them."""
    options = s3_server.storage_options()
    commit = CheckpointManager._commit

    def body(save: Any) -> Any:
        save(1)
        keys = all_keys(s3_url, options)

        def failing(self, attempt, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(CheckpointManager, "_commit", failing)
        assert "Input/output error" in failing_once(save, 2)
        monkeypatch.setattr(CheckpointManager, "_commit", commit)
        return keys, all_keys(s3_url, options), save(3)

    results = in_one_session(s3_url, options, 2, body)
    assert not isinstance(results[0], BaseException), results
    keys, after, size = results[0]
    assert after == keys and 10 * size < 2 * FROZEN_BYTES, (keys, after, size)
    assert restore_on_ranks(s3_url, options, 3, 2, 2) == [[], []]


def test_the_previous_steps_objects_removed_after_it_was_chosen_fails_the_save(s3_server, s3_url, monkeypatch) -> None:
    """Step 1 is chosen to share with, then its data objects are removed (another job's sweep, a
    deletion) before step 2's commit: the save fails rather than commit a step whose objects are
    missing, and the next one uploads whole and restores."""
    options = s3_server.storage_options()
    write = sharded_module._write_own_shard

    def body(save: Any) -> Any:
        save(1)
        objects = data_objects(s3_url, options, 1, 2)

        def removed_after_upload(store, attempt, state, names, rank, *args):  # type: ignore[no-untyped-def]
            written = write(store, attempt, state, names, rank, *args)
            object_store.remove([targets.object_location(f"{s3_url}/{objects[rank]}", options)])
            return written

        monkeypatch.setattr(sharded_module, "_write_own_shard", removed_after_upload)
        text = failing_once(save, 2)
        monkeypatch.setattr(sharded_module, "_write_own_shard", write)
        return text, save(3)

    results = in_one_session(s3_url, options, 2, body)
    assert not isinstance(results[0], BaseException), results
    text, size = results[0]
    assert "shared data object is gone" in text, text
    assert size > 2 * FROZEN_BYTES  # (whole: new objects)
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        assert reader.all_steps() == [1, 3]  # (step 1's objects are gone: the test removed them)
    assert restore_on_ranks(s3_url, options, 3, 2, 2) == [[], []]


@pytest.mark.parametrize("named", ["another rank's", "another step's"])
def test_a_metadata_document_naming_another_object_is_refused(s3_server, s3_url, named) -> None:
    """A hostile metadata.json of step 2 names, for rank 0's shard, another rank's data object
    (another size than the index's: refused before a byte is read) or another step's object of
    the same size, with that object's exact entry (downloaded, then refused: its pair id is not
    the shard's). Step 4, whose object that is, and step 1 still restore."""
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [1, 2]))
    saved(save_steps(s3_url, options, 2, [3, 4], version=1))
    document = metadata(s3_url, options, 2)
    zero, one = (f"{shard_file_name(rank, 2)}.data" for rank in range(2))
    document["files"][zero] = (
        document["files"][one] if named == "another rank's" else metadata(s3_url, options, 4)["files"][zero]
    )
    where = targets.object_location(f"{s3_url}/step_00000002/metadata.json", options)
    object_store.put(where, json.dumps(document).encode())
    named_object = f"{s3_url}/{document['files'][zero]['object']}"  # (the object the hostile entry names)
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        steps = {info.step: info for info in reader.all()}
        with pytest.raises((CheckpointIntegrityError, CheckpointFormatError), match=shard_file_name(0, 2)) as loaded:
            steps[2].load()
        with pytest.raises(CheckpointIntegrityError) as verified:
            reader.verify(2)
    # Each message names the objects where the run keeps them (the shared data object by its URL, not a
    # .data beside the shard that does not exist), each problem once, and no scratch copy.
    for message in (str(loaded.value), *verified.value.problems):
        assert "ortckpt-scratch" not in message and f"/{shard_file_name(0, 2)}.data" not in message, message
    assert named_object in str(loaded.value)
    assert any(named_object in p for p in verified.value.problems), verified.value.problems
    assert len(verified.value.problems) == len(set(verified.value.problems)) <= 3, verified.value.problems
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        steps = {info.step: info for info in reader.all()}
        assert_whole_state(steps[1].load(), 1, 2)
        assert_whole_state(steps[4].load(), 4, 2, version=1)
    assert restore_on_ranks(s3_url, options, 1, 2, 2) == [[], []]


def test_readers_restore_whole_sharded_steps_while_retention_collects_shared_objects(s3_server, s3_url) -> None:
    """Two ranks keeping one step change their frozen part every third step (so data objects are
    uploaded and collected) while a reader restores the latest step as fast as it can: every
    restore is one step's values, whole (never a missing object, never a mix of two steps)."""
    options = s3_server.storage_options()
    saved(save_steps(s3_url, options, 2, [0], max_to_keep=1))

    def check(state: Any) -> int:
        step = round(float(state.parameters["scale_0"].data) * 1000)
        assert_whole_state(state, step, 2, version=step // 3)
        return step

    def body(save: Any) -> None:
        for step in range(1, 10):
            save(step, version=step // 3)

    with restoring_readers(s3_url, options, check) as (seen, failures):
        results = in_one_session(s3_url, options, 2, body, max_to_keep=1)
    assert results == [None, None], results
    assert failures == [], failures[:3]
    assert len(seen) > 3 and len(set(seen)) > 2, seen
    assert shared_keys(s3_url, options) == sorted(data_objects(s3_url, options, 9, 2))
