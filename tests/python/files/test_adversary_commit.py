"""An adversarial review of the transaction layer, its one commit of local files (manager/test_adversary.py
holds the step stores' and the manager's part; manager/ADVERSARY_FINDINGS.md lists every finding).

Every test marked FINDING failed when it was written: it asserts what should happen when a process is killed,
a rename fails, a second process or thread interleaves, and something else happened then (see each docstring).
Tests marked HELD are attacks the code withstood, kept for the coverage they add. Moments narrower than a kill
from outside can hit are reached with a preloaded shim (adversary_shim.py) that stops, kills or fails the
process at one exact rename.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import adversary_shim
import numpy as np
import ortckpt
import pytest
from goldens import EVAL_MODEL, GOLDEN
from ortckpt import CheckpointState, _boundary
from ortckpt.errors import InternalError
from privileges import needs_root, small_tmpfs


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = adversary_shim.build(tmp_path_factory.mktemp("shim"))
    return built


def state_of(value: float, n: int = 1 << 10) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full(n, value, np.float32), "b": np.full(7, value, np.float32)})


def value_of(state: CheckpointState) -> float:
    """The one value a checkpoint of :func:`state_of` holds (an assertion if it mixes two)."""
    w, b = state.parameters["w"].data, state.parameters["b"].data
    assert np.all(w == w[0]) and np.all(b == w[0]), "a checkpoint mixing two saves"
    return float(w[0])


SAVE = textwrap.dedent(
    """
    import sys
    import numpy as np
    from ortckpt import CheckpointState
    path, value, threshold = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 1 << 10
    state = CheckpointState.from_arrays({"w": np.full(n, value, np.float32), "b": np.full(7, value, np.float32)})
    try:
        CheckpointState.save_checkpoint(state, path, external_data_threshold=threshold)
    except OSError as e:
        print("failed", e.errno, flush=True)
    """
)


def test_finding_a_second_rename_that_fails_leaves_the_previous_checkpoint_loadable(shim, tmp_path):
    """FINDING (unloadable: both the previous and the new checkpoint lost). A save with external
    data renames ``ck.data`` into place, then ``ck``. When the second rename fails (EIO, as a
    network or FUSE filesystem can answer; injected by the shim), Staged::commit returns the error
    and drops its PendingFile, which deletes the new checkpoint's temporary file: left behind are
    the previous ``ck`` beside the new ``ck.data``, which the pair trailers refuse, and nothing
    that matches it ("the checkpoint matching the data file is gone"). A crash at the same moment
    is recovered from (the loader finds the temporary checkpoint); an error is not. Every time."""
    path = tmp_path / "ck"
    ortckpt.save_checkpoint(state_of(1.0), path, external_data_threshold=0)
    done = adversary_shim.run(shim, "/ck", "eio-before", SAVE, path, 2.0, 0)
    assert done.stdout.split() == ["failed", "5"], done.stderr  # the save says it failed (EIO)...
    assert value_of(CheckpointState.load_checkpoint(path)) == 1.0  # ...so the previous one must load


EXPORT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ortckpt
    from ortckpt import CheckpointState
    golden, model, out, value = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    trained = CheckpointState.load_checkpoint(golden)
    state = CheckpointState.from_arrays({n: np.full(p.data.shape, value, p.data.dtype) for n, p in trained.parameters})
    ortckpt.export_model(state, model, out, external_data=True, size_threshold=100)
    """
)


