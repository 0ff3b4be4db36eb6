"""Compressed checkpoints (ortckpt.compression, `ortckpt compress` / `decompress`): lossless to
the byte, floating-point bytes grouped, every file's SHA-256 checked, hostile archives refused."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import ortckpt
import ortckpt.compression
import pytest
import zstandard
from goldens import GOLDEN
from ortckpt import (
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    SpecialFileError,
)
from ortckpt.cli import FAILED, OK, run
from ortckpt.compression import (
    MAGIC,
    compress,
    decompress,
    decompress_to_memory,
    is_compressed,
    load_compressed,
    read_footer,
)

GOLDENS = ["trained_with_optimizer.ckpt", "protos.ckpt", "protos_nominal.ckpt", "protos_properties.ckpt"]


def weights_with_external_data(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    state = CheckpointState.from_arrays(
        {"w": rng.standard_normal((256, 64)).astype(np.float32), "steps": np.arange(9, dtype=np.int64)},
        {"h": rng.standard_normal(300).astype(np.float16)},
    )
    path = tmp_path / "ext.ckpt"
    CheckpointState.save_checkpoint(state, path, external_data_threshold=0)
    assert Path(f"{path}.data").exists()
    return path


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_checkpoints_come_back_byte_for_byte(tmp_path: Path, name: str) -> None:
    src = GOLDEN / name
    done = compress(src, tmp_path / "c.zst")
    assert done.size == src.stat().st_size and done.compressed_size == (tmp_path / "c.zst").stat().st_size
    assert is_compressed(tmp_path / "c.zst") and not is_compressed(src)
    decompress(tmp_path / "c.zst", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert not Path(f"{tmp_path / 'back'}.data").exists()


def test_external_data_travels_in_the_same_archive(tmp_path: Path) -> None:
    src = weights_with_external_data(tmp_path)
    compress(src, tmp_path / "c.zst")
    decompress(tmp_path / "c.zst", tmp_path / "back.ckpt")
    assert (tmp_path / "back.ckpt").read_bytes() == src.read_bytes()
    assert (tmp_path / "back.ckpt.data").read_bytes() == Path(f"{src}.data").read_bytes()
    loaded, original = load_compressed(tmp_path / "c.zst"), CheckpointState.load_checkpoint(src)
    for name, parameter in original.parameters:
        assert np.array_equal(loaded.parameters[name].data, parameter.data)
    assert not list(Path(tempfile.gettempdir()).glob("ortckpt-decompressed-*"))  # the scratch copy is gone


def test_float_bytes_are_grouped_in_the_frame(tmp_path: Path) -> None:
    """The frame holds each float tensor's first bytes, then its second bytes, and so on."""
    src = weights_with_external_data(tmp_path)
    archive = tmp_path / "c.zst"
    compress(src, archive)
    with open(archive, "rb") as f:
        footer = read_footer(f, str(archive))
        data_entry = footer["files"][1]
        f.seek(data_entry["frame_offset"])
        frame = zstandard.ZstdDecompressor().decompress(f.read(data_entry["frame_size"]))
    original = Path(f"{src}.data").read_bytes()
    assert len(frame) == len(original) and frame != original
    regions = {itemsize: (offset, length) for offset, length, itemsize in data_entry["grouped"]}
    assert sorted(regions) == [2, 4]  # the float16 and the float32 tensors; the int64 one is not grouped
    offset, length = regions[4]
    expected = np.frombuffer(original[offset : offset + length], np.uint8).reshape(-1, 4).T.tobytes()
    assert frame[offset : offset + length] == expected


