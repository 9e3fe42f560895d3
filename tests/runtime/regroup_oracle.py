"""The block-128 regroup of MXFP8 operands computed by torch alone (no Triton): the oracle of the
regroup kernels' tests on CPU and GPU."""

from __future__ import annotations

import torch


def regrouped_by_torch(q: torch.Tensor, code: torch.Tensor):
    """Independent regroup: e4m3 values ``q * 2^(c - cmax)`` rounded by torch's float8 cast
    (ties to even), and fp32 ``2^(cmax - 127)`` per 128 columns ([rows, K/128])."""
    rows, k = q.shape
    c = code.long().reshape(rows, k // 128, 4)
    cmax = c.amax(dim=2)
    shift = torch.exp2((c - cmax[..., None]).double()).repeat_interleave(32, dim=2)
    v = (q.double().reshape(rows, k // 128, 128) * shift).float().reshape(rows, k)
    scale = torch.exp2(cmax.double() - 127).float()
    scale[cmax == 255] = float("nan")
    return v.to(torch.float8_e4m3fn), scale
