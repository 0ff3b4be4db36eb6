"""ortckpt: fast, zero-copy ONNX Runtime training checkpoints.

A drop-in for ``onnxruntime.training.api.CheckpointState``::

    from ortckpt import CheckpointState   # was: from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint("checkpoint")
    state.properties["epoch"] = 5
    CheckpointState.save_checkpoint(state, "checkpoint", include_optimizer_state=True)
"""

from importlib.metadata import PackageNotFoundError, version

from .checkpoint_state import CheckpointState, OptimizerGroup, Parameter, Parameters, Properties
from .dtypes import PackedBits, PackedInt4
from .errors import (
    CheckpointDirectoryInUseError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointStateError,
    InternalError,
    SpecialFileError,
    UnsupportedDataTypeError,
    UnsupportedPlatformError,
)
from .integrity import Verified, verify
from .manager import CheckpointInfo, CheckpointManager
from .retention import RetentionPolicy
from .rng import capture_rng_state, restore_rng_state

try:
    __version__ = version("ortckpt")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "CheckpointDirectoryInUseError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointIntegrityError",
    "CheckpointManager",
    "CheckpointState",
    "CheckpointStateError",
    "InternalError",
    "OptimizerGroup",
    "PackedBits",
    "PackedInt4",
    "Parameter",
    "Parameters",
    "Properties",
    "RetentionPolicy",
    "SpecialFileError",
    "UnsupportedDataTypeError",
    "UnsupportedPlatformError",
    "Verified",
    "__version__",
    "capture_rng_state",
    "restore_rng_state",
    "verify",
]
