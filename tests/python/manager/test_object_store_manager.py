"""CheckpointManager on an s3:// prefix (ortckpt.stepstore.objects), what only that backend has,
against a real S3 server (SeaweedFS, see s3_server.py): the conditional commit and racing writers,
uploads that fail, kills and server faults that must leave the previous step the latest, ETags,
downloads bounded by metadata, s3:// URLs in verify and inspect. What every backend does alike
(periodic saves, retention, resume, verify, async saves, best) is in test_conformance.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from ortckpt import CheckpointExistsError, CheckpointIntegrityError, CheckpointManager, CheckpointState, targets
from s3_server import kill_mid_upload, lose_the_answers_of_conditional_puts, streamed_bytes


def arrays(seed: int, nbytes: int = 1 << 20, count: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(nbytes // count // 4 + i, dtype=np.float32) for i in range(count)}


def keys(url: str, options: dict) -> list[str]:
    return sorted(k for k, _ in object_store.list_keys(targets.object_location(url, options)))


def fetch(url: str, options: dict) -> bytes:
    return bytes(object_store.get(targets.object_location(url, options)))


def assert_holds(state: CheckpointState, values: dict[str, np.ndarray]) -> None:
    assert sorted(name for name, _ in state.parameters) == sorted(values)
    for name, value in values.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)


def test_external_data_and_onnx_runtime_loads_a_step(s3_server, s3_url, tmp_path, ort):
    options = s3_server.storage_options()
    values = arrays(3, nbytes=4 << 20)
    with CheckpointManager(s3_url, storage_options=options, external_data_threshold=0) as manager:
        manager.save(CheckpointState.from_arrays(values), 10)
        info = manager.latest()
        assert sorted(info.metadata["files"]) == ["checkpoint", "checkpoint.data"]
        assert_holds(manager.restore(), values)
        assert set(manager.verify().files) == {"checkpoint", "checkpoint.data"}
    for name in ("checkpoint", "checkpoint.data"):
        (tmp_path / name).write_bytes(fetch(f"{info.folder}/{name}", options))
    described = ort("describe", tmp_path / "checkpoint")
    digests = {p["name"]: p["sha256"] for p in described["parameters"]}
    assert digests == {name: hashlib.sha256(value.tobytes()).hexdigest() for name, value in values.items()}


def test_two_writers_of_one_step_one_commits(s3_server, s3_url):
    """The commit is a conditional PUT: the second writer of a step gets CheckpointExistsError,
    its objects are removed, and the step holds the first writer's state."""
    options = s3_server.storage_options()
    first, second = (
        CheckpointManager(s3_url, storage_options=options),
        CheckpointManager(s3_url, storage_options=options),
    )
    first.save(CheckpointState.from_arrays(arrays(1)), 5)
    with pytest.raises(CheckpointExistsError, match="another writer committed step 5"):
        second.save(CheckpointState.from_arrays(arrays(2)), 5)
    listed = keys(s3_url, options)
    assert len(listed) == 2 and "step_00000005/metadata.json" in listed  # the loser's upload is gone
    assert_holds(CheckpointManager(s3_url, storage_options=options, read_only=True).restore(5), arrays(1))


def test_writers_racing_for_a_step_commit_once(s3_server, s3_url):
    options = s3_server.storage_options()
    managers = [CheckpointManager(s3_url, storage_options=options) for _ in range(4)]
    outcomes = [None] * 4
    start = threading.Barrier(4)

    def save(i):
        start.wait()
        try:
            managers[i].save(CheckpointState.from_arrays(arrays(i)), 7)
            outcomes[i] = "committed"
        except CheckpointExistsError:
            outcomes[i] = "lost"

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["committed", "lost", "lost", "lost"]
    winner = outcomes.index("committed")
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    assert_holds(reader.restore(7), arrays(winner))
    reader.verify(7)


def test_a_commit_whose_answer_was_lost_is_recognised_as_this_saves(s3_server, s3_url, monkeypatch):
    """A retried conditional PUT that finds the object its first try created is not a lost race."""
    options = s3_server.storage_options()
    lose_the_answers_of_conditional_puts(monkeypatch)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        assert manager.all_steps() == [1]
        manager.verify(1)


