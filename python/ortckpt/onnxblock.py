"""A drop-in for the checkpoint functions of ``onnxruntime.training.onnxblock``::

    from ortckpt.onnxblock import save_checkpoint, load_checkpoint_to_model
    # was: from onnxruntime.training.onnxblock import save_checkpoint, load_checkpoint_to_model

Needs the ``onnx`` package (``pip install 'ortckpt[onnx]'``).
"""

from .convert.onnx_model import export_model, load_checkpoint_to_model, save_checkpoint, state_from_onnx

__all__ = ["export_model", "load_checkpoint_to_model", "save_checkpoint", "state_from_onnx"]
