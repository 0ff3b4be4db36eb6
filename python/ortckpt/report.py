"""One self-contained HTML page about a checkpoint: what a person opens to see which layer went
NaN, what an optimizer step changed, what a file holds.

``write_report(checkpoint, path, against=None)`` writes it; ``render_report`` returns the text.
The page is a summary (files and sizes, tensors by role and dtype, bytes of parameters and of
optimizer state, optimizer groups, properties), the tensors holding NaN or Inf listed first, a
table of every tensor with its statistics (:mod:`ortckpt.statistics`) and the histogram of its
finite values for the largest ``histograms`` tensors (a page of thousands of tensors stays a few
MB), and with ``against`` what changed per tensor, largest first, and the tensors only one side
has.

The page needs nothing but itself: CSS and SVG inline, no script, and a Content-Security-Policy
that forbids loading anything (so a page opened from an archive, a mail or an MLflow run fetches
nothing). Every name and property comes from a file and is escaped: a tensor named ``<script>``
shows as text.
"""

from __future__ import annotations

import html
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import safe_io, targets, texts
from ._boundary import VERSION
from .checkpoint_state import CheckpointState, PackedBits
from .compare import beyond_tensors
from .errors import InvalidArgumentError
from .statistics import TensorChange, TensorStats, histogram, tensor_changes, tensor_stats
from .tensor_keys import TensorKey, TensorTable

# Histograms drawn, for the largest tensors (those holding NaN or Inf first): each is ~1.5 KB of
# SVG, so a model of 10,000 tensors makes a page of a few MB, not tens.
DEFAULT_HISTOGRAMS = 100
_BINS = 24

Checkpoint = CheckpointState | str | os.PathLike[str]


@dataclass(frozen=True)
class _Side:
    """A checkpoint as the page names it: its name, its state, its files' sizes (when local)."""

    name: str
    state: CheckpointState
    files: dict[str, int | None]


def render_report(
    checkpoint: Checkpoint,
    *,
    against: Checkpoint | None = None,
    histograms: int = DEFAULT_HISTOGRAMS,
    name: str | None = None,
    against_name: str | None = None,
    files: Sequence[Mapping[str, int | None]] | None = None,
) -> str:
    """The report's HTML. ``checkpoint`` and ``against`` are states or files of any format
    ortckpt reads (a path, or an ``s3://`` checkpoint); ``name`` and ``against_name`` are how
    the page names them (default: their path, or "checkpoint" and "against" for states).
    ``histograms``: how many tensors (the largest) get one. ``files``: the files the summary
    lists with their sizes, one mapping per checkpoint (default: a path's file and its .data)."""
    return _page(checkpoint, against, histograms, name, against_name, files).render()


def write_report(
    checkpoint: Checkpoint,
    path: str | os.PathLike[str],
    *,
    against: Checkpoint | None = None,
    histograms: int = DEFAULT_HISTOGRAMS,
    name: str | None = None,
    against_name: str | None = None,
    files: Sequence[Mapping[str, int | None]] | None = None,
) -> TensorTable[TensorStats]:
    """Writes :func:`render_report`'s page to ``path``, replacing it all or nothing (as every
    file ortckpt writes: a failed write leaves the previous file as it was). Returns the
    statistics the page shows (:class:`~ortckpt.TensorKey` -> :class:`~ortckpt.TensorStats`)."""
    targets.output(path, "path")
    if targets.is_object_url(path):
        raise InvalidArgumentError(f"{os.fspath(path)}: a report is written to a local file", "path")
    page = _page(checkpoint, against, histograms, name, against_name, files)
    safe_io.write_atomically(path, page.render().encode("utf-8"))
    return page.stats


def _page(
    checkpoint: Checkpoint,
    against: Checkpoint | None,
    histograms: int,
    name: str | None,
    against_name: str | None,
    files: Sequence[Mapping[str, int | None]] | None,
) -> _Page:
    """The page's figures, every argument checked before a file is read."""
    if isinstance(histograms, bool) or not isinstance(histograms, int) or histograms < 0:
        raise InvalidArgumentError(f"histograms is a count >= 0, got {histograms!r}", "histograms")
    count = 1 if against is None else 2
    if files is not None and len(files) != count:
        raise InvalidArgumentError(f"files: one mapping per checkpoint ({count}), got {len(files)}", "files")
    side = _side(checkpoint, name, "checkpoint", None if files is None else files[0])
    other = None if against is None else _side(against, against_name, "against", None if files is None else files[1])
    return _Page(side, other, histograms)


