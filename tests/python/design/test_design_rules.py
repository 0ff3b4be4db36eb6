"""The rules of issues 15 and 28, held by construction rather than case by case: this test reads
the package's source and fails if any module creates, renames or removes files, parses JSON,
asks what a target is, or spells a step's layout, other than through the modules that own
those concerns:

- the Rust core (``src/io/commit.rs``): the one commit; nothing in Python renames into place;
- ``safe_io``: every file created exclusively (O_EXCL|O_NOFOLLOW), every file read by name
  checked to be a regular file, every tree removed without following symlinks;
- ``documents`` (``documents/base.py``): every JSON document validated, with size and depth caps;
- ``targets``: the one place that asks whether a name is an ``s3://`` URL or a file object;
- ``steps``: the one place that spells a run's layout (``step_<n>``, attempts, markers);
- ``object_store``: moves bytes, and knows nothing of checkpoint states;
- one manager class, whatever holds the run;
- no module reads or writes a private name (``obj._x``) of another module's objects: the checkpoint
  state is a shell over one backing (``ortckpt.backings``), the ORT bridge (``live``) builds a
  backing and never touches the state, the manager snapshots a state through its public API.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ortckpt
import pytest

PACKAGE = Path(ortckpt.__file__).resolve().parent
OWNERS = {
    "create": {"safe_io.py"},  # os.open with O_CREAT, open() for writing
    "rename": set(),  # os.rename, os.replace: the core's one commit renames, Python never does
    "mkdir": {"safe_io.py"},  # os.mkdir, os.makedirs, Path.mkdir
    "remove-tree": {"safe_io.py"},  # shutil.rmtree
    "json-parse": {"documents/base.py"},  # json.load, json.loads
    "write-path": set(),  # Path.write_text, Path.write_bytes
}


def findings(source: str) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        text = ast.unparse(node)
        if name == "open" and owner in ("", "io", "builtins"):
            mode = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            if isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+"):
                found.append(("create", node.lineno))
        elif name == "open" and owner == "os" and "O_CREAT" in text:
            found.append(("create", node.lineno))
        elif (
            (name in ("rename", "replace") and owner == "os")
            or (name == "move" and owner == "shutil")
            or (name == "rename" and isinstance(func, ast.Attribute) and len(node.args) == 1)
        ):
            found.append(("rename", node.lineno))
        elif name in ("mkdir", "makedirs"):
            found.append(("mkdir", node.lineno))
        elif name == "rmtree":
            found.append(("remove-tree", node.lineno))
        elif name in ("load", "loads") and owner == "json":
            found.append(("json-parse", node.lineno))
        elif name in ("write_text", "write_bytes"):
            found.append(("write-path", node.lineno))
    return found


def test_only_the_owning_modules_create_rename_remove_or_parse():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for rule, line in findings(path.read_text()):
            if path.relative_to(PACKAGE).as_posix() not in OWNERS[rule]:
                violations.append(f"{path.relative_to(PACKAGE)}:{line}: {rule}")
    assert violations == [], "use safe_io, steps or documents instead:\n" + "\n".join(violations)


def test_the_scan_finds_what_it_looks_for():
    sample = (
        "import json, os, shutil\n"
        "open(p, 'wb')\nopen(p, mode='a')\nos.open(p, os.O_WRONLY | os.O_CREAT)\nos.rename(a, b)\n"
        "os.replace(a, b)\np.mkdir()\nos.makedirs(p)\nshutil.rmtree(p)\njson.loads(t)\np.write_text(t)\n"
        "open(p)\nopen(p, 'rb')\nos.open(p, os.O_RDONLY)\n"
    )
    assert [rule for rule, _ in findings(sample)] == [
        "create",
        "create",
        "create",
        "rename",
        "rename",
        "mkdir",
        "mkdir",
        "remove-tree",
        "json-parse",
        "write-path",
    ]


def _imports(source: str, module: str) -> list[tuple[str, str]]:
    """(imported module, name) for every ``from X import name`` and ``import X`` in a module of
    the package, X resolved to a dotted name under ``ortckpt``."""
    package = ["ortckpt", *module.split(".")[:-1]]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found += [(target, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return found


def _package_modules() -> dict[str, str]:
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_only_the_boundary_module_talks_to_the_rust_core():
    talkers = sorted(
        module
        for module, source in _package_modules().items()
        for target, name in _imports(source, module)
        if target == "ortckpt._core" or (target == "ortckpt" and name == "_core")
    )
    assert talkers == ["_boundary"]


def test_no_private_name_crosses_a_module_line():
    """A module uses another's public names only (a private module such as ``_boundary`` is
    private to the package, its names are not): private helpers stay where they are defined."""
    private_modules = {module.rsplit(".", 1)[-1] for module in _package_modules() if module.startswith("_")}
    private_modules.add("_core")
    crossings = sorted(
        f"{module} imports {name} from {target}"
        for module, source in _package_modules().items()
        for target, name in _imports(source, module)
        if target.startswith("ortckpt")
        and name.startswith("_")
        and not name.endswith("__")
        and name not in private_modules
    )
    assert crossings == []


# The rules read the package's source, which is the same on every interpreter (they run on the first of
# PYTHONS); what importing it loads is the interpreter's doing.
@pytest.mark.every_python
def test_import_ortckpt_loads_only_the_checkpoint_state():
    """The manager, the sharded writer, the converters and the CLI load on first use."""
    import subprocess
    import sys

    code = "import sys, ortckpt; print(sorted(m for m in sys.modules if m.startswith('ortckpt')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == [
        "ortckpt",
        "ortckpt._boundary",
        "ortckpt._core",
        "ortckpt.backings",
        "ortckpt.backings.arrays",
        "ortckpt.backings.mapped",
        "ortckpt.backings.tensors",
        "ortckpt.checkpoint_state",
        "ortckpt.dtypes",
        "ortckpt.errors",
        "ortckpt.tensor_keys",
    ]
    lazy = "import ortckpt; print(ortckpt.CheckpointManager.__module__, ortckpt.average.__module__)"
    assert subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, check=True).stdout.split() == [
        "ortckpt.manager.checkpoint_manager",
        "ortckpt.arithmetic",
    ]


def test_the_package_has_no_import_cycle():
    """Module imports (lazy ones too) form layers: the checkpoint state never reaches up into the
    converters, the manager or the command, and no two modules need each other."""
    modules = _package_modules()

    def module_of(target: str, name: str) -> str | None:
        for candidate in (f"{target}.{name}", target):
            short = candidate.removeprefix("ortckpt.")
            if candidate.startswith("ortckpt.") and short in modules:
                return short
            if candidate.startswith("ortckpt.") and f"{short}.__init__" in modules:
                return f"{short}.__init__"
        return None

    graph = {
        module: {
            found
            for target, name in _imports(source, module)
            if (found := module_of(target, name)) is not None and found != module
        }
        for module, source in modules.items()
    }
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


def _code_strings(source: str) -> list[tuple[str, int]]:
    """Every string constant of a module's code (docstrings left out: they may quote a URL)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.value, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_only_the_targets_module_asks_what_a_name_is():
    """``s3://`` is spelled, and a file object recognised (``hasattr(x, "read")``), in targets.py
    alone: everything below the public edge is handed a target already classified."""
    spelled = sorted(
        f"{module}:{line}"
        for module, source in _package_modules().items()
        for text, line in _code_strings(source)
        if "s3://" in text and module != "targets"
    )
    assert spelled == []
    sniffed = sorted(
        f"{module}:{node.lineno}"
        for module, source in _package_modules().items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "hasattr"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in ("read", "write")
        and module != "targets"
    )
    assert sniffed == []


