"""The HTML report (ortckpt.write_report, `ortckpt report`, MlflowTracker(report=True)): what the
page shows, read back by parsing it, its figures against ortckpt.statistics', hostile names kept
text, nothing to fetch, written all or nothing; the command's inputs and exit codes; the report
of each committed step uploaded to a real MLflow server without a save waiting for it."""

from __future__ import annotations

import json
import re
import threading
import warnings
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt
import ortckpt.report
import pytest
from lazy_modules import lazy_module
from ortckpt import CheckpointInfo, CheckpointManager, CheckpointState, OptimizerGroup
from ortckpt.cli import FAILED, OK, USAGE, run
from ortckpt.errors import InvalidArgumentError
from ortckpt.manager.tracking import MlflowTracker
from ortckpt.statistics import histogram, tensor_changes, tensor_stats
from ortckpt.tensor_keys import TensorTable

mlflow = lazy_module("mlflow")  # (imported at a test's first use: 3 CPU s that collection need not pay)

TIMES, MINUS = "\u00d7", "\u2212"  # as the page writes a shape and -Inf

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "</style><b>bold</b>",
    "a&amp;b <!-- c",
]


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find(self, tag: str, **attrs: str) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if child.tag == tag and all(child.attrs.get(k) == v for k, v in attrs.items()):
                    found.append(child)
                found += child.find(tag, **attrs)
        return found

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _Tree(HTMLParser):
    VOID = frozenset({"meta", "br", "img", "link", "input", "hr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>: the page is not well nested"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse(page: str) -> Node:
    tree = _Tree()
    tree.feed(page)
    tree.close()
    assert tree.stack == [tree.root], [n.tag for n in tree.stack]
    return tree.root


def rows(doc: Node, table_id: str) -> list[Node]:
    [table] = doc.find("table", id=table_id)
    [body] = table.find("tbody")
    return [r for r in body.children if isinstance(r, Node)]


def cells(row: Node) -> list[str]:
    return [" ".join(c.text().split()) for c in row.children if isinstance(c, Node) and c.tag == "td"]


def model(step: int, *, nan: bool = False, extra: str | None = None) -> CheckpointState:
    rng = np.random.default_rng(step)
    weights = {
        "fc1.weight": rng.normal(0, 0.05, (32, 16)).astype(np.float32),
        "fc1.bias": np.full(32, step * 0.01, np.float32),
        "fc2.weight": rng.normal(0, 0.1, (4, 32)).astype(np.float32),
    }
    if nan:
        weights["fc2.weight"][0, :3] = np.nan
        weights["fc2.weight"][1, 0] = np.inf
        weights["fc2.weight"][1, 1] = -np.inf
    if extra is not None:
        weights[extra] = np.ones(2, np.float32)
    state = CheckpointState.from_arrays(weights, {"ids": np.arange(6, dtype=np.int64)}, {"epoch": step, "tag": "<i>x"})
    momentums = {name: {"momentum0": value * 0.1, "momentum1": np.abs(value) * 0.01} for name, value in weights.items()}
    state.optimizer_groups = {"group0": OptimizerGroup(step, 0.001, momentums)}
    return state


def saved(path: Path, state: CheckpointState, **options) -> Path:
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True, **options)
    return path


def test_the_page_shows_the_summary_every_tensors_statistics_and_flags_nan_and_inf(tmp_path):
    path = saved(tmp_path / "b.ckpt", model(200, nan=True), external_data_threshold=256)
    state = CheckpointState.load_checkpoint(path)
    stats = tensor_stats(state)
    doc = parse(ortckpt.render_report(path))

    cards = {n.find("h2")[0].text(): n for n in doc.find("div") if "card" in n.classes()}
    files = [" ".join(li.text().split()) for li in cards["Files"].find("li")]
    sizes = [
        f"{path} {(path.stat().st_size / 1024):.1f} KiB",
        f"{path}.data {(Path(f'{path}.data').stat().st_size / 1024):.1f} KiB",
    ]
    assert files == sizes
    assert [p.text() for p in cards["Tensors"].find("p")] == [f"{len(stats)}", "3 trainable, 1 frozen, 6 momentum"]
    assert f"float32 {TIMES} 9, int64 {TIMES} 1" in cards["Dtypes"].text()
    assert [cells(r) for r in cards["Optimizer"].find("tr")[1:]] == [["group0", "200", "0.001", "3"]]
    assert [cells(r) for r in cards["Properties"].find("tr")] == [["epoch", "200"], ["tag", "'<i>x'"]]

    # NaN/Inf: listed at the top, linking to their rows, which are flagged.
    [alert] = [s for s in doc.find("section") if "alert" in s.classes()]
    flagged = [key.label for key, s in stats.items() if s.flagged]
    assert flagged == ["fc2.weight", "group0/fc2.weight/momentum0", "group0/fc2.weight/momentum1"]
    assert [li.find("code")[0].text() for li in alert.find("li")] == flagged
    assert "3 NaN" in alert.text() and "1 +Inf" in alert.text() and f"1 {MINUS}Inf" in alert.text()
    table = rows(doc, "tensors")
    assert [r.find("code")[0].text() for r in table] == list(stats.labels())  # every tensor, in order
    assert [r.find("code")[0].text() for r in table if "flagged" in r.classes()] == flagged
    links = [a.attrs["href"] for a in alert.find("a")]
    assert links == [f"#{r.attrs['id']}" for r in table if "flagged" in r.classes()]

    for row, s in zip(table, stats.values(), strict=True):
        name, role, dtype, shape, *figures, _hist = cells(row)
        assert (role, dtype) == (s.role, s.dtype)
        assert shape == (TIMES.join(map(str, s.shape)) or "scalar")
        expected = ["0" if x == 0 else f"{x:.4g}" for x in (s.min, s.max, s.mean, s.std, s.l2)]
        assert figures == expected, name


def test_each_histogram_draws_the_counts_of_statistics_histogram(tmp_path):
    state = model(3, nan=True)
    doc = parse(ortckpt.render_report(state))
    values = TensorTable(state.tensors())  # (a label finds its tensor)
    for row in rows(doc, "tensors"):
        name = row.find("code")[0].text()
        [svg] = row.find("svg")
        counts, _edges = histogram(values[name], bins=24)
        heights = [float(r.attrs["height"]) for r in svg.find("rect")]
        assert len(heights) == np.count_nonzero(counts), name  # one bar per bin that holds values
        tallest = max(heights)
        assert tallest == 28.0
        assert heights == pytest.approx([max(1.0, 28 * c / counts.max()) for c in counts if c], abs=0.06)


def test_with_against_the_changes_come_largest_first_and_tensors_only_on_one_side_are_listed(tmp_path):
    a = saved(tmp_path / "a.ckpt", model(100, extra="old.weight"))
    b = saved(tmp_path / "b.ckpt", model(200, nan=True, extra="new.weight"))
    doc = parse(ortckpt.render_report(b, against=a, name="B", against_name="A"))
    changes = [c for c in tensor_changes(a, b).values() if c.changed]
    assert changes[0].name == "fc2.weight"  # its NaNs and infinities changed: first
    got = [cells(r) for r in rows(doc, "changes")]
    assert [g[0] for g in got] == [c.name for c in changes]
    for g, c in zip(got, changes, strict=True):
        assert g[1:5] == [f"{c.changed:,} / {c.elements:,}", f"{c.l2:.4g}", f"{c.relative:.4g}", ""]
        assert g[5] == ("0" if c.max_abs == 0 else f"{c.max_abs:.4g}")
        assert g[6] == (f"{c.nonfinite:,}" if c.nonfinite else "")
    listed = [h for h in doc.find("h3") if h.text().startswith(("Only in", "In both"))]
    lists = {
        h.text(): [li.text() for li in ul.find("li")]
        for h, ul in zip(listed, doc.find("ul", **{"class": "names"}), strict=True)
    }
    # The optimizer's step and the properties that changed are listed too, A's value then B's.
    [other] = doc.find("table", id="other-changes")
    changed = {cells(r)[0]: cells(r)[1:] for r in other.find("tr")[1:]}
    assert changed == {"optimizer group0.step": ["100", "200"], "property epoch": ["100", "200"]}
    # Numeric columns' headers sit over their numbers (right-aligned, as the cells are).
    heads = {h.text(): h.attrs.get("class") for h in doc.find("th")}
    assert heads["L2 of change"] == heads["max |Δ|"] == heads["mean"] == "n" and heads["tensor"] is None
    assert lists == {
        "Only in B: 3": ["new.weight", "group0/new.weight/momentum0", "group0/new.weight/momentum1"],
        "Only in A: 3": ["old.weight", "group0/old.weight/momentum0", "group0/old.weight/momentum1"],
    }
    same = parse(ortckpt.render_report(a, against=a))
    assert not same.find("table", id="changes")
    assert f"No tensor changed ({len(tensor_stats(a))} compared)" in same.text()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_names_and_properties_stay_text(tmp_path, hostile):
    state = CheckpointState.from_arrays(
        {hostile: np.array([np.nan, 1.0], np.float32), "ok": np.ones(2, np.float32)}, properties={hostile: hostile}
    )
    other = CheckpointState.from_arrays({hostile: np.array([0.0, 2.0], np.float32)})
    page = ortckpt.render_report(state, against=other, name=hostile, against_name=hostile)
    doc = parse(page)
    tags = {n.tag for n in _all(doc)}
    assert tags <= {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "header",
        "h1",
        "h2",
        "h3",
        "p",
        "section",
        "div",
        "ul",
        "li",
        "a",
        "code",
        "span",
        "b",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
        "svg",
        "rect",
    }
    assert not any(k[:2] == "on" for n in _all(doc) for k in n.attrs)  # no event handler attribute
    assert doc.find("h1")[0].text() == hostile
    assert [r.find("code")[0].text() for r in rows(doc, "tensors")] == [hostile, "ok"]
    assert [r.find("code")[0].text() for r in rows(doc, "changes")] == [hostile]
    [style] = doc.find("style")
    assert "</style>" not in style.text() and "<b>" not in page.split("</style>", 1)[0]


def test_names_that_reorder_or_hide_text_show_those_characters_written_out():
    """A right-to-left override in a name would show "\u202eevil.weight" as "thgiew.live" and turn
    the text after it around too ("of 6" read "6 fo"); a zero-width space makes two names look
    alike; a newline shows as a space. The page writes such characters out, as Python's repr."""
    names = ["\u202eevil.weight", "zero\u200bwidth", "zerowidth", "new\nline", "isolate\u2067x"]
    state = CheckpointState.from_arrays(
        {n: np.array([np.nan, 1.0], np.float32) for n in names}, properties={"\u202ekey": "v\u202e"}
    )
    page = ortckpt.render_report(state, against=state, name="\u202estep")
    doc = parse(page)
    shown = ["\\u202eevil.weight", "zero\\u200bwidth", "zerowidth", "new\\nline", "isolate\\u2067x"]
    assert sorted(r.find("code")[0].text() for r in rows(doc, "tensors")) == sorted(shown)
    assert sorted(li.find("code")[0].text() for li in doc.find("section", id="flagged")[0].find("li")) == sorted(shown)
    assert doc.find("h1")[0].text() == "\\u202estep"
    assert "\\u202ekey" in doc.text()
    assert not any(c in page for c in "\u202e\u200b\u2067")


def test_a_long_property_is_shown_cut_and_the_page_stays_small():
    state = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, properties={"config": "y" * 2_000_000})
    page = ortckpt.render_report(state)
    assert len(page) < 20_000
    [value] = [c for c in parse(page).find("code") if c.text().startswith("'yyy")]
    assert value.text().endswith("\u2026 (2,000,002 characters)")


