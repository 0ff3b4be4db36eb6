"""The writers of a save (issue 41): a page-cache save and a durable one lay the files out by
different paths (a durable save's data file by parallel positioned writers). Both must write the
same bytes, checksums that verify, and files ONNX Runtime's layout reads (values at their aligned
offsets, zero padding between them)."""

from __future__ import annotations

import numpy as np
from ortckpt import CheckpointState, _boundary, load_checkpoint, save_checkpoint


def _state() -> tuple[CheckpointState, dict[str, np.ndarray]]:
    rng = np.random.default_rng(41)
    # Odd sizes (padding between values), some past the writers' 256 KiB pieces and 1 MiB hand-overs.
    sizes = [1, 3, 17, 70_001, 300_007, 5, 1_000_003, 0, 262_144]
    values = {f"t{i:02}": rng.random(n, dtype=np.float32) for i, n in enumerate(sizes)}
    return CheckpointState.from_arrays(values), values


def test_page_cache_and_durable_writers_write_the_same_verified_bytes(tmp_path):
    state, values = _state()
    files = {}
    for external in (False, True):
        for durable in (False, True):
            path = str(tmp_path / f"ck-{external}-{durable}")
            save_checkpoint(state, path, external_data_threshold=0 if external else 2**62, durable=durable)
            tensors, value_bytes, _root = _boundary.verify_checksums(path)
            assert (tensors, value_bytes) == (len(values), sum(v.nbytes for v in values.values()))
            loaded = load_checkpoint(path)
            for name, parameter in loaded.parameters:
                np.testing.assert_array_equal(parameter.data, values[name])
            with open(path, "rb") as f:
                main = f.read()
            data = None
            if external:
                with open(path + ".data", "rb") as f:
                    data = f.read()
            files[external, durable] = (main, data)
    # Inline: the same bytes whichever writer (the pair id derives from the checksums).
    assert files[False, False] == files[False, True]
    # External: the data files differ only in their random pair id (the trailer's last 16 bytes).
    (_, page_cache), (_, durable) = files[True, False], files[True, True]
    assert len(page_cache) == len(durable)
    assert page_cache[:-16] == durable[:-16]
