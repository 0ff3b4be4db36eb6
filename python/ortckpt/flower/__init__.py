"""ortckpt inside Flower (``pip install 'ortckpt[flower]'``, ``flwr`` 1.42): conversions between
a :class:`~ortckpt.CheckpointState` and Flower's ``ArrayRecord``; :class:`FedAvg`, Flower's
Message-API FedAvg aggregated by ortckpt's kernels, with server checkpoints and resume; and the
server optimizers :class:`FedAvgM`, :class:`FedAdam`, :class:`FedYogi` over it; and
:class:`OrtClient`, a client trained by ONNX Runtime's Module/Optimizer (onnxruntime-training).
See docs/flower.md."""

from .aggregate import Failure
from .client import OrtClient
from .convert import OPTIMIZER_PREFIX, ArrayRecordError, from_arrayrecord, to_arrayrecord
from .optimizers import FedAdam, FedAvgM, FedYogi
from .strategy import FedAvg

__all__ = [
    "OPTIMIZER_PREFIX",
    "ArrayRecordError",
    "Failure",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "OrtClient",
    "from_arrayrecord",
    "to_arrayrecord",
]
