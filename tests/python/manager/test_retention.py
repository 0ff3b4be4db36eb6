"""Retention against a reference model: thousands of random save sequences and policies.

The reference decides each checkpoint on its own, by counting (newer checkpoints,
better-ranked checkpoints), over the whole history at once; the policy is applied the
way the manager applies it, after every save to what is left. Both must keep exactly
the same steps, and the newest checkpoint must survive every deletion.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortckpt import RetentionPolicy


def reference_kept(history: list[tuple[int, float | None]], max_to_keep, keep_best, keep_every) -> set[int]:
    if max_to_keep is None and keep_best is None and keep_every is None:
        return {s for s, _ in history}
    newest = max(s for s, _ in history)
    kept = set()
    for step, metric in history:
        newer = sum(1 for s, _ in history if s > step)
        keep = step == newest
        keep |= max_to_keep is not None and newer < max_to_keep
        keep |= keep_every is not None and step % keep_every == 0
        if keep_best is not None and metric is not None and not math.isnan(metric):
            _, mode, k = keep_best

            def better(other_step, other_metric, metric=metric, step=step, mode=mode):
                if other_metric is None or math.isnan(other_metric):
                    return False
                if other_metric == metric:
                    return other_step > step  # ties: the newer step ranks first
                return other_metric < metric if mode == "min" else other_metric > metric

            keep |= sum(1 for s, m in history if better(s, m)) < k
        if keep:
            kept.add(step)
    return kept


metrics = st.one_of(st.none(), st.floats(-5, 5, allow_nan=False), st.sampled_from([0.0, 1.0, float("nan")]))
policies = st.tuples(
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.tuples(st.just("loss"), st.sampled_from(["min", "max"]), st.integers(1, 4))),
    st.one_of(st.none(), st.integers(1, 7)),
)


@pytest.mark.once  # 3,000 random sequences of pure Python logic
@settings(max_examples=3000, deadline=None)
@given(policy=policies, gaps=st.lists(st.integers(1, 4), min_size=1, max_size=40), values=st.data())
def test_incremental_retention_matches_the_reference(policy, gaps, values):
    max_to_keep, keep_best, keep_every = policy
    rule = RetentionPolicy(max_to_keep, keep_best, keep_every)
    history, alive, step = [], {}, 0
    for gap in gaps:
        step += gap
        metric = values.draw(metrics)
        history.append((step, metric))
        alive[step] = None if metric is None else {"loss": metric}
        keep = rule.steps_to_keep(list(alive.items()))
        assert step in keep, "the newest checkpoint was deleted"
        alive = {s: m for s, m in alive.items() if s in keep}
    assert set(alive) == reference_kept(history, max_to_keep, keep_best, keep_every)


def test_without_rules_everything_is_kept():
    assert RetentionPolicy().steps_to_keep([(1, None), (2, None)]) == {1, 2}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_to_keep": 0},
        {"keep_every": 0},
        {"keep_best": ("loss", "lowest", 1)},
        {"keep_best": ("loss", "min", 0)},
        {"keep_best": ("loss", "min")},
    ],
)
def test_bad_rules_are_refused(kwargs):
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)
