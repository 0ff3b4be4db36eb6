"""Saves stopped from outside: SIGKILL at random moments, a full disk. The target
path must always load as the complete old checkpoint or the complete new one;
leftover temporary files must not matter to readers and must go at the next save."""

from __future__ import annotations

import errno
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointState
from privileges import needs_root, small_tmpfs

TRIALS = 200


def _arrays(seed: int) -> dict[str, np.ndarray]:
    """Different names, shapes and values per seed, so a mix of two saves would show."""
    rng = np.random.default_rng(seed)
    arrays = {f"s{seed}.big{i}": rng.standard_normal(256 * 1024 + seed).astype(np.float32) for i in range(3)}
    arrays.update({f"s{seed}.small{i}": rng.standard_normal(17).astype(np.float32) for i in range(64)})
    return arrays


def _matches(state: CheckpointState, arrays: dict[str, np.ndarray]) -> bool:
    names = state.parameters.names()
    if sorted(names) != sorted(arrays):
        return False
    return all(np.array_equal(state.parameters[n].data, arrays[n]) for n in names)


def _temps(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".ortckpt-tmp." in p.name]


def _save_forever(states: list[CheckpointState], target: Path, threshold: int, done: int) -> None:
    """In a forked child: save the states in turn until killed, writing a byte to the pipe
    ``done`` after each save that returned."""
    try:
        while True:
            for state in states:
                CheckpointState.save_checkpoint(state, target, external_data_threshold=threshold)
                os.write(done, b"s")
    finally:
        os._exit(1)


def _read_saves(pipe: int, wanted: int) -> int:
    """Blocks until the child has reported ``wanted`` saves (a minute at most); returns them."""
    got = 0
    deadline = time.monotonic() + 60
    while got < wanted:
        ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"the saving child reported {got} of {wanted} saves in a minute")
        got += len(os.read(pipe, wanted - got))
    return got


# CPython 3.12+ warns that fork() in a multi-threaded process may deadlock the child. Here the child
# only saves (the Rust core starts its own threads; glibc's malloc and CPython's GIL are reset at
# fork) and is SIGKILLed, and fork is what makes 200 kills at random moments affordable.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_sigkill_at_random_moments_leaves_the_old_or_the_new_checkpoint(external, tmp_path):
    """Each trial kills a child that saves the new and the old state in turn, after it has
    reported 0, 1 or 2 saves and a random pause. The target must then hold what the saves that
    returned left, or what the save after them left (it may have renamed its file and been
    killed before reporting), never anything else. The kills land before, inside and between
    saves however fast the machine is: the count of saves, not the clock, says what to expect."""
    olds, news = _arrays(1), _arrays(2)
    states = [CheckpointState.from_arrays(news), CheckpointState.from_arrays(olds)]
    threshold = 0 if external else 1 << 40
    target = tmp_path / "ckpt"
    CheckpointState.save_checkpoint(states[1], target, external_data_threshold=threshold)
    rng = random.Random(20261122)
    seen = {"old": 0, "new": 0}
    killed_mid_save = 0
    before = "old"
    for _ in range(TRIALS):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _save_forever(states, target, threshold, write_end)
        os.close(write_end)
        saves = _read_saves(read_end, rng.choice([0, 1, 2]))
        time.sleep(rng.uniform(0, 0.012))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while chunk := os.read(read_end, 64):  # what it reported before it died
            saves += len(chunk)
        os.close(read_end)
        killed_mid_save += bool(_temps(tmp_path))

        def after(n: int, start: str = before) -> str:  # the child saves new, old, new, ...
            return start if n == 0 else ("new" if n % 2 else "old")

        loaded = CheckpointState.load_checkpoint(target)  # leftovers or not, the target loads
        found = "old" if _matches(loaded, olds) else "new" if _matches(loaded, news) else None
        assert found in (after(saves), after(saves + 1)), f"{saves} saves reported from {before}: found {found}"
        seen[found] += 1
        before = found
    print(f"{TRIALS} kills: {seen}, {killed_mid_save} left temporary files")
    assert seen["old"] > 0 and seen["new"] > 0, seen
    assert killed_mid_save > 0  # some kills landed inside a save
    # Dead saves' temporaries go at the next save, and a lock file a killed save held with them.
    CheckpointState.save_checkpoint(states[0], target, external_data_threshold=threshold)
    assert _temps(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == (["ckpt", "ckpt.data"] if external else ["ckpt"])
    assert _matches(CheckpointState.load_checkpoint(target), news)


@needs_root
@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_a_full_tmpfs_is_an_oserror_while_a_helper_copies_through_a_mapping(external):
    """A save of 40 MiB into a private directory on a 24 MiB tmpfs: such a save is filled from
    both ends, its second writer storing through a shared mapping, where a page that cannot be
    had would be SIGBUS. Each save must fail with ENOSPC naming the file (in a child, so that a
    signal shows as one), and leave the old checkpoint and nothing else."""
    with small_tmpfs("size=24M,mode=0700") as directory:
        target = directory / "ckpt"
        olds = _arrays(1)
        threshold = 0 if external else 1 << 40
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(olds), target, external_data_threshold=threshold)
        before = {p.name: p.read_bytes() for p in directory.iterdir()}
        script = textwrap.dedent(f"""
            import numpy as np
            from ortckpt import CheckpointState
            arrays = {{f"w{{i}}": np.full(1 << 20, i, np.float32) for i in range(10)}}  # 4 MiB each
            for attempt in range(4):
                try:
                    CheckpointState.save_checkpoint(
                        CheckpointState.from_arrays(arrays), {str(target)!r}, external_data_threshold={threshold}
                    )
                    raise SystemExit("a 40 MiB save fitted into 24 MiB")
                except OSError as e:
                    print(e.errno, e.filename)
        """)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, (run.returncode, run.stderr)
        for line in run.stdout.splitlines():
            code, filename = line.split()
            assert int(code) == errno.ENOSPC and filename == str(target) + (".data" if external else ""), line
        assert len(run.stdout.splitlines()) == 4
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # no temporaries either
        assert _matches(CheckpointState.load_checkpoint(target), olds)


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_a_full_disk_is_an_oserror_and_the_old_checkpoint_stays(external, tmp_path):
    """The file size limit (RLIMIT_FSIZE) stands in for a full disk: writes past it
    fail with EFBIG, as they would with ENOSPC on a full one."""
    target = tmp_path / "ckpt"
    olds = _arrays(1)
    threshold = 0 if external else 1 << 40
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(olds), target, external_data_threshold=threshold)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    script = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        from ortckpt import CheckpointState
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # 1 MiB per file
        state = CheckpointState.from_arrays({{"w": np.ones(1 << 20, np.float32)}})  # 4 MiB
        try:
            CheckpointState.save_checkpoint(state, {str(target)!r}, external_data_threshold={threshold})
        except OSError as e:
            print(e.errno, e.filename)
            sys.exit(0)
        sys.exit("the save succeeded past the file size limit")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    code, filename = run.stdout.split()
    assert int(code) in (errno.EFBIG, errno.ENOSPC)
    assert filename == str(target) + (".data" if external else "")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporaries either
    assert _matches(CheckpointState.load_checkpoint(target), olds)
