"""Job arrays: ``--num-parts N --part I`` converts one part of the shards into the shared work
folder, and ``finalize`` gathers the parts into the output once all of them ran."""

from __future__ import annotations

import time
from pathlib import Path

from mxfp8_convert.errors import ConvertError, OutputError
from mxfp8_convert.plan import ConversionPlan, ShardPlan
from mxfp8_convert.plan.shards import DEFAULT_MAX_SHARD_SIZE
from mxfp8_convert.run import (
    ConversionResult,
    Modes,
    ProgressCallback,
    SourceProof,
    finish_output,
    note_if_complete,
    plan_conversion,
)
from mxfp8_convert.write import Staging


def check_part(part: tuple[int, int]) -> tuple[int, int]:
    """``(i, n)`` as given, if part ``i`` of ``n`` exists."""
    i, n = part
    if n < 1 or not 0 <= i < n:
        raise ConvertError(f"--part {i} is not in 0..{n - 1} for --num-parts {n}")
    return i, n


def part_shards(plan: ConversionPlan, part: tuple[int, int]) -> list[ShardPlan]:
    """The shards part ``i`` of ``n`` converts: round robin over the sorted shards."""
    i, n = check_part(part)
    return [s for j, s in enumerate(plan.shards) if j % n == i]


def part_of(plan: ConversionPlan, shard: str, num_parts: int) -> int:
    """The part that converts ``shard``."""
    return next(j for j, s in enumerate(plan.shards) if s.name == shard) % num_parts


def finalize(output: str | Path, *, source: str | Path | None = None,
             hub_repo_id: str | None = None,
             progress: ProgressCallback | None = None) -> ConversionResult:
    """Gather the parts of a split conversion (``--num-parts N --part I``) into the output.

    Checks that every part ran with the same parameters and that every shard it wrote still
    verifies, then writes the index, config, model card and completion marker, and renames the
    work folder into place. Safe to rerun.

    Args:
        output: the destination the parts were converted to.
        source: the source checkpoint, if not at the path the parts recorded.
        hub_repo_id: where the output will be published (named in its model card).
        progress: callback receiving ``ProgressEvent``s.

    Raises:
        OutputError: a part missing, unfinished, still running, or made with other parameters.
    """
    t0 = time.perf_counter()
    dest = Path(output)
    staging, _ = Staging.finalizing(dest)
    errors: dict[str, dict] = {}
    try:
        p = staging.params
        ckpt, plan = plan_conversion(str(source or staging.source), p["backend"],
                                     source_format=p["format"], on_ineligible=p["on_ineligible"],
                                     ignore=p["ignore"], moe=p.get("moe", "fuse"),
                                     quantize_towers=p.get("quantize_towers", False),
                                     allow_no_quantized=p.get("allow_no_quantized", False),
                                     max_shard_size=p.get("max_shard_size",
                                                          DEFAULT_MAX_SHARD_SIZE))
        if plan.fingerprint != p["source_fingerprint"]:
            raise OutputError(f"{ckpt.root}: not the source the parts were converted from "
                              "(fingerprint differs)")
        n = p["num_parts"]
        missing = [s.name for s in plan.shards if s.name not in staging.files]
        if missing:
            raise OutputError(f"{dest}: shard {missing[0]} (part {part_of(plan, missing[0], n)} "
                              f"of {n}) is not finished", hint="rerun that part; it resumes")
        proof = SourceProof(ckpt, plan)
        files = {}
        for j, s in enumerate(plan.shards):
            rec = staging.files[s.name]
            if not proof.unchanged(s, rec):
                raise OutputError(f"{dest}: the source bytes behind shard {s.name} (part {j % n} "
                                  f"of {n}) are not those it was converted from",
                                  hint="rerun that part; it redoes the shard")
            errors.update(rec.get("errors") or {})
            files[s.name] = {"size": rec["size"], "xxh3_128": rec["xxh3_128"]}
        written = finish_output(ckpt, plan, staging.path, files, errors,
                                modes=Modes.of(ckpt, plan), hub_repo_id=hub_repo_id,
                                emit=progress or (lambda e: None), done=0)
        staging.commit()
    except BaseException as e:
        staging.suspend()
        note_if_complete(staging, e)
        raise
    return ConversionResult(str(ckpt.root), str(dest), plan, False, time.perf_counter() - t0,
                            written, dict(sorted(errors.items())))
