"""``FedAvg``: Flower's Message-API FedAvg, averaged in ortckpt's kernels, with server
checkpoints in ONNX Runtime's format and resume.

Flower's own arguments and conventions (``fraction_train``, ``min_*_nodes``, the weighting
key ``"num-examples"``, ``evaluate_fn`` given to :meth:`FedAvg.start`) are Flower's FedAvg's,
which this class extends; it changes three things:

- ``aggregate_train`` screens every reply alone and drops the bad ones (reported in
  :attr:`FedAvg.failures` and the log), where Flower's refuses the whole round, and averages
  the rest in Rust from the replies' bytes (:mod:`ortckpt.flower.aggregate`), summed in the
  order of the nodes' ids (not of arrival): the same replies give the same bits in every run.
- With ``manager=`` (a :class:`~ortckpt.CheckpointManager`), every round commits the global
  model (an ONNX Runtime checkpoint: step = the round), the round's metrics (``train.<key>``,
  ``evaluate.<key>``, ``server.<key>`` for what ``evaluate_fn`` returns: what ``keep_best``
  ranks by) and every round's metric records so far in the step's metadata.
- :meth:`FedAvg.start` given a manager that holds a commit resumes at the round after it,
  from the committed global model (the ``initial_arrays`` are then not used), with the
  history of the committed rounds in its ``Result``.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from ..checkpoint_state import CheckpointState, OptimizerGroup
from ..errors import ArrayRecordError
from ..extras import require
from .aggregate import Failure, Layout, average, layout_of, nonfinite, nonfinite_keys, screen
from .convert import flwr_app, from_arrayrecord, to_arrayrecord

_strategies: Any = require("flwr.serverapp.strategy", "ortckpt.flower")
_log: Any = require("flwr.common.logger", "ortckpt.flower").log

# The key of the step metadata that holds the Flower history.
METADATA_KEY = "flower"
# Result's fields of MetricRecords by round, and the prefix of their scalars in a step's metrics.
_HISTORY = {
    "train": "train_metrics_clientapp",
    "evaluate": "evaluate_metrics_clientapp",
    "server": "evaluate_metrics_serverapp",
}


@dataclass(frozen=True)
class _Screened:
    """A reply that passed the screening: its node, content, ArrayRecord, values' offsets, weight."""

    node: int
    content: Any
    record: Any
    offsets: dict[str, int]
    weight: float


def _average(replies: list[_Screened], layout: Layout | None) -> Any:
    """The replies' weighted mean, or None without a reply of weight above 0."""
    if not replies or layout is None or sum(r.weight for r in replies) == 0:
        return None
    return average([r.record for r in replies], [r.offsets for r in replies], [r.weight for r in replies], layout)


