"""An ONNX Runtime training script as its users write it (Module, Optimizer, LinearLRScheduler on
generate_artifacts output), unchanged but for its CheckpointState import line, which
test_ort_loop.py swaps for ortckpt's. Runs in the ONNX Runtime virtualenv with ortckpt installed.

  python ort_training_script.py ARTIFACTS OUT

Trains 4 steps, sets properties, saves OUT/a.ckpt (with the optimizer state) and OUT/a_params.ckpt
(without), loads OUT/a.ckpt into a new Module and Optimizer, trains 3 more steps and saves OUT/b.ckpt.
Prints one JSON object: the losses, learning rates, and what ``state.parameters`` and
``state.properties`` showed along the way.
"""

import hashlib  # noqa: I001 (the CheckpointState import stays a line of its own: the one swapped)
import json
import os
import sys

import numpy as np
from onnxruntime.training.api import CheckpointState
from onnxruntime.training.api import LinearLRScheduler, Module, Optimizer

artifacts, out = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(7)
report = {"losses": [], "learning_rates": [], "parameters": [], "grads": []}


def session(checkpoint):
    state = CheckpointState.load_checkpoint(checkpoint)
    model = Module(os.path.join(artifacts, "training_model.onnx"), state, os.path.join(artifacts, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), model)
    return state, model, optimizer


def train(state, model, optimizer, scheduler, steps):
    model.train()
    for _ in range(steps):
        x = rng.standard_normal((5, 8)).astype(np.float32)
        target = rng.standard_normal((5, 4)).astype(np.float32)
        report["losses"].append(float(model(x, target)))
        optimizer.step()
        scheduler.step()
        report["learning_rates"].append(optimizer.get_learning_rate())
        # What the state shows while it is trained: the values the Module trains, and gradients.
        report["grads"].append({name: p.grad is not None for name, p in state.parameters})
        model.lazy_reset_grad()
    report["parameters"].append({name: hashlib.sha256(p.data.tobytes()).hexdigest() for name, p in state.parameters})


state, model, optimizer = session(os.path.join(artifacts, "checkpoint"))
scheduler = LinearLRScheduler(optimizer, warmup_step_count=2, total_step_count=10, initial_lr=0.01)
train(state, model, optimizer, scheduler, 4)
state.properties["epoch"] = 4
state.properties["best_accuracy"] = 0.875
state.properties["run"] = "swap"
report["properties"] = dict(state.properties)
report["requires_grad"] = {name: p.requires_grad for name, p in state.parameters}
CheckpointState.save_checkpoint(state, os.path.join(out, "a.ckpt"), include_optimizer_state=True)
CheckpointState.save_checkpoint(state, os.path.join(out, "a_params.ckpt"))

state, model, optimizer = session(os.path.join(out, "a.ckpt"))
report["resumed_learning_rate"] = optimizer.get_learning_rate()
report["resumed_properties"] = dict(state.properties)
optimizer.set_learning_rate(0.005)
scheduler = LinearLRScheduler(optimizer, warmup_step_count=0, total_step_count=6, initial_lr=0.005)
train(state, model, optimizer, scheduler, 3)
model.eval()
x = rng.standard_normal((5, 8)).astype(np.float32)
report["eval_loss"] = float(model(x, rng.standard_normal((5, 4)).astype(np.float32)))
CheckpointState.save_checkpoint(state, os.path.join(out, "b.ckpt"), include_optimizer_state=True)
print(json.dumps(report))
