"""The malformed-file corpus (tests/data/malformed, built by tests/malformed_corpus.rs)
through the Python API: each file raises its typed exception naming the file (and
the tensor, where one is at fault), or, where the format cannot tell, loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ortckpt import CheckpointState
from ortckpt.errors import CheckpointFormatError, UnsupportedDataTypeError

CORPUS = Path(__file__).resolve().parents[2] / "data" / "malformed"
CASES = json.loads((CORPUS / "expected.json").read_text())


def test_the_corpus_covers_what_the_hardening_issue_lists():
    names = {c["file"].removesuffix(".ckpt") for c in CASES}
    for required in (
        "truncated_mid_metadata",
        "bitflip_root_vtable",
        "bitflip_in_values",
        "wrong_identifier",
        "version_3",
        "no_requires_grad_params",
        "negative_dim",
        "dims_overflow_count",
        "bytes_disagree_with_dims",
        "external_past_end",
        "external_overlapping",
        "external_data_missing",
        "absurd_vector_length",
        "dag_bomb",
    ):
        assert required in names
    assert len(CASES) >= 38


@pytest.mark.parametrize("case", CASES, ids=[c["file"] for c in CASES])
def test_each_file_gives_its_typed_error(case, tmp_path):
    path = CORPUS / case["file"]
    expect = case["expect"]
    if expect == "loads":
        # The one such case flips a bit inside the valid base checkpoint's tensor bytes.
        state = CheckpointState.load_checkpoint(path)
        assert sorted(state.parameters.names()) == ["layer.bias", "layer.weight"]
        assert state.parameters["layer.weight"].data.shape == (4, 6)
        return
    if expect == "not_found":
        with pytest.raises(FileNotFoundError) as caught:
            CheckpointState.load_checkpoint(path)
        assert caught.value.filename == str(path) + ".data"
        return
    cls = UnsupportedDataTypeError if expect == "unsupported_data_type" else CheckpointFormatError
    with pytest.raises(cls) as caught:
        CheckpointState.load_checkpoint(path)
    error = caught.value
    assert isinstance(error, RuntimeError)  # what ONNX Runtime raises, so old handlers still catch it
    assert error.filename in (str(path), str(path) + ".data")
    assert case["message_contains"] in str(error)
    if case["tensor"] is not None:
        assert error.tensor == case["tensor"]
