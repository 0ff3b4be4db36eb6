"""ortckpt: fast, zero-copy ONNX Runtime training checkpoints.

A drop-in for ``onnxruntime.training.api.CheckpointState``::

    from ortckpt import CheckpointState   # was: from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint("checkpoint")
    state.properties["epoch"] = 5
    CheckpointState.save_checkpoint(state, "checkpoint", include_optimizer_state=True)
"""

import importlib
import os
from typing import TYPE_CHECKING, Any

from ._boundary import DEFAULT_EXTERNAL_DATA_THRESHOLD as _DEFAULT_EXTERNAL_DATA_THRESHOLD
from ._boundary import VERSION as __version__
from .checkpoint_state import CheckpointState, OptimizerGroup, Parameter, Parameters, Properties
from .dtypes import PackedBits, PackedInt4
from .errors import (
    CheckpointDirectoryInUseError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointLockedError,
    CheckpointStateError,
    ForkedSaveError,
    ForkedSaveTimeoutError,
    InternalError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    NotACheckpointStateError,
    ObjectStoreError,
    ScanTimeoutError,
    SpecialFileError,
    UnsupportedDataTypeError,
    UnsupportedPlatformError,
    ValidationTimeoutError,
    ValueOverflowError,
)
from .tensor_keys import TensorKey

# The rest is imported on first use (PEP 562), so `import ortckpt` costs the checkpoint
# state and NumPy, not the manager, the sharded writer or the ONNX exporters.
_LAZY = {
    "apply": ".arithmetic",
    "average": ".arithmetic",
    "delta": ".arithmetic",
    "interpolate": ".arithmetic",
    "Verified": ".manager",
    "verify": ".manager",
    "CheckpointInfo": ".manager",
    "CheckpointManager": ".manager",
    "Forward": ".manager",
    "RetentionPolicy": ".manager",
    "capture_rng_state": ".manager",
    "restore_rng_state": ".manager",
    "upgrade": ".versions",
    "TensorChange": ".statistics",
    "TensorStats": ".statistics",
    "tensor_changes": ".statistics",
    "tensor_stats": ".statistics",
    "render_report": ".report",
    "write_report": ".report",
    "export_model": ".convert.onnx_model",
    "inference_model": ".convert.onnx_model",
}

if TYPE_CHECKING:
    from .arithmetic import apply, average, delta, interpolate
    from .convert.onnx_model import export_model, inference_model
    from .manager import (
        CheckpointInfo,
        CheckpointManager,
        Forward,
        RetentionPolicy,
        Verified,
        capture_rng_state,
        restore_rng_state,
        verify,
    )
    from .report import render_report, write_report
    from .statistics import TensorChange, TensorStats, tensor_changes, tensor_stats
    from .versions import upgrade


def load_checkpoint(checkpoint_uri: Any, **options: Any) -> CheckpointState:
    """:meth:`CheckpointState.load_checkpoint`: a path, an ``s3://`` URL, or a binary file object;
    also a :class:`CheckpointManager` step folder (plain, sharded or compressed; local or
    ``s3://``, where a step's checkpoint object names its step too: it holds no values of its own
    when the step shares them), read as the command line reads one (:mod:`ortckpt.resolve`: a
    plain step's checkpoint checked against what its metadata.json records)."""
    from . import targets

    if isinstance(checkpoint_uri, (str, os.PathLike)):
        directory = os.path.isdir(checkpoint_uri)
        an_object = not directory and targets.is_object_url(checkpoint_uri)
        if an_object:
            targets.checkpoint(checkpoint_uri, options.get("storage_options"))  # (a bucket refused first)
        if directory or (an_object and set(options) <= {"verify", "storage_options"}):
            from . import resolve

            return resolve.load_step(  # type: ignore[no-any-return]
                os.fspath(checkpoint_uri),
                verify=bool(options.get("verify", False)),
                storage_options=options.get("storage_options"),
            )
    return CheckpointState.load_checkpoint(checkpoint_uri, **options)


def save_checkpoint(
    state: CheckpointState,
    checkpoint_uri: Any,
    include_optimizer_state: bool = False,
    *,
    external_data_threshold: int = _DEFAULT_EXTERNAL_DATA_THRESHOLD,
    durable: bool = False,
    progress: bool = False,
    storage_options: Any = None,
    lock_timeout: float | None = None,
) -> None:
    """:meth:`CheckpointState.save_checkpoint`: to a path, an ``s3://`` URL, or a binary file object."""
    # (a plain call, not f(**options): a Ctrl-C held across the commit then surfaces in our
    # caller, not at this call; see ortckpt.interrupts)
    CheckpointState.save_checkpoint(
        state,
        checkpoint_uri,
        include_optimizer_state,
        external_data_threshold=external_data_threshold,
        durable=durable,
        progress=progress,
        storage_options=storage_options,
        lock_timeout=lock_timeout,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ortckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointDirectoryInUseError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointIntegrityError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointState",
    "CheckpointStateError",
    "ForkedSaveError",
    "ForkedSaveTimeoutError",
    "Forward",
    "InternalError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "NotACheckpointStateError",
    "ObjectStoreError",
    "OptimizerGroup",
    "PackedBits",
    "PackedInt4",
    "Parameter",
    "Parameters",
    "Properties",
    "RetentionPolicy",
    "ScanTimeoutError",
    "SpecialFileError",
    "TensorChange",
    "TensorKey",
    "TensorStats",
    "UnsupportedDataTypeError",
    "UnsupportedPlatformError",
    "ValidationTimeoutError",
    "ValueOverflowError",
    "Verified",
    "__version__",
    "apply",
    "average",
    "capture_rng_state",
    "delta",
    "export_model",
    "inference_model",
    "interpolate",
    "load_checkpoint",
    "render_report",
    "restore_rng_state",
    "save_checkpoint",
    "tensor_changes",
    "tensor_stats",
    "upgrade",
    "verify",
    "write_report",
]
