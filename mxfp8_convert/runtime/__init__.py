"""Run converted MXFP8 checkpoints: load, check the layout marker, and multiply.

    ckpt = load_checkpoint("out/", device="cuda")            # refuses a mismatched marker
    report = load_into(model, ckpt)                           # nn.Linear -> MXFP8Linear
    y = mxfp8_linear(x, ckpt.weights["model.layers.0.mlp.up_proj"])

Engines (``select.py``): ``flashinfer`` (SM100 family, ``mm_mxfp8``), ``triton`` (Hopper, our
kernel on the laid-out bytes), ``reference`` (exact float32 emulation, any device). FlashInfer and
Triton are imported only when their engine runs, so this package imports without them.
"""

from mxfp8_convert.runtime.linear import MXFP8Linear, mxfp8_linear
from mxfp8_convert.runtime.load import (
    COMPLETE_MARKER,
    MXFP8Checkpoint,
    load_checkpoint,
    read_marker,
)
from mxfp8_convert.runtime.model import LoadReport, load_into
from mxfp8_convert.runtime.moe import MXFP8MoEWeights, mxfp8_fused_moe
from mxfp8_convert.runtime.reference import dequantize_mxfp8, quantize_mxfp8, reference_linear
from mxfp8_convert.runtime.select import ENGINES, auto_engine, check_engine
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight

__all__ = [
    "CANONICAL",
    "COMPLETE_MARKER",
    "ENGINES",
    "LoadReport",
    "MXFP8Checkpoint",
    "MXFP8Linear",
    "MXFP8MoEWeights",
    "MXFP8Weight",
    "auto_engine",
    "check_engine",
    "dequantize_mxfp8",
    "load_checkpoint",
    "load_into",
    "mxfp8_fused_moe",
    "mxfp8_linear",
    "quantize_mxfp8",
    "read_marker",
    "reference_linear",
]
