"""Checkpoints that older ONNX Runtime releases wrote.

- ODTC version 1 (ONNX Runtime 1.16): version 2 (1.17) only added ``ModuleState.is_nominal_state``
  (onnxruntime/core/flatbuffers/checkpoint_version.h; ``has_external_data`` came later without a
  version change), so a version-1 file reads as a version-2 one with both flags false. ONNX
  Runtime >= 1.17 refuses it ("Checkpoint version 1 is not supported"); ortckpt reads it, and
  :func:`upgrade` rewrites it as version 2.
- Before 1.16 a checkpoint was a directory of ``.pbseq`` files (length-prefixed TensorProto
  sequences: ``paramtrain_tensors.pbseq``, ``paramfrozen_tensors.pbseq``, ``optim_*``,
  ``custom_properties.pbseq``). :func:`legacy_layout_problem` recognises it, so that loading one
  says what it is instead of "is a directory".
"""

from __future__ import annotations

import os
from pathlib import Path

from . import safe_io
from .checkpoint_state import CheckpointState

PBSEQ_SUFFIX = ".pbseq"


def upgrade(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, durable: bool = False) -> int:
    """Writes the checkpoint at ``src`` (version 1 or 2) to ``dst`` as version 2, which ONNX
    Runtime >= 1.17 loads: parameters, optimizer state and properties unchanged, a nominal
    checkpoint staying nominal. Returns the version ``src`` had."""
    state = CheckpointState.load_checkpoint(src)
    CheckpointState.save_checkpoint(state, dst, include_optimizer_state=True, durable=durable)
    return state.format_version


def legacy_layout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read, when it is a directory in ONNX Runtime's pre-1.16 layout."""
    directory = Path(path)
    names = sorted(e.name for e in safe_io.entries(directory) if e.name.endswith(PBSEQ_SUFFIX))
    if not names:
        return None
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (
        f"{directory}: a checkpoint directory of protobuf sequence files ({shown}), the layout of "
        "ONNX Runtime's training API before version 1.16. It predates the flatbuffers checkpoint "
        "format (ODTC) that ortckpt and ONNX Runtime >= 1.16 read, and ortckpt does not convert it: "
        "load its parameters with onnxruntime-training <= 1.15 and write them as a checkpoint "
        "(ortckpt.onnxblock.save_checkpoint or CheckpointState.from_arrays)"
    )


__all__ = ["legacy_layout_problem", "upgrade"]
