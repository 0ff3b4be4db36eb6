"""The Python suite's own layout (issue 42), held by construction: test files live in one folder per part
of the package they test, never flat in tests/python (only conftest.py is there); the modules they share
live in helpers/ and nowhere else; a test module imports another test module only from its own folder
(pytest puts a test's folder on sys.path when it imports it, so an import from another folder works only
when that folder happened to be collected first); and docs/layout.md names every test folder."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1]
ROOT = SUITE.parents[1]
HELPERS = SUITE / "helpers"


def folders() -> list[Path]:
    return sorted(p for p in SUITE.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def test_no_module_is_flat_in_the_suite_but_conftest():
    flat = sorted(p.name for p in SUITE.glob("*.py") if p.name != "conftest.py")
    assert flat == [], f"{flat}: a test belongs in the folder of the part it tests, a shared module in helpers/"


def test_shared_modules_live_in_helpers_and_tests_in_the_part_folders():
    misplaced = [
        str(p.relative_to(SUITE))
        for folder in folders()
        for p in sorted(folder.rglob("*.py"))
        if (folder == HELPERS) == p.name.startswith("test_")
    ]
    assert misplaced == [], f"{misplaced}: test_*.py files go in a part's folder, every other module in helpers/"
    assert not [p for p in folders() if list(p.glob("*/*.py"))], "the part folders are one level deep"


def test_a_test_module_imports_test_modules_of_its_own_folder_only():
    tests = {p.stem: p.parent for p in SUITE.glob("*/test_*.py")}
    crossing = []
    for path in sorted(SUITE.glob("*/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            crossing += [
                f"{path.relative_to(SUITE)} imports {name}"
                for name in names
                if name in tests and tests[name] != path.parent
            ]
    assert crossing == [], f"{crossing}: move what both need into helpers/"


def test_the_test_module_names_are_unique():
    """pytest imports each test module by its bare name (rootdir-relative folders are no packages here)."""
    stems = [p.stem for p in SUITE.glob("*/test_*.py")]
    assert sorted({s for s in stems if stems.count(s) > 1}) == []


def test_the_layout_page_names_every_test_folder():
    layout = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"^tests/python/([a-z_]+)/ ", layout, re.MULTILINE))
    present = {p.name for p in folders()}
    assert sorted(present - named) == [], "docs/layout.md's tests section misses these folders"
    assert sorted(named - present) == [], "docs/layout.md names test folders that are gone"


def test_every_part_folder_runs_in_exactly_one_lane_of_make_test():
    """make test spreads the one-interpreter tests over its lanes by part folder (the Makefile's
    TEST_PARTS_n, read by conftest.py, and TEST_PARTS_INTEROP): a folder in none would run only its
    every_python tests, a folder in two would run twice."""
    makefile = (ROOT / "Makefile").read_text()
    lanes = re.findall(r"^TEST_PARTS_\w+ := (.*)$", makefile, re.MULTILINE)
    named = [part for lane in lanes for part in lane.split()]
    parts = sorted(p.name for p in folders() if p != HELPERS)
    assert len(lanes) >= 2, "the Makefile's TEST_PARTS_n lines are gone"
    assert sorted(named) == parts, f"each of {parts} in exactly one TEST_PARTS_* of the Makefile"


def test_the_every_python_mark_is_spelled_in_the_test_files_that_use_it():
    """A lane skips collecting another lane's test files that do not spell every_python (conftest.py's
    pytest_ignore_collect): so the mark may come from nowhere else, no helper or conftest hands it out."""
    outside = [
        str(p.relative_to(SUITE))
        for p in sorted(SUITE.rglob("*.py"))
        if not p.name.startswith("test_")
        for node in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(node, ast.Attribute) and node.attr == "every_python"
    ]
    assert outside == [], f"{outside}: mark each test (or file) with @pytest.mark.every_python where it is written"
    users = [p for p in SUITE.glob("*/test_*.py") if "pytest.mark.every_python" in p.read_text()]
    assert len(users) >= 5, "the every_python tests are gone"
