"""Validation of a new checkpoint by a forward pass, before the manager commits it.

Re-reading a checkpoint (``verify_after_save``) proves its bytes; a forward pass proves its
values: the new checkpoint's weights go into the eval model in memory (as
:func:`ortckpt.inference_model` builds it), the ``onnxruntime`` inference package runs it once,
and the step is committed only if that run succeeds, every output is finite, ``check(outputs)``
agrees and, when asked, a loss output matches the metric being logged.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import extras
from ..checkpoint_state import open_checkpoint
from ..errors import CheckpointIntegrityError, InvalidArgumentError
from . import child

# ONNX Runtime's input types -> the NumPy dtype of a dummy input (what an inference session takes).
_DUMMY_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class Forward:
    """``CheckpointManager(..., validate=Forward(eval_model))``: run the eval model with each new
    checkpoint's weights before committing it.

    Args:
        eval_model: The eval model (``generate_artifacts``' ``eval_model.onnx``, a path or a
            ModelProto), or any model whose initializers are named like the parameters.
        inputs: The inputs to run it on, by name. None: dummy inputs made from the model's input
            types and shapes (symbolic dimensions as 1; floats from a fixed seed, integers 0).
        output_names: The outputs to compute (default: the model's).
        check: Called with the outputs by name; the checkpoint is refused unless it returns True.
        metric: ``(output name, metric name)``: the output (a loss: one value) must match the
            metric passed to ``save`` within ``tolerance`` (relative), so the metric logged is
            the checkpoint's.
        tolerance: For ``metric``: ``|output - metric| <= tolerance * max(1, |metric|)``.
        process: Run in a fresh Python process, so a crash in the model's kernels cannot take the
            training down. ``check`` must then pickle: a function of a module (not of the
            script being run, ``__main__``); the child imports the same ortckpt and ``check``
            module as this process did (its ``sys.path`` too). The verdict comes back on a
            channel of its own: what the child prints is logged (logger
            ``ortckpt.manager.child``, INFO), never taken for a problem. A child killed by a
            signal, or one that exits without a verdict, refuses the checkpoint.
        timeout: With ``process``: seconds the fresh process may take (default: 120 s plus 1 s
            per 64 MiB of checkpoint); past it, it is killed with every process it started and
            the checkpoint is refused (:class:`~ortckpt.ValidationTimeoutError`). A check in
            this process cannot be interrupted: without ``process`` no timeout can be given.
    """

    eval_model: Any
    inputs: Mapping[str, Any] | None = None
    output_names: Sequence[str] | None = None
    check: Callable[[dict[str, np.ndarray]], bool] | None = None
    metric: tuple[str, str] | None = None
    tolerance: float = 1e-4
    process: bool = False
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.metric is not None and (len(self.metric) != 2 or not all(isinstance(m, str) for m in self.metric)):
            raise TypeError(f"metric is (output name, metric name), got {self.metric!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"tolerance must be at least 0, got {self.tolerance}")
        child.check_timeout("timeout", self.timeout)
        if self.timeout is not None and not self.process:
            raise InvalidArgumentError(
                "Forward(timeout=...) needs process=True: a check in this process cannot be interrupted", "timeout"
            )
        if self.process:
            if _check_module(self.check) == "__main__":
                raise TypeError(
                    "Forward(process=True) sends check to a fresh process, which cannot import it from the "
                    "script being run (__main__): define check in a module of its own and import it from there"
                )
            try:
                pickle.dumps(self)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                raise TypeError(
                    f"Forward(process=True) sends itself to a fresh process, and it does not pickle ({e}): "
                    "give check as a module-level function, and the eval model as a path"
                ) from None

    def validate(self, checkpoint: Path, metrics: Mapping[str, Any] | None) -> None:
        """Refuses ``checkpoint`` (:class:`~ortckpt.CheckpointIntegrityError` naming it and why)
        unless the forward pass succeeds; see the class."""
        if self.process:
            in_child = dataclasses.replace(self, process=False, timeout=None)
            module = _check_module(self.check)
            child.run(
                in_child.problems,
                (checkpoint, dict(metrics or {})),
                subject=checkpoint,
                what="validation process",
                timeout=self.timeout if self.timeout is not None else child.default_timeout(_size_of(checkpoint)),
                modules=[module] if module else [],
            )
        else:
            problems = self.problems(checkpoint, metrics)
            if problems:
                raise CheckpointIntegrityError(checkpoint, problems)

    def problems(self, checkpoint: Path, metrics: Mapping[str, Any] | None) -> list[str]:
        """What is wrong with the forward pass of ``checkpoint``, in this process ([] if nothing)."""
        onnxruntime = extras.require("onnxruntime", "validate=Forward(...) (it runs the model in ONNX Runtime)")
        from ..convert.onnx_model import inference_model

        state = open_checkpoint(checkpoint, follow_symlinks=False)
        try:
            model = inference_model(state, self.eval_model, output_names=self.output_names)
            session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            feeds = dict(self.inputs) if self.inputs is not None else dummy_inputs(session)
            names = [o.name for o in session.get_outputs()]
            outputs = dict(zip(names, session.run(names, feeds), strict=True))
        except Exception as e:  # ONNX Runtime's errors have no common base: each is a refusal
            return [f"the forward pass failed: {type(e).__name__}: {_first_line(e)}"]
        problems = [
            f"output {name} is not finite ({_count_non_finite(value)} NaN or Inf values)"
            for name, value in outputs.items()
            if _count_non_finite(value)
        ]
        if problems:
            return problems
        if self.metric is not None:
            problems += self._metric_problems(outputs, metrics)
        if self.check is not None and not problems:
            try:
                verdict = self.check(outputs)
            except Exception as e:
                return [f"check(outputs) raised {type(e).__name__}: {_first_line(e)}"]
            if verdict is not True:
                problems.append(f"check(outputs) returned {verdict!r}, not True")
        return problems

    def _metric_problems(self, outputs: Mapping[str, np.ndarray], metrics: Mapping[str, Any] | None) -> list[str]:
        assert self.metric is not None
        output, metric = self.metric
        if output not in outputs:
            return [f"no output {output} to compare with metric {metric} (outputs: {', '.join(outputs)})"]
        value = np.asarray(outputs[output])
        if value.size != 1:
            return [f"output {output} has {value.size} values; comparing it with metric {metric} needs one"]
        logged = (metrics or {}).get(metric)
        if not isinstance(logged, (int, float)) or isinstance(logged, bool):
            return [f"metric {metric} was not given to save() (or is not a number): nothing to compare {output} with"]
        computed = float(value.reshape(()))
        if abs(computed - logged) > self.tolerance * max(1.0, abs(logged)):
            return [
                f"output {output} is {computed!r} but metric {metric} is {logged!r} "
                f"(beyond a relative tolerance of {self.tolerance})"
            ]
        return []


def dummy_inputs(session: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for every input of an ``onnxruntime.InferenceSession``, from its types and shapes:
    symbolic or unknown dimensions are 1; floats are standard normal from ``seed``; integers 0;
    booleans False."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for arg in session.get_inputs():
        dtype = _DUMMY_DTYPES.get(arg.type)
        if dtype is None:
            raise TypeError(f"input {arg.name} is {arg.type}: give Forward(inputs=...) for it")
        shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in (arg.shape or []))
        if np.issubdtype(dtype, np.floating):
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[arg.name] = np.zeros(shape, dtype)
    return feeds


def _count_non_finite(value: Any) -> int:
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.inexact):
        return 0
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def _size_of(checkpoint: Path) -> int:
    """The bytes of a checkpoint and its external data file."""
    return sum(p.stat().st_size for p in (checkpoint, checkpoint.with_name(checkpoint.name + ".data")) if p.exists())


_MESSAGE_CHARS = 4096  # of an exception's message in a problem: a message of megabytes is cut


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > _MESSAGE_CHARS:
        return f"{line[:_MESSAGE_CHARS]}... ({len(line) - _MESSAGE_CHARS} more characters)"
    return line


def _check_module(check: Any) -> str | None:
    """The module a fresh process imports to unpickle ``check`` (a ``functools.partial``'s function's)."""
    return getattr(getattr(check, "func", check), "__module__", None)


__all__ = ["Forward", "dummy_inputs"]