def test_a_failed_commit_keeps_its_objects_for_remove_leftovers(s3_server, s3_url, monkeypatch):
    """An error from the commit does not prove it failed: the uploaded objects stay (deleting them
    could break a step that did commit), the step is not listed, and remove_leftovers removes
    them once you know no writer is saving."""
    options = s3_server.storage_options()
    manager = CheckpointManager(s3_url, storage_options=options)
    manager.save(CheckpointState.from_arrays(arrays(1)), 1)
    committed = keys(s3_url, options)

    def unreachable(location, data):
        raise ortckpt.ObjectStoreError(location.url, "connection reset")

    monkeypatch.setattr(object_store, "put_new", unreachable)
    with pytest.raises(ortckpt.ObjectStoreError):
        manager.save(CheckpointState.from_arrays(arrays(2)), 2)
    monkeypatch.undo()
    left = [k for k in keys(s3_url, options) if k not in committed]
    assert len(left) == 1 and left[0].startswith("step_00000002/") and left[0].endswith("/checkpoint")
    assert CheckpointManager(s3_url, storage_options=options, read_only=True).all_steps() == [1]
    assert manager.remove_leftovers() == [f"{s3_url}/{left[0]}"]
    assert keys(s3_url, options) == committed
    manager.save(CheckpointState.from_arrays(arrays(2)), 2)  # the step can be saved again
    assert manager.all_steps() == [1, 2]


def test_a_failed_upload_leaves_nothing(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, external_data_threshold=0) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        committed = keys(s3_url, options)
        put_stream = object_store.put_stream

        def fails_on_the_second(location, pieces, digest=None, on_bytes=None):
            if location.key.endswith("/checkpoint"):  # the data file went up first
                raise ortckpt.ObjectStoreError(location.url, "disk full")
            return put_stream(location, pieces, digest, on_bytes)

        monkeypatch.setattr(object_store, "put_stream", fails_on_the_second)
        with pytest.raises(ortckpt.ObjectStoreError, match="disk full"):
            manager.save(CheckpointState.from_arrays(arrays(2)), 2)
        assert keys(s3_url, options) == committed  # the uploaded data file was removed
        assert manager.all_steps() == [1]


