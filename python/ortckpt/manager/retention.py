"""Which checkpoints a :class:`~ortckpt.CheckpointManager` keeps.

The rules combine as Orbax's ``AnyPreservationPolicy`` combines its policies: a
checkpoint is kept when any configured rule keeps it, and the newest checkpoint is
always kept. With no rule configured, every checkpoint is kept.

- ``max_to_keep=K``: the K newest (by step).
- ``keep_best=(metric, "min" | "max", k)``: the k best by that metric. A checkpoint
  saved without the metric (or with NaN) is not ranked: only the other rules keep it.
  Ties go to the newer step.
- ``keep_every=M``: every checkpoint whose step is a multiple of M, forever.

Deciding is pure (no files), so it is tested against a reference model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .. import arguments
from . import arguments as options


@dataclass(frozen=True)
class RetentionPolicy:
    max_to_keep: int | None = None
    keep_best: tuple[str, Literal["min", "max"], int] | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        # Checked (naming the argument: a float or a bool is no count) and kept as plain ints.
        object.__setattr__(self, "max_to_keep", arguments.optional_count("max_to_keep", self.max_to_keep))
        object.__setattr__(self, "keep_best", options.keep_best(self.keep_best))
        object.__setattr__(self, "keep_every", arguments.optional_count("keep_every", self.keep_every))

    @property
    def deletes_anything(self) -> bool:
        return self.max_to_keep is not None or self.keep_best is not None or self.keep_every is not None

    def metric_of(self, metrics: Mapping[str, float] | None) -> float | None:
        """The ranking metric of a checkpoint, or None when it is not ranked."""
        if self.keep_best is None or not metrics:
            return None
        value = metrics.get(self.keep_best[0])
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return None
        return float(value)

    def steps_to_keep(self, checkpoints: Sequence[tuple[int, Mapping[str, float] | None]]) -> set[int]:
        """``checkpoints``: (step, metrics) of every complete checkpoint; returns the steps to keep."""
        steps = sorted(step for step, _ in checkpoints)
        if not self.deletes_anything or not steps:
            return set(steps)
        keep = {steps[-1]}
        if self.max_to_keep is not None:
            keep.update(steps[-self.max_to_keep :])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            keep.update(self.ranked(checkpoints)[: self.keep_best[2]])
        return keep

    def steps_to_compress(self, checkpoints: Sequence[tuple[int, Mapping[str, float] | None]]) -> set[int]:
        """The steps kept only by ``keep_every`` or ``keep_best``: kept, but neither the newest
        nor among the newest ``max_to_keep`` (what a run may still resume or roll back to)."""
        steps = sorted(step for step, _ in checkpoints)
        if not steps or (self.keep_every is None and self.keep_best is None):
            return set()
        live = {steps[-1], *(steps[-self.max_to_keep :] if self.max_to_keep is not None else [])}
        return self.steps_to_keep(checkpoints) - live

    def ranked(self, checkpoints: Sequence[tuple[int, Mapping[str, float] | None]]) -> list[int]:
        """The steps of the checkpoints that have ``keep_best``'s metric, best first; among
        equals, the newer step first."""
        assert self.keep_best is not None
        mode = self.keep_best[1]
        ranked = [(m, step) for step, metrics in checkpoints if (m := self.metric_of(metrics)) is not None]
        ranked.sort(key=lambda ms: (ms[0] if mode == "min" else -ms[0], -ms[1]))
        return [step for _, step in ranked]
