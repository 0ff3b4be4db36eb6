"""Per-tensor checksums in every file ortckpt writes (issue 30): a flipped bit anywhere, a cut
file, a swapped file is caught by load_checkpoint(verify=True), ortckpt.verify and the manager,
naming the file and the tensor; files without checksums (ONNX Runtime's own, older ortckpt's)
verify as before and say so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState, OptimizerGroup, _boundary, verify
from ortckpt.cli import main as cli_main

ORT_VECTORS = Path(__file__).resolve().parents[1] / "data" / "ort-vectors"


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
            out["/".join(key[1:])] = (Path(f"{path}.data") if external else path, offset, length)
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
