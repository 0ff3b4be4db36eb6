"""ONNX Runtime 1.19.2's savers and loader, timed inside ONNX Runtime's own virtualenv.

Called by suite.py as a subprocess; prints one JSON object.

  state_save SRC DST      load SRC (untimed), then time the state-path saver (with optimizer state)
  load SRC                time load_checkpoint, then reading every parameter (eager, copies)
  protos_save RAW MANIFEST DST   time onnxblock's TensorProto path from NumPy arrays: arrays ->
                          TensorProtos -> save_checkpoint (RAW holds the bytes, MANIFEST their layout)
Peak RSS growth (MiB) during the timed part is reported as well.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

# Before numpy and onnxruntime: silences their import-time warnings in the figures' output.
warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from measure import current_mib, peak_mib, xor_all  # noqa: E402
from onnxruntime.capi import _pybind_state as C  # noqa: E402


def state_save(src: str, dst: str) -> dict:
    state = C.load_checkpoint(src)
    before = current_mib()
    start = time.perf_counter()
    C.save_checkpoint(state, dst, True)
    return {"seconds": time.perf_counter() - start, "peak_growth_mib": peak_mib() - before}


def load(src: str) -> dict:
    before = current_mib()
    start = time.perf_counter()
    state = C.load_checkpoint(src)
    opened = time.perf_counter()
    xor_all(state.get_parameter(name).data.numpy() for name in state.parameter_names())
    end = time.perf_counter()
    return {"open_seconds": opened - start, "seconds": end - start, "peak_growth_mib": peak_mib() - before}


def protos_save(raw: str, manifest: str, dst: str) -> dict:
    from onnx import numpy_helper

    layout = json.loads(Path(manifest).read_text())
    data = np.memmap(raw, dtype=np.uint8, mode="r")
    arrays = [
        (t["name"], t["trainable"], data[t["offset"] : t["offset"] + t["nbytes"]].view(t["dtype"]).reshape(t["shape"]))
        for t in layout["parameters"]
    ]
    before = current_mib()
    start = time.perf_counter()
    trainable = [numpy_helper.from_array(np.asarray(a), n).SerializeToString() for n, t, a in arrays if t]
    frozen = [numpy_helper.from_array(np.asarray(a), n).SerializeToString() for n, t, a in arrays if not t]
    C.save_checkpoint(trainable, frozen, dst, False)
    return {"seconds": time.perf_counter() - start, "peak_growth_mib": peak_mib() - before}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    print(json.dumps({"state_save": state_save, "load": load, "protos_save": protos_save}[command](*args)))
