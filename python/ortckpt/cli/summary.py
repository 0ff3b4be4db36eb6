"""What a checkpoint holds, as plain data (``ortckpt inspect`` prints it; ``--json`` gives it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import _boundary, targets
from .. import dtypes as _dt
from ..checkpoint_state import CheckpointState, PackedBits
from ..convert.files import format_of, load_any


def describe(path: str | os.PathLike[str], fmt: str | None = None) -> dict[str, Any]:
    """Every tensor (name, role, dtype, shape, bytes, where its bytes live), the optimizer
    groups, the properties and totals. For an ONNX Runtime checkpoint only the header is
    read (no tensor bytes); other formats are loaded through their converter."""
    target = targets.checkpoint(path)
    if isinstance(target, targets.ObjectFile):  # an ONNX Runtime checkpoint on object storage (AWS_* configure it)
        fmt = "ortckpt"
        out = _describe_object(target)
    else:
        fmt = fmt or format_of(path, must_exist=True)
        out = _describe_checkpoint(Path(path)) if fmt == "ortckpt" else _describe_file(path, fmt)
    out = {"path": os.fspath(path), "format": fmt, **out}
    tensors = out["tensors"]
    out["totals"] = {
        "tensors": len(tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        **{role: sum(1 for t in tensors if t["role"] == role) for role in ("trainable", "frozen", "momentum")},
        "parameter_bytes": sum(t["bytes"] for t in tensors if t["role"] != "momentum"),
        "optimizer_bytes": sum(t["bytes"] for t in tensors if t["role"] == "momentum"),
    }
    return out


def _describe_file(path: str | os.PathLike[str], fmt: str) -> dict[str, Any]:
    """A file of another format, loaded through its converter."""
    return {**_describe_state(load_any(path, fmt)), "files": {os.fspath(path): Path(path).stat().st_size}}


def _tensor_entry(name: str, role: str, code: int, dims: Any, nbytes: int, location: str, **extra: Any) -> dict:
    return {
        "name": name,
        "role": role,
        "dtype": _dt.name_of(code),
        "shape": list(dims),
        "bytes": nbytes,
        "location": location,
        **extra,
    }


def _where(stored: Any) -> tuple[int, str]:
    """(bytes, location) of a tensor as a load reports it."""
    if stored is None:
        return 0, "none (nominal)"
    if isinstance(stored, list):
        return sum(len(s.encode()) for s in stored), "inline strings"
    offset, nbytes, external = stored
    return nbytes, f"{'external' if external else 'inline'} @ {offset}"


def _describe_checkpoint(path: Path) -> dict[str, Any]:
    loaded = _boundary.load(path)
    files = {os.fspath(path): path.stat().st_size}
    data = Path(f"{path}.data")
    if loaded.mappings[1] is not None and data.exists():
        files[os.fspath(data)] = data.stat().st_size
    return _describe_loaded(loaded, files)


def _describe_object(target: targets.ObjectFile) -> dict[str, Any]:
    """The same from an object: it is downloaded, its external data (if any) is not."""
    loaded = target.load()
    main, data = loaded.mappings  # the downloaded object, and its data object read lazily (RemoteRanges)
    files = {target.name: memoryview(main).nbytes}
    if data is not None:
        files[data.location.url] = data.size
    return _describe_loaded(loaded, files)


def _describe_loaded(loaded: _boundary.Loaded, files: dict[str, int]) -> dict[str, Any]:
    tensors = []
    for role, entries in (("trainable", loaded.trainable), ("frozen", loaded.frozen)):
        for name, code, dims, stored in entries:
            nbytes, location = _where(stored)
            tensors.append(_tensor_entry(name, role, code, dims, nbytes, location))
    groups = []
    for group_name, step, lr, states in loaded.optimizer_groups:
        groups.append({"name": group_name, "step": step, "initial_learning_rate": lr, "parameters": len(states)})
        for param, momentums in states:
            for momentum, code, dims, stored in momentums:
                nbytes, location = _where(stored)
                tensors.append(
                    _tensor_entry(
                        f"{param}/{momentum}",
                        "momentum",
                        code,
                        dims,
                        nbytes,
                        location,
                        group=group_name,
                        parameter=param,
                        momentum=momentum,
                    )
                )
    properties: dict[str, Any] = dict(loaded.properties)
    return {
        "nominal": loaded.nominal,
        "external_data": loaded.mappings[1] is not None,
        "files": files,
        "tensors": tensors,
        "optimizer_groups": groups,
        "properties": properties,
    }


def _describe_state(state: CheckpointState) -> dict[str, Any]:
    def entry(name: str, role: str, value: Any, **extra: Any) -> dict:
        if isinstance(value, PackedBits):
            return _tensor_entry(name, role, value.data_type, value.shape, value.packed.nbytes, "in file", **extra)
        array = np.asarray(value)
        return _tensor_entry(name, role, _dt.code_of(array), array.shape, array.nbytes, "in file", **extra)

    tensors = [
        entry(name, "trainable" if param.requires_grad else "frozen", param.data) for name, param in state.parameters
    ]
    groups = []
    for group_name, group in state.optimizer_groups.items():
        groups.append(
            {
                "name": group_name,
                "step": group.step,
                "initial_learning_rate": group.initial_learning_rate,
                "parameters": len(group.momentums),
            }
        )
        for param, momentums in group.momentums.items():
            for momentum, value in momentums.items():
                tensors.append(
                    entry(
                        f"{param}/{momentum}", "momentum", value, group=group_name, parameter=param, momentum=momentum
                    )
                )
    return {
        "nominal": state.is_nominal,
        "external_data": False,
        "files": {},
        "tensors": tensors,
        "optimizer_groups": groups,
        "properties": dict(state.properties),
    }
