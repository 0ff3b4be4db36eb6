"""The exceptions ortckpt raises.

Every class derives from :class:`CheckpointError`, itself a ``RuntimeError``
because ONNX Runtime raises ``RuntimeError`` for the same failures: code written
for ``onnxruntime.training.api`` keeps catching them. Malformed files and invalid
values are also ``ValueError``; OS failures (a missing file, a full disk) are
plain ``OSError`` subclasses such as ``FileNotFoundError``, with ``filename`` set.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(RuntimeError):
    """Base class. ``filename`` and ``tensor`` name the file and tensor concerned, when known."""

    filename: str | None = None
    tensor: str | None = None


def name_file(error: CheckpointError, filename: str) -> None:
    """Names ``filename`` in ``error``, raised before the file was known (a check of the values
    to write): as its ``filename`` and at the start of its message."""
    error.filename = filename
    error.args = (f"{filename}: {error}",)


class CheckpointFormatError(CheckpointError, ValueError):
    """The file is not a valid ONNX Runtime training checkpoint (ODTC version 2)."""


class UnsupportedDataTypeError(CheckpointFormatError, TypeError):
    """A tensor's data type has no meaning here: an unknown ONNX code in a file, or
    a NumPy dtype with no ONNX equivalent."""


class CheckpointStateError(CheckpointError, ValueError):
    """The state cannot be saved or changed as asked: values that disagree with a
    parameter's shape or dtype, bytes that disagree with dims, repeated names."""


