"""ortckpt inside ONNX Runtime's training loop (issue 31): saving the live state of a Module and
Optimizer (AdamW), against ONNX Runtime's own ``save_checkpoint`` in the same run. Runs in ONNX
Runtime's interpreter with ortckpt installed (``make ort-loop-venv`` builds it)::

    target/ort-loop-venv/bin/python benches/ort_loop_bench.py [--rounds 5] [--layers 4] [--features 4096]
        [--dir /path/on/the/disk] [--out benches/out/ort_loop.md] [--async-only]

The model: --layers MatMuls of --features x --features float32 (4 x 4096 x 4096: 256 MiB of parameters,
768 MiB with AdamW's two moments), MSE loss, from ``generate_artifacts``; two such models in the
process, one on ortckpt's swapped ``CheckpointState``, one on ONNX Runtime's own; one training step
taken on each, so every moment is set. Each round runs every contender once, shuffled, ``os.sync()``
around each run (and, with --dirty-mib, that many MiB written and left unsynced just before it);
ratios are ``measure.paired_ratio`` (ONNX Runtime's time / this, per round: above 1, faster), of
wall time and of the process's CPU time (user + system: what the save cost, on a shared machine):

  - a full save (parameters and optimizer state), to --dir and to --tmpfs: ONNX Runtime's
    ``save_checkpoint(state, path, True)`` (it builds the file in memory, then writes it in place)
    against ortckpt's (a forked child runs ONNX Runtime's saver, its buffer grown in place, into
    the staged temporary files; ortckpt seals and commits them: ``forked_save.save``), and against
    the path before it (ONNX Runtime's saver in this process writes the staged files:
    ``live.save_through_ort``); of ortckpt's state and of ONNX Runtime's own; none fsyncs;
  - ONNX Runtime's serialisation alone (its save to /dev/null: building the file in memory, the
    floor of any full save through its public API), for the record;
  - a params-only save: ONNX Runtime's against ortckpt's (from the live views, no copy);
  - an async ``CheckpointManager.save(state, step)``: the time the trainer is blocked (the save
    then completes in the background, waited for outside the timing), against ONNX Runtime's full
    save; with ``async_save=True`` (ONNX Runtime serialises into memory in the trainer's thread)
    and ``async_save="fork"`` (a forked child serialises: the trainer waits for the fork only).
    Each is also timed to its completion (save() and wait()), for the record.

``--async-only``: only ONNX Runtime's full save to disk and the two async manager saves.

The memory each save takes: ``benches/ort_loop_memory.py`` (sampled from another process: ONNX
Runtime's saver holds the GIL, and a memfd's pages are not in VmHWM).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import paired_ratio, report, shuffled  # noqa: E402

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


def own_state(work: Path, layers: int, features: int) -> tuple[object, object, object]:
    """(ONNX Runtime's own CheckpointState, Module, Optimizer) on the artifacts ``trained_state``
    made in ``work``, one training step taken: a second model in the process."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    art = work / "artifacts"
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    model = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = Optimizer(str(art / "optimizer_model.onnx"), model)
    rng = np.random.default_rng(1)
    model(*(rng.standard_normal((2, features)).astype(np.float32) for _ in range(2)))
    optimizer.step()
    model.lazy_reset_grad()
    return state, model, optimizer


def cpu_seconds() -> float:
    """User and system time of this process so far, every thread's, and of its children
    reaped (a forked save's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime


def timed_rounds(
    contenders: dict[str, Callable[[], float | None]], rounds: int, seed: object, before: Callable[[], None]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``measure.time_rounds`` (shuffled rounds, ``os.sync()`` around each run), with ``before()``
    run untimed after the first sync, and each run's CPU time (user + system) beside its wall
    time: on a shared machine the CPU time is what the save itself cost."""
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in shuffled(contenders, f"{seed} {r}"):
            os.sync()
            before()
            start, start_cpu = time.perf_counter(), cpu_seconds()
            reported = contenders[name]()
            wall[name].append(time.perf_counter() - start if reported is None else reported)
            cpu[name].append(cpu_seconds() - start_cpu)
            os.sync()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="where the saves go (default: a temporary folder)")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="a tmpfs folder for the tmpfs saves")
    parser.add_argument(
        "--dirty-mib", type=int, default=0, help="MiB written to a scratch file (not synced) before each save"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--async-only", action="store_true", help="ONNX Runtime's save and the async saves only")
    args = parser.parse_args()

    import ortckpt
    from onnxruntime.capi import _pybind_state as C
    from ortckpt import live

    work = Path(tempfile.mkdtemp(prefix="ortckpt-ort-loop-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="ortckpt-ort-loop-", dir=args.tmpfs))
    try:
        # Two models in the process, as a run that trains (or evaluates) two: ortckpt's state, and
        # ONNX Runtime's own state object (kept alive: their Modules train them).
        state, *_session = trained_state(work, args.layers, args.features)
        own, *_own_session = own_state(work, args.layers, args.features)
        inner, own_inner = state._state, own._state  # ONNX Runtime's states: what its Modules train
        params = sum(p.data.nbytes for _, p in state.parameters)
        total = 3 * params  # (AdamW: two moments per parameter)

        out = work / "saves"
        out.mkdir()
        manager = ortckpt.CheckpointManager(work / "run", async_save=True, max_to_keep=1, durable=False)
        forking = ortckpt.CheckpointManager(work / "forked", async_save="fork", max_to_keep=1, durable=False)
        steps = iter(range(1, 10**6))
        completion: dict[str, list[float]] = {}
        dirty = np.ones(args.dirty_mib * MiB, np.uint8)

        def other_writes() -> None:
            if args.dirty_mib:
                (work / "other.bin").unlink(missing_ok=True)
                dirty.tofile(work / "other.bin")

        def manager_async(which: ortckpt.CheckpointManager, name: str) -> Callable[[], float]:
            def save() -> float:
                start = time.perf_counter()
                which.save(state, next(steps))
                blocked = time.perf_counter() - start
                which.wait()
                completion.setdefault(name, []).append(time.perf_counter() - start)
                return blocked

            return save

        def ortckpt_full(what: object, path: Path, **options: object) -> Callable[[], None]:
            return lambda: ortckpt.CheckpointState.save_checkpoint(what, path, include_optimizer_state=True, **options)

        def in_process(ort_state: object, path: Path) -> Callable[[], None]:
            # The path before this one: ONNX Runtime's saver in this process writes the staged files.
            def save() -> None:
                assert live.save_through_ort(ort_state, path)

            return save

        ort_disk = "ONNX Runtime save_checkpoint(state, path, True), to disk"
        ort_tmpfs = "ONNX Runtime save_checkpoint(state, path, True), to tmpfs"
        ort_own = "ONNX Runtime save_checkpoint(its own state, path, True), to disk"
        ort_own_tmpfs = "ONNX Runtime save_checkpoint(its own state, path, True), to tmpfs"
        ort_params = "ONNX Runtime save_checkpoint(state, path) (params only)"
        contenders: dict[str, Callable[[], float | None]] = {
            ort_disk: lambda: C.save_checkpoint(inner, str(out / "ort.ckpt"), True),
            "ortckpt save_checkpoint(state, path, include_optimizer_state=True), to disk": ortckpt_full(
                state, out / "ortckpt.ckpt"
            ),
            "the path before (ONNX Runtime's saver in this process), to disk": in_process(inner, out / "before.ckpt"),
            ort_tmpfs: lambda: C.save_checkpoint(inner, str(shm / "ort.ckpt"), True),
            "ortckpt save_checkpoint(state, path, include_optimizer_state=True), to tmpfs": ortckpt_full(
                state, shm / "ortckpt.ckpt"
            ),
            "the path before (ONNX Runtime's saver in this process), to tmpfs": in_process(inner, shm / "before.ckpt"),
            ort_own: lambda: C.save_checkpoint(own_inner, str(out / "ort_own.ckpt"), True),
            "ortckpt save_checkpoint(its own state, path, include_optimizer_state=True), to disk": ortckpt_full(
                own, out / "ortckpt_own.ckpt"
            ),
            ort_own_tmpfs: lambda: C.save_checkpoint(own_inner, str(shm / "ort_own.ckpt"), True),
            "ortckpt save_checkpoint(its own state, path, include_optimizer_state=True), to tmpfs": ortckpt_full(
                own, shm / "ortckpt_own.ckpt"
            ),
            "ONNX Runtime save to /dev/null (building the file alone: the floor)": lambda: C.save_checkpoint(
                inner, os.devnull, True
            ),
            ort_params: lambda: C.save_checkpoint(inner, str(out / "ort_params.ckpt"), False),
            "ortckpt save_checkpoint(state, path) (params only)": lambda: ortckpt.CheckpointState.save_checkpoint(
                state, out / "ortckpt_params.ckpt"
            ),
        }
        blocked_thread = "CheckpointManager(async_save=True).save(state, step): time blocked"
        blocked_fork = 'CheckpointManager(async_save="fork").save(state, step): time blocked'
        contenders[blocked_thread] = manager_async(manager, blocked_thread)
        contenders[blocked_fork] = manager_async(forking, blocked_fork)
        if args.async_only:
            contenders = {name: contenders[name] for name in (ort_disk, blocked_thread, blocked_fork)}
        wall, cpu = timed_rounds(contenders, args.rounds, "ort_loop", other_writes)
        manager.close()
        forking.close()

        def baseline(name: str) -> str:
            if "params only" in name:
                return ort_params
            if "its own state" in name:
                return ort_own_tmpfs if "tmpfs" in name else ort_own
            return ort_tmpfs if "tmpfs" in name else ort_disk

        lines = [
            f"# ortckpt in ONNX Runtime's training loop ({datetime.date.today()}, {platform.node()})",
            "",
            f"{args.layers} x MatMul {args.features}x{args.features} float32, AdamW: {params / MiB:.0f} MiB of "
            f"parameters, {total / MiB:.0f} MiB with the moments, two such models in the process (ortckpt's "
            f"state and ONNX Runtime's own); onnxruntime-training {__import__('onnxruntime').__version__}, "
            f"{args.rounds} rounds, saves to {work} and {shm}"
            + (f", {args.dirty_mib} MiB written (not synced) before each save" if args.dirty_mib else "")
            + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end.",
            "",
            "| contender | median s | range s | vs ONNX Runtime (its time / this, paired) | CPU s (median) "
            "| vs ONNX Runtime, CPU time |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, ts in wall.items():
            base = baseline(name)
            lines.append(
                f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | "
                f"{paired_ratio(ts, wall[base]):.2f} | {statistics.median(cpu[name]):.2f} | "
                f"{paired_ratio(cpu[name], cpu[base]):.2f} |"
            )
        lines.append("")
        for name in (blocked_thread, blocked_fork):
            blocked = [t / b for t, b in zip(wall[name], wall[ort_disk], strict=True)]
            done = completion[name]
            lines.append(
                f"{name.split('.save')[0]}: the trainer is blocked {statistics.median(blocked):.3f}x ONNX Runtime's "
                f"full save time (median of per-round ratios; range {min(blocked):.3f}-{max(blocked):.3f}); the save "
                f"completes in {statistics.median(done):.3f} s (median; {min(done):.3f}-{max(done):.3f})."
            )
        report(lines, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
