"""``benchmarks/ncu_stalls.py`` (the BENCHMARKS.md ncu table's summary) on a small export written
here in Nsight Compute's text formats, with the shares worked out by hand."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DETAILS = """\
[630] python3.12@127.0.0.1
  _dqmma_kernel (224, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.79
    Elapsed Cycles                cycle       50,813
    DRAM Throughput                   %        46.83
    Duration                         us        28.26
    INF   Shared is the highest-utilized pipeline (27.5%) based on elapsed cycles in the workload
    Section: Scheduler Statistics
    Active Warps Per Scheduler          warp         1.74
    Issued Warp Per Scheduler                        0.46
    Executed Instructions                           inst   10,292,352
"""

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "stall_long_sb", "stall_selected",
          "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [["0x10", "      HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR4], R24", "6", "5", "0", "1",
         "5", "0"],
        ["0x20", "      @!P0  BRA 0x30", "12", "12", "12", "0", "0", "12"],
        ["0x30", "      PRMT R57, R57, 0x9180, RZ", "2", "1", "0", "1", "1", "0"]]


def _tool():
    spec = importlib.util.spec_from_file_location("ncu_stalls",
                                                  ROOT / "benchmarks" / "ncu_stalls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_of_a_details_page_and_a_source_export(tmp_path, capsys, monkeypatch):
    (tmp_path / "k_details.txt").write_text(DETAILS)
    lines = ['"Kernel Name","_dqmma_kernel",', ",".join(f'"{h}"' for h in HEADER)]
    lines += [",".join(f'"{v}"' for v in r) for r in ROWS]
    (tmp_path / "k_sass.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(tmp_path), "--out", str(out)])
    assert _tool().main() == 0
    doc = json.loads(out.read_text())["k"]
    m = doc["metrics"]
    assert m["kernel"] == "_dqmma_kernel"
    assert m["Duration"] == {"value": 28.26, "unit": "us"}
    assert m["Executed Instructions"]["value"] == 10292352
    assert m["Issued Warp Per Scheduler"] == {"value": 0.46, "unit": ""}
    assert m["busiest pipeline"]["value"] == 27.5 and m["busiest pipeline"]["pipe"] == "Shared"
    assert "Elapsed Cycles" not in m  # only the listed metrics
    s = doc["stalls"]
    # 20 samples: long_sb 12, selected 2, wait 6 ("Not Issued" columns are not counted twice)
    assert s["samples"] == 20
    assert s["by_reason"] == {"long_sb": 0.6, "wait": 0.3, "selected": 0.1}
    top = s["top_instructions"]
    assert [t["sass"] for t in top] == ["@!P0  BRA 0x30", ROWS[0][1].strip(), ROWS[2][1].strip()]
    assert top[0]["share"] == 0.6 and top[0]["reasons"] == {"long_sb": 12}
    assert "BRA 0x30" in capsys.readouterr().out