def test_a_damaged_archive_never_replaces_a_file(tmp_path: Path) -> None:
    src = GOLDEN / "trained_with_optimizer.ckpt"
    archive = tmp_path / "c.zst"
    compress(src, archive)
    data = bytearray(archive.read_bytes())
    footer = read_footer(open(archive, "rb"), str(archive))  # noqa: SIM115
    (tmp_path / "out").write_bytes(b"previous")
    middle = footer["files"][0]["frame_offset"] + footer["files"][0]["frame_size"] // 2
    data[middle] ^= 0xFF
    (tmp_path / "bad.zst").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match="checkpoint: "):
        decompress(tmp_path / "bad.zst", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.zst", "c.zst", "out"]  # no temporary left


def footer_rewritten(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    archive = tmp_path / "c.zst"
    compress(GOLDEN / "trained_with_optimizer.ckpt", archive)
    data = archive.read_bytes()
    length = int.from_bytes(data[-16:-8], "little")
    footer = json.loads(data[-16 - length : -16])
    change(footer)
    text = json.dumps(footer).encode()
    out = tmp_path / "hostile.zst"
    out.write_bytes(data[: -16 - length] + text + len(text).to_bytes(8, "little") + MAGIC)
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.update(version=9), "compressed checkpoint version 9"),
        (lambda f: f["files"][0].update(role="external data"), "files\\[0\\].role"),
        (lambda f: f["files"][0]["grouped"].append([10**6, 4, 4]), "inside the file"),
        (lambda f: f["files"][0]["grouped"].insert(0, [0, 6, 4]), "of whole elements"),
        (lambda f: f["files"][0].update(frame_size=10**9), "run into the footer"),
        (lambda f: f["files"][0].update(sha256="../../etc/passwd"), "64 lowercase hex"),
        (lambda f: f.update(files=[f["files"][0]] * 3), "files lists 3 files"),
        (lambda f: f.update(block_elements=2**30), "block_elements"),
    ],
)
def test_a_hostile_footer_is_refused_before_anything_is_written(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    hostile = footer_rewritten(tmp_path, change)
    with pytest.raises(CheckpointFormatError, match=message):
        decompress(hostile, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_footer_claiming_a_huge_checkpoint_allocates_nothing(tmp_path: Path) -> None:
    hostile = footer_rewritten(tmp_path, lambda f: f["files"][0].update(size=2**40))
    with pytest.raises(CheckpointFormatError, match="claims a checkpoint of 1099511627776 bytes"):
        decompress_to_memory(hostile)
    with pytest.raises(CheckpointIntegrityError, match="the frame ends early"):
        decompress(hostile, tmp_path / "out")  # streamed: it stops where the frame does
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "data",
    [b"", b"ORTCKPTZ", MAGIC + b"x" * 40, MAGIC + (2**62).to_bytes(8, "little") + MAGIC, b"not an archive" * 9],
)
def test_what_is_not_an_archive_says_so(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "x.zst").write_bytes(data)
    with pytest.raises(CheckpointFormatError):
        decompress(tmp_path / "x.zst", tmp_path / "out")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SpecialFileError):
        decompress(tmp_path / "fifo", tmp_path / "out")
    assert not is_compressed(tmp_path / "fifo")


def test_a_planted_symlink_at_the_destination_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "c.zst").symlink_to(victim)
    compress(GOLDEN / "protos.ckpt", tmp_path / "c.zst")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "c.zst").is_symlink()


def test_the_command_compresses_and_decompresses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = weights_with_external_data(tmp_path)
    assert run(["compress", str(src), str(tmp_path / "c.zst"), "--json"]) == OK
    report = json.loads(capsys.readouterr().out)
    assert report["bytes"] == src.stat().st_size + Path(f"{src}.data").stat().st_size
    assert run(["decompress", str(tmp_path / "c.zst"), str(tmp_path / "back.ckpt")]) == OK
    assert (tmp_path / "back.ckpt.data").read_bytes() == Path(f"{src}.data").read_bytes()
    assert run(["decompress", str(src), str(tmp_path / "x")]) == FAILED
    assert "not a compressed checkpoint" in capsys.readouterr().err


# --- CheckpointManager(compress_kept=True) ------------------------------------------------------


def state_of(step: int) -> CheckpointState:
    rng = np.random.default_rng(step)
    return CheckpointState.from_arrays(
        {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)},
        {"ids": np.arange(step, step + 5, dtype=np.int64)},
    )


def same(a: CheckpointState, b: CheckpointState) -> bool:
    return all(np.array_equal(a.parameters[n].data, p.data) for n, p in b.parameters)