def _side(checkpoint: Checkpoint, name: str | None, default: str, files: Mapping[str, int | None] | None) -> _Side:
    if isinstance(checkpoint, CheckpointState):
        return _Side(name or default, checkpoint, dict(files or {}))
    from .convert.files import load_any

    path = os.fspath(checkpoint)
    state = load_any(path)
    shown = name or path
    if files is not None:
        return _Side(shown, state, dict(files))
    if targets.is_object_url(path):
        return _Side(shown, state, {shown: None})
    sizes: dict[str, int | None] = {}
    for suffix in ("", ".data"):  # (a checkpoint's external data file sits beside it)
        if suffix and not state.has_external_data:
            continue
        try:
            sizes[shown + suffix] = os.stat(path + suffix).st_size
        except OSError:
            sizes[shown + suffix] = None
    return _Side(shown, state, sizes)


def _nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, PackedBits):
        return int(value.packed.nbytes)
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "SU":
        return sum(len(str(s).encode()) for s in array.ravel())
    return int(array.nbytes)


def _e(value: Any) -> str:
    """Text from a file, as HTML text or attribute (quotes too). Characters that do not print
    are written out as Python's repr writes them: a right-to-left override would turn the name
    and the text after it around, a zero-width space make two names look alike."""
    return html.escape(texts.printable(str(value)), quote=True)


# A property's value is shown up to this many characters: a string of megabytes stays in the
# file, not in the page.
_PROPERTY_SHOWN = 500


def _clipped(text: str) -> str:
    if len(text) <= _PROPERTY_SHOWN:
        return text
    return f"{text[:_PROPERTY_SHOWN]}\u2026 ({_count(len(text))} characters)"


def _num(x: float | None) -> str:
    if x is None:
        return "&ndash;"
    if x == 0:
        return "0"
    return f"{x:.4g}"


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _count(n: int) -> str:
    return f"{n:,}"


def _shape(shape: Sequence[int]) -> str:
    return "&times;".join(map(str, shape)) or "scalar"


def _flags(s: TensorStats) -> str:
    parts = [(s.nan, "NaN"), (s.posinf, "+Inf"), (s.neginf, "&minus;Inf")]
    return " ".join(f'<span class="badge">{_count(n)} {what}</span>' for n, what in parts if n)


def _histogram_svg(counts: np.ndarray, edges: np.ndarray) -> str:
    """Bars of the counts, 120 by 28 pixels, with the range as its title (a tooltip)."""
    width, height = 120, 28
    top = int(counts.max()) if counts.size else 0
    bar = width / max(len(counts), 1)
    rects = []
    for i, c in enumerate(counts.tolist()):
        if not c:
            continue
        h = max(1.0, height * c / top)
        rects.append(f'<rect x="{i * bar:.1f}" y="{height - h:.1f}" width="{bar - 0.6:.1f}" height="{h:.1f}"/>')
    title = f"{len(counts)} bins from {_num(float(edges[0]))} to {_num(float(edges[-1]))}"
    return (
        f'<svg class="hist" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f"<title>{_e(title)}</title>{''.join(rects)}</svg>"
    )


def _histogram_of(value: Any, s: TensorStats) -> tuple[np.ndarray, np.ndarray] | None:
    """The counts and edges of the tensor's finite values in equal bins from min to max; None
    when float64 cannot hold that span (max - min overflows: values near both ends of float64)."""
    assert s.min is not None and s.max is not None
    if s.min == s.max:  # one value, one bar (NumPy's range around it has no width for values past 2**53)
        return np.array([s.finite]), np.array([s.min, s.max])
    try:
        return histogram(value, bins=_BINS, range=(s.min, s.max))
    except ValueError:
        return None


