"""``mxfp8_linear`` and the ``MXFP8Linear`` module: an MXFP8 weight behind an ``nn.Linear`` face.

Semantics, on every engine: ``y = bf16(fq(x) @ dq(W).T + bias)``, where ``fq`` quantizes the
activations to MXFP8 with FlashInfer's recipe (as SM100 kernels are fed) and ``dq`` is the exact
dequantization of the stored weight; products are exact and sums are float32. (The flashinfer
engine adds the bias to its bf16 output, so it rounds twice.) ``y`` is returned in ``x``'s dtype
(bf16, fp16 or fp32; the kernels write bf16, so fp32 and fp16 outputs carry bf16 precision).
Inference only: no autograd.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.select import ENGINES, ENV_ENGINE, check_engine
from mxfp8_convert.runtime.weight import MXFP8Weight

_CHECKED: dict[tuple[str, str, str, str], str] = {}
#: activation dtypes every engine takes (FlashInfer's mxfp8_quantize: bf16/fp16; fp32 is cast)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_input_dtype(x: torch.Tensor, what: str) -> None:
    """Raise LayoutError unless ``x`` is bf16, fp16 or fp32 (token ids are not activations)."""
    if x.dtype not in INPUT_DTYPES:
        raise LayoutError(f"{what or 'weight'}: input dtype {x.dtype} is not bf16, fp16 or fp32",
                          hint="MXFP8 layers take activations; embed token ids first")


def _engine_for(engine: str, device: torch.device, layout: str) -> str:
    """``check_engine`` once per (engine, device, layout, env override); then a dict lookup."""
    key = (engine, str(device), layout, os.environ.get(ENV_ENGINE, ""))
    if key not in _CHECKED:
        _CHECKED[key] = check_engine(engine, device, layout)
    return _CHECKED[key]


@torch.no_grad()
def mxfp8_linear(
    x: torch.Tensor,
    weight: MXFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    engine: str = "auto",
) -> torch.Tensor:
    """MXFP8 linear layer on a laid-out weight.

    Args:
        x: ``[..., K]`` activations (bf16, fp16 or fp32) on the weight's device.
        weight: :class:`MXFP8Weight` (``[N, K]`` logical) in the layout its checkpoint was written
        for.
        bias: optional ``[N]``.
        engine: ``"auto"``, ``"flashinfer"``, ``"triton"`` or ``"reference"`` (see ``select.py``).

    Returns:
        ``[..., N]`` in ``x``'s dtype (bf16 precision).

    Raises:
        LayoutError: ``x`` is not bf16/fp16/fp32, its last dim is not ``K``, or devices differ.
        BackendUnavailableError / MarkerError: the engine cannot run this layout here.

    Example:
        >>> w = MXFP8Weight.quantize(torch.randn(256, 512), "cutlass")
        >>> mxfp8_linear(torch.randn(4, 512), w).shape
        torch.Size([4, 256])
    """
    n, k = weight.shape
    check_input_dtype(x, weight.name)
    if x.shape[-1] != k:
        raise LayoutError(
            f"{weight.name or 'weight'}: input has {x.shape[-1]} features, weight expects {k}"
        )
    if x.device != weight.device:
        raise LayoutError(
            f"{weight.name or 'weight'}: input on {x.device}, weight on {weight.device}"
        )
    name = _engine_for(engine, x.device, weight.layout)
    x2d = x.reshape(-1, k)
    out = ENGINES[name].run(x2d, weight, bias)
    return out.reshape(*x.shape[:-1], n).to(x.dtype)


class MXFP8Linear(nn.Module):
    """Drop-in inference replacement for ``nn.Linear`` holding laid-out MXFP8 bytes.

    Buffers ``weight_data`` (the e4m3 ``[N, K]`` bytes, held as uint8 so that ``model.to(dtype)``
    leaves them alone) and ``weight_scale`` (uint8 scale tiles) move with ``.to()`` / ``.cuda()``
    byte for byte; ``bias`` is a frozen parameter. Output has the input's dtype.

    Args:
        weight: the :class:`MXFP8Weight` to hold.
        bias: optional ``[N]`` tensor.
        engine: engine name passed to :func:`mxfp8_linear` on every call.
    """

    def __init__(
        self, weight: MXFP8Weight, bias: torch.Tensor | None = None, engine: str = "auto"
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.layout = weight.layout
        self.name = weight.name
        self.engine = engine
        self.register_buffer("weight_data", weight.data.view(torch.uint8))
        self.register_buffer("weight_scale", weight.scale)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise LayoutError(
                f"{self.name or 'linear'}: bias shape {list(bias.shape)} != [{self.out_features}]"
            )
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def mx_weight(self) -> MXFP8Weight:
        """The held bytes as an :class:`MXFP8Weight` (no copy)."""
        data = self.weight_data.view(torch.float8_e4m3fn)
        return MXFP8Weight(data, self.weight_scale, self.layout, self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.device)
        return mxfp8_linear(x, self.mx_weight, bias, engine=self.engine)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, layout={self.layout}, engine={self.engine}"
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: str, engine: str = "auto") -> MXFP8Linear:
        """Quantize an ``nn.Linear``'s weight with FlashInfer's recipe and lay it out (tests,
        demos)."""
        w = MXFP8Weight.quantize(linear.weight.detach().float(), layout)
        return cls(w, None if linear.bias is None else linear.bias.detach(), engine)
