"""Serving-batch GEMM (M = 17 .. 512 and beyond) on Hopper in Gluon: the weight's e4m3 tiles
dequantized to bf16 in registers, bf16 wgmma with the weight as the register operand.

At serving batch sizes a GEMM is bound by the weight's bytes; MXFP8 halves them. SM90 has no
block-scaled MMA, but ``q * 2^(code-127)`` is exact in bf16 (e4m3 has a 4-bit significand, UE8M0
scales are powers of two), so multiplying exactly dequantized weights by the exactly dequantized
MXFP8 activations in a bf16 MMA with fp32 accumulation computes the MXFP8 GEMM up to fp32
summation order, at bf16 tensor-core rate, with the weight streamed as 1.03 bytes an element.

Each program computes a ``[BN, BM]`` tile of ``out^T`` (swap-AB: weight rows are the MMA's M,
tokens its N): ``BN`` physical weight rows (64 per warpgroup), ``BM`` tokens, a range of K
(split-K). Per 128-wide K-tile, the weight's ``[BN, 128]`` e4m3 box and the activations' two
``[BM, 64]`` bf16 boxes (from ``quantize_activations``, exactly dequantized) come in by TMA
through a ring of ``STAGES`` shared-memory buffers. Per 32-block of the tile, each thread loads
its fragment of the weight rows straight from shared memory in the wgmma's register-operand
layout, converts it to bf16 and multiplies it by its row's block scale ``2^(code-127)`` (one
128x4 scale word per row and K-tile, loaded from global memory two K-tiles ahead), then issues
the wgmma asynchronously; the next block's fragment is prepared while it runs (one wgmma in
flight). A stage is refilled once the wgmmas that read it have retired.

Rows are processed in *physical* order (TMA loads contiguous row boxes); the epilogue maps each
physical row to its logical output column (trtllm: the P32 permutation stays within 32-row
groups; cutlass: the identity). Split-K partials go to an fp32 workspace in physical row order
and ``reduce.py`` sums them (``P32``). Rows of the activation box past M are TMA's zero fill and
are never stored.

Not interpretable (Gluon has no CPU interpreter): validated by the ``gpu`` tests on a Hopper GPU;
``tests/runtime/test_gluon_compile.py`` compiles it for sm_90a on any machine.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.hopper.config import cdiv
from mxfp8_convert.runtime.hopper.jit import _p32_logical, _pow2_f32, _scale_row_base
from mxfp8_convert.runtime.hopper.wgmma import LAYOUT_CODE, _tma_load
from mxfp8_convert.runtime.weight import MXFP8Weight

BLOCK_K = 128  # K per pipeline stage: four 32-blocks, one 128x4 scale word per row
X_BOX = 64  # bf16 activation box width (128 bytes: the widest 128-byte-swizzled TMA box)


@gluon.jit
def _issue(w_desc, x_desc, w_s, x_s, bar, stage, p0, m0, k0, pred):
    """TMA loads of one K-tile: ``[BN, 128]`` weight bytes and two ``[BM, 64]`` activation boxes."""
    mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes, pred=pred)
    _tma_load(w_desc, [p0, k0], bar, w_s.index(stage), pred=pred)
    _tma_load(x_desc, [m0, k0], bar, x_s.index(2 * stage), pred=pred)
    _tma_load(x_desc, [m0, k0 + 64], bar, x_s.index(2 * stage + 1), pred=pred)


@gluon.jit
def _dq_block(w_tile, word, j: gl.constexpr, a_l: gl.constexpr):
    """32-block ``j`` of a shared ``[BN, 128]`` e4m3 tile as exact bf16 ``q * 2^(c-127)`` in the
    register-operand layout ``a_l`` (``word``: the rows' 128x4 scale words, in its row slice):
    e4m3 -> fp32 (exact), times the power of two (exact), -> bf16 (exact: 4 significant bits)."""
    q = w_tile.slice(j * 32, 32, dim=1).load(a_l)
    sc = _pow2_f32((word >> (8 * j)) & 0xFF)
    return (q.to(gl.float32) * gl.expand_dims(sc, 1)).to(gl.bfloat16)


@gluon.jit
def _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, i, kt0, n_it, p0, m0,
           a_l: gl.constexpr, STAGES: gl.constexpr):
    """K-tile ``i`` of the program: four 32-blocks, each dequantized (:func:`_dq_block`) while the
    previous block's wgmma runs; once the first block's wgmma is issued with one left in flight,
    the previous tile's have retired and its stage is refilled with tile ``i + STAGES - 1``.
    Returns the accumulator (one wgmma still in flight) and that wgmma's register operand, which
    stays live until a wait retires it."""
    stage = i % STAGES
    mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
    w_tile = w_s.index(stage)
    for j in gl.static_range(4):
        a_next = _dq_block(w_tile, sw_word, j, a_l)
        xb = x_s.index(2 * stage + j // 2).slice((j % 2) * 32, 32, dim=1).permute((1, 0))
        acc = warpgroup_mma(a_next, xb, acc, is_async=True)
        acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
        a = a_next
        if j == 0:
            nxt = i + STAGES - 1
            _issue(w_desc, x_desc, w_s, x_s, bars.index(nxt % STAGES), nxt % STAGES, p0, m0,
                   (kt0 + nxt) * 128, nxt < n_it)
    return acc, a


@gluon.jit
def _dqmma_kernel(
    w_desc, x_desc, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_om, stride_os, scale_cp4, split_k,
    LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    srow_l: gl.constexpr = gl.SliceLayout(1, a_l)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    m_tiles = gl.cdiv(M, BM)
    pid_n = gl.program_id(0) // m_tiles  # the M tiles of a weight tile run side by side (L2)
    m0 = (gl.program_id(0) % m_tiles) * BM
    split = gl.program_id(1)
    k_tiles = K // 128
    per_split = gl.cdiv(k_tiles, split_k)
    kt0 = split * per_split
    n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
    last = kt0 + n_it - 1
    p0 = pid_n * BN

    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BM, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        _issue(w_desc, x_desc, w_s, x_s, bars.index(s), s, p0, m0, (kt0 + s) * 128, s < n_it)

    srows = p0 + gl.arange(0, BN, layout=srow_l)  # physical rows (< the 128-row padded scale rows)
    sw_ptrs = s_ptr + _scale_row_base(srows, 0, scale_cp4, LAYOUT)  # word of (row, scale col 0)
    sw_word = gl.load(sw_ptrs + kt0 * 128)  # scale words from DRAM: two K-tiles ahead
    sw_1 = gl.load(sw_ptrs + gl.minimum(kt0 + 1, last) * 128)

    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    a = gl.zeros([BN, 32], gl.bfloat16, a_l)
    # K-tile 0 outside the loop (every split has one): on no path does a non-wgmma instruction
    # define the accumulator while a wgmma is in flight, so ptxas keeps them asynchronous
    acc, a = _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, 0, kt0, n_it, p0, m0, a_l,
                    STAGES)
    sw_word, sw_1 = sw_1, gl.load(sw_ptrs + gl.minimum(kt0 + 2, last) * 128)
    for i in range(1, n_it):
        sw_new = gl.load(sw_ptrs + gl.minimum(kt0 + i + 2, last) * 128)
        acc, a = _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, i, kt0, n_it, p0, m0,
                        a_l, STAGES)
        sw_word, sw_1 = sw_1, sw_new
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    rows = p0 + gl.arange(0, BN, layout=row_l)
    cols = m0 + gl.arange(0, BM, layout=col_l)
    mask = gl.expand_dims(rows < N, 1) & gl.expand_dims(cols < M, 0)
    if PARTIAL:  # physical row order (contiguous); reduce.py maps the rows (P32)
        ws_off = gl.expand_dims(cols.to(gl.int64), 0) * N + gl.expand_dims(rows, 1)
        gl.store(ws_ptr + split.to(gl.int64) * stride_os + ws_off, acc, mask=mask)
    else:
        lrows = _p32_logical(rows) if LAYOUT == 1 else rows  # trtllm rows are P32-shuffled
        if HAS_BIAS:
            acc += gl.expand_dims(gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32), 1)
        off = gl.expand_dims(cols.to(gl.int64), 0) * stride_om + gl.expand_dims(lrows, 1)
        gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: str) -> gl.NVMMASharedLayout:
    """The swizzled shared layout of a ``[rows, cols]`` TMA box, made once per shape."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], getattr(gl, dtype))


def supported(weight: MXFP8Weight, k: int) -> bool:
    """Whether the kernel can read ``weight`` as it lies: a 128x4 layout, TMA-aligned bytes."""
    d = weight.data
    return (weight.layout in LAYOUT_CODE and k % BLOCK_K == 0 and d.is_contiguous()
            and d.data_ptr() % 16 == 0 and weight.scale.is_contiguous()
            and weight.scale.data_ptr() % 4 == 0)


def dqmma(xd: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
          ws: torch.Tensor | None, *, split_k: int, block_n: int, block_m: int,
          stages: int) -> None:
    """Launch the kernel: ``out [M, N]`` (bf16) from ``xd [M, K]``, the exactly dequantized bf16
    MXFP8 activations (``quantize_activations(x)["deq"]``, 16-byte aligned rows); with ``split_k
    > 1`` fp32 partials go to ``ws [split_k, M, N]`` in the weight's physical row order, for the
    caller to sum (``reduce.py`` with ``P32`` for trtllm). ``block_n``: weight rows per program
    (64 per warpgroup: 64, 128 or 256); ``block_m``: tokens per program (16..256, a power of
    two); ``stages``: TMA buffers in the ring."""
    m, k = xd.shape
    n = weight.shape[0]
    if block_n not in (64, 128, 256) or block_m not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_n={block_n}, block_m={block_m}: 64/128/256 and 16..256")
    if not supported(weight, k) or xd.dtype != torch.bfloat16 or xd.stride(1) != 1:
        raise LayoutError(f"{weight.name or 'weight'}: the dequantizing wgmma kernel needs "
                          "K % 128 == 0, a trtllm/cutlass weight with 16-byte aligned bytes and "
                          "bf16 activations")
    k_tiles = k // BLOCK_K
    if split_k > k_tiles or (split_k - 1) * cdiv(k_tiles, split_k) >= k_tiles:
        raise ValueError(f"split_k={split_k}: leaves a split of K = {k} empty")
    w_desc = TensorDescriptor(weight.data, [n, k], [k, 1], [block_n, BLOCK_K],
                              _smem_layout(block_n, BLOCK_K, "float8e4nv"))
    x_desc = TensorDescriptor(xd, [m, k], [xd.stride(0), 1], [block_m, X_BOX],
                              _smem_layout(block_m, X_BOX, "bfloat16"))
    partial = split_k > 1
    _dqmma_kernel[(cdiv(n, block_n) * cdiv(m, block_m), split_k)](
        w_desc, x_desc, weight.scale.view(torch.int32), bias if bias is not None else out, out,
        ws if partial else out, m, n, k, out.stride(0), m * n, (k // 32 + 3) // 4, split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], HAS_BIAS=bias is not None, PARTIAL=partial,
        STAGES=stages, num_warps=block_n // 16,
    )
