"""Checks in a fresh process (validate=Forward(..., process=True), verify_after_save="process"):
the verdict comes on a channel of its own, a deadline kills the child and all it started, a
child that dies is named, and the child imports what the parent imported. Real children, real
ONNX models (the golden eval model, and one that loops for ever)."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import child_checks
import numpy as np
import onnx
import ortckpt
import pytest
from goldens import ARTIFACTS, EVAL_MODEL, INPUTS
from onnx import TensorProto, helper
from ortckpt import (
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointState,
    Forward,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ValidationTimeoutError,
)

HELPERS = Path(child_checks.__file__).resolve().parent  # (what a child imports by name: helpers/)

# Generous bounds that prove "does not hang": each save below takes seconds when it works.
NO_HANG = 60.0


def trained() -> CheckpointState:
    return CheckpointState.load_checkpoint(ARTIFACTS / "checkpoint")


def committed(manager: CheckpointManager) -> list[int]:
    return [c.step for c in manager.all()]


@pytest.fixture
def mark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every process started from here on carries a fresh environment mark; the file its checks
    write their pids to."""
    monkeypatch.setenv("ORTCKPT_TEST_MARK", uuid.uuid4().hex)
    started = tmp_path / "started"
    monkeypatch.setenv(child_checks.STARTED, str(started))
    return started


def marked_processes() -> list[int]:
    """The live processes (not zombies) other than this one that carry this test's mark."""
    needle = f"ORTCKPT_TEST_MARK={os.environ['ORTCKPT_TEST_MARK']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or another user's
        if needle in environ and state != "Z":
            found.append(int(entry.name))
    return found


def assert_nothing_left() -> None:
    deadline = time.monotonic() + 10  # a killed process may take a moment to be reaped by init
    while marked_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked_processes() == [], "a process the check started is still running"


def timed(call: Callable[[], object]) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


def looping_model(path: Path) -> Path:
    """An eval model of the parameter w that never finishes: a Loop of 2**62 trips."""
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("v_in", "v_out")]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Neg", ["v_in"], ["v_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            floats[0],
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), floats[1]],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "go", "w"], ["y"], body=body)],
        "loops",
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [
            helper.make_tensor("trips", TensorProto.INT64, [], [2**62]),
            helper.make_tensor("go", TensorProto.BOOL, [], [1]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


# --- 1. the verdict comes on its own channel; what the child prints is only logged ---


@pytest.mark.parametrize("process", [False, True])
def test_what_a_check_prints_is_logged_never_a_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, process: bool
) -> None:
    caplog.set_level(logging.INFO, logger="ortckpt.manager.child")
    forward = Forward(EVAL_MODEL, inputs=INPUTS, check=child_checks.prints_and_passes, process=process)
    with CheckpointManager(tmp_path, validate=forward) as manager:
        manager.save(trained(), 1)
        assert committed(manager) == [1]
        refuse = Forward(EVAL_MODEL, inputs=INPUTS, check=child_checks.prints_and_fails, process=process)
        manager.validate = refuse
        with pytest.raises(CheckpointIntegrityError) as e:
            manager.save(trained(), 2)
        # The verdict only: nothing the check printed, although it looks like one.
        assert e.value.problems == ["check(outputs) returned False, not True"]
        assert committed(manager) == [1]
    if process:
        logged = [r.getMessage() for r in caplog.records if r.name == "ortckpt.manager.child"]
        assert any(m.startswith("validation process: debug: the loss is") for m in logged), logged
        for line in child_checks.LOOKS_LIKE_A_VERDICT:
            assert logged.count(f"validation process: {line}") == 4  # stdout and stderr, two saves


@pytest.mark.parametrize(
    ("process", "check", "says"),
    [
        (False, child_checks.raises_a_huge_message, "check(outputs) raised ValueError: xxx"),
        (True, child_checks.raises_a_huge_message, "check(outputs) raised ValueError: xxx"),
        (True, child_checks.raises_a_huge_system_exit, "the validation process failed: SystemExit: zzz"),
    ],
)
def test_a_check_whose_message_is_huge_is_refused_naming_what_it_raised(
    tmp_path: Path, process: bool, check: Callable[[dict[str, np.ndarray]], bool], says: str
) -> None:
    """A message of 20 MiB used to make the child's verdict too large to read ("a verdict that
    cannot be read", naming neither the exception nor the check), and an error of megabytes in
    this process: the message is cut, the exception named."""
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL, inputs=INPUTS, check=check, process=process)) as m:
        with pytest.raises(CheckpointIntegrityError) as e:
            m.save(trained(), 1)
        assert committed(m) == []
    [problem] = e.value.problems
    assert problem.startswith(says), problem[:200]
    assert re.search(r"\.\.\. \(\d+ more characters\)$", problem), problem[-200:]
    assert len(str(e.value)) < 100_000


