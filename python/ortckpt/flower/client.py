"""``OrtClient``: a Flower client that trains on ONNX Runtime's training artifacts.

ONNX Runtime's on-device flow, driven by a round's ``ArrayRecord``: the client's checkpoint
(often the nominal one ``generate_artifacts(..., nominal_checkpoint=True)`` writes: names and
types, no values) goes to ONNX Runtime's ``Module`` and ``Optimizer``; the round's arrays go in
as one parameter buffer (``Module.copy_buffer_to_parameters``), in the order the Module keeps its
weights (the training graph's inputs that are parameters); the Module trains on the batches; its
parameters come back out as a buffer (``copy_parameters_to_buffer``), cut into the reply's
arrays under the keys the server sent.

With ``manager=`` (a :class:`~ortckpt.CheckpointManager` of the client's own), each round's
trained state is committed (step = the server round, the optimizer's moments included) and the
next round starts from it: the local optimizer state persists between rounds (the server's
arrays replace the parameters, the moments stay). Without one, every round starts from the
checkpoint, its optimizer state fresh, as ONNX Runtime's own Flower examples do.

ONNX Runtime's buffers are float32 only (its ``copy_buffer_to_parameters`` takes nothing
else), so the arrays must be float32; a nominal checkpoint takes every parameter (ONNX Runtime
refuses ``trainable_only`` there), so the server then sends the frozen ones too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint_state import CheckpointState
from ..errors import ArrayRecordError
from ..extras import require
from ..live import ort_state_of
from .convert import flwr_app, values_of

# The files generate_artifacts writes into its artifact directory.
TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL = "training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"
CHECKPOINT, NOMINAL_CHECKPOINT = "checkpoint", "nominal_checkpoint"


def _training_api() -> Any:
    return require("onnxruntime.capi._pybind_state", "ortckpt.flower.OrtClient (onnxruntime-training)")


class OrtClient:
    """Trains and evaluates a Flower client's rounds with ONNX Runtime's ``Module``/``Optimizer``.

    ``artifacts``: the directory of ``generate_artifacts``' output (``training_model.onnx``,
    ``eval_model.onnx``, ``optimizer_model.onnx``). ``checkpoint``: the state the Module starts
    from (default: its ``nominal_checkpoint`` if there is one, else its ``checkpoint``).
    ``manager``: a client-side :class:`~ortckpt.CheckpointManager` that keeps the trained state
    (optimizer moments included) from one round to the next. ``learning_rate``: set on the
    Optimizer each round (default: the checkpoint's, or the optimizer model's).
    """

    def __init__(
        self,
        artifacts: str | os.PathLike[str],
        *,
        checkpoint: str | os.PathLike[str] | None = None,
        manager: Any = None,
        learning_rate: float | None = None,
    ) -> None:
        self.artifacts = Path(artifacts)
        if checkpoint is None:
            nominal = self.artifacts / NOMINAL_CHECKPOINT
            checkpoint = nominal if nominal.exists() else self.artifacts / CHECKPOINT
        self.checkpoint = Path(checkpoint)
        self.manager = manager
        self.learning_rate = learning_rate
        self._weights: list[str] | None = None

    def weight_names(self) -> list[str]:
        """The Module's parameters in its buffer's order: the training graph's inputs that
        are parameters of the checkpoint (what ONNX Runtime's Module keeps as its weights)."""
        if self._weights is None:
            onnx = require("onnx", "ortckpt.flower.OrtClient")
            graph = onnx.load(str(self.artifacts / TRAINING_MODEL), load_external_data=False).graph
            names = {record.name for record in CheckpointState.load_checkpoint(self.checkpoint).tensor_records()}
            self._weights = [i.name for i in graph.input if i.name in names]
        return self._weights

    def train(self, message: Any, batches: Iterable[Sequence[np.ndarray]]) -> Any:
        """The reply to a ``train`` message: its arrays trained on ``batches`` (each the
        training model's user inputs, e.g. ``(x, target)``), ``num-examples`` (the rows of the
        batches' first inputs) and ``train_loss`` (the mean of the steps' losses)."""
        server_round = int(message.content["config"]["server-round"])
        state, module, optimizer, trainable_only = self._session(message.content["arrays"], self._base(server_round))
        C = _training_api()
        examples, losses = 0, []
        for batch in batches:
            fetches = C.OrtValueVector()
            module.train_step(list(batch), fetches)
            optimizer.optimizer_step()
            module.lazy_reset_grad()
            losses.append(float(fetches[0].numpy()))
            examples += len(batch[0])
        arrays = self._arrays_out(module, message.content["arrays"], trainable_only)
        if self.manager is not None:
            self.manager.save(state, server_round, metrics={"train_loss": _mean(losses)})
            self.manager.wait()
        metrics = flwr_app.MetricRecord({"num-examples": examples, "train_loss": _mean(losses)})
        return flwr_app.Message(flwr_app.RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=message)

    def evaluate(self, message: Any, batches: Iterable[Sequence[np.ndarray]]) -> Any:
        """The reply to an ``evaluate`` message: ``num-examples`` and ``eval_loss`` (the mean of
        the eval model's losses over ``batches``) of the message's arrays."""
        # (the state held to the last step: ONNX Runtime's Module uses its memory and keeps no reference)
        state, module, _, _ = self._session(message.content["arrays"], CheckpointState.load_checkpoint(self.checkpoint))
        C = _training_api()
        examples, losses = 0, []
        for batch in batches:
            fetches = C.OrtValueVector()
            module.eval_step(list(batch), fetches)
            losses.append(float(fetches[0].numpy()))
            examples += len(batch[0])
        del module, state
        metrics = flwr_app.MetricRecord({"num-examples": examples, "eval_loss": _mean(losses)})
        return flwr_app.Message(flwr_app.RecordDict({"metrics": metrics}), reply_to=message)

    def _base(self, server_round: int) -> CheckpointState:
        """The state a train round starts from: the client's commit of the latest earlier round
        (its optimizer state), else the checkpoint. Commits of this round or later are deleted:
        the server runs such a round again only when it never committed it (it was killed), and
        the run must go on as if that attempt had not been."""
        if self.manager is None:
            return CheckpointState.load_checkpoint(self.checkpoint)
        for step in self.manager.all_steps():
            if step >= server_round:
                self.manager.delete(step)
        latest = self.manager.latest()
        return latest.load() if latest is not None else CheckpointState.load_checkpoint(self.checkpoint)

    def _session(self, record: Any, state: CheckpointState) -> tuple[CheckpointState, Any, Any, bool]:
        """(state, Module, Optimizer, trainable_only): ``state`` in ONNX Runtime, ``record``'s
        arrays as its parameters."""
        C = _training_api()
        device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        options = C.SessionOptions()
        ort_state = ort_state_of(state)  # (ONNX Runtime's state behind ortckpt's, as its Module takes it)
        module = C.Module(
            str(self.artifacts / TRAINING_MODEL), ort_state, str(self.artifacts / EVAL_MODEL), device, options
        )
        optimizer = C.Optimizer(str(self.artifacts / OPTIMIZER_MODEL), ort_state, device, options)
        if self.learning_rate is not None:
            optimizer.set_learning_rate(self.learning_rate)
        trainable_only = self._buffer_in(module, record, state)
        return state, module, optimizer, trainable_only

    def _buffer_in(self, module: Any, record: Any, state: CheckpointState) -> bool:
        """Copies ``record`` into the Module's parameters as one buffer; whether it held the
        trainable parameters only (else every parameter)."""
        weights = self.weight_names()
        if set(record.keys()) == set(weights):
            names, trainable_only = weights, False
        else:
            trainable_names = {record.name for record in state.tensor_records() if record.requires_grad}
            trainable = [name for name in weights if name in trainable_names]
            if set(record.keys()) != set(trainable):
                missing = sorted(set(weights) - set(record.keys()))
                extra = sorted(set(record.keys()) - set(weights))
                raise ArrayRecordError(
                    f"the round's arrays are neither every parameter of the Module nor its trainable ones "
                    f"(missing {missing[:5]}, not parameters {extra[:5]})"
                )
            if state.is_nominal:
                raise ArrayRecordError(
                    "a nominal checkpoint takes every parameter (ONNX Runtime: trainable_only must be false): "
                    "send the frozen parameters too (to_arrayrecord(state) without trainable_only)"
                )
            names, trainable_only = trainable, True
        parts = []
        for name in names:
            values = values_of(record[name], name)
            if values.dtype != np.float32:
                raise ArrayRecordError(f"{name}: {values.dtype}: ONNX Runtime's parameter buffer is float32", name)
            parts.append(values.reshape(-1))
        buffer = np.concatenate(parts) if parts else np.empty(0, np.float32)
        C = _training_api()
        device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        module.copy_buffer_to_parameters(C.OrtValue.ortvalue_from_numpy(buffer, device), trainable_only)
        return trainable_only

    def _arrays_out(self, module: Any, record: Any, trainable_only: bool) -> Any:
        """The Module's parameters as an ``ArrayRecord`` of ``record``'s keys, order and shapes."""
        C = _training_api()
        weights = self.weight_names()
        names = [name for name in weights if name in record] if trainable_only else weights
        size = int(module.get_parameters_size(trainable_only))
        buffer = np.empty(size, np.float32)
        device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        module.copy_parameters_to_buffer(C.OrtValue.ortvalue_from_numpy(buffer, device), trainable_only)
        values, offset = {}, 0
        for name in names:
            shape = tuple(record[name].shape)
            count = math.prod(shape)
            values[name] = buffer[offset : offset + count].reshape(shape)
            offset += count
        return flwr_app.ArrayRecord({key: flwr_app.Array(values[key]) for key in record})


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0
