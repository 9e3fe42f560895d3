"""Convert a checkpoint, then run one of its linear layers through mxfp8_convert.runtime.

    python examples/make_demo_model.py /tmp/demo
    python examples/convert_and_run.py /tmp/demo --backend trtllm -o /tmp/demo-trtllm

The engine is chosen for the device: FlashInfer mm_mxfp8 on SM100, our Triton kernel on Hopper,
the exact float32 reference on CPU. The output is compared with the reference computed from the
canonical (un-laid-out) bytes, which is what every engine must reproduce.
"""

import argparse
import sys

import torch

from mxfp8_convert import ConvertError, convert
from mxfp8_convert.runtime import auto_engine, load_checkpoint, mxfp8_linear, reference_linear


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="trtllm", choices=["trtllm", "cutlass"])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--module", default=None, help="linear module to run (default: the first)")
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        result = convert(args.model, args.backend, args.output, overwrite=True)
        ckpt = load_checkpoint(result.output, device=device, backend=args.backend)
    except ConvertError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    name = args.module or sorted(ckpt.weights)[0]
    w = ckpt.weights[name]
    x = torch.randn(args.tokens, w.shape[1], device=device, dtype=torch.bfloat16)
    engine = auto_engine(device)
    y = mxfp8_linear(x, w)
    ref = reference_linear(x.cpu(), *(t.cpu() for t in w.canonical()))  # from un-laid-out bytes
    err = float((y.float().cpu() - ref.float()).norm() / ref.float().norm())
    print(f"converted {result.source} -> {result.output} ({result.plan.backend})")
    print(f"{name}: x {list(x.shape)} -> y {list(y.shape)} {y.dtype} on {device} "
          f"with engine {engine}; relative difference to the reference {err:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
