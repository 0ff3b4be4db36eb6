"""ortckpt inside ONNX Runtime's own training loop (onnxruntime-training-cpu 1.19.2's Module,
Optimizer and LinearLRScheduler): swapping the CheckpointState import line is the whole migration,
and the manager saves the state a Module trains, ONNX Runtime's own state object included.

The loops run in ONNX Runtime's virtualenv with ortckpt installed (the ``ort_loop_python``
fixture; tests/interop/torch_stub stands in for torch, which onnxruntime.training imports and
these loops never call). Their files are compared here, decoded by ortckpt: every parameter,
moment, step, learning rate and property byte for byte. Run once (not per interpreter): the
loops run on ONNX Runtime's interpreter whichever runs pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointState, verify

pytestmark = pytest.mark.once

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python" / "helpers"))  # the documentation's examples, by name
sys.path.insert(0, str(HERE))  # preempt_trials
from preempt_trials import loop_environment, loop_interpreter  # noqa: E402
from readme_blocks import block  # noqa: E402

ARTIFACTS = HERE.parent / "data" / "ort-vectors" / "artifacts"
SWAP_FROM = "from onnxruntime.training.api import CheckpointState\n"
SWAP_TO = "from ortckpt import CheckpointState\n"


def run_loop(
    python: str,
    script: Path | str,
    *args: object,
    timeout: float = 300,
    tmpdir: Path | None = None,
    fresh: bool = False,
) -> dict:
    """``python script args`` in a child of the warm interpreter (preempt_trials.loop_interpreter), or in
    an interpreter of its own when ``fresh``; its last line of stdout as JSON."""
    environment = loop_environment()
    if tmpdir is not None:
        environment["TMPDIR"] = str(tmpdir)
    argv = [str(script), *map(str, args)]
    if fresh:
        done = subprocess.run(
            [python, *argv], capture_output=True, text=True, timeout=timeout, env=environment, check=False
        )
    else:
        done = loop_interpreter(python).run(argv, env=environment, timeout=timeout)
    assert done.returncode == 0, f"{script} {args} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_checkpoint(a: Path, b: Path, *, optimizer: bool = True, properties_but: tuple[str, ...] = ()) -> None:
    """Every parameter (trainable and frozen), moment, step, learning rate and property of ``a``
    equals ``b``'s, byte for byte."""
    x, y = CheckpointState.load_checkpoint(a), CheckpointState.load_checkpoint(b)
    xs, ys = dict(x.parameters), dict(y.parameters)
    assert sorted(xs) == sorted(ys)
    for name in xs:
        assert xs[name].requires_grad == ys[name].requires_grad, name
        assert xs[name].data.dtype == ys[name].data.dtype and xs[name].data.shape == ys[name].data.shape, name
        assert xs[name].data.tobytes() == ys[name].data.tobytes(), name
    xp = {k: v for k, v in x.properties if k not in properties_but}
    yp = {k: v for k, v in y.properties if k not in properties_but}
    assert xp == yp
    xg, yg = x.optimizer_groups, y.optimizer_groups
    if not optimizer:
        assert xg == {} and yg == {}
        return
    assert sorted(xg) == sorted(yg) and xg, "both hold an optimizer state"
    for group in xg:
        assert (xg[group].step, xg[group].initial_learning_rate) == (yg[group].step, yg[group].initial_learning_rate)
        assert sorted(xg[group].momentums) == sorted(yg[group].momentums)
        for parameter, moments in xg[group].momentums.items():
            assert sorted(moments) == sorted(yg[group].momentums[parameter])
            for moment, value in moments.items():
                other = yg[group].momentums[parameter][moment]
                assert np.asarray(value).tobytes() == np.asarray(other).tobytes(), (parameter, moment)


def test_the_same_script_with_the_import_swapped_trains_saves_and_resumes_bit_identically(
    ort_loop_python: str, tmp_path: Path
) -> None:
    original = (HERE / "ort_training_script.py").read_text()
    assert original.count(SWAP_FROM) == 1
    scripts = {"onnxruntime": original, "ortckpt": original.replace(SWAP_FROM, SWAP_TO)}
    reports = {}
    for kind, text in scripts.items():
        (tmp_path / kind).mkdir()
        script = tmp_path / f"train_with_{kind}.py"
        script.write_text(text)
        # (each in an interpreter of its own, as the user who swaps the line runs it)
        reports[kind] = run_loop(ort_loop_python, script, ARTIFACTS, tmp_path / kind, fresh=True)
    # The same losses, learning rates, and the same values seen through state.parameters and
    # state.properties while the Module trains; gradients shown as ONNX Runtime shows them.
    assert reports["ortckpt"] == reports["onnxruntime"]
    report = reports["ortckpt"]
    assert len(report["losses"]) == 7 and len(set(report["losses"])) == 7
    assert report["requires_grad"] == {"0.bias": True, "0.weight": True, "2.bias": False, "2.weight": True}
    assert report["grads"][0] == report["requires_grad"]
    assert report["resumed_properties"] == {"best_accuracy": 0.875, "epoch": 4, "run": "swap"}
    # The files: byte-identical values, whoever saved them; ortckpt's carry its checksums (so
    # ortckpt did save them), ONNX Runtime's do not.
    for name, optimizer in (("a.ckpt", True), ("a_params.ckpt", False), ("b.ckpt", True)):
        ours, theirs = tmp_path / "ortckpt" / name, tmp_path / "onnxruntime" / name
        assert_same_checkpoint(ours, theirs, optimizer=optimizer)
        assert verify(ours).checksums and not verify(theirs).checksums


