"""PyTorch modules, state_dicts and optimizers <-> checkpoint states (needs ``torch``).

Parameters keep their state_dict names. Adam/AdamW's ``exp_avg`` and ``exp_avg_sq`` become
ONNX Runtime's ``momentum0`` and ``momentum1`` (SGD's ``momentum_buffer``: ``momentum0``);
torch's parameter group *i* becomes optimizer group ``group<i>`` (ONNX Runtime trains with
``group0``) holding the step and the learning rate.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from .. import extras, safe_io
from ..checkpoint_state import CheckpointState, OptimizerGroup
from ..errors import CheckpointStateError

# torch's optimizer state names -> ONNX Runtime's momentum names.
MOMENTUM_NAMES = {"exp_avg": "momentum0", "exp_avg_sq": "momentum1", "momentum_buffer": "momentum0"}
TORCH_NAMES = {
    "adam": {"momentum0": "exp_avg", "momentum1": "exp_avg_sq"},
    "sgd": {"momentum0": "momentum_buffer"},
}


def _torch() -> Any:
    return extras.require("torch", "reading and writing torch files")


def _views() -> dict[Any, tuple[Any, type, np.dtype]]:
    """torch dtypes NumPy lacks -> (same-size integer dtype to view through, in torch and in
    NumPy; the ``ml_dtypes`` dtype)."""
    torch = _torch()
    return {
        torch.bfloat16: (torch.int16, np.int16, np.dtype(ml_dtypes.bfloat16)),
        torch.float8_e4m3fn: (torch.uint8, np.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
        torch.float8_e5m2: (torch.uint8, np.uint8, np.dtype(ml_dtypes.float8_e5m2)),
        torch.float8_e4m3fnuz: (torch.uint8, np.uint8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
        torch.float8_e5m2fnuz: (torch.uint8, np.uint8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    }


def to_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor's values as a NumPy array sharing its memory (bfloat16 and float8 as
    ``ml_dtypes`` arrays); other devices are copied to the CPU first."""
    tensor = tensor.detach().cpu().contiguous()
    view = _views().get(tensor.dtype)
    if view is not None:
        return tensor.view(view[0]).numpy().view(view[2])
    return tensor.numpy()


def from_numpy(array: Any) -> Any:
    """A torch tensor holding a copy of ``array`` (the array may be a read-only view of a file)."""
    torch = _torch()
    array = np.asarray(array)
    for torch_dtype, (_, numpy_int, numpy_dtype) in _views().items():
        if array.dtype == numpy_dtype:
            return torch.from_numpy(np.array(array.view(numpy_int), copy=True)).view(torch_dtype)
    return torch.from_numpy(np.array(array, copy=True))


def _param_names(model: Any) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def from_torch(
    model_or_state_dict: Any,
    optimizer: Any = None,
    *,
    frozen: Iterable[str] = (),
) -> CheckpointState:
    """A checkpoint state from a ``torch.nn.Module`` (its state_dict: parameters that require
    grad are trainable, buffers and the rest frozen) or a state_dict (all trainable), with the
    optimizer's state when given (it needs the module, to name the parameters). ``frozen``
    names more parameters to freeze. Tensors on the CPU are shared, not copied.
    """
    torch = _torch()
    frozen = set(frozen)
    if isinstance(model_or_state_dict, torch.nn.Module):
        model = model_or_state_dict
        state_dict = model.state_dict()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} - frozen
    elif isinstance(model_or_state_dict, Mapping):
        model, state_dict = None, model_or_state_dict
        trainable = set(state_dict) - frozen
    else:
        raise TypeError(f"expected a torch.nn.Module or a state_dict, got {type(model_or_state_dict).__name__}")
    unknown = frozen - set(state_dict)
    if unknown:
        raise CheckpointStateError(f"frozen names not in the state_dict: {sorted(unknown)}")
    arrays = {name: to_numpy(t) for name, t in state_dict.items()}
    state = CheckpointState.from_arrays(
        {n: a for n, a in arrays.items() if n in trainable}, {n: a for n, a in arrays.items() if n not in trainable}
    )
    if optimizer is not None:
        if model is None:
            raise CheckpointStateError(
                "the optimizer's state needs the module (to name its parameters), not a state_dict"
            )
        state.optimizer_groups = _groups_from_torch(optimizer, _param_names(model))
    return state


