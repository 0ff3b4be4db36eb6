"""The HTML report in a real browser: headless Chromium (tests/python/helpers/browser.py drives it over
its DevTools pipe, offline) loads the page `ortckpt report --against` writes and finds no
script error, no console or log error, no request; the histograms drawn as SVG bars; the NaN/Inf
rows flagged (and painted so); a hostile tensor name shown as text, not made markup.

Without Chromium this test fails, saying how to install it (`make chromium`): it never skips."""

from __future__ import annotations

import numpy as np
import pytest
from browser import Browser, BrowserError, find_chromium
from ortckpt import CheckpointState, OptimizerGroup
from ortckpt.cli import OK, run

HOSTILE = '<script>document.title="owned"</script><img src=x onerror="document.title=1">'


def model(path, step: int, *, nan: bool) -> None:
    rng = np.random.default_rng(step)
    weights = {
        "fc1.weight": rng.normal(0, 0.05, (64, 32)).astype(np.float32),
        "fc2.weight": rng.normal(0, 0.1, (8, 64)).astype(np.float32),
        HOSTILE: np.full(4, float(step), np.float32),
    }
    if nan:
        weights["fc2.weight"][0, :2] = np.nan
        weights["fc2.weight"][3, 3] = np.inf
    state = CheckpointState.from_arrays(weights, properties={"epoch": step, HOSTILE: HOSTILE})
    state.optimizer_groups = {
        "group0": OptimizerGroup(step, 0.01, {n: {"momentum0": v * 0.1} for n, v in weights.items()})
    }
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)


def test_chromium_is_there():
    try:
        find_chromium()
    except BrowserError as e:
        pytest.fail(str(e))


def test_the_report_loads_in_chromium_without_errors_with_its_chart_and_flagged_rows(tmp_path):
    model(tmp_path / "a.ckpt", 1, nan=False)
    model(tmp_path / "b.ckpt", 2, nan=True)
    page = tmp_path / "report.html"
    assert run(["report", str(tmp_path / "b.ckpt"), "--against", str(tmp_path / "a.ckpt"), "-o", str(page)]) == OK
    with Browser() as browser:
        browser.open(page)
        found = browser.evaluate(
            """(() => {
                const names = sel => [...document.querySelectorAll(sel)].map(e => e.textContent);
                return {
                    title: document.title,
                    scripts: document.scripts.length,
                    images: document.images.length,
                    bars: [...document.querySelectorAll('#tensors svg')].map(s => s.querySelectorAll('rect').length),
                    barHeight: document.querySelector('#tensors svg rect').getBoundingClientRect().height,
                    flagged: names('#tensors tr.flagged td:first-child code'),
                    flaggedColor: getComputedStyle(document.querySelector('#tensors tr.flagged')).backgroundColor,
                    listed: names('#flagged li code'),
                    changes: names('#changes tr td:first-child code'),
                    heading: document.querySelector('h1').textContent,
                    rows: names('#tensors tbody tr td:first-child code'),
                };
            })()"""
        )
        browser.screenshot(tmp_path / "report.png")
        problems = browser.problems()
    assert problems == []  # no script error, no console or log error, no request
    assert found["scripts"] == 0 and found["images"] == 0  # the hostile name made no element
    assert found["title"].startswith("ortckpt report: ") and "owned" not in found["title"]
    assert HOSTILE in found["rows"] and f"group0/{HOSTILE}/momentum0" in found["rows"]
    assert len(found["bars"]) == len(found["rows"]) and all(n >= 1 for n in found["bars"])  # the chart, drawn
    assert found["barHeight"] > 0
    expected = ["fc2.weight", "group0/fc2.weight/momentum0"]
    assert found["flagged"] == expected and found["listed"] == expected
    assert found["flaggedColor"] == "rgb(255, 235, 233)"  # painted as flagged
    assert found["changes"][0] == "fc2.weight"  # its NaN and Inf changed: first
    assert found["heading"] == str(tmp_path / "b.ckpt")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_browser_check_sees_a_script_error_and_a_request(tmp_path):
    """The check above can fail: a page with a script error and an image to fetch is caught."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><img src="http://192.0.2.1/x.png"><script>undefinedFunction()</script>')
    with Browser() as browser:
        browser.open(page)
        problems = browser.problems()
    assert any(p.startswith("exception:") and "undefinedFunction" in p for p in problems), problems
    assert any(p == "a request: http://192.0.2.1/x.png" for p in problems), problems
