"""Runs inside the ONNX Runtime virtualenv (onnxruntime-training-cpu 1.19.2, numpy<2).

The interop tests call it as a subprocess, so that ONNX Runtime and ortckpt (which
needs no ONNX Runtime and runs on NumPy 2) never share an interpreter. Each
command prints one JSON object on stdout.

  describe PATH                 what ONNX Runtime reads from a checkpoint
  resave SRC DST [--no-optimizer]  ONNX Runtime loads SRC and saves it (state path)
  train CKPT ARTIFACTS OUT      one training step and one optimizer step, then save OUT
  write_protos DST MIB          ONNX Runtime's TensorProto-path saver (onnxblock's), on about MIB
                                MiB of deterministic float32 tensors; prints their sha256s
  save_protos PICKLE DST [--nominal]  the TensorProto-path saver on (trainable, frozen) lists of
                                serialized TensorProtos pickled in PICKLE; prints an error if it refuses
  load_to_model CKPT MODEL OUT  get_model_after_loading_checkpoint (onnxblock's load_checkpoint_to_model)
  infer MODEL NPY OUT_NPY       runs MODEL (its first input from NPY) in an InferenceSession
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from onnxruntime.capi import _pybind_state as C  # noqa: E402


def describe(path: str) -> dict:
    state = C.load_checkpoint(path)
    params = []
    for name in state.parameter_names():
        try:
            p = state.get_parameter(name)
            entry = {"name": name, "requires_grad": bool(p.requires_grad)}
            data = p.data.numpy()
            entry.update(dtype=str(data.dtype), shape=list(data.shape), sha256=hashlib.sha256(data.tobytes()).hexdigest())
        except RuntimeError as e:  # nominal states have no data
            entry = {"name": name, "error": str(e).strip().splitlines()[-1]}
        params.append(entry)
    props = {name: state.get_property(name) for name in state.property_names()}
    return {"parameter_names": list(state.parameter_names()), "parameters": params, "properties": props}


def resave(src: str, dst: str, include_optimizer_state: bool) -> dict:
    C.save_checkpoint(C.load_checkpoint(src), dst, include_optimizer_state)
    return {"saved": dst}


def train(ckpt: str, artifacts: str, out: str) -> dict:
    state = C.load_checkpoint(ckpt)
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    options = C.SessionOptions()
    module = C.Module(
        os.path.join(artifacts, "training_model.onnx"), state, os.path.join(artifacts, "eval_model.onnx"), device, options
    )
    optimizer = C.Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), state, device, options)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    target = rng.standard_normal((5, 4)).astype(np.float32)
    fetches = C.OrtValueVector()
    module.train_step([x, target], fetches)
    loss = float(fetches[0].numpy())
    optimizer.optimizer_step()
    C.save_checkpoint(state, out, True)
    return {"loss": loss, "saved": out}


def write_protos(dst: str, mib: str) -> dict:
    from onnx import numpy_helper

    count = 8
    per = int(mib) * 2**20 // 4 // count
    trainable, frozen, sums = [], [], {}
    for i in range(count):
        array = np.full(per, i + 0.5, np.float32)
        array[:: 4097] = i  # not constant, so misplaced bytes would show
        name = f"layer{i}.weight"
        sums[name] = hashlib.sha256(array.tobytes()).hexdigest()
        proto = numpy_helper.from_array(array, name).SerializeToString()
        (trainable if i % 4 else frozen).append(proto)
        del array
    small = np.arange(10, dtype=np.int64)
    sums["small"] = hashlib.sha256(small.tobytes()).hexdigest()
    frozen.append(numpy_helper.from_array(small, "small").SerializeToString())
    C.save_checkpoint(trainable, frozen, dst, False)
    return {"sha256": sums}


def save_protos(pickled: str, dst: str, nominal: bool) -> dict:
    import pickle

    with open(pickled, "rb") as f:
        trainable, frozen = pickle.load(f)
    try:
        C.save_checkpoint(trainable, frozen, dst, nominal)
    except Exception as e:  # noqa: BLE001 - the refusal itself is the result
        return {"error": str(e).strip().splitlines()[-1]}
    return {"saved": dst}


def load_to_model(ckpt: str, model: str, out: str) -> dict:
    with open(model, "rb") as f:
        result = C.get_model_after_loading_checkpoint(ckpt, f.read())
    with open(out, "wb") as f:
        f.write(result)
    return {"saved": out}


def infer(model: str, npy: str, out: str) -> dict:
    import onnxruntime

    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.load(npy)
    outputs = session.run(None, {session.get_inputs()[0].name: x})
    np.save(out, outputs[0])
    return {"saved": out}


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "describe":
        result = describe(args[0])
    elif command == "resave":
        result = resave(args[0], args[1], "--no-optimizer" not in args)
    elif command == "train":
        result = train(*args)
    elif command == "write_protos":
        result = write_protos(*args)
    elif command == "save_protos":
        result = save_protos(args[0], args[1], "--nominal" in args)
    elif command == "load_to_model":
        result = load_to_model(*args)
    elif command == "infer":
        result = infer(*args)
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
