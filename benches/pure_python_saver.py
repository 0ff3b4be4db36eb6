"""The baseline a user would otherwise hand-roll: an ODTC checkpoint written with the
`flatbuffers` Python package's Builder (no generated code, no ortckpt).

It writes what ONNX Runtime's state path writes (sorted parameters, AdamW momentums,
properties), building the whole buffer in memory as the Python builder must.
"""

from __future__ import annotations

import flatbuffers
import ml_dtypes
import numpy as np

# ONNX codes for the dtypes the benchmarks use.
CODES = {np.dtype(np.float32): 1, np.dtype(np.int64): 7, np.dtype(np.float64): 11, np.dtype(ml_dtypes.bfloat16): 16}


def _code(array: np.ndarray) -> int:
    return CODES[array.dtype]


def _tensor(b: flatbuffers.Builder, name: str, array: np.ndarray) -> int:
    raw = b.CreateNumpyVector(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    dims = b.CreateNumpyVector(np.asarray(array.shape, dtype=np.int64))
    name_off = b.CreateString(name)
    b.StartObject(7)  # Tensor: name, doc_string, dims, data_type, raw_data, string_data, external_data_offset
    b.PrependUOffsetTRelativeSlot(0, name_off, 0)
    b.PrependUOffsetTRelativeSlot(2, dims, 0)
    b.PrependInt32Slot(3, _code(array), 0)
    b.PrependUOffsetTRelativeSlot(4, raw, 0)
    return b.EndObject()


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def save(path: str, trainable: dict, frozen: dict, momentums: dict, step: int, lr: float, ints: dict) -> None:
    b = flatbuffers.Builder(1024)
    train = _vector(b, [_tensor(b, n, trainable[n]) for n in sorted(trainable)])
    froz = _vector(b, [_tensor(b, n, frozen[n]) for n in sorted(frozen)])
    b.StartObject(4)  # ModuleState
    b.PrependUOffsetTRelativeSlot(0, train, 0)
    b.PrependUOffsetTRelativeSlot(1, froz, 0)
    module = b.EndObject()

    states = []
    for param in sorted(momentums):
        moms = _vector(b, [_tensor(b, m, momentums[param][m]) for m in sorted(momentums[param])])
        pname = b.CreateString(param)
        b.StartObject(2)  # ParameterOptimizerState
        b.PrependUOffsetTRelativeSlot(0, pname, 0)
        b.PrependUOffsetTRelativeSlot(1, moms, 0)
        states.append(b.EndObject())
    states_vec = _vector(b, states)
    gname = b.CreateString("group0")
    b.StartObject(4)  # OptimizerGroup
    b.PrependUOffsetTRelativeSlot(0, gname, 0)
    b.PrependInt64Slot(1, step, 0)
    b.PrependFloat32Slot(2, lr, 0.0)
    b.PrependUOffsetTRelativeSlot(3, states_vec, 0)
    groups = _vector(b, [b.EndObject()])

    int_props = []
    for name in sorted(ints):
        n = b.CreateString(name)
        b.StartObject(2)
        b.PrependUOffsetTRelativeSlot(0, n, 0)
        b.PrependInt64Slot(1, ints[name], 0)
        int_props.append(b.EndObject())
    ints_vec, empty = _vector(b, int_props), _vector(b, [])
    empty2 = _vector(b, [])
    b.StartObject(3)  # PropertyBag
    b.PrependUOffsetTRelativeSlot(0, ints_vec, 0)
    b.PrependUOffsetTRelativeSlot(1, empty, 0)
    b.PrependUOffsetTRelativeSlot(2, empty2, 0)
    bag = b.EndObject()

    b.StartObject(4)  # Checkpoint
    b.PrependInt32Slot(0, 2, 0)
    b.PrependUOffsetTRelativeSlot(1, module, 0)
    b.PrependUOffsetTRelativeSlot(2, groups, 0)
    b.PrependUOffsetTRelativeSlot(3, bag, 0)
    b.Finish(b.EndObject(), file_identifier=b"ODTC")
    with open(path, "wb") as f:
        f.write(b.Output())
