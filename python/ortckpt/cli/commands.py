"""The ``ortckpt`` command (also ``python -m ortckpt``), built on click.

Each command is a thin layer over a library function (summary.describe, integrity.verify,
compare.compare, convert.convert, convert.to_nominal, ...): parsing, printing, exit codes.
Every checkpoint argument goes through :mod:`ortckpt.resolve` (a file, an object, or a manager's step
folder, local or ``s3://``); every argument is checked before any work (bad usage: exit 2).

The commands live by what they do: this module's read checkpoints and runs (``inspect``,
``verify``, ``diff``, ``report``, ``register-best``), :mod:`.transform`'s write one file from another,
:mod:`.combine`'s combine checkpoints; :mod:`.common` holds the group they register on.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import click

from .. import resolve, targets, texts

# The commands of the other modules register on `main` as they are imported.
from . import combine, transform  # noqa: F401
from .common import (
    DIFFERENT,
    EXIT_CODES,
    FAILED,
    FORMAT_CHOICE,
    INTERRUPTED,
    NAME,
    OK,
    USAGE,
    Number,
    as_given,
    emit_json,
    fail_cleanly,
    human_size,
    inference_outputs_option,
    local_only,
    main,
    progress_option,
    show_progress,
    text_table,
)


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
@progress_option
@fail_cleanly
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
            figures = _statistics(found.path, info["format"], show_progress(progress))
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
        return emit_json(info)
    flags = [info["format"]] + ["nominal"] * info["nominal"] + ["external data"] * info["external_data"]
    flags += [f"step {info['step']}"] if "step" in info else []
    files = ", ".join(f"{os.path.basename(f)} {human_size(s)}" for f, s in info["files"].items())
    click.echo(f"{path}: {', '.join(flags)}; {files}")
    tensors = info["tensors"]
    shown = tensors if limit <= 0 else tensors[:limit]
    rows = [
        [
            t["name"],
            t["role"],
            t["dtype"],
            "x".join(map(str, t["shape"])) or "scalar",
            human_size(t["bytes"]),
            t["location"],
        ]
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
    click.echo(text_table(rows, header))
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
            text_table(
                [[g["role"], g["name"], human_size(g["bytes"]), g["sha256"]] for g in info["graphs"]],
                ["role", "file", "size", "sha256"],
            )
        )
    t = info["totals"]
    click.echo(
        f"\ntotal: {t['tensors']} tensors, {human_size(t['bytes'])} ({t['trainable']} trainable, {t['frozen']} frozen, "
        f"{t['momentum']} momentums; parameters {human_size(t['parameter_bytes'])}, "
        f"optimizer state {human_size(t['optimizer_bytes'])})"
    )


@main.command(epilog=EXIT_CODES, short_help="Check that a checkpoint is whole and readable.")
@click.argument("path", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
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
        result = run_verify(path, progress=show_progress(progress))
    except CheckpointIntegrityError as e:
        if as_json:
            emit_json({"path": path, "ok": False, "problems": [as_given(p) for p in e.problems]})
        else:
            click.echo(f"{path}: FAILED", err=True)
            for problem in e.problems:
                click.echo(f"  {as_given(' '.join(problem.split()))}", err=True)
        raise SystemExit(DIFFERENT) from None
    if as_json:
        return emit_json(
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
    click.echo(f"{path}: OK ({result.tensors} tensors, {human_size(result.tensor_bytes)} read{hashed}{sums})")


@main.command(epilog=EXIT_CODES, short_help="Compare two checkpoints, with tolerances.")
@click.argument("a", type=NAME)
@click.argument("b", type=NAME)
@click.option("--rtol", type=Number(minimum=0), default=0.0, show_default=True, help="Relative tolerance for values.")
@click.option("--atol", type=Number(minimum=0), default=0.0, show_default=True, help="Absolute tolerance for values.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
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
    if show_progress(progress):
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
        emit_json({"a": a, "b": b, "rtol": rtol, "atol": atol, **result.to_json(), **figures})
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
@fail_cleanly
def report(checkpoint: str, against: str | None, out: str, histograms: int, as_json: bool) -> None:
    """Write one self-contained HTML page about CHECKPOINT (no network needed to view it): files
    and sizes, tensors by role and dtype, optimizer groups, properties, the tensors holding NaN
    or Inf, every tensor's statistics and histograms; with --against, what changed per tensor.
    CHECKPOINT and OTHER are checkpoints of any format, CheckpointManager step folders, or
    s3:// checkpoints and steps."""
    from ..convert.files import load_any
    from ..report import write_report

    local_only(out, "--output")
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
        return emit_json({"checkpoint": checkpoint, "against": against, "out": out, "flagged": flagged})
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


@main.command(
    "register-best", epilog=EXIT_CODES, short_help="Register a run's best checkpoint in MLflow's model registry."
)
@click.argument("directory", type=NAME)
@click.argument("name")
@click.argument("eval_model", type=NAME)
@inference_outputs_option
@click.option("--metric", help="The metric to rank by (default: the one the run's checkpoints have, if only one).")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True, help="Best is min or max.")
@click.option("--tracking-uri", help="The MLflow server (default: MLFLOW_TRACKING_URI).")
@click.option(
    "--experiment",
    help="The MLflow experiment (default: MLFLOW_EXPERIMENT_NAME, else the one with the run's MLflow run).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@fail_cleanly
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

    local_only(eval_model, "EVAL_MODEL")
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
        return emit_json(
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
