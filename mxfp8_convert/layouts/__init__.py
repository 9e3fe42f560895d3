"""Pure layout math: byte permutations, each with its inverse and its shape function.

Every function takes and returns tensors only (no paths, devices, logging). They work on
``uint8`` views, so the same code moves e4m3 weights and UE8M0 scales, on CPU and CUDA alike.
Source of truth: docs/LAYOUTS.md section 2, checked against FlashInfer 0.7.2.post1.
"""

from mxfp8_convert.layouts.rows import (
    P32_BLOCK,
    p32_row_indices,
    p32_row_order,
    p32_shuffle_rows,
    p32_shuffle_rows_array,
    p32_unshuffle_rows,
    p32_unshuffle_rows_array,
)
from mxfp8_convert.layouts.swizzle import (
    swizzle_8x4,
    swizzle_128x4,
    swizzle_128x4_array,
    swizzled_8x4_shape,
    swizzled_128x4_shape,
    unswizzle_8x4,
    unswizzle_128x4,
    unswizzle_128x4_array,
)
from mxfp8_convert.layouts.trtllm import (
    trtllm_scale_from_canonical,
    trtllm_scale_from_canonical_array,
    trtllm_scale_shape,
    trtllm_scale_to_canonical,
    trtllm_scale_to_canonical_array,
)

__all__ = [
    "P32_BLOCK",
    "p32_row_indices",
    "p32_row_order",
    "p32_shuffle_rows",
    "p32_shuffle_rows_array",
    "p32_unshuffle_rows",
    "p32_unshuffle_rows_array",
    "swizzle_128x4",
    "swizzle_128x4_array",
    "unswizzle_128x4",
    "unswizzle_128x4_array",
    "swizzled_128x4_shape",
    "swizzle_8x4",
    "unswizzle_8x4",
    "swizzled_8x4_shape",
    "trtllm_scale_from_canonical",
    "trtllm_scale_from_canonical_array",
    "trtllm_scale_to_canonical",
    "trtllm_scale_to_canonical_array",
    "trtllm_scale_shape",
]
