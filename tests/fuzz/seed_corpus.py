"""Writes the fuzzers' seed inputs.

    python tests/fuzz/seed_corpus.py OUT_DIR                    checkpoints (cargo-fuzz, atheris_load.py)
    python tests/fuzz/seed_corpus.py --documents KIND OUT_DIR   documents (atheris_documents.py)

Checkpoints: every golden checkpoint ONNX Runtime wrote and every file of the malformed corpus,
in the fuzz input layout (u32 little-endian length of the checkpoint, the checkpoint, then its
external data file, if any). Documents: the real ones ortckpt writes for the test data (a
safetensors file of each golden checkpoint and one of the safetensors package, the index of a
two-shard checkpoint, a manager's metadata.json), plus the hostile cases of the tests.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import sys
import threading
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"


def seeds():
    for directory in (DATA / "ort-vectors", DATA / "malformed"):
        for path in sorted(directory.rglob("*")):
            if path.is_dir() or path.suffix in (".json", ".md", ".onnx", ".data"):
                continue
            main = path.read_bytes()
            data_path = path.with_name(path.name + ".data")
            data = data_path.read_bytes() if data_path.exists() else b""
            yield len(main).to_bytes(4, "little") + main + data


# --- documents -------------------------------------------------------------------------------------


class _ThreadWorld:
    """Two ranks as threads, for a real two-shard checkpoint (as tests/python/sharded/test_distributed.py)."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier_ = size, threading.Barrier(size, timeout=30)
        self.slots: list[Any] = [None] * size

    def comm(self, rank: int) -> Any:
        world = self

        class Comm:
            def __init__(self) -> None:
                self.rank, self.world_size = rank, world.size

            def barrier(self) -> None:
                world.barrier_.wait()

            def gather(self, obj: Any, root: int = 0) -> Any:
                world.slots[rank] = pickle.dumps(obj)
                self.barrier()
                out = [pickle.loads(b) for b in world.slots] if rank == root else None
                self.barrier()
                return out

            def broadcast(self, obj: Any, root: int = 0) -> Any:
                if rank == root:
                    world.slots[root] = pickle.dumps(obj)
                self.barrier()
                out = pickle.loads(world.slots[root])
                self.barrier()
                return out

        return Comm()


def document_fixture(kind: str, directory: Path) -> Path:
    """The directory whose document a fuzz input replaces: for ``index`` a two-shard step
    directory, for ``metadata`` a manager's run directory with one step; for ``safetensors``
    an empty directory."""
    import numpy as np
    from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup
    from ortckpt.distributed import Slice, save_sharded

    directory.mkdir(parents=True, exist_ok=True)
    if kind == "index":
        world = _ThreadWorld(2)
        whole = np.arange(24, dtype=np.float32).reshape(6, 4)

        def rank(r: int) -> None:
            part = Slice.split(whole.shape, r, 2)
            state = CheckpointState.from_arrays(
                {"w": whole[part.index].copy(), "b": np.ones(4, np.float32)},
                {f"s{r}": np.array(r, np.int64)},
                {"epoch": 1},
            )
            state.optimizer_groups["group0"] = OptimizerGroup(3, 0.1, {"w": {"momentum0": whole[part.index] * 0}})
            save_sharded(state, directory, step=1, comm=world.comm(r), slices={"w": part}, durable=False)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return directory / "step_00000001"
    if kind == "metadata":
        with CheckpointManager(directory, durable=False) as manager:
            state = CheckpointState.from_arrays({"w": np.ones(4, np.float32)}, properties={"note": "x"})
            manager.save(
                state,
                1,
                epoch=0,
                metrics={"loss": 0.5, "acc": float("inf")},
                metadata={"k": [1, 2]},
                rng_state={"python": [3, [1, 2], None]},
            )
        return directory
    return directory


def document_seeds(kind: str, scratch: Path) -> list[bytes]:
    import numpy as np
    from ortckpt import CheckpointState
    from ortckpt.convert import save_safetensors

    if kind == "safetensors":
        out = []
        for i, path in enumerate(sorted((DATA / "ort-vectors").glob("*.ckpt"))):
            state = CheckpointState.load_checkpoint(path)
            if state.is_nominal:
                continue
            try:
                save_safetensors(state, scratch / f"{i}.safetensors")
            except Exception:
                continue
            out.append((scratch / f"{i}.safetensors").read_bytes())
        header = json.dumps(
            {"__metadata__": {"a": "b"}, "x": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]}}
        ).encode()
        out.append(struct.pack("<Q", len(header)) + header + np.ones(2, np.float32).tobytes())
        return out
    if kind == "compressed":
        from ortckpt.compression import compress

        out = []
        sources = [*sorted((DATA / "ort-vectors").glob("*.ckpt"))]
        rng = np.random.default_rng(0)
        state = CheckpointState.from_arrays({"w": rng.standard_normal(300).astype(np.float32)})
        CheckpointState.save_checkpoint(state, scratch / "ext.ckpt", external_data_threshold=0)
        for i, source in enumerate([*sources, scratch / "ext.ckpt"]):
            compress(source, scratch / f"{i}.zst")
            out.append((scratch / f"{i}.zst").read_bytes())
        return out
    fixture = document_fixture(kind, scratch / kind)
    if kind == "index":
        index = (fixture / "index.json").read_bytes()
        parsed = json.loads(index)
        parsed["tensors"]["w"]["pieces"][1]["offset"] = [0, 0]
        return [index, json.dumps(parsed).encode(), b"{}", b"[" * 64]
    metadata = (next(fixture.glob("step_*")) / "metadata.json").read_bytes()
    parsed = json.loads(metadata)
    parsed["files"] = {"../x": parsed["files"]["checkpoint"]}
    return [metadata, json.dumps(parsed).encode(), b"[]", b'{"format": "ortckpt-metadata/1"}']


def write(out: Path, inputs) -> int:
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for seed in inputs:
        (out / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
        count += 1
    return count


def main() -> None:
    if sys.argv[1] == "--documents":
        import tempfile

        kind, out = sys.argv[2], Path(sys.argv[3])
        with tempfile.TemporaryDirectory() as scratch:
            count = write(out, document_seeds(kind, Path(scratch)))
    else:
        out = Path(sys.argv[1])
        count = write(out, seeds())
    print(f"{count} seeds in {out}")


if __name__ == "__main__":
    main()
