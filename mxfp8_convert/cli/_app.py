"""The ``mxfp8-convert`` commands as a Typer app: options, usage errors, help. Imported only
for command lines the program does not read itself (``_fast``): Typer's parsing imports pydantic.
"""

from __future__ import annotations

import enum
import sys
from contextlib import contextmanager
from typing import Annotated

import typer
from typer.core import TyperCommand

from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.cli._errors import handle_errors
from mxfp8_convert.cli._output import Output, size_bytes
from mxfp8_convert.cli._run import (
    _render_convert,
    _render_verify,
    run_convert,
    run_inspect,
)
from mxfp8_convert.formats import FORMATS
from mxfp8_convert.plan import MOE_MODES, ON_INELIGIBLE

#: the base of every command-line usage error (missing or bad option values, unknown options):
#: Click's ``UsageError``, vendored inside Typer, reached through the one name Typer exports
UsageError = typer.BadParameter.__base__


class JsonErrorCommand(TyperCommand):
    """A command whose usage errors also print the ``--json`` error document on stdout.

    Typer still prints its own usage message on stderr and exits 2.
    """

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        with _usage_document("--json" in args):
            return super().parse_args(ctx, args)

    def invoke(self, ctx):
        with _usage_document(bool(ctx.params.get("as_json"))):
            return super().invoke(ctx)


@contextmanager
def _usage_document(as_json: bool):
    try:
        yield
    except UsageError as e:
        if as_json:
            ctx = getattr(e, "ctx", None)
            hint = f"see `{ctx.command_path} --help`" if ctx is not None else None
            Output(as_json=True).error_document(e.format_message(), hint)
        raise


def _choices(name: str, values) -> type[enum.Enum]:
    """A str Enum of the table's names: Typer checks the value and names the choices (exit 2)."""
    return enum.Enum(name, {v: v for v in values}, type=str)


Backend = _choices("Backend", BACKENDS)
SourceFormat = _choices("SourceFormat", (f.name for f in FORMATS))
OnIneligible = _choices("OnIneligible", ON_INELIGIBLE)
MoEMode = _choices("MoEMode", MOE_MODES)

EPILOG = """\
Examples:

  mxfp8-convert ./Llama-3-8B-MXFP8 --backend trtllm -o ./Llama-3-8B-MXFP8-trtllm

  mxfp8-convert org/model-MXFP8 --backend cutlass --dry-run --json

  mxfp8-convert ./model --backend trtllm --on-ineligible keep

  mxfp8-convert ./Qwen3-30B-A3B-MXFP8 --backend trtllm --moe keep

  mxfp8-convert verify ./Llama-3-8B-MXFP8-trtllm --source ./Llama-3-8B-MXFP8

  mxfp8-convert inspect deepseek-ai/DeepSeek-V3 --json

  mxfp8-convert ./big --backend trtllm -o /shared/out --num-parts 8 --part $SLURM_ARRAY_TASK_ID

  mxfp8-convert finalize /shared/out

Exit codes: 0 done, 1 conversion or verification failed, 2 usage error, 130 interrupted.
"""

app = typer.Typer(
    name="mxfp8-convert",
    help="Lay out MXFP8 checkpoints offline for FlashInfer's mm_mxfp8 (trtllm or cutlass).",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL", help="Model folder, or Hugging Face Hub repo id (org/name).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or info on stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).")
]


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"mxfp8-convert {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Lay out MXFP8 checkpoints offline for FlashInfer's mm_mxfp8 (trtllm or cutlass)."""


