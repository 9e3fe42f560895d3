"""Table of target backends: weight layout, scale layout and the constraints each kernel puts.

Adding a backend means one entry here, its layout names in ``format.LAYOUTS`` and one layout
module. Sources: docs/LAYOUTS.md section 3 and ``flashinfer/gemm/gemm_base.py`` (FlashInfer
0.7.2.post1): ``mm_mxfp8`` takes ``b = W.t()``, uint8 1-D scales, N >= 128, K >= 128; trtllm needs
K % 256 == 0 and a P32-shuffled weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mxfp8_convert.format import (  # noqa: F401 - re-exported: the names of the contract
    CANONICAL_LAYOUT,
    EPILOGUE_TILE_M,
    FLASHINFER_LAYOUT_VERSION,
    FORMAT_VERSION,
    LAYOUTS,
)
from mxfp8_convert.layouts import (
    p32_shuffle_rows,
    p32_unshuffle_rows,
    swizzle_128x4,
    swizzle_128x4_array,
    swizzled_128x4_shape,
    trtllm_scale_from_canonical,
    trtllm_scale_from_canonical_array,
    trtllm_scale_shape,
    trtllm_scale_to_canonical,
    unswizzle_128x4,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _identity_array(x: np.ndarray) -> np.ndarray:
    return x


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What one ``mm_mxfp8`` backend consumes, and how to lay a linear weight out for it."""

    name: str
    weight_layout: str  # name recorded in the marker (format.LAYOUTS)
    scale_layout: str
    n_multiple: int
    k_multiple: int
    min_n: int
    min_k: int
    compute_capabilities: tuple[int, ...]
    weight_forward: Callable[[torch.Tensor], torch.Tensor]
    weight_inverse: Callable[[torch.Tensor], torch.Tensor]
    scale_forward: Callable[[torch.Tensor], torch.Tensor]  # [N, C] -> [Nt, Ct, 512]
    scale_inverse: Callable[[torch.Tensor, int, int], torch.Tensor]
    scale_shape: Callable[[int, int], tuple[int, int, int]]
    #: ``scale_forward`` of a numpy uint8 [N, C] array (same bytes; the converter's torch-free path)
    scale_forward_array: Callable[[np.ndarray], np.ndarray]

    @property
    def laid_out(self) -> bool:
        """False for the canonical target (plain MXFP8, no kernel layout)."""
        return self.weight_layout != CANONICAL_LAYOUT

    def violations(self, n: int, k: int) -> list[str]:
        """Every constraint a ``[n, k]`` weight breaks, as short phrases (empty if eligible)."""
        out = []
        if k % 32:
            out.append(f"K={k} is not a multiple of 32")
        if n % self.n_multiple:
            out.append(f"N={n} is not a multiple of {self.n_multiple}")
        if self.k_multiple != 32 and k % self.k_multiple:
            out.append(f"K={k} is not a multiple of {self.k_multiple}")
        if n < self.min_n:
            out.append(f"N={n} < {self.min_n}")
        if k < self.min_k:
            out.append(f"K={k} < {self.min_k}")
        return out

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "weight_layout": self.weight_layout,
            "scale_layout": self.scale_layout,
            "constraints": {
                "n_multiple": self.n_multiple,
                "k_multiple": self.k_multiple,
                "min_n": self.min_n,
                "min_k": self.min_k,
            },
            "compute_capabilities": list(self.compute_capabilities),
        }


BACKENDS: dict[str, BackendSpec] = {
    "trtllm": BackendSpec(
        name="trtllm",
        weight_layout=LAYOUTS["trtllm"].weight,
        scale_layout=LAYOUTS["trtllm"].scale,
        n_multiple=32,
        k_multiple=256,
        min_n=128,
        min_k=128,
        compute_capabilities=(100, 103, 107),
        weight_forward=p32_shuffle_rows,
        weight_inverse=p32_unshuffle_rows,
        scale_forward=trtllm_scale_from_canonical,
        scale_inverse=trtllm_scale_to_canonical,
        scale_shape=trtllm_scale_shape,
        scale_forward_array=trtllm_scale_from_canonical_array,
    ),
    "cutlass": BackendSpec(
        name="cutlass",
        weight_layout=LAYOUTS["cutlass"].weight,
        scale_layout=LAYOUTS["cutlass"].scale,
        n_multiple=32,
        k_multiple=32,
        min_n=128,
        min_k=128,
        compute_capabilities=(100, 103, 107, 110, 120, 121),
        weight_forward=_identity,
        weight_inverse=_identity,
        scale_forward=swizzle_128x4,
        scale_inverse=unswizzle_128x4,
        scale_shape=swizzled_128x4_shape,
        scale_forward_array=swizzle_128x4_array,
    ),
    # Not a kernel: plain SGLang/Miles MXFP8 (uint8 scales [N, K/32], format.CANONICAL_SUFFIX).
    "canonical": BackendSpec(
        name="canonical",
        weight_layout=LAYOUTS["canonical"].weight,
        scale_layout=LAYOUTS["canonical"].scale,
        n_multiple=1,
        k_multiple=32,
        min_n=1,
        min_k=32,
        compute_capabilities=(),
        weight_forward=_identity,
        weight_inverse=_identity,
        scale_forward=_identity,
        scale_inverse=lambda s, rows, cols: s.reshape(rows, cols),
        scale_shape=lambda rows, cols: (rows, cols),
        scale_forward_array=_identity_array,
    ),
}

#: the backends FlashInfer's mm_mxfp8 runs (the runtime's choices)
KERNEL_BACKENDS = tuple(name for name, spec in BACKENDS.items() if spec.laid_out)


def get_backend(name: str) -> BackendSpec:
    from mxfp8_convert.errors import ConvertError

    try:
        return BACKENDS[name]
    except KeyError:
        raise ConvertError(
            f"unknown backend {name!r}", hint=f"choose one of: {', '.join(BACKENDS)}"
        ) from None
