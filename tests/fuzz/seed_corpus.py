"""Writes the fuzzers' seed inputs: every golden checkpoint ONNX Runtime wrote and
every file of the malformed corpus, in the fuzz input layout (u32 little-endian
length of the checkpoint, the checkpoint, then its external data file, if any).

    python tests/fuzz/seed_corpus.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

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


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for seed in seeds():
        (out / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
        count += 1
    print(f"{count} seeds in {out}")


if __name__ == "__main__":
    main()
