"""Files ortckpt writes load in the real ONNX Runtime 1.19.2, and the other way round.

ONNX Runtime runs in its own virtualenv (tests/interop/ort_helper.py, through the `ort` fixture).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "ort-vectors"

# Every dtype ONNX Runtime 1.19.2 can load into a CheckpointState.
ORT_LOADABLE = [
    np.float32,
    np.float64,
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
]


def sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@pytest.fixture
def rich_state() -> CheckpointState:
    """Parameters of every ORT-loadable dtype and several shapes, AdamW state, properties."""
    rng = np.random.default_rng(42)
    shapes = [(3, 4), (), (0,), (2, 1, 3, 1, 2), (17,)]
    trainable, frozen = {}, {}
    for i, dtype in enumerate(ORT_LOADABLE):
        array = (
            rng.integers(0, 2, shapes[i % len(shapes)])
            if dtype == np.bool_
            else rng.integers(-100, 100, shapes[i % len(shapes)]) % 100
        ).astype(dtype)
        (trainable if i % 3 else frozen)[f"layer{i}.{np.dtype(dtype).name}"] = array
    trainable["fc.weight"] = rng.standard_normal((64, 32)).astype(np.float32)
    state = CheckpointState.from_arrays(
        trainable, frozen, {"epoch": 7, "best_accuracy": 0.875, "run": "interop ünïcødé", "flag": True}
    )
    float_params = {n: a for n, a in trainable.items() if a.dtype in (np.float32, np.float64)}
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=12,
        initial_learning_rate=3e-4,
        momentums={n: {"momentum0": a * 0.5, "momentum1": a * a} for n, a in float_params.items()},
    )
    return state


def expected_view(state: CheckpointState) -> dict:
    params = []
    for name, p in state.parameters:
        params.append(
            {
                "name": name,
                "requires_grad": p.requires_grad,
                "dtype": str(p.data.dtype),
                "shape": list(p.data.shape),
                "sha256": sha256(p.data),
            }
        )
    return {
        "parameter_names": [n for n, _ in state.parameters],
        "parameters": params,
        "properties": dict(state.properties),
    }


def assert_same_state(a: CheckpointState, b: CheckpointState, with_optimizer: bool = True) -> None:
    assert expected_view(a) == expected_view(b)
    if not with_optimizer:
        return
    ga, gb = a.optimizer_groups, b.optimizer_groups
    assert sorted(ga) == sorted(gb)
    for name in ga:
        assert ga[name].step == gb[name].step
        # The file holds float32; a group built in Python may still hold the float64 it was given.
        assert np.float32(ga[name].initial_learning_rate) == np.float32(gb[name].initial_learning_rate)
        assert sorted(ga[name].momentums) == sorted(gb[name].momentums)
        for param, moms in ga[name].momentums.items():
            assert sorted(moms) == sorted(gb[name].momentums[param])
            for m, value in moms.items():
                other = gb[name].momentums[param][m]
                assert (value.dtype, value.shape, sha256(value)) == (other.dtype, other.shape, sha256(other))


def test_a_file_ortckpt_writes_loads_in_onnx_runtime_identically(ort, rich_state, tmp_path):
    path = tmp_path / "ours.ckpt"
    CheckpointState.save_checkpoint(rich_state, path, include_optimizer_state=True)
    assert ort("describe", path) == expected_view(rich_state)


def test_onnx_runtime_resaving_our_file_keeps_every_byte(ort, rich_state, tmp_path):
    ours, theirs = tmp_path / "ours.ckpt", tmp_path / "theirs.ckpt"
    CheckpointState.save_checkpoint(rich_state, ours, include_optimizer_state=True)
    ort("resave", ours, theirs)
    assert_same_state(CheckpointState.load_checkpoint(theirs), rich_state)
    # Without optimizer state, ONNX Runtime drops the groups, as ortckpt does.
    ort("resave", ours, tmp_path / "no_opt.ckpt", "--no-optimizer")
    assert CheckpointState.load_checkpoint(tmp_path / "no_opt.ckpt").optimizer_groups == {}


@pytest.mark.parametrize(
    "name", ["trained_with_optimizer.ckpt", "trained_no_optimizer.ckpt", "protos.ckpt", "protos_properties.ckpt"]
)
def test_files_onnx_runtime_writes_load_identically_in_ortckpt(ort, name, tmp_path):
    # ONNX Runtime re-saves its own file; ortckpt must read what ONNX Runtime reads.
    fresh = tmp_path / "fresh.ckpt"
    ort("resave", GOLDEN / name, fresh)
    state = CheckpointState.load_checkpoint(fresh)
    assert ort("describe", fresh) == expected_view(state)
    assert_same_state(state, CheckpointState.load_checkpoint(GOLDEN / name))


def test_nominal_files_written_by_ortckpt_load_in_onnx_runtime(ort, tmp_path):
    state = CheckpointState.load_checkpoint(GOLDEN / "protos_nominal.ckpt")
    CheckpointState.save_checkpoint(state, tmp_path / "nominal.ckpt")
    seen = ort("describe", tmp_path / "nominal.ckpt")
    assert seen["parameter_names"] == state.parameters.names()
    assert all("nominal" in p["error"] for p in seen["parameters"])


def test_training_resumes_in_onnx_runtime_from_an_ortckpt_file(ort, tmp_path):
    """Module + Optimizer step from our copy of a trained state: bit-identical to ONNX Runtime's own file."""
    artifacts = GOLDEN / "artifacts"
    ours = tmp_path / "ours.ckpt"
    state = CheckpointState.load_checkpoint(GOLDEN / "trained_with_optimizer.ckpt")
    CheckpointState.save_checkpoint(state, ours, include_optimizer_state=True)
    from_ours = ort("train", ours, artifacts, tmp_path / "after_ours.ckpt")
    from_theirs = ort("train", GOLDEN / "trained_with_optimizer.ckpt", artifacts, tmp_path / "after_theirs.ckpt")
    assert from_ours["loss"] == from_theirs["loss"] and np.isfinite(from_ours["loss"])
    after_ours = CheckpointState.load_checkpoint(tmp_path / "after_ours.ckpt")
    after_theirs = CheckpointState.load_checkpoint(tmp_path / "after_theirs.ckpt")
    assert_same_state(after_ours, after_theirs)
    assert after_ours.optimizer_groups["group0"].step == 4  # one more AdamW step than the file held
    moved = after_ours.parameters["0.weight"].data
    assert not np.array_equal(moved, state.parameters["0.weight"].data)