def test_only_the_steps_module_spells_the_layout_of_a_run():
    spelled = sorted(
        f"{module}:{line}: {text!r}"
        for module, source in _package_modules().items()
        for text, line in _code_strings(source)
        if (re.match(r"\.?step_(\d|\{|$)", text) or "retired-" in text) and module != "steps"
    )
    assert spelled == []


def test_object_store_moves_bytes_and_knows_no_checkpoint_state():
    source = _package_modules()["object_store"]
    imported = {target for target, _ in _imports(source, "object_store") if target.startswith("ortckpt")}
    assert imported <= {"ortckpt.errors", "ortckpt.extras", "ortckpt.object_requests"}, imported
    assert "_core_tensors" not in source and "core_state" not in source
    # (its own signed requests, below it: the pages of a listing, and the uploads' requests)
    requests = _package_modules()["object_requests"]
    assert {t for t, _ in _imports(requests, "object_requests") if t.startswith("ortckpt")} <= {"ortckpt.errors"}


# What asks which backend holds a run: a store's ``.local``, the backends' classes (chosen by
# stepstore.backend and open_store), an object store's Location class. ``s3://`` itself is parsed
# in targets.is_object_url alone (test_only_the_targets_module_asks_what_a_name_is).
BACKEND_NAMES = {"DirectoryStore", "ObjectStore", "Location"}


