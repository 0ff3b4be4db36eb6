"""safetensors files <-> checkpoint states, both ways, with no dependency.

The safetensors format is an 8-byte little-endian header length, a JSON header (dtype, shape
and byte range of each tensor, plus a ``__metadata__`` map of strings), then the tensor bytes.
It is written and read here directly, because the ``safetensors`` package's NumPy API knows
neither bfloat16 nor float8, and so that loading stays zero-copy (views over a memory map) and
saving writes each array's bytes once. The tests check every file against the real
``safetensors`` package.

What a checkpoint holds beyond tensors rides in the metadata: each property under its own
name (as a string, so other tools show it), and one ``__ortckpt__`` entry (JSON) with what is
needed to rebuild the state exactly: which parameters are frozen, the properties' types, the
optimizer groups and which tensor holds which momentum. A safetensors file written elsewhere
has no such entry: its tensors become trainable parameters (``frozen`` names exceptions) and
its metadata string properties.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import documents, safe_io
from .. import dtypes as _dt
from .._boundary import as_bytes
from ..checkpoint_state import CheckpointState, OptimizerGroup, PackedBits
from ..errors import CheckpointFormatError, UnsupportedDataTypeError

STRUCTURE_KEY = "__ortckpt__"
# safetensors' dtype names for the ONNX types it can hold.
DTYPE_NAMES = {
    _dt.FLOAT: "F32",
    _dt.DOUBLE: "F64",
    _dt.FLOAT16: "F16",
    _dt.BFLOAT16: "BF16",
    _dt.FLOAT8E4M3FN: "F8_E4M3",
    _dt.FLOAT8E5M2: "F8_E5M2",
    _dt.INT8: "I8",
    _dt.UINT8: "U8",
    _dt.INT16: "I16",
    _dt.UINT16: "U16",
    _dt.INT32: "I32",
    _dt.UINT32: "U32",
    _dt.INT64: "I64",
    _dt.UINT64: "U64",
    _dt.BOOL: "BOOL",
    _dt.COMPLEX64: "C64",
}
CODES = {name: code for code, name in DTYPE_NAMES.items()}
# A header larger than this is not a checkpoint's (safetensors itself stops at 100 MB).
MAX_HEADER_BYTES = documents.SAFETENSORS_HEADER.max_bytes


def momentum_tensor_name(group: str, param: str, momentum: str) -> str:
    return f"optimizer.{group}.{momentum}.{param}"


def save_safetensors(
    state: CheckpointState, path: str | os.PathLike[str], *, include_optimizer_state: bool = True
) -> None:
    """Writes ``state`` as a safetensors file, atomically (a temporary file, then rename).

    Parameters keep their names; momentums are named ``optimizer.<group>.<momentum>.<param>``;
    properties go to the metadata. Raises :class:`~ortckpt.UnsupportedDataTypeError` naming
    the tensor for types safetensors cannot hold (strings, int4, float8 *fnuz, complex128).
    """
    if state.is_nominal:
        raise CheckpointFormatError(f"{os.fspath(path)}: a nominal checkpoint has no values to write as safetensors")
    tensors: dict[str, np.ndarray] = {}
    for name, parameter in state.parameters:
        tensors[name] = _array_for(name, parameter.data)
    structure: dict[str, Any] = {
        "frozen": [name for name, parameter in state.parameters if not parameter.requires_grad],
        "property_types": {},
        "optimizer_groups": {},
    }
    if include_optimizer_state:
        for group_name, group in state.optimizer_groups.items():
            momentums = {}
            for param, moms in group.momentums.items():
                for momentum, value in moms.items():
                    tensor_name = momentum_tensor_name(group_name, param, momentum)
                    if tensor_name in tensors:
                        raise CheckpointFormatError(
                            f"{os.fspath(path)}: momentum {param}/{momentum} would be named {tensor_name!r}, "
                            "which a parameter already is"
                        )
                    tensors[tensor_name] = _array_for(f"{param}/{momentum}", value)
                    momentums[tensor_name] = [param, momentum]
            structure["optimizer_groups"][group_name] = {
                "step": int(group.step),
                # float32, as ONNX Runtime checkpoints hold it: conversions both ways are exact
                "initial_learning_rate": float(np.float32(group.initial_learning_rate)),
                "momentums": momentums,
            }
    metadata: dict[str, str] = {}
    for name, value in state.properties:
        if name == STRUCTURE_KEY:
            raise CheckpointFormatError(f"{os.fspath(path)}: property {name!r} is reserved for ortckpt")
        metadata[name] = repr(value) if isinstance(value, float) else str(value)
        if not isinstance(value, str):
            structure["property_types"][name] = type(value).__name__
    metadata[STRUCTURE_KEY] = json.dumps(structure, separators=(",", ":"))
    write_file(path, tensors, metadata)


def write_file(path: str | os.PathLike[str], tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` (any layout and byte order: each goes out as
    ``as_bytes`` gives it, a view when it already is contiguous little-endian) and ``metadata``."""
    # Widest items first, then by name (as the safetensors package orders them): every
    # tensor then starts at a multiple of its item size, so loaded views are aligned.
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        array = tensors[name]
        header[name] = {
            "dtype": DTYPE_NAMES[_dt.code_of(array)],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data then starts 8-byte aligned
    # A locked temporary file of a fresh name, renamed over path: two writers of one path
    # each write their own file, and the last rename wins whole.
    with safe_io.atomic_file(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            if tensors[name].nbytes:
                f.write(memoryview(as_bytes(tensors[name])))


def _array_for(name: str, value: Any) -> np.ndarray:
    if isinstance(value, PackedBits):
        raise UnsupportedDataTypeError(f"tensor {name}: safetensors has no {_dt.name_of(value.data_type)} type")
    array = np.asarray(value)
    code = _dt.code_of(array)
    if code not in DTYPE_NAMES:
        raise UnsupportedDataTypeError(f"tensor {name}: safetensors has no type for ONNX {_dt.name_of(code)}")
    return array


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (read-only views over a memory map of the file) and the metadata.

    Refuses, with :class:`~ortckpt.CheckpointFormatError` naming the file (and the tensor),
    what the ``safetensors`` package refuses: a header past the end, not JSON or not of the
    format (non-integer shapes or offsets, unknown dtypes, nesting), byte ranges that disagree
    with their shape, and tensors that do not tile the data exactly (overlapping ranges would
    alias one another; gaps and trailing bytes are not the format). Anything but a regular
    file is refused before it is read.
    """
    path = os.fspath(path)

    def bad(message: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path}: not a valid safetensors file: {message}")

    with safe_io.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise bad(f"{size} bytes, shorter than the header length")
        (header_len,) = struct.unpack("<Q", _read_exactly(f, 8))
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"header of {header_len} bytes in a file of {size}")
        try:
            header = documents.parse(documents.SAFETENSORS_HEADER, _read_exactly(f, header_len), "header")
        except documents.DocumentError as e:
            raise bad(str(e).removeprefix("header: ")) from None
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else b""
    metadata = header.pop("__metadata__")
    start, data_len = 8 + header_len, size - 8 - header_len
    tensors = {}
    ranges = []
    for name, info in header.items():
        code = CODES.get(info["dtype"])
        if code is None:
            raise bad(f"tensor {name}: unknown dtype {info['dtype']!r}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        dtype = _dt.numpy_dtype(code)
        count = math.prod(shape)  # Python ints: no overflow, however large the dims claim
        if end > data_len or end - begin != count * dtype.itemsize:
            raise bad(f"tensor {name}: bytes {begin}..{end} of {data_len} do not hold {info['dtype']} {list(shape)}")
        ranges.append((begin, end, name))
        tensors[name] = (
            np.frombuffer(mapping, dtype, count, start + begin).reshape(shape) if count else np.zeros(shape, dtype)
        )
    position = 0
    for begin, end, name in sorted(ranges):
        if begin != position:
            where = "overlap the tensor before them" if begin < position else "leave a gap after the tensor before them"
            raise bad(f"tensor {name}: bytes {begin}..{end} {where} (which ends at {position})")
        position = end
    if position != data_len:
        where = f"tensor {max(ranges)[2]}: the last tensor, followed by" if ranges else "no tensor, yet"
        raise bad(f"{where} {data_len - position} bytes of data")
    return tensors, metadata


def _read_exactly(f: Any, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def load_safetensors(path: str | os.PathLike[str], *, frozen: Iterable[str] = ()) -> CheckpointState:
    """A state from a safetensors file; tensors are views over the mapped file (no copy).

    A file :func:`save_safetensors` wrote comes back as it was saved (frozen parameters,
    optimizer groups, typed properties). For any other file every tensor is a trainable
    parameter, except those named in ``frozen``, and the metadata become string properties.
    """
    tensors, metadata = read_file(path)
    where = os.fspath(path)
    structure_text = metadata.pop(STRUCTURE_KEY, None)
    structure = (
        documents.parse(documents.ORTCKPT_STRUCTURE, structure_text, where) if structure_text is not None else {}
    )
    listed_frozen = set(structure.get("frozen", []))
    if listed_frozen - set(tensors):
        raise CheckpointFormatError(
            f"{where}: {STRUCTURE_KEY} names frozen parameters not in the file: {sorted(listed_frozen - set(tensors))}"
        )
    frozen_names = set(frozen) | listed_frozen
    groups = {}
    for group_name, group in structure.get("optimizer_groups", {}).items():
        momentums: dict[str, dict[str, Any]] = {}
        for tensor_name, (param, momentum) in group["momentums"].items():
            if tensor_name not in tensors:
                raise CheckpointFormatError(f"{where}: {STRUCTURE_KEY}: momentum tensor {tensor_name} is missing")
            momentums.setdefault(param, {})[momentum] = tensors.pop(tensor_name)
        groups[group_name] = OptimizerGroup(group["step"], group["initial_learning_rate"], momentums)
    for group_name, group in groups.items():
        for param in group.momentums:
            if param not in tensors:
                raise CheckpointFormatError(
                    f"{where}: {STRUCTURE_KEY}: momentums of {param} (group {group_name}), "
                    "which is not a parameter of the file"
                )
    missing = frozen_names - set(tensors)
    if missing:
        raise CheckpointFormatError(f"{where}: frozen parameters not in the file: {sorted(missing)}")
    types = structure.get("property_types", {})
    properties = {}
    for name, text in metadata.items():
        kind = types.get(name)
        try:
            properties[name] = int(text) if kind == "int" else float(text) if kind == "float" else text
        except ValueError:
            raise CheckpointFormatError(
                f"{where}: property {name}={text!r} is not the {kind} that {STRUCTURE_KEY} says it is"
            ) from None
    state = CheckpointState.from_arrays(
        {n: a for n, a in tensors.items() if n not in frozen_names},
        {n: a for n, a in tensors.items() if n in frozen_names},
        properties,
    )
    state.optimizer_groups = groups
    return state
