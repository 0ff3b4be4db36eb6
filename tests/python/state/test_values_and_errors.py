"""Silent wrong values and unclear errors (issue 15, findings 9 and 10): values the format cannot
hold are refused with a typed error at save() (never saved as something else, never only in a
background thread); non-finite metrics round-trip and rank; the command reports every failure in
one line with its documented exit code; a failed async save is never silently lost."""

from __future__ import annotations

import math
import re
import sys

import numpy as np
import ortckpt
import pytest
from ortckpt import (
    CheckpointFormatError,
    CheckpointManager,
    CheckpointState,
    CheckpointStateError,
    UnsupportedDataTypeError,
    ValueOverflowError,
)
from surrogates import PLACES, SURROGATE, no_bare_unicode_error, surrogate_in

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python

# --- finding 9: values --------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1.5, None, {"k": 1}], [b"ok", 3], ["a", 1.5]])
def test_an_object_array_of_non_strings_is_refused_naming_the_tensor(values):
    array = np.empty(len(values), dtype=object)
    array[:] = values
    with pytest.raises(UnsupportedDataTypeError, match="vocab"):
        CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"vocab": array})


def test_an_object_array_changed_to_non_strings_after_intake_is_refused_at_save(tmp_path):
    vocab = np.array(["a", "b"], dtype=object)
    state = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"vocab": vocab})
    vocab[1] = 7
    with pytest.raises(UnsupportedDataTypeError, match="vocab"):
        CheckpointState.save_checkpoint(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_non_utf8_bytes_are_a_typed_error_at_save(tmp_path, async_save):
    with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
        CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"raw": np.array([b"ok", b"\xff\xfe"])})
    raw = np.array([b"ok", b"ab"])
    state = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"raw": raw})
    raw[1] = b"\xff\xfe"  # changed after intake: refused at save
    with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
        CheckpointState.save_checkpoint(state, tmp_path / "ck")
    with CheckpointManager(tmp_path / "run", async_save=async_save) as manager:
        with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
            manager.save(state, 1)  # in the caller's thread, not at wait()
        manager.wait()
        assert manager.all_steps() == []


def test_utf8_bytes_and_str_still_save_as_strings(tmp_path):
    state = CheckpointState.from_arrays(
        {"w": np.ones(2, np.float32)}, {"raw": np.array(["é".encode(), b"x"]), "words": np.array(["a", "b"])}
    )
    CheckpointState.save_checkpoint(state, tmp_path / "ck")
    loaded = CheckpointState.load_checkpoint(tmp_path / "ck")
    assert loaded.parameters["raw"].data.tolist() == ["é", "x"]
    assert loaded.parameters["words"].data.tolist() == ["a", "b"]


def test_non_str_parameter_names_are_refused_by_from_arrays():
    with pytest.raises(TypeError, match="names are str"):
        CheckpointState.from_arrays({1: np.ones(2, np.float32)})
    with pytest.raises(TypeError, match="names are str"):
        CheckpointState.from_arrays({}, {("a",): np.ones(2, np.float32)})


# --- finding 10: errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("missing", "call", "install"),
    [
        (("obstore", "obstore.store"), lambda d: ortckpt.load_checkpoint("s3://bucket/key"), "ortckpt[s3]"),
        (("zstandard",), lambda d: ortckpt.CheckpointManager(d / "run", compress_kept=True), "ortckpt[compress]"),
        (("tqdm", "tqdm.auto"), lambda d: ortckpt.CheckpointManager(d / "run", progress=True), "ortckpt[progress]"),
    ],
)
def test_a_missing_optional_package_names_what_to_install_at_once(monkeypatch, tmp_path, missing, call, install):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # (an import of it fails as if it were not installed)
    with pytest.raises(ImportError, match=rf"needs {missing[0]}: pip install '{re.escape(install)}'"):
        call(tmp_path)
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_a_file_that_is_no_checkpoint_is_named_for_what_it_seems_to_be(tmp_path):
    import ortckpt.compression
    from goldens import EVAL_MODEL
    from safetensors.numpy import save_file

    state = CheckpointState.from_arrays({"w": np.ones(1000, np.float32)})
    CheckpointState.save_checkpoint(state, tmp_path / "whole.ckpt")
    whole = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    ortckpt.compression.compress(tmp_path / "whole.ckpt", tmp_path / "compressed.zst")
    save_file({"w": np.ones(4, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "zeros.ckpt").write_bytes(bytes(8192))
    for name, says in (
        (EVAL_MODEL, "it looks like an ONNX model"),
        (tmp_path / "compressed.zst", "it is a compressed checkpoint (a manager's compress_kept)"),
        (tmp_path / "model.safetensors", "it looks like a safetensors file"),
        (tmp_path / "zeros.ckpt", "its first bytes are all zero"),
        (tmp_path / "truncated.ckpt", f"the file ends at byte {len(whole) // 2}, before the end of what it records"),
    ):
        with pytest.raises(CheckpointFormatError, match=re.escape(says)) as e:
            CheckpointState.load_checkpoint(name)
        assert str(e.value).startswith(str(name)), e.value


INF, NAN = math.inf, math.nan


def state() -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.arange(4, dtype=np.float32)})


