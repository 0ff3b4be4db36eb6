"""Hostile directories (issue 15, findings 3, 4, 5 and 6): paths read from documents stay inside
their directory, no write follows a planted symlink, shards must match their index, and anything
that is not a regular file is refused before it is opened for reading."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from distributed_model import save_model
from ortckpt import (
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    SpecialFileError,
    _boundary,
    targets,
)
from ortckpt.cli import FAILED, run
from ortckpt.convert import format_of, load_any, load_safetensors, save_safetensors, state_from_onnx
from ortckpt.distributed import INDEX_NAME, SingleProcess, load_sharded, merge, save_sharded, shard_file_name

# --- finding 3: paths in documents ------------------------------------------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid checkpoint outside any step directory, which a hostile document points at."""
    path = tmp_path / "elsewhere" / "secret.ckpt"
    path.parent.mkdir()
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"secret": np.arange(4, dtype=np.float32)}), path)
    return path


def rewrite_json(path: Path, change: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    "escape", ["../../elsewhere/secret.ckpt", "ABSOLUTE", "shard-00000-of-00002/../x", ".", "shard-00001-of-00002"]
)
def test_a_shard_file_outside_its_name_is_refused_everywhere(tmp_path, outside, escape):
    run_dir = tmp_path / "run"
    save_model(run_dir, step=3, world=2)
    step_dir = run_dir / "step_00000003"
    target = str(outside) if escape == "ABSOLUTE" else escape

    def point_away(index):
        index["shards"][0]["file"] = target
        return index

    rewrite_json(step_dir / INDEX_NAME, point_away)
    with pytest.raises(CheckpointFormatError, match="shard") as e:
        load_sharded(run_dir, comm=SingleProcess())
    assert str(step_dir / INDEX_NAME) in str(e.value)
    with pytest.raises(CheckpointFormatError):
        merge(run_dir, tmp_path / "merged.ckpt")
    assert not (tmp_path / "merged.ckpt").exists()
    with pytest.raises(CheckpointIntegrityError):
        ortckpt.verify(step_dir)
    assert run(["verify", str(step_dir)]) == 1


def test_metadata_files_outside_the_step_directory_are_not_hashed(tmp_path, outside, capsys):
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 1)
    meta_path = tmp_path / "run" / "step_00000001" / "metadata.json"
    secret_sha = hashlib.sha256(outside.read_bytes()).hexdigest()
    for name in ("../../elsewhere/secret.ckpt", str(outside), "sub/dir", "..", ""):
        meta = json.loads(meta_path.read_text())
        meta["files"] = {"checkpoint": meta["files"]["checkpoint"], name: {"bytes": 1, "sha256": "0" * 64}}
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointIntegrityError) as e:
            ortckpt.verify(meta_path.parent)
        assert secret_sha not in str(e.value) and str(outside.stat().st_size) not in " ".join(e.value.problems)
        assert any("metadata.json" in p for p in e.value.problems), e.value.problems
        assert run(["verify", "--json", str(meta_path.parent)]) == 1
        out = capsys.readouterr().out
        assert secret_sha not in out


def test_checkpoint_info_load_refuses_an_escaping_shard(tmp_path, outside):
    run_dir = tmp_path / "run"
    with CheckpointManager(run_dir, comm=SingleProcess()) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 1)
    rewrite_json(
        run_dir / "step_00000001" / INDEX_NAME, lambda i: {**i, "shards": [{**i["shards"][0], "file": str(outside)}]}
    )
    with CheckpointManager(run_dir, read_only=True) as reader, pytest.raises(CheckpointFormatError):
        reader.latest().load()


# --- finding 4: planted symlinks --------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def test_save_safetensors_never_writes_through_a_symlink_at_a_temporary_name(tmp_path, victim):
    out = tmp_path / "m.safetensors"
    for name in [f".m.safetensors.ortckpt-tmp.{os.getpid()}", f".m.safetensors.ortckpt-tmp.{os.getpid() + 1}"]:
        (tmp_path / name).symlink_to(victim)
    save_safetensors(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), out)
    assert victim.read_text() == "precious"
    assert load_safetensors(out).parameters["w"].data.tolist() == [1, 1, 1]


