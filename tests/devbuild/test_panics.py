"""Run on the development build only (`make test` runs it after `make build`): the wheel has
no `_core._panic_for_test`, the hook that panics inside the boundary's guard on purpose."""

from __future__ import annotations

import numpy as np
import pytest
from ortckpt import CheckpointState, _core
from ortckpt.errors import CheckpointError, InternalError


@pytest.mark.parametrize("release_gil", [False, True], ids=["gil-held", "gil-released"])
def test_a_panic_in_the_core_becomes_an_internal_error(release_gil):
    with pytest.raises(InternalError, match="deliberate panic") as caught:
        _core._panic_for_test("deliberate panic", release_gil)
    assert isinstance(caught.value, CheckpointError)
    # The interpreter and the library still work afterwards.
    assert CheckpointState.from_arrays({"w": np.ones(3, np.float32)}).parameters["w"].data.sum() == 3
