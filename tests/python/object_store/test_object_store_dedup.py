"""Steps of a mostly frozen model on s3:// share their unchanged values (ortckpt.stepstore.shared):
a step uploads only what changed, its checkpoint object reading the rest from a data object of the
run's shared folder that an earlier step uploaded; every step restores, verifies and loads in ONNX
Runtime on its own, a shared object goes only when no kept step names it, and a save killed between
its data object and its commit leaves no step and garbage that the sweep collects. Against a real
S3 server (SeaweedFS)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from ortckpt import (
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    documents,
    resolve,
    targets,
)
from ortckpt.stepstore import shared
from restoring_readers import restoring_readers

SMALL = 1 << 20  # the share threshold the tests set (shared.SHARE_MIN_BYTES), so that models stay small
TRAINABLE = 16 << 10


def frozen_part(version: int, nbytes: int = 4 * SMALL) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {f"layer{i}": rng.standard_normal(nbytes // 4 // 8, dtype=np.float32) for i in range(8)}


def model(step: int, frozen: dict[str, np.ndarray]) -> CheckpointState:
    """The frozen part given, and a trainable part that changes at every step."""
    return CheckpointState.from_arrays({"head": np.full(TRAINABLE // 4, float(step), np.float32)}, frozen)


def assert_is(state: CheckpointState, step: int, frozen: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(state.parameters["head"].data, np.full(TRAINABLE // 4, float(step), np.float32))
    for name, value in frozen.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)


def shared_keys(url: str, options: dict) -> list[str]:
    listed = object_store.list_keys(targets.object_location(url, options))
    return sorted(key for key, _ in listed if key.startswith("shared/"))


@pytest.fixture
def small_share(monkeypatch):
    monkeypatch.setattr(shared, "SHARE_MIN_BYTES", SMALL)


@pytest.mark.once  # (72 MiB through the server: over 10 s on a loaded machine)
def test_steps_upload_only_what_changed_and_each_restores_alone(s3_server, s3_url):
    """At the default threshold (64 MiB): step 1 uploads the model, each later step its changed
    tensor (and its tables): about 1/70 of step 1 here."""
    options = s3_server.storage_options()
    frozen = frozen_part(7, nbytes=72 << 20)
    uploaded = []
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=3) as manager:
        for step in range(1, 6):
            before = object_store.bytes_put()
            manager.save(model(step, frozen), step)
            uploaded.append(object_store.bytes_put() - before)
        assert manager.all_steps() == [3, 4, 5]
        files = manager.latest().metadata["files"]
    assert uploaded[0] > 72 << 20
    assert all(later < 0.01 * uploaded[0] for later in uploaded[1:]), uploaded
    # One data object, uploaded by step 1 (retired since), named by every kept step.
    assert shared_keys(s3_url, options) == [files["checkpoint.data"]["object"]]
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        for step in reader.all_steps():
            assert_is(reader.restore(step), step, frozen)
            assert set(reader.verify(step).files) == {"checkpoint", "checkpoint.data"}


def test_a_step_loads_in_onnx_runtime_after_its_neighbours_are_deleted(
    s3_server, s3_url, small_share, ort, aws_environment
):
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        for step in range(1, 5):
            manager.save(model(step, frozen), step)
        for step in (1, 2, 4):  # step 1 uploaded the data object: step 3 alone names it now
            manager.delete(step)
        assert manager.all_steps() == [3] and len(shared_keys(s3_url, options)) == 1
        step_url = f"{s3_url}/step_00000003"
        with resolve.checkpoint(step_url) as resolved:  # (a copy: its data is not beside its object)
            assert resolved.copy
            described = ort("describe", resolved.path)
        digests = {p["name"]: p["sha256"] for p in described["parameters"]}
        values = {"head": np.full(TRAINABLE // 4, 3.0, np.float32), **frozen}
        assert digests == {name: hashlib.sha256(value.tobytes()).hexdigest() for name, value in values.items()}
        assert ortckpt.verify(step_url, storage_options=options).step == 3
        # Its checkpoint object alone does not hold its values: ONNX Runtime's load of a file (this class's)
        # says where they were looked for; ortckpt.load_checkpoint knows the object for its step's.
        checkpoint_url = f"{manager.latest().folder}/checkpoint"
        with pytest.raises(FileNotFoundError, match="external data"):
            CheckpointState.load_checkpoint(checkpoint_url, storage_options=options)
        assert_is(ortckpt.load_checkpoint(checkpoint_url, storage_options=options), 3, frozen)
        assert_is(ortckpt.load_checkpoint(step_url, storage_options=options), 3, frozen)
        # The same bytes in another folder of the step (a save that never committed) are no step's checkpoint.
        stray = targets.object_location(f"{step_url}/{'0' * 32}/checkpoint", options)
        object_store.put(stray, bytes(object_store.get(targets.object_location(checkpoint_url, options))))
        with pytest.raises(FileNotFoundError, match="external data"):
            ortckpt.load_checkpoint(stray.url, storage_options=options)
        manager.delete(3)  # the last step that names it: the data object goes with it
        assert shared_keys(s3_url, options) == []


def test_a_shared_object_goes_when_no_kept_step_names_it(s3_server, s3_url, small_share):
    """Steps 1-2 share step 1's object; step 3 changes the frozen part (saved whole, a new object),
    step 4 shares that one. Keeping two steps, step 1's object goes once steps 1 and 2 are retired."""
    options = s3_server.storage_options()
    old, new = frozen_part(1), frozen_part(2)
    uploaded = []
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=2) as manager:
        for step, frozen in ((1, old), (2, old), (3, new), (4, new)):
            before = object_store.bytes_put()
            manager.save(model(step, frozen), step)
            uploaded.append(object_store.bytes_put() - before)
            objects_now = [entry.get("object") for entry in manager.latest().metadata["files"].values()]
        assert uploaded[2] > 4 * SMALL > 10 * uploaded[3] and 10 * uploaded[1] < 4 * SMALL, uploaded
        assert manager.all_steps() == [3, 4]
        assert shared_keys(s3_url, options) == [key for key in objects_now if key]
        assert_is(manager.restore(3), 3, new)
        assert_is(manager.restore(4), 4, new)


