"""ortckpt inside Flower (``pip install 'ortckpt[flower]'``, ``flwr`` 1.42): conversions between
a :class:`~ortckpt.CheckpointState` and Flower's ``ArrayRecord``, and :class:`FedAvg`, Flower's
Message-API FedAvg aggregated by ortckpt's kernels, with server checkpoints and resume.
See docs/flower.md."""

from .aggregate import Failure
from .convert import OPTIMIZER_PREFIX, ArrayRecordError, from_arrayrecord, to_arrayrecord
from .strategy import FedAvg

__all__ = ["OPTIMIZER_PREFIX", "ArrayRecordError", "Failure", "FedAvg", "from_arrayrecord", "to_arrayrecord"]