def test_a_child_that_floods_its_output_does_not_block(
    tmp_path: Path, mark: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ortckpt.manager.child")
    forward = Forward(EVAL_MODEL, inputs=INPUTS, check=child_checks.floods_and_passes, process=True, timeout=NO_HANG)
    with CheckpointManager(tmp_path, validate=forward) as manager:
        assert timed(lambda: manager.save(trained(), 1)) < NO_HANG
        assert committed(manager) == [1]
    logged = [r.getMessage() for r in caplog.records if r.name == "ortckpt.manager.child"]
    assert len(logged) <= 1001 and logged[-1].endswith("more lines of output not logged")
    assert max(len(m) for m in logged) < 5000  # the 8 MiB line is cut
    assert_nothing_left()


def test_a_helper_the_check_leaves_running_neither_delays_the_save_nor_outlives_it(tmp_path: Path, mark: Path) -> None:
    # The helper holds the child's stdout and stderr open; the default deadline is minutes away.
    forward = Forward(EVAL_MODEL, inputs=INPUTS, check=child_checks.starts_a_helper_and_passes, process=True)
    with CheckpointManager(tmp_path, validate=forward) as manager:
        assert timed(lambda: manager.save(trained(), 1)) < 30
        assert committed(manager) == [1]
    assert len(mark.read_text().split()) == 1  # the helper did start
    assert_nothing_left()


def test_a_helper_that_leaves_the_childs_session_with_its_pipe_does_not_hold_the_save(
    tmp_path: Path, mark: Path
) -> None:
    # Out of the child's process group, it cannot be killed with it; the save reads the output a
    # few seconds more, then goes on (the reader ends when the helper closes the pipe).
    forward = Forward(EVAL_MODEL, inputs=INPUTS, check=child_checks.starts_an_escaping_helper_and_passes, process=True)
    try:
        with CheckpointManager(tmp_path, validate=forward) as manager:
            assert timed(lambda: manager.save(trained(), 1)) < 30
            assert committed(manager) == [1]
    finally:
        for pid in map(int, mark.read_text().split()):
            os.kill(pid, signal.SIGKILL)  # the helper this test's check started
    assert_nothing_left()


# --- 2. a deadline ---


def test_an_eval_model_that_never_finishes_is_killed_at_the_timeout(tmp_path: Path, mark: Path) -> None:
    model = looping_model(tmp_path / "loops.onnx")
    state = CheckpointState.from_arrays({"w": np.ones(4, np.float32)})
    run = tmp_path / "run"
    with CheckpointManager(run) as manager:
        manager.save(state, 1)
    with CheckpointManager(run, validate=Forward(model, process=True, timeout=2)) as manager:
        start = time.monotonic()
        with pytest.raises(ValidationTimeoutError) as e:
            manager.save(state, 2)
        assert time.monotonic() - start < NO_HANG
        assert isinstance(e.value, CheckpointIntegrityError) and isinstance(e.value, TimeoutError)
        assert e.value.timeout == 2 and ".step_00000002.tmp-" in e.value.filename
        assert e.value.problems == [
            "the validation process ran past its timeout of 2 s and was killed (with every process it started)"
        ]
        assert committed(manager) == [1] and manager.latest().step == 1
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".ortckpt")) == ["step_00000001"]
    assert_nothing_left()


@pytest.mark.parametrize("check", [child_checks.sleeps, child_checks.starts_a_helper_and_sleeps])
def test_a_check_that_hangs_is_killed_with_what_it_started(
    tmp_path: Path, mark: Path, check: Callable[[dict[str, np.ndarray]], bool]
) -> None:
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL, check=check, process=True, timeout=3)) as manager:
        start = time.monotonic()
        with pytest.raises(ValidationTimeoutError, match="timeout of 3 s"):
            manager.save(trained(), 1)
        assert time.monotonic() - start < NO_HANG
        assert committed(manager) == []
    assert mark.read_text().split()  # the check did run
    assert_nothing_left()


