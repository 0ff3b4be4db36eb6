"""Every read from S3 has a limit known before memory is allocated, every listing an end, every
request a deadline (ortckpt.object_store). Against a hostile server (hostile_s3.py), each attempt
runs in a process of its own, whose peak memory (VmHWM) and time are measured: an error within
seconds, memory far below what the server declares or sends. Against the real server (SeaweedFS,
s3_server.py): streamed downloads, checkpoints refused unread, multipart uploads left by a killed
writer listed and aborted."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import ortckpt.object_requests as object_requests
import ortckpt.object_store as object_store
import ortckpt.object_uploads as object_uploads
import pytest
from hostile_s3 import HUGE, SMALL, HostileS3
from ortckpt import CheckpointManager, CheckpointState, targets
from ortckpt.errors import CheckpointFormatError, ObjectStoreError
from s3_server import kill_mid_upload

PEAK_MIB = 128  # a process that imported ortckpt and obstore peaks near 50 MiB
SECONDS = 10  # the hostile server's deadlines are 3 s, and obstore does not retry there

ATTEMPT = textwrap.dedent(
    """
    import json, os, sys, time
    import ortckpt.object_store as object_store
    import ortckpt.object_uploads as object_uploads
    from ortckpt import targets
    url, options, call = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    location = targets.object_location(url, options)
    started = time.monotonic()
    try:
        globals_ = {"object_store": object_store, "object_uploads": object_uploads, "location": location, "os": os}
        eval(call, {**globals_, "options": options})
        error, message = None, ""
    except Exception as e:
        error, message = type(e).__name__, str(e)
    seconds = time.monotonic() - started
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) // 1024
    print(json.dumps({"error": error, "message": message, "seconds": seconds, "peak_mib": peak}))
    """
)


@pytest.fixture(scope="module")
def hostile():
    server = HostileS3()
    yield server
    server.stop()


def attempt(hostile: HostileS3, url: str, call: str, **options) -> dict:
    """``call`` (an expression of ``object_store``, ``object_uploads`` and ``location``, ``url`` located) in a child
    process: what it raised, in how many seconds, and the process's peak memory."""
    command = [sys.executable, "-c", ATTEMPT, url, json.dumps(hostile.storage_options(**options)), call]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the attempt died ({done.returncode}):\n{done.stderr[-2000:]}"
    return json.loads(done.stdout)


def assert_refused(outcome: dict, error: str = "ObjectStoreError", *, naming: str) -> None:
    assert outcome["error"] == error, outcome
    assert naming in outcome["message"], outcome
    assert outcome["seconds"] < SECONDS, outcome
    assert outcome["peak_mib"] < PEAK_MIB, outcome


@pytest.mark.parametrize(
    "call",
    [
        "object_store.get(location)",  # over the machine's memory
        "object_store.get(location, limit=1 << 20)",
        "object_store.get(location, expected_size=14)",
        "object_store.sha256_of(location, expected_size=14)",
        "object_store.download_to(location, os.open(os.devnull, os.O_WRONLY), expected_size=14)",
    ],
)
def test_a_declared_terabyte_is_refused_before_it_is_read(hostile, call):
    """``Content-Length: 2**40``, and zeros after it: the original code (obstore's GetResult.bytes())
    aborted the process (SIGABRT), failing to allocate the terabyte."""
    outcome = attempt(hostile, "s3://b/huge", call)
    assert_refused(outcome, naming="s3://b/huge")
    assert f"declares {HUGE} bytes" in outcome["message"]


def test_a_declared_terabyte_is_not_a_checkpoint(hostile):
    outcome = attempt(hostile, "s3://b/huge", "object_store.get_checkpoint(location)")
    assert_refused(outcome, "CheckpointFormatError", naming="s3://b/huge")
    assert "over the 2147483648 a checkpoint can hold" in outcome["message"]


@pytest.mark.parametrize(
    "call",
    [
        "object_store.get(location)",
        "object_store.get_checkpoint(location)",
        "object_store.sha256_of(location)",
        "object_store.download_to(location, os.open(os.devnull, os.O_WRONLY))",
    ],
)
def test_a_body_longer_than_declared_is_stopped(hostile, call):
    """16 bytes declared, a chunked body of 256 MiB sent: the original code returned all of it
    (its process peaked at 305 MiB)."""
    outcome = attempt(hostile, "s3://b/longer", call)
    assert_refused(outcome, naming="more than the 16 bytes it declared")


@pytest.mark.parametrize("key", ["huge", "longer"])
def test_a_range_longer_than_asked_is_stopped(hostile, key):
    outcome = attempt(hostile, f"s3://b/{key}", "object_store.get_range(location, 0, 10)")
    assert_refused(outcome, naming="more than the 10 bytes it declared")


