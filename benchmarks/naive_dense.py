"""The yardstick of bench_dense.py: a plain load / quantize / save MXFP8 script, as one writes it.

Usage: python benchmarks/naive_dense.py SRC -o OUT. Not a product path (no checks, no resume).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    x = w.float().reshape(n, k // 32, 32)
    amax = x.abs().amax(-1).clamp(min=2.0**-127)
    code = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    q = (x / torch.exp2(code).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(n, k), (code + 127).to(torch.uint8)


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[sys.argv.index("-o") + 1])
    out.mkdir(parents=True)
    tensors = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.rsplit(".", 2)[-2] in LINEAR:
                tensors[name], tensors[name + "_scale_inv"] = quantize(t)
            else:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for p in src.iterdir():
        if p.name not in ("model.safetensors", "config.json"):
            shutil.copy(p, out / p.name)


if __name__ == "__main__":
    main()
