"""OrtClient: a Flower client's rounds trained by ONNX Runtime's Module and Optimizer (the on-device
flow: nominal checkpoint + one parameter buffer), its optimizer state kept between rounds by a
client-side manager; checked against ONNX Runtime's own loop."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from ort_model import FROZEN, STEPS, TRAINABLE, batches, training_api
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.flower import ArrayRecordError, OrtClient, to_arrayrecord


def message(arrays, server_round, kind="train"):
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})})
    return Message(content, dst_node_id=1, message_type=kind)


def initial(ort_artifacts, trainable_only=False):
    return to_arrayrecord(CheckpointState.load_checkpoint(ort_artifacts / "checkpoint"), trainable_only=trainable_only)


def ort_loop(ort_artifacts, arrays, rounds_of_batches):
    """ONNX Runtime's own loop, from the complete checkpoint with ``arrays`` as its parameters:
    every batch in turn, one Module and Optimizer throughout. -> (parameters, moments, step)."""
    _, C = training_api()
    state = C.load_checkpoint(str(ort_artifacts / "checkpoint"))
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    options = C.SessionOptions()
    module = C.Module(
        str(ort_artifacts / "training_model.onnx"), state, str(ort_artifacts / "eval_model.onnx"), device, options
    )
    optimizer = C.Optimizer(str(ort_artifacts / "optimizer_model.onnx"), state, device, options)
    for name in arrays:
        state.copy_parameter_from(name, C.OrtValue.ortvalue_from_numpy(arrays[name].numpy().copy(), device))
    for batch in (b for bs in rounds_of_batches for b in bs):
        fetches = C.OrtValueVector()
        module.train_step(list(batch), fetches)
        optimizer.optimizer_step()
        module.lazy_reset_grad()
    return module, state


def test_the_rounds_arrays_become_the_modules_parameters_by_name(ort_artifacts, tmp_path):
    record = initial(ort_artifacts)
    shifted = ArrayRecord({k: Array(v.numpy() + np.float32(i + 1)) for i, (k, v) in enumerate(record.items())})
    client = OrtClient(ort_artifacts, manager=CheckpointManager(tmp_path / "client"))
    assert client.checkpoint.name == "nominal_checkpoint"
    assert CheckpointState.load_checkpoint(client.checkpoint).is_nominal
    reply = client.train(message(shifted, 1), [])  # (no batch: the parameters as they went in)
    assert dict(reply.content["metrics"]) == {"num-examples": 0, "train_loss": 0.0}
    committed = CheckpointManager(tmp_path / "client", read_only=True).latest().load()
    for key, array in shifted.items():
        assert reply.content["arrays"][key].numpy().tobytes() == array.numpy().tobytes(), key
        # (ONNX Runtime's state, saved by name: the buffer's order is the Module's)
        assert committed.parameters[key].data.tobytes() == array.numpy().tobytes(), key
        assert committed.parameters[key].requires_grad == (key in TRAINABLE)


def test_a_client_manager_keeps_the_optimizer_state_from_round_to_round(ort_artifacts, tmp_path):
    record = initial(ort_artifacts)
    kept = OrtClient(ort_artifacts, manager=CheckpointManager(tmp_path / "kept"))
    fresh = OrtClient(ort_artifacts)
    first = kept.train(message(record, 1), batches(0, 1))
    assert (
        fresh.train(message(record, 1), batches(0, 1)).content["arrays"]["w1"].data
        == first.content["arrays"]["w1"].data
    )
    second = kept.train(message(first.content["arrays"], 2), batches(0, 2))
    without = fresh.train(message(first.content["arrays"], 2), batches(0, 2))
    # ONNX Runtime's loop over both rounds' batches, one Optimizer throughout: the kept client's bits.
    _, state = ort_loop(ort_artifacts, record, [batches(0, 1), batches(0, 2)])
    for name in TRAINABLE + FROZEN:
        expected = state.get_parameter(name).data.numpy()
        assert second.content["arrays"][name].numpy().tobytes() == expected.tobytes(), name
    assert without.content["arrays"]["w1"].numpy().tobytes() != second.content["arrays"]["w1"].numpy().tobytes()
    committed = CheckpointManager(tmp_path / "kept", read_only=True)
    assert committed.all_steps() == [1, 2]
    group = committed.latest().load().optimizer_groups["group0"]
    assert group.step == 2 * STEPS
    assert second.content["arrays"]["b2"].data == record["b2"].data  # (frozen)
    assert second.content["metrics"]["num-examples"] == 4 * STEPS


def test_a_round_trained_again_replaces_the_clients_commit_of_it(ort_artifacts, tmp_path):
    record = initial(ort_artifacts)
    client = OrtClient(ort_artifacts, manager=CheckpointManager(tmp_path / "client"))
    first = client.train(message(record, 1), batches(1, 1))
    second = client.train(message(first.content["arrays"], 2), batches(1, 2))
    # The server died before committing round 2 and sends it again: it starts from round 1's state.
    again = client.train(message(first.content["arrays"], 2), batches(1, 2))
    for key in record:
        assert again.content["arrays"][key].data == second.content["arrays"][key].data, key
    committed = CheckpointManager(tmp_path / "client", read_only=True)
    assert committed.all_steps() == [1, 2]
    assert committed.latest().load().optimizer_groups["group0"].step == 2 * STEPS


def test_trainable_arrays_alone_go_into_a_complete_checkpoint(ort_artifacts):
    record = initial(ort_artifacts, trainable_only=True)
    assert list(record.keys()) == TRAINABLE
    client = OrtClient(ort_artifacts, checkpoint=ort_artifacts / "checkpoint")
    reply = client.train(message(record, 1), batches(2, 1))
    assert list(reply.content["arrays"].keys()) == TRAINABLE
    _, state = ort_loop(ort_artifacts, record, [batches(2, 1)])
    for name in TRAINABLE:
        assert reply.content["arrays"][name].numpy().tobytes() == state.get_parameter(name).data.numpy().tobytes()


def test_evaluate_reports_the_eval_models_loss(ort_artifacts):
    record = initial(ort_artifacts)
    reply = OrtClient(ort_artifacts).evaluate(message(record, 1, "evaluate"), batches(3, 1))
    module, _ = ort_loop(ort_artifacts, record, [])
    _, C = training_api()
    losses = []
    for batch in batches(3, 1):
        fetches = C.OrtValueVector()
        module.eval_step(list(batch), fetches)
        losses.append(float(fetches[0].numpy()))
    assert dict(reply.content["metrics"]) == {"num-examples": 4 * STEPS, "eval_loss": float(np.mean(losses))}


def test_arrays_the_module_cannot_take_are_refused_by_name(ort_artifacts):
    client = OrtClient(ort_artifacts)  # (its nominal checkpoint)
    with pytest.raises(ArrayRecordError, match="nominal checkpoint takes every parameter"):
        client.train(message(initial(ort_artifacts, trainable_only=True), 1), [])
    record = initial(ort_artifacts)
    as_float64 = ArrayRecord({k: Array(v.numpy().astype(np.float64)) for k, v in record.items()})
    with pytest.raises(ArrayRecordError, match="w1: float64: ONNX Runtime's parameter buffer is float32"):
        client.train(message(as_float64, 1), [])
    missing = ArrayRecord({k: v for k, v in record.items() if k != "w2"})
    with pytest.raises(ArrayRecordError, match=r"missing \['w2'\]"):
        client.train(message(missing, 1), [])
    wrong_shape = ArrayRecord(
        {k: Array(v.numpy().reshape(-1)[:-1].copy()) if k == "w1" else v for k, v in record.items()}
    )
    with pytest.raises(Exception, match="size"):
        client.train(message(wrong_shape, 1), [])