@pytest.mark.parametrize("call", ["object_store.get(location)", "object_store.sha256_of(location)"])
def test_a_body_shorter_than_declared_is_an_error(hostile, call):
    assert_refused(attempt(hostile, "s3://b/shorter", call), naming="s3://b/shorter")


READER = "__import__('ortckpt').CheckpointManager(location.url, storage_options=options, read_only=True)"


@pytest.mark.parametrize(
    ("prefix", "call", "problem"),
    [
        ("same", "object_store.list_keys(location)", "listed twice"),
        ("endless", "object_store.list_keys(location, max_keys=50_000)", "over 50000 keys"),
        ("endless", "object_store.list_keys(location, max_pages=3)", "over 3 pages"),
        ("empty", "object_store.list_keys(location)", "100 pages in a row hold nothing"),
        ("empty", "object_store.list_folders(location)", "100 pages in a row hold nothing"),
        ("same", "object_store.list_folders(location)", "the continuation token 'again' repeats"),
        ("empty", f"{READER}.all_steps()", "100 pages in a row hold nothing"),
    ],
    ids=[
        "repeated-token",
        "endless-keys",
        "endless-pages",
        "empty-pages",
        "empty-folder-pages",
        "repeated-folder-pages",
        "empty-pages-of-a-run",
    ],
)
def test_a_listing_without_end_is_an_error(hostile, prefix, call, problem):
    """The original code listed each of these until it was killed (90 s), the repeated and the
    endless pages' keys piling up; truncated pages without keys (a new continuation token each
    time) it listed for ever, as did every reader of a run there (issue 40, finding 14)."""
    outcome = attempt(hostile, f"s3://b/{prefix}", call)
    assert_refused(outcome, naming=f"s3://b/{prefix}/: listing")
    assert problem in outcome["message"]


def test_a_listing_answered_503_is_tried_again(hostile):
    """The listing's pages are ortckpt's own requests: a server error is tried again, as obstore
    tries its own (with no retries allowed, it is the error, naming the prefix)."""
    location = targets.object_location("s3://b/flaky", hostile.storage_options(max_retries=2))
    assert object_store.list_keys(location) == [("only", 1)]  # (each answered 503 first)
    assert object_store.list_folders(location) == []
    with pytest.raises(ObjectStoreError, match=r"s3://b/flaky/: GET .*HTTP 503 SlowDown"):
        object_store.list_keys(targets.object_location("s3://b/flaky", hostile.storage_options(max_retries=0)))


@pytest.mark.parametrize(
    ("url", "call"),
    [
        ("s3://b/silent", "object_store.get(location)"),
        ("s3://b/silent", "object_store.head(location)"),
        ("s3://b/silent", "object_store.list_keys(location)"),
        ("s3://b/silent", "object_uploads.pending_uploads(location)"),
        ("s3://b/x/silent", "object_uploads.abort_upload(location, 'silent')"),
        ("s3://b/drip", "object_store.get(location)"),
        ("s3://b/drip", "object_uploads.pending_uploads(location)"),
    ],
)
def test_a_server_that_never_answers_is_an_error_by_the_deadline(hostile, url, call):
    """The connection accepted, no answer, or a byte at a time: an error after the 3 s ``timeout``
    of the storage options (the original code waited for obstore's 30 s, and its default retries)."""
    outcome = attempt(hostile, url, call)
    assert_refused(outcome, naming=url)
    assert outcome["seconds"] > 2.5, outcome  # the deadline, not another failure


@pytest.mark.parametrize(
    ("prefix", "call", "problem"),
    [
        ("bomb", "object_uploads.pending_uploads(location)", "declares a document type"),
        ("oversized", "object_uploads.pending_uploads(location)", f"declares an answer of {HUGE} bytes"),
        ("unbounded", "object_uploads.pending_uploads(location)", "runs over"),
        ("same", "object_uploads.pending_uploads(location)", "listed twice"),
        ("endless", "object_uploads.pending_uploads(location, max_uploads=50_000)", "over 50000"),
        ("empty", "object_uploads.pending_uploads(location, max_pages=100)", "over 100 pages"),
    ],
)
def test_a_hostile_listing_of_uploads_is_an_error(hostile, prefix, call, problem):
    outcome = attempt(hostile, f"s3://b/{prefix}", call)
    assert_refused(outcome, naming=f"s3://b/{prefix}/")
    assert problem in outcome["message"]


