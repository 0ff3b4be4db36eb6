"""Experiment tracking: a manager's checkpoints reported to the tracker people already use.

The manager knows one small interface, :class:`Tracker`; :class:`MlflowTracker` is the one
built in (``CheckpointManager(..., track="mlflow")``). Another tracker is a class with the same
four methods, passed as ``track=``: the manager does not change.

A tracker is told of a checkpoint once it is committed. Reporting is never part of the save: the
tracker's calls run on a thread of their own, and the manager waits for each at most the
tracker's deadline (its ``timeout``, :data:`DEFAULT_TIMEOUT` seconds unless it says otherwise), so
a server that is down or does not answer costs a save seconds, not MLflow's minutes of retries.
A tracker that fails is a warning, the checkpoint stays saved, and what was not reported is
reported later: by the call that goes on past its deadline, at the next save, or when the run is
resumed (the tracker compares the committed steps with the last one it recorded).

:mod:`.base` holds the interface and what trackers share, :mod:`.mlflow_tracker` the MLflow
tracker, :mod:`.reporter` the manager's side; every name is re-exported here.
"""

from .base import (
    DEFAULT_TIMEOUT,
    REPORT_NAME,
    TAG_CHECKPOINT,
    TAG_DIRECTORY,
    TAG_RUN_ID,
    TAG_RUN_KEY,
    TAG_SHA256,
    TAG_STEP,
    TAG_VERSION,
    CommittedCheckpoint,
    Lane,
    TrackedRun,
    Tracker,
    refusal,
    refused,
    tracker_timeout,
    warn_of_work,
)
from .mlflow_tracker import MlflowTracker, flatten, path_text, run_key
from .reporter import Reporter, tracker_for

__all__ = [
    "DEFAULT_TIMEOUT",
    "REPORT_NAME",
    "TAG_CHECKPOINT",
    "TAG_DIRECTORY",
    "TAG_RUN_ID",
    "TAG_RUN_KEY",
    "TAG_SHA256",
    "TAG_STEP",
    "TAG_VERSION",
    "CommittedCheckpoint",
    "Lane",
    "MlflowTracker",
    "Reporter",
    "TrackedRun",
    "Tracker",
    "flatten",
    "path_text",
    "refusal",
    "refused",
    "run_key",
    "tracker_for",
    "tracker_timeout",
    "warn_of_work",
]