def test_verification_in_a_process_has_a_deadline(tmp_path: Path, mark: Path) -> None:
    with CheckpointManager(tmp_path, verify_after_save="process") as manager:
        manager.save(trained(), 1)
        manager.verify_timeout = 0.05  # less than Python takes to start: the deadline is what refuses
        with pytest.raises(ValidationTimeoutError, match=r"verification process ran past its timeout of 0\.05 s") as e:
            manager.save(trained(), 2)
        assert ".step_00000002.tmp-" in e.value.filename
        assert committed(manager) == [1]
    assert_nothing_left()


def test_timeouts_are_checked_when_configured(tmp_path: Path) -> None:
    assert Forward(EVAL_MODEL, process=True).timeout is None  # the documented default: 120 s + 1 s per 64 MiB
    assert ortckpt.manager.child.default_timeout(64 << 20) == 121
    with pytest.raises(InvalidArgumentError, match="needs process=True") as e:
        Forward(EVAL_MODEL, timeout=5)
    assert e.value.argument == "timeout"
    for bad, message in (
        (0, "number of seconds above 0"),
        (-1, "number of seconds above 0"),
        (float("inf"), "finite number"),
        (math.nan, "finite number"),
    ):
        with pytest.raises(InvalidArgumentError, match=message) as e:
            Forward(EVAL_MODEL, process=True, timeout=bad)
        assert e.value.argument == "timeout"
        with pytest.raises(InvalidArgumentError, match=f"verify_timeout (is a|must be a) {message}") as e:
            CheckpointManager(tmp_path, verify_after_save="process", verify_timeout=bad)
        assert e.value.argument == "verify_timeout"
    for wrong in ("5", True):
        with pytest.raises(InvalidArgumentTypeError, match="timeout is a number"):
            Forward(EVAL_MODEL, process=True, timeout=wrong)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="verify_timeout is for"):
        CheckpointManager(tmp_path, verify_after_save=True, verify_timeout=5)
    assert list(tmp_path.iterdir()) == []


def test_interrupting_a_save_kills_its_child(tmp_path: Path, mark: Path) -> None:
    # Ctrl-C reaches the training script, not the child (a session of its own): the save must kill it.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where this test runs with it ignored
        import child_checks
        from goldens import ARTIFACTS, EVAL_MODEL
        from ortckpt import CheckpointManager, CheckpointState, Forward
        forward = Forward(EVAL_MODEL, check=child_checks.sleeps, process=True)
        with CheckpointManager({str(tmp_path / "run")!r}, validate=forward) as manager:
            manager.save(CheckpointState.load_checkpoint(ARTIFACTS / "checkpoint"), 1)
        """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), *sys.path])}
    training = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + NO_HANG
    while not (mark.exists() and mark.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mark.read_text().strip(), "the check never started"
    training.send_signal(signal.SIGINT)
    _, stderr = training.communicate(timeout=NO_HANG)
    assert training.returncode != 0 and b"KeyboardInterrupt" in stderr
    assert_nothing_left()


@pytest.mark.parametrize("check", ["sleeps", "starts_a_helper_and_sleeps"])
def test_a_check_never_outlives_its_trainer_killed_outright(tmp_path: Path, mark: Path, check: str) -> None:
    # SIGKILL: no finally runs in the trainer, so the child (a session of its own) must notice by itself.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import child_checks
        from goldens import ARTIFACTS, EVAL_MODEL
        from ortckpt import CheckpointManager, CheckpointState, Forward
        forward = Forward(EVAL_MODEL, check=child_checks.{check}, process=True)
        with CheckpointManager({str(tmp_path / "run")!r}, validate=forward) as manager:
            manager.save(CheckpointState.load_checkpoint(ARTIFACTS / "checkpoint"), 1)
        """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), *sys.path])}
    training = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + NO_HANG
    while len(mark.read_text().split() if mark.exists() else []) < (2 if "helper" in check else 1):
        assert time.monotonic() < deadline, "the check never started"
        time.sleep(0.1)
    training.kill()
    training.communicate(timeout=NO_HANG)
    assert_nothing_left()


# --- 4. a child that dies ---


