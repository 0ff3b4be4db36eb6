"""A state over a loaded checkpoint file or buffer: every tensor stays where the load decoded it
(the core's ``ParameterIndex``; the state holds its position) until it is used, then becomes a
view over the file's private (copy-on-write) mapping; writing into it changes the state, never
the file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _boundary
from .arrays import ArraysBacking
from .tensors import OptimizerGroup, Tensor, TensorValue


class MappedBacking(ArraysBacking):
    def __init__(self, loaded: _boundary.Loaded) -> None:
        # name -> its position in the load's index (an int) until used, then its Tensor.
        tensors: dict[str, Any] = loaded.parameters.positions()
        # (a repeated property name: the last entry read wins, as in ONNX Runtime)
        super().__init__(tensors, loaded.parameters.frozen_names(), dict(loaded.properties), loaded.nominal)
        self.format_version = loaded.version  # (1: ONNX Runtime 1.16's; saves always write version 2)
        self._loaded = loaded
        # The loaded file's mappings (checkpoint, external data), which views keep alive.
        self.mappings: tuple[Any, Any] = loaded.mappings
        # Optimizer groups as loaded, turned into arrays on first access.
        self._pending_groups: list[Any] | None = loaded.optimizer_groups
        # Every tensor's view by position, made all at once by prepare_values (plain arrays:
        # nothing the garbage collector walks), None where made on first use; read only for
        # tensors not used yet (a Tensor, once made, took its view along).
        self._views: list[np.ndarray | None] = []

    @property
    def has_external_data(self) -> bool:  # type: ignore[override]
        return self.mappings[1] is not None

    def tensor(self, name: str) -> Tensor:
        entry = self.tensors[name]
        if type(entry) is int:  # its position in the load's index: not used yet
            _name, code, dims, stored = self._loaded.parameters.entry(entry)
            view = self._views[entry] if self._views else None
            entry = Tensor.from_file(name, code, dims, stored, self.mappings, view=view)
            self.tensors[name] = entry  # (published whole)
        tensor: Tensor = entry
        return tensor

    def value(self, name: str) -> TensorValue:
        """Without making the Tensor while the tensor is not used yet and its view at hand (a pass
        over 16k tensors comes through here)."""
        entry = self.tensors[name]
        if type(entry) is int and self._views:
            view = self._views[entry]
            if view is not None:
                return view
        return self.tensor(name).value()

    def prepare_values(self) -> None:
        """The views of every tensor, made in one core call (which reads none of their bytes; an
        object store's data file is still read a tensor at a time, on first use). Once: a tensor
        used since has its own view."""
        if not self._views and not self.nominal and self.tensors:
            self._views = _boundary.parameter_views(self._loaded)

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]:
        if self._pending_groups is not None:
            pending, self._pending_groups = self._pending_groups, None
            # Every momentum's view in one core call, then handed out in the same order.
            entries = [m for _group, _step, _lr, states in pending for _param, moms in states for m in moms]
            views = iter(_boundary.views(entries, self.mappings))
            for group_name, step, lr, states in pending:
                momentums = {
                    param: {entry[0]: self._momentum(entry, next(views)) for entry in moms} for param, moms in states
                }
                self.groups[group_name] = OptimizerGroup(step, lr, momentums)
        return self.groups

    def set_optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None:
        self._pending_groups = None
        super().set_optimizer_groups(groups)

    def _momentum(self, entry: _boundary.CoreTensor, view: np.ndarray | None) -> TensorValue | None:
        if entry[3] is None:  # nominal: no values
            return None
        return view if view is not None else Tensor.from_file(*entry, self.mappings).value()
