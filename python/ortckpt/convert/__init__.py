"""Converters between ONNX Runtime training checkpoints and the formats users arrive with.

One module per format: :mod:`.safetensors_file` (no dependency: the format is written and
read here, zero-copy), :mod:`.onnx_model` (needs ``onnx``), :mod:`.torch_state` (needs
``torch``); each imports its library only when called. :func:`convert` moves a checkpoint
between files of any two of them, as the ``ortckpt convert`` command does.
"""

from .files import FORMATS, ConversionError, convert, format_of, load_any, save_any, to_nominal
from .onnx_model import export_model, load_checkpoint_to_model, save_checkpoint, state_from_onnx
from .safetensors_file import load_safetensors, save_safetensors
from .torch_state import from_torch, to_torch

__all__ = [
    "FORMATS",
    "ConversionError",
    "convert",
    "export_model",
    "format_of",
    "from_torch",
    "load_any",
    "load_checkpoint_to_model",
    "load_safetensors",
    "save_any",
    "save_checkpoint",
    "save_safetensors",
    "state_from_onnx",
    "to_nominal",
    "to_torch",
]
