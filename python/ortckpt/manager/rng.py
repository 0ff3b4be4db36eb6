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
from typing import Any

import numpy as np

Generator = np.random.Generator | np.random.RandomState | random.Random


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


# The array types generator states hold (MT19937's key, SFC64's and Philox's words): nothing
# else is decoded, so a hostile metadata.json cannot ask for, say, a 2 GB string dtype.
_STATE_DTYPES = {"uint8", "uint32", "uint64", "int32", "int64"}
_MAX_STATE_ELEMENTS = 1 << 16


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            items, dtype = value["ndarray"], value["dtype"]
            if dtype not in _STATE_DTYPES or not isinstance(items, list) or len(items) > _MAX_STATE_ELEMENTS:
                raise ValueError(f"an array of {dtype!r} is not part of a generator's state")
            return np.array(items, dtype=dtype)
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _python_restore(saved: list) -> tuple:
    version, internal, gauss = saved
    if not isinstance(internal, list) or len(internal) > 1000 or not all(type(i) is int for i in internal):
        raise ValueError("not the state of a random.Random")
    return (version, tuple(internal), gauss)


def _capture_one(generator: Generator) -> dict:
    if isinstance(generator, np.random.Generator):
        return {"kind": "numpy.Generator", "state": _to_json(generator.bit_generator.state)}
    if isinstance(generator, np.random.RandomState):
        return {"kind": "numpy.RandomState", "state": _to_json(generator.get_state(legacy=False))}
    if isinstance(generator, random.Random):
        return {"kind": "random.Random", "state": _to_json(generator.getstate())}
    raise TypeError(f"cannot capture the state of {type(generator).__name__}")


_KINDS = {
    "numpy.Generator": np.random.Generator,
    "numpy.RandomState": np.random.RandomState,
    "random.Random": random.Random,
}


def _restore_one(generator: Generator, kind: str, decoded: Any) -> None:
    if not isinstance(generator, _KINDS[kind]):
        raise TypeError(f"saved state is for a {kind}, got {type(generator).__name__}")
    if isinstance(generator, np.random.Generator):
        generator.bit_generator.state = decoded
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(decoded)
    else:
        generator.setstate(decoded)


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
    """Puts back what :func:`capture_rng_state` captured; ``generators`` in the same order.

    ``state`` comes from a file (metadata.json), so it is decoded and checked whole before any
    generator changes: ValueError for anything :func:`capture_rng_state` would not have made."""
    try:
        python = _python_restore(state["python"])
        numpy_global = _from_json(state["numpy_global"])
        saved = [(g["kind"], g["state"]) for g in state["generators"]]
        if any(kind not in _KINDS for kind, _ in saved):
            raise ValueError(f"unknown generator kinds {[kind for kind, _ in saved]}")
        decoded = [(kind, _python_restore(s) if kind == "random.Random" else _from_json(s)) for kind, s in saved]
        torch_state = base64.b64decode(state["torch"], validate=True) if "torch" in state else None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise ValueError(
            f"not a random number generator state that capture_rng_state made: {type(e).__name__}: {e}"
        ) from None
    if len(generators) != len(decoded):
        raise ValueError(f"the state holds {len(decoded)} generator(s), {len(generators)} given")
    random.setstate(python)
    np.random.set_state(numpy_global)
    for generator, (kind, value) in zip(generators, decoded, strict=True):
        _restore_one(generator, kind, value)
    if torch_state is not None:
        import torch

        torch.set_rng_state(torch.from_numpy(np.frombuffer(torch_state, dtype=np.uint8).copy()))


__all__ = ["capture_rng_state", "restore_rng_state"]