def test_the_hostile_server_serves_honest_answers_too(hostile):
    """(So that the refusals above are the server's lies, not a misunderstanding.)"""
    location = targets.object_location("s3://b/small", hostile.storage_options())
    assert bytes(object_store.get(location)) == SMALL
    assert object_store.sha256_of(location) == (len(SMALL), hashlib.sha256(SMALL).hexdigest())
    assert object_store.list_keys(location) == [("only", 1)]
    ((key, upload_id, initiated),) = object_uploads.pending_uploads(location)
    assert (key, upload_id, initiated.year) == ("only", "1", 2024)


def test_every_request_has_deadlines_by_default_and_storage_options_set_them():
    store = targets.object_location("s3://b/k", {"endpoint_url": "http://127.0.0.1:9"}).store
    assert object_requests.config_of(store)["timeout"] == object_store.DEADLINES["timeout"]
    assert object_requests.config_of(store)["connect_timeout"] == object_store.DEADLINES["connect_timeout"]
    assert object_requests.config_of(store)["read_timeout"] is None
    options = {"endpoint_url": "http://127.0.0.1:9", "timeout": 2.5, "connect_timeout": "1", "read_timeout": 7}
    config = object_requests.config_of(targets.object_location("s3://b/k", options).store)
    assert (config["timeout"], config["connect_timeout"], config["read_timeout"]) == (2.5, 1, 7)
    with pytest.raises(ValueError, match="s3://b"):
        targets.object_location("s3://b/k", {"timeout": "soon"})


# Against the real server.


