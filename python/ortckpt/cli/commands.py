"""The ``ortckpt`` command (also ``python -m ortckpt``), built on click.

Each command is a thin layer over a library function (summary.describe, integrity.verify,
compare.compare, convert.convert, convert.to_nominal, ...): parsing, printing, exit codes.
Every checkpoint argument goes through :mod:`ortckpt.resolve` (a file, an object, or a manager's step
folder, local or ``s3://``); every argument is checked before any work (bad usage: exit 2).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
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


def _as_given(text: str) -> str:
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
        text = f"{' -> '.join(map(_as_given, names))}: {e.strerror}"
    elif isinstance(e, (OSError, ValueError, RuntimeError, TypeError, ImportError)):
        text = _as_given(str(e))
    else:
        text = f"{type(e).__name__}: {e}"
    return resolve.shown(" ".join(text.split()))


def _fail_cleanly(command: Callable[..., Any]) -> Callable[..., Any]:
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
_progress_option = click.option(
    "--progress/--no-progress", default=None, help="A progress bar (default: when stderr is a terminal)."
)

# `export` and `register-best`: which outputs the inference model keeps.
_inference_outputs = click.option(
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


def _local(value: str | None, hint: str) -> None:
    """Bad usage where a command reads or writes only local files and was given a URL."""
    if value is not None and targets.is_object_url(value):
        raise click.BadParameter(
            f"{value}: a local file, please (this is not read or written on object storage)", param_hint=hint
        )


def _format(path: str, given: str | None, hint: str, *, must_exist: bool) -> str:
    """The format of ``path``: ``given``, or detected (a file's contents, else its extension);
    one that object storage does not hold is bad usage."""
    from ..convert.files import ConversionError, format_of

    if given not in (None, "ortckpt") and targets.is_object_url(path):
        raise click.BadParameter(
            f"{path}: only ONNX Runtime checkpoints go to and from {targets.SCHEME}, not {given}", param_hint=hint
        )
    try:
        return given or format_of(path, must_exist=must_exist)
    except ConversionError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def _show_progress(asked: bool | None) -> bool:
    """Bars when asked, or by default when stderr is a terminal and tqdm is installed."""
    if asked is not None:
        return asked
    return importlib.util.find_spec("tqdm") is not None and sys.stderr.isatty()


def _emit_json(data: Any) -> None:
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


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _table(rows: list[list[str]], header: list[str]) -> str:
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


def _statistics(path: str, fmt: str, progress: bool) -> Mapping[Any, Any]:
    """TensorKey -> TensorStats of the checkpoint at ``path`` (a file or s3:// URL of ``fmt``):
    a checkpoint is read through its map, another format through its converter."""
    from ..convert.files import load_any
    from ..statistics import tensor_stats

    source: Any = path if fmt == "ortckpt" else load_any(path, fmt)
    if not progress:
        return tensor_stats(source)
    from ..progress import bar

    with bar("statistics") as counter:
        return tensor_stats(source, on_bytes=counter.update)


def _stats_key(tensor: dict[str, Any]) -> Any:
    """The key ortckpt.tensor_stats gives an inspect entry."""
    from ..tensor_keys import TensorKey

    if tensor["role"] == "momentum":
        return TensorKey.of_momentum(tensor["group"], tensor["parameter"], tensor["momentum"])
    return TensorKey.of_parameter(tensor["name"], tensor["role"] == "trainable")


def _flagged(tensor: dict[str, Any]) -> bool:
    """Whether an inspect entry's statistics count a NaN or an infinity."""
    st = tensor["stats"]
    return bool(st["nan"] or st["posinf"] or st["neginf"])


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


@main.command(epilog=EXIT_CODES, short_help="List tensors, optimizer groups, properties and totals.")
@click.argument("path", type=NAME)
@click.option("--from", "fmt", type=FORMAT_CHOICE, help="The file's format (default: detected).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of tables.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=50,
    show_default=True,
    help="Tensors listed (0: all); totals count all.",
)
@click.option(
    "--stats",
    is_flag=True,
    help="Also read every value: min, max, mean, std and L2 norm of the finite values, NaN and Inf counts.",
)
@_progress_option
@_fail_cleanly
def inspect(path: str, fmt: str | None, as_json: bool, limit: int, stats: bool, progress: bool | None) -> None:
    """List the tensors of a checkpoint (role, dtype, shape, size, where the bytes live), its
    optimizer groups, properties and totals. Reads only the header of an ONNX Runtime checkpoint;
    --stats reads every value too and adds each tensor's statistics, flagging NaN and Inf.
    PATH is a checkpoint (a file, or an s3:// object) or a CheckpointManager's step folder."""
    from .summary import describe

    asked_stats = stats
    with resolve.checkpoint(path) as found:
        info = describe(found.path, None if found.step else fmt)
        stats = stats and not info["nominal"]  # (a nominal checkpoint has no values: said below the table)
        if stats:
            figures = _statistics(found.path, info["format"], _show_progress(progress))
            for t in info["tensors"]:
                t["stats"] = figures[_stats_key(t)].to_json()
            info["totals"]["flagged"] = sum(1 for t in info["tensors"] if _flagged(t))
    info["path"] = path
    if found.step is not None:
        info["step"] = found.step.step.number
        graphs = found.step.step.document.get("artifacts") or {}
        if graphs:  # the run's graphs the step records (CheckpointManager(artifacts=...))
            info["graphs"] = [{"role": role, **entry} for role, entry in sorted(graphs.items())]
        if found.copy:  # (a sharded or compressed step: its own files, not the copy read)
            info["files"] = found.step.files()
    if as_json:
        return _emit_json(info)
    flags = [info["format"]] + ["nominal"] * info["nominal"] + ["external data"] * info["external_data"]
    flags += [f"step {info['step']}"] if "step" in info else []
    files = ", ".join(f"{os.path.basename(f)} {_size(s)}" for f, s in info["files"].items())
    click.echo(f"{path}: {', '.join(flags)}; {files}")
    tensors = info["tensors"]
    shown = tensors if limit <= 0 else tensors[:limit]
    rows = [
        [t["name"], t["role"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(t["bytes"]), t["location"]]
        for t in shown
    ]
    header = ["tensor", "role", "dtype", "shape", "size", "bytes at"]
    if stats:
        header += ["min", "max", "mean", "std", "L2", "NaN", "Inf"]
        for row, t in zip(rows, shown, strict=True):
            st = t["stats"]
            row += [_figure(st[k]) for k in ("min", "max", "mean", "std", "l2")]
            row += [str(st["nan"]), str(st["posinf"] + st["neginf"])]
            row[0] = ("! " if _flagged(t) else "  ") + row[0]
        header[0] = "  tensor"
    click.echo(_table(rows, header))
    if len(shown) < len(tensors):
        click.echo(f"... {len(tensors) - len(shown)} more (--limit 0 lists all)")
    if info["nominal"] and asked_stats:
        click.echo("no statistics: a nominal checkpoint has names and types, no values")
    if stats:
        flagged = [t["name"] for t in tensors if _flagged(t)]
        if flagged:
            more = f" and {len(flagged) - 10} more" if len(flagged) > 10 else ""
            holds = "tensor holds" if len(flagged) == 1 else "tensors hold"
            click.echo(f"! {len(flagged)} {holds} NaN or Inf: {texts.printable(', '.join(flagged[:10]))}{more}")
        else:
            click.echo("no NaN or Inf in any tensor")
    if info["optimizer_groups"]:
        click.echo("\noptimizer groups:")
        for g in info["optimizer_groups"]:
            click.echo(
                f"  {texts.printable(g['name'])}: step {g['step']}, initial learning rate "
                f"{g['initial_learning_rate']:g}, {g['parameters']} parameters with state"
            )
    if info["properties"]:
        click.echo("\nproperties:")
        for name, value in info["properties"].items():
            click.echo(f"  {texts.printable(name)} = {value!r}")
    if info.get("graphs"):
        click.echo("\ngraphs:")
        click.echo(
            _table(
                [[g["role"], g["name"], _size(g["bytes"]), g["sha256"]] for g in info["graphs"]],
                ["role", "file", "size", "sha256"],
            )
        )
    t = info["totals"]
    click.echo(
        f"\ntotal: {t['tensors']} tensors, {_size(t['bytes'])} ({t['trainable']} trainable, {t['frozen']} frozen, "
        f"{t['momentum']} momentums; parameters {_size(t['parameter_bytes'])}, "
        f"optimizer state {_size(t['optimizer_bytes'])})"
    )


@main.command(epilog=EXIT_CODES, short_help="Check that a checkpoint is whole and readable.")
@click.argument("path", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def verify(path: str, as_json: bool, progress: bool | None) -> None:
    """Check that a checkpoint is whole: for a CheckpointManager step directory every file's size
    and digest against its metadata.json, then (for any checkpoint) every tensor's bytes against
    the checksums ortckpt writes into the file ("no checksums" for a file without them, such as
    ONNX Runtime's: read in full instead), and that every tensor, momentum and property decodes.
    PATH may be on s3://."""
    from ..errors import CheckpointError, CheckpointIntegrityError
    from ..manager.integrity import verify as run_verify

    try:  # a bucket, a run of steps, a directory that is no step: refused here, one line
        resolve.step_folder(path)
    except resolve.NotACheckpointError:
        raise
    except (CheckpointError, OSError, ValueError):
        pass  # a damaged step, a missing file: verify says what it finds
    try:
        result = run_verify(path, progress=_show_progress(progress))
    except CheckpointIntegrityError as e:
        if as_json:
            _emit_json({"path": path, "ok": False, "problems": [_as_given(p) for p in e.problems]})
        else:
            click.echo(f"{path}: FAILED", err=True)
            for problem in e.problems:
                click.echo(f"  {_as_given(' '.join(problem.split()))}", err=True)
        raise SystemExit(DIFFERENT) from None
    if as_json:
        return _emit_json(
            {
                "path": path,
                "ok": True,
                "step": result.step,
                "tensors": result.tensors,
                "tensor_bytes": result.tensor_bytes,
                "sha256": {name: digest for name, digest in result.files.items() if len(digest) == 64},
                "files": result.files,
                "checksums": result.checksums,
            }
        )
    hashed = f", {len(result.files)} files match their metadata" if result.files else ""
    sums = "" if result.checksums else ", no checksums"
    click.echo(f"{path}: OK ({result.tensors} tensors, {_size(result.tensor_bytes)} read{hashed}{sums})")


@main.command(epilog=EXIT_CODES, short_help="Compare two checkpoints, with tolerances.")
@click.argument("a", type=NAME)
@click.argument("b", type=NAME)
@click.option("--rtol", type=Number(minimum=0), default=0.0, show_default=True, help="Relative tolerance for values.")
@click.option("--atol", type=Number(minimum=0), default=0.0, show_default=True, help="Absolute tolerance for values.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def diff(a: str, b: str, rtol: float, atol: float, as_json: bool, progress: bool | None) -> None:
    """Compare two checkpoints (of any formats): tensor names, roles, dtypes, shapes and values
    (within --rtol/--atol), optimizer steps and learning rates, properties. Exit code 1 when
    they differ."""
    from ..compare import compare
    from ..convert.files import load_any
    from ..statistics import tensor_changes

    with resolve.checkpoint(a) as found_a, resolve.checkpoint(b) as found_b:
        state_a, state_b = load_any(found_a.path), load_any(found_b.path)
    valued = not (state_a.is_nominal or state_b.is_nominal)  # (a nominal side has no values: no change figures)
    changes: Mapping[Any, Any] = {}
    if _show_progress(progress):
        from ..progress import bar

        with bar("comparing") as counter:
            result = compare(state_a, state_b, rtol=rtol, atol=atol, on_bytes=counter.update)
            if valued:
                changes = tensor_changes(state_a, state_b, on_bytes=counter.update)
    else:
        result = compare(state_a, state_b, rtol=rtol, atol=atol)
        if valued:
            changes = tensor_changes(state_a, state_b)
    if as_json:
        figures = {"changes": [c.to_json() for c in changes.values()]}
        _emit_json({"a": a, "b": b, "rtol": rtol, "atol": atol, **result.to_json(), **figures})
    else:
        for key in result.only_in_a:
            click.echo(f"only in {a}: {texts.printable(key.label)}")
        for key in result.only_in_b:
            click.echo(f"only in {b}: {texts.printable(key.label)}")
        for t in result.tensors:
            if t.problem == "values":
                detail = f"{t.mismatched} of {t.elements} elements differ"
                if t.max_abs is not None:
                    detail += f" (max abs {t.max_abs:.6g}, max rel {t.max_rel:.6g})"
            else:
                detail = f"{t.a} vs {t.b}"
            click.echo(f"{texts.printable(t.name)}: {t.problem}: {detail}")
        for name, (va, vb) in {**result.optimizer, **result.properties}.items():
            click.echo(f"{texts.printable(name)}: {va!r} vs {vb!r}")
        _echo_changes(list(changes.values()))
        if len(result.nominal) == 2:
            click.echo("both are nominal checkpoints (names and types, no values): values not compared")
        verdict = "identical" if result.identical else "differ in " + ", ".join(result.differing())
        click.echo(
            f"{result.compared} tensors compared: {verdict}"
            + (f" (rtol {rtol:g}, atol {atol:g})" if rtol or atol else "")
        )
    raise SystemExit(OK if result.identical else DIFFERENT)


@main.command(epilog=EXIT_CODES, short_help="Write an HTML report: statistics, NaN/Inf, histograms, changes.")
@click.argument("checkpoint", type=NAME)
@click.option("--against", type=NAME, help="Another checkpoint: what changed from it, per tensor, largest first.")
@click.option("-o", "--output", "out", type=NAME, required=True, help="The HTML file to write (replaced if it exists).")
@click.option(
    "--histograms",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="How many tensors (the largest; NaN/Inf ones first) get a histogram.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def report(checkpoint: str, against: str | None, out: str, histograms: int, as_json: bool) -> None:
    """Write one self-contained HTML page about CHECKPOINT (no network needed to view it): files
    and sizes, tensors by role and dtype, optimizer groups, properties, the tensors holding NaN
    or Inf, every tensor's statistics and histograms; with --against, what changed per tensor.
    CHECKPOINT and OTHER are checkpoints of any format, CheckpointManager step folders, or
    s3:// checkpoints and steps."""
    from ..convert.files import load_any
    from ..report import write_report

    _local(out, "--output")
    names = [checkpoint] if against is None else [checkpoint, against]
    with contextlib.ExitStack() as stack:
        found = [stack.enter_context(resolve.checkpoint(name)) for name in names]
        states = [load_any(f.path) for f in found]
        stats = write_report(
            states[0],
            out,
            against=states[1] if against is not None else None,
            histograms=histograms,
            name=checkpoint,
            against_name=against,
            files=[_files_of(f, name) for f, name in zip(found, names, strict=True)],
        )
    flagged = sum(1 for s in stats.values() if s.flagged)
    if as_json:
        return _emit_json({"checkpoint": checkpoint, "against": against, "out": out, "flagged": flagged})
    click.echo(f"{out}: report of {checkpoint}" + (f" against {against}" if against else "") + f" ({flagged} flagged)")


def _files_of(found: resolve.Resolved, given: str) -> dict[str, int | None]:
    """The files the user named, with their sizes: a step's files as its document records them, a
    local file's (and its .data) from the disk, an object's unknown."""
    if found.step is not None:
        return dict(found.step.files())
    if targets.is_object_url(found.path):
        return {given: None}
    files: dict[str, int | None] = {}
    for suffix in ("", ".data"):
        try:
            files[given + suffix] = os.stat(found.path + suffix).st_size
        except FileNotFoundError:
            if not suffix:
                raise
    return files


# Changed tensors listed by diff's text output (--json lists every shared tensor).
_CHANGES_SHOWN = 20


def _echo_changes(changes: list[Any]) -> None:
    """The changed tensors' figures, largest change first (NaN/Inf changes before all)."""
    changed = [c for c in changes if c.changed]
    if not changed:
        return
    click.echo(f"changes, largest first ({len(changed)} of {len(changes)} shared tensors changed):")
    for c in changed[:_CHANGES_SHOWN]:
        relative = "-" if c.relative is None else f"{c.relative:.3g}"
        nonfinite = f", {c.nonfinite} to or from NaN/Inf" if c.nonfinite else ""
        click.echo(
            f"  {texts.printable(c.name)}: {c.changed} of {c.elements} changed, L2 {c.l2:.4g} (relative {relative}), "
            f"max abs {c.max_abs:.4g}{nonfinite}"
        )
    if len(changed) > _CHANGES_SHOWN:
        click.echo(f"  ... {len(changed) - _CHANGES_SHOWN} more (--json lists all)")


@main.command(epilog=EXIT_CODES, short_help="Convert between checkpoint, safetensors, ONNX and torch files.")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--from", "src_format", type=FORMAT_CHOICE, help="SRC's format (default: detected).")
@click.option("--to", "dst_format", type=FORMAT_CHOICE, help="DST's format (default: from its extension).")
@click.option(
    "--frozen",
    multiple=True,
    metavar="NAME",
    help="A parameter to freeze (safetensors, ONNX and torch sources; repeatable).",
)
@click.option("--no-optimizer", is_flag=True, help="Leave the optimizer state out.")
@click.option(
    "--model", type=NAME, help="For an ONNX destination: the eval model (or any model) that takes the weights."
)
@click.option(
    "--output",
    "outputs",
    multiple=True,
    metavar="NAME",
    help="For an ONNX destination: an output to keep (repeatable); see `ortckpt export`.",
)
@_progress_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def convert(
    src: str,
    dst: str,
    src_format: str | None,
    dst_format: str | None,
    frozen: tuple[str, ...],
    no_optimizer: bool,
    model: str | None,
    outputs: tuple[str, ...],
    progress: bool | None,
    as_json: bool,
) -> None:
    """Convert a checkpoint between formats, e.g. `ortckpt convert model.safetensors checkpoint`
    or `ortckpt convert checkpoint model.onnx --model eval_model.onnx --output y`. SRC may be a
    CheckpointManager's step folder; SRC and DST may be s3:// checkpoints."""
    from ..convert.files import convert as run_convert

    _local(model, "--model")
    to = _format(dst, dst_format, "--to", must_exist=False)
    if to == "onnx" and model is None:
        raise click.UsageError("writing an ONNX model needs the model whose inputs take the weights: --model MODEL")
    with resolve.checkpoint(src) as found:
        source_format = _format(found.path, None if found.step else src_format, "--from", must_exist=True)
        _check_frozen(src, found.path, source_format, frozen)
        formats = run_convert(
            found.path,
            dst,
            src_format=source_format,
            dst_format=to,
            frozen=frozen,
            include_optimizer_state=not no_optimizer,
            model=model,
            output_names=list(outputs) or None,
            progress=_show_progress(progress),
        )
    if as_json:
        return _emit_json({"src": src, "dst": dst, "from": formats[0], "to": formats[1]})
    click.echo(f"{src} ({formats[0]}) -> {dst} ({formats[1]})")


def _check_frozen(src: str, path: str, fmt: str, frozen: tuple[str, ...]) -> None:
    """Bad usage when --frozen is given for a checkpoint (its parameters say if they are frozen)
    or names a parameter that the source does not have (one read of its names, before the
    conversion)."""
    if not frozen:
        return
    if fmt == "ortckpt":
        raise click.BadParameter(
            f"{src} is a checkpoint, whose parameters say if they are frozen (for safetensors, ONNX and torch)",
            param_hint="--frozen",
        )
    from ..convert.files import load_any

    unknown = sorted(set(frozen) - set(load_any(path, fmt).parameters.names()))
    if unknown:
        raise click.BadParameter(f"{src} has no parameter named {', '.join(unknown)}", param_hint="--frozen")


@main.command(epilog=EXIT_CODES, short_help="Write a checkpoint's nominal twin (names and types only).")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--from", "src_format", type=FORMAT_CHOICE, help="SRC's format (default: detected).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def nominal(src: str, dst: str, src_format: str | None, as_json: bool) -> None:
    """Write the nominal twin of a checkpoint: parameter names, roles and types without values
    (what ONNX Runtime's generate_artifacts(nominal_checkpoint=True) writes), for apps that ship
    small and load the weights later."""
    from ..convert.files import to_nominal

    _local(dst, "DST")
    with resolve.checkpoint(src) as found:
        fmt = _format(found.path, None if found.step else src_format, "--from", must_exist=True)
        count = to_nominal(found.path, dst, src_format=fmt)
    if as_json:
        return _emit_json({"src": src, "dst": dst, "parameters": count})
    click.echo(f"{dst}: nominal checkpoint of {count} parameters")


@main.command(epilog=EXIT_CODES, short_help="Export an inference ONNX model from a checkpoint and its eval model.")
@click.argument("checkpoint", type=NAME)
@click.argument("eval_model", type=NAME)
@click.argument("out", type=NAME)
@_inference_outputs
@click.option(
    "--external-data/--no-external-data",
    default=None,
    help="Weights in OUT.data (default: when the checkpoint has external data, as ONNX Runtime's export, "
    "or the model would pass protobuf's 2 GiB).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def export(
    checkpoint: str, eval_model: str, out: str, outputs: tuple[str, ...], external_data: bool | None, as_json: bool
) -> None:
    """Write the inference model ONNX Runtime's Module.export_model_for_inferencing writes: the
    eval model's parameter inputs bound to the checkpoint's values, only the --output values
    and the nodes they need. It runs in the onnxruntime inference package; no training package
    is needed."""
    from ..convert.onnx_model import export_model

    _local(eval_model, "EVAL_MODEL")
    _local(out, "OUT")
    with resolve.checkpoint(checkpoint) as found:
        export_model(found.path, eval_model, out, output_names=list(outputs) or None, external_data=external_data)
    if as_json:
        return _emit_json({"checkpoint": checkpoint, "eval_model": eval_model, "out": out, "outputs": list(outputs)})
    click.echo(f"{out}: inference model" + (f" with outputs {', '.join(outputs)}" if outputs else ""))


@main.command(epilog=EXIT_CODES, short_help="Rewrite an ONNX Runtime 1.16 checkpoint (version 1) as version 2.")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def upgrade(src: str, dst: str, as_json: bool) -> None:
    """Write SRC (checkpoint format version 1, which ONNX Runtime 1.16 wrote and 1.17+ refuses,
    or version 2) to DST as version 2 with the same parameters, optimizer state and properties."""
    from ..versions import upgrade as run_upgrade

    with resolve.checkpoint(src) as found:
        version = run_upgrade(found.path, dst)
    if as_json:
        return _emit_json({"src": src, "dst": dst, "from_version": version, "to_version": 2})
    click.echo(f"{src} (version {version}) -> {dst} (version 2)")


@main.command(epilog=EXIT_CODES, short_help="Compress a checkpoint kept for the long term (zstd).")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--level", type=click.IntRange(1, 22), default=3, show_default=True, help="The zstd level.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def compress(src: str, dst: str, level: int, as_json: bool, progress: bool | None) -> None:
    """Write the checkpoint SRC (and SRC.data) as one compressed archive DST: zstd over the
    files with each floating-point tensor's bytes grouped. ONNX Runtime cannot read it:
    `ortckpt decompress` gives the checkpoint back, byte for byte."""
    from ..compression import compress as run_compress

    _local(dst, "DST")
    with resolve.checkpoint(src, local=True) as found:
        done = run_compress(found.path, dst, level=level, progress=_show_progress(progress))
    if as_json:
        return _emit_json({"src": src, "dst": dst, "bytes": done.size, "compressed_bytes": done.compressed_size})
    click.echo(f"{src} ({done.size:,} bytes) -> {dst} ({done.compressed_size:,} bytes, {done.ratio:.2f}x)")


@main.command(epilog=EXIT_CODES, short_help="Write a compressed checkpoint back as the checkpoint it was.")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def decompress(src: str, dst: str, as_json: bool, progress: bool | None) -> None:
    """Write the checkpoint in the archive SRC to DST (and DST.data), checking every file's
    size and SHA-256 against the archive before it replaces anything."""
    from ..compression import decompress as run_decompress

    _local(dst, "DST")
    with resolve.archive(src) as archive:
        run_decompress(archive, dst, progress=_show_progress(progress))
    if as_json:
        return _emit_json({"src": src, "dst": dst})
    click.echo(f"{src} -> {dst}")


@main.command(
    "register-best", epilog=EXIT_CODES, short_help="Register a run's best checkpoint in MLflow's model registry."
)
@click.argument("directory", type=NAME)
@click.argument("name")
@click.argument("eval_model", type=NAME)
@_inference_outputs
@click.option("--metric", help="The metric to rank by (default: the one the run's checkpoints have, if only one).")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True, help="Best is min or max.")
@click.option("--tracking-uri", help="The MLflow server (default: MLFLOW_TRACKING_URI).")
@click.option(
    "--experiment",
    help="The MLflow experiment (default: MLFLOW_EXPERIMENT_NAME, else the one with the run's MLflow run).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_fail_cleanly
def register_best(
    directory: str,
    name: str,
    eval_model: str,
    outputs: tuple[str, ...],
    metric: str | None,
    mode: str,
    tracking_uri: str | None,
    experiment: str | None,
    as_json: bool,
) -> None:
    """Export the best checkpoint of the CheckpointManager DIRECTORY into EVAL_MODEL as an inference
    model and register it in MLflow as a new version of the registered model NAME, logged in
    the run's MLflow run (the one tagged with its run id; created if training was not tracked),
    with the checkpoint's metrics, step and SHA-256s as the version's tags."""
    from ..manager import CheckpointManager
    from ..manager.tracking import TAG_STEP, MlflowTracker

    _local(eval_model, "EVAL_MODEL")
    metric = _ranking_metric(directory, metric, mode)  # (before MLflow is asked anything)
    if tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        # (MLflow would make a local store in the working directory, not find the run's server)
        raise click.UsageError(
            "register-best needs the MLflow server the run is tracked on: --tracking-uri URL or MLFLOW_TRACKING_URI"
        )
    tracker = MlflowTracker(tracking_uri, experiment=experiment)
    manager = CheckpointManager(directory, read_only=True, track=tracker)
    version = manager.register_best(
        name, eval_model, output_names=list(outputs) or None, metric=metric, mode="max" if mode == "max" else "min"
    )
    if as_json:
        return _emit_json(
            {
                "name": name,
                "version": str(version.version),
                "source": version.source,
                "mlflow_run_id": version.run_id,
                "step": int(version.tags[TAG_STEP]),
                "metric": metric,
            }
        )
    click.echo(f"{name} version {version.version}: step {version.tags[TAG_STEP]} of {directory} ({version.source})")


def _ranking_metric(directory: str, metric: str | None, mode: str) -> str:
    """The metric that ranks the run's checkpoints: ``metric``, which one of them must have, or
    the only one they have; anything else is bad usage."""
    from ..manager import CheckpointManager

    with CheckpointManager(directory, read_only=True) as run:
        checkpoints = run.all()
        if not checkpoints:
            try:
                step = resolve.step_folder(directory)
            except (OSError, ValueError, RuntimeError):
                step = None
            if step is not None:
                raise click.BadParameter(
                    f"{directory} is one step: name the run's directory, which holds its steps",
                    param_hint="DIRECTORY",
                )
            raise FileNotFoundError(2, "no checkpoint (not a CheckpointManager's directory?)", directory)
        names = sorted({key for info in checkpoints for key in info.metrics})
        if metric is None:
            if len(names) != 1:
                raise click.UsageError(
                    f"{directory}: say which metric ranks the checkpoints (--metric): they have "
                    f"{', '.join(names) or 'none'}"
                )
            metric = names[0]
        if run.best(metric, "max" if mode == "max" else "min") is None:
            if metric in names:  # (NaN ranks no checkpoint)
                raise click.BadParameter(
                    f"every checkpoint of {directory} has {metric!r} NaN: none ranks best", param_hint="--metric"
                )
            raise click.BadParameter(
                f"no checkpoint of {directory} has a value of {metric!r} (their metrics: {', '.join(names) or 'none'})",
                param_hint="--metric",
            )
    return metric


def _same_name(a: str, b: str) -> bool:
    """Whether two names given on the command line name one checkpoint (a path however spelled)."""
    if targets.is_object_url(a) or targets.is_object_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


@main.command(epilog=EXIT_CODES, short_help="Weighted mean of checkpoints (federated averaging).")
@click.argument("checkpoints", nargs=-1, required=True, type=NAME, metavar="SOURCES...")
# The output is named by -o alone: positional, it was first here and last in delta, apply and
# convert, and typed in their order it overwrote a source.
@click.option("-o", "--out", required=True, type=NAME, help="The checkpoint to write (replaced whole if it exists).")
@click.option(
    "--weights",
    type=Weights(),
    metavar="W1,W2,...",
    help="One weight per source, finite and >= 0, not all 0 (default: num_samples, else equal).",
)
@click.option("--optimizer", "include_optimizer_state", is_flag=True, help="Average the optimizer momentums too.")
@click.option(
    "--frozen-from-first", is_flag=True, help="Take frozen parameters from the first source even if they differ."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def average(
    checkpoints: tuple[str, ...],
    out: str,
    weights: list[float] | None,
    include_optimizer_state: bool,
    frozen_from_first: bool,
    as_json: bool,
    progress: bool | None,
) -> None:
    """Write to -o OUT the weighted mean of the SOURCES' float parameters (FedAvg), streaming: the
    sources are read a chunk at a time, whatever their size. Integer, bool and string tensors and
    frozen parameters must be equal in every source, and are copied. A source may be a
    CheckpointManager's step folder; any may be on s3://."""
    from ..arithmetic import average as run_average
    from ..arithmetic import average_weights
    from ..errors import CheckpointStateError

    if weights is not None and len(weights) != len(checkpoints):
        raise click.BadParameter(
            f"{len(weights)} weights for {len(checkpoints)} checkpoints: give one per source", param_hint="--weights"
        )
    if any(_same_name(out, source) for source in checkpoints):
        raise click.BadParameter(f"{out} is also a source: the average would replace it", param_hint="--out")
    with resolve.checkpoints(checkpoints) as paths:
        try:
            run_average(
                paths,
                weights,
                include_optimizer_state=include_optimizer_state,
                frozen="first" if frozen_from_first else "equal",
                out=out,
                progress=_show_progress(progress),
            )
        except CheckpointStateError as e:  # (the library's spelling of the option is Python's)
            if type(e) is not CheckpointStateError or "frozen='first'" not in str(e):
                raise
            raise CheckpointStateError(str(e).replace("frozen='first'", "--frozen-from-first")) from None
        used = average_weights(paths, weights) if as_json else None
    if as_json:
        return _emit_json({"out": out, "sources": list(checkpoints), "weights": used})
    click.echo(f"{out}: average of {len(checkpoints)} checkpoints")


@main.command("delta", epilog=EXIT_CODES, short_help="Write A - B (what changed).")
@click.argument("a", type=NAME)
@click.argument("b", type=NAME)
@click.argument("out", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def delta_command(a: str, b: str, out: str, as_json: bool, progress: bool | None) -> None:
    """Write to OUT the difference A - B of the trainable float parameters (other tensors as in A).
    A and B may be CheckpointManager step folders; any may be on s3://."""
    from ..arithmetic import delta as run_delta

    with resolve.checkpoints([a, b]) as (path_a, path_b):
        run_delta(path_a, path_b, out=out, progress=_show_progress(progress))
    if as_json:
        return _emit_json({"a": a, "b": b, "out": out})
    click.echo(f"{out}: {a} - {b}")


@main.command("apply", epilog=EXIT_CODES, short_help="Write BASE + scale * DELTA.")
@click.argument("base", type=NAME)
@click.argument("delta", type=NAME)
@click.argument("out", type=NAME)
@click.option(
    "--scale", type=Number(), default=1.0, show_default=True, help="The (finite) factor DELTA is multiplied by."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@_progress_option
@_fail_cleanly
def apply_command(base: str, delta: str, out: str, scale: float, as_json: bool, progress: bool | None) -> None:
    """Write to OUT the checkpoint BASE + scale * DELTA (a delta written by `ortckpt delta`).
    BASE and DELTA may be CheckpointManager step folders; any may be on s3://."""
    from ..arithmetic import apply as run_apply

    with resolve.checkpoints([base, delta]) as (path_base, path_delta):
        run_apply(path_base, path_delta, scale, out=out, progress=_show_progress(progress))
    if as_json:
        return _emit_json({"base": base, "delta": delta, "out": out, "scale": scale})
    click.echo(f"{out}: {base} + {scale:g} * {delta}")


def run(argv: Sequence[str] | None = None) -> int:
    """Runs the command line with ``argv`` and returns the exit code (for tests and scripts)."""
    try:
        main.main(args=list(argv) if argv is not None else None, prog_name="ortckpt", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort as e:  # (click's name for KeyboardInterrupt, and for EOF at a prompt)
        if isinstance(e.__context__, KeyboardInterrupt):
            click.echo("ortckpt: interrupted", err=True)
            return INTERRUPTED
        return FAILED
    except KeyboardInterrupt:  # (outside click's own handling: while the command was being set up)
        click.echo("ortckpt: interrupted", err=True)
        return INTERRUPTED
    except click.ClickException as e:
        e.show()
        return USAGE
    except SystemExit as e:
        return int(e.code or 0)
    return OK


def console() -> None:
    """The ``ortckpt`` program: :func:`run` with the process's arguments, its code the exit status."""
    sys.exit(run())


if __name__ == "__main__":
    console()