def test_training_starts_from_a_state_built_with_from_arrays(ort, tmp_path):
    """A fresh AdamW state made in Python (no ONNX Runtime) trains in ONNX Runtime."""
    initial = CheckpointState.load_checkpoint(GOLDEN / "artifacts" / "checkpoint")
    trainable = {n: p.data.copy() for n, p in initial.parameters if p.requires_grad}
    frozen = {n: p.data.copy() for n, p in initial.parameters if not p.requires_grad}
    state = CheckpointState.from_arrays(trainable, frozen, {"epoch": 0})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=0,
        initial_learning_rate=0.01,
        momentums={n: {"momentum0": np.zeros_like(a), "momentum1": np.zeros_like(a)} for n, a in trainable.items()},
    )
    CheckpointState.save_checkpoint(state, tmp_path / "start.ckpt", include_optimizer_state=True)
    result = ort("train", tmp_path / "start.ckpt", GOLDEN / "artifacts", tmp_path / "after.ckpt")
    assert np.isfinite(result["loss"])
    after = CheckpointState.load_checkpoint(tmp_path / "after.ckpt")
    assert after.optimizer_groups["group0"].step == 1
    assert after.properties["epoch"] == 0
    assert not np.array_equal(after.parameters["0.weight"].data, trainable["0.weight"])
    np.testing.assert_array_equal(after.parameters["2.bias"].data, frozen["2.bias"])  # frozen stays


def test_external_data_written_by_ortckpt_loads_in_onnx_runtime_and_back(ort, rich_state, tmp_path):
    """Momentums external too (ONNX Runtime reads them); ONNX Runtime's own re-save of an
    external state (state path: module tensors external, momentums inline) loads back identically."""
    ours, theirs = tmp_path / "ours.ckpt", tmp_path / "theirs.ckpt"
    CheckpointState.save_checkpoint(rich_state, ours, include_optimizer_state=True, external_data_threshold=0)
    assert (tmp_path / "ours.ckpt.data").exists()
    assert ort("describe", ours) == expected_view(rich_state)
    ort("resave", ours, theirs)
    assert (tmp_path / "theirs.ckpt.data").exists()  # ONNX Runtime kept the state external
    assert_same_state(CheckpointState.load_checkpoint(theirs), rich_state)


