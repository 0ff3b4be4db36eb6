"""ONNX models and TensorProtos <-> checkpoints (needs the ``onnx`` package).

- :func:`save_checkpoint` / :func:`load_checkpoint_to_model`: drop-ins for
  ``onnxruntime.training.onnxblock``'s two checkpoint functions (also importable as
  ``ortckpt.onnxblock``), with the behaviour of ONNX Runtime's TensorProto path;
- :func:`state_from_onnx`: a checkpoint state from a model's initializers;
- :func:`export_model` / :func:`inference_model`: the inference model of an eval model with
  the checkpoint's weights, as ``Module.export_model_for_inferencing`` writes it (parameter
  inputs bound to initializers, pruned to the named outputs), in ONNX external data when the
  checkpoint has it (as ONNX Runtime writes it) or the model would not fit in one 2 GiB protobuf.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _boundary, safe_io, targets
from .. import dtypes as _dt
from .._boundary import as_bytes
from .._onnx_tensors import copy_proto, load_model, require_onnx, tensor_value
from ..checkpoint_state import CheckpointState, PackedBits
from ..errors import CheckpointStateError

if TYPE_CHECKING:
    import onnx

MiB = 2**20
# ONNX Runtime's TensorProto path moves every tensor of 64 bytes or more to <path>.data when
# the serialized protos total more than 1799 MiB (its 1800 MiB threshold, in whole MiB).
PROTO_PATH_EXTERNAL_DATA_THRESHOLD = 1800 * MiB
# A protobuf message cannot pass 2 GiB; models near it are saved with external data.
PROTOBUF_LIMIT = 2**31 - 1
# ONNX Runtime's inference export moves initializers of 64 bytes or more to external data.
EXPORT_EXTERNAL_MIN_BYTES = 64


def _as_proto(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        proto = require_onnx().TensorProto()
        proto.ParseFromString(bytes(value))
        return proto
    return value


def save_checkpoint(
    parameters: tuple[Sequence[Any], Sequence[Any]],
    path_to_checkpoint: str | os.PathLike[str],
    nominal_checkpoint: bool = False,
    *,
    external_data_threshold: int = PROTO_PATH_EXTERNAL_DATA_THRESHOLD,
) -> None:
    """Saves ``(trainable, frozen)`` TensorProtos (or their serialized bytes) as a checkpoint,
    as ``onnxruntime.training.onnxblock.save_checkpoint`` does: tensors in the order given,
    duplicate names rejected, a nominal checkpoint holding names and types only (empty dims
    and data), and external data when the protos total more than 1799 MiB.
    """
    if parameters is None:
        raise RuntimeError("No checkpoint parameters provided.")
    trainable, frozen = parameters
    seen: set[str] = set()
    tensors: list[list[tuple[str, int, tuple[int, ...], Any]]] = [[], []]
    total = 0
    for role, protos in enumerate((trainable, frozen)):
        for item in protos:
            proto = _as_proto(item)
            if proto.name in seen:
                raise CheckpointStateError(f"Duplicated tensor proto named {proto.name}")
            seen.add(proto.name)
            total += len(item) if isinstance(item, (bytes, bytearray, memoryview)) else proto.ByteSize()
            if nominal_checkpoint:
                tensors[role].append((proto.name, proto.data_type, (), None))
                continue
            value = tensor_value(proto)
            if isinstance(value, PackedBits):
                values: Any = value.packed
            elif proto.data_type == _dt.STRING:
                values = [str(s) for s in value.reshape(-1)]
            else:
                values = as_bytes(value)
            tensors[role].append((proto.name, proto.data_type, tuple(int(d) for d in proto.dims), values))
    external = not nominal_checkpoint and total > external_data_threshold - MiB
    _boundary.save(
        path_to_checkpoint,
        _boundary.CoreState(tensors[0], tensors[1], [], {}, nominal=nominal_checkpoint, keep_order=True),
        external_data_threshold=0 if external else 2**63 - 1,
    )


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike[str], model: onnx.ModelProto) -> None:
    """Copies the checkpoint's parameters into the model's initializers of the same name, in
    place, as ``onnxruntime.training.onnxblock.load_checkpoint_to_model`` does (other
    initializers are left as they are; a nominal checkpoint is refused)."""
    state = CheckpointState.load_checkpoint(path_to_checkpoint)
    if state.is_nominal:
        raise CheckpointStateError(
            f"{os.fspath(path_to_checkpoint)}: a nominal checkpoint holds no values to load into a model"
        )
    _fill_initializers(state, model)


def _fill_initializers(state: CheckpointState, model: onnx.ModelProto) -> int:
    """Copies the checkpoint's values into the model's initializers of the same name; returns
    how many it filled."""
    filled = 0
    for init in model.graph.initializer:
        if init.name in state.parameters:
            init.CopyFrom(_tensor_proto(init.name, state.parameters[init.name].data))
            filled += 1
    return filled


def state_from_onnx(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    requires_grad: Iterable[str] | None = None,
    frozen: Iterable[str] = (),
    base_dir: str | os.PathLike[str] | None = None,
) -> CheckpointState:
    """A checkpoint state of a model's initializers: :meth:`CheckpointState.from_onnx`."""
    return CheckpointState.from_onnx(model, requires_grad, frozen, base_dir=base_dir)


