"""torch.save and torch.load, timed inside their own virtualenv (.venv-torch: PyPI's only
Linux build of torch brings several GB of CUDA packages, kept out of the project's venv).

Called by suite.py as a subprocess; prints one JSON object.

  save RAW MANIFEST DST   copy each tensor out of RAW into its own tensor (untimed: a model's
                          parameters are separate allocations), then time torch.save of the dict
  load SRC [mmap]         time torch.load (or torch.load(mmap=True)), then reading every byte
  open SRC FIRST          medians of 5: torch.load(mmap=True) alone, and with reading tensor FIRST
Peak RSS growth (MiB) during the timed part is reported as well.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from measure import current_mib, median_seconds, peak_mib, xor_all

DTYPES = {"float32": (np.float32, torch.float32), "bfloat16": (np.uint16, torch.bfloat16)}


def tensors_as_numpy(tensors):
    """Byte views NumPy can read (NumPy has no bfloat16)."""
    return (t.contiguous().view(-1).view(torch.uint8).numpy() for t in tensors)


def save(raw: str, manifest: str, dst: str) -> dict:
    data = np.memmap(raw, dtype=np.uint8, mode="r")
    tensors = {}
    for t in json.loads(Path(manifest).read_text())["parameters"]:
        np_dtype, torch_dtype = DTYPES[t["dtype"]]
        array = np.array(data[t["offset"] : t["offset"] + t["nbytes"]].view(np_dtype).reshape(t["shape"]))
        tensors[t["name"]] = torch.from_numpy(array).view(torch_dtype)
    del data
    before = current_mib()
    start = time.perf_counter()
    torch.save(tensors, dst)
    return {"seconds": time.perf_counter() - start, "peak_growth_mib": peak_mib() - before}


def load(src: str, mode: str = "") -> dict:
    start = time.perf_counter()
    tensors = torch.load(src, mmap=mode == "mmap", weights_only=True)
    xor_all(tensors_as_numpy(tensors.values()))
    return {"seconds": time.perf_counter() - start}


def open_latency(src: str, first: str) -> dict:
    lazy = median_seconds(lambda: torch.load(src, mmap=True, weights_only=True))
    first_tensor = median_seconds(
        lambda: xor_all(tensors_as_numpy([torch.load(src, mmap=True, weights_only=True)[first]]))
    )
    return {"open_seconds": lazy, "first_seconds": first_tensor}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    print(json.dumps({"save": save, "load": load, "open": open_latency}[command](*args)))
