"""Where a ``CheckpointState`` keeps its tensors, properties and optimizer state: one backing.

``CheckpointState`` is a thin shell (ONNX Runtime's API: ``parameters``, ``properties``,
``optimizer_groups``, saves) over one :class:`Backing`, which it replaces when the state goes live:

- :class:`~ortckpt.backings.arrays.ArraysBacking`: values in hand (``from_arrays``, a snapshot);
- :class:`~ortckpt.backings.mapped.MappedBacking`: a loaded file or buffer, its tensors views over
  the mapping made when first used;
- ``ortckpt.live.LiveBacking``: ONNX Runtime's own state, the values its ``Module`` trains.

Nothing outside a backing reads its insides: the state, the ORT bridge and every reader of tensors
go through this protocol (mypy holds the implementations to it).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol

import numpy as np

from .._boundary import CoreState, PropertyValue, TensorRecord
from .tensors import OptimizerGroup, TensorValue


class Backing(Protocol):
    # ONNX Runtime's state (onnxruntime.capi's CheckpointState) this backing is, or None.
    ort_state: Any
    # The names of the frozen parameters (requires_grad False).
    frozen: set[str]
    # Properties by name, values as a file holds them (checked by the state before they get here).
    properties: MutableMapping[str, PropertyValue]

    @property
    def is_nominal(self) -> bool: ...

    @property
    def has_external_data(self) -> bool: ...

    @property
    def format_version(self) -> int: ...

    def __contains__(self, name: object) -> bool: ...

    def __len__(self) -> int: ...

    def names(self) -> list[str]:
        """Every parameter's name, in the state's order (the file's, or as given)."""
        ...

    def sorted_names(self) -> list[str]:
        """Every parameter's name, sorted, as ONNX Runtime iterates them."""
        ...

    def records(self) -> list[TensorRecord]:
        """Every parameter's name, type code, dims and requires_grad, in the state's order."""
        ...

    def record(self, name: str) -> tuple[int, tuple[int, ...]]:
        """(ONNX type code, dims) of one parameter."""
        ...

    def value(self, name: str) -> TensorValue:
        """A parameter's values (``KeyError`` for an unknown name)."""
        ...

    def prepare_values(self) -> None:
        """Before a pass over every value: make what can be made at once (a file's views)."""
        ...

    def assign(self, name: str, value: Any) -> None:
        """Copies ``value`` into a parameter (same dtype and shape, else CheckpointStateError)."""
        ...

    def grad(self, name: str) -> np.ndarray | None: ...

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]: ...

    def set_optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None: ...

    def settled(self, include_optimizer_state: bool) -> Backing:
        """A backing whose values are those of one moment: itself, but for a state ONNX Runtime
        trains asked for its optimizer state (then a copy ONNX Runtime saves, in memory)."""
        ...

    def core_state(self, include_optimizer_state: bool) -> CoreState:
        """The state as the core writes it (values handed over as their own memory, not copied)."""
        ...