KILLED_MANAGER = textwrap.dedent(
    """
    import sys, numpy as np, ortckpt
    url, endpoint, key, secret, mode = sys.argv[1:6]
    options = {"endpoint_url": endpoint, "access_key_id": key, "secret_access_key": secret}
    manager = ortckpt.CheckpointManager(url, storage_options=options, max_to_keep=1,
                                        async_save=mode == "async", external_data_threshold=0)
    values = {f"w{i}": np.full(8 << 20, i + 2, np.float32) for i in range(8)}  # 256 MiB
    print("saving", flush=True)
    manager.save(ortckpt.CheckpointState.from_arrays(values), 2)
    manager.wait()
    print("saved", flush=True)
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_process_killed_mid_save_leaves_the_previous_step_the_latest(s3_server, s3_url, tmp_path, mode):
    options = s3_server.storage_options()
    first = arrays(1)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays(first), 1)
    committed = keys(s3_url, options)
    script = tmp_path / "saver.py"
    script.write_text(KILLED_MANAGER)
    before = set(s3_server.pending_uploads())
    command = [
        sys.executable,
        str(script),
        s3_url,
        s3_server.url,
        options["access_key_id"],
        options["secret_access_key"],
    ]
    child = subprocess.Popen([*command, mode], stdout=subprocess.PIPE, text=True)
    kill_mid_upload(s3_server, child, before)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        assert manager.latest_step() == 1
        manager.verify()
        assert_holds(manager.restore(), first)
        manager.remove_leftovers()
        assert keys(s3_url, options) == committed
        manager.save(CheckpointState.from_arrays(arrays(2)), 2)  # and the run goes on
        assert manager.all_steps() == [1, 2]


def test_verify_after_save_commits_only_what_reads_back(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, verify_after_save=True) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        download_to = object_store.download_to

        def misread(location, fd, **options):  # the bytes read back are not what was hashed going up
            return download_to(location, fd, **{**options, "digest": hashlib.sha256(b"something else")})

        monkeypatch.setattr(object_store, "download_to", misread)
        with pytest.raises(CheckpointIntegrityError):
            manager.save(CheckpointState.from_arrays(arrays(2)), 2)
        assert manager.all_steps() == [1]
    monkeypatch.undo()
    assert [k.split("/")[0] for k in keys(s3_url, options)] == ["step_00000001"] * 2  # step 2's upload removed


@pytest.mark.parametrize(
    "document",
    [
        {"attempt": "../../elsewhere"},  # a path out of the step's folder
        {"files": {"../checkpoint": {"bytes": 1, "sha256": "0" * 64}}},
        {"step": 8},  # says another step
        "not json at all",
    ],
    ids=["attempt-path", "file-path", "other-step", "garbage"],
)
def test_a_hostile_metadata_document_is_skipped_and_kept(s3_server, s3_url, document):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        meta = manager.latest().metadata
    if isinstance(document, dict):
        planted = json.dumps({**json.loads(fetch(f"{s3_url}/step_00000001/metadata.json", options)), **document})
    else:
        planted = document
    object_store.put(targets.object_location(f"{s3_url}/step_00000009/metadata.json", options), planted.encode())
    with pytest.warns(RuntimeWarning, match="step_00000009"):
        manager = CheckpointManager(s3_url, storage_options=options)
    assert manager.all_steps() == [1] and manager.latest().metadata["attempt"] == meta["attempt"]
    with pytest.warns(RuntimeWarning, match="step_00000009"):
        assert manager.remove_leftovers() == []  # a damaged step is kept whole, for a person to look at
    assert "step_00000009/metadata.json" in keys(s3_url, options)


def test_options_it_does_not_have_are_refused(s3_server, s3_url, tmp_path):
    options = s3_server.storage_options()
    for refused in ({"compress_kept": True}, {"track": "mlflow"}, {"verify_after_save": "process"}):
        with pytest.raises(ValueError, match="not available for a manager on object storage"):
            CheckpointManager(s3_url, storage_options=options, **refused)
    with pytest.raises(TypeError, match="unexpected keyword"):
        CheckpointManager(s3_url, storage_options=options, no_such_option=1)
    with pytest.raises(ValueError, match="storage_options are for an object store URL"):
        CheckpointManager(tmp_path / "local", storage_options=options)
    with pytest.raises(ValueError, match=r"'\.\.' segments"):
        CheckpointManager("s3://ckpt/a/../b", storage_options=options)


def test_verify_and_inspect_take_object_urls(s3_server, s3_url, monkeypatch, capsys, aws_environment):
    """ortckpt.verify and the CLI's verify and inspect take s3:// URLs (a manager's step folder,
    or a checkpoint object), configured by the AWS_* variables as boto3 is."""
    from ortckpt.cli import run

    options = s3_server.storage_options()
    with CheckpointManager(s3_url, external_data_threshold=0) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 3)
        info = manager.latest()
    step_url = f"{s3_url}/step_00000003"
    checked = ortckpt.verify(step_url)
    assert (checked.step, checked.tensors, sorted(checked.files)) == (3, 4, ["checkpoint", "checkpoint.data"])
    assert ortckpt.verify(info.path).tensors == 4  # the checkpoint object alone: decoded in full
    assert run(["verify", "--json", step_url]) == 0
    assert json.loads(capsys.readouterr().out)["sha256"] == checked.files
    assert run(["inspect", "--json", info.path]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["external_data"] and sorted(described["files"]) == [info.path, info.path + ".data"]
    assert [t["name"] for t in described["tensors"]] == ["w0", "w1", "w2", "w3"]
    data = targets.object_location(info.path + ".data", options)
    whole = bytearray(fetch(data.url, options))
    whole[0] ^= 1
    object_store.put(data, bytes(whole))
    assert run(["verify", step_url]) == 1
    assert f"{data.url}: SHA-256" in capsys.readouterr().err
    assert run(["verify", f"{s3_url}/step_00000004"]) == 3  # nothing there: an input that cannot be read
    assert "no such object" in capsys.readouterr().err


@pytest.mark.parametrize("read_only", [True, False])
def test_a_reader_whose_step_is_deleted_mid_load_restores_the_new_latest(s3_server, s3_url, monkeypatch, read_only):
    """Retention deletes the step a reader is loading between its requests (after the checkpoint's
    GET, before its data object's HEAD): the reader looks again and restores the new latest. Also
    a manager made without read_only=True (``CheckpointManager(url).restore()``): no lock keeps
    other writers from an object store prefix (the original code raised FileNotFoundError)."""
    options = s3_server.storage_options()
    writer = CheckpointManager(s3_url, storage_options=options, max_to_keep=1, external_data_threshold=0)
    writer.save(CheckpointState.from_arrays(arrays(1)), 1)
    reader = CheckpointManager(s3_url, storage_options=options, read_only=read_only)
    head = object_store.head
    raced = []

    def head_after_retention(location):
        if location.key.endswith(".data") and not raced:
            raced.append(True)
            writer.save(CheckpointState.from_arrays(arrays(2)), 2)  # step 1 deleted
        return head(location)

    monkeypatch.setattr(object_store, "head", head_after_retention)
    assert_holds(reader.restore(), arrays(2))
    assert raced and reader.all_steps() == [2]


def test_remove_leftovers_keeps_a_sharded_step_under_the_prefix(s3_server, s3_url):
    """A save_sharded step has no metadata.json, only its index: not the manager's to delete."""
    from ortckpt.distributed import SingleProcess, save_sharded

    options = s3_server.storage_options()
    save_sharded(CheckpointState.from_arrays(arrays(1)), s3_url, step=7, comm=SingleProcess(), storage_options=options)
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays(arrays(2)), 8)
        before = keys(s3_url, options)
        assert manager.remove_leftovers() == [] and keys(s3_url, options) == before
        assert manager.all_steps() == [8]