def test_a_symlink_at_the_destination_is_replaced_not_followed(tmp_path, victim):
    for save in (save_safetensors, CheckpointState.save_checkpoint):
        link = tmp_path / "out"
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
        save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), link)
        assert victim.read_text() == "precious" and not link.is_symlink()


def test_metadata_json_is_never_written_through_a_planted_symlink(tmp_path, victim, monkeypatch):
    real_save = targets.LocalFile.save

    def save_and_plant(target, *args, **kwargs):  # an attacker who can write in the directory
        real_save(target, *args, **kwargs)
        (target.path.parent / "metadata.json").symlink_to(victim)

    monkeypatch.setattr(targets.LocalFile, "save", save_and_plant)
    with CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(OSError, match=r"metadata.json") as e:
            manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 1)
        assert e.value.errno in (errno.EEXIST, errno.ELOOP)
        assert manager.all_steps() == []
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


def test_the_sharded_index_is_never_written_through_a_planted_symlink(tmp_path, victim, monkeypatch):
    real_save = targets.LocalFile.save

    def save_and_plant(target, *args, **kwargs):
        real_save(target, *args, **kwargs)
        for pid in range(os.getpid() - 2, os.getpid() + 3):
            (target.path.parent / f".{INDEX_NAME}.tmp-{pid}").symlink_to(victim)

    monkeypatch.setattr(targets.LocalFile, "save", save_and_plant)
    save_sharded(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), tmp_path / "run", step=1)
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "run" / "step_00000001" / INDEX_NAME).read_text())["step"] == 1


def test_temporary_names_are_unpredictable(tmp_path, monkeypatch):
    """No temporary name a save uses is derived from the pid alone: two saves of one process use
    names no other process could plant in advance."""
    seen: list[str] = []
    real_stage, real_rename = _boundary.stage, _boundary.rename_directory

    def staged(*args, **kwargs):  # the core's staged files, which its one commit renames
        staging = real_stage(*args, **kwargs)
        seen.append(os.path.basename(staging.temporary()))
        return staging

    def renamed(src, dst, **kwargs):  # step directories, committed by renames
        seen.append(os.path.basename(src))
        return real_rename(src, dst, **kwargs)

    monkeypatch.setattr(_boundary, "stage", staged)
    monkeypatch.setattr(_boundary, "rename_directory", renamed)
    state = CheckpointState.from_arrays({"w": np.ones(3, np.float32)})
    for _ in range(2):
        save_safetensors(state, tmp_path / "m.safetensors")
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(state, 1)
        manager.save(state, 2)
    save_sharded(state, tmp_path / "sharded", step=1)
    save_sharded(state, tmp_path / "sharded", step=2)
    temporaries = [name for name in seen if name.startswith(".")]
    assert len(temporaries) >= 6 and len(set(temporaries)) == len(temporaries), temporaries
    assert not any(name.endswith(str(os.getpid())) for name in temporaries), temporaries


# --- finding 5: shards that disagree with their index -----------------------------------------------


def rewrite_shard(step_dir: Path, rank: int, world: int, change: Callable[[np.ndarray], np.ndarray]) -> None:
    path = step_dir / shard_file_name(rank, world)
    shard = CheckpointState.load_checkpoint(path)
    arrays = {n: np.array(p.data) for n, p in shard.parameters}
    arrays["embedding"] = change(arrays["embedding"])
    frozen = {n for n, p in shard.parameters if not p.requires_grad}
    new = CheckpointState.from_arrays(
        {n: a for n, a in arrays.items() if n not in frozen},
        {n: a for n, a in arrays.items() if n in frozen},
        dict(shard.properties),
    )
    new.optimizer_groups = {g: group for g, group in shard.optimizer_groups.items()}
    for moms in new.optimizer_groups["group0"].momentums.values():
        for m in list(moms):
            moms[m] = np.array(moms[m])
    CheckpointState.save_checkpoint(new, path, include_optimizer_state=True)


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a.astype(np.float64),
        lambda a: a.astype(np.int32),
        lambda a: a[:1],
        lambda a: a.reshape(-1),
    ],
    ids=["float64", "int32", "one-row", "flattened"],
)
def test_a_shard_that_disagrees_with_the_index_is_refused_naming_shard_and_tensor(tmp_path, change):
    save_model(tmp_path, step=4, world=2)
    step_dir = tmp_path / "step_00000004"
    rewrite_shard(step_dir, 1, 2, change)
    shard = str(step_dir / shard_file_name(1, 2))
    with pytest.raises(CheckpointFormatError, match="embedding") as e:
        load_sharded(tmp_path, comm=SingleProcess())
    assert shard in str(e.value)
    with pytest.raises(CheckpointFormatError, match="embedding"):
        merge(tmp_path, tmp_path / "merged.ckpt")
    with pytest.raises(CheckpointIntegrityError, match="embedding"):
        ortckpt.verify(step_dir)


