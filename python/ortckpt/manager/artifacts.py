"""The run's graphs: what ``CheckpointManager(artifacts=...)`` records with each step, and
:meth:`CheckpointManager.restore_training`, which makes ONNX Runtime's ``Module`` and
``Optimizer`` over a restored step.

ONNX Runtime trains a model from its training artifacts (``generate_artifacts`` writes
``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx`` and ``checkpoint``): the
checkpoint holds the weights, the graphs the architecture. A step that records the graphs
resumes without the code or the folder that made them. How they are stored (once per distinct
content, shared by the steps) is the step store's (:mod:`ortckpt.stepstore`); this module reads
the argument, records what ran, and hands local files to ONNX Runtime.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import documents, safe_io, steps
from ..errors import InvalidArgumentError, InvalidArgumentTypeError, MissingArtifacts
from ..stepstore import Step, StepStore

# A folder of training artifacts names its graphs so (generate_artifacts' names; its checkpoint is
# the state, saved by the manager, not a graph).
ROLES_OF_A_FOLDER = ("training", "eval", "optimizer")

# ONNX Runtime's device names and the execution provider each trains on.
_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "dml": "DmlExecutionProvider",
}


def resolve(artifacts: Any) -> dict[str, Path]:
    """``artifacts`` (a folder of training artifacts, or a mapping of role to ONNX file) as
    role -> absolute path of a regular file, checked now (naming the argument): a role is a
    lowercase word ("training", "eval", "optimizer", "inference"...), a file is there, regular
    (a FIFO or a directory is refused unread) and under an ONNX model's 2 GiB."""
    if artifacts is None:
        return {}
    if isinstance(artifacts, (str, os.PathLike)):
        folder = Path(artifacts)
        if not folder.is_dir():
            raise (InvalidArgumentError if os.path.lexists(folder) else MissingArtifacts)(
                f"artifacts: {folder} is not a folder of training artifacts (give a folder, or a mapping of role "
                "to ONNX file)",
                "artifacts",
            )
        given = {role: folder / steps.artifact_name(role) for role in ROLES_OF_A_FOLDER}
        given = {role: path for role, path in given.items() if os.path.lexists(path)}
        if "training" not in given:
            raise InvalidArgumentError(f"artifacts: {folder} holds no {steps.artifact_name('training')}", "artifacts")
    elif isinstance(artifacts, Mapping):
        given = {}
        for role, path in artifacts.items():
            if not isinstance(role, str) or not documents.ARTIFACT_ROLE.fullmatch(role):
                raise InvalidArgumentError(
                    f"artifacts: the role {role!r} is not a lowercase word (such as 'training', 'eval', 'optimizer')",
                    "artifacts",
                    f"artifacts[{role!r}]",
                )
            if not isinstance(path, (str, os.PathLike)):
                raise InvalidArgumentTypeError(
                    f"artifacts[{role!r}] is the path of an ONNX file, got {type(path).__name__}",
                    "artifacts",
                    f"artifacts[{role!r}]",
                )
            given[role] = Path(path)
    else:
        raise InvalidArgumentTypeError(
            f"artifacts is a folder or a mapping of role to ONNX file, got {type(artifacts).__name__}", "artifacts"
        )
    if not given or len(given) > documents.MAX_ARTIFACTS:
        raise InvalidArgumentError(f"artifacts: 1 to {documents.MAX_ARTIFACTS} graphs, got {len(given)}", "artifacts")
    for role, path in given.items():
        try:
            opened = safe_io.open_regular(path)  # (IsADirectoryError, SpecialFileError: refused unread)
        except FileNotFoundError:
            at = f"artifacts[{role!r}]"
            raise MissingArtifacts(f"{at}: {path} is missing", "artifacts", at) from None
        with opened as f:
            size = os.fstat(f.fileno()).st_size
        if size > documents.MAX_ARTIFACT_BYTES:
            raise InvalidArgumentError(
                f"artifacts[{role!r}]: {path} has {size} bytes, more than an ONNX model can "
                f"({documents.MAX_ARTIFACT_BYTES})",
                "artifacts",
                f"artifacts[{role!r}]",
            )
    return {role: Path(os.path.abspath(path)) for role, path in sorted(given.items())}


