"""Steps of a mostly frozen model on s3:// share their unchanged values (ortckpt.stepstore.objects):
a step uploads only what changed, its checkpoint object reading the rest from a data object of the
run's shared folder that earlier steps uploaded; every step restores, verifies and loads on its own,
and a shared object goes only when no kept step names it. Against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import numpy as np
import ortckpt.object_store as object_store
import pytest
from ortckpt import CheckpointManager, CheckpointState, targets
from ortckpt.stepstore import objects

FROZEN = 72 << 20  # past objects.SHARE_MIN_BYTES: the values go to a shared data object
TRAINABLE = 1 << 20


def model(step: int, frozen: dict[str, np.ndarray]) -> CheckpointState:
    """A frozen part that never changes, and a trainable part that does at every step."""
    trainable = {"head": np.full(TRAINABLE // 4, float(step), dtype=np.float32)}
    return CheckpointState.from_arrays(trainable, frozen)


def frozen_part() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"layer{i}": rng.standard_normal(FROZEN // 4 // 8, dtype=np.float32) for i in range(8)}


def shared_keys(url: str, options: dict) -> list[str]:
    listed = object_store.list_keys(targets.object_location(url, options))
    return sorted(key for key, _ in listed if key.startswith("shared/"))


def test_steps_upload_only_what_changed_and_each_restores_alone(s3_server, s3_url):
    options = s3_server.storage_options()
    frozen = frozen_part()
    uploaded = []
    with CheckpointManager(s3_url, storage_options=options, max_to_keep=3) as manager:
        for step in range(1, 6):
            before = object_store.bytes_put()
            manager.save(model(step, frozen), step)
            uploaded.append(object_store.bytes_put() - before)
        assert manager.all_steps() == [3, 4, 5]
    print("uploaded per step:", uploaded)
    assert uploaded[0] > FROZEN
    assert all(later < 0.1 * uploaded[0] for later in uploaded[1:]), uploaded
    # One data object, uploaded by step 1 (retired), named by every kept step.
    assert len(shared_keys(s3_url, options)) == 1
    with CheckpointManager(s3_url, storage_options=options, read_only=True) as reader:
        for step in reader.all_steps():
            restored = reader.restore(step)
            np.testing.assert_array_equal(restored.parameters["head"].data, np.full(TRAINABLE // 4, float(step)))
            for name, value in frozen.items():
                np.testing.assert_array_equal(restored.parameters[name].data, value)
            assert reader.verify(step)
