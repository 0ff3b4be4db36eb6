"""How fast each file of the malformed corpus (tests/data/malformed) is refused.

    .venv/bin/python benches/malformed.py

Prints, per file, the median of 20 load attempts and the error raised.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ortckpt import CheckpointState

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "malformed"


def main() -> None:
    cases = json.loads((CORPUS / "expected.json").read_text())
    rows = []
    for case in cases:
        path = CORPUS / case["file"]
        times, outcome = [], "loads"
        for _ in range(20):
            start = time.perf_counter()
            try:
                CheckpointState.load_checkpoint(path)
            except Exception as e:
                outcome = type(e).__name__
            times.append(time.perf_counter() - start)
        rows.append((case["file"], path.stat().st_size, statistics.median(times) * 1e3, outcome))
    print("| file | bytes | median ms | outcome |\n|---|---|---|---|")
    for name, size, ms, outcome in rows:
        print(f"| {name} | {size} | {ms:.3f} | {outcome} |")
    print(f"\nslowest: {max(r[2] for r in rows):.3f} ms over {len(rows)} files")


if __name__ == "__main__":
    main()
