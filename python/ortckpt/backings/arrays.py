"""A state's tensors with their values in hand: arrays given to ``from_arrays``, a snapshot's
copies. The other backings build on it (their tensors too are :class:`Tensor`\\ s, made otherwise)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from .. import _boundary
from .._boundary import CoreState, PropertyValue, TensorRecord
from ..errors import CheckpointStateError
from . import Backing
from .tensors import OptimizerGroup, Tensor, TensorValue


class ArraysBacking:
    ort_state: Any = None
    has_external_data = False
    format_version = _boundary.CHECKPOINT_VERSION

    def __init__(
        self,
        tensors: dict[str, Any] | None = None,
        frozen: set[str] | None = None,
        properties: MutableMapping[str, PropertyValue] | None = None,
        nominal: bool = False,
    ) -> None:
        # name -> Tensor, in the state's order (a subclass may keep other entries until first used).
        self.tensors: dict[str, Any] = {} if tensors is None else tensors
        self.frozen: set[str] = set() if frozen is None else frozen
        self.properties: MutableMapping[str, PropertyValue] = {} if properties is None else properties
        self.groups: dict[str, OptimizerGroup] = {}
        self.nominal = nominal
        self._sorted: list[str] | None = None

    def add(self, tensor: Tensor, requires_grad: bool) -> None:
        if tensor.name in self.tensors:
            raise CheckpointStateError(f"Parameter {tensor.name} is given as both trainable and frozen.")
        self.tensors[tensor.name] = tensor
        if not requires_grad:
            self.frozen.add(tensor.name)
        self._sorted = None

    @property
    def is_nominal(self) -> bool:
        return self.nominal

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def sorted_names(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self.tensors)
        return self._sorted

    def tensor(self, name: str) -> Tensor:
        tensor: Tensor = self.tensors[name]
        return tensor

    def records(self) -> list[TensorRecord]:
        out = []
        for name in self.tensors:
            tensor = self.tensor(name)
            out.append(TensorRecord(name, tensor.code, tensor.dims, name not in self.frozen))
        return out

    def record(self, name: str) -> tuple[int, tuple[int, ...]]:
        tensor = self.tensor(name)
        return tensor.code, tensor.dims

    def value(self, name: str) -> TensorValue:
        return self.tensor(name).value()

    def prepare_values(self) -> None:
        pass

    def assign(self, name: str, value: Any) -> None:
        self.tensor(name).assign(value)

    def grad(self, name: str) -> np.ndarray | None:
        return self.tensor(name).grad()

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]:
        return self.groups

    def set_optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None:
        self.groups = dict(groups)

    def settled(self, include_optimizer_state: bool) -> Backing:
        return self

    def core_state(self, include_optimizer_state: bool) -> CoreState:
        nominal = self.is_nominal
        self.prepare_values()
        trainable = [self.tensor(n).to_core(nominal) for n in self.tensors if n not in self.frozen]
        frozen = [self.tensor(n).to_core(nominal) for n in self.frozen]
        groups = _groups_to_core(self.optimizer_groups) if include_optimizer_state else []
        return CoreState(trainable, frozen, groups, self.properties, nominal)


def _groups_to_core(groups: Mapping[str, OptimizerGroup]) -> list[Any]:
    out = []
    for group_name, group in groups.items():
        if not isinstance(group, OptimizerGroup):
            raise TypeError(f"optimizer group {group_name}: expected OptimizerGroup, got {type(group).__name__}")
        for param, moms in group.momentums.items():
            for m, v in moms.items():
                if v is None:
                    raise CheckpointStateError(
                        f"optimizer group {group_name}: {param}/{m} has no values (a nominal "
                        "checkpoint's momentums cannot be saved; save without the optimizer state)"
                    )
        states = [
            (param, [Tensor.from_value(m, v).to_core(False) for m, v in moms.items()])
            for param, moms in group.momentums.items()
        ]
        out.append((group_name, int(group.step), float(group.initial_learning_rate), states))
    return out
