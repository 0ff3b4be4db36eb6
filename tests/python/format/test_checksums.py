"""Per-tensor checksums in every file ortckpt writes (issue 30): a flipped bit anywhere, a cut
file, a swapped file is caught by load_checkpoint(verify=True), ortckpt.verify and the manager,
naming the file and the tensor; files without checksums (ONNX Runtime's own, older ortckpt's)
verify as before and say so."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState, OptimizerGroup, _boundary, verify
from ortckpt.cli import main as cli_main

ORT_VECTORS = Path(__file__).resolve().parents[2] / "data" / "ort-vectors"


def rich_state() -> CheckpointState:
    """Tensors large and small (inline beside external ones), an empty one, a momentum, properties."""
    rng = np.random.default_rng(7)
    state = CheckpointState.from_arrays(
        {"big": rng.standard_normal(300).astype(np.float32), "small": np.arange(3, dtype=np.int32)},
        {"frozen": rng.standard_normal((8, 9)).astype(np.float64), "empty": np.zeros(0, np.float32)},
        {"epoch": 3, "lr": 0.5, "note": "checksums"},
    )
    state.optimizer_groups["g"] = OptimizerGroup(
        step=2, initial_learning_rate=1e-3, momentums={"big": {"m0": np.ones(300, np.float32)}}
    )
    return state


def save(path: Path, *, external: bool) -> None:
    threshold = 0 if external else _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
    CheckpointState.save_checkpoint(rich_state(), path, True, external_data_threshold=threshold)


def flipped(path: Path, at: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))


def tensor_ranges(path: Path) -> dict[str, tuple[Path, int, int]]:
    """Where each tensor's bytes lie: {name: (file, offset, length)}, from the core's own decoding."""
    loaded = _boundary.load(path)
    out = {}
    for key, (_name, _code, _dims, stored) in loaded.tensors():
        if isinstance(stored, tuple) and stored[1]:  # (offset, length, external?), some bytes
            offset, length, external = stored
            out[key.label] = (Path(f"{path}.data") if external else path, offset, length)
    return out


def assert_caught(path: Path, *, tensor: str | None, file: Path, what: str) -> None:
    """verify, load_checkpoint(verify=True) and the CLI all refuse ``path``, naming file (and tensor)."""
    for check in (lambda: verify(path), lambda: ortckpt.load_checkpoint(path, verify=True)):
        with pytest.raises(CheckpointIntegrityError) as e:
            check()
        assert len(e.value.problems) == 1, e.value.problems
        assert e.value.problems[0].startswith(f"{file}: "), e.value.problems
        assert what in e.value.problems[0], e.value.problems
        if tensor is not None:
            assert e.value.tensor == tensor and f"tensor '{tensor}'" in e.value.problems[0]


def test_every_file_carries_checksums_and_verifies(tmp_path):
    for external in (False, True):
        path = tmp_path / f"c{external}.ckpt"
        save(path, external=external)
        assert Path(f"{path}.data").exists() == external
        checked = _boundary.verify_checksums(path)
        assert checked is not None and checked[0] == 5  # big, small, frozen, empty, g/big/m0
        result = verify(path)
        assert result.checksums and result.tensors == 5
        state = ortckpt.load_checkpoint(path, verify=True)
        np.testing.assert_array_equal(state.parameters["big"].data, rich_state().parameters["big"].data)
        # The root identifies the file: read from its last bytes, equal to what verification found.
        assert _boundary.checksum_root(path) == (path.stat().st_size, checked[2])


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_a_flipped_bit_in_any_tensor_names_the_file_and_the_tensor(tmp_path, external):
    original = tmp_path / "original.ckpt"
    save(original, external=external)
    ranges = tensor_ranges(original)
    assert {"big", "small", "frozen", "g/big/m0"} <= ranges.keys()
    assert any(f.suffix == ".data" for f, _, _ in ranges.values()) == external
    for name, (file, offset, length) in ranges.items():
        for at, bit in ((offset, 0), (offset + length - 1, 7)):
            path = tmp_path / "c.ckpt"
            shutil.copy(original, path)
            if external:
                shutil.copy(f"{original}.data", f"{path}.data")
            target = path if file == original else Path(f"{path}.data")
            flipped(target, at, bit)
            assert_caught(path, tensor=name, file=target, what="bytes differ from their checksum")


def test_a_flipped_bit_in_a_name_or_a_property_is_caught(tmp_path):
    for needle in (b"frozen", b"checksums", b"epoch"):
        path = tmp_path / "c.ckpt"
        save(path, external=False)
        at = path.read_bytes().index(needle)
        flipped(path, at + 1, 0)  # a name, a string property, a property's name
        assert_caught(path, tensor=None, file=path, what="metadata")


def test_a_flipped_bit_in_the_checksum_block_or_trailer_is_caught(tmp_path):
    original = tmp_path / "original.ckpt"
    save(original, external=False)
    size = original.stat().st_size
    block = 8 * 6 + 32  # five tensors' and the metadata's sums, the footer
    for at in range(size - 32 - block, size):
        path = tmp_path / "c.ckpt"
        shutil.copy(original, path)
        flipped(path, at, at % 8)
        with pytest.raises(CheckpointIntegrityError) as e:
            ortckpt.load_checkpoint(path, verify=True)
        assert str(path) in e.value.problems[0] and "checksum" in e.value.problems[0], (at, e.value.problems)


def test_a_truncated_file_is_caught(tmp_path):
    original = tmp_path / "original.ckpt"
    save(original, external=False)
    data = original.read_bytes()
    for cut in (1, 16, 32, 40, 200):
        path = tmp_path / "c.ckpt"
        path.write_bytes(data[:-cut])
        with pytest.raises(CheckpointIntegrityError) as e:
            verify(path)
        assert str(path) in e.value.problems[0], (cut, e.value.problems)


def test_files_of_onnx_runtime_verify_as_no_checksums(tmp_path):
    for name in ("trained_with_optimizer.ckpt", "protos_properties.ckpt", "protos_nominal.ckpt"):
        path = tmp_path / name
        shutil.copy(ORT_VECTORS / name, path)
        assert _boundary.verify_checksums(path) is None
        result = verify(path)
        assert not result.checksums
        ortckpt.load_checkpoint(path, verify=True)  # loads as without verify


def test_the_cli_says_no_checksums(tmp_path, capsys):
    ort_file = tmp_path / "ort.ckpt"
    shutil.copy(ORT_VECTORS / "trained_with_optimizer.ckpt", ort_file)
    ours = tmp_path / "ours.ckpt"
    save(ours, external=False)
    for path, expected in ((ort_file, False), (ours, True)):
        with pytest.raises(SystemExit) as done:
            cli_main(["verify", "--json", str(path)])
        assert done.value.code == 0
        assert json.loads(capsys.readouterr().out)["checksums"] is expected
        with pytest.raises(SystemExit):
            cli_main(["verify", str(path)])
        assert ("no checksums" in capsys.readouterr().out) is not expected


def test_a_manager_step_records_checksums_not_digests_and_verifies(tmp_path):
    with CheckpointManager(tmp_path, external_data_threshold=0) as manager:
        manager.save(rich_state(), 1)
        info = manager.latest()
    files = info.metadata["files"]
    checkpoint, data = info.directory / "checkpoint", info.directory / "checkpoint.data"
    assert files["checkpoint"] == {
        "bytes": checkpoint.stat().st_size,
        "xxh3": f"{_boundary.checksum_root(checkpoint)[1]:016x}",
    }
    assert files["checkpoint.data"] == {"bytes": data.stat().st_size, "pair": data.read_bytes()[-16:].hex()}
    assert verify(info.directory).checksums

    # A checkpoint swapped for another save's of the same state and step: only its root differs.
    with CheckpointManager(tmp_path / "other", external_data_threshold=0) as manager:
        manager.save(rich_state(), 1)
        other = manager.latest().directory / "checkpoint"
    assert other.stat().st_size == checkpoint.stat().st_size
    shutil.copy(other, checkpoint)
    with pytest.raises(CheckpointIntegrityError, match=r"checksum root [0-9a-f]{16} differs from metadata's"):
        verify(info.directory)
    with pytest.raises(CheckpointIntegrityError):
        CheckpointManager(tmp_path, read_only=True).verify(1)


def test_digest_sha256_records_sha256_too(tmp_path):
    import hashlib

    with CheckpointManager(tmp_path, digest="sha256") as manager:
        manager.save(rich_state(), 1)
        info = manager.latest()
    entry = info.metadata["files"]["checkpoint"]
    assert entry["sha256"] == hashlib.sha256((info.directory / "checkpoint").read_bytes()).hexdigest()
    assert len(entry["xxh3"]) == 16
    assert verify(info.directory).files["checkpoint"] == entry["sha256"]
    with pytest.raises(ortckpt.InvalidArgumentError, match="digest"):
        CheckpointManager(tmp_path / "x", digest="md5")  # type: ignore[arg-type]


def test_an_older_step_with_sha256_entries_and_no_checksums_still_verifies_and_restores(tmp_path):
    """A step as an older ortckpt recorded it: SHA-256 entries, a file without checksums (ONNX
    Runtime's own stands in for an older ortckpt's)."""
    import hashlib

    with CheckpointManager(tmp_path) as manager:
        manager.save(rich_state(), 1)
        info = manager.latest()
    checkpoint, old = info.directory / "checkpoint", ORT_VECTORS / "trained_no_optimizer.ckpt"
    shutil.copy(old, checkpoint)
    meta_path = info.directory / "metadata.json"
    meta = json.loads(meta_path.read_text())
    digest = hashlib.sha256(old.read_bytes()).hexdigest()
    meta["files"] = {"checkpoint": {"bytes": old.stat().st_size, "sha256": digest}}
    meta_path.write_text(json.dumps(meta))
    result = verify(info.directory)
    assert not result.checksums and result.files == {"checkpoint": digest}
    restored = CheckpointManager(tmp_path, read_only=True).restore(1)
    assert {n for n, _ in restored.parameters} == {n for n, _ in ortckpt.load_checkpoint(old).parameters}
    flipped(checkpoint, 100)
    with pytest.raises(CheckpointIntegrityError, match="SHA-256"):
        verify(info.directory)


def test_arithmetic_outputs_carry_checksums_of_their_values(tmp_path):
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    save(a, external=False)
    save(b, external=True)
    out = tmp_path / "avg.ckpt"
    ortckpt.average([a, b], out=out)
    assert _boundary.verify_checksums(out) is not None
    assert verify(out).checksums


def checksum_block(path: Path) -> tuple[list[int], int, bytes]:
    """(each tensor's sum, the metadata's sum, the root and pair id) of a file's checksum block
    (src/format/checksums.rs: the sums, count, version, root, magic; the 32-byte pair trailer)."""
    data = path.read_bytes()
    footer = data[-32 - 32 : -32]
    assert footer[16:] == b"ortckpt sums xx3"
    count = int.from_bytes(footer[:4], "little")
    body = data[-32 - 32 - 8 * (count + 1) : -32 - 32]
    sums = [int.from_bytes(body[i : i + 8], "little") for i in range(0, len(body), 8)]
    return sums[:-1], sums[-1], footer[8:16] + data[-16:]


def mixed_sources(tmp_path: Path, *, external: bool) -> list[Path]:
    """Sources with tensors the kernel computes (several chunks, inline or in the data file, a
    float16 one, an empty one), one NumPy's path computes (float8) and ones copied."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    paths = []
    for i in range(3):
        state = CheckpointState.from_arrays(
            {
                "w": rng.standard_normal(3 * (1 << 16) + 5).astype(np.float32),
                "h": rng.standard_normal(1000).astype(np.float16),
                "f8": rng.standard_normal(64).astype(ml_dtypes.float8_e4m3fn),
                "d": rng.standard_normal(7),
                "empty": np.zeros(0, np.float32),
            },
            {"frozen": np.arange(5, dtype=np.int64)},
            {"step": 4},
        )
        paths.append(tmp_path / f"src{i}.ckpt")
        threshold = 0 if external else _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
        CheckpointState.save_checkpoint(state, paths[-1], external_data_threshold=threshold)
    return paths


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external data"])
def test_an_averages_checksums_are_what_a_save_of_its_result_writes(tmp_path, external):
    """The kernel sums its values as it writes them and the output is sealed with those sums
    (no read-back): the block is the one save_checkpoint writes of the same state, sum for sum
    (and the file byte for byte inline, where the pair id is derived from the sums; a data
    file's pair id is drawn at random, so there the root and the trailers differ)."""
    threshold = 0 if external else _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # The same name in two folders: a file's metadata holds its data file's name.
    out, again = tmp_path / "a" / "avg.ckpt", tmp_path / "b" / "avg.ckpt"
    result = ortckpt.average(
        mixed_sources(tmp_path, external=external), [1.0, 2.0, 0.5], out=out, external_data_threshold=threshold
    )
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(out), again, external_data_threshold=threshold)
    got, expected = checksum_block(out), checksum_block(again)
    assert got[:2] == expected[:2]
    assert len(got[0]) == 6 and len(set(got[0])) == 6
    if external:
        # The data files' values alike, their pair trailers (32 bytes) drawn apart.
        assert Path(f"{out}.data").read_bytes()[:-32] == Path(f"{again}.data").read_bytes()[:-32]
    else:
        assert out.read_bytes() == again.read_bytes()
    assert verify(out).checksums
    assert np.array_equal(result.parameters["w"].data, CheckpointState.load_checkpoint(again).parameters["w"].data)


