"""The schemas of the JSON that other files carry: the safetensors header and its ``__ortckpt__``
entry, the holder record of a directory's writer lock, the footer of a compressed checkpoint."""

from __future__ import annotations

from typing import Any

from .base import (
    INT64_MAX,
    DocumentError,
    Kind,
    bad_value,
    check_int,
    check_ints,
    check_list,
    check_number,
    check_object,
    check_str,
    check_versioned,
    key_shown,
    value_shown,
)
from .index import MAX_RANK

# --- the safetensors header and ortckpt's entry in its metadata ----------------------------------------


def check_safetensors_header(value: Any, where: str) -> dict[str, Any]:
    """Types only (dtype names, integer shapes and offsets, string metadata); the byte ranges
    are checked against the file by the reader, which knows its size."""
    header = check_object(value, where, "the header")
    metadata = header.get("__metadata__", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DocumentError(f"{where}: __metadata__ is not a map of strings")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        at = f"tensor {key_shown(name)}"
        if not isinstance(entry, dict):
            raise bad_value(where, at, entry, "a dtype, shape and data_offsets")
        if not isinstance(entry.get("dtype"), str):
            raise bad_value(where, f"{at}: dtype", entry.get("dtype"), "a dtype name")
        shape = check_ints(entry.get("shape"), where, f"{at}: shape", 0, INT64_MAX)
        if len(shape) > MAX_RANK:  # (the reader multiplies them: quadratic in a hostile rank)
            raise DocumentError(f"{where}: {at}: shape has {len(shape)} dimensions, more than a tensor's {MAX_RANK}")
        offsets = check_ints(entry.get("data_offsets"), where, f"{at}: data_offsets", 0, INT64_MAX)
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise bad_value(where, f"{at}: data_offsets", offsets, "[begin, end] with begin <= end")
    return {**header, "__metadata__": metadata}


# The safetensors format caps a header at 100 MB (so does the safetensors package). A tensor's
# entry is 12 values in 60 bytes or more ({"dtype": ..., "shape": [a, b], "data_offsets": [b, e]}
# under its name): 2^23 values are 700,000 tensors, beyond any file's, and about 800 MiB parsed
# at worst.
SAFETENSORS_HEADER = Kind(
    "safetensors header", max_bytes=100_000_000, max_values=1 << 23, max_depth=4, check=check_safetensors_header
)


def check_structure(value: Any, where: str) -> dict[str, Any]:
    """ortckpt's ``__ortckpt__`` entry in a safetensors file's metadata."""
    at = "__ortckpt__"
    structure = check_object(value, where, at)
    for i, name in enumerate(check_list(structure.get("frozen", []), where, f"{at}.frozen")):
        check_str(name, where, f"{at}.frozen[{i}]")
    for name, kind in check_object(structure.get("property_types", {}), where, f"{at}.property_types").items():
        if kind not in ("int", "float"):
            raise bad_value(where, f"{at}.property_types.{key_shown(name)}", kind, '"int" or "float"')
    for name, raw_group in check_object(structure.get("optimizer_groups", {}), where, f"{at}.optimizer_groups").items():
        gat = f"{at}.optimizer_groups.{key_shown(name)}"
        group = check_object(raw_group, where, gat)
        check_int(group.get("step"), where, f"{gat}.step", None)
        check_number(group.get("initial_learning_rate"), where, f"{gat}.initial_learning_rate")
        for tensor, pair in check_object(group.get("momentums"), where, f"{gat}.momentums").items():
            if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                raise bad_value(where, f"{gat}.momentums.{key_shown(tensor)}", pair, "[parameter, momentum]")
    return structure


# Inside a safetensors header (its caps), 5 values a momentum ("parameter": [parameter, momentum])
# and one a frozen tensor: 2^22 values are 800,000 momentums, about 400 MiB parsed at worst.
ORTCKPT_STRUCTURE = Kind(
    "__ortckpt__ entry", max_bytes=100_000_000, max_values=1 << 22, max_depth=6, check=check_structure
)


# --- the holder record of a directory's writer lock ---------------------------------------------------


def check_holder(value: Any, where: str) -> dict[str, Any]:
    """Who holds a directory's writer lock, as it wrote it: shown in an error message, so only
    known fields, and strings without control characters (no terminal escapes)."""
    holder = check_object(value, where, "the holder record")
    out: dict[str, Any] = {}
    for key in ("pid", "host", "started", "command"):
        item = holder.get(key)
        if type(item) is int:
            out[key] = item
        elif isinstance(item, str):
            out[key] = "".join(c if c.isprintable() else "?" for c in item[:200])
    return out


WRITER_HOLDER = Kind("writer lock record", max_bytes=64 << 10, max_values=1 << 12, max_depth=2, check=check_holder)


# --- the footer of a compressed checkpoint (ortckpt.compression) ------------------------------------

COMPRESSED_FORMAT = "ortckpt.compressed"
COMPRESSED_VERSION = 1
COMPRESSED_ROLES = ("checkpoint", "external data")  # the files of a checkpoint, in the archive's order
GROUPED_ITEMSIZES = (2, 4, 8)


def check_compressed(value: Any, where: str) -> dict[str, Any]:
    """A compressed checkpoint's footer: one entry per file of the checkpoint (the checkpoint,
    then its external data file), each frame inside the archive and after the previous one,
    sizes and SHA-256 of the uncompressed bytes, and the byte-grouped regions inside the file,
    ascending, not overlapping, whole elements of 2, 4 or 8 bytes."""
    footer = check_versioned(value, where, COMPRESSED_FORMAT, COMPRESSED_VERSION, "compressed checkpoint")
    if footer.get("codec") != "zstd":
        raise bad_value(where, "codec", footer.get("codec"), '"zstd"')
    # A block is held in memory to regroup it: at most 2^24 elements (128 MiB of 8-byte ones).
    check_int(footer.get("block_elements"), where, "block_elements", 1, 1 << 24)
    files = check_list(footer.get("files"), where, "files")
    if not 1 <= len(files) <= len(COMPRESSED_ROLES):
        raise DocumentError(f"{where}: files lists {len(files)} files, expected 1 or 2")
    frame_end = len(b"ORTCKPTZ")
    for i, raw in enumerate(files):
        at = f"files[{i}]"
        entry = check_object(raw, where, at)
        if entry.get("role") != COMPRESSED_ROLES[i]:
            raise bad_value(where, f"{at}.role", entry.get("role"), repr(COMPRESSED_ROLES[i]))
        size = check_int(entry.get("size"), where, f"{at}.size", 0, INT64_MAX)
        frame = check_int(entry.get("frame_offset"), where, f"{at}.frame_offset", frame_end, INT64_MAX)
        frame_end = frame + check_int(entry.get("frame_size"), where, f"{at}.frame_size", 1, INT64_MAX)
        sha = entry.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise bad_value(where, f"{at}.sha256", sha, "64 lowercase hex digits")
        end = 0
        for j, region in enumerate(check_list(entry.get("grouped"), where, f"{at}.grouped")):
            values = check_ints(region, where, f"{at}.grouped[{j}]")
            offset, length, itemsize = values if len(values) == 3 else (0, 0, 0)
            if itemsize not in GROUPED_ITEMSIZES or length % itemsize or offset < end or offset + length > size:
                raise DocumentError(
                    f"{where}: {at}.grouped[{j}] is {value_shown(region)}: "
                    "expected [offset, length, item size 2, 4 or 8] "
                    f"inside the file, after the previous region, of whole elements"
                )
            end = offset + length
    return footer


# One grouped region, 5 values ([offset, length, item size]), for each tensor of 2, 4 or 8-byte
# elements: 2^22 values are 800,000 tensors, about 400 MiB parsed at worst.
COMPRESSED_FOOTER = Kind(
    "compressed checkpoint footer", max_bytes=64 << 20, max_values=1 << 22, max_depth=5, check=check_compressed
)
