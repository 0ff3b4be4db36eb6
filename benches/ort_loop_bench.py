"""ortckpt inside ONNX Runtime's training loop (issue 31): saving the live state of a Module and
Optimizer (AdamW), against ONNX Runtime's own ``save_checkpoint`` in the same run. Runs in ONNX
Runtime's interpreter with ortckpt installed (``make ort-loop-venv`` builds it)::

    target/ort-loop-venv/bin/python benches/ort_loop_bench.py [--rounds 5] [--layers 4] [--features 4096]
        [--dir /path/on/the/disk] [--out benches/out/ort_loop.md]

The model: --layers MatMuls of --features x --features float32 (4 x 4096 x 4096: 256 MiB of parameters,
768 MiB with AdamW's two moments), MSE loss, from ``generate_artifacts``; one training step taken,
so every moment is set. Each round runs every contender once, shuffled, ``os.sync()`` around
each run (``measure.time_rounds``); ratios are ``measure.paired_ratio`` (ONNX Runtime's time / this,
per round: above 1, faster):

  - a full save (parameters and optimizer state) to --dir: ONNX Runtime's
    ``CheckpointState.save_checkpoint(state, path, True)`` (it builds the file in memory, then
    writes it in place) against ortckpt's (ONNX Runtime saves into a memfd, ortckpt's writer
    writes the file atomically); neither fsyncs;
  - ONNX Runtime's serialisation into a memfd, and alone (its save to /dev/null: building the file
    in memory, the floor of any full save through its public API), for the record;
  - a params-only save: ONNX Runtime's against ortckpt's (from the live views, no copy);
  - an async ``CheckpointManager.save(state, step)``: the time the trainer is blocked (the save
    then completes in the background, waited for outside the timing), against ONNX Runtime's full save.

The memory each save takes: ``benches/ort_loop_memory.py`` (sampled from another process: ONNX
Runtime's saver holds the GIL, and a memfd's pages are not in VmHWM).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import paired_ratio, report, time_rounds  # noqa: E402

MiB = 2**20


def artifacts_for(directory: Path, layers: int, features: int) -> None:
    """generate_artifacts for x[2, F] -> ``layers`` MatMuls of F x F -> y, MSE loss, AdamW."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    onnxruntime.set_default_logger_severity(3)  # (generate_artifacts logs every graph pass at INFO)

    # onnxruntime.training's __init__ imports torch; its artifacts module does not need it.
    package = types.ModuleType("onnxruntime.training")
    package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    sys.modules.setdefault("onnxruntime.training", package)
    from onnxruntime.training import artifacts

    rng = np.random.default_rng(5)
    weights = [
        numpy_helper.from_array((rng.standard_normal((features, features)) / features).astype(np.float32), f"w{i}")
        for i in range(layers)
    ]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"]) for i in range(layers)]
    nodes.append(helper.make_node("Identity", [f"h{layers}"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, features])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    artifacts.generate_artifacts(
        model,
        requires_grad=[w.name for w in weights],
        loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(directory),
    )
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        # A current onnx stamps IR 11+; ONNX Runtime 1.19.2 reads up to 10, which is all these need.
        path = directory / name
        generated = onnx.load(str(path))
        generated.ir_version = min(generated.ir_version, 10)
        onnx.save(generated, str(path))


def trained_state(work: Path, layers: int, features: int) -> tuple[object, object, object]:
    """(ortckpt's state, Module, Optimizer) on fresh artifacts in ``work``, one training step
    taken (so every moment is set); the state is then the one ONNX Runtime trains."""
    import ortckpt

    art = work / "artifacts"
    art.mkdir()
    artifacts_for(art, layers, features)  # (first: it imports onnxruntime.training without torch)
    from onnxruntime.training.api import Module, Optimizer

    state = ortckpt.CheckpointState.load_checkpoint(art / "checkpoint")
    model = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = Optimizer(str(art / "optimizer_model.onnx"), model)
    rng = np.random.default_rng(0)
    model(*(rng.standard_normal((2, features)).astype(np.float32) for _ in range(2)))
    optimizer.step()
    model.lazy_reset_grad()
    return state, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="where the saves go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import ortckpt
    from onnxruntime.capi import _pybind_state as C

    work = Path(tempfile.mkdtemp(prefix="ortckpt-ort-loop-", dir=args.dir))
    try:
        state, _model, _optimizer = trained_state(work, args.layers, args.features)  # (kept alive: they train it)
        inner = state._state  # ONNX Runtime's own state: the one its Module trains
        params = sum(p.data.nbytes for _, p in state.parameters)
        total = 3 * params  # (AdamW: two moments per parameter)

        out = work / "saves"
        out.mkdir()
        manager = ortckpt.CheckpointManager(work / "run", async_save=True, max_to_keep=1, durable=False)
        steps = iter(range(1, 10**6))

        def memfd_save() -> None:
            fd = os.memfd_create("ort")
            try:
                C.save_checkpoint(inner, f"/proc/self/fd/{fd}", True)
            finally:
                os.close(fd)

        def manager_async() -> float:
            start = time.perf_counter()
            manager.save(state, next(steps))
            blocked = time.perf_counter() - start
            manager.wait()
            return blocked

        ort_full = "ONNX Runtime save_checkpoint(state, path, True)"
        ort_params = "ONNX Runtime save_checkpoint(state, path) (params only)"
        contenders = {
            ort_full: lambda: C.save_checkpoint(inner, str(out / "ort.ckpt"), True),
            "ortckpt save_checkpoint(state, path, include_optimizer_state=True)": lambda: (
                ortckpt.CheckpointState.save_checkpoint(state, out / "ortckpt.ckpt", include_optimizer_state=True)
            ),
            "ONNX Runtime save into a memfd (its serialisation)": memfd_save,
            "ONNX Runtime save to /dev/null (building the file alone: the floor)": lambda: C.save_checkpoint(
                inner, os.devnull, True
            ),
            ort_params: lambda: C.save_checkpoint(inner, str(out / "ort_params.ckpt"), False),
            "ortckpt save_checkpoint(state, path) (params only)": lambda: ortckpt.CheckpointState.save_checkpoint(
                state, out / "ortckpt_params.ckpt"
            ),
            "CheckpointManager(async_save=True).save(state, step): time blocked": manager_async,
        }
        times = time_rounds(contenders, args.rounds, "ort_loop")
        manager.close()

        lines = [
            f"# ortckpt in ONNX Runtime's training loop ({datetime.date.today()}, {platform.node()})",
            "",
            f"{args.layers} x MatMul {args.features}x{args.features} float32, AdamW: {params / MiB:.0f} MiB of "
            f"parameters, {total / MiB:.0f} MiB with the moments; onnxruntime-training "
            f"{__import__('onnxruntime').__version__}, {args.rounds} rounds, saves to {work}.",
            "",
            "| contender | median s | range s | vs ONNX Runtime (its time / this, paired) |",
            "|---|---:|---:|---:|",
        ]
        for name, ts in times.items():
            base = times[ort_params] if "params only" in name else times[ort_full]
            lines.append(
                f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {paired_ratio(ts, base):.2f} |"
            )
        blocked = [t / b for t, b in zip(times[list(contenders)[-1]], times[ort_full], strict=True)]
        lines += [
            "",
            f"Async manager save: the trainer is blocked {statistics.median(blocked):.2f}x ONNX Runtime's full "
            "save time (median of per-round ratios).",
        ]
        report(lines, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