class _Page:
    def __init__(self, side: _Side, other: _Side | None, histograms: int) -> None:
        self.side, self.other, self.histograms = side, other, histograms
        self.values: dict[TensorKey, Any] = dict(side.state.tensors())
        self.stats = tensor_stats(side.state)
        self.ids = {key: f"t{i}" for i, key in enumerate(self.stats)}  # (ids never carry a name)

    def render(self) -> str:
        title = f"ortckpt report: {self.side.name}" + (f" against {self.other.name}" if self.other else "")
        body = [
            f"<header><h1>{_e(self.side.name)}</h1>",
            f'<p class="sub">{("against " + _e(self.other.name) + " · ") if self.other else ""}'
            f"ortckpt {_e(VERSION)} report</p></header>",
            self._flagged(),
            self._summary(),
            self._changes() if self.other else "",
            self._table(),
        ]
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            # Nothing to load from anywhere: styles and images are inline, scripts are none.
            '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            "style-src 'unsafe-inline'; img-src data:\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(part for part in body if part)
            + "\n</body></html>\n"
        )

    def _summary(self) -> str:
        state = self.side.state
        roles = Counter(key.role for key in self.values)
        dtypes = Counter(s.dtype for s in self.stats.values())
        parameter_bytes = sum(_nbytes(v) for key, v in self.values.items() if not key.is_momentum)
        optimizer_bytes = sum(_nbytes(v) for key, v in self.values.items() if key.is_momentum)
        files = "".join(f"<li><code>{_e(f)}</code> {_size(n)}</li>" for f, n in self.side.files.items())
        cards = [
            ("Files", f"<ul>{files}</ul>" if files else "<p>(a state in memory)</p>"),
            (
                "Tensors",
                f"<p class='big'>{_count(len(self.stats))}</p><p>"
                + ", ".join(f"{_count(roles[r])} {r}" for r in ("trainable", "frozen", "momentum"))
                + (" · <b>nominal</b> (no parameter values)" if state.is_nominal else "")
                + "</p>",
            ),
            (
                "Bytes",
                f"<p class='big'>{_size(parameter_bytes + optimizer_bytes)}</p>"
                f"<p>parameters {_size(parameter_bytes)}, optimizer state {_size(optimizer_bytes)}</p>",
            ),
            ("Dtypes", "<p>" + ", ".join(f"{_e(d)} &times; {_count(n)}" for d, n in sorted(dtypes.items())) + "</p>"),
        ]
        groups = state.optimizer_groups
        rows = "".join(
            f"<tr><td><code>{_e(g)}</code></td><td>{_count(group.step)}</td>"
            f"<td>{_num(group.initial_learning_rate)}</td><td>{_count(len(group.momentums))}</td></tr>"
            for g, group in groups.items()
        )
        cards.append(
            (
                "Optimizer",
                "<table class='mini'><tr><th>group</th><th>step</th><th>learning rate</th><th>parameters</th></tr>"
                f"{rows}</table>"
                if groups
                else "<p>no optimizer state</p>",
            )
        )
        props = "".join(
            f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(_clipped(repr(v)))}</code></td></tr>"
            for k, v in state.properties
        )
        cards.append(("Properties", f"<table class='mini'>{props}</table>" if props else "<p>none</p>"))
        return (
            '<section class="cards">'
            + "".join(
                f'<div class="card{" wide" if title in _WIDE else ""}"><h2>{title}</h2>{content}</div>'
                for title, content in cards
            )
            + "</section>"
        )

    def _flagged(self) -> str:
        flagged = [s for s in self.stats.values() if s.flagged]
        if not flagged:
            return '<section class="ok" id="flagged"><p>✓ No tensor holds NaN or Inf.</p></section>'
        items = "".join(
            f'<li><a href="#{self.ids[key]}"><code>{_e(s.name)}</code></a> {_flags(s)}'
            f" <span class='muted'>of {_count(s.elements)}</span></li>"
            for key, s in self.stats.items()
            if s.flagged
        )
        return (
            f'<section class="alert" id="flagged"><h2>⚠ {_count(len(flagged))} of {_count(len(self.stats))} '
            f"tensors hold NaN or Inf</h2><ul>{items}</ul></section>"
        )

    def _changes(self) -> str:
        assert self.other is not None
        ours = self.stats
        theirs = [key for key, _value in self.other.state.tensors()]
        shared = set(theirs)
        changes = tensor_changes(self.other.state, self.side.state)  # what went from `against` to this
        only_here = [key for key in ours if key not in shared]
        only_there = [key for key in theirs if key not in ours]
        unlike = [key for key in ours if key in shared and key not in changes]  # (dtype, shape or strings)
        changed = [c for c in changes.values() if c.changed]
        top = max((c.relative or 0.0 for c in changed), default=0.0)
        rows = "".join(self._change_row(c, top) for c in changed)
        parts = [
            f"<section><h2>Changes from <code>{_e(self.other.name)}</code></h2>",
            (
                f"<p>{_count(len(changed))} of {_count(len(changes))} tensors changed, largest first: the L2 norm "
                f"of the difference, relative to the norm in <code>{_e(self.other.name)}</code>, and the largest "
                "absolute difference, of the finite values (NaN/Inf changes first, counted apart).</p>"
                if changed
                else f"<p>No tensor changed ({_count(len(changes))} compared).</p>"
            ),
        ]
        if changed:
            parts.append(
                "<table class='grid' id='changes'><thead><tr><th>tensor</th><th class='n'>changed</th>"
                "<th class='n'>L2 of change</th><th colspan='2'>relative</th><th class='n'>max |&Delta;|</th>"
                "<th class='n'>NaN/Inf changed</th></tr></thead>"
                f"<tbody>{rows}</tbody></table>"
            )
        moved = self._other_changes()
        if moved:
            items = "".join(
                f"<tr><td><code>{_e(name)}</code></td><td><code>{_e(_clipped(repr(a)))}</code></td>"
                f"<td><code>{_e(_clipped(repr(b)))}</code></td></tr>"
                for name, (a, b) in moved.items()
            )
            parts.append(
                f"<h3>Optimizer state and properties that changed: {_count(len(moved))}</h3>"
                "<table class='mini' id='other-changes'><tr><th>name</th>"
                f"<th>in <code>{_e(self.other.name)}</code></th><th>here</th></tr>{items}</table>"
            )
        for label, names in (
            (f"Only in <code>{_e(self.side.name)}</code>", only_here),
            (f"Only in <code>{_e(self.other.name)}</code>", only_there),
            ("In both, not comparable (dtype, shape or strings differ)", unlike),
        ):
            if names:
                items = "".join(f"<li><code>{_e(key.label)}</code></li>" for key in names)
                parts.append(f"<h3>{label}: {_count(len(names))}</h3><ul class='names'>{items}</ul>")
        parts.append("</section>")
        return "\n".join(parts)

    def _other_changes(self) -> dict[str, tuple[Any, Any]]:
        """Optimizer groups' steps and learning rates, and properties, that differ from ``against``
        (None: absent on that side)."""
        assert self.other is not None
        found = beyond_tensors(self.other.state, self.side.state)
        return {
            **{f"optimizer {name}": values for name, values in found.optimizer.items()},
            **{f"property {name}": values for name, values in found.properties.items()},
        }

    def _change_row(self, c: TensorChange, top: float) -> str:
        width = 0.0 if not top or c.relative is None else 100 * c.relative / top
        flagged = " class='flagged'" if c.nonfinite else ""
        return (
            f"<tr{flagged}><td><code>{_e(c.name)}</code></td>"
            f"<td class='n'>{_count(c.changed)} / {_count(c.elements)}</td><td class='n'>{_num(c.l2)}</td>"
            f"<td class='n'>{_num(c.relative)}</td>"
            f"<td class='barcell'><div class='bar' style='width:{width:.1f}%'></div></td>"
            f"<td class='n'>{_num(c.max_abs)}</td><td class='n'>{_count(c.nonfinite) if c.nonfinite else ''}</td></tr>"
        )

    def _drawn(self) -> set[TensorKey]:
        """The tensors that get a histogram: those holding NaN or Inf, then the largest."""
        numeric = [(key, s) for key, s in self.stats.items() if s.min is not None]
        numeric.sort(key=lambda ks: (not ks[1].flagged, -ks[1].elements, ks[1].name, ks[0]))
        return {key for key, _s in numeric[: self.histograms]}

    def _table(self) -> str:
        drawn = self._drawn()
        rows = []
        for key, s in self.stats.items():
            hist = ""
            if key in drawn:
                bars = _histogram_of(self.values[key], s)
                hist = _histogram_svg(*bars) if bars else "<span class='muted'>range too wide to bin</span>"
            flagged = " class='flagged'" if s.flagged else ""
            rows.append(
                f"<tr id='{self.ids[key]}'{flagged}><td><code>{_e(s.name)}</code> {_flags(s)}</td>"
                f"<td>{_e(s.role)}</td><td>{_e(s.dtype)}</td><td>{_shape(s.shape)}</td>"
                + "".join(f"<td class='n'>{_num(x)}</td>" for x in (s.min, s.max, s.mean, s.std, s.l2))
                + f"<td>{hist}</td></tr>"
            )
        numeric = sum(1 for s in self.stats.values() if s.min is not None)
        note = (
            f"Histograms of the finite values ({_BINS} bins from min to max) for "
            + (
                f"all {_count(numeric)} numeric tensors"
                if len(drawn) == numeric
                else f"the {_count(len(drawn))} largest of {_count(numeric)} numeric tensors (NaN/Inf ones first)"
            )
            + ". Figures are of the finite values."
        )
        return (
            f"<section><h2>Tensors</h2><p class='muted'>{note}</p>"
            "<table class='grid' id='tensors'><thead><tr><th>tensor</th><th>role</th><th>dtype</th><th>shape</th>"
            "<th class='n'>min</th><th class='n'>max</th><th class='n'>mean</th><th class='n'>std</th>"
            "<th class='n'>L2</th><th>histogram</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></section>"
        )


