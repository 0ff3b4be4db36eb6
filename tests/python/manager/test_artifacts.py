"""Steps that carry the run's graphs (CheckpointManager(artifacts=...)): each distinct ONNX model
stored once and shared by the steps that use it (hard links in a directory, objects by digest on
s3://), covered by verify, kept while a kept step needs it, listed by `ortckpt inspect`; and the
attacks on it (planted symlinks, special files, huge sizes, hostile metadata, a kill mid-store,
a reader racing retention). ONNX Runtime's own loop over a step copied alone: tests/interop/
test_ort_loop.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import ortckpt
import ortckpt.object_store as object_store
import pytest
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState, documents, targets
from ortckpt.cli import run as cli_run

ARTIFACTS = Path(__file__).resolve().parents[2] / "data" / "ort-vectors" / "artifacts"
GRAPHS = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")


def state(seed: int = 0) -> CheckpointState:
    rng = np.random.default_rng(seed)
    return CheckpointState.from_arrays({"w": rng.standard_normal(64).astype(np.float32)})


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """A copy of a folder generate_artifacts wrote (its graphs may then be changed)."""
    folder = tmp_path / "artifacts-src"
    shutil.copytree(ARTIFACTS, folder)
    return folder


def stored(run: Path) -> dict[str, int]:
    """The run's stored graphs: name -> link count."""
    folder = run / "artifacts"
    return {entry.name: os.lstat(entry.path).st_nlink for entry in os.scandir(folder)} if folder.exists() else {}


def digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_steps_share_one_stored_copy_and_a_changed_graph_is_stored_again(tmp_path, artifacts):
    run = tmp_path / "run"
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        for step in (1, 2, 3):
            manager.save(state(step), step)
        # One stored file per graph, linked from each of the three steps (3 links + its own name).
        assert sorted(stored(run)) == sorted(f"{digest(artifacts / g)}.onnx" for g in GRAPHS)
        assert set(stored(run).values()) == {4}
        inodes = {os.lstat(run / f"step_{s:08d}" / "training_model.onnx").st_ino for s in (1, 2, 3)}
        assert len(inodes) == 1
        info = manager.latest()
        assert sorted(info.artifacts) == ["eval", "optimizer", "training"]
        for role, path in info.artifacts.items():
            assert path == run / "step_00000003" / f"{role}_model.onnx"
            assert path.read_bytes() == (artifacts / f"{role}_model.onnx").read_bytes()
        assert info.metadata["artifacts"]["training"] == {
            "name": "training_model.onnx",
            "bytes": (artifacts / "training_model.onnx").stat().st_size,
            "sha256": digest(artifacts / "training_model.onnx"),
        }
        # The eval graph changes (re-exported): stored again, the others still shared.
        (artifacts / "eval_model.onnx").write_bytes((artifacts / "eval_model.onnx").read_bytes() + b"\n")
        manager.save(state(4), 4)
        assert len(stored(run)) == 4
        new = manager.latest().metadata["artifacts"]["eval"]
        assert new["sha256"] == digest(artifacts / "eval_model.onnx") != info.metadata["artifacts"]["eval"]["sha256"]
        assert stored(run)[f"{new['sha256']}.onnx"] == 2
        assert stored(run)[f"{info.metadata['artifacts']['training']['sha256']}.onnx"] == 5
        manager.verify(4)


def test_retention_deletes_the_graphs_no_kept_step_uses_and_keeps_the_others(tmp_path, artifacts):
    run = tmp_path / "run"
    old = f"{digest(artifacts / 'eval_model.onnx')}.onnx"
    with CheckpointManager(run, artifacts=artifacts, max_to_keep=2, durable=False) as manager:
        manager.save(state(1), 1)
        manager.save(state(2), 2)
        (artifacts / "eval_model.onnx").write_bytes(b"another eval graph")
        manager.save(state(3), 3)  # step 1 goes; step 2 still uses the old eval graph
        assert manager.all_steps() == [2, 3] and old in stored(run)
        manager.save(state(4), 4)  # step 2 goes: nothing uses the old eval graph
        assert manager.all_steps() == [3, 4] and old not in stored(run)
        assert f"{digest(artifacts / 'eval_model.onnx')}.onnx" in stored(run)
        assert len(stored(run)) == 3
        manager.delete(3)
        manager.delete(4)
        assert stored(run) == {}


