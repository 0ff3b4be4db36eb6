"""The Flower tests: run in their own venv (flwr and its pins: `make test-flower`), with a fake
grid that plays deterministic clients, and Flower messages built outside a run."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

# tests/ is on sys.path (the suite's root conftest), where the folder tests/torch would pass for a
# namespace package torch: ONNX Runtime's import probes torch and would fail on it (this venv has no torch).
sys.modules.setdefault("torch", None)

# Messages built outside a run need a task identity (a run sets it).
TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0


def out_message(arrays: ArrayRecord, node: int) -> Message:
    return Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train")


def reply(
    node: int, arrays: dict[str, np.ndarray] | ArrayRecord, weight: float | None = 1, **metrics: float
) -> Message:
    """A train reply from ``node``: its arrays and a MetricRecord with the weight."""
    record = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord({k: Array(v) for k, v in arrays.items()})
    values = dict(metrics)
    if weight is not None:
        values["num-examples"] = weight
    content = RecordDict({"arrays": record, "metrics": MetricRecord(values)})
    return Message(content, reply_to=out_message(record, node))


def error_reply(node: int, reason: str) -> Message:
    return Message(Error(code=1, reason=reason), reply_to=out_message(ArrayRecord(), node))


class FakeGrid:
    """Flower's Grid for Strategy.start, its clients deterministic functions of (node, round,
    arrays): ``client(node, round, arrays) -> (arrays dict, num_examples)``, and an optional
    ``crash(round)`` called before each train round (to kill the server mid-run)."""

    def __init__(self, nodes, client, crash=None):
        self.nodes, self.client, self.crash = list(nodes), client, crash

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            config = message.content["config"]
            round_ = int(config["server-round"])
            if message.metadata.message_type.startswith("train"):
                if self.crash is not None:
                    self.crash(round_)
                arrays = {k: v.numpy() for k, v in message.content["arrays"].items()}
                new, examples = self.client(node, round_, arrays)
                content = RecordDict(
                    {
                        "arrays": ArrayRecord({k: Array(v) for k, v in new.items()}),
                        "metrics": MetricRecord({"num-examples": examples, "loss": 1.0 / round_ + node}),
                    }
                )
            else:
                content = RecordDict({"metrics": MetricRecord({"num-examples": 2, "accuracy": 0.5 + round_ / 100})})
            replies.append(Message(content, reply_to=message))
        return replies


def deterministic_client(node, round_, arrays):
    """Moves each float array by a node- and round-dependent amount (seeded: the same every run)."""
    rng = np.random.default_rng(node * 1000 + round_)
    new = {}
    for key, value in arrays.items():
        if value.dtype.kind == "f":
            new[key] = (value + rng.standard_normal(value.shape).astype(value.dtype)).astype(value.dtype)
        else:
            new[key] = value
    return new, 10 + node


@pytest.fixture
def model():
    rng = np.random.default_rng(0)
    return {
        "fc.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(4).astype(np.float32),
        "emb": rng.standard_normal((5, 2)).astype(np.float64),
        "steps": np.array([3, 4], np.int64),
    }


class MessageGrid(FakeGrid):
    """A Grid whose nodes answer Flower's messages themselves: ``handler(node, message) -> reply``
    (e.g. an OrtClient's train/evaluate), in the order of the nodes."""

    def __init__(self, nodes, handler):
        super().__init__(nodes, client=None)
        self.handler = handler

    def send_and_receive(self, messages, timeout=None):
        return [self.handler(message.metadata.dst_node_id, message) for message in messages]


@pytest.fixture(scope="session")
def ort_artifacts(tmp_path_factory):
    """ONNX Runtime's training artifacts of a small MLP (ort_model.py), made once per session."""
    from ort_model import make_artifacts

    return make_artifacts(tmp_path_factory.mktemp("ort-artifacts"))