@pytest.mark.parametrize(
    ("check", "how"),
    [
        (child_checks.kills_itself, r"was killed by signal SIGKILL without giving a verdict"),
        (child_checks.segfaults, r"killed by signal SIGSEGV without giving a verdict; its last output: .*address 0"),
        (child_checks.exits_quietly, r"exited with status 0 without giving a verdict"),
        (child_checks.exits_with_3, r"exited with status 3 without giving a verdict; its last output: giving up"),
        (child_checks.raises_system_exit, r"the validation process failed: SystemExit: 0"),
    ],
)
def test_a_child_that_dies_is_a_refusal_naming_how(
    tmp_path: Path, mark: Path, check: Callable[[dict[str, np.ndarray]], bool], how: str
) -> None:
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL, check=check, process=True)) as manager:
        start = time.monotonic()
        with pytest.raises(CheckpointIntegrityError) as e:
            manager.save(trained(), 1)
        assert time.monotonic() - start < NO_HANG
        assert not isinstance(e.value, ValidationTimeoutError)
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith("the validation process ")
        assert re.search(how, e.value.problems[0]), e.value.problems
        assert committed(manager) == []
    assert_nothing_left()


# --- 3. the child imports what the parent imported ---

# The training script of a project that vendors ortckpt (and keeps its checks in a folder of its
# own), reached only through sys.path: run with PYTHONPATH unset.
TRAIN = """
import os, sys
{setup}
import ortckpt, mychecks
from ortckpt import CheckpointManager, CheckpointState, Forward
{after_import}
state = CheckpointState.load_checkpoint({checkpoint!r})
forward = Forward({eval_model!r}, check=mychecks.passes, process=True)
with CheckpointManager({run!r}, verify_after_save="process", validate=forward) as manager:
    manager.save(state, 1)
    print("committed", [c.step for c in manager.all()])
"""

SETUPS = {
    # sys.path entries made at run time, absolute: the plain vendored case
    "absolute": ("sys.path[:0] = [{vendor!r}, {checks!r}, {extras!r}]", ""),
    # relative entries, and a script that then moves to its output folder
    "relative, then chdir": ("sys.path[:0] = ['vendor', 'checks', 'extras']", "os.chdir({run_parent!r})"),
    # entries dropped once imported
    "removed after import": ("sys.path[:0] = [{vendor!r}, {checks!r}, {extras!r}]", "del sys.path[:2]"),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("pathsep_in_name", [False, True])
def test_the_child_imports_the_ortckpt_and_check_the_parent_imported(
    tmp_path: Path, setup: str, pathsep_in_name: bool
) -> None:
    project = tmp_path / (f"my{os.pathsep}project" if pathsep_in_name else "project")
    vendor, checks, extras = project / "vendor", project / "checks", project / "extras"
    shutil.copytree(Path(ortckpt.__file__).parent, vendor / "ortckpt", ignore=shutil.ignore_patterns("__pycache__"))
    # Each import of this copy of ortckpt says so: the log proves which ortckpt every process ran.
    imports = tmp_path / "imports.log"
    with open(vendor / "ortckpt" / "__init__.py", "a") as f:
        f.write(f"\nwith open({str(imports)!r}, 'a') as _log:\n    _log.write(__file__ + '\\n')\n")
    checks.mkdir()
    # The check's module imports a sibling; the check, when called, a module of a folder nothing was
    # imported from before.
    (checks / "mychecks.py").write_text(
        "import mylimits\n\ndef passes(outputs):\n    import mythreshold\n    return mythreshold.OK and mylimits.OK\n"
    )
    (checks / "mylimits.py").write_text("OK = True\n")
    extras.mkdir()
    (extras / "mythreshold.py").write_text("OK = True\n")
    run = tmp_path / "out" / "run"
    run.parent.mkdir()
    setup_code, after_import = SETUPS[setup]
    names = {"vendor": str(vendor), "checks": str(checks), "extras": str(extras), "run_parent": str(run.parent)}
    script = project / "train.py"
    script.write_text(
        TRAIN.format(
            setup=setup_code.format(**names),
            after_import=after_import.format(**names),
            checkpoint=str(ARTIFACTS / "checkpoint"),
            eval_model=str(EVAL_MODEL),
            run=str(run),
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "committed [1]"
    # This process, the verification child and the validation child: each ran the vendored copy.
    assert imports.read_text().splitlines() == [str(vendor / "ortckpt" / "__init__.py")] * 3


def test_a_check_in_the_script_being_run_is_refused_at_once(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        from ortckpt import Forward
        def passes(outputs):
            return True
        Forward({str(EVAL_MODEL)!r}, check=passes, process=True)
        """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "TypeError: Forward(process=True) sends check to a fresh process" in done.stderr
    assert "define check in a module of its own" in done.stderr
