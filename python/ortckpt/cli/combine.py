"""The ``ortckpt`` commands that combine checkpoints (:mod:`ortckpt.arithmetic`): ``average``,
``delta``, ``apply``."""

from __future__ import annotations

import os

import click

from .. import resolve, targets
from .common import EXIT_CODES, NAME, Number, Weights, emit_json, fail_cleanly, main, progress_option, show_progress


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
@progress_option
@fail_cleanly
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
                progress=show_progress(progress),
            )
        except CheckpointStateError as e:  # (the library's spelling of the option is Python's)
            if type(e) is not CheckpointStateError or "frozen='first'" not in str(e):
                raise
            raise CheckpointStateError(str(e).replace("frozen='first'", "--frozen-from-first")) from None
        used = average_weights(paths, weights) if as_json else None
    if as_json:
        return emit_json({"out": out, "sources": list(checkpoints), "weights": used})
    click.echo(f"{out}: average of {len(checkpoints)} checkpoints")


@main.command("delta", epilog=EXIT_CODES, short_help="Write A - B (what changed).")
@click.argument("a", type=NAME)
@click.argument("b", type=NAME)
@click.argument("out", type=NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
def delta_command(a: str, b: str, out: str, as_json: bool, progress: bool | None) -> None:
    """Write to OUT the difference A - B of the trainable float parameters (other tensors as in A).
    A and B may be CheckpointManager step folders; any may be on s3://."""
    from ..arithmetic import delta as run_delta

    with resolve.checkpoints([a, b]) as (path_a, path_b):
        run_delta(path_a, path_b, out=out, progress=show_progress(progress))
    if as_json:
        return emit_json({"a": a, "b": b, "out": out})
    click.echo(f"{out}: {a} - {b}")


@main.command("apply", epilog=EXIT_CODES, short_help="Write BASE + scale * DELTA.")
@click.argument("base", type=NAME)
@click.argument("delta", type=NAME)
@click.argument("out", type=NAME)
@click.option(
    "--scale", type=Number(), default=1.0, show_default=True, help="The (finite) factor DELTA is multiplied by."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@progress_option
@fail_cleanly
def apply_command(base: str, delta: str, out: str, scale: float, as_json: bool, progress: bool | None) -> None:
    """Write to OUT the checkpoint BASE + scale * DELTA (a delta written by `ortckpt delta`).
    BASE and DELTA may be CheckpointManager step folders; any may be on s3://."""
    from ..arithmetic import apply as run_apply

    with resolve.checkpoints([base, delta]) as (path_base, path_delta):
        run_apply(path_base, path_delta, scale, out=out, progress=show_progress(progress))
    if as_json:
        return emit_json({"base": base, "delta": delta, "out": out, "scale": scale})
    click.echo(f"{out}: {base} + {scale:g} * {delta}")
