"""Runs of checkpoints: :class:`CheckpointManager` and what it keeps beside each step.

- ``checkpoint_manager``: the manager (periodic and async saves, resume, retention, sharded runs),
  one class over a step store (:mod:`ortckpt.stepstore`: a directory, or an ``s3://`` prefix);
- ``common``: the copy an async save writes from, the report of an unwaited one, step checks;
- ``retention``: which steps a :class:`RetentionPolicy` keeps;
- ``metadata``: each step's ``metadata.json`` (metrics, config, files and SHA-256s);
- ``integrity``: :func:`verify`, of a step directory or a single checkpoint file;
- ``rng``: the random-number generators' state, saved with a step so a resumed run repeats it;
- ``validation``: :class:`Forward`, a forward pass of each new checkpoint before it is committed;
- ``tracking``: the :class:`~ortckpt.manager.tracking.Tracker` interface and ``MlflowTracker``, which
  report each committed step to an experiment tracker and hand the best to a model registry.

The steps themselves (their layout: :mod:`ortckpt.steps`; the transaction: :mod:`ortckpt.stepstore`)
are shared with sharded saves.
"""

from .checkpoint_manager import CheckpointInfo, CheckpointManager
from .integrity import Verified, verify
from .retention import RetentionPolicy
from .rng import capture_rng_state, restore_rng_state
from .validation import Forward

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "Forward",
    "RetentionPolicy",
    "Verified",
    "capture_rng_state",
    "restore_rng_state",
    "verify",
]
