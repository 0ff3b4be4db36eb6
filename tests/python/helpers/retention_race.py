"""A reader restoring as fast as it can while a writer's retention deletes the steps it finds: the race
every step store must win (a directory, an s3:// prefix)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import ortckpt
from ortckpt import CheckpointManager, CheckpointState

WRITER_WITH_RETENTION = textwrap.dedent(
    """
    import sys
    import numpy as np
    from ortckpt import CheckpointManager, CheckpointState
    options = {"endpoint_url": sys.argv[3], "access_key_id": sys.argv[4], "secret_access_key": sys.argv[5]} \\
        if len(sys.argv) > 3 else None
    with CheckpointManager(sys.argv[1], max_to_keep=1, durable=False, storage_options=options) as manager:
        for step in range(1, int(sys.argv[2]) + 1):
            manager.save(CheckpointState.from_arrays({"w": np.full(64, step, np.float32)}), step)
    print("done", flush=True)
    """
)


def restore_while_retention_deletes(where: str, steps: int, **options: object) -> tuple[int, list[str]]:
    """A writer saves ``steps`` steps keeping one; a reader restores as fast as it can meanwhile:
    (restores, the failures it saw)."""
    extra = []
    if options:
        extra = [options["endpoint_url"], options["access_key_id"], options["secret_access_key"]]
    with CheckpointManager(where, max_to_keep=1, storage_options=options or None) as first:
        first.save(CheckpointState.from_arrays({"w": np.zeros(64, np.float32)}), 0)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER_WITH_RETENTION, where, str(steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader = CheckpointManager(where, read_only=True, storage_options=options or None)
    restores, failures = 0, []
    while writer.poll() is None:
        try:
            state = reader.restore()
            w = state.parameters["w"].data
            assert np.all(w == w[0])
            restores += 1
        except (OSError, ortckpt.CheckpointError) as e:
            failures.append(f"{type(e).__name__}: {e}")
    out, err = writer.communicate()
    assert writer.returncode == 0 and out.strip() == "done", err[-2000:]
    return restores, failures
