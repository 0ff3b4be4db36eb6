"""Which format a file is in, and moving a checkpoint from one file format to another."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from .. import _boundary, safe_io, targets
from ..checkpoint_state import CheckpointState
from ..errors import CheckpointError, ConversionError

# Format name -> file extensions that imply it.
FORMATS = {
    "ortckpt": (".ckpt", ""),
    "safetensors": (".safetensors",),
    "onnx": (".onnx",),
    "torch": (".pt", ".pth"),
}
ODTC_IDENTIFIER = b"ODTC"


def format_of(path: str | os.PathLike[str], *, must_exist: bool = False) -> str:
    """The format of ``path``: from its contents when it exists (an ONNX Runtime checkpoint
    is recognised whatever its name), otherwise from its extension; ``ortckpt`` for a name
    without a known extension. On object storage (``s3://``) only ONNX Runtime checkpoints are
    read and written: another format's extension there is a ConversionError."""
    if targets.is_object_url(path):
        named = format_of(Path(str(path)).name)
        if named != "ortckpt":
            raise ConversionError(
                f"{os.fspath(path)}: only ONNX Runtime checkpoints go to and from {targets.SCHEME}, not {named}"
            )
        return named
    path = Path(path)
    try:
        with safe_io.open_regular(path) as f:
            head = f.read(8)
        if head[4:8] == ODTC_IDENTIFIER:
            return "ortckpt"
    except OSError:
        if must_exist:  # missing, a directory, a FIFO...: the error says which
            raise
    suffix = path.suffix.lower()
    for name, suffixes in FORMATS.items():
        if suffix in suffixes and suffix:
            return name
    return "ortckpt"


def load_any(path: str | os.PathLike[str], fmt: str | None = None, *, frozen: Iterable[str] = ()) -> CheckpointState:
    """A state from a file of any supported format (``fmt`` overrides detection). Errors of
    the libraries that read ONNX and torch files become :class:`ConversionError` naming the
    file; anything but a regular file is refused before any byte is read (the readers open
    files through :mod:`ortckpt.safe_io`)."""
    fmt = fmt or format_of(path, must_exist=True)
    frozen = list(frozen)
    if fmt == "ortckpt":
        if frozen:
            raise ConversionError("--frozen applies to safetensors, ONNX and torch sources, not to checkpoints")
        return CheckpointState.load_checkpoint(path)
    if fmt == "safetensors":
        from .safetensors_file import load_safetensors

        return load_safetensors(path, frozen=frozen)
    if fmt not in ("onnx", "torch"):
        raise ConversionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        if fmt == "onnx":
            from .onnx_model import state_from_onnx

            return state_from_onnx(path, frozen=frozen)
        from .torch_state import load_torch_file

        return load_torch_file(path, frozen=frozen)
    except (CheckpointError, OSError, ImportError):
        raise
    except Exception as e:  # the library's own errors (protobuf, onnx's checker, torch's unpickler)
        message = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConversionError(f"{os.fspath(path)}: cannot read this {fmt} file: {message}") from e


def save_any(
    state: CheckpointState,
    path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    include_optimizer_state: bool = True,
    model: str | os.PathLike[str] | None = None,
    output_names: Sequence[str] | None = None,
    progress: bool = False,
) -> None:
    """Writes ``state`` in any supported format; an ONNX model needs ``model``, the eval model
    (or any model) whose parameter inputs or initializers take the checkpoint's values, and
    ``output_names`` keeps only those outputs (see :func:`~ortckpt.export_model`)."""
    targets.output(path, "path")
    fmt = fmt or format_of(path)
    if fmt == "ortckpt":
        CheckpointState.save_checkpoint(state, path, include_optimizer_state, progress=progress)
    elif fmt == "safetensors":
        from .safetensors_file import save_safetensors

        save_safetensors(state, path, include_optimizer_state=include_optimizer_state)
    elif fmt == "onnx":
        if model is None:
            raise ConversionError("writing an ONNX model needs the model whose initializers take the weights (--model)")
        from .onnx_model import export_model

        export_model(state, model, path, output_names=output_names)
    elif fmt == "torch":
        from .torch_state import save_torch_file

        save_torch_file(state, path)  # weights only: torch's optimizer state needs a live optimizer
    else:
        raise ConversionError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    frozen: Iterable[str] = (),
    include_optimizer_state: bool = True,
    model: str | os.PathLike[str] | None = None,
    output_names: Sequence[str] | None = None,
    progress: bool = False,
) -> tuple[str, str]:
    """Converts the checkpoint in ``src`` to ``dst``; returns the two formats used."""
    src_format = src_format or format_of(src, must_exist=True)
    dst_format = dst_format or format_of(dst)
    state = load_any(src, src_format, frozen=frozen)
    save_any(
        state,
        dst,
        dst_format,
        include_optimizer_state=include_optimizer_state,
        model=model,
        output_names=output_names,
        progress=progress,
    )
    return src_format, dst_format


def to_nominal(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, src_format: str | None = None) -> int:
    """Writes the nominal twin of the checkpoint in ``src`` to ``dst``: every parameter's name,
    role and data type with empty dims and no values, as ONNX Runtime's
    ``generate_artifacts(..., nominal_checkpoint=True)`` writes it, and the properties (an app
    ships it and fills the values in later). Returns the number of parameters."""
    state = load_any(src, src_format)
    roles: tuple[list, list] = ([], [])
    for name, code, _, requires_grad in state.tensor_records():  # (a nominal source has no data to read)
        roles[0 if requires_grad else 1].append((name, code, (), None))
    # the source's order, as ONNX Runtime's TensorProto path keeps it
    nominal = _boundary.CoreState(roles[0], roles[1], [], dict(state.properties), nominal=True, keep_order=True)
    _boundary.save(dst, nominal)
    return len(roles[0]) + len(roles[1])
