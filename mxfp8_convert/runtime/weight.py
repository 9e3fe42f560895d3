"""``MXFP8Weight``: the laid-out bytes of one linear weight, as a converted checkpoint holds them.

A weight is ``data`` (e4m3 ``[N, K]``, rows P32-shuffled for trtllm) plus ``scale`` (uint8 UE8M0
codes: ``[ceil(N/128), ceil(K/128), 512]`` tiles for trtllm and cutlass, or ``[N, K/32]`` linear
for a module the converter kept canonical). docs/FORMAT.md section 3 is the contract.
Nothing here re-lays-out bytes except :meth:`MXFP8Weight.canonical`, which the reference
engine and the tests use to read a weight back in logical order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import CANONICAL_LAYOUT as CANONICAL
from mxfp8_convert.format import LAID_OUT_BACKENDS as KERNEL_LAYOUTS
from mxfp8_convert.runtime.reference import dequantize_mxfp8, quantize_mxfp8

#: Layout names a weight can carry: the kernel backends' layouts, plus modules kept canonical.
LAYOUTS = (*KERNEL_LAYOUTS, CANONICAL)


def expected_scale_shape(layout: str, n: int, k: int) -> tuple[int, ...]:
    """Shape of the scale tensor of an ``[n, k]`` weight in ``layout`` (FORMAT.md section 3)."""
    if layout == CANONICAL:
        return (n, k // 32)
    return BACKENDS[layout].scale_shape(n, k // 32)


@dataclass(frozen=True)
class MXFP8Weight:
    """One MXFP8 linear weight in the layout its checkpoint was written for.

    Attributes:
        data: float8_e4m3fn ``[N, K]``; trtllm rows are P32-shuffled, others are logical order.
        scale: uint8 UE8M0 codes; ``[ceil(N/128), ceil(K/128), 512]`` for ``trtllm`` (rows padded
            to 128, P32, 128x4) and ``cutlass`` (128x4), ``[N, K/32]`` for ``canonical``.
        layout: ``"trtllm"``, ``"cutlass"`` or ``"canonical"``.
        name: module name in the checkpoint (for messages), may be empty.
    """

    data: torch.Tensor
    scale: torch.Tensor
    layout: str
    name: str = ""

    def __post_init__(self) -> None:
        what = self.name or "weight"
        if self.layout not in LAYOUTS:
            raise LayoutError(f"{what}: unknown layout {self.layout!r} "
                              f"(known: {', '.join(LAYOUTS)})")
        if self.data.dim() != 2 or self.data.dtype != torch.float8_e4m3fn:
            raise LayoutError(
                f"{what}: data must be float8_e4m3fn [N, K], "
                f"got {self.data.dtype} {list(self.data.shape)}"
            )
        n, k = self.data.shape
        if k % 32:
            raise LayoutError(f"{what}: K={k} is not a multiple of 32")
        if self.scale.dtype != torch.uint8:
            object.__setattr__(self, "scale", _scale_as_uint8(self.scale, what))
        want = expected_scale_shape(self.layout, n, k)
        if tuple(self.scale.shape) != want:
            raise LayoutError(
                f"{what}: {self.layout} scale of a [{n}, {k}] weight must have shape {list(want)}, "
                f"got {list(self.scale.shape)}"
            )
        if self.layout != CANONICAL:
            bad = BACKENDS[self.layout].violations(n, k)
            if bad:
                raise LayoutError(f"{what}: [{n}, {k}] does not fit {self.layout}: "
                                  f"{'; '.join(bad)}")
        if self.data.device != self.scale.device:
            raise LayoutError(f"{what}: data on {self.data.device} "
                              f"but scale on {self.scale.device}")

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``(N, K)``: output features, input features."""
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> MXFP8Weight:
        """The same bytes on ``device`` (a copy, never a re-layout)."""
        return MXFP8Weight(self.data.to(device), self.scale.to(device), self.layout, self.name)

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Invert the layout: ``(q, code)`` = e4m3 ``[N, K]`` and uint8 ``[N, K/32]`` in logical
        order.

        Allocates new tensors; the engines that run the weight never call this.
        """
        n, k = self.shape
        if self.layout == CANONICAL:
            return self.data, self.scale
        spec = BACKENDS[self.layout]
        q = spec.weight_inverse(self.data.view(torch.uint8)).view(torch.float8_e4m3fn)
        return q, spec.scale_inverse(self.scale, n, k // 32)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` logical weight, ``q * 2^(code-127)`` (exact)."""
        return dequantize_mxfp8(*self.canonical())

    @classmethod
    def quantize(cls, w: torch.Tensor, layout: str, name: str = "") -> MXFP8Weight:
        """Quantize a high-precision ``[N, K]`` weight with FlashInfer's recipe and lay it out.

        For building test models and small experiments; a real checkpoint is converted offline.
        """
        q, code = quantize_mxfp8(w)
        return cls.from_canonical(q, code, layout, name)

    @classmethod
    def from_canonical(
        cls, q: torch.Tensor, code: torch.Tensor, layout: str, name: str = ""
    ) -> MXFP8Weight:
        """Lay out canonical ``q`` (e4m3 ``[N, K]``) and ``code`` (uint8 ``[N, K/32]``) for
        ``layout``."""
        if layout == CANONICAL:
            return cls(q.contiguous(), _scale_as_uint8(code, name).contiguous(), layout, name)
        if layout not in KERNEL_LAYOUTS:
            raise LayoutError(f"{name or 'weight'}: unknown layout {layout!r}")
        spec = BACKENDS[layout]
        data = spec.weight_forward(q.view(torch.uint8)).contiguous().view(torch.float8_e4m3fn)
        return cls(data, spec.scale_forward(code), layout, name)


def _scale_as_uint8(scale: torch.Tensor, what: str) -> torch.Tensor:
    float_not_e8m0 = scale.is_floating_point() and scale.dtype != torch.float8_e8m0fnu
    if scale.element_size() != 1 or float_not_e8m0:
        raise LayoutError(f"{what}: scale must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    return scale.view(torch.uint8)
