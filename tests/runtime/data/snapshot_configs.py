"""Write ``hopper_configs.json``: the configs that the selection rules of commit a5719ef (the
single-module ``runtime/triton_mxfp8.py``) chose for the model shapes and a few edge shapes, as
the fixed expectation of ``tests/runtime/test_hopper_rules.py``. Run against that commit's tree,
not this one:

    git archive a5719ef | tar -x -C /tmp/a5719ef
    python tests/runtime/data/snapshot_configs.py /tmp/a5719ef

Each device is simulated on CPU by patching what the rules read of it (compute capability, SM
count, CUDA versions, ``MXFP8_PDL``, Gluon, refused clusters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

M_VALUES = (*range(1, 17), 256, 2048)
# shapes beside the models' that sit at the rules' boundaries (128-row programs per SM, K not a
# multiple of 128 or of 256, N not a multiple of 64)
EXTRA_SHAPES = [
    ("edge.n6272", 6272, 2048), ("edge.n6400", 6400, 2048), ("edge.n8448", 8448, 2048),
    ("edge.n8576", 8576, 2048), ("edge.n7168.k512", 7168, 512), ("edge.n4352", 4352, 4096),
    ("edge.k4000", 4096, 4000), ("edge.k160", 576, 160), ("edge.n544.k1024", 544, 1024),
    ("edge.n4000", 4000, 4096),
]
# name: (capability or None for the CPU interpreter, SMs, MXFP8_PDL, Gluon, clusters refused)
DEVICES = {
    "h200": ((9, 0), 132, None, True, False),
    "h200-pdl-strict": ((9, 0), 132, "strict", True, False),
    "h200-pdl-off": ((9, 0), 132, "0", True, False),
    "h200-clusters-refused": ((9, 0), 132, None, True, True),
    "h200-no-gluon": ((9, 0), 132, None, False, False),
    "hopper-114": ((9, 0), 114, None, True, False),
    "sm89-128": ((8, 9), 128, None, True, False),
    "sm80-108": ((8, 0), 108, None, True, False),
    "cpu": (None, 4, None, True, False),
}


def main() -> None:
    old_root = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(old_root))
    import mxfp8_convert.runtime.triton_mxfp8 as tri
    import torch

    assert Path(tri.__file__).resolve().is_relative_to(old_root), tri.__file__
    shapes_ns: dict = {}
    exec((old_root / "tests/runtime/shapes.py").read_text(), shapes_ns)
    real_gluon = tri._gluon
    fields = list(tri.GemmConfig.__slots__)
    out = {"fields": ["shape", "m", "n", "k", *fields], "devices": {}}
    for name, (cap, sms, pdl_env, gluon, refused) in DEVICES.items():
        torch.cuda.get_device_capability = lambda device=None, cap=cap: cap
        torch.version.cuda = "12.8"
        tri._num_sms = lambda device, sms=sms: sms
        tri._driver_cuda_version = lambda: (12, 8)
        tri._gluon = real_gluon if gluon else (lambda: None)
        tri._CLUSTERS_REFUSED.clear()
        if refused:
            tri._CLUSTERS_REFUSED.add(0)
        os.environ.pop("MXFP8_PDL", None)
        if pdl_env is not None:
            os.environ["MXFP8_PDL"] = pdl_env
        dev = torch.device("cpu" if cap is None else "cuda")
        rows = out["devices"][name] = []
        for shape, n, k in shapes_ns["MODEL_SHAPES"] + EXTRA_SHAPES:
            for m in M_VALUES:
                cfg = tri.choose_config(m, n, k, dev)
                rows.append([shape, m, n, k, *(getattr(cfg, f) for f in fields)])
    dst = Path(__file__).with_name("hopper_configs.json")
    lines = ",\n".join(f"{json.dumps(d)}: [\n" + ",\n".join(map(json.dumps, rows)) + "\n]"
                        for d, rows in out["devices"].items())
    dst.write_text(f'{{"fields": {json.dumps(out["fields"])},\n"devices": {{\n{lines}\n}}}}\n')
    print(f"{dst}: {sum(len(r) for r in out['devices'].values())} configs")


if __name__ == "__main__":
    main()
