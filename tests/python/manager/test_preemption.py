"""Preemption (CheckpointManager(preemption=...)) and Ctrl-C during save_checkpoint
(ortckpt.interrupts), in subprocesses that get real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointManager, CheckpointState, interrupts

LOOP = textwrap.dedent(
    """
    import sys, numpy as np, ortckpt
    directory, steps, async_save = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    manager = ortckpt.CheckpointManager(directory, save_every=50, max_to_keep=2, async_save=async_save,
                                        durable=False, preemption=True, preemption_grace=30)
    latest = manager.latest_step()
    state = manager.restore() if latest else ortckpt.CheckpointState.from_arrays(
        {"w": np.zeros(1 << 16, np.float32)})
    w = state.parameters["w"].data
    print("ready", flush=True)
    done = latest or 0
    for step in range(done, steps):
        w += np.float32(step % 7)          # the "training": deterministic, whatever was resumed
        sum(range(20000))                 # (time for a signal to land mid-step)
        done = step + 1
        if manager.should_save(done) or done == steps:
            manager.save(state, done)
            if manager.preempted:
                break
    manager.close()
    print("result", done, manager.latest_step(), manager.preempted, flush=True)
    """
)


def _start(tmp_path: Path, directory: Path, steps: int, async_save: bool) -> subprocess.Popen[str]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    process = subprocess.Popen(
        [sys.executable, str(script), str(directory), str(steps), "1" if async_save else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("async_save", [True, False])
def test_a_signal_saves_the_step_it_was_at(tmp_path: Path, signum: int, async_save: bool) -> None:
    directory = tmp_path / "run"
    process = _start(tmp_path, directory, 100000, async_save)
    time.sleep(0.3)
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    _, done, latest, preempted = out.split()
    assert preempted == "True" and int(done) == int(latest) and int(done) < 100000
    with CheckpointManager(directory, read_only=True) as manager:
        manager.verify()
        restored = manager.restore()
    expected = sum(np.float32(s % 7) for s in range(int(done)))
    assert restored.parameters["w"].data[0] == np.float32(expected)
    assert restored.properties["step"] == int(done)


def test_a_second_signal_during_the_preemption_save_leaves_a_whole_step(tmp_path: Path) -> None:
    """The second SIGTERM comes at once: during the save (noted: the save completes, exit 0)
    or before it (SIGTERM's default action ends the process): either way the latest step is whole."""
    for attempt in range(4):
        directory = tmp_path / f"run{attempt}"
        process = _start(tmp_path, directory, 100000, True)
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.001 * attempt)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode in (0, -signal.SIGTERM), err
        with CheckpointManager(directory, read_only=True) as manager:
            if manager.latest() is not None:
                manager.verify()
                manager.restore()
        if process.returncode == 0:
            _, done, latest, _ = out.split()
            assert done == latest


def test_grace_period_ends_a_run_that_never_saves(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, ortckpt
            manager = ortckpt.CheckpointManager({str(tmp_path / "run")!r}, preemption=True, preemption_grace=0.5)
            print("ready", flush=True)
            while True:
                time.sleep(0.05)      # never calls should_save
            """
        )
    )
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert "preemption_grace" in err


CLOSE_SWEEP = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import ortckpt
    manager = ortckpt.CheckpointManager(sys.argv[1], preemption=True, preemption_grace=60)
    os.kill(os.getpid(), signal.SIGTERM)  # the first signal: the run is preempted
    assert manager.preempted
    outcomes = {}
    for k in range(1, 100_000):
        pid = os.fork()
        if pid == 0:  # a child closes the manager, and gets the second SIGTERM at close's k-th event
            seen = 0
            def hook(frame, event, arg):
                global seen
                seen += 1
                if seen == k:
                    os.kill(os.getpid(), signal.SIGTERM)
            sys.setprofile(hook)
            manager.close()
            sys.setprofile(None)
            os._exit(0 if seen >= k else 3)  # 3: close() ended before its k-th event
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        if done[0] == 0:  # stuck: killed, and told
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            outcomes[k] = "stuck"
            break
        if os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 3:
            break
        outcomes[k] = f"signal {os.WTERMSIG(done[1])}" if os.WIFSIGNALED(done[1]) else f"exit {os.WEXITSTATUS(done[1])}"
    print(json.dumps([sorted(set(outcomes.values())), len(outcomes), [k for k, v in outcomes.items() if v == "stuck"]]))
    """
)