def _all(node: Node) -> list[Node]:
    found = []
    for child in node.children:
        if isinstance(child, Node):
            found += [child, *_all(child)]
    return found


def test_the_page_needs_nothing_but_itself(tmp_path):
    page = ortckpt.render_report(model(1, nan=True), against=model(2))
    doc = parse(page)
    assert not doc.find("script") and not doc.find("link") and not doc.find("img") and not doc.find("iframe")
    assert not re.search(
        r"(?i)\b(src|srcset|action|xlink:href)\s*=|url\(|@import|https?:", page.replace("http-equiv", "")
    )
    assert {a.attrs["href"][0] for a in doc.find("a")} == {"#"}
    [csp] = [m for m in doc.find("meta") if m.attrs.get("http-equiv") == "Content-Security-Policy"]
    assert csp.attrs["content"].startswith("default-src 'none';")


def test_histograms_go_to_the_largest_tensors_flagged_first_and_the_page_stays_small():
    many = {f"layer{i:04}.weight": np.full(10 + i, 0.5, np.float32) for i in range(3000)}
    many["layer0000.weight"][0] = np.nan  # the smallest tensor, flagged
    state = CheckpointState.from_arrays(many)
    page = ortckpt.render_report(state, histograms=20)
    doc = parse(page)
    drawn = [r.find("code")[0].text() for r in rows(doc, "tensors") if r.find("svg")]
    assert drawn == ["layer0000.weight"] + [f"layer{i:04}.weight" for i in range(2981, 3000)]
    assert "the 20 largest of 3,000 numeric tensors" in doc.text()
    assert len(page) < 3000 * 700  # the table of every tensor, about 600 bytes a row, and 20 histograms
    assert len(parse(ortckpt.render_report(state, histograms=0)).find("svg")) == 0