def test_the_server_stopping_mid_save_leaves_the_previous_step_the_latest(s3_server, s3_url, monkeypatch):
    """The server goes away with a step's upload half done: the save fails (ObjectStoreError),
    its cleanup cannot reach the server either (a warning), and once the server is back the
    previous step is the latest and remove_leftovers tidies up."""
    options = s3_server.storage_options(max_retries=0, retry_timeout=2)
    big = arrays(2, nbytes=40 << 20)  # past two upload parts
    manager = CheckpointManager(s3_url, storage_options=options, external_data_threshold=0)
    manager.save(CheckpointState.from_arrays(arrays(1)), 1)
    committed = keys(s3_url, options)
    real_parts = object_store._parts

    def parts_then_stop(pieces, digest=None, on_bytes=None):
        for i, part in enumerate(real_parts(pieces, digest, on_bytes)):
            if i == 1:
                s3_server.stop()  # with the data object's upload half done
            yield part

    monkeypatch.setattr(object_store, "_parts", parts_then_stop)
    try:
        with (
            pytest.warns(RuntimeWarning, match="could not remove a failed save's objects"),
            pytest.raises(ortckpt.ObjectStoreError),
        ):
            manager.save(CheckpointState.from_arrays(big), 2)
    finally:
        s3_server.start()
    monkeypatch.undo()
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        assert resumed.latest_step() == 1
        resumed.verify()
        resumed.remove_leftovers()
        assert keys(s3_url, options) == committed
        resumed.save(CheckpointState.from_arrays(big), 2)
        assert_holds(resumed.restore(2), big)


def test_restore_and_verify_download_no_more_than_metadata_records(s3_server, s3_url, monkeypatch, capsys):
    """A step object replaced by a larger one (a server may declare any size): restore, verify and
    `ortckpt verify` refuse it by the size metadata.json records, before reading its body."""
    from ortckpt.cli import run

    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        info = manager.latest()
    recorded = info.metadata["files"]["checkpoint"]["bytes"]
    large = 16 << 20
    object_store.put(targets.object_location(info.path, options), bytes(large))
    streamed = streamed_bytes(monkeypatch)
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    with pytest.raises(CheckpointIntegrityError, match=f"{large} bytes, metadata says {recorded}"):
        reader.restore(1)
    with pytest.raises(CheckpointIntegrityError, match=f"{large} bytes"):
        reader.verify(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    assert run(["verify", f"{s3_url}/step_00000001"]) == 1
    assert f"{info.path}: " in capsys.readouterr().err
    assert streamed[0] < large  # (the documents only: no body of the replaced object)


def test_a_restore_whose_data_object_is_gone_names_the_object(s3_server, s3_url):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, external_data_threshold=0) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        data = manager.latest().path + ".data"
        object_store.remove([targets.object_location(data, options)])
        with pytest.raises(FileNotFoundError) as caught:
            manager.restore(1)
    assert caught.value.filename == data and "scratch" not in str(caught.value)