def test_a_second_signal_at_any_moment_of_close_ends_the_process(tmp_path: Path) -> None:
    """Once preempted, a second SIGTERM that lands anywhere inside close() ends the process by
    its default action (or close() finishes first): never a hang. Each forked child gets it at
    the next of close()'s profile events. (The handler once cancelled the watchdog Timer that
    close() was cancelling, inside its Event's lock, and waited for that lock forever.)"""
    script = tmp_path / "sweep.py"
    script.write_text(CLOSE_SWEEP)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kinds, events, stuck = json.loads(done.stdout.strip().splitlines()[-1])
    assert stuck == [] and events > 10, done.stdout
    assert set(kinds) <= {f"signal {int(signal.SIGTERM)}", "exit 0"}, kinds


def test_handlers_chain_and_are_restored(tmp_path: Path) -> None:
    heard: list[int] = []

    def mine(signum: int, frame: object) -> None:
        heard.append(signum)

    before_int = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        manager = CheckpointManager(tmp_path / "run", save_every=10, preemption=True)
        assert signal.getsignal(signal.SIGTERM) is not mine
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert manager.preempted and heard == [signal.SIGTERM]  # the user's handler heard of it too
        assert manager.should_save(1) and manager.should_save(3)  # whatever save_every says
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 3)
        assert manager.latest_step() == 3 and not manager.should_save(4) and manager.preempted
        manager.close()
        assert signal.getsignal(signal.SIGTERM) is mine
        # SIGINT: the handler of before, or ortckpt's forwarder standing for it (a save installs it: it hands
        # every SIGINT outside a save to that handler; see ortckpt.interrupts), whichever tests ran first.
        assert interrupts.underlying(signal.getsignal(signal.SIGINT)) is interrupts.underlying(before_int)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_close_restores_handlers_after_an_error(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    manager = CheckpointManager(tmp_path / "run", preemption=[signal.SIGTERM])
    manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 5)
    with pytest.raises(ValueError):
        manager.save(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), 4)  # older than the latest
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_without_preemption_nothing_changes(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with CheckpointManager(tmp_path / "run", save_every=10) as manager:
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
        assert not manager.preempted and not manager.should_save(3)
        import threading

        thread = threading.Thread(target=manager.preempt)  # by hand, from another thread: as a signal would
        thread.start()
        thread.join()
        assert manager.preempted and manager.should_save(3)


def test_a_manager_dropped_without_close_puts_its_handlers_back(tmp_path: Path) -> None:
    import gc

    from ortckpt.interrupts import underlying

    # (an earlier save may have left ortckpt's SIGINT forwarder: it stands for the handler it replaced)
    before = signal.getsignal(signal.SIGTERM), underlying(signal.getsignal(signal.SIGINT))
    manager = CheckpointManager(tmp_path / "run", preemption=True, read_only=False)
    assert signal.getsignal(signal.SIGTERM) != before[0]
    manager.store.close()  # (the directory's lock; the manager itself is just dropped)
    del manager
    gc.collect()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_preemption_outside_the_main_thread_is_refused(tmp_path: Path) -> None:
    import threading

    errors: list[BaseException] = []

    def create() -> None:
        try:
            CheckpointManager(tmp_path / "run", preemption=True)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert isinstance(errors[0], ValueError) and "main thread" in str(errors[0])


@pytest.mark.parametrize("bad", ["SIGTERM", [0], [signal.SIGKILL], []])
def test_preemption_arguments(tmp_path: Path, bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        CheckpointManager(tmp_path / "run", preemption=bad)


def test_the_manager_sets_step_and_epoch_on_the_state(tmp_path: Path) -> None:
    """A restored state carries step 500; after the manager saves step 1000, a plain save
    writes 1000 (the stale-step bug)."""
    state = CheckpointState.from_arrays({"w": np.ones(3, np.float32)})
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(state, 500, epoch=1)
        restored = manager.restore()
        assert restored.properties["step"] == 500
        manager.save(restored, 1000, epoch=2)
    assert (restored.properties["step"], restored.properties["epoch"]) == (1000, 2)
    ortckpt.save_checkpoint(restored, tmp_path / "final.ckpt")
    assert ortckpt.load_checkpoint(tmp_path / "final.ckpt").properties["step"] == 1000


SAVE = textwrap.dedent(
    """
    import sys, numpy as np, ortckpt
    path = sys.argv[1]
    state = ortckpt.CheckpointState.from_arrays({"w": np.full(24 << 20, 2.0, np.float32)})
    try:
        print("ready", flush=True)  # (in the try: a SIGINT landing as it returns is one before the save)
        ortckpt.save_checkpoint(state, path)
    except KeyboardInterrupt:
        print("raised", flush=True)
        sys.exit(3)
    print("returned", flush=True)
    """
)


def test_ctrl_c_during_save_checkpoint_means_nothing_committed(tmp_path: Path) -> None:
    """SIGINT at many moments of a 96 MiB save: an exception out of save_checkpoint means the
    old file is intact, byte for byte; a normal return means the new file is in place (a
    KeyboardInterrupt may then surface after it returned, in the caller)."""
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    old = CheckpointState.from_arrays({"w": np.full(24 << 20, 1.0, np.float32)})
    seen = set()
    for n in range(10):
        path = tmp_path / f"c{n}.ckpt"
        ortckpt.save_checkpoint(old, path)
        before = path.read_bytes()
        process = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(0.03 * n)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
        now = ortckpt.load_checkpoint(path).parameters["w"].data
        if "raised" in out:
            assert process.returncode == 3 and path.read_bytes() == before
            seen.add("raised")
        else:
            assert now[0] == 2.0 and now[-1] == 2.0  # the new file, whole
            ortckpt.verify(path)
            seen.add("returned" if "returned" in out else "after")
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".c{n}.ckpt")]
        assert leftovers == [], leftovers
        path.unlink()
    assert "raised" in seen


