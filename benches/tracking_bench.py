"""What track="mlflow" adds to a CheckpointManager save: durable saves of a model's weights with
no tracker (the baseline), reported to a real MLflow server (metrics, tags, metadata.json), and
with log_artifacts=True (the checkpoint uploaded too), in shuffled rounds (measure.py). The
server is the tests' (tests/python/helpers/mlflow_server.py: SQLite backend, local artifact store, on
127.0.0.1), started here; ORTCKPT_MLFLOW names its executable (make sets it).

    python benches/tracking_bench.py [--mib 64] [--rounds 5] [--out benches/out/tracking.md]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import numpy as np
from measure import added_table, report, time_rounds
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.manager.tracking import MlflowTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python" / "helpers"))
from mlflow_server import MlflowServer  # the tests' server helper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layers = 8
    width = int((args.mib * 2**20 / 4 / layers) ** 0.5)
    state = CheckpointState.from_arrays(
        {f"w{i}": rng.standard_normal((width, width), dtype=np.float32) for i in range(layers)}
    )
    nbytes = sum(p.data.nbytes for _, p in state.parameters)
    server = MlflowServer()
    try:
        uri = server.wait_until_up()
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            managers = {
                "save, no tracker (baseline)": CheckpointManager(root / "plain", max_to_keep=1),
                'save + track="mlflow"': CheckpointManager(
                    root / "tracked", max_to_keep=1, track=MlflowTracker(uri, experiment="bench")
                ),
                "save + mlflow, log_artifacts=True": CheckpointManager(
                    root / "artifacts", max_to_keep=1, track=MlflowTracker(uri, experiment="bench", log_artifacts=True)
                ),
            }
            steps = dict.fromkeys(managers, 0)

            def save(name: str) -> None:
                steps[name] += 1
                managers[name].save(state, steps[name], metrics={"loss": 1.0 / steps[name]})

            times = time_rounds({n: functools.partial(save, n) for n in managers}, args.rounds, "tracking")
            for manager in managers.values():
                manager.close()
    finally:
        server.stop()
    lines = [
        f"{layers} float32 tensors, {nbytes / 2**20:.0f} MiB, durable saves with SHA-256, a local MLflow server "
        f"(SQLite, artifacts on this disk), {args.rounds} shuffled rounds; "
        f"`python benches/tracking_bench.py --mib {args.mib} --rounds {args.rounds}`",
        "",
    ]
    lines += added_table(times, "save, no tracker (baseline)")
    report(lines, args.out)


if __name__ == "__main__":
    main()