def test_verify_catches_a_corrupted_or_replaced_graph(tmp_path, artifacts):
    run = tmp_path / "run"
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        manager.save(state(2), 2)
    graph = run / "step_00000002" / "training_model.onnx"
    # Replaced by another graph of the same size.
    data = bytearray(graph.read_bytes())
    data[100] ^= 1
    graph.unlink()
    graph.write_bytes(bytes(data))
    reader = CheckpointManager(run, read_only=True)
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx: SHA-256"):
        reader.verify(2)
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx"):
        ortckpt.verify(run / "step_00000002")
    with pytest.raises(CheckpointIntegrityError, match="not the graph this step recorded"):
        _ = reader.latest().artifacts
    reader.verify(1)  # its own link still holds the stored graph
    # Missing, and replaced by a symlink to the right bytes (never followed).
    graph.unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx: missing"):
        reader.verify(2)
    graph.symlink_to(artifacts / "training_model.onnx")
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx"):
        reader.verify(2)


def test_a_step_folder_copied_alone_holds_its_graphs(tmp_path, artifacts):
    with CheckpointManager(tmp_path / "run", artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        manager.save(state(2), 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(["cp", "-r", str(tmp_path / "run" / "step_00000002"), str(elsewhere)], check=True)
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(artifacts)
    with CheckpointManager(elsewhere) as copy:
        info = copy.latest()
        assert info.step == 2
        assert {role: digest(path) for role, path in info.artifacts.items()} == {
            role: entry["sha256"] for role, entry in info.metadata["artifacts"].items()
        }
        copy.verify(2)
    assert (
        ortckpt.verify(elsewhere / "step_00000002").files["optimizer_model.onnx"]
        == (info.metadata["artifacts"]["optimizer"]["sha256"])
    )


def test_a_mapping_of_roles_and_what_metadata_records(tmp_path, artifacts):
    extra = tmp_path / "model.onnx"
    extra.write_bytes(b"an inference graph")
    with CheckpointManager(
        tmp_path / "run", artifacts={"training": artifacts / "training_model.onnx", "inference": extra}, device="cuda:1"
    ) as manager:
        manager.save(state(), 1)
        meta = manager.latest().metadata
    assert sorted(meta["artifacts"]) == ["inference", "training"]
    assert meta["artifacts"]["inference"]["name"] == "inference_model.onnx"
    assert (tmp_path / "run" / "step_00000001" / "inference_model.onnx").read_bytes() == b"an inference graph"
    assert meta["device"] == "cuda:1" and meta["execution_provider"] == "CUDAExecutionProvider"
    assert set(meta["versions"]) >= {"onnxruntime", "onnx", "ortckpt", "numpy", "python"}
    # A manager without graphs records none (and old metadata without these fields reads).
    with CheckpointManager(tmp_path / "plain") as manager:
        manager.save(state(), 1)
        info = manager.latest()
        assert info.artifacts == {} and "artifacts" not in info.metadata and "execution_provider" not in info.metadata
    with CheckpointManager(tmp_path / "defaults", artifacts=artifacts) as manager:
        manager.save(state(), 1)
        assert manager.latest().metadata["execution_provider"] == "CPUExecutionProvider"


def test_the_artifacts_argument_is_checked_before_anything_is_written(tmp_path, artifacts):
    run = tmp_path / "run"
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.onnx"
    with open(huge, "wb") as f:  # sparse: no space taken
        f.truncate(documents.MAX_ARTIFACT_BYTES + 1)
    refused = [
        ({"training": fifo}, "FIFO"),
        ({"training": tmp_path}, "directory"),
        ({"training": huge}, "more than an ONNX model can"),
        ({"../x": artifacts / "training_model.onnx"}, "not a lowercase word"),
        ({"Training": artifacts / "training_model.onnx"}, "not a lowercase word"),
        ({"training": 3}, "path of an ONNX file"),
        ({}, "1 to 16 graphs"),
        (tmp_path / "missing", "not a folder"),
        (tmp_path, "holds no training_model.onnx"),
        (["training_model.onnx"], "folder or a mapping"),
    ]
    for given, message in refused:
        with pytest.raises((ValueError, TypeError, OSError), match=message):
            CheckpointManager(run, artifacts=given)
    with pytest.raises(ValueError, match="device"):
        CheckpointManager(run, artifacts=artifacts, device="tpu")
    with pytest.raises(ValueError, match="writer"):
        CheckpointManager(run, artifacts=artifacts, read_only=True)
    assert not run.exists()


def test_a_symlink_planted_in_the_shared_folder_is_never_linked_nor_written_through(tmp_path, artifacts):
    run = tmp_path / "run"
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(b"not the graph")
    name = f"{digest(artifacts / 'training_model.onnx')}.onnx"
    (run / "artifacts").mkdir(parents=True)
    (run / "artifacts" / name).symlink_to(outside)
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        manager.verify(1)
        graph = manager.latest().artifacts["training"]
        assert not graph.is_symlink() and graph.read_bytes() == (artifacts / "training_model.onnx").read_bytes()
        assert not (run / "artifacts" / name).is_symlink()  # replaced by the stored graph
    assert outside.read_bytes() == b"not the graph"
    # A stored graph replaced by other bytes (same name) is not linked into later steps.
    stored_graph = run / "artifacts" / name
    stored_graph.unlink()
    stored_graph.write_bytes(b"rotten")
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        manager.save(state(2), 2)
        manager.verify(2)
        assert manager.latest().artifacts["training"].read_bytes() == (artifacts / "training_model.onnx").read_bytes()
    # The artifacts folder itself a symlink: the save is refused, the previous step stands.
    shutil.rmtree(run / "artifacts")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "artifacts").symlink_to(elsewhere)
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        with pytest.raises(NotADirectoryError, match="not a directory of this run's graphs"):
            manager.save(state(3), 3)
        assert manager.all_steps() == [1, 2]
        manager.verify(2)
    assert list(elsewhere.iterdir()) == []


def test_a_save_killed_while_storing_graphs_leaves_nothing_behind(tmp_path, artifacts):
    run = tmp_path / "run"
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
    (artifacts / "eval_model.onnx").write_bytes(b"a new eval graph")
    new = f"{digest(artifacts / 'eval_model.onnx')}.onnx"
    # Killed after the graphs were stored (and linked into the save's folder), before its commit.
    script = textwrap.dedent(
        f"""
        import os, numpy as np
        from ortckpt import CheckpointManager, CheckpointState
        from ortckpt.stepstore.directory import DirectoryStore
        DirectoryStore.commit = lambda *a, **k: os._exit(9)
        manager = CheckpointManager({str(run)!r}, artifacts={str(artifacts)!r}, durable=False)
        manager.save(CheckpointState.from_arrays({{"w": np.zeros(3, np.float32)}}), 2)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 9, done.stderr
    assert new in stored(run) and any(p.name.startswith(".step_00000002.tmp-") for p in run.iterdir())
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:  # the next writer sweeps
        assert manager.all_steps() == [1]
        assert new not in stored(run) and set(stored(run).values()) == {2}
        assert not any(p.name.startswith(".step_") for p in run.iterdir())
        manager.verify(1)
        manager.save(state(2), 2)
        manager.verify(2)


def test_a_reader_never_sees_a_step_whose_graphs_are_missing(tmp_path, artifacts):
    run = tmp_path / "run"
    stop = threading.Event()
    problems: list[str] = []

    def write() -> None:
        with CheckpointManager(run, artifacts=artifacts, max_to_keep=1, durable=False) as manager:
            for step in range(1, 40):
                (artifacts / "eval_model.onnx").write_bytes(f"eval graph {step}".encode())
                manager.save(state(step), step)
        stop.set()

    with CheckpointManager(run, artifacts=artifacts, durable=False) as first:
        first.save(state(0), 0)
    writer = threading.Thread(target=write)
    writer.start()
    reader = CheckpointManager(run, read_only=True)
    seen = 0
    while not stop.is_set():
        for info in reader.all():
            try:
                graphs = info.artifacts
                eval_bytes = graphs["eval"].read_bytes()
            except (OSError, CheckpointIntegrityError) as e:
                if (run / f"step_{info.step:08d}").exists():  # still listed: its graphs must be there
                    problems.append(f"step {info.step}: {e}")
                continue
            if info.step and eval_bytes != f"eval graph {info.step}".encode():
                problems.append(f"step {info.step}: another step's eval graph")
            seen += 1
    writer.join()
    assert problems == [] and seen > 0
    assert len(stored(run)) == 3


def test_hostile_metadata_is_refused_before_any_file_is_read(tmp_path, artifacts):
    run = tmp_path / "run"
    with CheckpointManager(run, artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
    path = run / "step_00000001" / "metadata.json"
    good = json.loads(path.read_text())
    training = good["artifacts"]["training"]
    hostile = {
        "a name escaping the folder": {"training": {**training, "name": "../../outside.onnx"}},
        "another role's file": {"training": {**training, "name": "checkpoint"}},
        "a role that is a path": {"../x": {**training, "name": "../x_model.onnx"}},
        "a huge size": {"training": {**training, "bytes": 2**40}},
        "a digest that is no digest": {"training": {**training, "sha256": "../" * 21 + "x"}},
        "too many graphs": {f"r{i}": {**training, "name": f"r{i}_model.onnx"} for i in range(17)},
        "not an object": ["training"],
    }
    for what, artifacts_field in hostile.items():
        data = json.dumps({**good, "artifacts": artifacts_field}).encode()
        with pytest.raises(documents.DocumentError, match="artifacts"):
            documents.parse(documents.METADATA, data, "metadata.json")
        os.chmod(path, 0o644)
        path.write_bytes(data)
        with pytest.warns(RuntimeWarning, match="metadata is damaged"):
            assert CheckpointManager(run, read_only=True).all_steps() == [], what
    with pytest.raises(documents.DocumentError, match="execution_provider"):
        documents.parse(documents.METADATA, json.dumps({**good, "execution_provider": "x" * 201}), "m")


def test_inspect_lists_the_graphs_of_a_step(tmp_path, artifacts, capsys):
    with CheckpointManager(tmp_path / "run", artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        meta = manager.latest().metadata
    step = tmp_path / "run" / "step_00000001"
    assert cli_run(["inspect", str(step)]) == 0
    out = capsys.readouterr().out
    graphs = out.split("\ngraphs:\n")[1]
    for role in ("training", "eval", "optimizer"):
        entry = meta["artifacts"][role]
        line = next(line for line in graphs.splitlines() if line.startswith(role + " "))
        assert entry["name"] in line and entry["sha256"] in line
    assert cli_run(["inspect", "--json", str(step)]) == 0
    listed = json.loads(capsys.readouterr().out)["graphs"]
    assert listed == [{"role": role, **meta["artifacts"][role]} for role in ("eval", "optimizer", "training")]


def test_restore_training_without_onnxruntime_training_names_the_package(tmp_path, artifacts, monkeypatch):
    with CheckpointManager(tmp_path / "run", artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        monkeypatch.setitem(sys.modules, "onnxruntime.training", None)
        with pytest.raises(ImportError, match="onnxruntime-training"):
            manager.restore_training()


# --- s3:// ---------------------------------------------------------------------------------------


def keys(url: str, options: dict) -> list[str]:
    return sorted(k for k, _ in object_store.list_keys(targets.object_location(url, options)))


def test_on_s3_graphs_are_stored_once_verified_kept_while_needed_and_downloaded_checked(
    s3_server, s3_url, artifacts, capsys, aws_environment
):
    options = s3_server.storage_options()
    graph_keys = lambda: [k for k in keys(s3_url, options) if k.startswith("artifacts/")]  # noqa: E731
    original = {g: f"artifacts/{digest(artifacts / g)}.onnx" for g in GRAPHS}
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts, max_to_keep=2) as manager:
        manager.save(state(1), 1)
        manager.save(state(2), 2)
        assert graph_keys() == sorted(original.values())  # one object per graph, for both steps
        info = manager.latest()
        local = info.artifacts
        assert {role: path.read_bytes() for role, path in local.items()} == {
            role: (artifacts / f"{role}_model.onnx").read_bytes() for role in ("training", "eval", "optimizer")
        }
        assert manager.verify(2).files["training_model.onnx"] == digest(artifacts / "training_model.onnx")
        (artifacts / "eval_model.onnx").write_bytes(b"a new eval graph")
        manager.save(state(3), 3)  # step 1 goes; step 2 keeps the old eval graph
        assert original["eval_model.onnx"] in graph_keys() and len(graph_keys()) == 4
        manager.save(state(4), 4)  # step 2 goes: the old eval graph too
        assert original["eval_model.onnx"] not in graph_keys() and len(graph_keys()) == 3
        # A stored graph replaced by other bytes of its size: verify and the download refuse it.
        key = original["training_model.onnx"]
        location = targets.object_location(f"{s3_url}/{key}", options)
        data = bytearray(object_store.get(location))
        data[10] ^= 1
        object_store.put(location, bytes(data))
    reader = CheckpointManager(s3_url, storage_options=options, read_only=True)
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx"):
        reader.verify(4)
    # (this process downloaded it before it was replaced, checked: that copy is still the graph)
    assert digest(reader.latest().artifacts["training"]) == digest(artifacts / "training_model.onnx")
    local["training"].unlink()  # a fresh download from here on
    with pytest.raises(CheckpointIntegrityError, match="SHA-256"):
        _ = CheckpointManager(s3_url, storage_options=options, read_only=True).latest().artifacts
    # A size on record that is not the object's: nothing downloaded past it.
    object_store.put(location, bytes(data) * 1000)
    with pytest.raises(CheckpointIntegrityError, match="missing"):
        _ = CheckpointManager(s3_url, storage_options=options, read_only=True).latest().artifacts
    # ortckpt.verify of the step folder's URL on its own finds the graphs in its run.
    with pytest.raises(CheckpointIntegrityError, match=r"training_model\.onnx"):
        ortckpt.verify(f"{s3_url}/step_00000004", storage_options=options)
    object_store.put(location, (artifacts / "training_model.onnx").read_bytes())
    assert ortckpt.verify(f"{s3_url}/step_00000004", storage_options=options).files["eval_model.onnx"] == digest(
        artifacts / "eval_model.onnx"
    )
    # inspect lists the graphs of an s3:// step from its metadata.
    assert cli_run(["inspect", "--json", f"{s3_url}/step_00000004"]) == 0
    assert [g["role"] for g in json.loads(capsys.readouterr().out)["graphs"]] == ["eval", "optimizer", "training"]


def test_on_s3_a_save_killed_before_its_commit_leaves_graphs_the_sweep_removes(s3_server, s3_url, artifacts):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts) as manager:
        manager.save(state(1), 1)
    (artifacts / "eval_model.onnx").write_bytes(b"a new eval graph")
    new = f"artifacts/{digest(artifacts / 'eval_model.onnx')}.onnx"
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts) as manager:
        original = manager.store.commit
        manager.store.commit = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            manager.save(state(2), 2)
        manager.store.commit = original  # type: ignore[method-assign]
        assert new in keys(s3_url, options) and manager.all_steps() == [1]
        removed = manager.remove_leftovers()
        assert any(url.endswith(new) for url in removed)
        assert new not in keys(s3_url, options)
        manager.verify(1)


def test_async_saves_and_compressed_kept_steps_keep_their_graphs(tmp_path, artifacts):
    pytest.importorskip("zstandard")
    run = tmp_path / "run"
    with CheckpointManager(
        run, artifacts=artifacts, async_save=True, max_to_keep=1, keep_every=2, compress_kept=True, durable=False
    ) as manager:
        for step in range(1, 6):
            manager.save(state(step), step)
        manager.wait()
        assert manager.all_steps() == [2, 4, 5]
        kept = manager.all()[0]
        assert kept.compressed and sorted(kept.artifacts) == ["eval", "optimizer", "training"]
        for step in (2, 4, 5):
            manager.verify(step)
    assert set(stored(run).values()) == {4}  # three steps' links and the stored name


def test_a_graph_grown_past_an_onnx_models_size_is_refused_at_the_save(tmp_path, artifacts):
    run = tmp_path / "run"
    graph = tmp_path / "training.onnx"
    graph.write_bytes(b"a graph")
    with CheckpointManager(run, artifacts={"training": graph}, durable=False) as manager:
        manager.save(state(1), 1)
        with open(graph, "r+b") as f:  # sparse: no space taken, nothing copied
            f.truncate(documents.MAX_ARTIFACT_BYTES + 1)
        with pytest.raises(ValueError, match="more than an ONNX model can hold"):
            manager.save(state(2), 2)
        assert manager.all_steps() == [1]
    with CheckpointManager(run, read_only=True) as reader:  # no step left damaged
        assert reader.all_steps() == [1] and not any(p.name.startswith(".step_") for p in run.iterdir())
        reader.verify(1)


def test_on_s3_a_graph_another_jobs_sweep_removed_is_uploaded_again(s3_server, s3_url, artifacts):
    options = s3_server.storage_options()
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts) as manager:
        manager.save(state(1), 1)
        training = f"artifacts/{digest(artifacts / 'training_model.onnx')}.onnx"
        object_store.remove([targets.object_location(f"{s3_url}/{training}", options)])
        with pytest.raises(CheckpointIntegrityError, match="the graph training is gone"):
            manager.save(state(2), 2)
        manager.save(state(2), 2)  # uploaded again, not taken as there
        assert training in keys(s3_url, options)
        manager.verify(2)


def test_on_s3_a_reader_of_a_step_deleted_meanwhile_is_told_so(s3_server, s3_url, artifacts):
    options = s3_server.storage_options()
    # (a graph of its own: none this process downloaded before, which it would give from its cache)
    (artifacts / "training_model.onnx").write_bytes(s3_url.encode())
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts, max_to_keep=1) as manager:
        manager.save(state(1), 1)
        stale = CheckpointManager(s3_url, storage_options=options, read_only=True).latest()
        (artifacts / "training_model.onnx").write_bytes(b"a new training graph")
        manager.save(state(2), 2)  # step 1 retired, and the graph only it used
    with pytest.raises(FileNotFoundError, match="step 1 was deleted meanwhile"):
        _ = stale.artifacts


def test_the_same_script_resumes_where_the_artifacts_folder_is_missing(tmp_path, artifacts):
    """A step folder copied alone to another machine, resumed by the script that made it: the
    artifacts folder it names is not there, so the run's latest step's graphs are recorded again
    (from private copies, which retention deleting that step leaves)."""
    with CheckpointManager(tmp_path / "run", artifacts=artifacts, durable=False) as manager:
        manager.save(state(1), 1)
        manager.save(state(2), 2)
        recorded = manager.latest().metadata["artifacts"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(["cp", "-r", str(tmp_path / "run" / "step_00000002"), str(elsewhere)], check=True)
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(artifacts)
    with CheckpointManager(elsewhere, artifacts=artifacts, max_to_keep=1, durable=False) as manager:
        manager.save(state(3), 3)  # step 2 goes
        manager.save(state(4), 4)
        assert manager.all_steps() == [4] and manager.latest().metadata["artifacts"] == recorded
        assert manager.latest().metadata["execution_provider"] == "CPUExecutionProvider"
        manager.verify(4)
    assert sorted(stored(elsewhere)) == sorted(f"{e['sha256']}.onnx" for e in recorded.values())
    # Nothing records them, and they are missing: refused, naming the argument.
    with pytest.raises(FileNotFoundError, match="not a folder of training artifacts") as refused:
        CheckpointManager(tmp_path / "fresh", artifacts=artifacts)
    assert refused.value.argument == "artifacts"
    with pytest.raises(FileNotFoundError, match=r"artifacts\['eval'\]: .* is missing"):
        CheckpointManager(tmp_path / "fresh", artifacts={"eval": tmp_path / "gone.onnx"})


def test_on_s3_threads_fetching_one_graph_at_once_all_get_it_whole(s3_server, s3_url, artifacts):
    options = s3_server.storage_options()
    (artifacts / "training_model.onnx").write_bytes(os.urandom(4 << 20) + s3_url.encode())  # (none cached yet)
    with CheckpointManager(s3_url, storage_options=options, artifacts=artifacts) as manager:
        manager.save(state(1), 1)
    infos = [CheckpointManager(s3_url, storage_options=options, read_only=True).latest() for _ in range(6)]
    got: list[object] = []
    threads = [threading.Thread(target=lambda i=info: got.append(i.artifacts["training"])) for info in infos]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 6 and len(set(got)) == 1
    assert digest(got[0]) == digest(artifacts / "training_model.onnx")  # type: ignore[arg-type]
