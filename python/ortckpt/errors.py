"""The exceptions ortckpt raises.

Every class derives from :class:`CheckpointError`, itself a ``RuntimeError``
because ONNX Runtime raises ``RuntimeError`` for the same failures: code written
for ``onnxruntime.training.api`` keeps catching them. Malformed files and invalid
values are also ``ValueError``; OS failures (a missing file, a full disk) are
plain ``OSError`` subclasses such as ``FileNotFoundError``, with ``filename`` set.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class. ``filename`` and ``tensor`` name the file and tensor concerned, when known."""

    filename: str | None = None
    tensor: str | None = None


class CheckpointFormatError(CheckpointError, ValueError):
    """The file is not a valid ONNX Runtime training checkpoint (ODTC version 2)."""


class UnsupportedDataTypeError(CheckpointFormatError, TypeError):
    """A tensor's data type has no meaning here: an unknown ONNX code in a file, or
    a NumPy dtype with no ONNX equivalent."""


class CheckpointStateError(CheckpointError, ValueError):
    """The state cannot be saved or changed as asked: values that disagree with a
    parameter's shape or dtype, bytes that disagree with dims, repeated names."""


class UnsupportedPlatformError(CheckpointError):
    """The host cannot read or write the format (it is big-endian)."""


class CheckpointIntegrityError(CheckpointError):
    """:func:`ortckpt.verify` found a damaged or incomplete checkpoint; ``problems`` lists
    every finding, each naming its file."""

    def __init__(self, path: object, problems: list[str]) -> None:
        self.filename = str(path)
        self.problems = list(problems)
        super().__init__(f"{path} failed verification:\n" + "\n".join(f"  {p}" for p in problems))


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A :class:`~ortckpt.CheckpointManager` already holds a checkpoint for this step."""


class InternalError(CheckpointError):
    """A bug in ortckpt, caught at the Rust boundary instead of crashing."""


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointStateError",
    "InternalError",
    "UnsupportedDataTypeError",
    "UnsupportedPlatformError",
]
