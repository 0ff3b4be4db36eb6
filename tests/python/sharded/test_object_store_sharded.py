"""Sharded checkpoints on an s3:// prefix, ranks as threads (see test_distributed), against a
real S3 server (SeaweedFS): every rank uploads its shard into the step's fresh attempt folder,
rank 0 commits by creating index.json with a conditional PUT; loads reshard; merge reads and
writes object storage; a failed or beaten save leaves no objects."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from distributed_model import check_part, on_ranks, rank_state, whole_tensors
from ortckpt import CheckpointFormatError, CheckpointState, targets
from ortckpt.distributed import (
    INDEX_NAME,
    ShardedCheckpointError,
    SingleProcess,
    committed_steps,
    latest_step,
    load_sharded,
    merge,
    save_sharded,
    shard_file_name,
)
from ortckpt.distributed import sharded as sharded_module
from s3_server import lose_the_answers_of_conditional_puts


def keys(url: str, options: dict) -> list[str]:
    return sorted(k for k, _ in object_store.list_keys(targets.object_location(url, options)))


def save_model(url: str, options: dict, step: int, world: int, **more: Any) -> list[Any]:
    def work(comm):
        state, slices = rank_state(step, comm.rank, world)
        return save_sharded(state, url, step=step, comm=comm, slices=slices, storage_options=options, **more)

    return on_ranks(world, work)


def raise_any(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("threshold", [2**40, 0], ids=["inline", "external-data"])
def test_every_rank_uploads_its_shard_and_gets_it_back(s3_server, s3_url, threshold):
    options = s3_server.storage_options()
    world = 4
    where = raise_any(save_model(s3_url, options, step=100, world=world, external_data_threshold=threshold))
    assert where == [f"{s3_url}/step_00000100"] * world
    assert committed_steps(s3_url, storage_options=options) == [100]
    assert latest_step(s3_url, storage_options=options) == 100
    listed = keys(s3_url, options)
    index = json.loads(
        bytes(object_store.get(targets.object_location(f"{s3_url}/step_00000100/{INDEX_NAME}", options)))
    )
    shards = [shard_file_name(r, world) for r in range(world)]
    expected = [f"step_00000100/{index['attempt']}/{s}{suffix}" for s in shards for suffix in ("", ".data")]
    assert listed == sorted([f"step_00000100/{INDEX_NAME}", *expected[:: 1 if threshold == 0 else 2]])

    def work(comm):
        state, slices = load_sharded(s3_url, comm=comm, storage_options=options)
        return check_part(state, slices, 100, world)

    assert on_ranks(world, work) == [[]] * world  # each rank what it saved
    assert on_ranks(2, work) == [[]] * 2  # resharded to another world size


def test_merge_from_and_to_object_storage_loads_in_onnx_runtime(s3_server, s3_url, tmp_path, ort):
    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=9, world=2))
    merged_url = merge(s3_url, f"{s3_url}/merged", storage_options=options)
    assert merged_url == f"{s3_url}/merged"
    local = merge(f"{s3_url}/step_00000009", tmp_path / "merged", storage_options=options)  # one step's URL
    assert bytes(object_store.get(targets.object_location(merged_url, options))) == local.read_bytes()
    whole = whole_tensors(9, 2)
    described = ort("describe", local)
    assert {p["name"]: p["sha256"] for p in described["parameters"]} == {
        name: hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        for name, value in whole.items()
        if "/" not in name
    }


def test_a_rank_failing_to_upload_commits_nothing_and_leaves_no_objects(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=1, world=2))
    before = keys(s3_url, options)
    real = sharded_module._write_own_shard

    def failing(store, attempt, state, names, rank, *args):
        files = real(store, attempt, state, names, rank, *args)  # uploaded, then the rank fails
        if rank == 1:
            raise OSError(28, "No space left on device")
        return files

    monkeypatch.setattr(sharded_module, "_write_own_shard", failing)
    results = save_model(s3_url, options, step=2, world=2)
    assert all(isinstance(r, ShardedCheckpointError) and r.failures.keys() == {1} for r in results)
    assert keys(s3_url, options) == before  # both ranks' uploads removed
    assert committed_steps(s3_url, storage_options=options) == [1]


def test_an_existing_step_is_refused(s3_server, s3_url):
    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=1, world=2))
    before = keys(s3_url, options)
    results = save_model(s3_url, options, step=1, world=2)
    assert all(isinstance(r, ShardedCheckpointError) and "step 1 exists" in str(r) for r in results)
    assert keys(s3_url, options) == before
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_sharded(s3_url, step=2, comm=SingleProcess(), storage_options=options)


def test_of_two_jobs_saving_one_step_one_commits(s3_server, s3_url, monkeypatch):
    """Job B checks that step 5 is free, then job A saves and commits it while B uploads: B's
    conditional PUT of the index fails, B raises on every rank, and its shards are removed."""
    options = s3_server.storage_options()
    real = sharded_module._write_own_shard
    raced = []

    def a_commits_meanwhile(store, attempt, state, names, rank, *args):
        files = real(store, attempt, state, names, rank, *args)
        if not raced:
            raced.append(True)
            monkeypatch.setattr(sharded_module, "_write_own_shard", real)
            job_a = CheckpointState.from_arrays({"a": np.arange(4, dtype=np.float32)})
            save_sharded(job_a, s3_url, step=5, comm=SingleProcess(), storage_options=options)
        return files

    monkeypatch.setattr(sharded_module, "_write_own_shard", a_commits_meanwhile)
    state_b = CheckpointState.from_arrays({"b": np.ones(4, np.float32)})
    with pytest.raises(ShardedCheckpointError, match="another writer committed step 5 first"):
        save_sharded(state_b, s3_url, step=5, comm=SingleProcess(), storage_options=options)
    loaded, _ = load_sharded(s3_url, comm=SingleProcess(), storage_options=options)
    assert sorted(loaded.parameters.names()) == ["a"]
    index = json.loads(
        bytes(object_store.get(targets.object_location(f"{s3_url}/step_00000005/{INDEX_NAME}", options)))
    )
    assert keys(s3_url, options) == sorted(
        [f"step_00000005/{INDEX_NAME}", f"step_00000005/{index['attempt']}/{shard_file_name(0, 1)}"]
    )


def test_a_commit_whose_answer_was_lost_is_this_saves(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()
    lose_the_answers_of_conditional_puts(monkeypatch)
    raise_any(save_model(s3_url, options, step=3, world=2))
    assert on_ranks(2, lambda c: check_part(*load_sharded(s3_url, comm=c, storage_options=options), 3, 2)) == [[], []]


def test_a_failed_commit_keeps_the_shards_it_may_have_committed(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()

    def unreachable(location, data):
        raise ortckpt.ObjectStoreError(location.url, "connection reset")

    monkeypatch.setattr(object_store, "put_new", unreachable)
    results = save_model(s3_url, options, step=4, world=2)
    assert all(isinstance(r, ShardedCheckpointError) and "connection reset" in str(r) for r in results)
    assert len(keys(s3_url, options)) == 2  # both shards kept: the index may have landed


@pytest.mark.parametrize(
    "change",
    [{"attempt": "../../elsewhere"}, {"attempt": "0" * 31 + "/"}, {"step": 8}],
    ids=["attempt-path", "attempt-slash", "other-step"],
)
def test_a_hostile_index_is_refused_naming_it(s3_server, s3_url, change):
    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=1, world=1))
    at = targets.object_location(f"{s3_url}/step_00000001/{INDEX_NAME}", options)
    object_store.put(at, json.dumps({**json.loads(bytes(object_store.get(at))), **change}).encode())
    with pytest.raises(CheckpointFormatError) as caught:
        load_sharded(s3_url, comm=SingleProcess(), storage_options=options)
    assert at.url in str(caught.value)


def test_remove_leftovers_deletes_what_no_index_names(s3_server, s3_url, monkeypatch):
    """A commit that failed (its shards kept: the index may have landed) and a step never
    committed leave objects; remove_leftovers deletes them and keeps every committed step, a
    manager's step and a step whose index is damaged."""
    from ortckpt import CheckpointManager
    from ortckpt.distributed import remove_leftovers

    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=1, world=2))
    committed = keys(s3_url, options)

    def unreachable(location, data):
        raise ortckpt.ObjectStoreError(location.url, "connection reset")

    monkeypatch.setattr(object_store, "put_new", unreachable)
    save_model(s3_url, options, step=2, world=2)  # fails at the commit: its 2 shards stay
    monkeypatch.undo()
    raise_any(save_model(s3_url, options, step=3, world=2))
    damaged = targets.object_location(f"{s3_url}/step_00000003/{INDEX_NAME}", options)
    object_store.put(damaged, b"{")
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays({"m": np.ones(2, np.float32)}), 4)
    kept = [k for k in keys(s3_url, options) if not k.startswith("step_00000002/")]
    assert len(keys(s3_url, options)) == len(kept) + 2
    removed = remove_leftovers(s3_url, storage_options=options)
    assert len(removed) == 2 and all(url.startswith(f"{s3_url}/step_00000002/") for url in removed)
    assert keys(s3_url, options) == kept and set(committed) <= set(kept)
    assert on_ranks(2, lambda c: check_part(*load_sharded(s3_url, step=1, comm=c, storage_options=options), 1, 2)) == [
        [],
        [],
    ]
    with pytest.raises(FileNotFoundError):  # a directory is swept under its writer lock: it must exist
        remove_leftovers("local/directory")


