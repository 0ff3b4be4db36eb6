"""Checkpoint arithmetic (issue 16): average is NumPy's weighted mean, streamed or not, in a few chunks of memory;
what it refuses; delta, apply and interpolate and their commands; a full disk mid-average leaves the previous
result."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt.arithmetic
import pytest
from ortckpt import CheckpointState
from ortckpt.cli import run as cli
from ortckpt.compare import compare
from ortckpt.errors import CheckpointStateError


def device(tmp_path: Path, i: int, *, samples: int | None = None, **changes) -> Path:
    rng = np.random.default_rng(i)
    trainable = {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "h": rng.standard_normal(70).astype(ml_dtypes.bfloat16),
        "count": np.arange(3),
    }
    frozen = {"emb": np.linspace(0, 1, 10, dtype=np.float32)}
    for key, value in changes.items():
        (frozen if key in frozen else trainable)[key] = value
    properties = {"round": 3} if samples is None else {"round": 3, "num_samples": samples}
    path = tmp_path / f"d{i}.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(trainable, frozen, properties), path)
    return path


def test_average_is_numpys_weighted_mean_streamed_or_not(tmp_path, monkeypatch):
    paths = [device(tmp_path, i, samples=n) for i, n in enumerate((10, 30, 60))]
    xs = [CheckpointState.load_checkpoint(p) for p in paths]
    monkeypatch.setattr(ortckpt.arithmetic, "CHUNK", 1000)  # several chunks per tensor
    in_memory = ortckpt.average(paths)  # weights: num_samples
    streamed = ortckpt.average(paths, out=tmp_path / "avg.ckpt")
    assert compare(in_memory, streamed).identical
    w = [10, 30, 60]
    expected = np.average(np.stack([x.parameters["w"].data for x in xs]).astype(np.float64), axis=0, weights=w)
    assert np.array_equal(streamed.parameters["w"].data, expected.astype(np.float32))
    # bfloat16 accumulates in float32, rounded once
    h = [x.parameters["h"].data.astype(np.float32) for x in xs]
    mean = h[0] * np.float32(10) + h[1] * np.float32(30)
    mean += h[2] * np.float32(60)
    assert np.array_equal(streamed.parameters["h"].data, (mean / np.float32(100)).astype(ml_dtypes.bfloat16))
    assert np.array_equal(streamed.parameters["count"].data, [0, 1, 2])  # integers copied, never averaged
    assert dict(streamed.properties) == {"round": 3, "num_samples": 100}
    equal = ortckpt.average(paths, [1, 1, 1])
    assert np.allclose(equal.parameters["w"].data, np.mean([x.parameters["w"].data for x in xs], axis=0))
    # external data and a state given in memory work the same
    ext = ortckpt.average([xs[0], *paths[1:]], out=tmp_path / "ext.ckpt", external_data_threshold=0)
    assert (tmp_path / "ext.ckpt.data").exists() and compare(ext, streamed).identical


def test_what_average_refuses(tmp_path):
    a = device(tmp_path, 1)
    with pytest.raises(CheckpointStateError, match=r"count differs .* INT64 tensor is never combined"):
        ortckpt.average([a, device(tmp_path, 2, count=np.arange(1, 4))])
    frozen_b = device(tmp_path, 3, emb=np.zeros(10, np.float32))
    with pytest.raises(CheckpointStateError, match=r"emb differs .*frozen='first'"):
        ortckpt.average([a, frozen_b])
    taken = ortckpt.average([a, frozen_b], frozen="first")
    assert np.array_equal(taken.parameters["emb"].data, CheckpointState.load_checkpoint(a).parameters["emb"].data)
    with pytest.raises(CheckpointStateError, match=r"tensor w is FLOAT \[64, 33\] in checkpoint #0 .* FLOAT \[2\]"):
        ortckpt.average([a, device(tmp_path, 4, w=np.ones(2, np.float32))])
    with pytest.raises(CheckpointStateError, match="does not hold the same tensors"):
        ortckpt.average([a, device(tmp_path, 5, extra=np.ones(2, np.float32))])
    for weights in ([1.0], [1.0, -1.0], [0.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(CheckpointStateError, match="weights"):
            ortckpt.average([a, device(tmp_path, 6)], weights)
    before = tmp_path / "kept.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": np.ones(1, np.float32)}), before)
    with pytest.raises(CheckpointStateError):
        ortckpt.average([a, device(tmp_path, 2, count=np.arange(1, 4))], out=before)
    assert CheckpointState.load_checkpoint(before).parameters.names() == ["w"]  # a refused result writes nothing
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_delta_apply_interpolate_and_their_commands(tmp_path):
    a, b = device(tmp_path, 1), device(tmp_path, 2)
    sa, sb = CheckpointState.load_checkpoint(a), CheckpointState.load_checkpoint(b)
    d = ortckpt.delta(b, a)
    assert np.array_equal(
        d.parameters["w"].data,
        (sb.parameters["w"].data.astype(np.float64) - sa.parameters["w"].data).astype(np.float32),
    )
    back = ortckpt.apply(a, d)
    np.testing.assert_allclose(back.parameters["w"].data, sb.parameters["w"].data, atol=1e-6)
    assert np.array_equal(ortckpt.interpolate(a, b, 0.0).parameters["w"].data, sa.parameters["w"].data)
    assert np.array_equal(ortckpt.interpolate(a, b, 1.0).parameters["w"].data, sb.parameters["w"].data)
    half = ortckpt.interpolate(a, b, 0.5).parameters["w"].data
    assert np.array_equal(half, ortckpt.average([a, b]).parameters["w"].data)

    assert cli(["delta", str(b), str(a), str(tmp_path / "d.ckpt")]) == 0
    assert cli(["apply", str(a), str(tmp_path / "d.ckpt"), str(tmp_path / "b2.ckpt"), "--scale", "0.5"]) == 0
    half_step = CheckpointState.load_checkpoint(tmp_path / "b2.ckpt").parameters["w"].data
    assert np.array_equal(half_step, ortckpt.apply(a, d, 0.5).parameters["w"].data)
    assert cli(["average", str(a), str(b), "-o", str(tmp_path / "avg.ckpt"), "--weights", "1,x"]) == 2
    assert cli(["average", str(a), str(b), "-o", str(tmp_path / "avg.ckpt"), "--weights", "1,3"]) == 0
    assert compare(CheckpointState.load_checkpoint(tmp_path / "avg.ckpt"), ortckpt.average([a, b], [1, 3])).identical


STREAMING_RSS = textwrap.dedent(
    """
    import sys
    import ortckpt
    def peak():  # VmHWM: unlike ru_maxrss, it does not carry the parent's peak across exec
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    paths, out = sys.argv[1:-1], sys.argv[-1]
    before = peak()
    ortckpt.average(paths, out=out)
    print(peak() - before)
    """
)


def test_streaming_average_uses_a_few_chunks_of_memory_not_the_checkpoints(tmp_path):
    """Four checkpoints of 96 MiB: averaging them with out= grows the peak RSS by a few chunks
    (the sources' pages are dropped once used), not by the 384 MiB they hold."""
    paths = []
    for i in range(4):
        w = np.full((3, 8 << 20), i + 0.5, np.float32)  # 3 tensors of 32 MiB
        state = CheckpointState.from_arrays({f"w{j}": w[j] for j in range(3)})
        CheckpointState.save_checkpoint(state, tmp_path / f"s{i}.ckpt")
        paths.append(str(tmp_path / f"s{i}.ckpt"))
        del w, state
    done = subprocess.run(
        [sys.executable, "-c", STREAMING_RSS, *paths, str(tmp_path / "avg.ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    assert grown < 96 << 20, f"peak RSS grew by {grown >> 20} MiB"  # less than one source holds
    result = CheckpointState.load_checkpoint(tmp_path / "avg.ckpt")
    assert np.all(result.parameters["w1"].data == np.float32(2.0))


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    import ortckpt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    try:
        ortckpt.average(sys.argv[1:-1], out=sys.argv[-1])
    except OSError as e:
        print("refused", e.errno)
    """
)


def test_a_full_disk_mid_average_leaves_the_previous_result_and_no_staging(tmp_path):
    paths = []
    for i in range(2):
        state = CheckpointState.from_arrays({"w": np.full(1 << 20, i, np.float32)})  # 4 MiB
        CheckpointState.save_checkpoint(state, tmp_path / f"s{i}.ckpt")
        paths.append(str(tmp_path / f"s{i}.ckpt"))
    previous = tmp_path / "avg.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"old": np.ones(3, np.float32)}), previous)
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, *paths, str(previous)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.startswith("refused 27"), done.stdout + done.stderr  # EFBIG
    assert CheckpointState.load_checkpoint(previous).parameters.names() == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg.ckpt", "s0.ckpt", "s1.ckpt"]
