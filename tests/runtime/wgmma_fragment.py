"""The activation order of the dequantizing wgmma kernel, derived from the wgmma fragment
layout itself (independent of the kernels' ``FRAGMENT_ORDER``)."""

import torch


def wgmma_fragment_columns(k: int) -> torch.Tensor:
    """The column of the activations each K position of the dequantizing wgmma kernel reads,
    from the PTX ISA's register fragment of a bf16 wgmma A operand: thread column ``c`` (lane
    % 4) holds K positions ``2c, 2c+1, 2c+8, 2c+9`` of each k16 step, i.e. ``2c + j % 2 +
    8 (j // 2)`` for its ``j``-th element of a 32-block; the kernel fills them with the weight's
    stored columns ``8c + j`` (one 8-byte load), so K position ``2c + j % 2 + 8 (j // 2)`` must
    hold activation column ``8c + j``."""
    cols = torch.empty(32, dtype=torch.long)
    for c in range(4):
        for j in range(8):
            cols[2 * c + j % 2 + 8 * (j // 2)] = 8 * c + j
    return (torch.arange(k // 32).view(-1, 1) * 32 + cols).flatten()