def test_finding_a_killed_export_never_leaves_a_model_mixing_two_exports(shim, tmp_path):
    """FINDING (silent wrong values). export_model with external data publishes ``model.onnx.data``
    first and ``model.onnx`` last, through the same commit as a checkpoint; but an ONNX model has
    no pair trailer and no loader that looks for a temporary model, so an export killed between
    the two renames leaves the previous model reading the new export's data file: here its
    weights (external) are the second export's and its biases (inline) the first's, and onnx and
    ONNX Runtime load it without a word. Every time."""
    import onnx
    from onnx import numpy_helper

    out = tmp_path / "model.onnx"
    golden = GOLDEN / "trained_no_optimizer.ckpt"
    first = subprocess.run(
        [sys.executable, "-c", EXPORT, *map(str, (golden, EVAL_MODEL, out, 1.0))],
        check=False,
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr
    killed = adversary_shim.run(shim, "/model.onnx.data", "kill-after", EXPORT, golden, EVAL_MODEL, out, 2.0)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    trained = {name for name, _ in CheckpointState.load_checkpoint(golden).parameters}

    def values_of_the_model() -> set[float]:
        model = onnx.load(str(out))
        return {float(numpy_helper.to_array(t).ravel()[0]) for t in model.graph.initializer if t.name in trained}

    # Fixed: the previous model is moved out of sight before the data file is replaced, so a
    # crash between the renames leaves no model at the path (a loud FileNotFoundError), never a mix.
    assert not out.exists() or len(values_of_the_model()) == 1, f"{out.name} mixes two exports"
    again = subprocess.run(
        [sys.executable, "-c", EXPORT, *map(str, (golden, EVAL_MODEL, out, 3.0))], check=False, capture_output=True
    )
    assert again.returncode == 0 and len(values_of_the_model()) == 1
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "model.onnx.data"]  # what the killed export left: swept


def test_finding_an_inline_save_racing_an_external_one_leaves_no_orphan_data_file(shim, tmp_path):
    """FINDING (leak: a data file as large as the model, for ever). An inline save that finds no
    data file and no leftovers commits without the lock: it reads the pair id of the checkpoint it
    is about to replace, then renames. If a save with external data commits in between (here: the
    inline save is stopped just before its rename while the other save runs whole), the inline
    save replaces that checkpoint but judges ``ck.data`` against the pair id it read before (none:
    the checkpoint before was inline), so the other save's ``ck.data`` stays beside an inline
    checkpoint. No later save removes it either (it matches no checkpoint they replace). Every
    time."""
    path = tmp_path / "ck"
    ortckpt.save_checkpoint(state_of(0.0), path)  # inline, no data file: the unlocked path
    inline = adversary_shim.start_stopped(shim, "/ck", SAVE, path, 1.0, 1 << 40)
    ortckpt.save_checkpoint(state_of(2.0), path, external_data_threshold=0)  # commits whole meanwhile
    code, out, err = adversary_shim.resume(inline)
    assert code == 0 and "failed" not in out, err
    assert value_of(CheckpointState.load_checkpoint(path)) == 1.0  # the inline save renamed last
    ortckpt.save_checkpoint(state_of(3.0), path)  # and another inline save later
    assert sorted(os.listdir(tmp_path)) == ["ck"], "an orphan data file no save will ever remove"


@needs_root
def test_finding_temporaries_of_dead_saves_never_fill_the_disk_for_good(shim):
    """FINDING (a full disk for ever; every later save of the path fails). The temporary files of
    a killed save are removed only by the next save that commits. On a nearly full disk (a 4 MiB
    tmpfs) a save killed after staging 2.5 MiB leaves its temporaries, which nothing but a commit
    removes; every later save then fails with ENOSPC while staging, before any commit, so the space
    is never given back, although the dead saves' locks prove them removable. Every time."""
    with small_tmpfs("size=4M") as directory:
        path = directory / "ck"
        quarter = 1 << 18  # float32 values in a MiB
        ortckpt.save_checkpoint(state_of(1.0, quarter), path, external_data_threshold=0)  # 1 MiB
        killed = adversary_shim.run(shim, "/ck.data", "kill-before", SAVE, path, 2.0, 0, int(2.5 * quarter))
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        failures = []
        for attempt in range(3):  # 1 MiB each: it fits once the dead save's 2.5 MiB are gone
            try:
                ortckpt.save_checkpoint(state_of(3.0 + attempt, quarter), path, external_data_threshold=0)
                break
            except OSError as e:
                failures.append(e.errno)
        assert failures == [], f"every save fails ({failures}): {sorted(os.listdir(directory))}"
        loaded = CheckpointState.load_checkpoint(path)
        assert value_of(loaded) == 3.0
        del loaded
        gc.collect()


