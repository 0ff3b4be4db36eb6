"""Random number generator state, saved with a checkpoint so that a resumed run draws
the same numbers (data order, dropout masks, augmentation) as an uninterrupted one.

    rng = np.random.default_rng(0)
    manager.save(state, step, rng_state=capture_rng_state(rng))
    ...
    info = manager.latest()
    restore_rng_state(info.rng_state, rng)

Captured: Python's global ``random``, NumPy's global (legacy) generator, the
generators passed in (``numpy.random.Generator``, ``numpy.random.RandomState`` or
``random.Random``, restored in the same order), and torch's CPU generator when the
program has imported torch (CUDA generators are not captured). The result is plain
JSON, stored in the checkpoint's metadata.json.
"""

from __future__ import annotations

import base64
import random
import sys
from typing import Any, Union

import numpy as np

Generator = Union[np.random.Generator, np.random.RandomState, random.Random]


def _to_json(value: Any) -> Any:
    """NumPy arrays and tuples inside a generator's state, as JSON-able values."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            return np.array(value["ndarray"], dtype=value["dtype"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _python_restore(saved: list) -> tuple:
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


def _capture_one(generator: Generator) -> dict:
    if isinstance(generator, np.random.Generator):
        return {"kind": "numpy.Generator", "state": _to_json(generator.bit_generator.state)}
    if isinstance(generator, np.random.RandomState):
        return {"kind": "numpy.RandomState", "state": _to_json(generator.get_state(legacy=False))}
    if isinstance(generator, random.Random):
        return {"kind": "random.Random", "state": _to_json(generator.getstate())}
    raise TypeError(f"cannot capture the state of {type(generator).__name__}")


def _restore_one(generator: Generator, saved: dict) -> None:
    kind = saved["kind"]
    expected = {"numpy.Generator": np.random.Generator, "numpy.RandomState": np.random.RandomState,
                "random.Random": random.Random}[kind]  # fmt: skip
    if not isinstance(generator, expected):
        raise TypeError(f"saved state is for a {kind}, got {type(generator).__name__}")
    if kind == "numpy.Generator":
        generator.bit_generator.state = _from_json(saved["state"])
    elif kind == "numpy.RandomState":
        generator.set_state(_from_json(saved["state"]))
    else:
        generator.setstate(_python_restore(saved["state"]))


def capture_rng_state(*generators: Generator) -> dict:
    """The state of the global generators and of ``generators``, as JSON-able data."""
    state: dict[str, Any] = {
        "python": _to_json(random.getstate()),
        "numpy_global": _to_json(np.random.get_state(legacy=False)),
        "generators": [_capture_one(g) for g in generators],
    }
    torch = sys.modules.get("torch")
    if torch is not None:  # only when the program uses torch: importing it here would cost seconds
        state["torch"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng_state(state: dict, *generators: Generator) -> None:
    """Puts back what :func:`capture_rng_state` captured; ``generators`` in the same order."""
    if len(generators) != len(state["generators"]):
        raise ValueError(f"the state holds {len(state['generators'])} generator(s), {len(generators)} given")
    random.setstate(_python_restore(state["python"]))
    np.random.set_state(_from_json(state["numpy_global"]))
    for generator, saved in zip(generators, state["generators"]):
        _restore_one(generator, saved)
    if "torch" in state:
        import torch

        raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))


__all__ = ["capture_rng_state", "restore_rng_state"]