class InvalidArgumentError(CheckpointStateError):
    """An argument refused before any work is done: out of its range, not finite, at odds with
    the others (3 weights for 2 checkpoints), or text a file cannot hold. ``argument`` names it
    (e.g. ``"max_to_keep"``, ``"weights"``), ``key`` the place inside it when it is a mapping
    (e.g. ``metadata['1']``). What the command line reports as a usage error."""

    def __init__(self, message: str, argument: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument
        self.key = key


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type: a float or a bool where a count goes, a str where a
    number or a bool goes, a mapping key that is neither str nor int."""


class NotACheckpointStateError(InvalidArgumentTypeError, AttributeError):
    """``CheckpointState.save_checkpoint`` was given something that is not a state. Also an
    ``AttributeError``, which ONNX Runtime raises there (reading the argument's ``_state``), so
    an ``except AttributeError`` written for ONNX Runtime still catches it."""


class ValueOverflowError(CheckpointStateError, OverflowError):
    """A value that does not fit the type that must hold it, from inputs that fit theirs: an
    arithmetic result past its tensor's data type (``tensor`` and ``filename`` name it), a
    float property past float32, an int property or a sum of ``num_samples`` past int64.
    Nothing is written."""


class UnsupportedPlatformError(CheckpointError):
    """The host cannot read or write the format (it is big-endian)."""


class CheckpointIntegrityError(CheckpointError):
    """:func:`ortckpt.verify` found a damaged or incomplete checkpoint; ``problems`` lists
    every finding, each naming its file."""

    def __init__(self, path: object, problems: list[str]) -> None:
        self.filename = str(path)
        self.problems = list(problems)
        super().__init__(f"{path} failed verification:\n" + "\n".join(f"  {p}" for p in problems))


class ValidationTimeoutError(CheckpointIntegrityError, TimeoutError):
    """A check of a new checkpoint in a fresh process (``verify_after_save="process"``,
    ``validate=Forward(..., process=True)``) ran past its deadline: the process and every process
    it started were killed, and the step was not committed. ``filename`` names the checkpoint;
    ``timeout`` is the deadline in seconds."""

    def __init__(self, path: object, problem: str, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(path, [problem])


class ForkedSaveError(CheckpointError):
    """An async save taken by a forked process (``CheckpointManager(async_save="fork")``) failed
    there: the process raised (its message says what), was killed, or ran past its deadline
    (:class:`ForkedSaveTimeoutError`). Nothing was committed: the previous steps stand and the
    step's temporary files are gone. ``filename`` names the step's checkpoint."""

    def __init__(self, path: object, problem: str) -> None:
        self.filename = str(path)
        super().__init__(f"{path}: {problem} (nothing was committed, the steps saved before stand)")


class ForkedSaveTimeoutError(ForkedSaveError, TimeoutError):
    """A forked save's process ran past its deadline (``timeout``, seconds) and was killed."""

    def __init__(self, path: object, problem: str, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(path, problem)


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A :class:`~ortckpt.CheckpointManager` already holds a checkpoint for this step."""


class CheckpointLockedError(CheckpointError):
    """A lock ortckpt needs stayed held by another process past its deadline (a save waits
    at most ``lock_timeout`` for another save of the same path to commit), or belongs to
    another user (ortckpt locks only files its own user created, so that nobody else can
    hold them). ``filename`` is the lock file; ``holder`` who holds it, as it recorded itself."""

    holder: object = None


class CheckpointDirectoryInUseError(CheckpointLockedError):
    """Another writer (a :class:`~ortckpt.CheckpointManager`, or a sharded save) holds this
    directory. ``holder`` says who, as that writer recorded it (pid, host, start time,
    command), as far as it could be read; ``filename`` is the directory."""

    def __init__(self, directory: object, holder: dict[str, object]) -> None:
        self.filename = str(directory)
        self.holder = dict(holder)
        who = ", ".join(f"{k} {holder[k]}" for k in ("pid", "host", "started", "command") if k in holder)
        super().__init__(
            f"{directory}: another writer holds this checkpoint directory ({who or 'holder unknown'}); "
            "one writer at a time: wait for it to close, or open a reader with read_only=True"
        )


class SpecialFileError(CheckpointError, OSError):
    """The path names a FIFO, socket or device, not a regular file: refused before it is
    opened for reading (opening a FIFO would wait forever). ``filename`` names it."""


class ObjectStoreError(CheckpointError, OSError):
    """A request to an object store (``s3://``) failed: unreachable, refused or denied, or the
    object was replaced while a load read it. ``filename`` is the object's URL."""

    def __init__(self, url: str, problem: object) -> None:
        self.filename = url
        super().__init__(f"{url}: {problem}")


class ScanTimeoutError(CheckpointError, TimeoutError):
    """A reader looked for a run's committed steps as long as it may (20 looks, 10 s at most), and
    each look found the newest step it listed deleted under it and nothing committed (a writer's
    retention deleting steps faster than this reader reads them): not "no checkpoint", which may
    be false. ``filename`` is the run."""

    def __init__(self, run: str, problem: str) -> None:
        self.filename = run
        super().__init__(f"{run}: {problem}")


class ConversionError(CheckpointError, ValueError):
    """A conversion that cannot be done as asked (unknown format, a missing template model)."""


class ArrayRecordError(CheckpointStateError):
    """An ``ArrayRecord`` (or a state) that cannot be converted; ``tensor`` names the key."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class MissingArtifacts(InvalidArgumentError, FileNotFoundError):
    """The ``artifacts`` given are not on this machine (the folder, or a file of the mapping)."""


class NotACheckpointError(CheckpointFormatError):
    """The name is neither a checkpoint nor a step folder (a bucket, a run, another directory)."""


class ShardedCheckpointError(CheckpointError):
    """A collective save or load failed on one or more ranks; raised on every rank alike.
    ``failures`` maps each failed rank to its error. A failed save commits nothing."""

    def __init__(self, what: str, failures: Mapping[int, str]) -> None:
        self.failures = dict(failures)
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in sorted(self.failures.items()))
        super().__init__(f"{what} failed on {len(self.failures)} rank(s):\n{lines}")


class DocumentError(CheckpointFormatError):
    """A JSON document that is malformed, too large, too deep, or not of its schema."""


class InternalError(CheckpointError):
    """A bug in ortckpt, caught at the Rust boundary instead of crashing."""


__all__ = [
    "CheckpointDirectoryInUseError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointLockedError",
    "CheckpointStateError",
    "ForkedSaveError",
    "ForkedSaveTimeoutError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "ScanTimeoutError",
    "SpecialFileError",
    "UnsupportedDataTypeError",
    "UnsupportedPlatformError",
    "ValidationTimeoutError",
    "ValueOverflowError",
]