def test_training_resumes_in_onnx_runtime_from_an_external_ortckpt_file(ort, tmp_path):
    ours = tmp_path / "ours.ckpt"
    state = CheckpointState.load_checkpoint(GOLDEN / "trained_with_optimizer.ckpt")
    CheckpointState.save_checkpoint(state, ours, include_optimizer_state=True, external_data_threshold=0)
    from_ours = ort("train", ours, GOLDEN / "artifacts", tmp_path / "after_ours.ckpt")
    from_theirs = ort("train", GOLDEN / "trained_with_optimizer.ckpt", GOLDEN / "artifacts", tmp_path / "after.ckpt")
    assert from_ours["loss"] == from_theirs["loss"]
    assert_same_state(
        CheckpointState.load_checkpoint(tmp_path / "after_ours.ckpt"),
        CheckpointState.load_checkpoint(tmp_path / "after.ckpt"),
    )


def test_a_checkpoint_manager_step_loads_and_trains_in_onnx_runtime(ort, tmp_path):
    """The file in a manager's step directory is what ONNX Runtime's load_checkpoint takes:
    same parameters, step and epoch among its properties, and training goes on from it."""
    from ortckpt import CheckpointManager

    state = CheckpointState.load_checkpoint(GOLDEN / "trained_with_optimizer.ckpt")
    manager = CheckpointManager(tmp_path / "run", async_save=True, verify_after_save="process")
    manager.save(state, 3, epoch=1, metrics={"loss": 0.25})
    manager.close()
    path = manager.latest().path
    seen = ort("describe", path)
    assert seen["parameter_names"] == state.parameters.names()
    assert seen["properties"]["step"] == 3 and seen["properties"]["epoch"] == 1
    trained = ort("train", path, GOLDEN / "artifacts", tmp_path / "after.ckpt")
    reference = ort("train", GOLDEN / "trained_with_optimizer.ckpt", GOLDEN / "artifacts", tmp_path / "ref.ckpt")
    assert trained["loss"] == reference["loss"]


def test_manager_steps_that_share_unchanged_tensors_load_in_onnx_runtime_exactly(ort, tmp_path):
    """share_unchanged: steps whose frozen tensors are in the previous step's data file (a hard
    link) and whose changed ones are inline each load in ONNX Runtime on their own, with exact
    values (parameters by SHA-256; momentums through ONNX Runtime's own re-save), also once the
    step that wrote the shared file is deleted."""
    from ortckpt import CheckpointManager

    rng = np.random.default_rng(5)
    frozen = {f"frozen{i}": rng.standard_normal(4096).astype(np.float32) for i in range(6)}

    def state_at(step: int) -> CheckpointState:
        head = {
            "head.weight": rng.standard_normal((32, 8)).astype(np.float32),
            "head.bias": np.full(8, step, np.float32),
        }
        state = CheckpointState.from_arrays(head, frozen, {"run": "shared"})
        state.optimizer_groups["group0"] = OptimizerGroup(
            step=step,
            initial_learning_rate=1e-3,
            momentums={n: {"momentum0": a * 0.5, "momentum1": a * a} for n, a in head.items()},
        )
        return state

    states = {}
    with CheckpointManager(tmp_path / "run", max_to_keep=3) as manager:
        for step in range(1, 6):
            states[step] = state_at(step)
            manager.save(states[step], step)
        assert manager.all_steps() == [3, 4, 5]
        infos = manager.all()
    data = [os.stat(info.directory / "checkpoint.data") for info in infos]
    assert len({d.st_ino for d in data}) == 1 and data[0].st_nlink == 3  # step 2 wrote it and is gone
    for info in infos:
        state = states[info.step]
        seen = ort("describe", info.path)
        assert seen["parameters"] == expected_view(state)["parameters"]
        assert seen["properties"]["step"] == info.step
        again = tmp_path / f"resaved{info.step}.ckpt"
        ort("resave", info.path, again)
        resaved = CheckpointState.load_checkpoint(again)
        assert expected_view(resaved)["parameters"] == expected_view(state)["parameters"]
        group, expected = resaved.optimizer_groups["group0"], state.optimizer_groups["group0"]
        assert group.step == info.step
        for param, moms in expected.momentums.items():
            for m, value in moms.items():
                assert sha256(group.momentums[param][m]) == sha256(value), (info.step, param, m)