def test_download_to_streams_into_a_file_with_its_digest(s3_server, s3_url, tmp_path, monkeypatch):
    options = s3_server.storage_options()
    data = os.urandom(3 * object_store.STREAM_CHUNK + 12345)  # several chunks
    location = targets.object_location(f"{s3_url}/blob", options)
    object_store.put_stream(location, [data])
    etag = object_store.head(location).etag
    digest = hashlib.sha256()
    with open(tmp_path / "by-file", "wb") as file:
        file.write(b"head:")  # the caller's own bytes come first
        assert object_store.download_to(location, file, expected_size=len(data), etag=etag, digest=digest) == len(data)
    assert (tmp_path / "by-file").read_bytes() == b"head:" + data
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, view: real_write(fd, view[:100_000]))  # short writes
    fd = os.open(tmp_path / "short-writes", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert object_store.download_to(location, fd) == len(data)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert (tmp_path / "short-writes").read_bytes() == data
    assert object_store.sha256_of(location, expected_size=len(data)) == (len(data), hashlib.sha256(data).hexdigest())
    with open(tmp_path / "refused", "wb") as file, pytest.raises(ObjectStoreError, match=f"{len(data) - 1} were"):
        object_store.download_to(location, file, expected_size=len(data) - 1)
    assert (tmp_path / "refused").read_bytes() == b""  # refused before a byte was written
    with open(os.devnull, "wb") as nowhere, pytest.raises(ObjectStoreError, match="replaced while it was being read"):
        object_store.download_to(location, nowhere, etag='"another"')


def test_reads_are_exact_on_the_real_server(s3_server, s3_url):
    options = s3_server.storage_options()
    data = os.urandom(object_store.STREAM_CHUNK + 99)
    location = targets.object_location(f"{s3_url}/blob", options)
    object_store.put(location, data)
    assert bytes(object_store.get(location, expected_size=len(data))) == data
    assert bytes(object_store.get_range(location, 7, 1000)) == data[7:1007]
    with pytest.raises(ObjectStoreError, match="over the limit of 1000"):
        object_store.get(location, limit=1000)
    with pytest.raises(ObjectStoreError, match="were expected"):
        object_store.get(location, expected_size=len(data) + 1)
    with pytest.raises(ObjectStoreError):  # past the end: fewer bytes than asked for
        object_store.get_range(location, len(data) - 10, 20)


def counting_chunks(monkeypatch) -> list[int]:
    """How many chunks of a body are read, from here on."""
    read: list[int] = []
    real_chunks = object_store._chunks

    def chunks(*args):
        for chunk in real_chunks(*args):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(object_store, "_chunks", chunks)
    return read


def test_a_checkpoint_is_refused_unread_when_it_cannot_be_one(s3_server, s3_url, trained_path, monkeypatch):
    options = s3_server.storage_options()
    checkpoint = targets.object_location(f"{s3_url}/trained.ckpt", options)
    object_store.put(checkpoint, trained_path.read_bytes())
    assert bytes(object_store.get_checkpoint(checkpoint)) == trained_path.read_bytes()

    not_one = targets.object_location(f"{s3_url}/not-a-checkpoint", options)
    object_store.put_stream(not_one, [os.urandom(4 * object_store.STREAM_CHUNK)])
    read = counting_chunks(monkeypatch)
    with pytest.raises(CheckpointFormatError, match="no ODTC identifier") as caught:
        object_store.get_checkpoint(not_one)
    assert caught.value.filename == not_one.url and not_one.url in str(caught.value)
    assert len(read) == 1, "refused from its first chunk"
    read.clear()
    with pytest.raises(CheckpointFormatError, match="over the 1000 a checkpoint can hold") as caught:
        object_store.get_checkpoint(checkpoint, limit=1000)
    assert caught.value.filename == checkpoint.url
    assert read == [], "refused before a byte was read"


KILLED_WRITER = textwrap.dedent(
    """
    import itertools, sys, obstore
    from obstore.store import S3Store
    endpoint, key, secret, path = sys.argv[1:5]
    config = {"access_key_id": key, "secret_access_key": secret, "region": "us-east-1"}
    store = S3Store("ckpt", config=config, endpoint=endpoint, client_options={"allow_http": True})
    print("saving", flush=True)
    obstore.put(store, path, (bytes(5 << 20) for _ in itertools.count()), use_multipart=True, chunk_size=5 << 20)
    """
)


def test_a_killed_writers_upload_is_listed_and_aborted(s3_server, s3_url):
    """weed mini answers ListMultipartUploads and AbortMultipartUpload."""
    options = s3_server.storage_options()
    prefix = targets.object_location(s3_url, options)
    before = set(s3_server.pending_uploads())
    credentials = (options["access_key_id"], options["secret_access_key"])
    command = [sys.executable, "-c", KILLED_WRITER, s3_server.url, *credentials, f"{prefix.key}/step/obj"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    kill_mid_upload(s3_server, child, before)
    ((key, upload_id, initiated),) = object_uploads.pending_uploads(prefix)
    assert key == "step/obj"
    assert abs(datetime.datetime.now(datetime.UTC) - initiated) < datetime.timedelta(minutes=5)
    assert object_uploads.pending_uploads(prefix.child("elsewhere")) == []
    assert object_store.list_keys(prefix) == []  # invisible to a listing of objects
    object_uploads.abort_upload(prefix.child(key), upload_id)
    assert object_uploads.pending_uploads(prefix) == []
    assert set(s3_server.pending_uploads()) == before  # gone from the server, not only its listing
    object_uploads.abort_upload(prefix.child(key), upload_id)  # again: already gone is no error
    wrong = targets.object_location(s3_url, s3_server.storage_options(secret_access_key="wrong"))
    with pytest.raises(ObjectStoreError, match="HTTP 403"):
        object_uploads.pending_uploads(wrong)


def test_listing_bounds_on_the_real_server(s3_server, s3_url):
    options = s3_server.storage_options()
    prefix = targets.object_location(s3_url, options)
    names = [f"a/b/{i}" for i in range(5)] + ["a/b-x", "a/b.data"]  # (S3's order is not a folder walk's)
    for name in names:
        object_store.put(prefix.child(name), b"x")
    assert sorted(key for key, _ in object_store.list_keys(prefix, max_keys=len(names))) == sorted(names)
    with pytest.raises(ObjectStoreError, match=f"over {len(names) - 1} keys") as caught:
        object_store.list_keys(prefix, max_keys=len(names) - 1)
    assert caught.value.filename == f"{s3_url}/"


def test_a_store_without_static_credentials_lists_through_obstore(s3_server, s3_url, monkeypatch):
    """Where ortckpt cannot sign (an instance's role, a web identity), obstore lists: the same
    keys and folders, and a run's steps."""
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=2) as manager:
        for step in (1, 2, 3):
            manager.save(CheckpointState.from_arrays({"w": np.full(8, step, np.float32)}), step)
    prefix = targets.object_location(s3_url, options)
    signed = (object_store.list_keys(prefix), object_store.list_folders(prefix))
    monkeypatch.setattr(object_store, "signs", lambda store: False)
    assert (object_store.list_keys(prefix), object_store.list_folders(prefix)) == signed
    assert {key for key, _ in signed[0] if key.endswith("metadata.json")} == {
        "step_00000002/metadata.json",
        "step_00000003/metadata.json",
    }
    assert {"step_00000002", "step_00000003"} <= set(signed[1])  # (and step 1's, emptied, where a server keeps it)
    assert CheckpointManager(s3_url, storage_options=options, read_only=True).all_steps() == [2, 3]


def test_a_store_without_static_credentials_cannot_list_uploads(monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    location = targets.object_location("s3://b/prefix", {"endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(ObjectStoreError, match="static credentials"):
        object_uploads.pending_uploads(location)
