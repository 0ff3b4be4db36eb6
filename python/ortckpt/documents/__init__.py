"""Every JSON document ortckpt reads, validated before anything uses it.

A document is read by :func:`parse` with the caps of its kind, checked before it is parsed
(its bytes, and the JSON values those bytes can make: what parsing will allocate) and after
(its nesting depth), then checked against its schema: the manager's ``metadata.json``, the
sharded ``index.json``, the safetensors header and its ``__ortckpt__`` entry, the footer of a
compressed checkpoint and the holder record of a directory's writer lock. The checks' own work
is bounded too (linear in the values, and a budget for what is not, e.g. an index's tiling
grids), so a hostile document under its caps costs time and memory known in advance. Whatever
is wrong raises :class:`DocumentError` (a :class:`~ortckpt.CheckpointFormatError`) naming the
file and the place in the document, e.g. ``index.json: shards[0].file``; no caller ever indexes
into unchecked JSON.

The schemas are written as plain functions over the parsed value (no dependency), one per
kind, in the order the document's fields appear: ``metadata.json`` in :mod:`.metadata`, the
sharded ``index.json`` in :mod:`.index`, the JSON other files carry in :mod:`.files`, over
:mod:`.base` (parsing, caps, building blocks). Every name is re-exported here:
``documents.parse``, ``documents.METADATA``, ...
"""

from .base import BYTES_PER_VALUE, INT64_MAX, NON_FINITE, DocumentError, Kind, depth_of, parse
from .files import (
    COMPRESSED_FOOTER,
    COMPRESSED_FORMAT,
    COMPRESSED_ROLES,
    COMPRESSED_VERSION,
    GROUPED_ITEMSIZES,
    ORTCKPT_STRUCTURE,
    SAFETENSORS_HEADER,
    WRITER_HOLDER,
    check_compressed,
    check_holder,
    check_safetensors_header,
    check_structure,
)
from .index import (
    GRID_CELLS_MIN,
    INDEX_NAME,
    MAX_INDEX_TILING_CELLS,
    MAX_RANK,
    MAX_TILING_CELLS,
    MAX_WORLD_SIZE,
    SHARDED_FORMAT,
    SHARDED_INDEX,
    SHARDED_VERSION,
    TilingBudget,
    check_index,
    shard_file_name,
    tiling_problem,
)
from .metadata import (
    ARTIFACT_ROLE,
    ATTEMPT,
    MAX_ARTIFACT_BYTES,
    MAX_ARTIFACTS,
    METADATA,
    METADATA_FORMAT,
    NON_FINITE_KEY,
    artifact_name,
    check_metadata,
    decode_metric,
    encode_metric,
    encode_non_finite,
    is_etag,
)

__all__ = [
    "ARTIFACT_ROLE",
    "ATTEMPT",
    "BYTES_PER_VALUE",
    "COMPRESSED_FOOTER",
    "COMPRESSED_FORMAT",
    "COMPRESSED_ROLES",
    "COMPRESSED_VERSION",
    "GRID_CELLS_MIN",
    "GROUPED_ITEMSIZES",
    "INDEX_NAME",
    "INT64_MAX",
    "MAX_ARTIFACTS",
    "MAX_ARTIFACT_BYTES",
    "MAX_INDEX_TILING_CELLS",
    "MAX_RANK",
    "MAX_TILING_CELLS",
    "MAX_WORLD_SIZE",
    "METADATA",
    "METADATA_FORMAT",
    "NON_FINITE",
    "NON_FINITE_KEY",
    "ORTCKPT_STRUCTURE",
    "SAFETENSORS_HEADER",
    "SHARDED_FORMAT",
    "SHARDED_INDEX",
    "SHARDED_VERSION",
    "WRITER_HOLDER",
    "DocumentError",
    "Kind",
    "TilingBudget",
    "artifact_name",
    "check_compressed",
    "check_holder",
    "check_index",
    "check_metadata",
    "check_safetensors_header",
    "check_structure",
    "decode_metric",
    "depth_of",
    "encode_metric",
    "encode_non_finite",
    "is_etag",
    "parse",
    "shard_file_name",
    "tiling_problem",
]
