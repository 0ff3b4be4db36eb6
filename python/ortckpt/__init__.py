"""ortckpt: fast, zero-copy ONNX Runtime training checkpoints.

A drop-in for ``onnxruntime.training.api.CheckpointState``::

    from ortckpt import CheckpointState   # was: from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint("checkpoint")
    state.properties["epoch"] = 5
    CheckpointState.save_checkpoint(state, "checkpoint", include_optimizer_state=True)
"""

from importlib.metadata import PackageNotFoundError, version

from .checkpoint_state import CheckpointState, OptimizerGroup, Parameter, Parameters, Properties
from .dtypes import PackedInt4
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointStateError,
    InternalError,
    UnsupportedDataTypeError,
    UnsupportedPlatformError,
)

try:
    __version__ = version("ortckpt")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointState",
    "CheckpointStateError",
    "InternalError",
    "OptimizerGroup",
    "PackedInt4",
    "Parameter",
    "Parameters",
    "Properties",
    "UnsupportedDataTypeError",
    "UnsupportedPlatformError",
    "__version__",
]