def staged_with_a_hole(tmp_path: Path, external: bool) -> tuple[Any, int, Path, np.ndarray]:
    """A staged save whose tensor "w" is a hole (as arithmetic stages its output), filled in
    place: (staging, its offset, the checkpoint's path, the values)."""
    import os

    values = np.arange(5000, dtype=np.float32)
    hole = np.zeros(5000, np.float32)
    state = CheckpointState.from_arrays({"w": hole, "b": np.ones(3, np.float32)})
    path = tmp_path / "staged.ckpt"
    threshold = 0 if external else _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
    staging, placed = _boundary.save_staged(
        path, state.core_state(False), external_data_threshold=threshold, holes=[hole.ctypes.data]
    )
    offset, in_data = placed[hole.ctypes.data]
    assert in_data == external
    os.pwrite(staging.fileno(data=external), values.tobytes(), offset)
    return staging, offset, path, values


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external data"])
def test_reseal_takes_the_sums_given_and_reads_only_the_ones_not_given(tmp_path, external):
    """A sum given is written as given, never checked against the file (so a wrong one is
    caught by verify, naming the tensor); a tensor given without a sum is read and summed."""
    staging, offset, path, values = staged_with_a_hole(tmp_path, external)
    staging.reseal([(external, offset, None)])
    staging.commit()
    assert verify(path).checksums
    assert np.array_equal(CheckpointState.load_checkpoint(path).parameters["w"].data, values)

    staging, offset, path, _ = staged_with_a_hole(tmp_path, external)
    staging.reseal([(external, offset, 12345)])
    staging.commit()
    with pytest.raises(CheckpointIntegrityError, match="differ from their checksum") as caught:
        verify(path)
    assert caught.value.tensor == "w"


