"""The ``ortckpt`` commands that write one file from another: ``convert``, ``nominal``,
``export``, ``upgrade``, ``compress``, ``decompress``."""

from __future__ import annotations

import click

from .. import resolve
from .common import (
    EXIT_CODES,
    FORMAT_CHOICE,
    NAME,
    checked_format,
    emit_json,
    fail_cleanly,
    inference_outputs_option,
    local_only,
    main,
    progress_option,
    show_progress,
)


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
@progress_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@fail_cleanly
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

    local_only(model, "--model")
    to = checked_format(dst, dst_format, "--to", must_exist=False)
    if to == "onnx" and model is None:
        raise click.UsageError("writing an ONNX model needs the model whose inputs take the weights: --model MODEL")
    with resolve.checkpoint(src) as found:
        source_format = checked_format(found.path, None if found.step else src_format, "--from", must_exist=True)
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
            progress=show_progress(progress),
        )
    if as_json:
        return emit_json({"src": src, "dst": dst, "from": formats[0], "to": formats[1]})
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
@fail_cleanly
def nominal(src: str, dst: str, src_format: str | None, as_json: bool) -> None:
    """Write the nominal twin of a checkpoint: parameter names, roles and types without values
    (what ONNX Runtime's generate_artifacts(nominal_checkpoint=True) writes), for apps that ship
    small and load the weights later."""
    from ..convert.files import to_nominal

    local_only(dst, "DST")
    with resolve.checkpoint(src) as found:
        fmt = checked_format(found.path, None if found.step else src_format, "--from", must_exist=True)
        count = to_nominal(found.path, dst, src_format=fmt)
    if as_json:
        return emit_json({"src": src, "dst": dst, "parameters": count})
    click.echo(f"{dst}: nominal checkpoint of {count} parameters")


@main.command(epilog=EXIT_CODES, short_help="Export an inference ONNX model from a checkpoint and its eval model.")
@click.argument("checkpoint", type=NAME)
@click.argument("eval_model", type=NAME)
@click.argument("out", type=NAME)
@inference_outputs_option
@click.option(
    "--external-data/--no-external-data",
    default=None,
    help="Weights in OUT.data (default: when the checkpoint has external data, as ONNX Runtime's export, "
    "or the model would pass protobuf's 2 GiB).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@fail_cleanly
def export(
    checkpoint: str, eval_model: str, out: str, outputs: tuple[str, ...], external_data: bool | None, as_json: bool
) -> None:
    """Write the inference model ONNX Runtime's Module.export_model_for_inferencing writes: the
    eval model's parameter inputs bound to the checkpoint's values, only the --output values
    and the nodes they need. It runs in the onnxruntime inference package; no training package
    is needed."""
    from ..convert.onnx_model import export_model

    local_only(eval_model, "EVAL_MODEL")
    local_only(out, "OUT")
    with resolve.checkpoint(checkpoint) as found:
        export_model(found.path, eval_model, out, output_names=list(outputs) or None, external_data=external_data)
    if as_json:
        return emit_json({"checkpoint": checkpoint, "eval_model": eval_model, "out": out, "outputs": list(outputs)})
    click.echo(f"{out}: inference model" + (f" with outputs {', '.join(outputs)}" if outputs else ""))


@main.command(epilog=EXIT_CODES, short_help="Rewrite an ONNX Runtime 1.16 checkpoint (version 1) as version 2.")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@fail_cleanly
def upgrade(src: str, dst: str, as_json: bool) -> None:
    """Write SRC (checkpoint format version 1, which ONNX Runtime 1.16 wrote and 1.17+ refuses,
    or version 2) to DST as version 2 with the same parameters, optimizer state and properties."""
    from ..versions import upgrade as run_upgrade

    with resolve.checkpoint(src) as found:
        version = run_upgrade(found.path, dst)
    if as_json:
        return emit_json({"src": src, "dst": dst, "from_version": version, "to_version": 2})
    click.echo(f"{src} (version {version}) -> {dst} (version 2)")


@main.command(epilog=EXIT_CODES, short_help="Compress a checkpoint kept for the long term (zstd).")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--level", type=click.IntRange(1, 22), default=3, show_default=True, help="The zstd level.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
def compress(src: str, dst: str, level: int, as_json: bool, progress: bool | None) -> None:
    """Write the checkpoint SRC (and SRC.data) as one compressed archive DST: zstd over the
    files with each floating-point tensor's bytes grouped. ONNX Runtime cannot read it:
    `ortckpt decompress` gives the checkpoint back, byte for byte."""
    from ..compression import compress as run_compress

    local_only(dst, "DST")
    with resolve.checkpoint(src, local=True) as found:
        done = run_compress(found.path, dst, level=level, progress=show_progress(progress))
    if as_json:
        return emit_json({"src": src, "dst": dst, "bytes": done.size, "compressed_bytes": done.compressed_size})
    click.echo(f"{src} ({done.size:,} bytes) -> {dst} ({done.compressed_size:,} bytes, {done.ratio:.2f}x)")


@main.command(epilog=EXIT_CODES, short_help="Write a compressed checkpoint back as the checkpoint it was.")
@click.argument("src", type=NAME)
@click.argument("dst", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
def decompress(src: str, dst: str, as_json: bool, progress: bool | None) -> None:
    """Write the checkpoint in the archive SRC to DST (and DST.data), checking every file's
    size and SHA-256 against the archive before it replaces anything."""
    from ..compression import decompress as run_decompress

    local_only(dst, "DST")
    with resolve.archive(src) as archive:
        run_decompress(archive, dst, progress=show_progress(progress))
    if as_json:
        return emit_json({"src": src, "dst": dst})
    click.echo(f"{src} -> {dst}")