def test_finding_lock_timeouts_out_of_range_are_refused_not_internal_errors(tmp_path):
    """FINDING (wrong error). ``lock_timeout`` reaches Duration::from_secs_f64 unchecked: an
    infinite (or huge) timeout on a save, any timeout on Staging.commit that is negative or NaN,
    and an infinite one on acquire_lock panic in the core, surfacing as InternalError "please
    report" instead of a ValueError (or, for the negative and NaN ones, the zero wait that save()
    and acquire_lock() already make of them)."""
    path = tmp_path / "ck"
    state = state_of(1.0)
    calls = {
        "save_checkpoint(lock_timeout=inf)": lambda: ortckpt.save_checkpoint(
            state, path, external_data_threshold=0, lock_timeout=float("inf")
        ),
        "save_checkpoint(lock_timeout=1e30)": lambda: ortckpt.save_checkpoint(
            state, path, external_data_threshold=0, lock_timeout=1e30
        ),
        "Staging.commit(lock_timeout=-1)": lambda: _boundary.stage(tmp_path / "f").commit(lock_timeout=-1.0),
        "Staging.commit(lock_timeout=nan)": lambda: _boundary.stage(tmp_path / "f").commit(lock_timeout=float("nan")),
        "acquire_lock(timeout=inf)": lambda: _boundary.acquire_lock(tmp_path / "lock", timeout=float("inf")),
    }
    internal = []
    for name, call in calls.items():
        try:
            call()
        except ValueError:
            pass  # refused: fine
        except InternalError:
            internal.append(name)
    assert internal == [], f"panics in the core: {internal}"