@pytest.mark.parametrize("where", PLACES)
def test_a_lone_surrogate_in_a_state_is_refused_at_save_checkpoint_naming_the_file(tmp_path, where):
    with pytest.raises(CheckpointStateError, match="lone surrogate") as caught:
        CheckpointState.save_checkpoint(surrogate_in(where), tmp_path / "ck", include_optimizer_state=True)
    no_bare_unicode_error(caught.value)
    assert str(caught.value).startswith(f"{tmp_path / 'ck'}: ") and caught.value.filename == str(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_names_and_properties_with_a_lone_surrogate_are_refused_when_given():
    with pytest.raises(CheckpointStateError, match="tensor name 'a\\\\udc80b' is not text") as caught:
        CheckpointState.from_arrays({SURROGATE: np.ones(2)})
    no_bare_unicode_error(caught.value)
    assert caught.value.tensor == SURROGATE
    with pytest.raises(CheckpointStateError, match="tensor 'v': element 1 'a\\\\udc80b' is not text"):
        CheckpointState.from_arrays({}, {"v": np.array(["x", SURROGATE], dtype=object)})
    s = state()
    with pytest.raises(CheckpointStateError, match="property name 'a\\\\udc80b' is not text"):
        s.properties[SURROGATE] = 1
    with pytest.raises(CheckpointStateError, match="property 'p': value 'a\\\\udc80b' is not text"):
        s.properties["p"] = SURROGATE
    assert len(s.properties) == 0


def test_text_past_the_basic_plane_still_saves(tmp_path):
    """Only lone surrogates are refused: a pair (an emoji), CJK and escapes go through."""
    name = "poids😀重み\x00"
    s = CheckpointState.from_arrays({name: np.ones(2)}, {"v": np.array(["😀", "é"], dtype=object)}, {"p": "😀"})
    with CheckpointManager(tmp_path, config={"😀": "重み"}) as manager:
        manager.save(s, 1, metadata={"😀": ["é"]})
    back = CheckpointManager(tmp_path, read_only=True)
    assert back.latest().metadata["user"] == {"😀": ["é"]} and back.latest().metadata["config"] == {"😀": "重み"}
    restored = back.restore()
    assert name in restored.parameters and restored.properties["p"] == "😀"


def test_property_values_that_do_not_fit_are_refused_and_non_finite_ones_round_trip(tmp_path):
    s = state()
    for value in (1e39, -1e300, np.float64(3.5e38)):
        with pytest.raises(ValueOverflowError, match="does not fit in float32"):
            s.properties["x"] = value
    with pytest.raises(OverflowError, match="does not fit in int64"):  # (a ValueOverflowError)
        s.properties["x"] = 2**63
    for name, value in (("inf", INF), ("minus", -INF), ("nan", NAN), ("max", float(np.finfo(np.float32).max))):
        s.properties[name] = value
    CheckpointState.save_checkpoint(s, tmp_path / "ck")
    back = CheckpointState.load_checkpoint(tmp_path / "ck").properties
    assert back["inf"] == INF and back["minus"] == -INF and math.isnan(back["nan"])
    assert back["max"] == float(np.finfo(np.float32).max)
