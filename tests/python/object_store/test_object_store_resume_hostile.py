"""A hostile metadata.json for a resumed writer on s3://: step 2's entry for its shared data object
replaced by step 1's (another object of the run's shared folder, its entry copied whole, so every
field names a real object). The restore must refuse it (the checkpoint object is paired with
another data object), and hash nothing a later save would share from."""

from __future__ import annotations

import json

import ortckpt.object_store as object_store
import pytest
from ortckpt import CheckpointError, CheckpointManager, targets
from test_object_store_dedup import (
    SMALL,
    assert_is,
    data_object,
    frozen_part,
    model,
    small_share,  # noqa: F401  (the fixture)
    uploaded_by,
)


def test_a_metadata_entry_naming_another_object_of_the_run_is_refused(s3_server, s3_url, small_share):  # noqa: F811
    options = s3_server.storage_options()
    old, new = frozen_part(1), frozen_part(2)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, old), 1)
        first.save(model(2, new), 2)  # (another frozen part: a data object of its own)
        assert data_object(first, 1) != data_object(first, 2)
        entry = first.all()[0].metadata["files"]["checkpoint.data"]
    listed = object_store.list_keys(targets.object_location(s3_url, options))
    (key,) = [k for k, _ in listed if k.startswith("step_00000002/") and k.endswith("metadata.json")]
    where = targets.object_location(f"{s3_url}/{key}", options)
    document = json.loads(bytes(object_store.get(where)))
    document["files"]["checkpoint.data"] = entry
    object_store.put(where, json.dumps(document).encode())
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        with pytest.raises(CheckpointError, match="different saves"):  # (the pair ids differ)
            resumed.restore(2)
        assert uploaded_by(lambda: resumed.save(model(3, new), 3)) > 4 * SMALL
        assert_is(resumed.restore(3), 3, new)
        resumed.verify(3)
