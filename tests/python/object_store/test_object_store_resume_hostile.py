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
        with pytest.raises(CheckpointError, match="different saves") as refused:  # (the pair ids differ)
            resumed.restore(2)
        # (named as the step's object, not as the scratch copy it was downloaded to)
        assert refused.value.filename.startswith("s3://") and "step_00000002" in str(refused.value), refused.value
        assert uploaded_by(lambda: resumed.save(model(3, new), 3)) > 4 * SMALL
        assert_is(resumed.restore(3), 3, new)
        resumed.verify(3)


def test_the_shared_object_put_again_with_its_own_bytes_after_the_restore(s3_server, s3_url, small_share, monkeypatch):  # noqa: F811
    """The restored step's data object uploaded again, the same bytes in parts (another ETag): not
    the object hashed, so the next step goes up whole; it restores and verifies alone."""
    options = s3_server.storage_options()
    frozen = frozen_part(1, 12 * SMALL)  # (in 5 MiB parts, the server's least)
    with CheckpointManager(s3_url, storage_options=options) as first:
        first.save(model(1, frozen), 1)
    with CheckpointManager(s3_url, storage_options=options) as resumed:
        resumed.restore()
        where = targets.object_location(f"{s3_url}/{data_object(resumed)}", options)
        before = object_store.head(where)
        with monkeypatch.context() as parts:
            parts.setattr(object_store, "PART_BYTES", 5 << 20)
            again = object_store.put_stream(where, [bytes(object_store.get(where))])
        assert before is not None and again.etag != before.etag and again.size == before.size
        assert uploaded_by(lambda: resumed.save(model(2, frozen), 2)) > 12 * SMALL
        resumed.delete(1)
        assert_is(resumed.restore(2), 2, frozen)
        resumed.verify(2)
