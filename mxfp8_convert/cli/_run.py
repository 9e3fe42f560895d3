"""What the commands do once their options are read: the conversion (with the imports its end
needs loaded on a thread during the writes), the push, and the human result tables. No Typer
here: the program reaches this without it (``_fast``), Typer's commands (``_app``) call in."""

from __future__ import annotations

import gc
import importlib
import math
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mxfp8_convert._gc import paused_gc
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.cli._errors import handle_errors
from mxfp8_convert.cli._output import Output, human_bytes, table
from mxfp8_convert.format import CANONICAL_SUFFIX


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
            preload = _Preload(() if dry_run else
                               CARD_MODULES if as_json else CARD_MODULES + TABLE_MODULES)
            try:
                result = convert(model, backend, output, overwrite=overwrite, dry_run=dry_run,
                                 source_format=source_format, on_ineligible=on_ineligible,
                                 ignore=ignore, revision=revision, fresh=fresh,
                                 hub_repo_id=push_to_hub, progress=preload.around(on_progress),
                                 part=part, workers=workers, max_memory=max_memory, moe=moe,
                                 quantize_towers=quantize_towers,
                                 allow_no_quantized=allow_no_quantized,
                                 max_shard_size=max_shard_size)
            finally:  # before anything else prints (an error: rich) or imports
                preload.join()
        with paused_gc():  # a dry run's document: a dict per module and tensor (``_gc``)
            doc = result.to_dict()
        if push_to_hub is not None:
            with handle_errors(out, debug=debug):
                doc["push"] = _verify_and_push(out, result, push_to_hub, private, push_branch)
        with paused_gc():
            out.result(doc, lambda console: _render_convert(console, result, doc.get("push")))


#: what the end of a conversion imports: the model card's modules (``publish``) and, for people,
#: the result table's. They are imported on a thread once this many bytes are on their way to
#: the disk, which then stays busy with the writes queued meanwhile, instead of after the last
#: write (measured in BENCHMARKS.md, issue 25)
PRELOAD_AFTER = 64 << 20
CARD_MODULES = ("huggingface_hub.repocard_data", "safetensors")
TABLE_MODULES = ("rich.console", "rich.table")
#: the interpreter's thread switch interval while they load (default 5 ms): the shard writer's
#: threads, which need the GIL only between their C calls (copies, hashes, writes), each wait at
#: most this long for it
PRELOAD_SWITCH_S = 0.0005


class _Preload:
    """``modules`` imported on a thread from the first progress event of ``PRELOAD_AFTER``
    bytes transformed (events may come from several workers), and waited for at the "writing"
    event, which starts the end of the conversion, or at ``join()``: so the end never imports
    one of them beside this thread (two threads importing one package can deadlock on its
    import locks, and Python then hands one of them the package half made)."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules = modules
        self._once = threading.Lock()
        self._thread: threading.Thread | None = None

    def around(self, progress):
        """``progress``, starting and ending the imports on the way."""
        def on_event(e) -> None:
            if e.stage == "writing":
                self.join()
            elif (self.modules and e.stage == "transforming" and e.bytes_done >= PRELOAD_AFTER
                    and self._once.acquire(blocking=False)):
                self._thread = threading.Thread(target=_preload, args=(self.modules,),
                                                name="mxfp8-preload", daemon=True)
                self._thread.start()
            progress(e)

        return on_event

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


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


def run_inspect(model: str, *, source_format: str | None, revision: str | None, as_json: bool,
                debug: bool) -> None:
    """The ``inspect`` command's body, for Typer's ``inspect_cmd`` and the fast path alike."""
    from mxfp8_convert.inspection import inspect_checkpoint

    out = Output(as_json=as_json)
    with _planning_only(True):
        with handle_errors(out, debug=debug):
            report = inspect_checkpoint(model, source_format=source_format, revision=revision)
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


#: whether this process is the ``mxfp8-convert`` program (``cli.script`` sets it): it ends with
#: the command
PROGRAM = False


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
    elif PROGRAM:
        gc.disable()
        yield
    else:
        with paused_gc():
            yield
