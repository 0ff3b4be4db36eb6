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
  infer_all MODEL NPZ OUT_NPZ   runs MODEL on every input in NPZ (by name); saves every output by name
  train_steps CKPT ARTIFACTS OUT SEED STEPS  STEPS training and optimizer steps on data drawn from SEED
                                (a "device" of a federated run); saves OUT with the optimizer state
  export CKPT ARTIFACTS OUT NAME...  Module.export_model_for_inferencing(OUT, [NAME...])
  properties PAIRS DST          a new state with the properties PAIRS (JSON [[name, value], ...], or
                                [name, value, "float32"] for a NumPy scalar; [] for an empty state)
                                saved to DST: each value's type and value as get_property gives it in
                                memory and after reloading DST, and DST's size
  save_optimized MODEL OUT      ONNX Runtime's writer of external initializers (64 bytes or more) on MODEL
  flags DST                     which include_optimizer_state values (FLAGS) save_checkpoint takes
  read_properties PATH          each property's type and value as get_property gives it
  frozen_artifacts DIR          generate_artifacts for a model with two trainable and two frozen
                                parameters (x[b,6] -> y[b,3], MSE, AdamW) into DIR, then one training
                                step saved as DIR/trained.ckpt
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

# Before numpy and onnxruntime: silences their import-time warnings in this oracle's output.
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
            entry.update(
                dtype=str(data.dtype), shape=list(data.shape), sha256=hashlib.sha256(data.tobytes()).hexdigest()
            )
        except RuntimeError as e:  # nominal states have no data
            entry = {"name": name, "error": str(e).strip().splitlines()[-1]}
        params.append(entry)
    props = {name: state.get_property(name) for name in state.property_names()}
    return {"parameter_names": list(state.parameter_names()), "parameters": params, "properties": props}


def resave(src: str, dst: str, include_optimizer_state: bool) -> dict:
    C.save_checkpoint(C.load_checkpoint(src), dst, include_optimizer_state)
    return {"saved": dst}


def train(ckpt: str, artifacts: str, out: str) -> dict:
    state, module, optimizer = _session(ckpt, artifacts)
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
        array[::4097] = i  # not constant, so misplaced bytes would show
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
    except Exception as e:
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


def infer_all(model: str, npz: str, out: str) -> dict:
    import onnxruntime

    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    inputs = dict(np.load(npz))
    names = [o.name for o in session.get_outputs()]
    np.savez(out, **dict(zip(names, session.run(names, inputs), strict=True)))
    return {"outputs": names}


def _session(ckpt: str, artifacts: str) -> tuple:
    state = C.load_checkpoint(ckpt)
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    options = C.SessionOptions()
    module = C.Module(
        os.path.join(artifacts, "training_model.onnx"),
        state,
        os.path.join(artifacts, "eval_model.onnx"),
        device,
        options,
    )
    optimizer = C.Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), state, device, options)
    return state, module, optimizer


def train_steps(ckpt: str, artifacts: str, out: str, seed: str, steps: str) -> dict:
    state, module, optimizer = _session(ckpt, artifacts)
    inputs = module.input_names(True)
    rng = np.random.default_rng(int(seed))
    losses = []
    for _ in range(int(steps)):
        batch = []
        for name in inputs:  # the user inputs ([x, target]): [5, width of the parameter they meet]
            width = 8 if name == "x" else 4
            batch.append(rng.standard_normal((5, width)).astype(np.float32))
        fetches = C.OrtValueVector()
        module.train_step(batch, fetches)
        losses.append(float(fetches[0].numpy()))
        optimizer.optimizer_step()
        module.lazy_reset_grad()
    C.save_checkpoint(state, out, True)
    return {"losses": losses, "saved": out}


def export(ckpt: str, artifacts: str, out: str, *names: str) -> dict:
    _state, module, _optimizer = _session(ckpt, artifacts)
    # ONNX Runtime 1.19.2 refuses an absolute path when the export writes external data (graph.cc:
    # "external_file_path.is_relative() was false"), so it exports from the output's directory.
    os.chdir(os.path.dirname(os.path.abspath(out)))
    module.export_model_for_inferencing(os.path.basename(out), list(names))
    return {"saved": out}