def test_what_the_state_shows_and_takes_while_a_module_trains_it(ort_loop_python: str, tmp_path: Path) -> None:
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "live_api", ARTIFACTS, tmp_path)
    assert report["repr_before"] == "CheckpointState(parameters=4, properties=0, optimizer_groups=[])"
    assert report["grad_before"] and report["same_inner"]
    assert report["repr_live"] == "CheckpointState(parameters=4, properties=0, onnxruntime)"
    assert report["view_is_ort"] and report["trained"] and report["old_view_kept"]
    assert report["grads"] == {"0.bias": True, "0.weight": True, "2.bias": False, "2.weight": True}
    assert report["grad_is_ort"]
    assert report["set_item_reaches_ort"] and report["set_data_reaches_ort"]
    assert report["wrong_shape"] == "Parameter 0.weight: shape mismatch: expected (16, 8), got (8, 16)"
    expected = {"epoch": 5, "from_ort": "yes", "ratio": float(np.float32(0.1))}
    assert report["properties_in_ort"] == expected and report["properties"] == expected and report["has_from_ort"]
    assert report["groups_equal_ort"] == {"group0": {"step": True, "lr": True, "moments": True}}
    assert report["step"] == 2
    assert "is its Optimizer's" in report["set_groups"]
    # In the state's own order (the file's), as before ONNX Runtime had it.
    assert [r[0] for r in report["records"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [r[3] for r in report["records"]] == [True, True, True, False]
    assert report["to_bytes_loads"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert report["external_bound"]


def test_the_three_backings_show_and_save_the_same(ort_loop_python: str, tmp_path: Path) -> None:
    """One checkpoint as arrays, as the mapped file, and as ONNX Runtime's live state (bound from
    ortckpt's, and ONNX Runtime's own adopted): the same parameters, properties, optimizer groups,
    records and keyed tensors through the public API, and the same once saved and loaded."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "backings_alike", ARTIFACTS, tmp_path)
    assert report.pop("one_binding")  # four threads binding one state at once got one ORT state
    kinds = ("arrays", "mapped", "bound", "adopted", "raced")
    assert [report[k]["live"] for k in kinds] == [False, False, True, True, True]
    reference = report["mapped"]["shown"]
    assert reference["groups"]["group0"][0] == 3 and reference["properties"] == {"epoch": 2, "note": "alike"}
    assert len(reference["tensors"]) == 4 + 2 * 3  # four parameters, two moments of the three trainable
    for kind, seen in report.items():
        assert seen["shown"] == reference, kind
        assert seen["saved"] == reference, kind
    for kind in ("arrays", "bound", "adopted", "raced"):
        assert_same_checkpoint(tmp_path / f"{kind}.ckpt", tmp_path / "mapped.ckpt")


def test_onnx_runtimes_own_state_saves_through_ortckpt_and_the_manager(ort_loop_python: str, tmp_path: Path) -> None:
    run_loop(ort_loop_python, HERE / "ort_loop.py", "own_state", ARTIFACTS, tmp_path)
    reference = tmp_path / "ort.ckpt"  # ONNX Runtime's own save, the same moment
    assert not verify(reference).checksums
    for name in ("ortckpt.ckpt", "ortckpt_inner.ckpt"):
        assert_same_checkpoint(tmp_path / name, reference)
        assert verify(tmp_path / name).checksums
    assert_same_checkpoint(tmp_path / "ortckpt_params.ckpt", tmp_path / "ort_params.ckpt", optimizer=False)
    # The manager's steps: the state of the moment save() was called (the async one was trained
    # on while it wrote), plus the step the manager records.
    for mode in ("sync", "async"):
        step = tmp_path / mode / "step_00000002" / "checkpoint"
        assert_same_checkpoint(step, reference, properties_but=("step",))
        assert CheckpointState.load_checkpoint(step).properties["step"] == 2


def test_a_full_save_is_onnx_runtimes_serialisation_written_into_the_staged_files_then_sealed(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """ortckpt's state and ONNX Runtime's own, loaded with and without external data: the full
    save holds what ONNX Runtime's own save of the same moment holds, in its layout (a data file
    where the state was loaded with one), sealed with ortckpt's checksums, and loads in ONNX
    Runtime; saves that fail (the saver raising, a torn file, an interrupt after the saver
    returned) commit nothing and leave the file saved before as it was."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "through_ort", ARTIFACTS, tmp_path)
    for kind in ("ortckpt", "ortckpt_external", "onnxruntime", "onnxruntime_external"):
        saved = tmp_path / f"{kind}.ckpt"
        external = kind.endswith("_external")
        assert report["files"][kind] == [f"{kind}.ckpt", f"{kind}.ckpt.data"] if external else [f"{kind}.ckpt"]
        assert_same_checkpoint(saved, tmp_path / f"{kind}_ort.ckpt")
        assert_same_checkpoint(tmp_path / f"{kind}_reloaded.ckpt", saved)
        checked = verify(saved)
        assert checked.checksums and checked.tensors > 0
        assert CheckpointState.load_checkpoint(saved).has_external_data == external
        assert (tmp_path / f"{kind}_ort.ckpt.data").exists() == external  # (ONNX Runtime's own layout)
    assert report["failures"] == {
        "torn": "CheckpointFormatError",
        "refused": "RuntimeError",
        "interrupted": "KeyboardInterrupt",
    }
    assert not [name for name in report["left"] if "ortckpt-tmp" in name or name.startswith(".")]


def test_a_full_save_grows_onnx_runtimes_buffer_in_place_in_a_forked_child_and_writes_its_bytes(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """A full save of a 12 MiB AdamW state, ortckpt's and ONNX Runtime's own: a forked child runs
    ONNX Runtime's saver with its buffer grown in place (every array of 1 MiB or more it took
    placed so: more bytes than the file), and the file is ONNX Runtime's own save of the same
    moment byte for byte, then ortckpt's seal; the same with the buffer grown as ONNX Runtime
    grows it (nothing placed), and in this process where no fork can be had or ORTCKPT_NO_FORK says
    not to."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "in_place", tmp_path)
    for kind in ("ortckpt", "onnxruntime"):
        saves = report[kind]["saves"]
        assert saves["in_place"]["forked"] and saves["in_place"]["placed"] > report[kind]["checkpoint_bytes"] > 12 << 20
        assert saves["grown_as_onnx_runtime"]["forked"] and saves["grown_as_onnx_runtime"]["placed"] == 0
        assert not saves["in_process"]["forked"] and not saves["told_not_to_fork"]["forked"]
        for how in ("in_place", "grown_as_onnx_runtime", "in_process", "told_not_to_fork"):
            assert saves[how]["onnx_runtimes_bytes_then_the_seal"] and saves[how]["verified"], (kind, how)


def test_a_signal_handlers_exception_around_a_synchronous_forked_save_leaves_no_child_and_no_temporary(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """A trainer whose SIGTERM handler raises SystemExit, signalled as the fork's signals are
    unblocked and while the parent drops the replaced file's cache: the SystemExit comes out of
    the save, the child is killed and reaped (no process of it left, not even a zombie), no
    temporary or descriptor stays, the old file stands, and the next save is ONNX Runtime's. A
    Ctrl-C while the child saves: KeyboardInterrupt before the commit, the same left."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "forked_save_signalled", ARTIFACTS, tmp_path)
    for kind, raised in (
        ("as_the_fork_unblocks_signals", "SystemExit(143)"),
        ("while_the_cache_is_dropped", "SystemExit(143)"),
        ("ctrl_c_while_the_child_saves", "KeyboardInterrupt"),
    ):
        assert report[kind] == {
            "raised": raised,
            "children": [],
            "old_file_intact": True,
            "left": ["state.ckpt"],
            "descriptors_added": 0,
        }, kind
    assert report["next_save_is_onnx_runtimes_then_the_seal"]


def test_a_manager_run_on_either_class_gives_the_same_steps(ort_loop_python: str, tmp_path: Path) -> None:
    runs = {}
    for kind in ("ortckpt", "onnxruntime"):
        (tmp_path / kind).mkdir()
        arguments = ("manager_run", ARTIFACTS, tmp_path / kind, 6, kind, 0)
        runs[kind] = run_loop(ort_loop_python, HERE / "ort_loop.py", *arguments)
        assert runs[kind] == {"resumed_from": None, "steps": [4, 5, 6]}
    for name in ("run/step_00000005/checkpoint", "run/step_00000006/checkpoint", "final.ckpt"):
        assert_same_checkpoint(tmp_path / "ortckpt" / name, tmp_path / "onnxruntime" / name)


@pytest.mark.parametrize("kind", ["ortckpt", "onnxruntime"])
def test_a_resumed_runs_final_file_is_the_uninterrupted_runs_byte_for_byte(
    ort_loop_python: str, tmp_path: Path, kind: str
) -> None:
    """The stale step: a run resumed at step 3 (its state carries the restored step 3) and
    trained to 6, then saved by ONNX Runtime's own save_checkpoint, writes what the uninterrupted
    run writes: the manager's saves set step on the state, ONNX Runtime's own object included."""
    for name, stops in (("whole", (6,)), ("resumed", (3, 6))):
        (tmp_path / name).mkdir()
        for steps in stops:
            run_loop(ort_loop_python, HERE / "ort_loop.py", "manager_run", ARTIFACTS, tmp_path / name, steps, kind, 0)
    final = (tmp_path / "resumed" / "final.ckpt").read_bytes()
    assert CheckpointState.load_checkpoint(tmp_path / "resumed" / "final.ckpt").properties["step"] == 6
    assert final == (tmp_path / "whole" / "final.ckpt").read_bytes()


def test_a_sigkilled_run_resumes_through_restore_to_the_uninterrupted_runs_state(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """Async saves of the state a Module trains, a SIGKILL at a random moment of the run (during a
    save, a step, between them), resumed from the manager's latest step each time: the end state
    is the uninterrupted run's, byte for byte."""
    steps = 30
    reference = tmp_path / "reference"
    reference.mkdir()
    run_loop(ort_loop_python, HERE / "ort_loop.py", "manager_run", ARTIFACTS, reference, steps, "ortckpt", 1)

    killed = tmp_path / "killed"
    killed.mkdir()
    rng = random.Random(31)
    kills = resumes = 0
    command = [str(HERE / "ort_loop.py"), "manager_run", str(ARTIFACTS), str(killed), str(steps)]
    for _attempt in range(60):
        # Paced: after each "saved N" the run waits for our line, so each kill lands where drawn (in the
        # next step, or while the save runs in the background thread), not wherever a busy machine lets
        # this reader catch up with the run.
        child = loop_interpreter(ort_loop_python).popen(
            [*command, "ortckpt", "1", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=loop_environment(),
        )
        assert child.stdin is not None and child.stderr is not None and child.stdout is not None
        saves_before_kill = rng.randrange(0, 4)
        finished = True
        seen = 0
        lines = []
        for line in child.stderr:
            lines.append(line)
            if line.startswith("saved "):
                seen += 1
                child.stdin.write("go\n")
                child.stdin.flush()
                if seen > saves_before_kill:
                    finished = False
                    break
        if not finished:
            signal_delay = rng.choice([0, 0, 1e-4, 5e-4, 2e-3, 2e-2])
            if signal_delay:
                time.sleep(signal_delay)
            child.send_signal(signal.SIGKILL)
        out = child.stdout.read()
        errors = "".join(lines) + child.stderr.read()
        child.wait(120)
        for stream in (child.stdin, child.stderr, child.stdout):
            with contextlib.suppress(BrokenPipeError):
                stream.close()
        if child.returncode == 0:
            report = json.loads(out.strip().splitlines()[-1])
            resumes += report["resumed_from"] is not None
            break
        assert child.returncode == -signal.SIGKILL, f"the run failed by itself ({child.returncode}):\n{errors[-4000:]}"
        kills += 1
    else:
        pytest.fail("the run never finished in 60 starts")
    assert kills >= 5, kills
    assert report["steps"] == [28, 29, 30]
    # Each manager save sets "step" on the state it saves, so the final file (ONNX Runtime's own
    # save after the manager's last) carries step 30, not the step the run last resumed from (issue 38).
    assert_same_checkpoint(killed / "final.ckpt", reference / "final.ckpt")
    assert (killed / "final.ckpt").read_bytes() == (reference / "final.ckpt").read_bytes()
    for step in (28, 29, 30):
        name = f"run/step_{step:08d}/checkpoint"
        assert_same_checkpoint(killed / name, reference / name)
    print(f"{kills} kills, then a run to the end", file=sys.stderr)


def test_a_nominal_checkpoint_goes_through_a_module_as_onnx_runtimes_on_device_flow_does(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """A nominal checkpoint (names and types only) handed to a Module, its values copied in with
    ``Module.copy_buffer_to_parameters``, saved, trained, saved: as with ONNX Runtime's class."""
    reports = {}
    for kind in ("ortckpt", "onnxruntime"):
        (tmp_path / kind).mkdir()
        reports[kind] = run_loop(ort_loop_python, HERE / "ort_loop.py", "nominal", ARTIFACTS, tmp_path / kind, kind)
        assert reports[kind]["weight_equal"]
    report = reports["ortckpt"]
    assert report["nominal_in_module"] and not report["nominal_after_copy"]
    assert report["read_nominal"] == (
        "Cannot get parameter 0.weight from a nominal state. Please load the parameter states first."
    )
    # The shapes are ONNX Runtime's once it has the values (the nominal file holds none).
    assert report["records"] == [
        ["0.weight", 1, [16, 8], True],
        ["0.bias", 1, [16], True],
        ["2.weight", 1, [4, 16], True],
        ["2.bias", 1, [4], False],
    ]
    ours, theirs = tmp_path / "ortckpt", tmp_path / "onnxruntime"
    assert_same_checkpoint(ours / "copied_params.ckpt", ARTIFACTS / "checkpoint", optimizer=False)
    assert_same_checkpoint(
        ours / "run/step_00000001/checkpoint", ARTIFACTS / "checkpoint", optimizer=False, properties_but=("step",)
    )
    for name, optimizer in (("copied_params.ckpt", False), ("trained.ckpt", True), ("trained_params.ckpt", False)):
        assert_same_checkpoint(ours / name, theirs / name, optimizer=optimizer)


def test_a_type_onnx_runtimes_loader_refuses_is_named_and_the_state_stays_as_it_was(ort_loop_python: str) -> None:
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "refused_types")
    for name, onnx_type in (("float16", "FLOAT16"), ("bfloat16", "BFLOAT16"), ("int4", "INT4"), ("string", "STRING")):
        kind, message, nominal, shown = report[name]
        assert kind == "UnsupportedDataTypeError"
        assert message.startswith(f"tensor {name}_weight: ONNX Runtime's Module cannot take {onnx_type} tensors")
        assert not nominal and shown == "CheckpointState(parameters=2, properties=0, optimizer_groups=[])"


def test_setting_a_parameter_whose_buffer_is_off_the_cpu_reaches_onnx_runtime(ort_loop_python: str) -> None:
    # (numpy() of a GPU buffer is a writable copy: copying into it would change nothing)
    assert run_loop(ort_loop_python, HERE / "ort_loop.py", "off_cpu", ARTIFACTS) == {"reached_ort": True}


def test_what_a_process_killed_while_binding_or_saving_leaves_is_removed_by_the_next(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """A SIGKILL while ONNX Runtime reads or writes its memory checkpoint leaves that directory
    (symlinks to memfds gone with the process) in TMPDIR: the next process to bind removes it."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    environment = dict(loop_environment(), TMPDIR=str(tmpdir))
    rng = random.Random(31)
    left: list[str] = []
    for _kill in range(20):  # (until a kill lands inside a bind or a save: most of the loop's time)
        child = loop_interpreter(ort_loop_python).popen(
            [str(HERE / "ort_loop.py"), "bind_forever"], stdout=subprocess.PIPE, env=environment
        )
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.3, 1.0))
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        child.stdout.close()
        left = [p.name for p in tmpdir.iterdir()]
        if left:
            break
    assert left and all(name.startswith("ortckpt-scratch-") for name in left), left
    assert run_loop(ort_loop_python, HERE / "ort_loop.py", "bind_once", tmpdir=tmpdir) == {"temporaries": []}
    assert list(tmpdir.iterdir()) == []


def test_bindings_and_saves_leave_no_descriptor_or_temporary_behind(ort_loop_python: str, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "leaks", ARTIFACTS, tmp_path, tmpdir=tmpdir)
    assert report["fds_after"] == report["fds_before"]
    assert report["temporaries"] == []


def test_async_manager_saves_while_the_module_trains_on_hold_the_state_of_each_save_call(
    ort_loop_python: str, tmp_path: Path
) -> None:
    run_loop(ort_loop_python, HERE / "ort_loop.py", "async_while_training", ARTIFACTS, tmp_path)
    for name, optimizer in (("full", True), ("params", False)):
        for step in (1, 2, 3):
            saved = tmp_path / name / f"step_{step:08d}" / "checkpoint"
            reference = tmp_path / f"{name}_ort_{step}.ckpt"
            assert_same_checkpoint(saved, reference, optimizer=optimizer, properties_but=("step",))


def test_a_forked_async_save_is_the_synchronous_save_of_its_instant_byte_for_byte(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """async_save="fork": the child's file is ortckpt's synchronous full save of the moment
    save() was called, byte for byte (the Module trained on while the child wrote), loads in
    ONNX Runtime, holds what ONNX Runtime's own save of that moment holds, and verifies; of
    ortckpt's state and of ONNX Runtime's own state object."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "forked_saves", ARTIFACTS, tmp_path)
    assert report["steps"] == [1, 2, 3]
    assert report["left"] == ["step_00000001", "step_00000002", "step_00000003"]  # (no temporary: closed)
    assert report["fds"][0] == report["fds"][1]  # (no descriptor left behind)
    for step in (1, 2, 3):
        saved = tmp_path / "run" / f"step_{step:08d}" / "checkpoint"
        assert saved.read_bytes() == (tmp_path / f"sync_{step}.ckpt").read_bytes()
        assert_same_checkpoint(saved, tmp_path / f"ort_{step}.ckpt")
        assert CheckpointState.load_checkpoint(saved).properties["step"] == step
        assert verify(saved).checksums
    assert_same_checkpoint(tmp_path / "reloaded_3.ckpt", tmp_path / "ort_3.ckpt")
    own = tmp_path / "own" / "step_00000001" / "checkpoint"  # (ONNX Runtime's own state object)
    assert own.read_bytes() == (tmp_path / "own_sync_1.ckpt").read_bytes()
    later = CheckpointState.load_checkpoint(tmp_path / "ort_3.ckpt").parameters
    first = CheckpointState.load_checkpoint(tmp_path / "ort_1.ckpt").parameters
    assert any(later[name].data.tobytes() != p.data.tobytes() for name, p in first)  # (it trained on)


def test_a_snapshot_taken_by_a_forked_child_is_the_state_of_each_save_call_and_falls_back_without_one(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """Manager saves (async, the Module training on at once, with and without share_unchanged and
    max_to_keep; synchronous; of ONNX Runtime's own state object) whose snapshot a forked child
    writes into memfds hold what ONNX Runtime's own save of each save() holds: no later step or
    snapshot reaches a pending save. A child hung past its deadline is killed and the save falls
    back to ONNX Runtime's save in the trainer at once (it waited for the hung child forever);
    so do a child that raises and a fork that fails; a SIGCHLD handler reaping every child
    changes nothing. Nothing is left: no descriptor, memfd, child or temporary directory, and (the
    collector off) no snapshot's mapping: a written snapshot goes with its last reference."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "forked_snapshots", ARTIFACTS, tmp_path, tmpdir=scratch)
    assert report["fell_back"] == {"hung": True, "raised": True, "forkless": True}
    before, after = report["held"]
    assert before == after == report["held_at_end"]
    assert after["memfds"] == after["mapped"] == 0 and after["children"] == [] and after["temporaries"] == []
    expected = {
        "async": [10, 11, 12],
        "async_whole": [1, 2, 3, 4],
        "sync": [1, 2, 3],
        "own": [1, 2, 3],
        "hung": [1, 2],
        "raised": [1, 2],
        "forkless": [1, 2],
        "reaped": [1, 2, 3],
        "reaped_sync": [1, 2],
    }
    for name, steps in expected.items():
        assert report[name] == steps, name
        for step in steps:
            saved = tmp_path / name / f"step_{step:08d}" / "checkpoint"
            assert_same_checkpoint(saved, tmp_path / f"ort_{name}_{step}.ckpt", properties_but=("step",))
            assert CheckpointState.load_checkpoint(saved).properties["step"] == step
    first = CheckpointState.load_checkpoint(tmp_path / "ort_async_1.ckpt").parameters
    later = CheckpointState.load_checkpoint(tmp_path / "ort_async_12.ckpt").parameters
    assert any(later[name].data.tobytes() != p.data.tobytes() for name, p in first)  # (it trained on)


def test_a_forked_save_whose_child_dies_hangs_or_raises_commits_nothing_and_the_next_save_works(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """The child SIGKILLed mid-save, hung past its deadline, or raising: ForkedSaveError (the
    hang a ForkedSaveTimeoutError at its deadline), the steps before stand, no temporary is
    left, and the next save commits. A SIGTERM and a SIGINT sent to the child (a Ctrl-C or a
    preemption notice to the process group) do not stop its save nor preempt the run."""
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "forked_failures", ARTIFACTS, tmp_path)
    lock = ".ortckpt-writer.lock"
    for kind, error, says in (
        ("killed", "ForkedSaveError", "killed by signal SIGKILL"),
        ("hung", "ForkedSaveTimeoutError", "ran past its deadline (2 s)"),
        ("raised", "ForkedSaveError", "RuntimeError: the saver failed"),
    ):
        outcome = report[kind]
        assert outcome["error"] == error, kind
        assert says in outcome["message"] and "nothing was committed" in outcome["message"], kind
        assert outcome["steps"] == [1] and outcome["left"] == [lock, "step_00000001"], kind
    assert report["hung"]["seconds"] < 30
    assert report["signalled"] == {
        "error": None,
        "steps": [1, 5],
        "left": [lock, "step_00000001", "step_00000005"],
        "preempted": False,
    }
    assert report["reaped"] == {"by_another": True, "saved": True}  # (reaped elsewhere: its pipe said it saved)
    assert verify(tmp_path / "direct.ckpt").checksums
    assert report["after"]["error"] is None and report["after"]["steps"] == [1, 5, 6]
    assert verify(tmp_path / "run" / "step_00000001" / "checkpoint").checksums
    assert_same_checkpoint(Path(report["latest"]), tmp_path / "now.ckpt", properties_but=())


def test_a_forked_saves_child_dies_with_a_trainer_killed_outright_and_frees_the_run(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """The trainer SIGKILLed while its forked save's child runs: the child goes too (it shares the
    run's writer lock, which would stay held while it lived), and the next writer opens the run."""
    from ortckpt import CheckpointManager

    process = loop_interpreter(ort_loop_python).popen(
        [str(HERE / "ort_loop.py"), "forked_orphan", str(ARTIFACTS), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=loop_environment(),
    )
    assert process.stdout is not None
    child = int(process.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    process.kill()
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    try:
        while not _exited(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exited(child), "the child outlived its trainer"
    finally:  # (a failure here leaves no child behind)
        if Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)
    with CheckpointManager(tmp_path / "run") as manager:  # (the writer lock is free)
        assert manager.all_steps() == []


def _exited(pid: int) -> bool:
    """Whether every thread of ``pid`` has exited (its descriptors, the run's lock among them, closed).
    A zombie leader is not enough: a forked save's child has a second thread (the in-place
    allocator's helper), which may still be exiting, tearing down the address space and holding the
    descriptors, while the leader shows "Z" (the run's lock then refused a writer, once in a loaded
    session)."""
    if not Path(f"/proc/{pid}").exists():
        return True
    with contextlib.suppress(OSError):
        return "Z" in _state_of(pid) and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    return not Path(f"/proc/{pid}").exists()


def _state_of(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


def test_a_memory_checkpoint_directory_swapped_in_a_hostile_tmpdir_changes_nothing(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """ONNX Runtime opens the memory checkpoint through the directory's descriptor: the swapped-in
    directory's symlinks (to a file of ours, to a checkpoint of theirs) are never followed."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    report = run_loop(ort_loop_python, HERE / "ort_loop.py", "hostile_tmpdir", tmp_path, tmpdir=tmpdir)
    assert report == {"swaps": 2, "bound": [[1, 1], [1, 1]], "saved": [[1, 1], [1, 1]], "victim": "precious\n"}


def test_a_step_folder_copied_alone_into_an_empty_directory_resumes_through_restore_training(
    ort_loop_python: str, tmp_path: Path
) -> None:
    """A run whose manager records the graphs stops after step 3 of 6; its step folder alone is
    copied into an empty directory (the run and the artifacts folder then deleted); there,
    restore_training makes ONNX Runtime's Module and Optimizer, and training on to step 6 ends
    bit-identical to the run that was never interrupted."""
    script = HERE / "ort_loop.py"
    artifacts = tmp_path / "artifacts"
    shutil.copytree(ARTIFACTS, artifacts)
    whole = run_loop(ort_loop_python, script, "graphs_run", artifacts, tmp_path / "whole", 6, 6)
    (tmp_path / "cut").mkdir()
    run_loop(ort_loop_python, script, "graphs_run", artifacts, tmp_path / "cut", 6, 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run(["cp", "-r", str(tmp_path / "cut" / "run" / "step_00000003"), str(empty)], check=True)
    shutil.rmtree(tmp_path / "cut")
    shutil.rmtree(artifacts)
    assert sorted(p.name for p in (empty / "step_00000003").iterdir()) == [
        "checkpoint",
        "eval_model.onnx",
        "metadata.json",
        "optimizer_model.onnx",
        "training_model.onnx",
    ]
    resumed = run_loop(ort_loop_python, script, "graphs_resume", empty, 6, artifacts)
    assert resumed == {
        "resumed_from": 3,
        "steps": [5, 6],
        "lr": whole["lr"],
        "classes": ["Module", "Optimizer", "ortckpt.checkpoint_state"],
        "device": "CPUExecutionProvider",
        "recorded": ["eval", "optimizer", "training"],  # the new steps carry the graphs too
    }
    # Every parameter, moment, step, learning rate and property, byte for byte: the last step's
    # checkpoint, and ONNX Runtime's own save of the live state (whose `step` property the
    # manager's saves do not set yet: the stale step of issue 38, item 5, fixed apart).
    whole_step = tmp_path / "whole" / "run" / "step_00000006"
    assert_same_checkpoint(whole_step / "checkpoint", empty / "step_00000006" / "checkpoint")
    assert_same_checkpoint(tmp_path / "whole" / "final.ckpt", empty / "final.ckpt", properties_but=("step",))


def test_the_readmes_training_loop_example_runs_and_resumes(ort_loop_python: str, tmp_path: Path) -> None:
    loop = block("ort-loop")
    shutil.copytree(ARTIFACTS, tmp_path / "artifacts")
    # The example's `batch(step)` is the user's data: here, the artifacts' x[5, 8] and target[5, 4].
    data = (
        "import numpy as np\n"
        "def batch(step):\n"
        "    rng = np.random.default_rng(step)\n"
        "    return rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)\n"
    )
    script = tmp_path / "train.py"
    script.write_text(data + loop + "print(sorted(manager.all_steps()), manager.latest_step())\n")

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ort_loop_python, str(script)],
            cwd=tmp_path,
            env=loop_environment(),
            capture_output=True,
            text=True,
            check=False,
        )

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.splitlines()[-1] == "[800, 900, 1000] 1000"
    final = CheckpointState.load_checkpoint(tmp_path / "final.ckpt")
    assert final.optimizer_groups["group0"].step == 1000 and verify(tmp_path / "final.ckpt").checksums
    # Run again: it restores step 1000 and has nothing left to train.
    again = run()
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[-1] == "[800, 900, 1000] 1000"
    assert_same_checkpoint(tmp_path / "final.ckpt", tmp_path / "runs/mlp/step_00001000/checkpoint")


def test_the_resuming_from_a_step_alone_example_resumes_elsewhere(ort_loop_python: str, tmp_path: Path) -> None:
    example = block("ort-graphs")
    shutil.copytree(ARTIFACTS, tmp_path / "artifacts")
    data = (
        "import numpy as np\n"
        "def batch(step):\n"
        "    rng = np.random.default_rng(step)\n"
        "    return rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)\n"
    )
    report = (
        "import ortckpt\n"
        "print(manager.all_steps(), type(model).__name__, type(optimizer).__name__, optimizer.get_learning_rate())\n"
        "print(state.optimizer_groups['group0'].step, state.properties['step'])\n"
    )
    script = tmp_path / "train.py"
    script.write_text(data + example + report)
    environment = loop_environment()
    done = subprocess.run(
        [ort_loop_python, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps, classes = done.stdout.splitlines()[-2:]
    assert steps.startswith("[200, 300] Module Optimizer ")
    assert classes == "300 300"  # the optimizer's step and the step property, from the copied step
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["step_00000300"]


def test_the_readmes_torch_trap_workaround_imports_the_training_api_without_torch(
    ort_loop_python: str, tmp_path: Path
) -> None:
    torch_trap = block("ort-trap-torch")
    script = tmp_path / "no_torch.py"
    script.write_text(torch_trap + "print('torch' in sys.modules, Module.__module__, artifacts.__name__)\n")
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (no torch stand-in)
    done = subprocess.run(
        [ort_loop_python, "-c", "import torch"], env=environment, capture_output=True, text=True, check=False
    )
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr, "this venv has no torch"
    done = subprocess.run(
        [ort_loop_python, "-c", "import onnxruntime.training.api"],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "No module named 'torch'" in done.stderr, "the trap: importing the training API needs torch"
    done = subprocess.run([ort_loop_python, str(script)], env=environment, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "onnxruntime.training.api.module", "onnxruntime.training.artifacts"]


def test_the_readmes_ir_version_clamp_makes_current_onnx_artifacts_load(ort_loop_python: str, tmp_path: Path) -> None:
    torch_trap, ir_trap = block("ort-trap-torch"), block("ort-trap-ir")
    make_model = textwrap.dedent(
        """
        import numpy as np
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])  # the current onnx's IR
        onnx.save(model, "model.onnx")
        print(model.ir_version)
        """
    )
    unclamped = textwrap.dedent(
        """
        try:
            artifacts.generate_artifacts(onnx.load("model.onnx"), requires_grad=["w"],
                loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW, artifact_directory="raw")
            print("generated")
        except Exception as e:
            print("refused:", str(e).strip().splitlines()[-1][-80:])
        """
    )
    try_module = textwrap.dedent(
        """
        from onnxruntime.training.api import CheckpointState, Module, Optimizer
        state = CheckpointState.load_checkpoint("artifacts/checkpoint")
        model = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
        Optimizer("artifacts/optimizer_model.onnx", model)
        print("loads")
        """
    )
    (tmp_path / "unclamped.py").write_text(torch_trap + make_model + unclamped)
    (tmp_path / "clamped.py").write_text(torch_trap + ir_trap + try_module)
    for script in ("unclamped.py", "clamped.py"):
        done = subprocess.run(
            [ort_loop_python, script], cwd=tmp_path, env=loop_environment(), capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        if script == "unclamped.py":
            ir_version, refused = done.stdout.splitlines()[-2:]
            assert int(ir_version) > 10, "a current onnx writes a newer IR than ONNX Runtime 1.19.2 reads"
            assert refused.startswith("refused:") and "IR version" in refused, refused
        else:
            assert done.stdout.splitlines()[-1] == "loads"


def test_preemption_at_random_moments(ort_loop_python: str, tmp_path: Path) -> None:
    """SIGTERM at random moments of ONNX Runtime's loop with async manager saves: each run exits
    0 with the step it was at committed and resumes to a final file byte-identical to an
    uninterrupted run's (the last trial gets a second SIGTERM soon after the first). A few
    trials here; `tests/interop/preempt_trials.py --count 100` runs many."""
    import preempt_trials

    rng = random.Random(38)
    reference = preempt_trials.reference_run(ort_loop_python, tmp_path / "reference")
    for n in range(4):
        preempt_trials.trial(ort_loop_python, tmp_path / f"trial{n}", reference, rng, second=n == 3)


def test_preemption_at_random_moments_with_forked_async_saves(ort_loop_python: str, tmp_path: Path) -> None:
    """As above with async_save="fork": the preemption save waits for the forked save pending
    (its child finishes; the signal went to the trainer only) and resumes byte-identically."""
    import preempt_trials

    rng = random.Random(380)
    reference = preempt_trials.reference_run(ort_loop_python, tmp_path / "reference", "fork")
    for n in range(3):
        preempt_trials.trial(ort_loop_python, tmp_path / f"trial{n}", reference, rng, second=n == 2, async_save="fork")


RESTORED_TO_ORT = """
import gc, json, sys
import numpy as np
import ortckpt
directory = sys.argv[1]
m = ortckpt.CheckpointManager(directory)
m.save(ortckpt.CheckpointState.from_arrays({"w": np.ones(1 << 20, np.float32)}), 1)
state = m.restore()
assert float(state.parameters["w"].data.sum()) == 1 << 20  # (its values read, through the map)
def mapped():
    return sum(1 for line in open("/proc/self/maps") if directory in line)
before = mapped()
state._state  # handed to ONNX Runtime: it holds the values now
gc.collect()
after = mapped()
m.delete(1)
m.close()
print(json.dumps({"before": before, "after": after, "w": float(state.parameters["w"].data.sum())}))
"""


def test_a_restored_state_handed_to_onnx_runtime_keeps_no_file_mapped(ort_loop_python: str, tmp_path: Path) -> None:
    # ONNX Runtime copies every value when it loads a state: the step's files, mapped for the restore, are
    # let go (a deleted step frees its space; on s3:// no unlinked copy stays in TMPDIR).
    script = tmp_path / "restored.py"
    script.write_text(RESTORED_TO_ORT)
    report = run_loop(ort_loop_python, script, tmp_path / "run")
    assert report["before"] > 0 and report["after"] == 0, report
    assert report["w"] == 1 << 20