def test_a_changed_or_swapped_shared_object_is_refused(s3_server, s3_url, small_share):
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen), 1)
        manager.save(model(2, frozen), 2)
        key = manager.latest().metadata["files"]["checkpoint.data"]["object"]
        where = targets.object_location(f"{s3_url}/{key}", options)
        data = bytearray(object_store.get(where))
        data[100] ^= 1  # (the same size: caught by its SHA-256, and by the checksums on load)
        object_store.put(where, bytes(data))
        for step in (1, 2):
            with pytest.raises(CheckpointIntegrityError, match=key):
                manager.restore(step)
            with pytest.raises(CheckpointIntegrityError, match=key):
                manager.verify(step)


@pytest.mark.parametrize("named", ["../step_00000001/x.data", "shared/../../other/run.data", "shared/abc.data", 7])
def test_a_metadata_entry_naming_an_object_outside_the_shared_folder_is_refused(named):
    document = {
        "step": 1,
        "format": "ortckpt-metadata/1",
        "files": {"checkpoint.data": {"bytes": 10, "sha256": "0" * 64, "object": named}},
    }
    with pytest.raises(documents.DocumentError, match="object"):
        documents.parse(documents.METADATA, json.dumps(document).encode(), "metadata.json")


KILLED_BEFORE_COMMIT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    from ortckpt import CheckpointManager, CheckpointState
    from ortckpt.stepstore import objects, shared

    shared.SHARE_MIN_BYTES = 1 << 20
    url, options = sys.argv[1], json.loads(sys.argv[2])

    def frozen(version):
        rng = np.random.default_rng(version)
        return {f"layer{i}": rng.standard_normal((4 << 20) // 4 // 8, dtype=np.float32) for i in range(8)}

    def model(step, frozen):
        return CheckpointState.from_arrays({"head": np.full(4096, float(step), np.float32)}, frozen)

    def killed(self, attempt, document, data, *, durable):
        os.kill(os.getpid(), signal.SIGKILL)  # its data object and checkpoint uploaded, nothing committed

    manager = CheckpointManager(url, storage_options=options)
    manager.save(model(1, frozen(1)), 1)
    objects.ObjectStore.commit = killed
    manager.save(model(2, frozen(2)), 2)  # (the frozen part changed: a new data object)
    """
)


def test_a_save_killed_before_its_commit_leaves_no_step_and_garbage_the_sweep_collects(s3_server, s3_url, small_share):
    options = s3_server.storage_options()
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_COMMIT, s3_url, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == -9, child.stderr[-2000:]
    assert len(shared_keys(s3_url, options)) == 2  # step 1's, and the killed save's
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        assert reader.all_steps() == [1]
        assert_is(reader.restore(), 1, frozen_part(1))
    with CheckpointManager(s3_url, storage_options=options) as writer:
        kept = writer.latest().metadata["files"]["checkpoint.data"]["object"]
        removed = writer.remove_leftovers()
        assert any(url.endswith(".data") and "/shared/" in url for url in removed), removed
        assert shared_keys(s3_url, options) == [kept]
        assert_is(writer.restore(), 1, frozen_part(1))
        writer.verify()


def test_readers_restore_whole_steps_while_retention_collects_shared_objects(s3_server, s3_url, small_share):
    """A writer keeping one step changes its frozen part every third step (so shared objects are
    uploaded and collected) while readers restore the latest step as fast as they can: every
    restore is one step's values, whole (never a missing object, never a mix of two steps)."""
    options = s3_server.storage_options()
    versions = {version: frozen_part(version, nbytes=2 * SMALL) for version in range(4)}
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=1) as writer:
        writer.save(model(0, versions[0]), 0)

        def check(state: Any) -> int:
            step = int(state.parameters["head"].data[0])
            assert_is(state, step, versions[step // 3])
            return step

        with restoring_readers(s3_url, options, check, count=2) as (seen, failures):
            for step in range(1, 12):
                writer.save(model(step, versions[step // 3]), step)
        assert failures == [], failures[:3]
        assert len(seen) > 5 and len(set(seen)) > 2, seen
        assert shared_keys(s3_url, options) == [writer.latest().metadata["files"]["checkpoint.data"]["object"]]


def test_a_resumed_writer_uploads_its_first_step_whole_then_shares(s3_server, s3_url, small_share):
    """The digests a step shares by are this writer's, taken as its values went up: a writer
    resumed in a new process uploads its first step whole (a new data object), then shares."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen), 1)
    uploaded = []
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=2) as resumed:
        for step in (2, 3):
            before = object_store.bytes_put()
            resumed.save(model(step, frozen), step)
            uploaded.append(object_store.bytes_put() - before)
        assert resumed.all_steps() == [2, 3]
    assert uploaded[0] > 4 * SMALL > 10 * uploaded[1], uploaded
    assert len(shared_keys(s3_url, options)) == 1  # step 1's went with it


def uploaded_by(save) -> int:
    before = object_store.bytes_put()
    save()
    return object_store.bytes_put() - before


def data_object(manager: CheckpointManager, step: int | None = None) -> str:
    info = manager.latest() if step is None else next(info for info in manager.all() if info.step == step)
    assert info is not None
    return info.metadata["files"]["checkpoint.data"]["object"]


def test_a_resumed_writer_that_restores_shares_from_its_first_step(
    s3_server, s3_url, small_share, ort, aws_environment
):
    """A new writer (a new manager: no digests of its own) restores the latest step, changes its
    trainable part and saves: the step uploads only that change, sharing the data object the
    restored step names, hashed from the bytes the restore downloaded; so does the next. The
    step restores bit-identically and loads in ONNX Runtime alone, its neighbours deleted."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        whole = uploaded_by(lambda: first.save(model(1, frozen), 1))
        first.save(model(2, frozen), 2)  # (shares step 1's object: restored, it is the one hashed)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        state = resumed.restore()
        assert_is(state, 2, frozen)
        state.parameters["head"] = np.full(TRAINABLE // 4, 3.0, np.float32)  # (a training step's change)
        uploaded = [uploaded_by(lambda: resumed.save(state, 3))]
        uploaded.append(uploaded_by(lambda: resumed.save(model(4, frozen), 4)))
        assert whole > 4 * SMALL and all(10 * later < 4 * SMALL for later in uploaded), (whole, uploaded)
        assert data_object(resumed, 3) == data_object(resumed, 4) == data_object(resumed, 2)
        assert_is(resumed.restore(3), 3, frozen)
        for step in (1, 2, 4):
            resumed.delete(step)
        assert resumed.all_steps() == [3] and len(shared_keys(s3_url, options)) == 1
        assert_is(resumed.restore(3), 3, frozen)
        with resolve.checkpoint(f"{s3_url}/step_00000003") as resolved:
            described = ort("describe", resolved.path)
    values = {"head": np.full(TRAINABLE // 4, 3.0, np.float32), **frozen}
    digests = {p["name"]: p["sha256"] for p in described["parameters"]}
    assert digests == {name: hashlib.sha256(value.tobytes()).hexdigest() for name, value in values.items()}


def test_a_data_object_replaced_after_the_restore_is_not_shared_from(s3_server, s3_url, small_share):
    """The restored step's data object is replaced, by one of the same size, between the restore
    and the save: the ETag it had when hashed differs, so the step goes up whole (a new data
    object), and restores as saved (shared by the size alone, it would read the planted bytes)."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        resumed.restore()
        key = data_object(resumed)
        where = targets.object_location(f"{s3_url}/{key}", options)
        data = bytearray(object_store.get(where))
        data[100] ^= 1  # (inside layer0's values: a value the restore hashed)
        object_store.put(where, bytes(data))
        uploaded = uploaded_by(lambda: resumed.save(model(2, frozen), 2))
        assert uploaded > 4 * SMALL and data_object(resumed, 2) != key, uploaded
        assert_is(resumed.restore(2), 2, frozen)
        resumed.verify(2)


def test_two_resumed_writers_of_one_step_leave_the_shared_object_to_the_winner(
    s3_server, s3_url, small_share, monkeypatch
):
    """Two writers resume from the same step and save the next one, both sharing its data object,
    the winner committing while the loser's save is about to: the loser's fails
    (CheckpointExistsError) and its cleanup removes its own attempt only, never the object the
    winner's step reads its values from."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
    with (
        CheckpointManager(s3_url, storage_options=options) as winner,
        CheckpointManager(s3_url, storage_options=options) as loser,
    ):
        winner.restore()
        loser.restore()
        commit, uploaded = loser.store.commit, []

        def winner_first(*args, **kwargs):
            uploaded.append(uploaded_by(lambda: winner.save(model(2, frozen), 2)))
            return commit(*args, **kwargs)

        monkeypatch.setattr(loser.store, "commit", winner_first)
        with pytest.raises(CheckpointExistsError):
            before = object_store.bytes_put()
            loser.save(model(2, frozen), 2)
        uploaded.append(object_store.bytes_put() - before - uploaded[0])
        assert all(10 * size < 4 * SMALL for size in uploaded), uploaded  # (both shared)
        assert shared_keys(s3_url, options) == [data_object(winner, 1)] == [data_object(winner, 2)]
        assert_is(winner.restore(2), 2, frozen)
        winner.verify(2)


@pytest.mark.parametrize("case", ["an older step", "another writer's step since", "a reader's restore"])
def test_a_resumed_writer_shares_only_after_restoring_the_previous_step(
    s3_server, s3_url, small_share, monkeypatch, case
):
    """Its first step shares only when the step it restored is the one it follows: an older step
    restored (even one naming the same object), or a step another writer committed since the
    restore, and it goes up whole, as without a restore; a reader's restore hashes nothing."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
        first.save(model(2, frozen), 2)  # (names step 1's object too)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        if case == "an older step":
            assert_is(resumed.restore(1), 1, frozen)
        elif case == "another writer's step since":
            resumed.restore()
            with CheckpointManager(s3_url, storage_options=options) as other:
                other.save(model(3, frozen), 3)
            resumed.reload()
        else:
            with (
                CheckpointManager(s3_url, storage_options=options, read_only=True) as reader,
                monkeypatch.context() as patched,
            ):
                patched.setattr(shared.SharedObjects, "restored", lambda *_: pytest.fail("a reader hashed"))
                assert_is(reader.restore(), 2, frozen)
        step = resumed.latest().step + 1
        assert uploaded_by(lambda: resumed.save(model(step, frozen), step)) > 4 * SMALL
        assert 10 * uploaded_by(lambda: resumed.save(model(step + 1, frozen), step + 1)) < 4 * SMALL
        assert_is(resumed.restore(step), step, frozen)


def test_small_checkpoints_and_shards_stay_whole_in_their_step(s3_server, s3_url, monkeypatch):
    """Under SHARE_MIN_BYTES a manager's checkpoint is one object, as before; a sharded save's
    shards (with or without a manager) never share: each stays whole in its step's folder."""
    from ortckpt.distributed import SingleProcess, load_sharded, save_sharded

    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen_part(1)), 1)  # 4 MiB: under SHARE_MIN_BYTES
        assert sorted(manager.latest().metadata["files"]) == ["checkpoint"]
    monkeypatch.setattr(shared, "SHARE_MIN_BYTES", SMALL)
    for step in (7, 8):
        save_sharded(model(step, frozen_part(1)), s3_url, step=step, comm=SingleProcess(), storage_options=options)
        assert_is(load_sharded(s3_url, step=step, storage_options=options)[0], step, frozen_part(1))
    assert shared_keys(s3_url, options) == []


@pytest.mark.parametrize("async_save", [False, True])
def test_every_kind_of_value_shares_by_its_bytes(s3_server, s3_url, small_share, async_save):
    """bfloat16, float8, integers, a string tensor, equal values in two tensors and one buffer
    handed over as two tensors: each comes back as it was saved, from the shared object or inline
    (no two tensors reading the same bytes, which a load refuses), in saves and async saves."""
    import ml_dtypes

    options = s3_server.storage_options()
    rng = np.random.default_rng(3)
    frozen = {
        "bf16": rng.standard_normal(1 << 20).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal(1 << 19).astype(ml_dtypes.float8_e4m3fn),
        "ints": np.arange(1 << 16, dtype=np.int64),
        "same_as_ints": np.arange(1 << 16, dtype=np.int64),
        "names": np.array(["a", "bc", "def"], dtype=object),
    }
    frozen["tied"] = frozen["tied_too"] = rng.standard_normal(1 << 16).astype(np.float32)  # (one buffer, two tensors)
    uploaded = []
    with CheckpointManager(s3_url, storage_options=options, async_save=async_save) as manager:
        for step in range(1, 4):
            before = object_store.bytes_put()
            manager.save(model(step, frozen), step)
            manager.wait()
            uploaded.append(object_store.bytes_put() - before)
        for step in (1, 2, 3):
            restored = manager.restore(step)
            assert_is(restored, step, {k: v for k, v in frozen.items() if k != "names"})
            assert list(restored.parameters["names"].data) == ["a", "bc", "def"]
    assert 5 * uploaded[1] < uploaded[0] and 5 * uploaded[2] < uploaded[0], uploaded  # (the tied pair: inline)


def test_a_shared_object_swept_away_before_the_commit_withdraws_the_step(s3_server, s3_url, small_share, monkeypatch):
    """Another job's sweep removes the data object a save shares just before its commit: the save
    fails (its step is never shown naming a missing object), and the next save, finding the object
    gone, uploads whole again."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen), 1)
        key = manager.latest().metadata["files"]["checkpoint.data"]["object"]
        real_put_new = object_store.put_new

        def swept_then_put(location, data):
            object_store.remove([targets.object_location(f"{s3_url}/{key}", options)])
            return real_put_new(location, data)

        monkeypatch.setattr(object_store, "put_new", swept_then_put)
        with pytest.raises(CheckpointIntegrityError, match="shared data object is gone"):
            manager.save(model(2, frozen), 2)
        monkeypatch.undo()
        with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
            assert reader.all_steps() == [1]
        before = object_store.bytes_put()
        manager.save(model(3, frozen), 3)
        assert object_store.bytes_put() - before > 4 * SMALL  # (whole: a new data object)
        assert_is(manager.restore(3), 3, frozen)


def test_a_save_failing_before_its_commit_leaves_none_of_its_objects(s3_server, s3_url, small_share, monkeypatch):
    """A save whose data object and checkpoint went up fails before its commit (its graph cannot
    be stored): its abandon removes its attempt and its own new data object (an object, not a
    folder), and the previous step still restores and verifies."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen_part(1)), 1)
        before = sorted(key for key, _ in object_store.list_keys(targets.object_location(s3_url, options)))
        uploaded: list[str] = []

        def failing(attempt, *args, **kwargs):
            uploaded.extend(entry["object"] for entry in attempt.shared.values())
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(manager.store, "commit", failing)
        with pytest.raises(OSError, match="No space left"):
            manager.save(model(2, frozen_part(2)), 2)  # (the frozen part changed: a new data object)
        monkeypatch.undo()
        assert len(uploaded) == 1 and uploaded[0] not in before
        assert sorted(key for key, _ in object_store.list_keys(targets.object_location(s3_url, options))) == before
        assert_is(manager.restore(), 1, frozen_part(1))
        manager.verify(1)


def test_a_failed_save_never_removes_a_data_object_a_committed_step_names(s3_server, s3_url, small_share, monkeypatch):
    """A document committed meanwhile names the failed save's new data object (another writer's
    copy of its entry, or a hostile one): the failed save's abandon leaves that object, which the
    committed step reads; only when no step names it does it go (the sweep)."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(model(1, frozen_part(1)), 1)
        first = manager.latest().metadata

        def naming_then_failing(attempt, *args, **kwargs):
            other = {**first, "step": 7, "files": {**first["files"], **attempt.shared}}
            object_store.put(
                targets.object_location(f"{s3_url}/step_00000007/metadata.json", options), json.dumps(other).encode()
            )
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(manager.store, "commit", naming_then_failing)
        with pytest.raises(OSError, match="No space left"):
            manager.save(model(2, frozen_part(2)), 2)
        monkeypatch.undo()
        named = json.loads(
            bytes(object_store.get(targets.object_location(f"{s3_url}/step_00000007/metadata.json", options)))
        )["files"]["checkpoint.data"]["object"]
        assert named in shared_keys(s3_url, options)  # kept: step 7 names it
        object_store.remove([targets.object_location(f"{s3_url}/step_00000007/metadata.json", options)])
        removed = manager.remove_leftovers()
        assert any(url.endswith(named) for url in removed), removed
        assert shared_keys(s3_url, options) == [first["files"]["checkpoint.data"]["object"]]
        assert_is(manager.restore(1), 1, frozen_part(1))
