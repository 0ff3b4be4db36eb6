"""Checkpoints on S3 (ortckpt.object_store), against a real S3 server (SeaweedFS, see s3_server.py):
saves stream to multipart uploads, loads read lazily or whole, and faults leave no visible object."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from goldens import golden_checkpoints, load_json, sha256
from ortckpt import targets
from ortckpt.errors import CheckpointFormatError
from s3_server import kill_mid_upload

BIG = 40 << 20  # over two upload parts


def arrays(seed: int = 0, nbytes: int = 8 << 20, count: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    per = nbytes // count // 4
    return {f"layer{i}.weight": rng.standard_normal(per + i, dtype=np.float32) for i in range(count)}


def state_of(values: dict[str, np.ndarray], epoch: int = 1) -> ortckpt.CheckpointState:
    return ortckpt.CheckpointState.from_arrays(values, {"step": np.array(epoch, np.int64)}, {"epoch": epoch})


def assert_holds(state: ortckpt.CheckpointState, values: dict[str, np.ndarray]) -> None:
    for name, value in values.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)


def keys(s3_url: str, options: dict) -> list[str]:
    return sorted(k for k, _ in object_store.list_keys(targets.object_location(s3_url, options)))


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external-data"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "downloaded"])
def test_round_trip(s3_server, s3_url, external, lazy):
    options = s3_server.storage_options()
    values = arrays(nbytes=BIG)
    url = f"{s3_url}/ckpt"
    before = set(s3_server.pending_uploads())  # (killed saves of other tests leave theirs)
    ortckpt.save_checkpoint(
        state_of(values), url, storage_options=options, external_data_threshold=0 if external else 2**40
    )
    assert keys(s3_url, options) == (["ckpt", "ckpt.data"] if external else ["ckpt"])
    back = ortckpt.load_checkpoint(url, storage_options=options, lazy=lazy)
    assert_holds(back, values)
    assert back.properties["epoch"] == 1 and back.parameters["step"].data == 1
    assert set(s3_server.pending_uploads()) == before  # every multipart upload completed


def test_the_object_is_the_file_a_local_save_writes(s3_server, s3_url, tmp_path):
    options = s3_server.storage_options()
    state = state_of(arrays(nbytes=BIG))
    ortckpt.save_checkpoint(state, f"{s3_url}/ckpt", storage_options=options)
    ortckpt.save_checkpoint(state, tmp_path / "ckpt")
    location = targets.object_location(f"{s3_url}/ckpt", options)
    assert bytes(object_store.get(location)) == (tmp_path / "ckpt").read_bytes()


def test_onnx_runtime_loads_what_was_uploaded(s3_server, s3_url, tmp_path, ort):
    """Both layouts, fetched back with the S3 API and opened by ONNX Runtime itself."""
    options = s3_server.storage_options()
    values = arrays(nbytes=1 << 20)
    for threshold, name in ((2**40, "inline"), (0, "external")):
        ortckpt.save_checkpoint(
            state_of(values), f"{s3_url}/{name}", storage_options=options, external_data_threshold=threshold
        )
        for key in keys(s3_url, options):
            if key.startswith(name):
                (tmp_path / key).write_bytes(
                    bytes(object_store.get(targets.object_location(f"{s3_url}/{key}", options)))
                )
        described = ort("describe", tmp_path / name)
        assert {p["name"]: p["sha256"] for p in described["parameters"] if p["name"] in values} == {
            k: sha256(v) for k, v in values.items()
        }
        assert described["properties"] == {"epoch": 1}


def test_golden_checkpoints_written_by_onnx_runtime_load_from_s3(s3_server, s3_url):
    options = s3_server.storage_options()
    for path in golden_checkpoints():
        url = f"{s3_url}/{path.name}"
        object_store.put(targets.object_location(url, options), path.read_bytes())
        expected = load_json(path)
        state = ortckpt.load_checkpoint(url, storage_options=options)
        assert state.parameters.names() == sorted(p["name"] for p in expected["parameters"])
        if not state.is_nominal:  # the same values as the file opened locally
            local = ortckpt.load_checkpoint(path)
            for name, param in state.parameters:
                got, want = param.data, local.parameters[name].data
                assert sha256(getattr(got, "packed", got)) == sha256(getattr(want, "packed", want)), (path.name, name)


def test_overwrite_replaces_and_leaves_no_stale_data_file(s3_server, s3_url):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    ortckpt.save_checkpoint(state_of(arrays(1), epoch=1), url, storage_options=options, external_data_threshold=0)
    second = arrays(2)
    ortckpt.save_checkpoint(state_of(second, epoch=2), url, storage_options=options)
    assert keys(s3_url, options) == ["ckpt"]
    back = ortckpt.load_checkpoint(url, storage_options=options)
    assert back.properties["epoch"] == 2
    assert_holds(back, second)


def test_a_failed_upload_is_aborted_and_the_previous_object_stays(s3_server, s3_url, monkeypatch):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    first = arrays(1, nbytes=BIG)
    ortckpt.save_checkpoint(state_of(first), url, storage_options=options)
    real_parts = object_store._parts
    before = set(s3_server.pending_uploads())

    def failing_parts(pieces, digest=None, on_bytes=None):
        for i, part in enumerate(real_parts(pieces, digest, on_bytes)):
            if i == 2:
                assert set(s3_server.pending_uploads()) - before, "the upload is under way"
                raise OSError("the disk under the arrays failed")
            yield part

    monkeypatch.setattr(object_store, "_parts", failing_parts)
    with pytest.raises(OSError, match="disk under the arrays"):
        ortckpt.save_checkpoint(state_of(arrays(2, nbytes=BIG)), url, storage_options=options)
    assert set(s3_server.pending_uploads()) == before  # aborted, not left behind
    assert_holds(ortckpt.load_checkpoint(url, storage_options=options), first)


def test_the_server_stopping_mid_upload_fails_the_save_and_keeps_the_previous(s3_server, s3_url):
    options = s3_server.storage_options(max_retries=0, retry_timeout=2)
    url = f"{s3_url}/ckpt"
    first = arrays(1, nbytes=BIG)
    ortckpt.save_checkpoint(state_of(first), url, storage_options=options)
    failure: list[BaseException] = []
    stopped = threading.Event()
    real_parts = object_store._parts

    def parts_then_stop(pieces, digest=None, on_bytes=None):
        for i, part in enumerate(real_parts(pieces, digest, on_bytes)):
            if i == 1:
                s3_server.stop()  # the server goes away with the upload half done
                stopped.set()
            yield part

    def save():
        try:
            object_store_parts, object_store._parts = object_store._parts, parts_then_stop
            try:
                ortckpt.save_checkpoint(state_of(arrays(2, nbytes=BIG)), url, storage_options=options)
            finally:
                object_store._parts = object_store_parts
        except BaseException as e:
            failure.append(e)

    worker = threading.Thread(target=save)
    worker.start()
    worker.join(120)
    try:
        assert stopped.is_set() and not worker.is_alive()
        assert len(failure) == 1 and isinstance(failure[0], ortckpt.ObjectStoreError), failure
        assert url.rsplit("/", 1)[0] in str(failure[0])
    finally:
        s3_server.start()
    assert_holds(ortckpt.load_checkpoint(url, storage_options=options), first)


KILLED_SAVER = textwrap.dedent(
    """
    import sys, numpy as np, ortckpt
    url, endpoint, key, secret = sys.argv[1:5]
    options = {"endpoint_url": endpoint, "access_key_id": key, "secret_access_key": secret}
    values = {f"w{i}": np.full(8 << 20, i + 2, np.float32) for i in range(8)}  # 256 MiB
    print("saving", flush=True)
    ortckpt.save_checkpoint(ortckpt.CheckpointState.from_arrays(values), url, storage_options=options)
    print("saved", flush=True)
    """
)


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(s3_server, s3_url, tmp_path):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    first = arrays(1)
    ortckpt.save_checkpoint(state_of(first), url, storage_options=options)
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    before = set(s3_server.pending_uploads())
    child = subprocess.Popen(
        [
            sys.executable,
            str(script),
            url,
            s3_server.url,
            *(options[k] for k in ("access_key_id", "secret_access_key")),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    kill_mid_upload(s3_server, child, before)
    assert set(s3_server.pending_uploads()) - before, "the killed upload is left, invisible"
    assert keys(s3_url, options) == ["ckpt"]
    back = ortckpt.load_checkpoint(url, storage_options=options)
    assert_holds(back, first)


def test_a_truncated_object_is_refused_naming_it(s3_server, s3_url):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    ortckpt.save_checkpoint(state_of(arrays()), url, storage_options=options)
    location = targets.object_location(url, options)
    whole = bytes(object_store.get(location))
    object_store.put(location, whole[: len(whole) // 2])
    with pytest.raises(CheckpointFormatError) as caught:
        ortckpt.load_checkpoint(url, storage_options=options)
    assert caught.value.filename == url


def test_a_truncated_data_object_is_refused(s3_server, s3_url):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    ortckpt.save_checkpoint(state_of(arrays()), url, storage_options=options, external_data_threshold=0)
    data = targets.object_location(f"{url}.data", options)
    whole = bytes(object_store.get(data))
    object_store.put(data, whole[: len(whole) - 1000] + whole[-32:])  # the trailer kept: only ranges tell
    with pytest.raises(CheckpointFormatError, match="beyond the end of the data file"):
        ortckpt.load_checkpoint(url, storage_options=options)


def test_a_data_object_from_another_save_is_refused(s3_server, s3_url):
    options = s3_server.storage_options()
    for name, seed in (("a", 1), ("b", 2)):
        ortckpt.save_checkpoint(
            state_of(arrays(seed)), f"{s3_url}/{name}", storage_options=options, external_data_threshold=0
        )
    other = bytes(object_store.get(targets.object_location(f"{s3_url}/b.data", options)))
    object_store.put(targets.object_location(f"{s3_url}/a.data", options), other)
    with pytest.raises(CheckpointFormatError, match="different saves"):
        ortckpt.load_checkpoint(f"{s3_url}/a", storage_options=options)


def test_a_lazy_load_never_mixes_two_saves(s3_server, s3_url):
    """The data object replaced after the load began: reading a tensor fails, naming it."""
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    first = arrays(1)
    ortckpt.save_checkpoint(state_of(first), url, storage_options=options, external_data_threshold=0)
    lazy = ortckpt.load_checkpoint(url, storage_options=options)
    np.testing.assert_array_equal(lazy.parameters["layer0.weight"].data, first["layer0.weight"])
    ortckpt.save_checkpoint(state_of(arrays(2)), url, storage_options=options, external_data_threshold=0)
    with pytest.raises(ortckpt.ObjectStoreError, match="replaced while it was being read") as caught:
        lazy.parameters["layer1.weight"].data  # noqa: B018
    assert caught.value.filename == f"{url}.data"


def test_a_missing_object_is_file_not_found(s3_server, s3_url):
    with pytest.raises(FileNotFoundError):
        ortckpt.load_checkpoint(f"{s3_url}/nothing", storage_options=s3_server.storage_options())


@pytest.mark.parametrize("url", ["s3://", "s3:///key", "s3://b/a/../k", "s3://b/a//k", "s3://b/./k"])
def test_malformed_urls_are_refused(url):
    with pytest.raises(ValueError):
        targets.object_location(url, {"endpoint_url": "http://127.0.0.1:1"})


@pytest.mark.parametrize("url", ["s3://ckpt", "s3://ckpt/"])
def test_a_bucket_is_not_a_checkpoint(url):
    state = state_of(arrays(nbytes=1 << 10))
    with pytest.raises(ValueError, match="names a bucket, not an object"):
        ortckpt.save_checkpoint(state, url, storage_options={"endpoint_url": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="names a bucket, not an object"):
        ortckpt.load_checkpoint(url, storage_options={"endpoint_url": "http://127.0.0.1:1"})


def test_wrong_credentials_are_an_object_store_error(s3_server, s3_url):
    options = s3_server.storage_options(secret_access_key="wrong", max_retries=0)
    with pytest.raises(ortckpt.ObjectStoreError) as caught:
        ortckpt.save_checkpoint(state_of(arrays(nbytes=1 << 16)), f"{s3_url}/ckpt", storage_options=options)
    assert caught.value.filename == f"{s3_url}/ckpt"


def test_configuration_from_the_environment_and_profile_files(s3_server, s3_url, tmp_path, monkeypatch):
    """As boto3 finds it: storage_options, then AWS_* variables, then the profile files."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    options = s3_server.storage_options()
    values = arrays(nbytes=1 << 16)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    ortckpt.save_checkpoint(state_of(values), f"{s3_url}/from-env")
    # A wrong secret in the environment, the right one in storage_options: storage_options win.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert_holds(
        ortckpt.load_checkpoint(f"{s3_url}/from-env", storage_options={"secret": options["secret_access_key"]}), values
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    (tmp_path / "credentials").write_text(
        f"[training]\naws_access_key_id = {options['access_key_id']}\n"
        f"aws_secret_access_key = {options['secret_access_key']}\n"
    )
    (tmp_path / "config").write_text(f"[profile training]\nendpoint_url = {s3_server.url}\nregion = eu-west-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "training")
    assert_holds(ortckpt.load_checkpoint(f"{s3_url}/from-env"), values)
    # An explicit profile outranks the environment's credentials.
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    assert_holds(ortckpt.load_checkpoint(f"{s3_url}/from-env", storage_options={"profile": "training"}), values)
    with pytest.raises(ortckpt.ObjectStoreError):
        ortckpt.load_checkpoint(f"{s3_url}/from-env", storage_options={"endpoint_url": s3_server.url, "max_retries": 0})


def test_a_save_holds_a_few_parts_in_memory_not_the_checkpoint(s3_server, s3_url, tmp_path):
    """Peak memory of a 512 MiB save, in a fresh process: the arrays, plus about the parts in flight."""
    script = tmp_path / "measure.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, numpy as np, ortckpt

            def peak():  # VmHWM starts afresh at exec (ru_maxrss is inherited from pytest, the parent)
                with open("/proc/self/status") as status:
                    return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))

            url, endpoint, key, secret = sys.argv[1:5]
            options = {"endpoint_url": endpoint, "access_key_id": key, "secret_access_key": secret}
            values = {f"w{i}": np.full(32 << 20, i, np.float32) for i in range(4)}  # 512 MiB, touched
            state = ortckpt.CheckpointState.from_arrays(values)
            before = peak()
            ortckpt.save_checkpoint(state, url, storage_options=options)
            print(peak() - before)
            """
        )
    )
    options = s3_server.storage_options()
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            f"{s3_url}/ckpt",
            s3_server.url,
            options["access_key_id"],
            options["secret_access_key"],
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    added = int(done.stdout.strip())
    bound = 2 * object_store.PARTS_IN_FLIGHT * object_store.PART_BYTES + (64 << 20)
    assert added < bound, f"the save added {added >> 20} MiB at its peak (bound {bound >> 20} MiB)"
    back = ortckpt.load_checkpoint(f"{s3_url}/ckpt", storage_options=options)
    assert float(back.parameters["w3"].data[-1]) == 3.0


def test_a_missing_data_object_is_named(s3_server, s3_url):
    options = s3_server.storage_options()
    url = f"{s3_url}/ckpt"
    ortckpt.save_checkpoint(state_of(arrays()), url, storage_options=options, external_data_threshold=0)
    object_store.remove([targets.object_location(f"{url}.data", options)])
    with pytest.raises(FileNotFoundError, match="external data") as caught:
        ortckpt.load_checkpoint(url, storage_options=options)
    assert caught.value.filename == f"{url}.data"


def test_average_delta_and_convert_take_object_urls(s3_server, s3_url, tmp_path, monkeypatch, capsys, aws_environment):
    """Federated averaging and conversion read and write s3:// (the CLI too, configured by AWS_*)."""
    from ortckpt.cli import run
    from ortckpt.convert import ConversionError, convert

    options = s3_server.storage_options()
    clients = [{"w": np.full(1000, i, np.float32)} for i in (1.0, 2.0, 6.0)]
    for i, values in enumerate(clients):
        ortckpt.save_checkpoint(state_of(values), f"{s3_url}/client{i}", external_data_threshold=0 if i else 2**40)
    urls = [f"{s3_url}/client{i}" for i in range(3)]
    ortckpt.average(urls, out=f"{s3_url}/global", storage_options=options)
    np.testing.assert_array_equal(ortckpt.load_checkpoint(f"{s3_url}/global").parameters["w"].data, np.full(1000, 3.0))
    ortckpt.delta(urls[2], urls[0], out=tmp_path / "delta")  # objects in, a file out
    np.testing.assert_array_equal(ortckpt.load_checkpoint(tmp_path / "delta").parameters["w"].data, np.full(1000, 5.0))
    ortckpt.apply(urls[0], tmp_path / "delta", 0.5, out=f"{s3_url}/applied")  # a file and an object in, an object out
    np.testing.assert_array_equal(ortckpt.load_checkpoint(f"{s3_url}/applied").parameters["w"].data, np.full(1000, 3.5))
    assert run(["average", *urls[:2], "-o", f"{s3_url}/cli-global"]) == 0
    np.testing.assert_array_equal(
        ortckpt.load_checkpoint(f"{s3_url}/cli-global").parameters["w"].data, np.full(1000, 1.5)
    )
    convert(urls[1], tmp_path / "w.safetensors")
    convert(tmp_path / "w.safetensors", f"{s3_url}/from-safetensors")
    np.testing.assert_array_equal(
        ortckpt.load_checkpoint(f"{s3_url}/from-safetensors").parameters["w"].data, clients[1]["w"]
    )
    with pytest.raises(ConversionError, match="only ONNX Runtime checkpoints"):
        convert(urls[1], f"{s3_url}/w.safetensors")
