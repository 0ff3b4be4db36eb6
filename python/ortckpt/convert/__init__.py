"""Converters between ONNX Runtime training checkpoints and the formats users arrive with.

One module per format: :mod:`.safetensors_file` (no dependency: the format is written and
read here, zero-copy), :mod:`.onnx_model` (needs ``onnx``), :mod:`.torch_state` (needs
``torch``). :func:`convert` moves a checkpoint between files of any two of them, as the
``ortckpt convert`` command does.
"""

from .files import FORMATS, ConversionError, convert, format_of, load_any, save_any, to_nominal
from .safetensors_file import load_safetensors, save_safetensors

__all__ = ["FORMATS", "ConversionError", "convert", "format_of", "load_any", "load_safetensors", "save_any", "save_safetensors", "to_nominal"]
