"""from_torch / to_torch against the real torch (run by `make test-torch`): exact round trips
of weights and Adam/AdamW/SGD state, dtypes NumPy lacks, and a converted checkpoint that
ONNX Runtime loads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ortckpt import CheckpointState
from ortckpt.convert import convert
from ortckpt.convert.torch_state import from_torch, to_torch


def model_and_optimizer(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    model[3].bias.requires_grad_(False)  # a frozen parameter
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = {
        "adamw": lambda: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    }[kind]()
    return model, optimizer


def train(model, optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_a_round_trip_through_a_checkpoint_file_is_exact_and_training_continues_identically(kind, tmp_path):
    model, optimizer = model_and_optimizer(kind)
    train(model, optimizer, 3)
    state = from_torch(model, optimizer)
    assert not state.parameters["3.bias"].requires_grad
    assert not state.parameters["1.running_mean"].requires_grad  # buffers are frozen
    assert state.parameters["0.weight"].requires_grad
    group = state.optimizer_groups["group0"]
    assert group.step == (3 if kind != "sgd" else 0)
    assert np.float32(group.initial_learning_rate) == np.float32(optimizer.param_groups[0]["lr"])
    assert set(group.momentums["0.weight"]) == ({"momentum0"} if kind == "sgd" else {"momentum0", "momentum1"})
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)

    fresh_model, fresh_optimizer = model_and_optimizer(kind, seed=99)
    state_dict, optimizer_state = to_torch(
        CheckpointState.load_checkpoint(tmp_path / "ckpt"), fresh_model, fresh_optimizer
    )
    fresh_model.load_state_dict(state_dict)
    fresh_optimizer.load_state_dict(optimizer_state)
    for (name, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(optimizer.param_groups[0]["params"], fresh_optimizer.param_groups[0]["params"], strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(fresh_optimizer.state[q][key])), key
    train(model, optimizer, 2, seed=5)
    train(fresh_model, fresh_optimizer, 2, seed=5)
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_bfloat16_and_float8_keep_their_bits_and_cpu_tensors_are_shared():
    torch.manual_seed(0)
    sd = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "e4m3": torch.randn(16).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(16).to(torch.float8_e5m2),
        "f32": torch.randn(3),
    }
    state = from_torch(sd, frozen=["f32"])
    assert state.parameters["bf16"].data_type == "BFLOAT16"
    assert state.parameters["e4m3"].data_type == "FLOAT8E4M3FN"
    assert not state.parameters["f32"].requires_grad
    sd["f32"][0] = 42.0  # shared memory, no copy on the way in
    assert state.parameters["f32"].data[0] == 42.0
    back, _ = to_torch(state)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name


def test_an_optimizer_without_the_module_is_refused():
    model, optimizer = model_and_optimizer("adamw")
    with pytest.raises(ValueError, match="needs the module"):
        from_torch(model.state_dict(), optimizer)


def test_amsgrad_state_is_refused_by_name():
    model, _ = model_and_optimizer("adamw")
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True)
    train(model, optimizer, 1)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        from_torch(model, optimizer)


def test_torch_files_convert_to_checkpoints_and_back(tmp_path):
    model, _ = model_and_optimizer("adamw")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "ckpt", frozen=["1.running_var"])
    state = CheckpointState.load_checkpoint(tmp_path / "ckpt")
    assert not state.parameters["1.running_var"].requires_grad
    convert(tmp_path / "ckpt", tmp_path / "again.pth")
    again = torch.load(tmp_path / "again.pth", weights_only=True)
    for name, t in model.state_dict().items():
        assert torch.equal(again[name], t), name


def test_a_converted_torch_model_loads_in_onnx_runtime(tmp_path):
    python = os.environ.get("ORTCKPT_ORT_PYTHON")
    assert python and Path(python).exists(), "set ORTCKPT_ORT_PYTHON (make test-torch does)"
    model, optimizer = model_and_optimizer("adamw")
    train(model, optimizer, 2)
    CheckpointState.save_checkpoint(from_torch(model, optimizer), tmp_path / "ckpt", include_optimizer_state=True)
    helper = Path(__file__).resolve().parents[1] / "interop" / "ort_helper.py"
    done = subprocess.run(
        [python, str(helper), "describe", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seen = {p["name"]: p for p in json.loads(done.stdout.strip().splitlines()[-1])["parameters"]}
    assert set(seen) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert seen[name]["sha256"] == hashlib.sha256(t.numpy().tobytes()).hexdigest(), name
        assert seen[name]["requires_grad"] == (name in {n for n, p in model.named_parameters() if p.requires_grad})


def test_the_readme_torch_example_runs(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "helpers"))
    from readme_blocks import block

    example = block("torch")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(example, "README torch example", "exec"), namespace)
    state = CheckpointState.load_checkpoint(tmp_path / "torch.ckpt")
    assert state.optimizer_groups["group0"].step == 1
    assert torch.equal(namespace["model"].weight, torch.from_numpy(np.array(state.parameters["weight"].data)))
