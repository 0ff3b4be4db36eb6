"""Lone surrogates (text that is no Unicode) where a state or a save's arguments can hold them: what the
state's and the manager's tests of values refuse alike."""

from __future__ import annotations

import numpy as np
from ortckpt import CheckpointState, OptimizerGroup

SURROGATE = "a\udc80b"


def no_bare_unicode_error(error: BaseException) -> None:
    assert not isinstance(error, UnicodeError), repr(error)
    str(error).encode("utf-8")  # the message itself prints on any terminal


def surrogate_in(where: str) -> CheckpointState:
    """A state that holds a lone surrogate where only save() can see it (intake refuses the rest)."""
    vocab = np.array(["a", "b"], dtype=object)
    s = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"vocab": vocab})
    if where == "string element":
        vocab[1] = SURROGATE  # changed after intake
    elif where == "optimizer group name":
        s.optimizer_groups = {SURROGATE: OptimizerGroup(1, 0.1, {"w": {"momentum0": np.zeros(2, np.float32)}})}
    elif where == "momentum name":
        s.optimizer_groups = {"group0": OptimizerGroup(1, 0.1, {"w": {SURROGATE: np.zeros(2, np.float32)}})}
    elif where == "momentum's parameter name":
        s.optimizer_groups = {"group0": OptimizerGroup(1, 0.1, {SURROGATE: {"momentum0": np.zeros(2, np.float32)}})}
    return s


PLACES = ["string element", "optimizer group name", "momentum name", "momentum's parameter name"]