@pytest.mark.parametrize("filled", [[(False, 3, None)], [(True, 0, 1)]], ids=["no tensor there", "no data file"])
def test_reseal_refuses_a_place_no_tensor_holds(tmp_path, filled):
    staging, offset, _, _ = staged_with_a_hole(tmp_path, False)
    try:
        with pytest.raises(ortckpt.CheckpointStateError, match="reseal: no one tensor"):
            staging.reseal(filled)
        with pytest.raises(ortckpt.CheckpointStateError, match="listed twice"):
            staging.reseal([(False, offset, None), (False, offset, 1)])
    finally:
        staging.discard()


def unsealed(path: Path) -> tuple[bytes, bytes | None]:
    """The files ortckpt saved at ``path`` without their checksum block and pair trailers: as
    another writer (ONNX Runtime's saver) leaves a checkpoint."""
    main = path.read_bytes()
    count = sum(1 for _ in _boundary.load(path).tensors())
    main = main[: len(main) - (8 * (count + 1) + 32) - 32]  # (the block: sums, footer; the trailer)
    data_path = Path(f"{path}.data")
    return main, data_path.read_bytes()[:-32] if data_path.exists() else None


@pytest.mark.parametrize("external", [False, True])
def test_a_checkpoint_another_writer_wrote_into_the_staged_files_is_sealed_then_committed(
    tmp_path: Path, external: bool
) -> None:
    """What ONNX Runtime's saver writes into a staged save's files (live.save_through_ort) gets
    ortckpt's checksums and pair trailers, and replaces the checkpoint there (of either layout)."""
    source = tmp_path / "source.ckpt"
    save(source, external=external)
    main, data = unsealed(source)
    if not external:  # (a file without a block, as ONNX Runtime's)
        (tmp_path / "bare.ckpt").write_bytes(main)
        assert not verify(tmp_path / "bare.ckpt").checksums
        (tmp_path / "bare.ckpt").unlink()
    target = tmp_path / "target.ckpt"
    save(target, external=not external)  # (an earlier checkpoint in its place, the other layout)
    staging = _boundary.stage(target, with_data=True)
    os.write(staging.fileno(), main)
    if data is not None:
        os.write(staging.fileno(data=True), data)
    staging.seal()
    staging.commit()
    checked = verify(target)
    assert checked.checksums and checked.tensors == 5
    assert Path(f"{target}.data").exists() == external  # (the earlier data file went with its checkpoint)
    if external:
        x, y = CheckpointState.load_checkpoint(target), rich_state()
        assert {k: v.data.tobytes() for k, v in x.parameters} == {k: v.data.tobytes() for k, v in y.parameters}
        assert x.optimizer_groups["g"].momentums["big"]["m0"].tobytes() == np.ones(300, np.float32).tobytes()
        assert dict(x.properties) == dict(y.properties)
    else:  # (its pair id comes from its checksums, as a save of ortckpt's own: the same bytes)
        assert target.read_bytes() == source.read_bytes()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


def test_a_staged_checkpoint_torn_sealed_already_or_without_its_data_file_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "source.ckpt"
    save(source, external=True)
    main, data = unsealed(source)
    assert data is not None
    target = tmp_path / "target.ckpt"
    save(target, external=False)
    before = target.read_bytes()
    cases = [
        (True, main[: len(main) // 2], ortckpt.CheckpointFormatError, ""),
        (True, source.read_bytes(), ortckpt.CheckpointStateError, "sealed already"),
        (False, main, ortckpt.CheckpointStateError, "no data file is staged"),
    ]
    for with_data, written, error, message in cases:
        staging = _boundary.stage(target, with_data=with_data)
        os.write(staging.fileno(), written)
        with pytest.raises(error, match=message or None):
            staging.seal()
        staging.discard()
        assert target.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["source.ckpt", "source.ckpt.data", "target.ckpt"]