def test_a_commit_that_landed_counts_when_the_check_after_it_fails(s3_server, s3_url, monkeypatch):
    """The commit's PUT landed, but the check after it (that its objects are still there) gets
    server errors: the step counts, with a warning, as committed (the writer lists it, retention
    deletes it in its turn), rather than a save that raised for a step that exists (and a retry
    told another writer committed it)."""
    options = s3_server.storage_options()
    put_new, head = object_store.put_new, object_store.head
    failing = []

    def commit_then_fail(location, data):
        landed = put_new(location, data)
        failing.append(landed)
        return landed

    def head_failing(location):
        if failing:
            raise ortckpt.ObjectStoreError(location.url, "500 Internal Server Error")
        return head(location)

    with CheckpointManager(s3_url, storage_options=options, max_to_keep=1) as manager:
        monkeypatch.setattr(object_store, "put_new", commit_then_fail)
        monkeypatch.setattr(object_store, "head", head_failing)
        with pytest.warns(RuntimeWarning, match="step 1 committed, but the check"):
            manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        monkeypatch.undo()
        assert manager.all_steps() == [1]
        assert_holds(manager.restore(1), arrays(1))
        manager.save(CheckpointState.from_arrays(arrays(2)), 2)
        assert manager.all_steps() == [2]  # retention deleted step 1: the writer knew of it
    assert not [k for k in keys(s3_url, options) if k.startswith("step_00000001/")]


def test_an_intact_steps_restore_is_proven_by_its_etags_not_hashed(s3_server, s3_url, monkeypatch):
    """Each object's ETag is recorded as its upload got it; a restore whose objects the server
    declares with those ETags (and whose GETs are conditional on them) reads no SHA-256: the
    digest is for objects that are not the ones uploaded."""
    import hashlib as real_hashlib

    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, external_data_threshold=0) as manager:
        manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        files = manager.latest().metadata["files"]
    assert sorted(files) == ["checkpoint", "checkpoint.data"]
    assert all(isinstance(entry.get("etag"), str) and len(entry["sha256"]) == 64 for entry in files.values())
    hashed = []

    class Counting:
        @staticmethod
        def sha256(*args):
            hashed.append(True)
            return real_hashlib.sha256(*args)

    import ortckpt.stepstore.objects as objects_module

    monkeypatch.setattr(objects_module, "hashlib", Counting)
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    assert_holds(reader.restore(1), arrays(1))
    assert not hashed


@pytest.mark.parametrize("reads", ["answered", "failing too"])
def test_a_commit_that_landed_unheard_is_this_writers_step(s3_server, s3_url, monkeypatch, reads):
    """The commit's PUT lands but its answer is an error. Read back, the step is this save's (it
    counts); if the reads fail too, the save raises, and a retried save of the step finds this
    writer's own earlier commit: the step counts, never "another writer committed it", and
    retention deletes it in its turn."""
    options = s3_server.storage_options()
    put_new, head = object_store.put_new, object_store.head
    down = []

    def lands_then_fails(location, data):
        assert put_new(location, data)
        if reads == "failing too":
            down.append(True)
        raise ortckpt.ObjectStoreError(location.url, "500 Internal Server Error")

    def head_while_down(location):
        if down:
            raise ortckpt.ObjectStoreError(location.url, "500 Internal Server Error")
        return head(location)

    with CheckpointManager(s3_url, storage_options=options, max_to_keep=1) as manager:
        monkeypatch.setattr(object_store, "put_new", lands_then_fails)
        monkeypatch.setattr(object_store, "head", head_while_down)
        if reads == "answered":
            manager.save(CheckpointState.from_arrays(arrays(1)), 1)
        else:
            with pytest.raises(ortckpt.ObjectStoreError):
                manager.save(CheckpointState.from_arrays(arrays(1)), 1)
            monkeypatch.undo()  # the server answers again
            manager.save(CheckpointState.from_arrays(arrays(1)), 1)  # the retry
        monkeypatch.undo()
        assert manager.all_steps() == [1]
        assert_holds(manager.restore(1), arrays(1))
        manager.verify(1)
        manager.save(CheckpointState.from_arrays(arrays(2)), 2)
        assert manager.all_steps() == [2]
    assert not [k for k in keys(s3_url, options) if k.startswith("step_00000001/")]