def backend_questions(source: str) -> list[tuple[str, int]]:
    """(what, line) of every backend question in a module: ``x.local`` (but ``threading.local``),
    and every use or import of a backend's class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "local":
            if not (isinstance(node.value, ast.Name) and node.value.id == "threading"):
                found.append((ast.unparse(node), node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr in BACKEND_NAMES:
            found.append((ast.unparse(node), node.lineno))
        elif isinstance(node, ast.Name) and node.id in BACKEND_NAMES:
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name in BACKEND_NAMES]
    return found


def test_backends_differ_inside_the_stepstore_package_alone():
    """Issue 42 (2): what differs between a directory and an object store is a method of
    StepStore (stepstore/base.py), implemented by stepstore/directory.py and stepstore/objects.py;
    no other module asks which backend it holds. (object_store, object_uploads and targets make
    and move Locations: they are the object store, below the backends.)"""
    asked = sorted(
        f"{module}:{line}: {what}"
        for module, source in _package_modules().items()
        if not module.startswith("stepstore.") and module not in ("object_store", "object_uploads", "targets")
        for what, line in backend_questions(source)
    )
    assert asked == [], "add a StepStore method each backend implements:\n" + "\n".join(asked)


def test_a_steps_folder_is_typed_as_the_stores_own():
    """The seams between a store and its callers are typed: a step's and an attempt's folder is
    a stepstore.Folder (a Path or a Location) that only its store reads, never Any."""
    from ortckpt.stepstore import base

    for cls in (base.Step, base.Attempt):
        assert cls.__annotations__["folder"] == "Folder", cls
    assert base.Folder == "Path | Location"


def test_the_backend_scan_finds_what_it_looks_for():
    sample = (
        "import threading\nfrom ..stepstore import ObjectStore\n"
        "x = threading.local()\n"  # not a store's
        "if store.local: pass\n"
        "if isinstance(store, stepstore.DirectoryStore): pass\n"
        "if isinstance(folder, Location): pass\n"
    )
    found = sorted(what for what, _ in backend_questions(sample))
    assert found == ["Location", "ObjectStore", "stepstore.DirectoryStore", "store.local"]


def test_one_manager_class_serves_every_backend():
    from ortckpt.manager import checkpoint_manager

    managers = sorted(
        node.name
        for module, source in _package_modules().items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Manager")
    )
    assert managers == ["CheckpointManager"]
    assert checkpoint_manager.ObjectStoreCheckpointManager is ortckpt.CheckpointManager


# Modules whose ImportError is not a missing extra: ONNX Runtime's training bindings and training
# API (restore_training's Module and Optimizer: their own package, never an extra of ours), and an
# MPI launch without mpi4py (a RuntimeError saying so).
IMPORT_ERRORS_OF_THEIR_OWN = {"extras", "live", "manager.artifacts", "distributed.comm"}


def test_one_helper_imports_the_optional_packages():
    """A missing optional package is said one way (extras.require: what needs it, what to install)."""
    handlers = sorted(
        f"{module}:{node.lineno}"
        for module, source in _package_modules().items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ExceptHandler)
        and "ImportError" in ast.unparse(node.type or ast.Name("BaseException"))
        and not (len(node.body) == 1 and isinstance(node.body[0], ast.Raise) and node.body[0].exc is None)
        and module not in IMPORT_ERRORS_OF_THEIR_OWN
    )
    assert handlers == []


def test_no_module_takes_the_version_from_the_package_root():
    """``__version__`` is the compiled core's (``_boundary.VERSION``): no module imports the
    package root for it (an arrow up the map, and an import cycle waiting to happen)."""
    upward = sorted(
        module
        for module, source in _package_modules().items()
        for target, name in _imports(source, module)
        if target == "ortckpt" and name == "__version__" and module != "__init__"
    )
    assert upward == []


def test_the_rules_scans_find_what_they_look_for():
    assert ("ortckpt", "__version__") in _imports("from .. import __version__, arguments\n", "manager.tracking")
    assert _code_strings('"""A docstring: s3://b/k."""\nx = "s3://b/k"\n') == [("s3://b/k", 2)]
    assert [rule for rule, _ in findings("import shutil\nshutil.move(a, b)\np.rename(q)\n")] == ["rename", "rename"]


# A module may use a private name of an object it did not make only here, each with its reason.
FOREIGN_PRIVATE_NAMES_ALLOWED = {
    ("_boundary", "_release"): "the core's own MappedFile, which only _boundary talks to",
    ("live", "_ortvalue"): "ONNX Runtime's OrtValue, handed over as ONNX Runtime's Parameters.__setitem__ does",
    ("client", "_state"): "ONNX Runtime's state behind ortckpt's, as ONNX Runtime's Module takes it (state._state)",
    ("preemption", "_exit"): "os._exit: the standard library's end of a process that runs no cleanup",
    ("forked_save", "_exit"): "os._exit: a forked child leaves without the parent's atexit handlers and buffers",
}