def test_a_manager_drives_sharded_saves_on_object_storage(s3_server, s3_url):
    """CheckpointManager(s3://..., comm=): every rank uploads its shard into the step's attempt
    folder; rank 0 adds the index, commits metadata.json (every object's SHA-256) and applies
    retention; a job of another world size resumes; one process loads and verifies a step whole."""
    from ortckpt import CheckpointIntegrityError, CheckpointManager

    options = s3_server.storage_options()

    def work(comm):
        with CheckpointManager(s3_url, storage_options=options, comm=comm, max_to_keep=2) as manager:
            for step in (10, 20, 30):
                state, slices = rank_state(step, comm.rank, 2)
                manager.save(state, step, metrics={"loss": 1.0 / step}, slices=slices)
            return manager.all_steps(), manager.run_id, check_part(*manager.restore_sharded(), 30, 2)

    results = raise_any(on_ranks(2, work))
    assert [r[0] for r in results] == [[20, 30]] * 2 and results[0][1] == results[1][1]
    assert [r[2] for r in results] == [[], []]
    assert sorted({k.split("/")[0] for k in keys(s3_url, options)}) == ["step_00000020", "step_00000030"]

    def resume(comm):  # four ranks now: each gets its part, resharded
        with CheckpointManager(s3_url, storage_options=options, comm=comm) as manager:
            return manager.latest_step(), check_part(*manager.restore_sharded(), 30, 2)

    assert raise_any(on_ranks(4, resume)) == [(30, [])] * 4
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    latest = reader.latest()
    assert latest.sharded and latest.metrics == {"loss": 1.0 / 30}
    whole = latest.load()
    assert np.array_equal(whole.parameters["embedding"].data, whole_tensors(30, 2)["embedding"])
    verified = reader.verify()
    assert set(verified.files) == {INDEX_NAME, shard_file_name(0, 2), shard_file_name(1, 2)}
    shard = targets.object_location(f"{latest.folder}/{shard_file_name(1, 2)}", options)
    damaged = bytearray(bytes(object_store.get(shard)))
    damaged[-100] ^= 1
    object_store.put(shard, bytes(damaged))
    with pytest.raises(CheckpointIntegrityError, match="SHA-256"):
        reader.verify()


def test_a_shard_object_larger_than_its_index_records_is_refused_unread(s3_server, s3_url, monkeypatch):
    """A shard object replaced by a larger one: a load refuses it by the size index.json records,
    before its body is read (no download is larger than its step records)."""
    from s3_server import streamed_bytes

    options = s3_server.storage_options()
    raise_any(save_model(s3_url, options, step=3, world=2))
    index = json.loads(
        bytes(object_store.get(targets.object_location(f"{s3_url}/step_00000003/{INDEX_NAME}", options)))
    )
    shard = f"{s3_url}/step_00000003/{index['attempt']}/{shard_file_name(0, 2)}"
    large = 16 << 20
    object_store.put(targets.object_location(shard, options), bytes(large))
    streamed = streamed_bytes(monkeypatch)
    with pytest.raises(ortckpt.CheckpointIntegrityError, match=f"{shard}: {large} bytes"):
        load_sharded(s3_url, storage_options=options)
    assert streamed[0] < large
