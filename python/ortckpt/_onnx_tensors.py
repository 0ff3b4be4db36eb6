"""ONNX TensorProtos and model initializers as the arrays a checkpoint holds (needs ``onnx``).

Below both the checkpoint state (``CheckpointState.from_onnx``) and the ONNX converters
(``ortckpt.convert.onnx_model``), so neither imports the other to read a model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes as _dt
from . import extras, safe_io
from .dtypes import PackedBits
from .errors import CheckpointFormatError, CheckpointStateError

if TYPE_CHECKING:
    import onnx


def require_onnx() -> Any:
    return extras.require("onnx", "reading and writing ONNX models")


def tensor_value(proto: onnx.TensorProto, base_dir: str | os.PathLike[str] = "") -> Any:
    """A TensorProto's values as ortckpt holds them: an array (a view of ``raw_data`` when
    there is one), a :class:`~ortckpt.PackedBits`, or an object array of str."""
    onnx = require_onnx()
    from onnx import numpy_helper

    dims = tuple(int(d) for d in proto.dims)
    code = proto.data_type
    if proto.data_location == onnx.TensorProto.EXTERNAL:
        from onnx.external_data_helper import load_external_data_for_tensor

        proto = copy_proto(proto)
        load_external_data_for_tensor(proto, os.fspath(base_dir))
    if code == _dt.STRING:
        return np.array([s.decode() for s in proto.string_data], dtype=object).reshape(dims)
    if code in _dt.SUB_BYTE_CODES:
        if proto.HasField("raw_data"):
            return PackedBits.of(np.frombuffer(proto.raw_data, np.uint8), dims, code)
        return PackedBits.pack(numpy_helper.to_array(proto))
    dtype = _dt.numpy_dtype(code)
    if proto.HasField("raw_data"):
        count = int(np.prod(dims, dtype=np.int64))
        if len(proto.raw_data) != count * dtype.itemsize:
            raise CheckpointStateError(
                f"tensor {proto.name}: {len(proto.raw_data)} bytes of raw_data for {_dt.name_of(code)} {list(dims)}"
            )
        return np.frombuffer(proto.raw_data, dtype.newbyteorder("<"), count).reshape(dims)
    return np.asarray(numpy_helper.to_array(proto)).view(dtype).reshape(dims)


def copy_proto(proto: Any) -> Any:
    out = type(proto)()
    out.CopyFrom(proto)
    return out


def load_model(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[Any, str]:
    """The model (external data loaded) and the directory its external data paths start from.
    The file is read here (a regular file only, so a FIFO never blocks), then parsed by onnx."""
    if isinstance(model, (str, os.PathLike)):
        onnx = require_onnx()
        from onnx.external_data_helper import load_external_data_for_model

        base_dir = os.path.dirname(os.fspath(model))
        proto = _parsed(onnx, safe_io.read_regular(model), os.fspath(model))
        load_external_data_for_model(proto, base_dir)
        return proto, base_dir
    return model, ""


def _parsed(onnx: Any, data: bytes, name: str) -> Any:
    """The ModelProto in ``data``; CheckpointFormatError naming the file when it is none (a
    protobuf parser's own error names no file, and zero bytes parse as an empty model)."""
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load_model_from_string(data)
    except DecodeError as e:
        error = CheckpointFormatError(f"{name}: not an ONNX model (protobuf cannot parse it: {e})")
        error.filename = name
        raise error from None
    if not proto.HasField("graph"):
        error = CheckpointFormatError(f"{name}: not an ONNX model (it holds no graph)")
        error.filename = name
        raise error
    return proto


def initializers(
    model: onnx.ModelProto | str | os.PathLike[str],
    requires_grad: Iterable[str] | None,
    frozen: Iterable[str],
    base_dir: str | os.PathLike[str] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainable, frozen) initializer values of a model (a ModelProto or a path; initializers
    in ONNX external data are read from ``base_dir``, by default the model file's directory).

    ``requires_grad`` names the trainable parameters (the others are frozen); without it every
    initializer not named in ``frozen`` is trainable, as ``generate_artifacts`` treats them.
    """
    proto, model_dir = load_model(model)
    directory = os.fspath(base_dir) if base_dir is not None else model_dir
    values = {init.name: tensor_value(init, directory) for init in proto.graph.initializer}
    frozen = set(frozen)
    trainable = set(values) - frozen if requires_grad is None else set(requires_grad)
    unknown = (trainable | frozen) - set(values)
    if unknown:
        raise CheckpointStateError(f"not initializers of the model: {sorted(unknown)}")
    return (
        {n: v for n, v in values.items() if n in trainable},
        {n: v for n, v in values.items() if n not in trainable},
    )
