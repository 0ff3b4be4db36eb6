"""The README's performance chart: save and load throughput of one workload of a suite run, ortckpt
against its peers, as a small SVG a reader takes in at a glance.

    python benches/suite.py --sizes 1 --shapes transformer --dtypes float32 --rounds 5 --out OUT
    python benches/chart.py OUT/results.json docs/performance.svg

Plain SVG written here (no plotting library): bars of median GiB/s (higher is faster), the same-run
baseline in grey (a plain write() of the same bytes; the same bytes mapped and read once, the fair
peer of a mapped load, since a plain read() also pays a fresh buffer's page faults and a copy), and
the run's date, machine and command under it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
from html import escape
from pathlib import Path

GiB = 2**30
WIDTH, MARGIN, BAR, GAP, LABEL, TOP = 760, 10, 16, 5, 150, 34
PANEL = (WIDTH - 2 * MARGIN - 20) // 2  # two panels side by side: save, load
COLOURS = {"ortckpt": "#d9480f", "baseline": "#adb5bd", "peer": "#4c6ef5"}
# What the chart shows of a run (the suite measures more: results.md has every contender): ortckpt, the
# plain-file baseline, and the peers a user would otherwise choose; torch only where the run had it.
SHOWN = {
    "save": (
        "ortckpt",
        "write() (baseline)",
        "safetensors",
        "torch.save",
        "ONNX Runtime state path",
        "pure-Python flatbuffers",
    ),
    "load": ("ortckpt", "mmap (baseline)", "safetensors", "torch.load", "ONNX Runtime"),
}
LABELS = {"ONNX Runtime state path": "ONNX Runtime", "pure-Python flatbuffers": "pure-Python flatbuffers"}


def throughputs(times: dict[str, list[float]], nbytes: int, shown: tuple[str, ...]) -> list[tuple[str, float]]:
    """(label, median GiB/s) of each contender shown that the run measured, fastest first."""
    rows = [(LABELS.get(n, n), nbytes / GiB / statistics.median(times[n])) for n in shown if times.get(n)]
    return sorted(rows, key=lambda row: -row[1])


def colour(name: str) -> str:
    if name == "ortckpt":
        return COLOURS["ortckpt"]
    return COLOURS["baseline"] if "baseline" in name else COLOURS["peer"]


def panel(x0: int, title: str, rows: list[tuple[str, float]]) -> list[str]:
    """One horizontal bar a contender, on the panel's own linear scale (save and load differ 3x)."""
    top = max(v for _, v in rows)
    out = [f'<text x="{x0}" y="{TOP - 12}" font-weight="bold">{escape(title)}</text>']
    span = PANEL - LABEL - 50
    for i, (name, gib_s) in enumerate(rows):
        y = TOP + i * (BAR + GAP)
        length = max(1.0, span * gib_s / top)
        out.append(f'<text x="{x0 + LABEL - 6}" y="{y + BAR - 4}" text-anchor="end">{escape(name)}</text>')
        out.append(
            f'<rect x="{x0 + LABEL}" y="{y}" width="{length:.1f}" height="{BAR}" fill="{colour(name)}">'
            f"<title>{escape(name)}: {gib_s:.3g} GiB/s</title></rect>"
        )
        out.append(f'<text x="{x0 + LABEL + length + 4:.1f}" y="{y + BAR - 4}">{gib_s:.2g}</text>')
    return out


def chart(saved: dict, workload: str | None, note: str) -> str:
    results = saved["results"]
    result = next((r for r in results if workload in (None, r["workload"])), None)
    if result is None:
        raise SystemExit(f"no workload {workload!r} in the results: {[r['workload'] for r in results]}")
    save = throughputs(result["save"], result["bytes"], SHOWN["save"])
    load = throughputs(result["load"], result["bytes"], SHOWN["load"])
    meta = saved["meta"]
    caption = [
        f"{result['workload']} ({result['tensors']} tensors, {result['bytes'] / GiB:.2f} GiB): median GiB/s of "
        f"{meta['rounds']} rounds, higher is faster; grey: plain file I/O of the same bytes, same run.",
        f"{meta['date']}, {meta['machine']}. {note}".strip(),
        *textwrap.wrap(meta["command"], 125),
    ]
    height = TOP + max(len(save), len(load)) * (BAR + GAP) + 8 + 15 * len(caption)
    body = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        *panel(MARGIN, "save (to a new file)", save),
        *panel(MARGIN + PANEL + 20, "load (every byte read)", load),
    ]
    for i, line in enumerate(caption):
        y = height - 8 - 15 * (len(caption) - 1 - i)
        body.append(f'<text x="{MARGIN}" y="{y}" fill="#495057" font-size="10">{escape(line)}</text>')
    return "\n".join([*body, "</svg>"]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results.json of benches/suite.py")
    parser.add_argument("out", type=Path, help="the SVG to write")
    parser.add_argument("--workload", help="which workload (default: the first)")
    parser.add_argument("--note", default="", help="a sentence after the run's date and machine (how busy it was)")
    args = parser.parse_args()
    saved = json.loads(args.results.read_text())
    args.out.write_text(chart(saved, args.workload, args.note))


if __name__ == "__main__":
    main()
