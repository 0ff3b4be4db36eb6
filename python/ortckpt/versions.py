"""Checkpoints that older ONNX Runtime releases wrote.

- ODTC version 1 (ONNX Runtime 1.16): version 2 (1.17) only added ``ModuleState.is_nominal_state``
  (onnxruntime/core/flatbuffers/checkpoint_version.h; ``has_external_data`` came later without a
  version change), so a version-1 file reads as a version-2 one with both flags false. ONNX
  Runtime >= 1.17 refuses it ("Checkpoint version 1 is not supported"); ortckpt reads it, and
  :func:`upgrade` rewrites it as version 2.
- Before 1.16 a checkpoint was a directory of ``.pbseq`` files (length-prefixed TensorProto
  sequences: ``paramtrain_tensors.pbseq``, ``paramfrozen_tensors.pbseq``, ``optim_*``,
  ``custom_properties.pbseq``). Loading one says what it is instead of "is a directory"
  (:func:`ortckpt.checkpoint_state.legacy_layout_problem`).
"""

from __future__ import annotations

import os

from .checkpoint_state import CheckpointState


def upgrade(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, durable: bool = False) -> int:
    """Writes the checkpoint at ``src`` (version 1 or 2) to ``dst`` as version 2, which ONNX
    Runtime >= 1.17 loads: parameters, optimizer state and properties unchanged, a nominal
    checkpoint staying nominal. Returns the version ``src`` had."""
    state = CheckpointState.load_checkpoint(src)
    CheckpointState.save_checkpoint(state, dst, include_optimizer_state=True, durable=durable)
    return state.format_version


__all__ = ["upgrade"]
