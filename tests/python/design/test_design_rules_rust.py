"""The Rust core's layering (issue 42), held by construction: this test reads every file under
``src/`` (but the flatc output), resolves each path it names inside the crate (``use crate::...``,
``super::...``, paths written inline, re-exports followed to where the item lives) and fails on

- a module that uses one of its own layer or a layer above in ``LAYERS`` (``io`` reaching into
  ``format`` was one), or the crate root
  itself (``lib.rs`` is the face: declarations and re-exports, nothing of its own to use);
- any circle between the files of the crate, at any depth (``io/atomic.rs`` <-> ``io/locks.rs`` was
  the first); a folder's ``mod.rs`` declaring and re-exporting its own children is no circle;
- a ``lib.rs`` that defines anything;
- a ``clippy::too_many_arguments`` allow: what crosses a boundary in bulk is a typed record.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"

# The crate's top-level modules in layers, lowest first: a module may use the layers below its own,
# never its own layer's other modules nor a layer above (format and io know nothing of each other).
LAYERS = [
    ["error", "random"],  # the one error type; unpredictable ids and names
    ["seal"],  # pair trailer, checksum block, the data file's name: what format and io share
    ["generated"],  # flatc output
    ["format", "io"],  # bytes <-> checkpoint, no filesystem | maps, temporaries, locks, the one commit
    # kernels | a checkpoint's files mapped and decoded | written and committed | values proven unwritten
    ["compute", "load", "save", "untouched"],
    ["integrity", "sharing"],  # checksums checked, staged files resealed | saves sharing a data file
    ["python"],  # the PyO3 boundary (feature `python`)
]

Module = tuple[str, ...]
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text: str) -> str:
    """``text`` with comments (doc comments too: their links are no dependency) and the contents
    of string and char literals blanked, line breaks kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif (raw := re.match(r'b?r(#*)"', text[i:])) and (i == 0 or not re.match(r"\w", text[i - 1])):
            close = '"' + raw.group(1)
            end = text.find(close, i + raw.end())
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end + len(close)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and (char := re.match(r"'(\\.[^']*|[^\\'])'", text[i:])):
            out.append("' '")
            i += char.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def module_of(path: Path, root: Path = SRC) -> Module:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def _tree_paths(text: str, at: int, prefix: list[str]) -> list[list[str]]:
    """The paths a use tree (or an inline path) starting at ``at`` names: ``a::b::{c, d::e}``."""
    paths: list[list[str]] = []
    path = list(prefix)
    while True:
        m = re.compile(r"\s*(" + IDENT + r"|\*|\{)").match(text, at)
        if not m:
            break
        token, at = m.group(1), m.end()
        if token == "{":
            depth = 1
            pieces, piece_start = [], at
            while depth:
                ch = text[at]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                if (ch == "," and depth == 1) or depth == 0:
                    pieces.append((piece_start, at))
                    piece_start = at + 1
                at += 1
            for piece_start, piece_end in pieces:
                if text[piece_start:piece_end].strip():
                    paths += _tree_paths(text[:piece_end], piece_start, path)
            return paths
        if token != "*":
            path.append(token)
        sep = re.compile(r"\s*::").match(text, at)
        if not sep:
            break
        at = sep.end()
    paths.append(path)
    return paths


