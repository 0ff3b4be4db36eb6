"""What names a tensor of a checkpoint state: a parameter by its name, a momentum by its optimizer
group, parameter and momentum name.

Every reader of a state's tensors (``CheckpointState.tensors()``: arithmetic, statistics, the
report, ``ortckpt inspect --stats`` and ``diff``, the manager's snapshots) keys them by
:class:`TensorKey`. A key is not a string: a parameter literally named ``group0/w/momentum0`` and
the first momentum of ``w`` in ``group0`` are two keys, whatever the names in a file are. The
string ``group/parameter/momentum`` is a label for people (:attr:`TensorKey.label`), never an
identity.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

V = TypeVar("V")


class TensorKey:
    """A parameter (``group`` and ``momentum`` None) or a momentum of an optimizer group.

    Two keys are equal when they name the same tensor: the kind (parameter or momentum), the group,
    the parameter and the momentum. ``role`` ("trainable", "frozen" or "momentum") is carried along
    but a parameter frozen in one state and trainable in another is the same tensor (``diff``
    reports the role that differs). Keys sort parameters first, by name, then momentums by group,
    parameter and momentum.
    """

    # identity: (0, "", name, "") for a parameter, (1, group, parameter, momentum) for a momentum
    # (never equal); hash: its hash, kept (a pass over 16k tensors hashes each key more than once).
    __slots__ = ("hash", "identity", "role")

    def __init__(self, role: str, parameter: str, group: str | None = None, momentum: str | None = None) -> None:
        if role not in ("trainable", "frozen", "momentum"):
            raise ValueError(f"a key's role is trainable, frozen or momentum, got {role!r}")
        if (role == "momentum") != (group is not None and momentum is not None):
            raise ValueError(f"a {role} key: a momentum has a group and a name, a parameter neither")
        self.role = role
        self.identity = identity = (0, "", parameter, "") if group is None else (1, group, parameter, momentum)
        self.hash = hash(identity)

    @classmethod
    def of_parameter(cls, name: str, requires_grad: bool = True) -> TensorKey:
        key = _new(cls)  # (no checks to make, no call: made for every tensor of every pass)
        key.role = "trainable" if requires_grad else "frozen"
        key.identity = identity = (0, "", name, "")
        key.hash = hash(identity)
        return key

    @classmethod
    def of_momentum(cls, group: str, parameter: str, momentum: str) -> TensorKey:
        key = _new(cls)
        key.role = "momentum"
        key.identity = identity = (1, group, parameter, momentum)
        key.hash = hash(identity)
        return key

    @property
    def parameter(self) -> str:
        """The parameter's name (of a momentum: the parameter it belongs to)."""
        return self.identity[2]

    @property
    def group(self) -> str | None:
        """A momentum's optimizer group; None for a parameter."""
        return self.identity[1] if self.identity[0] else None

    @property
    def momentum(self) -> str | None:
        """A momentum's name (``momentum0``); None for a parameter."""
        return self.identity[3] if self.identity[0] else None

    @property
    def is_momentum(self) -> bool:
        return bool(self.identity[0])

    @property
    def label(self) -> str:
        """For people: a parameter's name, or ``group/parameter/momentum`` (which a parameter's
        name may also be: a label is not an identity)."""
        kind, group, parameter, momentum = self.identity
        return f"{group}/{parameter}/{momentum}" if kind else parameter

    def describe(self) -> str:
        """``tensor NAME`` or ``momentum group/parameter/momentum``, as messages name it."""
        return f"momentum {self.label}" if self.is_momentum else f"tensor {self.parameter}"

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "group": self.group, "parameter": self.parameter, "momentum": self.momentum}

    def __eq__(self, other: object) -> bool:
        return type(other) is TensorKey and self.identity == other.identity

    def __hash__(self) -> int:
        return self.hash

    def __lt__(self, other: TensorKey) -> bool:
        return self.identity < other.identity

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        if not self.is_momentum:
            return f"TensorKey.of_parameter({self.parameter!r}, requires_grad={self.role == 'trainable'})"
        return f"TensorKey.of_momentum({self.group!r}, {self.parameter!r}, {self.momentum!r})"


_new = object.__new__


class TensorTable(dict[TensorKey, V]):
    """A dict by :class:`TensorKey` (what ``tensor_stats`` and ``tensor_changes`` return). For
    convenience a ``str`` looks a tensor up by its label, when exactly one tensor has that label;
    when a parameter's name is also a momentum's label, the ``str`` is refused (``KeyError``
    naming both) and the key says which."""

    def __init__(self, items: Iterable[tuple[TensorKey, V]] = ()) -> None:
        super().__init__(items)
        self._labels: dict[str, list[TensorKey]] | None = None
        self._labelled = 0  # len(self) when _labels was made

    def keys_labelled(self, label: str) -> list[TensorKey]:
        """The keys whose label is ``label`` (two where a parameter is named like a momentum)."""
        if self._labels is None or self._labelled != len(self):
            self._labels = {}
            for key in self:
                self._labels.setdefault(key.label, []).append(key)
            self._labelled = len(self)
        return self._labels.get(label, [])

    def key_of(self, label: str) -> TensorKey:
        """The one key whose label is ``label``."""
        found = self.keys_labelled(label)
        if len(found) != 1:
            raise KeyError(
                label if not found else f"{label!r} labels {len(found)} tensors ({found}): look it up by its TensorKey"
            )
        return found[0]

    def __missing__(self, key: object) -> V:
        if isinstance(key, str):
            return dict.__getitem__(self, self.key_of(key))
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return bool(self.keys_labelled(key))
        return dict.__contains__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def labels(self) -> Iterator[str]:
        """Every key's label, in order (repeated where two tensors share one)."""
        return (key.label for key in self)