def recorded(store: StepStore, step: Step | None, missing: MissingArtifacts) -> dict[str, Path]:
    """The graphs ``step`` (the run's latest) records, as sources for the next steps, when the
    ``artifacts`` given are not on this machine: a step folder copied alone resumes with the
    script that made it. Copied into this process's private folder (checked by digest), so that
    retention deleting the step leaves them. Without such a step, ``missing`` is raised."""
    if step is None or not graphs_of(step.document):
        raise missing
    cache = _graph_cache()
    sources = {}
    for role, path in local_graphs(store, step).items():
        digest = step.document["artifacts"][role]["sha256"]
        source = cache / f"source-{digest}.onnx"
        if not os.path.lexists(source):  # (copied aside, then named: two managers may copy it at once)
            partial = cache / f".source-{digest}.{steps.new_attempt()}"
            safe_io.copy_new(path, partial)
            safe_io.link_into_place(partial, source)
        sources[role] = source
    return sources


def recorded_by(store: StepStore, missing: MissingArtifacts) -> None:
    """Raises ``missing`` unless the run's latest step records graphs (read without a lock)."""
    scan = store.scan(steps.METADATA_NAME)
    if not scan.steps or not graphs_of(scan.steps[max(scan.steps)].document):
        raise missing


def check_device(device: Any) -> str | None:
    """ONNX Runtime's device string ("cpu", "cuda", "cuda:1"), or None."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise InvalidArgumentTypeError(f"device is ONNX Runtime's device name, got {type(device).__name__}", "device")
    if device.split(":")[0] not in _PROVIDERS or len(device) > 64:
        raise InvalidArgumentError(
            f"device is one of ONNX Runtime's ({', '.join(_PROVIDERS)}, with ':N' for an index), got {device!r}",
            "device",
        )
    return device


def runtime(device: str | None) -> dict[str, Any]:
    """What metadata.json records of where the run trains: the device and its execution provider."""
    return {"device": device, "execution_provider": _PROVIDERS[device.split(":")[0]] if device else None}


def graphs_of(metadata: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The step's graphs as its metadata records them: role -> {"name", "bytes", "sha256"}."""
    return dict(metadata.get("artifacts") or {})


_cache_lock = threading.Lock()
_cache: list[Path] = []


def _graph_cache() -> Path:
    """This process's private folder for graphs downloaded from object storage (one download per
    content), removed at exit; one a killed process left is swept as every scratch directory is."""
    with _cache_lock:
        if not _cache:
            stack = contextlib.ExitStack()
            _cache.append(stack.enter_context(safe_io.scratch_directory()))
            atexit.register(stack.close)
        return _cache[0]


def local_graphs(store: StepStore, step: Step) -> dict[str, Path]:
    """role -> a local file of the step's graph, checked against its size and SHA-256 (a
    directory's step: its own files; on object storage: downloaded once into a private cache)."""
    # (the cache is made only for a download: a directory's step holds its own graphs)
    return {role: store.graph_file(step, role, _graph_cache) for role in sorted(graphs_of(step.document))}


def training_session(state: Any, graphs: Mapping[str, Path], device: str | None, where: str) -> tuple[Any, Any, Any]:
    """ONNX Runtime's Module over ``state`` with the step's graphs, and its Optimizer (None when
    the step records no optimizer graph)."""
    if "training" not in graphs:
        raise FileNotFoundError(
            f"{where}: the step records no training graph (save with CheckpointManager(..., artifacts=...))"
        )
    api = training_api()
    for path in graphs.values():  # (ONNX Runtime opens them by name: a plain file, checked just now)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise FileNotFoundError(f"{path}: not a regular file")
    eval_model = os.fspath(graphs["eval"]) if "eval" in graphs else None
    module = api.Module(os.fspath(graphs["training"]), state, eval_model, device=device or "cpu")
    optimizer = api.Optimizer(os.fspath(graphs["optimizer"]), module) if "optimizer" in graphs else None
    return state, module, optimizer


def training_api() -> Any:
    """``onnxruntime.training.api`` (imported here only: ortckpt never requires it)."""
    try:
        from onnxruntime.training import api
    except ImportError as e:
        if e.name == "torch":
            raise ImportError(
                "restore_training imports onnxruntime.training.api, which imports torch: install a CPU torch, "
                "or register the package bare before (docs/ort-loop.md, the torch trap)"
            ) from e
        raise ImportError(
            "restore_training makes ONNX Runtime's Module and Optimizer: it needs onnxruntime-training "
            f"(pip install onnxruntime-training-cpu==1.19.2, the last release): {e}"
        ) from e
    return api


__all__ = [
    "MissingArtifacts",
    "check_device",
    "graphs_of",
    "local_graphs",
    "recorded",
    "recorded_by",
    "resolve",
    "runtime",
    "training_api",
    "training_session",
]