class Crate:
    def __init__(self, root: Path = SRC) -> None:
        self.files = {
            module_of(p, root): strip_comments_and_strings(p.read_text())
            for p in sorted(root.rglob("*.rs"))
            if "generated" not in p.relative_to(root).parts[:1]
        }
        self.modules = set(self.files) | {("generated",)}
        self.reexports: dict[Module, dict[str, list[str]]] = {m: {} for m in self.files}
        for module, text in self.files.items():
            for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+", text):
                for path in _tree_paths(text, m.end(), []):
                    absolute = self.absolute(module, (), path, relative_children=True)
                    if absolute:
                        self.reexports[module][absolute[-1]] = absolute

    def absolute(self, module: Module, inline: Module, path: list[str], relative_children: bool) -> list[str] | None:
        """``path``, written in ``module`` (inside the inline modules ``inline``), made absolute;
        None for another crate's (std, pyo3...)."""
        here = list(module + inline)
        if path[0] == "crate":
            return path[1:]
        if path[0] in ("super", "self"):
            while path and path[0] in ("super", "self"):
                if path[0] == "super":
                    here.pop()
                path = path[1:]
            return here + path
        if relative_children and tuple([*module, path[0]]) in self.modules:
            return list(module) + path
        return None

    def resolve(self, path: list[str], seen: int = 0) -> Module:
        """The module an absolute path's item lives in: the longest module it starts with, through
        the re-exports of that module."""
        prefix = max((m for m in self.modules if tuple(path[: len(m)]) == m), key=len, default=())
        rest = path[len(prefix) :]
        if rest and seen < 16 and prefix in self.reexports and rest[0] in self.reexports[prefix]:
            target = self.reexports[prefix][rest[0]]
            if target != path[: len(prefix) + 1]:
                return self.resolve(target + rest[1:], seen + 1)
        return prefix

    def uses(self, module: Module) -> set[Module]:
        """The modules ``module``'s file names, but its own descendants (what it declares)."""
        text = self.files[module]
        found: set[Module] = set()
        # Inline modules (`mod tests { ... }`) change what `super` means inside them.
        opens = [(m.end(), m.group(1)) for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", text)]

        def inline_at(position: int) -> Module:
            stack = []
            for start, name in opens:
                if start <= position and text[start:position].count("{") >= text[start:position].count("}"):
                    stack.append(name)
            return tuple(stack)

        starts = [(m.start(), m.end(), []) for m in re.finditer(r"(?<![\w:])(?=(?:crate|super|self)\s*::)", text)]
        starts += [(m.start(), m.end(), []) for m in re.finditer(r"\buse\s+", text)]
        for start, at, prefix in starts:
            for path in _tree_paths(text, at, prefix):
                if not path or path == ["self"]:
                    continue
                absolute = self.absolute(module, inline_at(start), path, relative_children=True)
                if absolute is None:
                    continue
                target = self.resolve(absolute)
                if target[: len(module)] != module:
                    found.add(target)
        return found


def top(module: Module) -> str:
    return module[0] if module else "lib"


def upward_reaches(crate: Crate, layers: list[list[str]] = LAYERS) -> list[str]:
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    wrong = []
    for module in crate.files:
        if not module:
            continue  # the face declares everything
        for target in crate.uses(module):
            if not target:
                wrong.append(f"{'/'.join(module)} uses the crate root (lib.rs is the face only)")
            elif top(target) != top(module) and rank[top(target)] >= rank[top(module)]:
                wrong.append(f"{'/'.join(module)} reaches into {'/'.join(target)}, which is not below it")
    return sorted(wrong)


def circles(crate: Crate) -> list[list[str]]:
    graph = {m: crate.uses(m) for m in crate.files}
    found, state = [], dict.fromkeys(graph, 0)
    stack: list[Module] = []

    def visit(m: Module) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                found.append(["/".join(x) or "lib" for x in stack[stack.index(t) :]] + ["/".join(t)])
            elif state.get(t) == 0:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m)
    return found


def test_every_top_level_module_has_a_layer():
    tops = {top(m) for m in Crate().modules} - {"lib"}
    layered = {name for layer in LAYERS for name in layer}
    assert tops == layered, (sorted(tops - layered), sorted(layered - tops))


def test_no_module_reaches_up_or_into_the_face():
    assert upward_reaches(Crate()) == []


def test_no_circle_between_the_files_of_the_crate():
    assert circles(Crate()) == []


def test_lib_rs_is_the_face_only():
    """lib.rs declares the modules and re-exports what the crate offers; it defines nothing."""
    text = strip_comments_and_strings((SRC / "lib.rs").read_text())
    text = re.sub(r"#!?\[[^\]]*(\[[^\]]*\][^\]]*)*\]", "", text)  # attributes
    statements = [" ".join(part.split()) for part in text.split(";") if part.strip()]
    face = re.compile(r"(pub )?mod \w+|pub use [\w:]+(::\{[\w\s,:{}]*\})?")
    assert [s for s in statements if not face.fullmatch(s)] == []


def test_no_function_takes_too_many_arguments():
    allows = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.rs")
        if "generated" not in p.relative_to(SRC).parts[:1]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "too_many_arguments" in line
    ]
    assert allows == []


def test_the_rules_see_what_they_look_for(tmp_path):
    """The scan on a made-up crate with each fault: an upward reach through a re-export, a use of
    the root, a reach across a layer, a circle between two siblings (through `super::` and an inline
    path), a grouped use; and what is no fault: comments, strings, a module's own tests."""
    files = {
        "lib.rs": "pub mod seal; pub mod io; pub mod format;\npub use format::Thing;\npub fn helper() {}\n",
        "seal/mod.rs": 'pub mod sums;\n// use crate::io; (a comment)\nconst S: &str = "crate::io::x";\n',
        "seal/sums.rs": "use crate::{error::E, Thing};\npub fn f() { crate::helper() }\n",
        "format/mod.rs": "mod a; pub use a::Thing; use crate::seal::sums;\n",
        "format/a.rs": "pub struct Thing;\nuse super::super::seal;\n#[cfg(test)]\nmod tests { use super::*; }\n",
        "io/mod.rs": "mod atomic; mod locks;\n",
        "io/atomic.rs": "use super::locks::{self, held};\n",
        "io/locks.rs": "fn g() { super::atomic::create() }\nuse crate::format::Thing;\n",
        "error.rs": "pub struct E;\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    crate = Crate(tmp_path)
    assert crate.uses(("seal", "sums")) == {("error",), ("format", "a"), ()}
    assert crate.uses(("seal",)) == set()  # its child, a comment, a string
    assert crate.uses(("format", "a")) == {("seal",)}  # not itself (its tests' `super::*`)
    assert crate.uses(("format",)) == {("seal", "sums")}
    assert upward_reaches(crate, [["error"], ["seal"], ["format", "io"]]) == [
        "io/locks reaches into format/a, which is not below it",
        "seal/sums reaches into format/a, which is not below it",
        "seal/sums uses the crate root (lib.rs is the face only)",
    ]
    assert circles(crate) == [["io/atomic", "io/locks", "io/atomic"]]
