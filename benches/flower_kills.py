"""Random SIGKILLs of a Flower server on the deployment engine, each run resumed to its end and
compared bit for bit with an uninterrupted in-process run (the engine test's federation, apps
and kill: tests/flower/test_deployment.py).

One SuperLink and two SuperNodes on 127.0.0.1 serve every kill. Each kill: a 3-round
``flwr run`` of ortckpt's FedAvg committing to a fresh directory, a SIGKILL at a random moment
(seeded: after 0, 1 or 2 commits, then 0 to 2 s), of the ServerApp or, every
``--superlink-every``-th kill, of the whole SuperLink (its SuperExec and ServerApp with it; a new
SuperLink and SuperNodes are started), then ``flwr run`` again to the end; the last commit must
equal the reference bit for bit. Runs in flwr's venv (`make .venv-flower/.ok`):

    PYTHONPATH=python:tests/flower .venv-flower/bin/python benches/flower_kills.py --kills 10 --seed 1
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from conftest import FakeGrid
from federation import Federation
from flwr.app import Array, ArrayRecord
from ortckpt import CheckpointManager
from ortckpt.flower import FedAvg
from test_deployment import CLIENT_APP, COMMON, SERVER_APP, kill_serverapp_at, random_kill


def reference(app: Path) -> dict[str, bytes]:
    """The uninterrupted run's global model, in-process (the same clients)."""
    sys.path.insert(0, str(app))
    try:
        import common
    finally:
        sys.path.remove(str(app))
    nodes = {101: 0, 202: 1}
    grid = FakeGrid(nodes, lambda node, r, arrays: common.train(nodes[node], r, arrays))
    result = FedAvg(fraction_evaluate=0.0).start(
        grid, ArrayRecord({k: Array(v) for k, v in common.initial().items()}), num_rounds=3
    )
    return {key: array.numpy().tobytes() for key, array in result.arrays.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=None, help="the first kill's seed (the next: +1, ...)")
    parser.add_argument("--superlink-every", type=int, default=3, help="every n-th kill is the SuperLink's (0: never)")
    args = parser.parse_args()
    first_seed = random.randrange(1 << 32) if args.seed is None else args.seed
    tmp = Path(tempfile.mkdtemp(prefix="ortckpt-flower-kills-"))
    checkpoints = tmp / "server-checkpoints"
    files = {"common.py": COMMON, "server_app.py": SERVER_APP, "client_app.py": CLIENT_APP}
    federation = Federation(tmp, files, "num-server-rounds = 3", ORTCKPT_FLOWER_DIR=str(checkpoints))
    identical = 0
    try:
        expected = reference(federation.app)
        for n in range(args.kills):
            seed = first_seed + n
            shutil.rmtree(checkpoints, ignore_errors=True)
            whole = args.superlink_every > 0 and (n + 1) % args.superlink_every == 0
            started = time.monotonic()
            kill_serverapp_at(federation, seed, tmp / "first-run.log", federation.kill_superlink if whole else None)
            committed = CheckpointManager(checkpoints, read_only=True).all_steps()
            if whole:  # (the SuperLink's state was in memory: the SuperNodes join a new one)
                federation.kill_supernodes()
                federation.superlink = federation.start_superlink()
                federation.supernodes = federation.start_supernodes()
            federation.run(3)
            served = CheckpointManager(checkpoints, read_only=True).latest().load()
            same = all(served.parameters[key].data.tobytes() == value for key, value in expected.items())
            identical += same
            commits, delay = random_kill(seed)
            print(
                f"kill {n + 1}: seed {seed}, {'SuperLink' if whole else 'ServerApp'} killed {delay:.2f} s after "
                f"{commits} commits ({committed} committed then), resumed to 3 rounds: "
                f"{'bit-identical' if same else 'DIFFERENT'} ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    finally:
        federation.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    seeds = f"{first_seed}..{first_seed + args.kills - 1}"
    print(f"{identical} of {args.kills} killed runs resumed bit-identical (seeds {seeds})")
    if identical != args.kills:
        sys.exit(1)


if __name__ == "__main__":
    main()