def inference_model(
    state: CheckpointState | str | os.PathLike[str],
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    output_names: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """The inference model for ``model`` with the checkpoint's weights, in memory, as ONNX
    Runtime's ``Module.export_model_for_inferencing`` builds it from an eval model:

    - every graph input named like a checkpoint parameter (trainable or frozen) becomes an
      initializer holding its values, and leaves the inputs; an initializer named like a
      parameter takes its values (models that are not training artifacts);
    - with ``output_names``, the graph's outputs become those values (any node's output),
      and nodes no output needs are removed (the loss), then inputs and initializers no
      node uses; without, the outputs stay as they are;
    - everything else (opsets, IR version, metadata, functions) is kept.

    The model passed in is not changed.
    """
    if not isinstance(state, CheckpointState):
        state = CheckpointState.load_checkpoint(state)
    if state.is_nominal:
        raise CheckpointStateError("a nominal checkpoint holds no values to export a model with")
    proto, _ = load_model(model)
    proto = copy_proto(proto)
    graph = proto.graph
    if output_names is not None:
        _set_outputs(proto, list(output_names))
    filled = _fill_initializers(state, proto)
    kept_inputs = []
    bound = 0
    for graph_input in graph.input:
        if graph_input.name in state.parameters:
            graph.initializer.append(_initializer(state, graph_input))
            bound += 1
        else:
            kept_inputs.append(graph_input)
    del graph.input[:]
    graph.input.extend(kept_inputs)
    if not filled and not bound and (len(graph.initializer) or len(kept_inputs)):
        raise CheckpointStateError(
            "no graph input or initializer of the model is named like a checkpoint parameter "
            f"(parameters: {_some(state.parameters.names())}; inputs: {_some([i.name for i in graph.input])})"
        )
    if output_names is not None:
        _prune(graph)
    return proto


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def _initializer(state: CheckpointState, graph_input: Any) -> Any:
    """The initializer for a parameter input, after checking the input's declared type and
    static dims against the checkpoint's."""
    parameter = state.parameters[graph_input.name]
    tensor_type = graph_input.type.tensor_type
    code = _dt.code_of(parameter.data)
    if tensor_type.elem_type and tensor_type.elem_type != code:
        raise CheckpointStateError(
            f"tensor {graph_input.name}: the model's input is {_dt.name_of(tensor_type.elem_type)}, "
            f"the checkpoint holds {_dt.name_of(code)}"
        )
    if tensor_type.HasField("shape"):
        declared = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if len(declared) != len(parameter.shape) or any(
            d is not None and d != actual for d, actual in zip(declared, parameter.shape, strict=True)
        ):
            raise CheckpointStateError(
                f"tensor {graph_input.name}: the model's input has shape {declared}, the checkpoint's "
                f"{list(parameter.shape)}"
            )
    return _tensor_proto(graph_input.name, parameter.data)


def _tensor_proto(name: str, value: Any) -> Any:
    onnx = require_onnx()
    from onnx import numpy_helper

    if isinstance(value, np.ndarray) and value.dtype == object:
        return numpy_helper.from_array(value, name)
    proto = onnx.TensorProto(name=name)
    if isinstance(value, PackedBits):
        proto.data_type = value.data_type
        proto.dims.extend(value.shape)
        proto.raw_data = value.packed.tobytes()
    else:
        proto.data_type = _dt.code_of(value)
        proto.dims.extend(value.shape)
        proto.raw_data = as_bytes(value).tobytes()
    return proto


def _set_outputs(proto: Any, names: list[str]) -> None:
    """The graph's outputs become ``names``, typed from the model's declarations or, failing
    those, from ONNX shape inference (as ONNX Runtime's Graph::Resolve infers them)."""
    onnx = require_onnx()
    if not names:
        raise CheckpointStateError("output_names is empty: name the outputs the inference model computes")
    graph = proto.graph
    produced = {name for node in graph.node for name in node.output} | {i.name for i in graph.input}
    missing = [n for n in names if n not in produced]
    if missing:
        # The graph's own outputs first (the usual answer), then the other values nodes compute.
        own = [o.name for o in graph.output if o.name in produced]
        others = sorted(produced - set(own) - {i.name for i in graph.input})
        raise CheckpointStateError(
            f"no node of the model computes {', '.join(missing)} (the model's outputs: {_some(own) or 'none'}; "
            f"other values its nodes compute: {_some(others) or 'none'})"
        )
    declared = {v.name: v for v in [*graph.output, *graph.value_info, *graph.input]}
    if any(n not in declared for n in names):
        try:
            inferred = onnx.shape_inference.infer_shapes(proto)
            declared.update({v.name: v for v in inferred.graph.value_info})
        except Exception:
            pass
    outputs = [copy_proto(declared[n]) if n in declared else onnx.ValueInfoProto(name=n) for n in names]
    del graph.output[:]
    graph.output.extend(outputs)


def _used_names(node: Any) -> set[str]:
    """The values a node reads, including those its subgraphs (If, Loop, Scan) read from outside."""
    used = {name for name in node.input if name}
    for attribute in node.attribute:
        for subgraph in [attribute.g, *attribute.graphs] if attribute.HasField("g") or attribute.graphs else []:
            for inner in subgraph.node:
                used |= _used_names(inner)
    return used


def _prune(graph: Any) -> None:
    """Removes the nodes no graph output needs, then the inputs and initializers no node uses."""
    needed = {o.name for o in graph.output}
    producer = {name: i for i, node in enumerate(graph.node) for name in node.output}
    keep: set[int] = set()
    todo = [producer[n] for n in needed if n in producer]
    while todo:
        index = todo.pop()
        if index in keep:
            continue
        keep.add(index)
        for name in _used_names(graph.node[index]):
            needed.add(name)
            if name in producer:
                todo.append(producer[name])
    nodes = [node for i, node in enumerate(graph.node) if i in keep]
    del graph.node[:]
    graph.node.extend(nodes)
    for field in (graph.input, graph.initializer):
        kept = [entry for entry in field if entry.name in needed]
        del field[:]
        field.extend(kept)
    value_info = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(value_info)


def export_model(
    state: CheckpointState | str | os.PathLike[str],
    model: onnx.ModelProto | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    output_names: Sequence[str] | None = None,
    external_data: bool | None = None,
    size_threshold: int = EXPORT_EXTERNAL_MIN_BYTES,
) -> Path:
    """Writes the inference model of ``model`` (an eval model from ONNX Runtime's
    ``generate_artifacts``, or any model whose initializers are named like the parameters)
    with the checkpoint's weights to ``path``: see :func:`inference_model`, which is what
    ``Module.export_model_for_inferencing(path, output_names)`` writes, without a training
    session or the training package.

    ``external_data=None`` (the default) stores the weights in ONNX external data
    (``<path>.data``, one file) when the checkpoint has external data, as ONNX Runtime's export
    does, or when the model would pass protobuf's 2 GiB limit; ``True``/``False`` force it.
    Initializers of ``size_threshold`` bytes or more (64, as in ONNX Runtime) go there, one
    after another in the model's order; smaller ones stay in the model. Returns the path written.
    """
    targets.output(path, "path")
    require_onnx()
    if not isinstance(state, CheckpointState):
        state = CheckpointState.load_checkpoint(state)
    proto = inference_model(state, model, output_names=output_names)
    path = Path(path)
    if external_data is None:
        from google.protobuf.message import EncodeError

        try:
            external_data = state.has_external_data or proto.ByteSize() > PROTOBUF_LIMIT
        except EncodeError:  # protobuf will not even size a message past its limit
            external_data = True
    # Both files are staged by the core and published by its one commit (the data file first,
    # the model that points into it last); the external data is written here, not by onnx,
    # which writes it by name beside the model.
    staged = _boundary.stage(os.fspath(path), with_data=external_data)
    try:
        if external_data:
            _write_external_data(proto, size_threshold, staged.fileno(data=True), Path(f"{path}.data"))
        safe_io.pwrite_all(staged.fileno(), [(0, proto.SerializeToString())], path)
        staged.commit(unpaired=True)  # (no trailer ties an ONNX model to its data: see the core)
    finally:
        staged.discard()
    return path


def _write_external_data(proto: onnx.ModelProto, size_threshold: int, fd: int, data_path: Path) -> None:
    """Moves the values of every initializer of ``size_threshold`` bytes or more into the file
    ``fd``, one after another with no padding, as ONNX Runtime's export lays them out (values in
    typed fields such as ``float_data`` too, as their raw bytes), recording each one's location,
    offset and length as onnx's own save does. Strings stay in the model."""
    external = require_onnx().TensorProto.EXTERNAL
    at = 0
    for tensor in _initializers(proto.graph):
        if tensor.data_type == _dt.STRING:
            continue
        if tensor.HasField("raw_data"):
            data: Any = tensor.raw_data
        else:
            value = tensor_value(tensor)
            data = as_bytes(value.packed if isinstance(value, PackedBits) else value).reshape(-1)
        if len(data) < size_threshold:
            continue
        safe_io.pwrite_all(fd, [(at, data)], data_path)
        for typed in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(typed)
        tensor.ClearField("raw_data")
        tensor.data_location = external
        del tensor.external_data[:]
        for key, entry in (("location", data_path.name), ("offset", str(at)), ("length", str(len(data)))):
            tensor.external_data.add(key=key, value=entry)
        at += len(data)


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The initializers of a graph and of its nodes' subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _initializers(attribute.g)
            for subgraph in attribute.graphs:
                yield from _initializers(subgraph)


__all__ = [
    "PROTO_PATH_EXTERNAL_DATA_THRESHOLD",
    "export_model",
    "inference_model",
    "load_checkpoint_to_model",
    "save_checkpoint",
    "state_from_onnx",
    "tensor_value",
]