def test_write_report_replaces_the_file_all_or_nothing_and_checks_its_arguments(tmp_path):
    out = tmp_path / "report.html"
    out.write_text("previous")
    stats = ortckpt.write_report(model(1), out)
    assert out.read_text().startswith("<!DOCTYPE html>") and stats == tensor_stats(model(1))
    before = out.read_bytes()
    with pytest.raises(FileNotFoundError):
        ortckpt.write_report(model(1), out, against=tmp_path / "missing.ckpt")
    assert out.read_bytes() == before
    for bad, argument in (
        ({"histograms": -1}, "histograms"),
        ({"histograms": True}, "histograms"),
        ({"files": [{}, {}]}, "files"),
    ):
        with pytest.raises(InvalidArgumentError) as raised:
            ortckpt.write_report(model(1), out, **bad)
        assert raised.value.argument == argument
    for path in (f"{tmp_path}/dir/", "s3://bucket/report.html"):
        with pytest.raises(InvalidArgumentError):
            ortckpt.write_report(model(1), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary file left behind


def cli(capsys, *args) -> tuple[int, str, str]:
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_report_command(tmp_path, capsys):
    a = saved(tmp_path / "a.ckpt", model(100))
    b = saved(tmp_path / "b.ckpt", model(200, nan=True))
    out = tmp_path / "report.html"
    code, stdout, _ = cli(capsys, "report", b, "--against", a, "-o", out)
    assert (code, stdout) == (OK, f"{out}: report of {b} against {a} (3 flagged)\n")
    doc = parse(out.read_text())
    assert doc.find("h1")[0].text() == str(b) and [
        h.find("code")[0].text() for h in doc.find("h2") if h.text().startswith("Changes from")
    ] == [str(a)]
    code, stdout, _ = cli(capsys, "report", b, "-o", out, "--histograms", "0", "--json")
    assert code == OK and json.loads(stdout) == {"checkpoint": str(b), "against": None, "out": str(out), "flagged": 3}
    assert not parse(out.read_text()).find("svg")  # replaced, as `convert` replaces its output

    from ortckpt.convert import save_safetensors

    save_safetensors(model(5), tmp_path / "m.safetensors")  # another format: read through its converter
    assert cli(capsys, "report", tmp_path / "m.safetensors", "--against", a, "-o", out)[0] == OK
    before = out.read_bytes()
    for args, expected, named in (
        (("report", tmp_path / "missing", "-o", out), FAILED, tmp_path / "missing"),
        (("report", b, "--against", tmp_path / "missing", "-o", out), FAILED, tmp_path / "missing"),
        (("report", b, "-o", tmp_path / "no dir" / "r.html"), FAILED, tmp_path / "no dir" / "r.html"),
        (("report", b, "-o", "s3://bucket/r.html"), USAGE, "s3://bucket/r.html"),
        (("report", b, "-o", f"{tmp_path}/"), USAGE, f"{tmp_path}/"),
        (("report", b), USAGE, "--output"),
        (("report", b, "-o", out, "--histograms", "-1"), USAGE, "--histograms"),
    ):
        code, _, err = cli(capsys, *args)
        last = err.strip().splitlines()[-1]
        assert code == expected and str(named) in last, (args, err)
        if code == FAILED:  # one line, naming the file
            assert err == f"{last}\n" and last.startswith("ortckpt: error: "), err
    assert out.read_bytes() == before  # a failed report leaves the previous page


def test_the_report_of_a_step_folder_names_the_steps_files(tmp_path, capsys):
    with CheckpointManager(tmp_path / "run", external_data_threshold=64) as manager:
        manager.save(model(1), step=1)
        manager.save(model(2, nan=True), step=2)
        steps = [info.url for info in manager.all()]
        files = manager.latest().metadata["files"]
    out = tmp_path / "report.html"
    assert cli(capsys, "report", steps[1], "--against", steps[0], "-o", out)[0] == OK
    doc = parse(out.read_text())
    [card] = [n for n in doc.find("div") if "card" in n.classes() and n.find("h2")[0].text() == "Files"]
    listed = [li.find("code")[0].text() for li in card.find("li")]
    assert listed == [f"{steps[1]}/{name}" for name in sorted(files)]


def published(client: mlflow.MlflowClient, run_id: str, step: int, into: Path) -> Node:
    path = client.download_artifacts(run_id, f"checkpoints/step_{step:08d}/report.html", str(into))
    return parse(Path(path).read_text())


def test_the_manager_attaches_each_steps_report_to_mlflow(tmp_path, mlflow_uri):
    tracker = MlflowTracker(mlflow_uri, experiment="ortckpt-report", timeout=120, report=True)
    with CheckpointManager(tmp_path / "run", track=tracker, max_to_keep=2) as manager:
        manager.save(model(1), step=1, metrics={"loss": 1.0})
        manager.save(model(2, nan=True), step=2, metrics={"loss": 0.5})
        directories = [str(info.directory) for info in manager.all()]
    client = mlflow.MlflowClient(mlflow_uri)
    first = published(client, tracker.mlflow_run_id, 1, tmp_path / "1")
    assert first.find("h1")[0].text() == directories[0] and not first.find("table", id="changes")
    second = published(client, tracker.mlflow_run_id, 2, tmp_path / "2")
    assert second.find("h1")[0].text() == directories[1]
    assert f"Changes from {directories[0]}" in " ".join(second.text().split())  # what changed since the step before
    assert [r.find("code")[0].text() for r in rows(second, "tensors") if "flagged" in r.classes()] == [
        "fc2.weight",
        "group0/fc2.weight/momentum0",
        "group0/fc2.weight/momentum1",
    ]
    listed = sorted(
        a.path.rsplit("/", 1)[1] for a in client.list_artifacts(tracker.mlflow_run_id, "checkpoints/step_00000002")
    )
    assert listed == ["metadata.json", "report.html"]


def test_a_save_never_waits_for_its_report_and_close_waits_for_it(tmp_path, mlflow_uri, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    write = ortckpt.report.write_report

    def slow(*args, **kwargs):
        entered.set()
        assert release.wait(120)
        return write(*args, **kwargs)

    monkeypatch.setattr(ortckpt.report, "write_report", slow)
    tracker = MlflowTracker(mlflow_uri, experiment="ortckpt-report", timeout=120, report=True)
    manager = CheckpointManager(tmp_path / "run", track=tracker)
    manager.save(model(1), step=1, metrics={"loss": 1.0})
    assert entered.wait(120)  # the report is being made...
    manager.save(model(2), step=2, metrics={"loss": 0.5})  # ...and the saves go on, their metrics logged
    client = mlflow.MlflowClient(mlflow_uri)
    assert [m.step for m in client.get_metric_history(tracker.mlflow_run_id, "loss")] == [1, 2]
    assert not release.is_set()
    release.set()
    manager.close()
    for step in (1, 2):
        assert published(client, tracker.mlflow_run_id, step, tmp_path / str(step)).find("h1")


def test_a_report_that_cannot_be_made_is_a_warning_and_the_step_is_reported(tmp_path, mlflow_uri, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device", "report.html")

    monkeypatch.setattr(ortckpt.report, "write_report", broken)
    tracker = MlflowTracker(mlflow_uri, experiment="ortckpt-report", timeout=120, report=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(tmp_path / "run", track=tracker) as manager:
            manager.save(model(1), step=1, metrics={"loss": 1.0})
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == [
        f"{tmp_path / 'run' / 'step_00000001'}: step 1's report is not uploaded: "
        "OSError: [Errno 28] No space left on device: 'report.html'"
    ]
    client = mlflow.MlflowClient(mlflow_uri)
    assert [m.step for m in client.get_metric_history(tracker.mlflow_run_id, "loss")] == [1]
    assert [
        a.path.rsplit("/", 1)[1] for a in client.list_artifacts(tracker.mlflow_run_id, "checkpoints/step_00000001")
    ] == ["metadata.json"]


@pytest.mark.parametrize(
    ("value", "bars"),
    [
        (np.array([-1.7e308, 1.7e308, 0.0]), None),  # max - min overflows float64: no bins, said so
        (np.full(3, 3e38, np.float32), [28.0]),  # one value past 2**53: one bar (NumPy's range would have no width)
        (np.array([0, 2**64 - 1], np.uint64), [28.0, 28.0]),
        (np.array([1, 2, np.nan], dtype=ml_dtypes.bfloat16), [28.0, 28.0]),
        (np.array([True, False, True]), [28.0, 14.0]),
        (np.full(4, np.nan, np.float32), "no finite value"),
        (np.zeros((0, 3), np.float32), "no finite value"),
        (np.array(["a", "<b>"], dtype=object), "no finite value"),
    ],
)
def test_odd_tensors_get_the_histogram_they_can_have(value, bars):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's overflow in the statistics of 1.7e308)
        state = CheckpointState.from_arrays({"w": value})
        doc = parse(ortckpt.render_report(state, against=state))
    [row] = rows(doc, "tensors")
    svgs = row.find("svg")
    if bars is None:
        assert not svgs and "range too wide to bin" in row.text()
    elif bars == "no finite value":
        assert not svgs
    else:
        assert sorted(float(r.attrs["height"]) for r in svgs[0].find("rect")) == sorted(bars)


def test_a_step_deleted_before_its_report_is_a_warning_and_the_next_report_stands_alone(
    tmp_path, mlflow_uri, monkeypatch
):
    entered, release = threading.Event(), threading.Event()
    load = CheckpointInfo.load

    def held(info):
        if not entered.is_set():  # (step 1's report waits until retention has deleted step 1)
            entered.set()
            assert release.wait(120)
        return load(info)

    monkeypatch.setattr(CheckpointInfo, "load", held)
    tracker = MlflowTracker(mlflow_uri, experiment="ortckpt-report", timeout=120, report=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = CheckpointManager(tmp_path / "run", track=tracker, max_to_keep=1)
        manager.save(model(1), step=1, metrics={"loss": 1.0})
        assert entered.wait(120)
        manager.save(model(2), step=2, metrics={"loss": 0.5})  # retention deletes step 1
        assert not (tmp_path / "run" / "step_00000001").exists()
        release.set()
        manager.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{tmp_path / 'run' / 'step_00000001'}: step 1's report is not uploaded: ")
    client = mlflow.MlflowClient(mlflow_uri)
    second = published(client, tracker.mlflow_run_id, 2, tmp_path / "2")
    assert second.find("h1") and not second.find("table", id="changes")  # step 1 is gone: nothing to compare
