"""The ``mxfp8-convert`` command line: thin commands over the library API.

``mxfp8-convert MODEL --backend trtllm`` is the ``convert`` command; ``verify`` and ``inspect``
are subcommands. Exit codes: 0 done, 1 conversion/verification failed, 2 usage error,
130/143 interrupted.
"""

from __future__ import annotations

import enum
import errno
import gc
import importlib
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from mxfp8_convert._gc import paused_gc
from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.cli._errors import Interrupted, JsonErrorCommand, Terminated, handle_errors
from mxfp8_convert.cli._fast import convert_args
from mxfp8_convert.cli._output import Output, human_bytes, size_bytes, table
from mxfp8_convert.format import CANONICAL_SUFFIX
from mxfp8_convert.formats import FORMATS
from mxfp8_convert.plan import MOE_MODES, ON_INELIGIBLE


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

SUBCOMMANDS = ("convert", "verify", "inspect", "finalize")

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


def run_convert(model: str, backend: str, *, output: str | None, overwrite: bool, dry_run: bool,
                source_format: str | None, on_ineligible: str, ignore: list[str] | None,
                revision: str | None, fresh: bool, push_to_hub: str | None, private: bool,
                push_branch: str | None, part: tuple[int, int] | None, workers: int,
                max_memory: int | None, moe: str, quantize_towers: bool,
                allow_no_quantized: bool, max_shard_size: int, as_json: bool, quiet: bool,
                debug: bool) -> None:
    """The convert command on its parsed, checked options (Typer's ``convert_cmd``, or
    ``_fast.convert_args`` for the common command lines): convert, push, print the result."""
    from mxfp8_convert import convert

    out = Output(as_json=as_json, quiet=quiet)
    with _planning_only(dry_run):
        with handle_errors(out, debug=debug), out.progress() as on_progress:
            if not dry_run:
                on_progress = _preloading(on_progress, CARD_MODULES if as_json
                                          else CARD_MODULES + TABLE_MODULES)
            result = convert(model, backend, output, overwrite=overwrite, dry_run=dry_run,
                             source_format=source_format, on_ineligible=on_ineligible,
                             ignore=ignore, revision=revision, fresh=fresh,
                             hub_repo_id=push_to_hub, progress=on_progress, part=part,
                             workers=workers, max_memory=max_memory, moe=moe,
                             quantize_towers=quantize_towers,
                             allow_no_quantized=allow_no_quantized, max_shard_size=max_shard_size)
        with paused_gc():  # a dry run's document: a dict per module and tensor (``_gc``)
            doc = result.to_dict()
        if push_to_hub is not None:
            with handle_errors(out, debug=debug):
                doc["push"] = _verify_and_push(out, result, push_to_hub, private, push_branch)
        with paused_gc():
            out.result(doc, lambda console: _render_convert(console, result, doc.get("push")))


#: what the end of a conversion imports: the model card's modules (``publish``) and, for people,
#: the result table's. They are imported on a thread once this many bytes are on their way to
#: the disk, which then stays busy with the writes queued meanwhile; at the end they took
#: 0.07-0.2 s after the last write (BENCHMARKS.md, issue 25)
PRELOAD_AFTER = 64 << 20
CARD_MODULES = ("huggingface_hub.repocard_data", "safetensors")
TABLE_MODULES = ("rich.console", "rich.table")
#: the interpreter's thread switch interval while they load (default 5 ms): the shard writer's
#: threads, which need the GIL only between their C calls (copies, hashes, writes), each wait at
#: most this long for it
PRELOAD_SWITCH_S = 0.0005


def _preloading(progress, modules: tuple[str, ...]):
    """``progress``, which also starts ``_preload(modules)`` on a thread, once, at the first
    event of ``PRELOAD_AFTER`` bytes transformed (events may come from several workers)."""
    once = threading.Lock()

    def on_event(e) -> None:
        if (e.stage == "transforming" and e.bytes_done >= PRELOAD_AFTER
                and once.acquire(blocking=False)):
            threading.Thread(target=_preload, args=(modules,), name="mxfp8-preload",
                             daemon=True).start()
        progress(e)

    return on_event


