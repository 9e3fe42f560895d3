"""Convert a checkpoint through the library API, printing progress events and the plan summary.

What `mxfp8-convert MODEL --backend B` does, without the CLI:

    python examples/make_demo_model.py /tmp/demo
    python examples/convert_with_library.py /tmp/demo --backend trtllm --dry-run
    python examples/convert_with_library.py /tmp/demo --backend cutlass -o /tmp/demo-cutlass

Progress goes to stderr, the summary to stdout.
"""

from __future__ import annotations

import argparse
import sys

from mxfp8_convert import BACKENDS, ConvertError, ProgressEvent, convert


def progress_printer():
    """A ``progress`` callback: prints each stage once, and each tensor as it starts
    transforming."""
    last = {"stage": None, "tensor": None}

    def on_event(event: ProgressEvent) -> None:
        if event.stage != last["stage"]:
            print(f"[{event.stage}]", file=sys.stderr)
        if event.stage == "transforming" and event.tensor != last["tensor"]:
            pct = 100 * event.bytes_done / event.bytes_total if event.bytes_total else 100.0
            print(f"  {pct:5.1f}%  {event.shard}  {event.tensor}", file=sys.stderr)
        last.update(stage=event.stage, tensor=event.tensor)

    return on_event


def summary(result) -> list[str]:
    plan = result.to_dict()["plan"]
    actions = ", ".join(f"{n} {a}" for a, n in plan["modules_by_action"].items()) or "none"
    lines = [
        f"source:   {result.source} ({result.plan.format})",
        f"backend:  {result.plan.backend}",
        f"modules:  {actions}",
        f"tensors:  {sum(len(s['tensors']) for s in plan['shards'])} "
        f"in {len(plan['shards'])} shard(s), {plan['total_bytes']} bytes",
        f"copied:   {', '.join(plan['copied_files']) or 'nothing'}",
    ]
    if plan["kept_canonical"]:
        lines.append(f"kept canonical: {', '.join(plan['kept_canonical'])}")
    if result.dry_run:
        lines.append(f"dry run: nothing written; output would be {result.output}")
    else:
        lines.append(f"output:   {result.output} "
                     f"({result.bytes_written} bytes in {result.seconds:.2f} s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="local folder or Hub repo id")
    ap.add_argument("--backend", required=True, choices=sorted(BACKENDS))
    ap.add_argument("-o", "--output", help="output folder (default: MODEL-BACKEND beside MODEL)")
    ap.add_argument("--dry-run", action="store_true", help="plan only; write nothing")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    args = ap.parse_args(argv)
    try:
        result = convert(args.model, args.backend, args.output, dry_run=args.dry_run,
                         overwrite=args.overwrite, progress=progress_printer())
    except ConvertError as e:  # one line, and a hint when there is one
        print(f"Error: {e}" + (f"\nHint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 1
    print("\n".join(summary(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
