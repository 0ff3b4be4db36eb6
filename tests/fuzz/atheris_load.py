"""Fuzzes the Python API over arbitrary files: load_checkpoint, then every parameter,
property and optimizer momentum read in full. Anything but a checkpoint or one of
ortckpt's typed errors (CheckpointError, or OSError for a missing/unreadable data
file) is a finding.

    .venv/bin/python tests/fuzz/atheris_load.py CORPUS_DIR [libFuzzer flags]

Input layout, as in the cargo-fuzz load_bytes target: u32 little-endian length of
the checkpoint file, the checkpoint, then its external data file.
"""

from __future__ import annotations

import os
import sys
import tempfile

import atheris
import numpy as np

# Only ortckpt is instrumented (include=): the coverage of NumPy, ml_dtypes or the standard library's
# modules it imports (json, socket, subprocess...) guides nothing of ours, and instrumenting them cost
# a second at every run's start.
with atheris.instrument_imports(include=["ortckpt"]):
    from ortckpt import CheckpointState, PackedInt4
    from ortckpt.errors import CheckpointError

SCRATCH = tempfile.mkdtemp(prefix="ortckpt-atheris-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
PATH = os.path.join(SCRATCH, "ckpt")


def read_everything(state: CheckpointState) -> None:
    if not state.is_nominal:
        for name in state.parameters.names():
            data = state.parameters[name].data
            array = data.unpack() if isinstance(data, PackedInt4) else np.asarray(data)
            array.tobytes()
    for name, _value in state.properties:  # (name, value) pairs, as in ONNX Runtime
        state.properties[name]
    for group in state.optimizer_groups.values():
        for momentums in group.momentums.values():
            for value in momentums.values():
                value.unpack() if isinstance(value, PackedInt4) else np.asarray(value).tobytes()


def test_one_input(data: bytes) -> None:
    if len(data) >= 4:
        n = int.from_bytes(data[:4], "little")
        main, external = data[4 : 4 + n], data[4 + n :]
    else:
        main, external = data, b""
    with open(PATH, "wb") as f:
        f.write(main)
    with open(PATH + ".data", "wb") as f:
        f.write(external)
    try:
        state = CheckpointState.load_checkpoint(PATH)
    except (CheckpointError, OSError):
        return
    read_everything(state)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
