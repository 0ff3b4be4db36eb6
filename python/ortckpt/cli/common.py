"""What every ``ortckpt`` command shares: the click group (:func:`main`), exit codes, argument
types, the failure handling that turns errors into messages and exit codes, and printing."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import resolve, targets, texts
from .._boundary import VERSION
from ..convert.files import FORMATS
from ..errors import InvalidArgumentError

# Exit codes, as documented in --help. INTERRUPTED: 128 + SIGINT, as a shell reports a command
# that Ctrl-C stopped (never 1, which says "differ" or "verification failed").
OK, DIFFERENT, USAGE, FAILED, INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = (
    "Exit codes: 0 success; 1 the checkpoints differ (diff) or verification failed (verify); "
    "2 bad usage; 3 an input could not be read or an output not written; 130 interrupted (Ctrl-C)."
)
FORMAT_CHOICE = click.Choice(list(FORMATS))


# The names the running command was given, by the forms the library writes them in: a path as
# pathlib makes it (no "./", "//" nor trailing "/"), a URL without its trailing "/".
_given: dict[str, str] = {}


def _remember(arguments: list[Any]) -> None:
    """Records the command's arguments (str, or tuples of them) to be named as given."""
    names = [n for v in arguments for n in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(n, str) and n]
    for name in names:
        written = name.rstrip("/") if targets.is_object_url(name) else os.fspath(Path(name))
        if written != name and written not in names:  # (a name given as it is written stays as it is)
            _given.setdefault(written, name)


def as_given(text: str) -> str:
    """``text`` (a message or a file name) with the file it starts with named as the user gave it."""
    for written, name in _given.items():
        if text == written or text.startswith((f"{written}:", f"{written} ")):
            return name + text[len(written) :]
    return text


def _message(e: BaseException) -> str:
    """One line for an error: ``file: problem`` for an OS error that names its file, the
    exception's type for an unexpected kind; files named as the user named them (temporary
    copies too)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        names = [str(e.filename)] + ([str(e.filename2)] if e.filename2 is not None else [])
        text = f"{' -> '.join(map(as_given, names))}: {e.strerror}"
    elif isinstance(e, (OSError, ValueError, RuntimeError, TypeError, ImportError)):
        text = as_given(str(e))
    else:
        text = f"{type(e).__name__}: {e}"
    return resolve.shown(" ".join(text.split()))


def fail_cleanly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Any failure to read or write becomes one line on stderr (the error names the file) and
    exit code 3; never a traceback. Inputs are not checked by click (a missing one is exit 3,
    as documented, not a usage error): the readers refuse what they cannot read. Bad usage is a
    click.UsageError, or an argument the library refuses before any work (InvalidArgumentError,
    e.g. an output named with a trailing slash): exit 2."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        _remember([*args, *kwargs.values()])
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, SystemExit, KeyboardInterrupt):
            raise
        except InvalidArgumentError as e:  # an argument the library refused before any work
            click.echo(f"ortckpt: error: {_message(e)}", err=True)
            raise SystemExit(USAGE) from None
        except BrokenPipeError:  # the reader went away (`ortckpt inspect x | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(OK) from None
        except Exception as e:
            click.echo(f"ortckpt: error: {_message(e)}", err=True)
            raise SystemExit(FAILED) from None

    return run


# Commands that read or write much: a bar unless asked not to (or stderr is no terminal).
progress_option = click.option(
    "--progress/--no-progress", default=None, help="A progress bar (default: when stderr is a terminal)."
)

# `export` and `register-best`: which outputs the inference model keeps.
inference_outputs_option = click.option(
    "--output",
    "outputs",
    multiple=True,
    metavar="NAME",
    help="An output of the inference model (repeatable; default: the eval model's outputs).",
)


class Name(click.Path):
    """A file, directory or URL; an empty one is bad usage (it would name the current directory)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":
            self.fail("an empty name", param, ctx)
        return super().convert(value, param, ctx)


NAME = Name()


class Number(click.ParamType):
    """A finite number (``inf`` and ``nan`` are bad usage), at least ``minimum`` if given."""

    name = "number"

    def __init__(self, minimum: float | None = None) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = float(click.FLOAT.convert(value, param, ctx))
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.minimum is not None and number < self.minimum:
            self.fail(f"{value!r} is less than {self.minimum:g}", param, ctx)
        return number


class Weights(click.ParamType):
    """A comma-separated list of finite, non-negative numbers, not all 0."""

    name = "w1,w2,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[float]:
        if isinstance(value, list):
            return value
        try:
            weights = [float(w) for w in str(value).split(",")]
        except ValueError:
            self.fail(f"not a comma-separated list of numbers: {value}", param, ctx)
        if not all(math.isfinite(w) and w >= 0 for w in weights):
            self.fail(f"every weight must be a finite number >= 0: {value}", param, ctx)
        if not any(w > 0 for w in weights):
            self.fail(f"the weights are all 0: {value}", param, ctx)
        return weights


def local_only(value: str | None, hint: str) -> None:
    """Bad usage where a command reads or writes only local files and was given a URL."""
    if value is not None and targets.is_object_url(value):
        raise click.BadParameter(
            f"{value}: a local file, please (this is not read or written on object storage)", param_hint=hint
        )


def checked_format(path: str, given: str | None, hint: str, *, must_exist: bool) -> str:
    """The format of ``path``: ``given``, or detected (a file's contents, else its extension);
    one that object storage does not hold is bad usage."""
    from ..convert.files import format_of
    from ..errors import ConversionError

    if given not in (None, "ortckpt") and targets.is_object_url(path):
        raise click.BadParameter(
            f"{path}: only ONNX Runtime checkpoints go to and from {targets.SCHEME}, not {given}", param_hint=hint
        )
    try:
        return given or format_of(path, must_exist=must_exist)
    except ConversionError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def show_progress(asked: bool | None) -> bool:
    """Bars when asked, or by default when stderr is a terminal and tqdm is installed."""
    if asked is not None:
        return asked
    return importlib.util.find_spec("tqdm") is not None and sys.stderr.isatty()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(_finite_json(data), indent=2, default=str, allow_nan=False))


def _finite_json(data: Any) -> Any:
    """``data`` with its infinite and NaN floats as the strings "inf", "-inf", "nan" (as
    ``float()`` reads them back): JSON has no such numbers, and Python's bare ``Infinity``
    makes jq and ``JSON.parse`` refuse the whole document (a figure beyond float64 is inf)."""
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    if isinstance(data, dict):
        return {k: _finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_json(v) for v in data]
    return data


def human_size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def text_table(rows: list[list[str]], header: list[str]) -> str:
    """Columns aligned by what each cell takes on a terminal; text from files (names) shown with
    its unprintable characters written out (see ortckpt.texts)."""
    cells = [[texts.printable(str(c)) for c in row] for row in [header, *rows]]
    widths = [max(texts.width(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(texts.pad(c, w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXIT_CODES)
@click.version_option(
    VERSION,
    "-V",
    "--version",
    prog_name="ortckpt",
    message=f"%(prog)s %(version)s (Python {platform.python_version()}, {platform.machine()})",
)
def main() -> None:
    """Inspect, verify, compare and convert ONNX Runtime training checkpoints.

    Formats: ONNX Runtime checkpoints (any name; .ckpt), safetensors (.safetensors), ONNX models
    (.onnx, needs the onnx package) and PyTorch files (.pt/.pth, needs torch). A format is
    recognised from the file's contents or its extension; --from/--to override.
    """
