"""FedAvgM, FedAdam, FedYogi: Flower's results (its strategies of the same names, to the
float32 accumulation Flower's average has), their state in each round's checkpoint as the
optimizer group "server", and a resume that ends bit-identical."""

from __future__ import annotations

import flwr.serverapp.strategy as flowers
import numpy as np
import pytest
from conftest import FakeGrid, deterministic_client
from flwr.app import Array, ArrayRecord
from ortckpt import CheckpointManager
from ortckpt.flower import FedAdam, FedAvgM, FedYogi

KINDS = {
    "FedAvgM": (FedAvgM, flowers.FedAvgM, {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    "FedAdam": (FedAdam, flowers.FedAdam, {"eta": 0.05, "beta_1": 0.8}),
    "FedYogi": (FedYogi, flowers.FedYogi, {}),
}
ROUNDS = 4


def float_model():
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((6, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float64)}


def run(cls, kwargs, manager=None, crash=None):
    extra = {"manager": manager} if manager is not None else {}  # (Flower's own FedAvg takes none)
    strategy = cls(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0, **extra, **kwargs)
    grid = FakeGrid([1, 2, 3], deterministic_client, crash)
    return strategy.start(grid, ArrayRecord({k: Array(v) for k, v in float_model().items()}), num_rounds=ROUNDS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_server_optimizers_give_flowers_results(kind):
    mine_cls, flowers_cls, kwargs = KINDS[kind]
    mine = run(mine_cls, kwargs).arrays
    theirs = (
        flowers_cls(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0, **kwargs)
        .start(
            FakeGrid([1, 2, 3], deterministic_client),
            ArrayRecord({k: Array(v) for k, v in float_model().items()}),
            num_rounds=ROUNDS,
        )
        .arrays
    )
    plain = run(flowers.FedAvg, {}).arrays
    for key in float_model():
        got = mine[key].numpy()
        assert got.dtype == float_model()[key].dtype
        np.testing.assert_allclose(got, theirs[key].numpy(), rtol=1e-4, atol=1e-4)
        assert not np.allclose(got, plain[key].numpy())  # (the optimizer did something)


class Crash(Exception):
    pass


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_optimizer_state_is_committed_and_a_resumed_run_ends_bit_identical(kind, tmp_path):
    cls, _, kwargs = KINDS[kind]
    uninterrupted = run(cls, kwargs).arrays

    def crash(server_round):
        if server_round == 3:
            raise Crash

    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(Crash):
        run(cls, kwargs, manager, crash)
    manager.close()
    group = manager.latest().load().optimizer_groups["server"]
    assert group.step == 2 and sorted(group.momentums) == ["b", "w"]
    names = {"FedAvgM": ["momentum0"], "FedAdam": ["momentum0", "momentum1"], "FedYogi": ["momentum0", "momentum1"]}
    assert sorted(group.momentums["w"]) == names[kind]
    resumed = run(cls, kwargs, CheckpointManager(tmp_path / "run")).arrays
    assert {k: v.data for k, v in resumed.items()} == {k: v.data for k, v in uninterrupted.items()}


def test_every_rounds_checkpoint_loads_in_onnx_runtime(ort, tmp_path):
    """A client can start from any round's commit: ONNX Runtime reads its parameters, the split
    and the round (the server optimizer's group beside them)."""
    import hashlib

    from ortckpt import CheckpointState

    model = {**float_model(), "steps": np.array([1, 2], np.int64)}
    like = CheckpointState.from_arrays({k: v for k, v in model.items() if k != "steps"}, {"steps": model["steps"]})
    manager = CheckpointManager(tmp_path / "run")
    strategy = FedAdam(min_available_nodes=3, min_train_nodes=3, fraction_evaluate=0.0, manager=manager, like=like)
    strategy.start(FakeGrid([1, 2, 3], deterministic_client), ArrayRecord({k: Array(v) for k, v in model.items()}), 3)
    for info in manager.all():
        ours = info.load()
        seen = ort("describe", info.path)
        assert seen["properties"]["step"] == info.step
        for entry in seen["parameters"]:
            name = entry["name"]
            assert entry["requires_grad"] == (name != "steps")
            data = ours.parameters[name].data
            assert entry["sha256"] == hashlib.sha256(data.tobytes()).hexdigest(), (info.step, name)
        assert sorted(seen["parameter_names"]) == ["b", "steps", "w"]