@app.command("convert", epilog=EPILOG, cls=JsonErrorCommand)
def convert_cmd(
    model: ModelArg,
    backend: Annotated[
        Backend,
        typer.Option(
            "--backend", "-b",
            help="Target layout: trtllm, cutlass, or canonical (plain MXFP8, the way back).",
            show_default=False,
        ),
    ],
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Output folder [default: MODEL-BACKEND beside MODEL]."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output folder.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; write nothing.")
    ] = False,
    source_format: Annotated[
        SourceFormat | None,
        typer.Option("--source-format", help="Override format detection (see `inspect`)."),
    ] = None,
    on_ineligible: Annotated[
        OnIneligible,
        typer.Option(
            "--on-ineligible",
            help="error: fail listing tensors the backend cannot take; "
            "keep: leave them canonical MXFP8.",
        ),
    ] = OnIneligible.error,
    ignore: Annotated[
        list[str] | None,
        typer.Option("--ignore", help="Module name pattern to leave untouched (repeatable)."),
    ] = None,
    revision: RevisionOpt = None,
    fresh: Annotated[
        bool,
        typer.Option("--fresh", help="Discard an interrupted earlier run instead of resuming it."),
    ] = False,
    push_to_hub: Annotated[
        str | None,
        typer.Option(
            "--push-to-hub", metavar="REPO",
            help="After a conversion that verifies, upload it to this Hub repo "
            "(created if needed).",
        ),
    ] = None,
    private: Annotated[
        bool, typer.Option("--private", help="With --push-to-hub: create the repo private.")
    ] = False,
    push_branch: Annotated[
        str | None,
        typer.Option(
            "--push-branch",
            help="With --push-to-hub: the branch to upload to (created if needed).",
        ),
    ] = None,
    num_parts: Annotated[
        int | None,
        typer.Option(
            "--num-parts",
            help="Split the conversion by output shard into N parts (job arrays); see `finalize`.",
        ),
    ] = None,
    part: Annotated[
        int | None,
        typer.Option(
            "--part",
            help="With --num-parts: the part this task converts, 0..N-1 "
            "(e.g. $SLURM_ARRAY_TASK_ID).",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            help="Shards converted in parallel on this machine. One worker's writes already "
            "keep a disk busy (O_DIRECT), so more workers help only with cores and disk "
            "bandwidth to spare (on 2 cores: faster in most runs, slower in some; "
            "BENCHMARKS.md).",
        ),
    ] = 1,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory",
            help="Memory budget for the workers, e.g. 8GiB (fewer workers run if needed).",
        ),
    ] = None,
    moe: Annotated[
        MoEMode,
        typer.Option(
            "--moe",
            help="Per-expert MoE weights (experts.<e>.{gate,up,down}_proj, w1/w3/w2). "
            "fuse: for trtllm, into the fused MoE kernel's [E, 2I, H] and [E, H, I] tensors "
            "(other backends: linears like any other); "
            "keep: leave them per-expert canonical MXFP8.",
        ),
    ] = MoEMode.fuse,
    quantize_towers: Annotated[
        bool,
        typer.Option(
            "--quantize-towers",
            help="Dense sources: also quantize the linear layers outside the language model "
            "(vision/audio towers, projectors, task heads).",
        ),
    ] = False,
    allow_no_quantized: Annotated[
        bool,
        typer.Option(
            "--allow-no-quantized",
            help="Write a plain copy when no module would be converted (otherwise an error).",
        ),
    ] = False,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            help="Largest output shard, e.g. 5GB (10^9) or 4GiB, as in transformers' "
            "save_pretrained; a larger module gets a shard of its own. Shards are named "
            "model-00001-of-0000N.safetensors, or model.safetensors alone.",
        ),
    ] = "5GB",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Convert MODEL to the layout of --backend and write a checkpoint that says so."""
    if (num_parts is None) != (part is None):
        raise typer.BadParameter("--num-parts and --part go together", param_hint="--part")
    if num_parts is not None and num_parts < 1:
        raise typer.BadParameter(f"{num_parts} is not a number of parts (at least 1)",
                                 param_hint="--num-parts")
    if num_parts is not None and not 0 <= part < num_parts:
        raise typer.BadParameter(f"--part {part} is not in 0..{num_parts - 1}", param_hint="--part")
    if num_parts is not None and push_to_hub is not None:
        raise typer.BadParameter(
            "push after `finalize`, not from a part", param_hint="--push-to-hub"
        )
    if workers < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--workers")
    budget = parse_size(max_memory) if max_memory is not None else None
    shard_bytes = parse_size(max_shard_size, "--max-shard-size")
    if shard_bytes <= 0:
        raise typer.BadParameter("must be positive", param_hint="--max-shard-size")
    if push_to_hub is None and (private or push_branch):
        raise typer.BadParameter(
            "--private and --push-branch need --push-to-hub", param_hint="--push-to-hub"
        )
    if push_to_hub is not None and dry_run:
        raise typer.BadParameter("--dry-run writes nothing to push", param_hint="--push-to-hub")
    run_convert(model, backend.value, output=output, overwrite=overwrite, dry_run=dry_run,
                source_format=source_format and source_format.value,
                on_ineligible=on_ineligible.value, ignore=ignore, revision=revision,
                fresh=fresh, push_to_hub=push_to_hub, private=private, push_branch=push_branch,
                part=(part, num_parts) if num_parts is not None else None, workers=workers,
                max_memory=budget, moe=moe.value, quantize_towers=quantize_towers,
                allow_no_quantized=allow_no_quantized, max_shard_size=shard_bytes,
                as_json=as_json, quiet=quiet, debug=debug)


def parse_size(text: str, param: str = "--max-memory") -> int:
    """'8GiB', '500MB', '1.5G' or a plain byte count -> bytes, as pydantic's ``ByteSize`` reads
    them (``size_bytes``): KB/MB/GB (and K/M/G) are powers of 1000, KiB/MiB/GiB powers of 1024,
    as ``human_bytes`` prints them."""
    n = size_bytes(text)
    if n is None:
        raise typer.BadParameter(f"{text!r} is not a size like 8GiB or 500MB", param_hint=param)
    return n


@app.command("finalize", cls=JsonErrorCommand)
def finalize_cmd(
    path: Annotated[
        str, typer.Argument(metavar="OUT", help="The output the parts were converted to.")
    ],
    source: Annotated[
        str | None,
        typer.Option("--source", help="The source, if not at the path the parts recorded."),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Complete a conversion split with --num-parts: check every part ran with the same
    parameters and its shards verify, then write the index, config, card and completion marker."""
    from mxfp8_convert.convert import finalize

    out = Output(as_json=as_json, quiet=quiet)
    with handle_errors(out, debug=debug), out.progress() as on_progress:
        result = finalize(path, source=source, progress=on_progress)
    out.result(result.to_dict(), lambda console: _render_convert(console, result))


