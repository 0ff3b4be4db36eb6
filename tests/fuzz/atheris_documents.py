"""Fuzzes the parsers of untrusted input that ortckpt's Python side owns, one per run:

    .venv/bin/python tests/fuzz/atheris_documents.py KIND CORPUS_DIR [libFuzzer flags]

- ``safetensors``: the input is a safetensors file; load_safetensors, then every tensor read.
- ``index``: the input is the index.json of a real two-shard checkpoint (the shards stay
  valid); load_sharded, merge and verify.
- ``metadata``: the input is the metadata.json of a real CheckpointManager step; a reader
  manager lists, ranks and restores, and verify checks the step.
- ``compressed``: the input is a compressed checkpoint (ortckpt.compression); decompressed
  into memory and through a file, then every tensor read.

Anything but a result or one of ortckpt's typed errors (CheckpointError; OSError for the
filesystem) is a finding: an uncaught exception, a hang (-timeout) or a crash.
Seeds: ``tests/fuzz/seed_corpus.py --documents KIND OUT_DIR``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import atheris
import numpy as np

# Only ortckpt is instrumented (include=): the coverage of NumPy, ml_dtypes or the standard library's
# modules it imports (json, socket, subprocess...) guides nothing of ours, and instrumenting them cost
# a second at every run's start.
with atheris.instrument_imports(include=["ortckpt"]):
    import ortckpt
    from ortckpt import CheckpointManager, CheckpointState, PackedInt4
    from ortckpt.compression import decompress_to_memory, is_compressed, load_compressed
    from ortckpt.convert import load_safetensors
    from ortckpt.distributed import INDEX_NAME, SingleProcess, load_sharded, merge
    from ortckpt.errors import CheckpointError, CheckpointIntegrityError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

from seed_corpus import document_fixture

SCRATCH = Path(tempfile.mkdtemp(prefix="ortckpt-atheris-docs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
KIND = sys.argv.pop(1)
FIXTURE = document_fixture(KIND, SCRATCH / "fixture")  # the directory whose document the input replaces
warnings.simplefilter("ignore")  # damaged steps are skipped with a warning: expected here


def read_all(value: object) -> None:
    array = value.unpack() if isinstance(value, PackedInt4) else np.asarray(value)
    array.tobytes()


def read_state(state: ortckpt.CheckpointState) -> None:
    for name in state.parameters.names():
        read_all(state.parameters[name].data)
    for group in state.optimizer_groups.values():
        for momentums in group.momentums.values():
            for value in momentums.values():
                read_all(value)


def fuzz_safetensors(data: bytes) -> None:
    path = SCRATCH / "input.safetensors"
    path.write_bytes(data)
    with contextlib.suppress(CheckpointError, OSError):
        read_state(load_safetensors(path))


def fuzz_index(data: bytes) -> None:
    (FIXTURE / INDEX_NAME).write_bytes(data)
    with contextlib.suppress(CheckpointError, OSError):
        read_state(load_sharded(FIXTURE, comm=SingleProcess())[0])
    out = SCRATCH / "merged.ckpt"
    with contextlib.suppress(CheckpointError, OSError):
        merge(FIXTURE, out)
    with contextlib.suppress(CheckpointError, OSError):
        ortckpt.verify(FIXTURE)


def fuzz_metadata(data: bytes) -> None:
    step_dir = next(FIXTURE.glob("step_*"))
    (step_dir / "metadata.json").write_bytes(data)
    reader = CheckpointManager(FIXTURE, read_only=True, keep_best=("loss", "min", 1))
    for info in reader.all():
        _ = (info.metrics, info.epoch, info.rng_state)
        # A step whose metadata records another checkpoint than the one there (its size or
        # checksum root) is listed, and refused at restore, naming the file (issue 30).
        with contextlib.suppress(CheckpointIntegrityError):
            read_state(reader.restore(info.step))
    reader.best()
    with contextlib.suppress(CheckpointError, OSError):
        ortckpt.verify(step_dir)


def fuzz_compressed(data: bytes) -> None:
    archive = SCRATCH / "input.zst"
    archive.write_bytes(data)
    is_compressed(archive)
    with contextlib.suppress(CheckpointError, OSError, ValueError):
        read_state(CheckpointState.from_bytes(decompress_to_memory(archive)))
    with contextlib.suppress(CheckpointError, OSError):
        read_state(load_compressed(archive))


TARGETS = {
    "safetensors": fuzz_safetensors,
    "index": fuzz_index,
    "metadata": fuzz_metadata,
    "compressed": fuzz_compressed,
}


def main() -> None:
    atheris.Setup(sys.argv, TARGETS[KIND])
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
