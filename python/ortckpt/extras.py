"""The optional packages: each imported where it is needed, through :func:`require`, which
names what to install when it is missing (ortckpt's extra where one brings it)."""

from __future__ import annotations

import importlib
from types import ModuleType

# The top-level package -> what installs it.
INSTALL = {
    "obstore": "pip install 'ortckpt[s3]'",
    "zstandard": "pip install 'ortckpt[compress]'",
    "tqdm": "pip install 'ortckpt[progress]' (or tqdm)",
    "onnx": "pip install 'ortckpt[onnx]'",
    "mlflow": "pip install 'ortckpt[mlflow]'",
    "torch": "pip install torch",
    "onnxruntime": "pip install onnxruntime",
    "mpi4py": "pip install mpi4py",
    "flwr": "pip install 'ortckpt[flower]'",
}


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or an ImportError saying that ``purpose`` needs its package and how
    to install it. A package that is there but fails to import (a dependency of its own missing)
    keeps its own error."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name != top and not e.name.startswith(top + "."):
            raise
        raise ImportError(f"{purpose} needs {top}: {INSTALL[top]}") from None