def private_accesses(source: str) -> list[tuple[str, int]]:
    """(name, line) of every ``x._name`` (one underscore) where ``x`` is not ``self`` or ``cls``
    and ``_name`` is not defined in the module itself (a function, class, variable, slot or
    attribute it assigns): a private name of another module's objects."""
    tree = ast.parse(source)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            own |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return [
        (node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in own
    ]


def test_no_module_uses_a_private_name_of_another_modules_objects():
    found = sorted(
        f"{module}:{line}: .{name}"
        for module, source in _package_modules().items()
        for name, line in private_accesses(source)
        if (module.rsplit(".", 1)[-1], name) not in FOREIGN_PRIVATE_NAMES_ALLOWED
    )
    assert found == [], "use the object's public API (or add a public one):\n" + "\n".join(found)


def test_the_ort_bridge_and_the_backings_never_import_the_checkpoint_state():
    """The state replaces its backing; the backings, and live (which makes ONNX Runtime's), know
    nothing of the state."""
    modules = _package_modules()
    for module in ["live", *(m for m in modules if m.startswith("backings"))]:
        imported = {target for target, _ in _imports(modules[module], module)}
        assert "ortckpt.checkpoint_state" not in imported, module


def test_the_private_name_scan_finds_what_it_looks_for():
    sample = (
        "class A:\n    __slots__ = ('_slot',)\n    def _mine(self):\n        self._held = 1\n"
        "def f(state, other, a):\n"
        "    state._ort\n    state._go_live(1)\n    other.backing._tensors\n"  # three foreign names
        "    a._mine()\n    a._held\n    a._slot\n    self._anything\n    a.__dict__\n"  # own names
    )
    assert sorted(name for name, _ in private_accesses(sample)) == ["_go_live", "_ort", "_tensors"]


def test_the_layout_page_names_every_module():
    """docs/layout.md, the map a newcomer reads first, names every module of the package and the
    core (its "Every file" table): a new module without a line there fails here."""
    root = Path(__file__).resolve().parents[3]
    layout = (root / "docs" / "layout.md").read_text()
    files = [*sorted((root / "python" / "ortckpt").rglob("*.py")), *sorted((root / "src").rglob("*.rs"))]
    named = {str(p.relative_to(root)) for p in files if "generated" not in p.parts}
    missing = sorted(name for name in named if f"`{name}`" not in layout)
    assert len(named) > 50 and missing == [], missing
    listed = set(re.findall(r"^\| `((?:python|src)/[^`]+)` \|", layout, re.MULTILINE))
    assert listed - named == set(), "a file the page lists is gone"


# Issue 42 (6): a module a newcomer opens fits in one reading. One that grows past this is split
# where its reader would look (a package of its parts, re-exporting the names users import).
MAX_MODULE_LINES = 700


def test_no_module_is_longer_than_700_lines():
    long = sorted(
        f"{path.relative_to(PACKAGE)}: {lines} lines"
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert long == [], "split where a newcomer would look:\n" + "\n".join(long)


def checkpoint_error_classes(source: str) -> list[str]:
    """The classes a module defines that derive, by name, from an exception ortckpt raises
    (``...Error``), its own or the standard library's (``ValueError``, ``OSError``...)."""
    return [
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).split(".")[-1].endswith("Error") for base in node.bases)
        and not node.name.startswith("_")
    ]


# Raised only inside the module that defines it and caught there or by its one caller: a signal
# between two functions, never an error a user sees.
INTERNAL_SIGNALS = {("forked_save", "ForkFailed"): "caught by the manager's save, which falls back to a thread"}


def test_every_exception_lives_in_errors_py():
    """A user looks for the exceptions in one place (errors.py, each documented in docs/api.md)."""
    elsewhere = sorted(
        f"{module}.{name}"
        for module, source in _package_modules().items()
        if module != "errors"
        for name in checkpoint_error_classes(source)
        if (module.split(".")[-1], name) not in INTERNAL_SIGNALS
    )
    assert elsewhere == []


def test_the_exception_scan_finds_what_it_looks_for():
    source = "class A(CheckpointError):\n    pass\nclass B(errors.X, OSError): ...\nclass _C(ValueError): ...\n"
    assert checkpoint_error_classes(source) == ["A", "B"]