class FedAvg(_strategies.FedAvg):  # type: ignore[misc]
    """Flower's FedAvg (same arguments), aggregated by ortckpt, with server checkpoints.

    ``manager``: a :class:`~ortckpt.CheckpointManager` that each round commits to and that
    :meth:`start` resumes from. ``like``: a state whose trainable/frozen split and properties
    the committed checkpoints take (:func:`~ortckpt.flower.from_arrayrecord`); without it every
    array is a trainable parameter.
    """

    def __init__(self, *args: Any, manager: Any = None, like: CheckpointState | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.manager = manager
        self.like = like
        # round -> the replies dropped from it, and why.
        self.failures: dict[int, list[Failure]] = {}
        self._layout: Layout | None = None

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Iterable[Any]:
        self._layout = layout_of(arrays)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> tuple[Any, Any]:
        """The weighted mean of the good replies' arrays and Flower's aggregate of their
        metrics; (None, None) when no reply is good. Replies with errors and those screened
        out are recorded in ``failures[server_round]``."""
        failures: list[Failure] = []
        good: list[_Screened] = []
        layout = self._layout
        # In the order of the nodes' ids, whatever the order of arrival (or of sampling): the
        # sums, so the global model, are then the same in every run with the same replies.
        for message in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = message.metadata.src_node_id
            if message.has_error():
                failures.append(Failure(node, f"error reply: {message.error.reason}"))
                continue
            try:
                weight, record, offsets, layout = screen(message.content, layout, self.weighted_by_key)
            except ArrayRecordError as e:
                failures.append(Failure(node, str(e)))
                continue
            # (aggregate_train without configure_train: the layout is the first good reply's)
            good.append(_Screened(node, message.content, record, offsets, weight))
        arrays = _average(good, layout)
        if arrays is not None and layout is not None and (bad_keys := nonfinite_keys(arrays, layout)):
            # Some replies hold NaN or infinities there: they are dropped, the others averaged again.
            finite = []
            for reply in good:
                reason = nonfinite(reply.record, reply.offsets, bad_keys, layout)
                if reason is None:
                    finite.append(reply)
                else:
                    failures.append(Failure(reply.node, reason))
            good = finite
            arrays = _average(good, layout)
        self.failures[server_round] = failures
        _log(INFO, "aggregate_train: %s replies averaged, %s dropped", len(good), len(failures))
        for failure in failures:
            _log(WARNING, "\t> reply of node %s dropped: %s", failure.node_id, failure.reason)
        if arrays is None:
            if good:
                _log(WARNING, "aggregate_train: every accepted reply weighs 0: the global model is kept")
            return None, None
        return arrays, self.train_metrics_aggr_fn([reply.content for reply in good], self.weighted_by_key)

    def start(
        self,
        grid: Any,
        initial_arrays: Any,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: Any = None,
        evaluate_config: Any = None,
        evaluate_fn: Callable[[int, Any], Any] | None = None,
    ) -> Any:
        """Flower's ``Strategy.start``, with a commit after each round and, when the manager
        holds one, a resume at the round after the latest commit."""
        train_config = flwr_app.ConfigRecord() if train_config is None else train_config
        evaluate_config = flwr_app.ConfigRecord() if evaluate_config is None else evaluate_config
        result = _strategies.Result()
        arrays, first = initial_arrays, 1
        latest = self.manager.latest() if self.manager is not None else None
        if latest is not None:
            arrays, first = self._resumed(latest, initial_arrays, result), latest.step + 1
            _log(INFO, "Resuming %s at round %s (round %s committed)", type(self).__name__, first, latest.step)
        else:
            _log(INFO, "Starting %s strategy:", type(self).__name__)
            self.summary()
            if evaluate_fn:
                res = evaluate_fn(0, initial_arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[0] = res
        t_start = time.time()
        for current_round in range(first, num_rounds + 1):
            _log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(current_round, arrays, train_config, grid), timeout=timeout
            )
            new_arrays, train_metrics = self.aggregate_train(current_round, replies)
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[current_round] = train_metrics
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid), timeout=timeout
            )
            evaluate_metrics = self.aggregate_evaluate(current_round, replies)
            if evaluate_metrics is not None:
                result.evaluate_metrics_clientapp[current_round] = evaluate_metrics
            if evaluate_fn:
                res = evaluate_fn(current_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
            if self.manager is not None:
                self.commit(current_round, arrays, result)
        if self.manager is not None:
            self.manager.wait()
        if not result.arrays:  # (no round changed the model: it is the one started from)
            result.arrays = arrays
        _log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(result)):
            _log(INFO, "\t%s", line.strip("\n"))
        return result

    def commit(self, server_round: int, arrays: Any, result: Any) -> None:
        """Commits ``arrays`` as the checkpoint of ``server_round``, with the round's metrics
        and the history so far (the values are the arrays' bytes: no copy before the write)."""
        state = from_arrayrecord(arrays, like=self.like)
        metrics: dict[str, float] = {}
        history: dict[str, dict[str, dict[str, Any]]] = {}
        for prefix, field in _HISTORY.items():
            by_round = getattr(result, field)
            history[prefix] = {str(r): dict(record) for r, record in by_round.items()}
            for name, value in dict(by_round.get(server_round, {})).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"{prefix}.{name}"] = float(value)
        failures = [[f.node_id, f.reason] for f in self.failures.get(server_round, [])]
        metadata = {METADATA_KEY: {"round": server_round, "history": history, "dropped": failures}}
        groups = self.server_optimizer_state()
        if groups:
            state.optimizer_groups = groups
        self.manager.save(state, server_round, metrics=metrics, metadata=metadata)

    def server_optimizer_state(self) -> dict[str, OptimizerGroup]:
        """The server optimizer's state as optimizer groups of the round's checkpoint (none for FedAvg)."""
        return {}

    def restore_server_optimizer(self, groups: dict[str, OptimizerGroup]) -> None:
        """Takes back what :meth:`server_optimizer_state` gave, from a committed checkpoint."""

    def _resumed(self, latest: Any, initial_arrays: Any, result: Any) -> Any:
        """The committed global model as an ``ArrayRecord`` (in ``initial_arrays``' order where
        they have the same keys), the committed history put into ``result``."""
        state = latest.load()
        self.restore_server_optimizer(state.optimizer_groups)
        record = to_arrayrecord(state)
        if set(record.keys()) == set(initial_arrays.keys()):
            record = flwr_app.ArrayRecord({key: record[key] for key in initial_arrays})
        history = (latest.metadata.get("user") or {}).get(METADATA_KEY, {}).get("history", {})
        for prefix, field in _HISTORY.items():
            for r, values in history.get(prefix, {}).items():
                getattr(result, field)[int(r)] = flwr_app.MetricRecord(values)
        result.arrays = record
        return record