def test_steps_kept_only_by_keep_every_are_compressed_and_restore(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        for step in range(1, 6):
            manager.save(state_of(step), step)
        assert manager.all_steps() == [2, 4, 5]
        assert [c.compressed for c in manager.all()] == [True, True, False]
        for step in (2, 4):
            directory = tmp_path / f"step_{step:08d}"
            assert sorted(p.name for p in directory.iterdir()) == ["checkpoint.zst", "metadata.json"]
            assert same(manager.restore(step), state_of(step))
            verified = ortckpt.verify(directory)
            assert set(verified.files) == {"checkpoint.zst", "checkpoint"} and verified.tensors == 3
        assert not manager.latest().compressed and manager.latest().path.exists()  # the latest: never
    reader = CheckpointManager(tmp_path, read_only=True)
    assert [c.compressed for c in reader.all()] == [True, True, False] and same(reader.restore(2), state_of(2))


def test_keep_best_alone_compresses_the_best_once_they_are_not_the_latest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_best=("loss", "min", 2), compress_kept=True) as manager:
        for step, loss in [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.2)]:
            manager.save(state_of(step), step, metrics={"loss": loss})
        assert manager.all_steps() == [2, 4] and [c.compressed for c in manager.all()] == [True, False]
        assert manager.best().step == 2 and same(manager.restore(manager.best().step), state_of(2))


def test_a_damaged_archive_fails_verification(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        for step in range(1, 4):
            manager.save(state_of(step), step)
    archive = tmp_path / "step_00000002" / "checkpoint.zst"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(archive, 0o644)
    archive.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"checkpoint\.zst: SHA-256"):
        ortckpt.verify(archive.parent)


def test_every_crash_point_of_a_compression_leaves_a_step_that_loads_and_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ortckpt.manager.checkpoint_manager as manager_module
    from ortckpt.manager import metadata

    def crash(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    directory = tmp_path / "step_00000002"
    with CheckpointManager(tmp_path, max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        manager.save(state_of(2), 2)
        # 1: the archive cannot be written; 2: metadata.json cannot be rewritten; 3: the old files stay.
        for point, (target, name) in enumerate(
            [(ortckpt.compression, "compress"), (metadata, "rewrite"), (manager_module.os, "unlink")], 1
        ):
            with monkeypatch.context() as m:
                m.setattr(target, name, crash)
                with pytest.warns(RuntimeWarning, match="could not compress the checkpoint of step"):
                    manager.save(state_of(2 + point), 2 + point)  # step 2 is no longer the latest
            assert same(CheckpointManager(tmp_path, read_only=True).restore(2), state_of(2)), point
            assert ortckpt.verify(directory).tensors == 3, point
        assert (directory / "checkpoint").exists() and manager.all()[0].compressed  # left by crash point 3
        manager.save(state_of(6), 6)  # retried: the old files go
        assert sorted(p.name for p in directory.iterdir()) == ["checkpoint.zst", "metadata.json"]
        assert same(manager.restore(2), state_of(2))


def test_an_info_read_before_its_step_was_compressed_still_loads(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        manager.save(state_of(2), 2)
        stale = CheckpointManager(tmp_path, read_only=True).latest()  # a reader's view: not compressed
        manager.save(state_of(3), 3)
    assert stale is not None and not stale.compressed and not stale.path.exists()
    assert same(stale.load(), state_of(2))  # the archive was there before the checkpoint went


def test_a_symlink_planted_as_a_steps_archive_is_never_followed(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", max_to_keep=1, keep_every=2, compress_kept=True) as manager:
        for step in range(1, 4):
            manager.save(state_of(step), step)
    step_dir = tmp_path / "run" / "step_00000002"
    elsewhere = tmp_path / "elsewhere.zst"
    compress(GOLDEN / "trained_with_optimizer.ckpt", elsewhere)  # a valid archive, of another checkpoint
    (step_dir / "checkpoint.zst").unlink()
    (step_dir / "checkpoint.zst").symlink_to(elsewhere)
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    with pytest.raises(OSError) as e:  # opened with O_NOFOLLOW: the link itself is refused, no check-then-open race
        reader.restore(2)
    assert e.value.errno == errno.ELOOP
    with pytest.raises(CheckpointIntegrityError, match=r"checkpoint\.zst"):
        ortckpt.verify(step_dir)