class CountsTrue(io.RawIOBase):
    """A raw stream whose write() takes everything and returns True (a count of 1 to Python)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b):  # type: ignore[no-untyped-def]
        self.data += bytes(b)
        return True


def test_finding_a_stream_whose_write_returns_a_bool_is_refused_not_fed_garbage():
    """FINDING (silent garbage; low: needs a broken stream). write_stream promises every byte or
    an error and checks the count write() returns with isinstance(written, int), which True
    passes as 1: it then writes the rest again from the next byte, and again, so a 320-byte
    checkpoint arrives as 51 kB of overlapping copies, with no error."""
    sink = CountsTrue()
    state = CheckpointState.from_arrays({"w": np.arange(16, dtype=np.float32)})
    try:
        ortckpt.save_checkpoint(state, sink)
    except OSError:
        return  # refused: fine
    assert bytes(sink.data) == state.to_bytes(), f"{len(sink.data)} bytes written for {len(state.to_bytes())}"


def test_finding_a_long_but_valid_file_name_can_be_saved(tmp_path):
    """FINDING (wrong error; low). Temporary names are ``.<name>.ortckpt-tmp.<32 hex>``: 47
    bytes longer than the target's name. A checkpoint named with 209 to 255 bytes (names built
    from a run's configuration get long), which the filesystem and ONNX Runtime accept, cannot be
    saved: OSError ENAMETOOLONG "File name too long" naming the target, whose name is not."""
    path = tmp_path / ("c" * 230)
    path.write_bytes(b"")  # the name itself is fine
    path.unlink()
    try:
        ortckpt.save_checkpoint(state_of(1.0), path)
    except OSError as e:
        pytest.fail(f"a {len(path.name)}-byte name refused: {e.strerror}")
    assert value_of(CheckpointState.load_checkpoint(path)) == 1.0


@pytest.mark.parametrize("action", ["kill-after", "kill-before"])
def test_held_a_save_killed_at_either_side_of_its_first_rename_loads_and_is_cleaned(shim, tmp_path, action):
    """HELD. The kill lands exactly between the data file's rename and the checkpoint's (or just
    before the first): the path loads as one save whole (the loader finds the interrupted save's
    temporary checkpoint), and the next inline save removes the stale data file, the dead
    temporaries and the dead save's lock file."""
    path = tmp_path / "ck"
    ortckpt.save_checkpoint(state_of(1.0), path, external_data_threshold=0)
    killed = adversary_shim.run(shim, "/ck.data", action, SAVE, path, 2.0, 0)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    expected = 2.0 if action == "kill-after" else 1.0
    assert value_of(CheckpointState.load_checkpoint(path)) == expected
    ortckpt.save_checkpoint(state_of(3.0), path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert value_of(CheckpointState.load_checkpoint(path)) == 3.0


MIXED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import ortckpt
    from ortckpt import CheckpointState
    from ortckpt.compression import decompress
    role, directory, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    path, end, count = f"{directory}/ck", time.monotonic() + seconds, 0
    while time.monotonic() < end:
        count += 1
        threshold = 0 if count % 2 else 1 << 40
        if role == "save":
            value = float(count % 5)
            arrays = {"w": np.full(1 << 14, value, np.float32), "b": np.full(7, value, np.float32)}
            state = CheckpointState.from_arrays(arrays)
            CheckpointState.save_checkpoint(state, path, external_data_threshold=threshold)
        elif role == "average":
            ortckpt.average([f"{directory}/a", f"{directory}/b"], out=path, external_data_threshold=threshold)
        else:
            decompress(f"{directory}/z{count % 2}", path)
    print(count, flush=True)
    """
)


def test_held_saves_averages_and_decompresses_of_one_path_never_show_a_reader_a_mix(tmp_path):
    """HELD. Three processes replace one path for two seconds (saves, averages into it and
    decompressions into it, each alternating inline and external data) while this one loads it
    as fast as it can: every load is one whole checkpoint (about 15 000 loads, no error)."""
    from ortckpt.compression import compress

    for name, value in (("a", 10.0), ("b", 20.0)):
        ortckpt.save_checkpoint(state_of(value, 1 << 14), tmp_path / name)
    for index, threshold in enumerate((0, 1 << 40)):
        ortckpt.save_checkpoint(
            state_of(30.0 + index, 1 << 14), tmp_path / f"s{index}", external_data_threshold=threshold
        )
        compress(tmp_path / f"s{index}", tmp_path / f"z{index}")
    path = tmp_path / "ck"
    ortckpt.save_checkpoint(state_of(0.0, 1 << 14), path)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", MIXED_WRITER, role, str(tmp_path), "2"], stdout=subprocess.PIPE, text=True
        )
        for role in ("save", "average", "decompress")
    ]
    loads, problems = 0, []
    while any(w.poll() is None for w in writers):
        try:
            value_of(CheckpointState.load_checkpoint(path))
            loads += 1
        except (OSError, ortckpt.CheckpointError, AssertionError) as e:
            problems.append(f"{type(e).__name__}: {e}")
    assert all(w.wait() == 0 for w in writers)
    assert loads > 100 and problems == [], problems[:3]
    assert value_of(CheckpointState.load_checkpoint(path)) in {0.0, 1.0, 2.0, 3.0, 4.0, 15.0, 30.0, 31.0}


def test_held_things_planted_at_the_names_a_save_judges_are_never_followed_nor_removed(tmp_path):
    """HELD. A FIFO at ``ck.data`` and a FIFO, a directory and a symlink at names of the form of
    the checkpoint's temporary files (``.ck.ortckpt-tmp.*``): inline and external saves commit
    without blocking, remove none of them, and never write through the symlink."""
    path = tmp_path / "ck"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.mkfifo(tmp_path / ".ck.ortckpt-tmp.fifo")
    (tmp_path / ".ck.ortckpt-tmp.dir").mkdir()
    os.symlink(victim, tmp_path / ".ck.ortckpt-tmp.link")
    os.mkfifo(tmp_path / "ck.data")
    planted = sorted(os.listdir(tmp_path))
    ortckpt.save_checkpoint(state_of(1.0), path)  # inline: judges ck.data and the "leftovers"
    assert value_of(CheckpointState.load_checkpoint(path)) == 1.0
    assert sorted(os.listdir(tmp_path)) == sorted([*planted, "ck"])
    os.unlink(tmp_path / "ck.data")
    ortckpt.save_checkpoint(state_of(2.0), path, external_data_threshold=0)
    ortckpt.save_checkpoint(state_of(3.0), path)
    assert value_of(CheckpointState.load_checkpoint(path)) == 3.0
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == sorted({*planted, "ck"} - {"ck.data"})