def test_the_readmes_preemption_example_saves_where_it_was(tmp_path: Path) -> None:
    from readme_blocks import block  # (helpers/, on sys.path by conftest)

    script = tmp_path / "example.py"
    script.write_text(block("preemption"))
    for _ in range(2):  # preempted, then resumed and preempted again
        process = subprocess.Popen(
            [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert process.stdout is not None and process.stdout.readline().strip() == "training"
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        _, _, step, _, saved = out.split()
        assert step == saved
    restored = CheckpointManager(tmp_path / "preemptible", read_only=True).restore()
    assert restored.parameters["w"].data[0] == int(step)


COMMIT_INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, numpy as np, ortckpt
    from ortckpt import _boundary
    path, where = sys.argv[1], sys.argv[2]
    real = _boundary.save_staged

    class Staged:  # a SIGINT that comes during the commit (or just before it)
        def __init__(self, staged):
            self.staged = staged
        def commit(self, **options):
            if where == "commit":
                os.kill(os.getpid(), signal.SIGINT)
            return self.staged.commit(**options)

    def save_staged(*args, **kwargs):
        staged, placed = real(*args, **kwargs)
        if where == "before":
            os.kill(os.getpid(), signal.SIGINT)
        return Staged(staged), placed

    _boundary.save_staged = save_staged
    state = ortckpt.CheckpointState.from_arrays({"w": np.full(8, 2.0, np.float32)})
    try:
        ortckpt.save_checkpoint(state, path)
    except KeyboardInterrupt:
        print("raised", flush=True)
        sys.exit(3)
    try:
        print("returned", flush=True)
    except KeyboardInterrupt:  # (at the caller's next call)
        print("after the return", flush=True)
        sys.exit(4)
    """
)


@pytest.mark.parametrize("where", ["before", "commit"])
def test_a_sigint_before_the_commit_raises_one_during_it_surfaces_after_the_return(tmp_path: Path, where: str) -> None:
    script = tmp_path / "save.py"
    script.write_text(COMMIT_INTERRUPTED)
    path = tmp_path / "c.ckpt"
    ortckpt.save_checkpoint(CheckpointState.from_arrays({"w": np.full(8, 1.0, np.float32)}), path)
    before = path.read_bytes()
    done = subprocess.run([sys.executable, str(script), str(path), where], capture_output=True, text=True, check=False)
    if where == "before":
        assert (done.returncode, done.stdout) == (3, "raised\n") and path.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt", "save.py"]  # the staged file removed
    else:  # committed: the save returned, and the KeyboardInterrupt came in the caller, after it
        assert (done.returncode, done.stdout) == (4, "after the return\n")
        assert ortckpt.load_checkpoint(path).parameters["w"].data[0] == 2.0


def test_a_sigint_handler_that_does_not_raise_lets_the_save_commit(tmp_path: Path) -> None:
    heard: list[int] = []

    def mine(signum: int, frame: object) -> None:
        heard.append(signum)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        from ortckpt import _boundary

        real = _boundary.save_staged

        def save_staged(*args: object, **kwargs: object) -> object:
            staged = real(*args, **kwargs)  # type: ignore[arg-type]
            os.kill(os.getpid(), signal.SIGINT)  # during the write, as far as the save can tell
            return staged

        _boundary.save_staged = save_staged  # type: ignore[assignment]
        try:
            ortckpt.save_checkpoint(CheckpointState.from_arrays({"w": np.ones(3, np.float32)}), tmp_path / "c.ckpt")
        finally:
            _boundary.save_staged = real  # type: ignore[assignment]
        assert heard == [signal.SIGINT] and (tmp_path / "c.ckpt").exists()  # heard before the commit, once
        os.kill(os.getpid(), signal.SIGINT)  # outside a save: the forwarder hands it over, and steps aside
        time.sleep(0.01)
        assert heard == [signal.SIGINT, signal.SIGINT] and signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_close_leaves_a_handler_installed_after_the_manager_alone(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        manager = CheckpointManager(tmp_path / "run", preemption=[signal.SIGTERM])
        replacement = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the program's own, installed since
        assert replacement is not previous
        manager.close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


MANAGER_SAVE = textwrap.dedent(
    """
    import sys, numpy as np, ortckpt
    directory = sys.argv[1]
    manager = ortckpt.CheckpointManager(directory, durable=False)
    state = ortckpt.CheckpointState.from_arrays({"w": np.full(32 << 20, 2.0, np.float32)})
    print("ready", flush=True)
    try:
        manager.save(state, 2)
    except KeyboardInterrupt:
        print("raised", flush=True)
        sys.exit(3)
    print("returned", flush=True)
    """
)


def test_ctrl_c_during_a_synchronous_manager_save_means_nothing_committed(tmp_path: Path) -> None:
    script = tmp_path / "save.py"
    script.write_text(MANAGER_SAVE)
    seen = set()
    for n in range(8):
        directory = tmp_path / f"run{n}"
        with CheckpointManager(directory, durable=False) as manager:
            manager.save(CheckpointState.from_arrays({"w": np.full(4, 1.0, np.float32)}), 1)
        process = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(0.03 * n)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
        with CheckpointManager(directory, read_only=True) as reader:
            if "raised" in out:
                assert process.returncode == 3 and reader.all_steps() == [1]
                seen.add("raised")
            else:
                assert reader.all_steps() == [1, 2]
                reader.verify(2)
                seen.add("committed")
    assert "raised" in seen