@app.command("verify", cls=JsonErrorCommand)
def verify_cmd(
    path: Annotated[str, typer.Argument(metavar="OUT", help="A folder written by mxfp8-convert.")],
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            help="The checkpoint it was converted from: invert every layout and compare bytes.",
        ),
    ] = None,
    no_hashes: Annotated[
        bool,
        typer.Option(
            "--no-hashes",
            help="Skip re-hashing every file: a changed byte that keeps a file's size goes "
            "unseen (unless --source compares it). "
            "Sizes, missing and unlisted files are still checked.",
        ),
    ] = False,
    source_format: Annotated[
        SourceFormat | None,
        typer.Option(
            "--source-format",
            help="The source's format [default: the one the output records].",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check an output: completion and layout markers, every tensor's shape and dtype, and, with
    --source, every byte against the source. Exit 1 on any mismatch."""
    from mxfp8_convert.verify import verify

    out = Output(as_json=as_json, quiet=quiet)
    with handle_errors(out, debug=debug):
        report = verify(path, source, check_hashes=not no_hashes,
                        source_format=source_format and source_format.value)
    if report.ok:
        out.result(report.to_dict(), lambda console: _render_verify(console, report))
        return
    first = report.mismatches[0]
    more = f" (+{len(report.mismatches) - 1} more)" if len(report.mismatches) > 1 else ""
    message = f"verification failed: {first}{more}"
    out.result({**report.to_dict(), "error": message, "hint": None},
               lambda console: _render_verify(console, report))
    out.error(message)
    raise typer.Exit(1)


@app.command("inspect", cls=JsonErrorCommand)
def inspect_cmd(
    path: ModelArg,
    source_format: Annotated[
        SourceFormat | None,
        typer.Option("--source-format", help="Override format detection."),
    ] = None,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Describe a checkpoint (source or output): format or layout, bytes by role, and per linear
    module whether each backend can take it and why not."""
    run_inspect(path, source_format=source_format and source_format.value, revision=revision,
                as_json=as_json, debug=debug)