_WIDE = ("Optimizer", "Properties")  # cards holding a table: two columns of the grid
_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#f6f8fa;--accent:#0969da;--bad:#cf222e;--badbg:#ffebe9}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);margin:0;padding:24px 32px;
max-width:1400px}
header h1{font-size:22px;margin:0;word-break:break-all}
.sub,.muted{color:var(--muted)}
.sub{margin:2px 0 18px}
h2{font-size:16px;margin:0 0 8px}
h3{font-size:14px;margin:14px 0 6px}
section{margin:0 0 20px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;word-break:break-all}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:12px}
.card.wide{grid-column:span 2}
.card code{word-break:normal;overflow-wrap:anywhere}
.card{border:1px solid var(--line);border-radius:8px;padding:12px 14px;background:#fff}
.card h2{font-size:12px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted)}
.card p,.card ul{margin:4px 0}
.card ul{padding-left:18px}
.big{font-size:24px;font-weight:600}
.mini{border-collapse:collapse;width:100%}
.mini th,.mini td{text-align:left;padding:2px 10px 2px 0;border-bottom:1px solid var(--line);vertical-align:top}
.mini th{font-weight:600;color:var(--muted);font-size:12px}
.mini td:first-child{min-width:8em;width:35%}
th.n{text-align:right}
.alert{border:1px solid var(--bad);background:var(--badbg);border-radius:8px;padding:12px 14px}
.alert h2{color:var(--bad)}
.alert ul{margin:0;padding-left:18px}
.ok{border:1px solid #1a7f37;background:#dafbe1;border-radius:8px;padding:8px 14px}
.ok p{margin:0;color:#1a7f37}
.grid{border-collapse:collapse;width:100%}
.grid th{position:sticky;top:0;background:var(--bg);text-align:left;font-size:12px;color:var(--muted);
border-bottom:2px solid var(--line);padding:6px 8px}
.grid td{border-bottom:1px solid var(--line);padding:4px 8px;vertical-align:middle}
.grid tbody tr:nth-child(even){background:#fbfcfd}
.grid tr.flagged,.grid tr.flagged:nth-child(even){background:var(--badbg)}
.grid tr.flagged td:first-child{border-left:4px solid var(--bad)}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;background:var(--bad);color:#fff;border-radius:10px;padding:0 7px;font-size:11px;
font-weight:600;white-space:nowrap}
.barcell{width:140px}
.bar{height:10px;background:var(--accent);border-radius:2px;min-width:1px}
svg.hist{display:block;fill:var(--accent)}
tr.flagged svg.hist{fill:var(--bad)}
ul.names{columns:3 260px;margin:0;padding-left:18px}
a{color:var(--accent)}
"""


__all__ = ["DEFAULT_HISTOGRAMS", "render_report", "write_report"]
