"""The Python examples of README.md and docs/*.md, by name.

Every ```python block follows a tag on the line before it, `<!-- test: NAME -->` (indented as the
block is, inside a list item), and RUN_BY names the test that runs it. test_readme.py holds the two
to each other: an untagged block, a tag no test claims, or a test that no longer asks for its block
by name (`block("NAME")`) fails the suite, so no example of the documentation can go unrun.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# name -> the test that runs it ("file::function"; the function calls block(name)). Examples that need
# a server or several ranks are run by the tests that start them (MLflow, S3, mpirun); those that run in
# ONNX Runtime's training loop by tests/interop/test_ort_loop.py, in ONNX Runtime's interpreter; the
# torch example by tests/torch (`make test-torch`); the Flower example by tests/flower, in flwr's venv.
HERE, LOOP, TORCH, FLOWER = (
    "tests/python/design/test_readme.py::",
    "tests/interop/test_ort_loop.py::",
    "tests/torch/test_torch_convert.py::",
    "tests/flower/test_docs.py::",
)
RUN_BY = {
    "import-line": HERE + "test_the_import_line_gives_ortckpts_class",
    "quick-start": HERE + "test_the_quick_start_runs_as_written_in_an_empty_directory",
    "ort-loop": LOOP + "test_the_readmes_training_loop_example_runs_and_resumes",
    "ort-trap-torch": LOOP + "test_the_readmes_torch_trap_workaround_imports_the_training_api_without_torch",
    "ort-trap-ir": LOOP + "test_the_readmes_ir_version_clamp_makes_current_onnx_artifacts_load",
    "manager": HERE + "test_readme_checkpoint_manager_example_runs_and_resumes",
    "graphs": HERE + "test_the_run_graphs_example_shares_the_graphs_and_a_step_copied_alone_verifies",
    "ort-graphs": LOOP + "test_the_resuming_from_a_step_alone_example_resumes_elsewhere",
    "preemption": "tests/python/manager/test_preemption.py::test_the_readmes_preemption_example_saves_where_it_was",
    "validation": HERE + "test_readme_validation_example_refuses_the_nan_step",
    "compression": HERE + "test_readme_compression_example_compresses_the_kept_steps",
    "tracking": HERE + "test_readme_tracking_example_logs_to_mlflow_and_registers_the_best",
    "sharded": HERE + "test_readme_sharded_example_runs_under_mpirun_and_resumes_on_another_world_size",
    "onnx": HERE + "test_readme_onnx_and_safetensors_examples_run",
    "safetensors": HERE + "test_readme_onnx_and_safetensors_examples_run",
    "torch": TORCH + "test_the_readme_torch_example_runs",
    "deployment": HERE + "test_readme_deployment_example_runs",
    "object-storage": HERE + "test_readme_object_storage_example_runs_against_s3",
    "looking": HERE + "test_looking_at_checkpoints_runs_in_the_quick_starts_folder",
    "report-python": HERE + "test_the_reports_python_example_writes_the_page",
    "report-mlflow": HERE + "test_the_reports_mlflow_example_uploads_each_steps_report",
    "flower": FLOWER + "test_the_flower_docs_example_runs_and_resumes",
    "flower-artifacts": FLOWER + "test_the_runnable_example_runs_three_supernodes_a_kill_and_a_resume",
    "flower-server-app": FLOWER + "test_the_runnable_example_runs_three_supernodes_a_kill_and_a_resume",
    "flower-client-app": FLOWER + "test_the_runnable_example_runs_three_supernodes_a_kill_and_a_resume",
}

FENCE = re.compile(r"^( *)```(?:python3?|py|pycon)$", re.M)  # what renders as Python
TAG = re.compile(r"^( *)<!-- test: ([a-z0-9-]+) -->$")


@dataclass(frozen=True)
class Block:
    name: str
    document: Path
    line: int  # of the fence, 1-based
    code: str  # dedented


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(document: Path) -> list[Block]:
    """Every ```python block of one document, with its tag's name; an untagged block is an error."""
    text = document.read_text()
    lines = text.splitlines()
    found = []
    for fence in FENCE.finditer(text):
        line = text.count("\n", 0, fence.start()) + 1
        indent = fence.group(1)
        tag = TAG.match(lines[line - 2]) if line >= 2 else None
        if tag is None or tag.group(1) != indent:
            raise AssertionError(
                f"{document.name}:{line}: a python block without its tag on the line before it, "
                f"{indent}<!-- test: NAME --> (and NAME in tests/python/helpers/readme_blocks.py's RUN_BY)"
            )
        closing = re.compile(rf"^{indent}```$", re.M).search(text, fence.end())
        if closing is None:
            raise AssertionError(f"{document.name}:{line}: a python block that is never closed")
        code = textwrap.dedent(text[fence.end() + 1 : closing.start()])
        found.append(Block(tag.group(2), document, line, code))
    return found


def all_blocks() -> dict[str, Block]:
    """Every tagged block of README.md and docs/*.md by name; a name given twice is an error."""
    named: dict[str, Block] = {}
    for document in documents():
        for b in blocks_of(document):
            if b.name in named:
                first = named[b.name]
                raise AssertionError(
                    f"{b.document.name}:{b.line}: the tag {b.name!r} is taken ({first.document.name}:{first.line})"
                )
            named[b.name] = b
    return named


def block(name: str) -> str:
    """The code of the example tagged NAME, dedented, as a user would paste it."""
    return all_blocks()[name].code


def shell_block(name: str) -> list[str]:
    """The commands of the ```sh block tagged NAME (comments dropped): run by the test that runs the
    Python example beside it, so the command lines of the documentation cannot drift either."""
    for document in documents():
        found = re.search(rf"^<!-- test: {re.escape(name)} -->\n```sh\n(.*?)^```$", document.read_text(), re.M | re.S)
        if found:
            lines = (line.split("#", 1)[0].strip() for line in found.group(1).splitlines())
            return [line for line in lines if line]
    raise KeyError(f"no ```sh block tagged {name!r} in README.md or docs/")
