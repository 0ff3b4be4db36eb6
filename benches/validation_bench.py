"""What validate=Forward(...) adds to a CheckpointManager save: saves of an MLP's weights with no
validation (the baseline), with a forward pass in this process, and in a fresh process, in shuffled
rounds (measure.py). The eval model is built here with onnx.helper: LAYERS MatMul+Relu layers
whose weights are initializers named like the checkpoint's parameters.

    python benches/validation_bench.py [--width 2048] [--layers 8] [--rounds 5] [--out benches/out/validation.md]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path

import numpy as np
import onnx
from measure import added_table, report, time_rounds
from onnx import TensorProto, helper, numpy_helper
from ortckpt import CheckpointManager, CheckpointState, Forward


def mlp(width: int, layers: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(width))  # activations stay of the same size layer after layer
    weights = {f"w{i}": rng.standard_normal((width, width), dtype=np.float32) * scale for i in range(layers)}
    nodes, previous = [], "x"
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"]))
        previous = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(np.zeros((1, 1), np.float32), name) for name in weights],  # filled from the checkpoint
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, weights = mlp(args.width, args.layers)
        onnx.save(model, root / "eval_model.onnx")
        state = CheckpointState.from_arrays(weights)
        nbytes = sum(w.nbytes for w in weights.values())
        managers = {
            "save, no validation (baseline)": CheckpointManager(root / "plain", max_to_keep=1),
            "save + Forward (this process)": CheckpointManager(
                root / "forward", max_to_keep=1, validate=Forward(root / "eval_model.onnx")
            ),
            "save + Forward(process=True)": CheckpointManager(
                root / "process", max_to_keep=1, validate=Forward(root / "eval_model.onnx", process=True)
            ),
        }
        steps = dict.fromkeys(managers, 0)

        def save(name: str) -> None:
            steps[name] += 1
            managers[name].save(state, steps[name])

        times = time_rounds({n: functools.partial(save, n) for n in managers}, args.rounds, "validation")
        for manager in managers.values():
            manager.close()
    lines = [
        f"{args.layers} layers of {args.width}x{args.width} float32 ({nbytes / 2**20:.0f} MiB), durable saves with "
        f"SHA-256, {args.rounds} shuffled rounds; `python benches/validation_bench.py --width {args.width} "
        f"--layers {args.layers} --rounds {args.rounds}`",
        "",
    ]
    lines += added_table(times, "save, no validation (baseline)")
    report(lines, args.out)


if __name__ == "__main__":
    main()
