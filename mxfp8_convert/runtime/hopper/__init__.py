"""The ``triton`` engine: MXFP8 linears on Hopper (SM90) that read the laid-out weight and scale
bytes in place (no unshuffled or dequantized copy stays resident).

Modules, in the order a call meets them:

- ``config.py``: :class:`GemmConfig`, whose ``kind`` (:class:`Kernel`) names the kernel family;
- ``rules.py``: the selection rules, pure functions from (M, N, K) and :class:`DeviceFacts` to a
  config, with every tuned threshold in one table (:data:`TUNED`);
- ``probe.py``: the device facts (SM count, capability, Gluon, PDL, refused clusters, the
  1x128 FP8 recipe of cuBLAS);
- ``launch.py``: :func:`triton_linear`, :func:`quantize_activations`, :func:`dequantize_weight`
  and the launchers of each family;
- the kernels, one module per family: ``tile.py``, ``decode.py``, ``gemv.py``, ``dequant.py``
  (cuBLAS path), ``regroup.py`` (block-128 path), ``wgmma.py`` (Gluon, FP8, M <= 32),
  ``dqmma.py`` (Gluon, bf16 on weight tiles dequantized in registers, serving batches),
  ``grouped_moe.py`` (fused MoE), with ``quantize.py``, ``reduce.py`` and the JIT helpers they
  share (``jit.py``);
- ``shapes.py``: the model shapes the rules were tuned on (benchmarks and tests).

Why it works on Hopper: SM90 tensor cores have no block-scaled FP8 MMA, but UE8M0 scales are
powers of two and e4m3 has a 4-bit significand, so ``q * 2^(code-127)`` is exact in bf16 and
products of e4m3 values are exact in the FP8 MMAs' fp32 accumulators. The weight-stream kernels
(GEMV, decode, wgmma) multiply e4m3 bytes and apply the two power-of-two scales to each
32-block's partial product; the tile and dqmma kernels and the cuBLAS path multiply exactly
dequantized bf16. Results equal the MXFP8 GEMM up to fp32 summation order, except on the
block-128 path (prefill, where cuBLAS has it): there each 128-block of four 32-blocks is brought
to its largest scale ``s``: exact for every element of magnitude >= 2^-6 s, smaller ones rounded
to multiples of 2^-9 s (``regroup.py``), so that cuBLAS's 1x128-scaled FP8 GEMM runs at the FP8
rate.

Importing this package imports neither torch nor Triton; its names below are loaded on first use
(``rules`` and ``config`` need neither). Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU
tensors) every kernel but the Gluon one runs, with its dots on float32 copies of the same exact
values.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GemmConfig": "config",
    "Kernel": "config",
    "DeviceFacts": "rules",
    "TUNED": "rules",
    "choose_config": "rules",
    "cublas_config": "rules",
    "decode_config": "rules",
    "dqmma_config": "rules",
    "gemv_config": "rules",
    "serving_rule": "rules",
    "tile_config": "rules",
    "wgmma_config": "rules",
    "wgmma_rule": "rules",
    "device_facts": "probe",
    "pdl_enabled": "probe",
    "default_config": "launch",
    "dequantize_weight": "launch",
    "quantize_activations": "launch",
    "regroup_activations": "launch",
    "regroup_weight": "launch",
    "triton_linear": "launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
