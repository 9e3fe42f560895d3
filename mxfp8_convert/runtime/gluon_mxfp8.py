"""Decode GEMM (M <= 16) on Hopper in Gluon: FP8 wgmma per 32-block, several in flight.

Why Gluon: the Triton decode kernel (``triton_mxfp8._mxfp8_decode_kernel``) issues one FP8 MMA
per 32-block of K and Triton 3.6 waits for each before the next (its pipeliner only overlaps
MMAs that chain one accumulator), so a program spends one tensor-core round trip per 2 KB of
weight. Gluon gives the wait to us: per K-tile the four 32-block MMAs go out back to back into
four fresh accumulators, and each is waited for and rescaled while the later ones still run;
the weight and activation bytes come in by TMA through a ring of ``STAGES`` shared-memory
buffers, so loads for later tiles are in flight during the MMAs.

Numerics are those of the decode kernel: ``part = Wq[rows, b] @ Xq[:, b]^T`` on e4m3 operands
(exact products, fp32 sums), ``acc += part * 2^(cw-127) * 2^(cx-127)``.

Rows are processed in *physical* order (TMA loads contiguous row boxes); the output store maps
each physical row to its logical row (trtllm: the P32 permutation stays within 32-row groups,
so a 64-row tile covers the same logical rows; cutlass: the identity). Scales are read at the
128x4 offset of the physical row, as in every kernel here.

Not interpretable: Gluon kernels have no CPU interpreter, so this path is validated by the
``gpu`` tests on a Hopper GPU; the CI compiles it for sm_90a (``tests/runtime/test_gluon_compile.py``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.weight import MXFP8Weight

# TMA global->shared load: ``async_load`` since Triton 3.7, ``async_copy_global_to_shared`` before
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# CTA-wide barrier: ``barrier`` since Triton 3.7, ``thread_barrier`` before
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

#: Kernel code of each weight layout (the canonical layout is not served here).
LAYOUT_CODE = {"cutlass": 0, "trtllm": 1}
BLOCK_N = 64  # weight rows per program: one warpgroup's wgmma M
BLOCK_K = 128  # K per pipeline stage: four 32-blocks, one 128x4 scale word per row


@gluon.jit
def _pow2_f32(e_field):
    """fp32 ``2^(e_field - 127)`` for e_field in 0..254 (0 gives the subnormal 2^-127); the Gluon
    twin of ``triton_mxfp8._pow2_f32``, kept as a Gluon function next to the kernel that uses it."""
    bits = gl.where(e_field <= 0, 0x400000, e_field << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _issue_tile(w_desc, x_desc, w_s, x_s, bar, stage, p0, k0, pred):
    """TMA loads of one K-tile: a [BN, 128] box of weight rows and a [BM, 128] box of activations."""
    mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
    _tma_load(w_desc, [p0, k0], bar, w_s.index(stage), pred=pred)
    _tma_load(x_desc, [0, k0], bar, x_s.index(stage), pred=pred)


@gluon.jit
def _part(w_s, x_s, stage, zero, j: gl.constexpr):
    """Async FP8 wgmma of 32-block ``j`` of the tile in ``stage`` into a fresh accumulator."""
    w = w_s.index(stage).slice(j * 32, 32, dim=1)
    x = x_s.index(stage).slice(j * 32, 32, dim=1).permute((1, 0))
    return warpgroup_mma(w, x, zero, use_acc=False, is_async=True)


@gluon.jit
def _rescale(acc, part, sw_word, cx, j: gl.constexpr):
    """``acc += part * 2^(cw_j - 127) * 2^(cx_j - 127)`` for 32-block ``j`` of the K-tile."""
    cw = (sw_word >> (8 * j)) & 0xFF
    return acc + part * gl.expand_dims(_pow2_f32(cw), 1) * gl.expand_dims(_pow2_f32(cx), 0)


@gluon.jit
def _wgmma_decode_kernel(
    w_desc, x_desc, s_ptr, xc_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_om, stride_os, scale_cp4, split_k,
    LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, SERIAL: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    pid_n = gl.program_id(0)
    k_tiles = K // 128
    per_split = gl.cdiv(k_tiles, split_k)
    kt0 = gl.program_id(1) * per_split
    n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
    p0 = pid_n * BN

    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 128], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        _issue_tile(w_desc, x_desc, w_s, x_s, bars.index(s), s, p0, (kt0 + s) * 128, s < n_it)

    rows = p0 + gl.arange(0, BN, layout=row_l)  # physical rows (< the 128-row padded scale rows)
    # 128x4 word offset of (row, scale column 0): (r//128)*(Cp/4)*128 + (r%32)*4 + (r%128)//32
    sw_ptrs = s_ptr + (rows // 128).to(gl.int64) * (scale_cp4 * 128) + (rows % 32) * 4 + (rows % 128) // 32
    cols = gl.arange(0, BM, layout=col_l)
    xc_ptrs = xc_ptr + gl.minimum(cols, M - 1).to(gl.int64) * (K // 32)  # rows past M repeat row M-1

    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    zero = gl.zeros([BN, BM], gl.float32, acc_l)
    # scales of the current tile; the next tile's are loaded one iteration ahead
    sw_word = gl.load(sw_ptrs + kt0 * 128)
    cx0 = gl.load(xc_ptrs + kt0 * 4)
    cx1 = gl.load(xc_ptrs + kt0 * 4 + 1)
    cx2 = gl.load(xc_ptrs + kt0 * 4 + 2)
    cx3 = gl.load(xc_ptrs + kt0 * 4 + 3)
    for i in range(n_it):
        stage = i % STAGES
        nxt = i + STAGES - 1  # refill the stage of tile i-1, whose MMAs were waited for
        _issue_tile(w_desc, x_desc, w_s, x_s, bars.index(nxt % STAGES), nxt % STAGES, p0, (kt0 + nxt) * 128,
                    nxt < n_it)
        kn = gl.minimum(kt0 + i + 1, kt0 + n_it - 1)
        sw_next = gl.load(sw_ptrs + kn * 128)
        cn0 = gl.load(xc_ptrs + kn * 4)
        cn1 = gl.load(xc_ptrs + kn * 4 + 1)
        cn2 = gl.load(xc_ptrs + kn * 4 + 2)
        cn3 = gl.load(xc_ptrs + kn * 4 + 3)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        p_0 = _part(w_s, x_s, stage, zero, 0)
        p_1 = _part(w_s, x_s, stage, zero, 1)
        p_2 = _part(w_s, x_s, stage, zero, 2)
        p_3 = _part(w_s, x_s, stage, zero, 3)
        p_0 = warpgroup_mma_wait(num_outstanding=3, deps=(p_0,))
        acc = _rescale(acc, p_0, sw_word, cx0, 0)
        p_1 = warpgroup_mma_wait(num_outstanding=2, deps=(p_1,))
        acc = _rescale(acc, p_1, sw_word, cx1, 1)
        p_2 = warpgroup_mma_wait(num_outstanding=1, deps=(p_2,))
        acc = _rescale(acc, p_2, sw_word, cx2, 2)
        p_3 = warpgroup_mma_wait(num_outstanding=0, deps=(p_3,))
        acc = _rescale(acc, p_3, sw_word, cx3, 3)
        sw_word, cx0, cx1, cx2, cx3 = sw_next, cn0, cn1, cn2, cn3
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    if LAYOUT == 1:  # trtllm: physical row p holds logical row 32*(p//32) + 4*(q%8) + q//8, q = p%32
        q = rows % 32
        lrows = rows - q + 4 * (q % 8) + q // 8
    else:
        lrows = rows
    mask = gl.expand_dims(lrows < N, 1) & gl.expand_dims(cols < M, 0)
    off = gl.expand_dims(cols.to(gl.int64), 0) * stride_om + gl.expand_dims(lrows, 1)
    ws_off = gl.expand_dims(cols.to(gl.int64), 0) * N + gl.expand_dims(lrows, 1)
    if PARTIAL:
        gl.store(ws_ptr + gl.program_id(1).to(gl.int64) * stride_os + ws_off, acc, mask=mask)
        if SERIAL:  # the last split of this row tile to arrive sums the partials: no second launch
            _cta_barrier()  # every thread's partial is stored before the release below
            arrived = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = gl.zeros([BN, BM], gl.float32, acc_l)
                for sp in range(0, split_k):
                    total += gl.load(ws_ptr + sp * stride_os + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += gl.expand_dims(gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32), 1)
                gl.store(out_ptr + off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call
    else:
        if HAS_BIAS:
            acc += gl.expand_dims(gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32), 1)
        gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supported(weight: MXFP8Weight, k: int) -> bool:
    """Whether the kernel can read ``weight`` as it lies: a 128x4 layout, TMA-aligned bytes."""
    d = weight.data
    return (weight.layout in LAYOUT_CODE and k % BLOCK_K == 0 and d.is_contiguous() and d.data_ptr() % 16 == 0
            and weight.scale.is_contiguous() and weight.scale.data_ptr() % 4 == 0)


def wgmma_decode(
    xq: torch.Tensor, xc: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    ws: torch.Tensor | None, lock: torch.Tensor | None, *, split_k: int, stages: int = 4, num_warps: int = 4,
) -> None:
    """Launch the kernel: ``out [M, N]`` (bf16); with ``split_k > 1`` fp32 partials go to ``ws``
    ``[split_k, M, N]`` and are summed by the last program of each row tile to arrive when
    ``lock`` (zeroed int32 arrival counters, one per row tile) is given, else by the caller.

    Args:
        xq: e4m3 activations ``[M, K]`` (16-byte aligned, as from ``quantize_activations``).
        xc: int32 activation codes ``[M, K/32]``.
    """
    m, k = xq.shape
    n = weight.shape[0]
    if m > 16 or not supported(weight, k):
        raise LayoutError(f"{weight.name or 'weight'}: the wgmma decode kernel needs M <= 16, K % 128 == 0, "
                          "a trtllm/cutlass weight and 16-byte aligned contiguous bytes")
    bm = 8 if m <= 8 else 16
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    x_layout = gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], gl.float8e4nv)
    w_desc = TensorDescriptor(weight.data, [n, k], [k, 1], [BLOCK_N, BLOCK_K], w_layout)
    x_desc = TensorDescriptor(xq, [m, k], [k, 1], [bm, BLOCK_K], x_layout)
    partial = split_k > 1
    scale = weight.scale.view(torch.int32)
    cp4 = (k // 32 + 3) // 4
    _wgmma_decode_kernel[(triton.cdiv(n, BLOCK_N), split_k)](
        w_desc, x_desc, scale, xc, bias if bias is not None else out, out, ws if partial else out,
        lock if lock is not None else xc, m, n, k, out.stride(0), m * n, cp4, split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], HAS_BIAS=bias is not None, PARTIAL=partial,
        SERIAL=partial and lock is not None, STAGES=stages,
        num_warps=num_warps,
    )
