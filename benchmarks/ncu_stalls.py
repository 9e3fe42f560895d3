"""Summarize ``benchmarks/ncu_dqmma.sh`` outputs: per kernel, the headline metrics of its
details page and where its warps' stall samples fall (by reason and by instruction).

    python3 benchmarks/ncu_stalls.py DIR [--out FILE.json]

Reads ``DIR/NAME_details.txt`` and ``DIR/NAME_sass.csv`` for every NAME; prints a table and, with
``--out``, writes the summary as JSON. Runs anywhere (no GPU): the inputs are ncu's text exports.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import Counter
from pathlib import Path

#: details-page metrics kept (the metric's name as ncu prints it)
METRICS = (
    "Duration", "SM Frequency", "DRAM Throughput", "L2 Cache Throughput", "Memory Throughput",
    "Issue Slots Busy", "Issued Warp Per Scheduler", "No Eligible", "Active Warps Per Scheduler",
    "Eligible Warps Per Scheduler", "Achieved Active Warps Per SM", "Theoretical Occupancy",
    "Registers Per Thread", "Dynamic Shared Memory Per Block", "Grid Size", "Block Size",
    "Executed Instructions",
)


def details(path: Path) -> dict:
    """The :data:`METRICS` of one details page (number and unit), and its launch line."""
    out = {}
    text = path.read_text()
    for line in text.splitlines():
        m = re.match(r"\s{4}(\S.*?)\s{2,}(\S+)?\s+([\d,.]+)\s*$", line)
        if m and m[1] in METRICS and m[1] not in out:
            out[m[1]] = {"value": float(m[3].replace(",", "")), "unit": m[2] or ""}
    launch = re.search(r"^\s+(\w+) \((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)", text, re.M)
    if launch:
        out["kernel"] = launch[1]
    pipe = re.search(r"INF\s+(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", text)
    if pipe:
        out["busiest pipeline"] = {"value": float(pipe[2]), "unit": "%", "pipe": pipe[1]}
    return out


def stalls(path: Path, top: int = 12) -> dict:
    """Warp-stall samples of one source export: totals by reason, and the ``top`` instructions."""
    rows = list(csv.reader(path.open()))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], rows[head + 1:]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total, per = Counter(), []
    for r in data:
        if len(r) < len(hdr):
            continue
        d = {h[6:]: int(r[col[h]] or 0) for h in reasons}
        total.update(d)
        per.append((int(r[col["Warp Stall Sampling (All Samples)"]] or 0), r[col["Source"]].strip(),
                    {k: v for k, v in d.items() if v}))
    n = sum(total.values())
    per.sort(key=lambda x: -x[0])
    return {
        "samples": n,
        "by_reason": {k: round(v / n, 4) for k, v in total.most_common()},
        "top_instructions": [{"sass": s, "share": round(c / n, 4),
                              "reasons": dict(Counter(d).most_common(3))}
                             for c, s, d in per[:top]],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    doc = {}
    for det in sorted(a.dir.glob("*_details.txt")):
        name = det.name[: -len("_details.txt")]
        doc[name] = {"metrics": details(det), "stalls": stalls(a.dir / f"{name}_sass.csv")}
    if not doc:
        print(f"{a.dir}: no *_details.txt", file=sys.stderr)
        return 1
    for name, d in doc.items():
        m, s = d["metrics"], d["stalls"]
        print(f"== {name}: " + ", ".join(f"{k} {v['value']:g}{v['unit'] and ' ' + v['unit']}"
                                         for k, v in m.items() if isinstance(v, dict)))
        print("   stalls: " + ", ".join(f"{k} {100 * v:.1f}%"
                                        for k, v in list(s["by_reason"].items())[:8]))
        for t in s["top_instructions"][:6]:
            print(f"   {100 * t['share']:5.1f}% {t['sass'][:56]:56s} {t['reasons']}")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
