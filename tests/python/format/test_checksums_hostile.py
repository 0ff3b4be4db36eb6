"""Checksum blocks a hostile file makes up: each is a typed error naming the file, and no count
it claims sizes what is read into memory."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ortckpt import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    _boundary,
    load_checkpoint,
    verify,
)

FOOTER_AND_TRAILER = 64  # count, version, root, magic; the pair trailer


def saved(path: Path, values: np.ndarray) -> bytes:
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"a": values, "b": np.ones((3, 4), np.int64)}), path)
    return path.read_bytes()


def with_word(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<I", out, at, value)
    return bytes(out)


def refused_everywhere(path: Path, what: str, root_what: str | None = None) -> None:
    """Every check refuses ``path`` saying ``what`` (``root_what`` for checksum_root, which reads
    only the block)."""
    for check, said in (
        (lambda: _boundary.verify_checksums(path), what),
        (lambda: _boundary.checksum_root(path), root_what or what),
        (lambda: load_checkpoint(path, verify=True), what),
        (lambda: verify(path), what),
    ):
        with pytest.raises(CheckpointIntegrityError) as e:
            check()
        assert e.value.problems[0].startswith(f"{path}: ") and said in e.value.problems[0], e.value.problems


@pytest.mark.parametrize(
    ("count", "what", "root_what"),
    [
        (2**32 - 1, "claims 4294967295 tensors, more than the file holds", None),
        (3, "the checkpoint lists 2 tensors, its checksum block 3", "its own checksum differs"),
        (0, "the checkpoint lists 2 tensors, its checksum block 0", "its own checksum differs"),
    ],
)
def test_a_count_the_file_cannot_hold_or_that_disagrees(tmp_path, count, what, root_what):
    path = tmp_path / "c"
    data = saved(path, np.arange(10, dtype=np.float32))
    path.write_bytes(with_word(data, len(data) - FOOTER_AND_TRAILER, count))
    refused_everywhere(path, what, root_what)


def test_a_block_of_an_unknown_version_is_named(tmp_path):
    path = tmp_path / "c"
    data = saved(path, np.arange(10, dtype=np.float32))
    path.write_bytes(with_word(data, len(data) - FOOTER_AND_TRAILER + 4, 2))
    refused_everywhere(path, "checksum block version 2: this ortckpt reads version 1")


def test_a_whole_block_grafted_from_another_checkpoint_names_the_tensor(tmp_path):
    # Its root matches (it is a real block, with its own trailer), its sums do not.
    path, other = tmp_path / "c", tmp_path / "other"
    data = saved(path, np.arange(10, dtype=np.float32))
    donor = saved(other, np.arange(10, 20, dtype=np.float32))
    block = 8 * 3 + FOOTER_AND_TRAILER
    path.write_bytes(data[:-block] + donor[-block:])
    assert _boundary.checksum_root(path) == (len(data), _boundary.checksum_root(other)[1])
    for check in (lambda: verify(path), lambda: load_checkpoint(path, verify=True)):
        with pytest.raises(CheckpointIntegrityError) as e:
            check()
        assert e.value.tensor == "a" and e.value.problems[0].startswith(f"{path}: tensor 'a'"), e.value.problems


def test_a_block_alone_is_no_checkpoint(tmp_path):
    path = tmp_path / "c"
    data = saved(path, np.arange(10, dtype=np.float32))
    path.write_bytes(data[-(8 * 3 + FOOTER_AND_TRAILER) :])
    with pytest.raises(CheckpointError, match="not an ONNX Runtime training checkpoint"):
        load_checkpoint(path, verify=True)
    with pytest.raises(CheckpointIntegrityError, match="not an ONNX Runtime training checkpoint"):
        verify(path)


# The peak is VmHWM (this process's own): ru_maxrss would carry over the parent's across exec.
MEASURE = """
import sys
from ortckpt import CheckpointIntegrityError, _boundary
for check in (_boundary.checksum_root, _boundary.verify_checksums):
    try:
        check(sys.argv[1])
    except CheckpointIntegrityError as e:
        print(e.problems[0])
    except Exception as e:
        print(type(e).__name__, e)
status = open("/proc/self/status").read().split("VmHWM:")[1]
print(int(status.split()[0]) // 1024)
"""


def test_a_count_claiming_a_huge_file_never_sizes_an_allocation(tmp_path):
    # 1 GiB (sparse: no disk), its footer claiming a block of almost all of it: the block is
    # streamed (checksum_root) or refused for its count before it is read (verify).
    path = tmp_path / "c"
    data = saved(path, np.arange(10, dtype=np.float32))
    size = 1 << 30
    last = with_word(data[-FOOTER_AND_TRAILER:], 0, (size - 200) // 8)
    with open(path, "r+b") as f:
        f.truncate(size - FOOTER_AND_TRAILER)
        f.seek(size - FOOTER_AND_TRAILER)
        f.write(last)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, check=True)
    *problems, peak_mib = out.stdout.splitlines()
    assert problems[0] == f"{path}: the checksum block is damaged (its own checksum differs)", out.stdout
    assert problems[1].startswith("CheckpointFormatError") or problems[1].startswith(f"{path}: "), out.stdout
    assert int(peak_mib) < 256, out.stdout  # (the file's size, 1024 MiB, before the fix)


def managed_steps(tmp_path: Path) -> tuple[Path, list[Path]]:
    root = tmp_path / "run"
    with CheckpointManager(root, max_to_keep=5) as manager:
        for step in (1, 2):
            values = {f"t{i}": np.full(300, i + step, np.float32) for i in range(3)}
            manager.save(CheckpointState.from_arrays(values), step)
    return root, sorted(p.parent for p in root.rglob("metadata.json"))


def test_restore_refuses_a_step_holding_another_steps_checkpoint(tmp_path):
    root, (first, second) = managed_steps(tmp_path)
    shutil.copyfile(first / "checkpoint", second / "checkpoint")
    reader = CheckpointManager(root, read_only=True)
    for check in (lambda: reader.restore(2), lambda: reader.verify(2)):
        with pytest.raises(CheckpointIntegrityError) as e:
            check()
        assert e.value.problems[0].startswith(f"{second / 'checkpoint'}: checksum root "), e.value.problems
    assert reader.restore(1).parameters["t0"].data[0] == 1  # (the step it belongs to restores)


@pytest.mark.parametrize(
    ("kind", "recorded", "said"),
    [("pair", "0" * 32, "pair id"), ("sha256", "1" * 64, "SHA-256"), ("xxh3", "2" * 16, "checksum root")],
)
def test_every_digest_an_entry_records_is_checked(tmp_path, kind, recorded, said):
    # A wrong digest beside right ones (an edited metadata.json) is found, whichever it is.
    _, (_, second) = managed_steps(tmp_path)
    meta = json.loads((second / "metadata.json").read_text())
    entry = meta["files"]["checkpoint"]
    entry["pair"] = (second / "checkpoint").read_bytes()[-16:].hex()
    entry["sha256"] = hashlib.sha256((second / "checkpoint").read_bytes()).hexdigest()
    entry[kind] = recorded
    (second / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointIntegrityError) as e:
        verify(second)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"{second / 'checkpoint'}: {said} "), e.value.problems
    assert e.value.problems[0].endswith(f"differs from metadata's {recorded}"), e.value.problems