def _preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` (a failure is left for their real import to report)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, PRELOAD_SWITCH_S))
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - the import that needs it raises it again
                continue
    finally:
        sys.setswitchinterval(before)


def _verify_and_push(out, result, repo: str, private: bool, branch: str | None) -> dict:
    """Verify the output against its source, then upload it; never upload what fails."""
    from mxfp8_convert.errors import VerifyError
    from mxfp8_convert.publish import push_to_hub
    from mxfp8_convert.verify import verify

    report = verify(result.output, result.source)
    if not report.ok:
        raise VerifyError(f"not pushed: verification failed: {report.mismatches[0]}")
    if not out.interactive:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    url = push_to_hub(result.output, repo, private=private, revision=branch)
    return {"repo_id": repo, "branch": branch, "private": private, "commit_url": url}


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


def _render_convert(console, result, push: dict | None = None) -> None:
    plan = result.plan
    if result.part is not None:
        i, n = result.part
        done = f"{human_bytes(result.bytes_written)} in {result.seconds:.2f} s"
        console.print(f"Part {i} of {n} done ({done}); "
                      "run `mxfp8-convert finalize OUT` once every part has run.")
        return
    if result.dry_run:
        rows = _grouped([m.name, f"{m.n}x{m.k}", m.action,
                         m.layout + (f" ({m.reason})" if m.reason else ""), m.decided_by]
                        for m in plan.modules)
        console.print(table(f"Plan: {plan.format} -> {plan.backend}",
                            ["module", "count", "N x K", "action", "layout", "decided by"], rows))
        if plan.moe:
            console.print(table("Fused MoE blocks",
                                ["block", "experts", "H", "I", "action", "shard"],
                                [[m.name, m.experts, m.hidden, m.intermediate,
                                  m.gate[0].action, m.shard]
                                 for m in plan.moe]))
        if plan.unquantized:
            console.print(table("Left as they are",
                                ["weight", "count", "shape", "kind", "decided by", "why"],
                                _grouped([u.name, "x".join(map(str, u.shape)), u.kind,
                                          u.decided_by, u.why] for u in plan.unquantized)))
        console.print(table("Tensors by role", ["role", "layout", "dtype", "tensors", "bytes"],
                            _tensors_by_role(plan)))
        console.print(table("Shards", ["file", "tensors", "bytes"],
                            [[s.name, len(s.tensors), human_bytes(s.nbytes)] for s in plan.shards]))
        exists = ""
        if Path(result.output).exists():
            exists = " (it exists: a real run needs --overwrite)"
        console.print(f"Dry run: nothing written. Output would be {result.output}{exists}")
        return
    d = plan.to_dict()
    summary = [
        ["source", f"{result.source} ({plan.format})"],
        ["output", result.output],
        ["backend", _backend_summary(plan.backend)],
        ["modules", ", ".join(f"{v} {k}" for k, v in d["modules_by_action"].items()) or "none"],
        ["tensors", str(sum(len(s.tensors) for s in plan.shards))],
        ["shards", str(len(plan.shards))],
        ["written", human_bytes(result.bytes_written)],
        ["time", f"{result.seconds:.2f} s"],
    ]
    if plan.moe:
        sizes = sorted({(m.experts, m.hidden, m.intermediate) for m in plan.moe})
        summary.append(["fused MoE", f"{len(plan.moe)} blocks ("
                        + "; ".join(f"E={e}, H={h}, I={i}" for e, h, i in sizes) + ")"])
    if plan.kept:
        summary.append(["kept canonical", _kept_summary(plan.kept)])
    summary += _left_summary(plan)
    summary += _error_summary(result.quantization_errors)
    if push:
        summary.append(["pushed", f"{push['repo_id']} ({push['commit_url']})"])
    console.print(table("Converted", ["", ""], summary))


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _grouped(rows) -> list[list]:
    """Rows of the human plan whose names differ only in their numeric path parts (layer and
    expert indices) and agree in every other column, as one row: the name with ``*`` for those
    parts, and how many it stands for. Order of first appearance; ``--json`` lists each one."""
    groups: dict[tuple, list] = {}
    for name, *rest in rows:
        key = (_INDEX.sub("*", name), *rest)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [name, 1, key]
    return [[first if n == 1 else key[0], n, *key[1:]] for first, n, key in groups.values()]


def _left_summary(plan) -> list[list[str]]:
    """Summary rows: weights left unquantized (by kind), dequantized modules, stacked experts,
    dropped activation scales and kept KV-cache scales."""
    rows = []
    kinds: dict[str, int] = {}
    for u in plan.unquantized:
        if u.kind != "other":
            kinds[u.kind] = kinds.get(u.kind, 0) + 1
    if kinds:
        how = sorted({u.decided_by for u in plan.unquantized if u.kind != "other"})
        rows.append(["left unquantized", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                     + f" (decided by {'/'.join(how)})"])
    stacked = [u for u in plan.unquantized if u.kind == "stacked_experts"]
    if stacked:
        rows.append(["stacked experts", f"{len(stacked)} tensors NOT quantized: {stacked[0].why}"])
    split = sorted({m.name.rsplit(".", 2)[0] for m in plan.modules if m.stacked is not None}
                   | {layer.name for layer in plan.moe if layer.gate[0].stacked is not None})
    if split:
        rows.append(["stacked experts",
                     f"{len(split)} blocks quantized per expert ({split[0]}, ...)"])
    deq = [m.name for m in plan.modules if m.action == "dequantize"]
    if deq:
        rows.append(["dequantized",
                     f"{len(deq)} modules written in the model's dtype ({deq[0]}, ...)"])
    if plan.dropped:
        rows.append(["dropped", f"{len(plan.dropped)} static activation scales (input_scale): "
                     "MXFP8 activations are quantized dynamically"])
    if plan.kv_scales:
        rows.append(["KV-cache scales", f"{len(plan.kv_scales)} kept (kv_cache_scheme "
                     f"{plan.marker.get('kv_cache_scheme')})"])
    return rows


def _backend_summary(name: str) -> str:
    spec = BACKENDS[name]
    if not spec.laid_out:
        return f"{name} (plain MXFP8: {CANONICAL_SUFFIX} uint8 [N, K/32])"
    return f"{name} (weight {spec.weight_layout}, scale {spec.scale_layout})"


#: summary label of the modules whose error is reported, by plan action (plan.ACTIONS)
ERROR_LABELS = {"quantize": "quantized", "requantize": "requantized"}


def _error_summary(errors: dict) -> list[list[str]]:
    """One row per action: how many modules, and the worst SQNR (null: exact, infinite SQNR)."""
    by_action: dict[str, dict] = {}
    for name, e in errors.items():
        by_action.setdefault(e["action"], {})[name] = e
    rows = []
    for action, errs in by_action.items():
        worst = min(
            errs, key=lambda n: math.inf if errs[n]["sqnr_db"] is None else errs[n]["sqnr_db"]
        )
        e = errs[worst]
        sqnr = "exact" if e["sqnr_db"] is None else f"{e['sqnr_db']:.1f} dB"
        rel = "" if e["rel_fro"] is None else f" (rel. error {e['rel_fro']:.2e})"
        rows.append([ERROR_LABELS.get(action, action),
                     f"{len(errs)} modules; worst SQNR {sqnr}{rel} in {worst}"])
    return rows


def _tensors_by_role(plan) -> list[list]:
    """Every output tensor counted by (role, layout, dtype); --json lists them one by one."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for shard in plan.shards:
        for t in shard.tensors:
            g = groups.setdefault((t.role, t.layout, t.dtype), [0, 0])
            g[0] += 1
            g[1] += t.nbytes
    return [[*key, n, human_bytes(b)] for key, (n, b) in sorted(groups.items())]


def _kept_summary(kept: tuple[str, ...]) -> str:
    """Kept modules by name, experts counted per MoE block (a model has thousands)."""
    from mxfp8_convert.plan import expert_key

    blocks: dict[str, int] = {}
    names = []
    for name in kept:
        key = expert_key(name)
        if key is None:
            names.append(name)
        else:
            blocks[key[0]] = blocks.get(key[0], 0) + 1
    return ", ".join(names + [f"{b} ({n} expert projections)" for b, n in blocks.items()])


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


def _render_verify(console, report) -> None:
    rows = [["path", report.path], ["backend", str(report.backend)],
            ["files checked", str(report.files_checked)],
            ["tensors checked", str(report.tensors_checked)]]
    if report.source:
        rows += [["source", report.source], ["modules compared", str(report.modules_compared)]]
    rows.append(["result", "OK" if report.ok else f"{len(report.mismatches)} mismatch(es)"])
    console.print(table("Verify", ["", ""], rows))
    if report.mismatches:
        console.print(table("Mismatches", ["where", "what", "first position"],
                            [[m.where, m.what, str(m.position)] for m in report.mismatches[:50]]))


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
    from mxfp8_convert.inspection import inspect_checkpoint

    out = Output(as_json=as_json)
    with _planning_only(True):
        with handle_errors(out, debug=debug):
            report = inspect_checkpoint(path, source_format=source_format and source_format.value,
                                        revision=revision)
        out.result(report.to_dict(), lambda console: _render_inspect(console, report))


def _render_inspect(console, report) -> None:
    head = [["path", report.path], ["format", f"{report.format} ({report.kind})"],
            ["shards", str(report.shards)]]
    if report.backend:
        head.append(["laid out for", f"{report.backend} (complete: {report.complete})"])
        sizes = "not recorded (format version 1)" if report.tp_compat is None else (
            ", ".join(map(str, report.tp_compat)) or "none")
        head.append(["tensor parallel", sizes])
    for role in sorted(report.bytes_by_role):
        size = human_bytes(report.bytes_by_role[role])
        head.append([f"{role} tensors", f"{report.count_by_role[role]} ({size})"])
    for backend, what in report.actions.items():
        head.append([f"-> {backend}", what])
    console.print(table("Checkpoint", ["", ""], head))
    from mxfp8_convert.plan import expert_key

    if report.moe:
        console.print(table("MoE blocks",
                            ["block", "experts", "H", "I", "stored as", "fused MoE (trtllm)"],
                            [[m.name, m.experts, m.hidden, m.intermediate, m.stored,
                              "ok" if not m.why_not else "; ".join(m.why_not)]
                             for m in report.moe]))
    blocks = {m.name for m in report.moe}
    # a MoE block's experts are in the table above
    modules = [m for m in report.modules if (expert_key(m.name) or ("",))[0] not in blocks]
    backends = sorted({b for m in report.modules for b in m.backends})
    rows = _grouped([m.name, "x".join(map(str, m.shape)), m.weight_dtype, m.layout,
                     *["ok" if not m.backends[b] else "; ".join(m.backends[b]) for b in backends]]
                    for m in modules)
    columns = ["module", "count", "shape", "dtype", "stored as", *backends]
    console.print(table("Linear modules", columns, rows))


def _on_signal(signum, frame) -> None:
    raise Terminated() if signum == getattr(signal, "SIGTERM", None) else Interrupted()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Without a subcommand, arguments go to ``convert``.

    SIGINT and SIGTERM end the run with 130 / 143 and one ``Error:`` line wherever they land,
    also before or after a command's own error handling (parsing, printing the result).
    """
    from mxfp8_convert.cli._errors import EXIT_SIGINT, EXIT_SIGTERM, HINTS

    args = list(sys.argv[1:] if argv is None else argv)
    sigs = [s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)) if s is not None]
    previous = {s: signal.signal(s, _on_signal) for s in sigs}
    try:
        if args and args[0] not in SUBCOMMANDS and args[0] not in ("--help", "-h", "--version"):
            args.insert(0, "convert")
        fast = convert_args(args[1:]) if args and args[0] == "convert" else None
        if fast is not None:
            return _run_fast(fast)
        app(args=args, prog_name="mxfp8-convert", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (KeyboardInterrupt, Interrupted) as e:
        code = EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT
        what = "terminated" if code == EXIT_SIGTERM else "interrupted"
        Output(as_json="--json" in args).error(what, getattr(e, "hint", None) or HINTS[code])
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0


def _run_fast(kwargs: dict) -> int:
    """``run_convert`` on a command line read by ``_fast.convert_args``, ending as Typer ends a
    command in its standalone mode: ``typer.Exit``'s code, 130 for a KeyboardInterrupt (Typer's
    silent exit), 1 for a closed stdout (EPIPE: what is left to print goes nowhere)."""
    try:
        run_convert(kwargs.pop("model"), kwargs.pop("backend"), **kwargs)
    except typer.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):
                pass
        return 1
    return 0


#: whether this process is the ``mxfp8-convert`` program (``script``): it ends with the command
_PROGRAM = False


@contextmanager
def _planning_only(only: bool) -> Iterator[None]:
    """Around a command that reads headers and plans, nothing else (a dry run, ``inspect``;
    ``only`` False: no effect): the cycle collector paused from the checkpoint's opening to the
    printed document. Its objects (~10^5 for DeepSeek-V3: header entries, module plans,
    document nodes) form no cycles (``_gc``), and the first collection after a pause walks
    everything made during it: in a dry run and ``inspect`` there were two such walks, between
    opening and planning and before printing (BENCHMARKS.md, issue 25). In the program the
    collector stays off to the end, where ``script`` freezes what is left; called in-process,
    it resumes.
    """
    if not only:
        yield
    elif _PROGRAM:
        gc.disable()
        yield
    else:
        with paused_gc():
            yield


def script() -> None:
    """The ``mxfp8-convert`` program: ``main()``, then the process ends with its exit code.

    What the command built (a DeepSeek-V3-sized plan is ~10^5 header entries, module plans and
    document nodes) is moved out of the cycle collector's reach first (``gc.freeze``): the
    interpreter's shutdown collections would walk all of it once more only to free it
    (BENCHMARKS.md, issue 25); it is freed by reference counting as before.
    ``main()`` itself leaves the collector as it found it, for callers that go on running.
    """
    global _PROGRAM
    _PROGRAM = True
    code = main()
    gc.freeze()
    raise SystemExit(code)