def _groups_from_torch(optimizer: Any, names: dict[int, str]) -> dict[str, OptimizerGroup]:
    groups = {}
    for i, group in enumerate(optimizer.param_groups):
        momentums: dict[str, dict[str, Any]] = {}
        step = 0
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointStateError("the optimizer holds a parameter that is not the module's")
            per_param = optimizer.state.get(param, {})
            for key, value in per_param.items():
                if key == "step":
                    step = max(step, int(value))
                elif key in MOMENTUM_NAMES:
                    momentums.setdefault(names[id(param)], {})[MOMENTUM_NAMES[key]] = to_numpy(value)
                else:
                    raise CheckpointStateError(
                        f"optimizer state {key!r} of {names[id(param)]} has no ONNX Runtime counterpart "
                        "(Adam/AdamW without amsgrad and SGD are supported)"
                    )
        groups[f"group{i}"] = OptimizerGroup(step=step, initial_learning_rate=float(group["lr"]), momentums=momentums)
    return groups


def to_torch(state: CheckpointState, model: Any = None, optimizer: Any = None) -> tuple[dict[str, Any], dict | None]:
    """``(state_dict, optimizer_state_dict)`` for ``model.load_state_dict`` and
    ``optimizer.load_state_dict``. The optimizer's state_dict needs the module and the optimizer
    it will be loaded into (for parameter order and the hyperparameters ONNX Runtime does not
    store); without them it is ``None``. Tensors are copies (the state may be a mapped file).
    """
    torch = _torch()
    state_dict = {name: from_numpy(param.data) for name, param in state.parameters}
    if optimizer is None:
        return state_dict, None
    if model is None:
        raise CheckpointStateError("to_torch needs the module as well as the optimizer (to order the parameters)")
    names = _param_names(model)
    template = optimizer.state_dict()
    out_state: dict[int, dict[str, Any]] = {}
    kind = "sgd" if isinstance(optimizer, torch.optim.SGD) else "adam"
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, template["param_groups"], strict=True)):
        ort_group = state.optimizer_groups.get(f"group{i}")
        if ort_group is None:
            continue
        # The checkpoint holds the rate as float32: keep the optimizer's own value when it
        # rounds to the same float32, so that training continues bit for bit.
        if np.float32(saved["lr"]) != np.float32(ort_group.initial_learning_rate):
            saved["lr"] = ort_group.initial_learning_rate
        for param, index in zip(group["params"], saved["params"], strict=True):
            momentums = ort_group.momentums.get(names.get(id(param), ""))
            if not momentums:
                continue
            entry: dict[str, Any] = {TORCH_NAMES[kind][m]: from_numpy(v) for m, v in momentums.items()}
            if kind == "adam":
                entry["step"] = torch.tensor(float(ort_group.step))
            out_state[index] = entry
    return state_dict, {"state": out_state, "param_groups": template["param_groups"]}


def load_torch_file(path: str | os.PathLike[str], *, frozen: Iterable[str] = ()) -> CheckpointState:
    """A state from a file of ``torch.save(model.state_dict())`` (or of a dict holding one
    under ``"state_dict"`` or ``"model"``), read with ``weights_only=True``."""
    torch = _torch()
    with safe_io.open_regular(path) as f:  # a regular file only: a FIFO would block torch's open
        data = torch.load(f, map_location="cpu", weights_only=True)
    if isinstance(data, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(data.get(key), Mapping):
                data = data[key]
                break
    if not isinstance(data, Mapping) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointStateError(f"{os.fspath(path)}: not a state_dict of tensors")
    return from_torch(dict(data), frozen=frozen)


def save_torch_file(state: CheckpointState, path: str | os.PathLike[str]) -> None:
    """``torch.save`` of the state's parameters as a state_dict (the optimizer state needs a
    live optimizer to become torch's; use :func:`to_torch` for it)."""
    state_dict = to_torch(state)[0]
    with safe_io.atomic_file(path) as f:  # created exclusively, renamed over path
        _torch().save(state_dict, f)