# --- finding 6: anything but a regular file ----------------------------------------------------------


def finishes(call: Callable[[], Any], fifo: Path | None = None, timeout: float = 10) -> Any:
    """``call()``'s result or exception; fails (and unblocks the call) if it blocks on the FIFO."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if fifo is not None:  # let the blocked open return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail("blocked on a FIFO")
    if "error" in box:
        raise box["error"]
    return box.get("result")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_fifo_as_the_checkpoint_is_refused_without_blocking(fifo):
    with pytest.raises(SpecialFileError) as e:
        finishes(lambda: CheckpointState.load_checkpoint(fifo), fifo)
    assert e.value.filename == str(fifo) and "not a regular file" in str(e.value)
    assert isinstance(e.value, OSError) and isinstance(e.value, ortckpt.CheckpointError)


def test_a_fifo_as_the_data_file_is_refused_without_blocking(tmp_path):
    path = tmp_path / "ck"
    CheckpointState.save_checkpoint(
        CheckpointState.from_arrays({"w": np.ones(64, np.float32)}), path, external_data_threshold=0
    )
    data = tmp_path / "ck.data"
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(SpecialFileError) as e:
        finishes(lambda: CheckpointState.load_checkpoint(path), data)
    assert e.value.filename == str(data)


def test_a_directory_as_the_checkpoint_is_is_a_directory_error(tmp_path):
    with pytest.raises(IsADirectoryError) as e:
        CheckpointState.load_checkpoint(tmp_path)
    assert e.value.filename == str(tmp_path)
    with pytest.raises(IsADirectoryError):
        load_safetensors(tmp_path)


@pytest.mark.parametrize(
    "reader",
    [
        load_safetensors,
        lambda p: format_of(p, must_exist=True),
        lambda p: load_any(p, "safetensors"),
        state_from_onnx,
        lambda p: load_any(p, "ortckpt"),
    ],
    ids=["safetensors", "format_of", "load_any", "onnx", "load_any-ortckpt"],
)
def test_converters_refuse_a_fifo_without_blocking(fifo, reader):
    with pytest.raises(SpecialFileError):
        finishes(lambda: reader(fifo), fifo)


@pytest.mark.parametrize("args", [["inspect"], ["verify"], ["diff", "SELF"], ["convert", "OUT"], ["nominal", "OUT"]])
def test_the_command_refuses_a_fifo_in_one_line(fifo, tmp_path, capsys, args):
    argv = [args[0], str(fifo)] + [str(fifo) if a == "SELF" else str(tmp_path / "out.ckpt") for a in args[1:]]
    code = finishes(lambda: run(argv), fifo)
    err = capsys.readouterr().err
    assert code == FAILED, err
    assert err.count("\n") == 1 and str(fifo) in err and "not a regular file" in err, err


def test_verify_of_a_step_directory_whose_checkpoint_is_a_fifo(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 1)
    checkpoint = tmp_path / "step_00000001" / "checkpoint"
    checkpoint.unlink()
    os.mkfifo(checkpoint)
    with pytest.raises(CheckpointIntegrityError, match="not a regular file"):
        finishes(lambda: ortckpt.verify(checkpoint.parent), checkpoint)


def test_a_symlinked_member_of_a_step_directory_is_refused(tmp_path, outside):
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 1)
    step_dir = tmp_path / "run" / "step_00000001"
    (step_dir / "checkpoint").unlink()
    (step_dir / "checkpoint").symlink_to(outside)
    with pytest.raises(CheckpointIntegrityError) as e:
        ortckpt.verify(step_dir)
    assert hashlib.sha256(outside.read_bytes()).hexdigest() not in str(e.value)
    assert any(os.strerror(errno.ELOOP) in p or "symbolic link" in p for p in e.value.problems), e.value.problems
