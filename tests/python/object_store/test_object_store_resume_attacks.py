"""Attacks on a resumed writer on s3:// sharing from the data object of the step it restored
(ortckpt.stepstore.shared, SharedObjects.restored): the restored step deleted before the save,
a value of the restored state changed in place, an older step restored after a shared save. Each
step saved restores as saved and verifies on its own."""

from __future__ import annotations

import numpy as np
import pytest
from ortckpt import CheckpointManager
from test_object_store_dedup import (
    SMALL,
    TRAINABLE,
    assert_is,
    data_object,
    frozen_part,
    model,
    shared_keys,
    small_share,  # noqa: F401  (the fixture)
    uploaded_by,
)


@pytest.mark.parametrize("resave", [False, True])
def test_the_restored_step_deleted_before_the_save(s3_server, s3_url, small_share, resave):  # noqa: F811
    """Step 2 restored, then deleted: the next save follows step 1 (not the step restored), so it
    goes up whole, whether it is step 3 or step 2 again; it restores as saved alone."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
        first.save(model(2, frozen), 2)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        state = resumed.restore()
        assert_is(state, 2, frozen)
        resumed.delete(2)
        step = 2 if resave else 3
        state.parameters["head"] = np.full(TRAINABLE // 4, float(step), np.float32)
        assert uploaded_by(lambda: resumed.save(state, step)) > 4 * SMALL
        resumed.delete(1)
        assert resumed.all_steps() == [step] and len(shared_keys(s3_url, options)) == 1
        assert_is(resumed.restore(step), step, frozen)
        resumed.verify(step)


def test_a_restored_value_changed_in_place_is_saved_as_changed(s3_server, s3_url, small_share):  # noqa: F811
    """A frozen value of the restored state changed in place (its own buffer, hashed at the
    restore as the object's bytes): the save finds its new bytes nowhere in the object and
    uploads them; the step restores with the change."""
    options = s3_server.storage_options()
    frozen = frozen_part(1)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        state = resumed.restore()
        value = state.parameters["layer0"].data
        assert value.flags.writeable  # (the restored state's own memory)
        value[:16] += 1
        assert uploaded_by(lambda: resumed.save(state, 2)) < SMALL  # (that value, 0.5 MiB, and the head)
        assert data_object(resumed, 2) == data_object(resumed, 1)
        changed = {**frozen, "layer0": value.copy()}
        assert_is(resumed.restore(2), 1, changed)
        resumed.verify(2)
        assert_is(resumed.restore(1), 1, frozen)


def test_an_older_step_restored_after_a_shared_save(s3_server, s3_url, small_share):  # noqa: F811
    """Step 2 restored and step 3 saved sharing its object; then step 1 (another frozen part)
    restored and saved as step 4: only the values the object holds are shared, the others go up,
    and step 4 restores as step 1 was."""
    options = s3_server.storage_options()
    old, new = frozen_part(1), frozen_part(2)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, old), 1)
        first.save(model(2, new), 2)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        assert_is(resumed.restore(), 2, new)
        assert 10 * uploaded_by(lambda: resumed.save(model(3, new), 3)) < 4 * SMALL
        older = resumed.restore(1)
        assert_is(older, 1, old)
        resumed.save(older, 4)
        assert_is(resumed.restore(4), 1, old)
        resumed.verify(4)
