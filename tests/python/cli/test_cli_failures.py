"""The command's failures (issue 15, finding 10): every failure in one line naming the file, exit 3 for an
input that cannot be read, 2 for bad usage."""

from __future__ import annotations

import onnx
import ortckpt
import pytest
from onnx import TensorProto, helper
from ortckpt.cli import FAILED, USAGE, run

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


def one_line_failure(capsys, argv: list[str], code: int, *must_name: object) -> str:
    assert run([str(a) for a in argv]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for thing in must_name:
        assert str(thing) in err, (thing, err)
    return err


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["diff", "X"], ["convert", "OUT"], ["nominal", "OUT"]])
def test_a_missing_input_is_exit_3_naming_the_file(tmp_path, capsys, command):
    missing = tmp_path / "missing.ckpt"
    args = [str(missing) if a == "X" else str(tmp_path / "out") if a == "OUT" else a for a in command[1:]]
    one_line_failure(capsys, [command[0], missing, *args], FAILED, missing)


def test_a_directory_as_input_is_exit_3(tmp_path, capsys):
    one_line_failure(capsys, ["inspect", tmp_path], FAILED, tmp_path)


def test_bad_usage_is_still_exit_2(capsys):
    assert run(["inspect"]) == USAGE
    assert run(["no-such-command"]) == USAGE
    capsys.readouterr()


def test_an_onnx_model_whose_external_data_onnx_refuses_is_one_line(tmp_path, capsys):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    weight.data_location = TensorProto.EXTERNAL
    del weight.float_data[:]
    weight.external_data.add(key="location", value="../../etc/passwd")
    weight.external_data.add(key="length", value="8")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [weight],
    )
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(graph), path)
    one_line_failure(capsys, ["inspect", path], FAILED, path)
    one_line_failure(capsys, ["convert", path, tmp_path / "out.ckpt"], FAILED, path)


def test_verify_of_a_text_file_names_it_once(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(ortckpt.CheckpointIntegrityError) as e:
        ortckpt.verify(text)
    assert len(e.value.problems) == 1 and e.value.problems[0].count(str(text)) == 1, e.value.problems
    assert run(["verify", str(text)]) == 1
    err = capsys.readouterr().err
    assert err.count(str(text)) == 2, err  # the FAILED line and the problem