def frozen_artifacts(directory: str) -> dict:
    import types

    import onnx

    # onnxruntime.training's __init__ imports torch; its artifacts module does not need it.
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import artifacts

    rng = np.random.default_rng(11)
    weights = {
        "w1": rng.standard_normal((6, 5)).astype(np.float32),
        "b1": rng.standard_normal(5).astype(np.float32),
        "w2": rng.standard_normal((5, 3)).astype(np.float32),
        "b2": rng.standard_normal(3).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "frozen_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    artifacts.generate_artifacts(
        model,
        requires_grad=["w1", "b2"],
        frozen_params=["b1", "w2"],
        loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=directory,
    )
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        # The onnx package beside ONNX Runtime 1.19.2 is newer than it and stamps a newer IR version
        # than 1.19.2 reads (10); nothing in these models needs more.
        path = os.path.join(directory, name)
        generated = onnx.load(path)
        generated.ir_version = min(generated.ir_version, 10)
        onnx.save(generated, path)
    state, module, optimizer = _session(os.path.join(directory, "checkpoint"), directory)
    fetches = C.OrtValueVector()
    module.train_step(
        [rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)], fetches
    )
    optimizer.optimizer_step()
    C.save_checkpoint(state, os.path.join(directory, "trained.ckpt"), True)
    return {"saved": directory, "loss": float(fetches[0].numpy())}


def save_optimized(model: str, out: str) -> dict:
    """ONNX Runtime's own writer of models with external data (Graph::ToGraphProtoWithExternalInitializers,
    what export_model_for_inferencing calls), through an InferenceSession's optimized-model output with
    every optimization off and the export's 64-byte threshold."""
    import onnxruntime as ort

    model = os.path.abspath(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    os.chdir(os.path.dirname(os.path.abspath(out)))  # (a relative path, as for export)
    options.optimized_model_filepath = os.path.basename(out)
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", os.path.basename(out) + ".data"
    )
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return {"saved": out}


# include_optimizer_state values by label (test_ort_differences.py builds the same ones)
FLAGS = {
    "True": True,
    "None": None,
    "1": 1,
    "0.5": 0.5,
    "2j": 2j,
    "np.bool_": np.bool_(False),
    "np.int64": np.int64(1),
    "np.float32": np.float32(0),
    "str": "False",
    "bytes": b"",
    "list": [],
    "dict": {},
    "object": object(),
}


def flags(dst: str) -> dict:
    accepted = {}
    for label, value in FLAGS.items():
        try:
            C.save_checkpoint(C.CheckpointState(), dst, value)
            accepted[label] = True
        except TypeError:
            accepted[label] = False
    return accepted


def _typed_properties(state) -> dict:
    return {
        name: [type(state.get_property(name)).__name__, state.get_property(name)] for name in state.property_names()
    }


def properties(pairs: str, dst: str) -> dict:
    state = C.CheckpointState()  # (no pairs: an empty state)
    for name, value, *numpy_type in json.loads(pairs):  # [name, value, "float32"]: a NumPy scalar
        state.add_property(name, getattr(np, numpy_type[0])(value) if numpy_type else value)
    C.save_checkpoint(state, dst, False)
    return {
        "in_memory": _typed_properties(state),
        "reloaded": _typed_properties(C.load_checkpoint(dst)),
        "size": os.path.getsize(dst),
    }


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
    elif command == "infer_all":
        result = infer_all(*args)
    elif command == "train_steps":
        result = train_steps(*args)
    elif command == "export":
        result = export(*args)
    elif command == "frozen_artifacts":
        result = frozen_artifacts(*args)
    elif command == "properties":
        result = properties(*args)
    elif command == "save_optimized":
        result = save_optimized(*args)
    elif command == "flags":
        result = flags(*args)
    elif command == "read_properties":
        result = _typed_properties(C.load_checkpoint(args[0]))
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
