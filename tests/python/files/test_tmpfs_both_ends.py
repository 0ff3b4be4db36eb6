"""Attacks on saves into tmpfs, which fill their files from both ends (a helper thread storing
through a shared mapping of the file, see src/io/both_ends.rs): what a plain writer survives,
such a save must survive too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointState


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_a_save_into_tmpfs_fits_in_the_address_space_a_save_on_disk_fits_in(external, tmp_path):
    """Under RLIMIT_AS (ulimit -v), mapping the whole temporary file is refused where plain
    writes are not: a 64 MiB save into a private directory on tmpfs must then still be written
    (and read back whole), in the headroom the same save on disk needed, plus a little."""
    shm = Path(tempfile.mkdtemp(prefix="ortckpt-as-", dir="/dev/shm"))  # mode 0700: the helper's case
    script = textwrap.dedent(f"""
        import resource
        import numpy as np
        from ortckpt import CheckpointState

        threshold = {0 if external else 1 << 40}
        arrays = {{f"w{{i}}": np.full(1 << 20, i, np.float32) for i in range(16)}}  # 64 MiB
        state = CheckpointState.from_arrays(arrays)
        on_disk, on_tmpfs = {str(tmp_path / "ckpt")!r}, {str(shm / "ckpt")!r}
        for target in (on_disk, on_tmpfs):  # once without a limit: pools and threads made
            CheckpointState.save_checkpoint(state, target, external_data_threshold=threshold)
        status = open("/proc/self/status").read()
        size = int(next(line for line in status.splitlines() if line.startswith("VmSize")).split()[1]) << 10

        def save_within(headroom, target):
            resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))
            try:
                CheckpointState.save_checkpoint(state, target, external_data_threshold=threshold)
                return True
            except MemoryError:
                return False
            except OSError as e:
                assert e.errno == 12, e
                return False
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

        headroom = next(h << 20 for h in range(0, 1024, 8) if save_within(h << 20, on_disk))
        assert save_within(headroom + (16 << 20), on_tmpfs), f"needed more than {{headroom >> 20}} + 16 MiB"
        loaded = CheckpointState.load_checkpoint(on_tmpfs)
        for name, array in arrays.items():
            assert np.array_equal(loaded.parameters[name].data, array), name
        print("headroom", headroom >> 20)
    """)
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, (run.stdout, run.stderr)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
@pytest.mark.parametrize("place", ["/dev/shm", tempfile.gettempdir()], ids=["tmpfs", "tempdir"])
def test_a_save_with_no_thread_to_be_had_is_written_by_the_calling_thread(place, external):
    """Under RLIMIT_NPROC (or a cgroup's pids.max) no thread can be started: the save's
    writers (the both-ends helper on tmpfs, the parallel writers of external data) must leave
    their work to the calling thread, not panic (an InternalError) where one thread would do."""
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-nproc-", dir=place))
    if os.geteuid() == 0:  # RLIMIT_NPROC binds no root: the child drops to nobody
        os.chown(directory, 65534, 65534)
    script = textwrap.dedent(f"""
        import os, resource
        import numpy as np
        from ortckpt import CheckpointState

        directory = {str(directory)!r}
        # A first save while root: what a save imports lazily is loaded where root can read it.
        warm = CheckpointState.from_arrays({{"w": np.ones(4, np.float32)}})
        CheckpointState.save_checkpoint(warm, directory + "/warm")
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        state = CheckpointState.from_arrays({{f"w{{i}}": np.full(1 << 20, i, np.float32) for i in range(8)}})  # 32 MiB
        resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
        threshold = {0 if external else 1 << 40}
        CheckpointState.save_checkpoint(state, directory + "/ckpt", external_data_threshold=threshold)
    """)
    try:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        loaded = CheckpointState.load_checkpoint(directory / "ckpt")
        for i in range(8):
            assert np.array_equal(loaded.parameters[f"w{i}"].data, np.full(1 << 20, i, np.float32)), i
        names = {"ckpt", "warm", ".ckpt.ortckpt-lock", ".warm.ortckpt-lock"} | ({"ckpt.data"} if external else set())
        assert {p.name for p in directory.iterdir()} <= names  # no temporaries
    finally:
        shutil.rmtree(directory, ignore_errors=True)