def test_steps_of_a_resumed_run_sharing_its_file_unread_load_in_onnx_runtime_exactly(ort, tmp_path):
    """Issue 41: a run resumed from its latest step (its frozen part mapped from that step's data
    file and never written: shared without being compared), one frozen value then changed in place
    through the restored view. Every kept step loads in ONNX Runtime on its own with exact values,
    once the steps that wrote and first shared the file are deleted."""
    from ortckpt import CheckpointManager

    rng = np.random.default_rng(6)
    frozen = {f"frozen{i}": rng.standard_normal(4096).astype(np.float32) for i in range(6)}
    head = {"head.weight": rng.standard_normal((32, 8)).astype(np.float32), "head.bias": np.zeros(8, np.float32)}
    state = CheckpointState.from_arrays(head, frozen, {"run": "resumed"})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=0, initial_learning_rate=1e-3, momentums={n: {"momentum0": a * 0.5} for n, a in head.items()}
    )
    expected = {}
    with CheckpointManager(tmp_path / "run", max_to_keep=3) as manager:
        for step in range(1, 8):
            if step == 4:
                state = manager.restore(3)  # resumed: the frozen part is step 3's data file, mapped
            if step == 6:
                state.parameters["frozen2"].data[1000] = 42.0  # in place, through the restored view
            state.parameters["head.bias"].data[...] = step
            state.optimizer_groups["group0"].momentums["head.bias"]["momentum0"][...] = step / 2
            manager.save(state, step)
            expected[step] = {n: sha256(p.data) for n, p in state.parameters}
        assert manager.all_steps() == [5, 6, 7]
        infos = manager.all()
    data = [os.stat(info.directory / "checkpoint.data") for info in infos]
    assert len({d.st_ino for d in data}) == 1 and data[0].st_nlink == 3  # step 2 wrote it and is gone
    for info in infos:
        seen = ort("describe", info.path)
        assert {p["name"]: p["sha256"] for p in seen["parameters"]} == expected[info.step]
        assert seen["properties"]["step"] == info.step
        again = tmp_path / f"resaved{info.step}.ckpt"
        ort("resave", info.path, again)
        moment = CheckpointState.load_checkpoint(again).optimizer_groups["group0"].momentums["head.bias"]
        assert moment["momentum0"].tolist() == [info.step / 2] * 8
    assert expected[6]["frozen2"] != expected[5]["frozen2"] == sha256(frozen["frozen2"])


def test_onnx_runtimes_saver_pointed_at_a_step_changes_no_step_silently(ort, tmp_path):
    """ONNX Runtime's own saver pointed at a step's checkpoint rewrites it and its checkpoint.data
    in place, the very file earlier steps share by hard link (share_unchanged). A step's files are
    read-only, so for their owner that save fails; root ignores modes, and then restore refuses
    every step that shares the file (naming it) rather than restoring ONNX Runtime's bytes as them."""
    from ortckpt import CheckpointIntegrityError, CheckpointManager

    def state_at(step: int) -> CheckpointState:
        frozen = {"frozen": np.arange(100_000, dtype=np.float32)}
        return CheckpointState.from_arrays({"w": np.full(1000, step, np.float32)}, frozen)

    with CheckpointManager(tmp_path / "run", external_data_threshold=0) as manager:
        for step in (1, 2):
            manager.save(state_at(step), step)
        first, second = (info.directory for info in manager.all())
    assert (first / "checkpoint.data").stat().st_ino == (second / "checkpoint.data").stat().st_ino
    other = tmp_path / "other"
    ones = CheckpointState.from_arrays({"w": np.zeros(1000, np.float32)}, {"frozen": np.ones(100_000, np.float32)})
    CheckpointState.save_checkpoint(ones, other, external_data_threshold=0)
    if os.geteuid() != 0:
        with pytest.raises(AssertionError, match="ONNX Runtime failed"):
            ort("resave", other, second / "checkpoint", 1)
        return
    ort("resave", other, second / "checkpoint", 1)
    reader = CheckpointManager(tmp_path / "run", read_only=True)
    for step, directory in ((1, first), (2, second)):
        with pytest.raises(CheckpointIntegrityError) as caught:
            reader.restore(step)
        assert str(directory / "checkpoint.data") in str(caught.value)
