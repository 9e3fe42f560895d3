"""Decode GEMM (M <= 32) on Hopper in Gluon: FP8 wgmma per 32-block, several in flight.

Why Gluon: the Triton decode kernel (``decode.py``) issues one FP8 MMA
per 32-block of K and Triton 3.6 waits for each before the next (its pipeliner only overlaps
MMAs that chain one accumulator), so a program spends one tensor-core round trip per 2 KB of
weight. Gluon gives the wait to us: per K-tile the four 32-block MMAs go out back to back into
four fresh accumulators, and each is waited for and rescaled while the later ones still run;
the weight and activation bytes come in by TMA through a ring of ``STAGES`` shared-memory
buffers, so loads for later tiles are in flight during the MMAs.

Activations come either as e4m3 bytes (from ``quantize_activations``, by TMA into the ring) or
as bf16/fp16/fp32, quantized inside the kernel (``FUSE_QUANT``: one launch instead of two, the
rule's choice everywhere): each program loads the K-tile it needs, only
its ``QM`` rows (M rounded up to a power of two; warp j takes 32-block j, or half its rows in a
program of two warpgroups), rounds it as
``mxfp8_quantize`` does (the code by the shared ``jit`` helper, the e4m3 rounding by the
hardware's ``cvt.rn.satfinite``, which gives the same bytes), stores the e4m3 tile to shared
memory (MMA columns QM..BM-1 read zeros) and the blocks' scales beside it, fences the tile for
the async proxy and meets the other warps at the one barrier the tile needs before the wgmma
reads it; this happens while the tile's weight bytes are still on their way. The next tile's
activations are loaded one iteration ahead; bf16 ones as int32 words of two elements
(``X_WORDS``), which stay packed in the registers carried to the next iteration, so nothing
waits on that load before then. The weight scale words come from DRAM, so they are loaded up to
three K-tiles ahead (``SW_AHEAD``).

With ``PDL`` (programmatic dependent launch) the kernel waits for the previous kernel in the
stream (``griddepcontrol.wait``, so it never reads an unfinished input) and then lets the next one
launch: launch latency is hidden behind the neighbours' tails. Without ``PREFETCH`` the wait comes
before any memory access; with it, the TMA loads of the weight's first K-tiles (the ring's
prologue) and its first scale words go out before the wait, so that their DRAM latency overlaps
the previous kernel's tail: the weight must then not be written by that kernel. With
``X_PREFETCH`` the program also asks L2 for the activation lines of its K-tiles then
(``prefetch.global.L2``, which reads no value: the activations themselves are loaded after the
wait, so a line the previous kernel is still writing is harmless).

Split-K partials are summed by the last program of each row tile to arrive (through global
memory, an arrival counter per tile), by a second kernel, or, with ``CLUSTER``, inside a
thread-block cluster made of the tile's splits: each program leaves its fp32 partial at the start
of its own shared memory (the TMA ring, no longer in use), and after a cluster barrier sums a
share of the tile's elements over the cluster's shared memory (``mapa`` + ``ld.shared::cluster``)
in split order, the order of the other two, then stores that share. Triton compiles the kernel
for one CTA, so the Gluon layouts are unchanged; its launcher is asked for the clusters through
the compiled kernel's packed metadata (``_launch_as_clusters``). The kernel reads its rank and
the cluster's size from the special registers, so a launch without clusters still gives the
right result (each program then runs all of K).

Numerics are those of the decode kernel: ``part = Wq[rows, b] @ Xq[:, b]^T`` on e4m3 operands
(exact products, fp32 sums), ``acc += part * 2^(cw-127) * 2^(cx-127)``.

Rows are processed in *physical* order (TMA loads contiguous row boxes); the output store maps
each physical row to its logical row (trtllm: the P32 permutation stays within 32-row groups,
so a 64-row tile covers the same logical rows; cutlass: the identity). Scales are read at the
128x4 offset of the physical row, as in every kernel here.

Not interpretable: Gluon kernels have no CPU interpreter, so this path is validated by the
``gpu`` tests on a Hopper GPU; the CI compiles it for sm_90a
(``tests/runtime/test_gluon_compile.py``).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.hopper.config import CLUSTER_SIZES, cdiv, next_pow2
from mxfp8_convert.runtime.hopper.jit import (
    FP_FUSION,
    _p32_logical,
    _pow2_f32,
    _scale_row_base,
    _ue8m0_code,
)
from mxfp8_convert.runtime.weight import MXFP8Weight

# TMA global->shared load: ``async_load`` since Triton 3.7, ``async_copy_global_to_shared`` before
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# CTA-wide barrier: ``barrier`` since Triton 3.7, ``thread_barrier`` before
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton >= 3.7

    @gluon.jit
    def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return buf.reinterpret(dtype, shape, layout)
else:

    @gluon.jit
    def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return buf._reinterpret(dtype, shape, layout)

#: Kernel code of each weight layout (the canonical layout is not served here).
LAYOUT_CODE = {"cutlass": 0, "trtllm": 1}
BLOCK_N = 64  # weight rows per program: one warpgroup's wgmma M (``block_n=128``: two warpgroups)
BLOCK_K = 128  # K per pipeline stage: four 32-blocks, one 128x4 scale word per row
MAX_M = 32  # activation rows: the quantized tile is one row per thread of a warp


@gluon.jit
def _gdc_wait_and_release():
    """Programmatic dependent launch: wait until the previous kernel in the stream has finished
    and its writes are visible (``griddepcontrol.wait``), then let the next kernel launch
    (``launch_dependents``: it must wait likewise before it reads anything). Both are no-ops for
    a kernel launched without the attribute."""
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; griddepcontrol.launch_dependents; mov.b32 $0, 0;",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _prefetch_x_l2(
    x_ptr, M, stride_xm, kt0, n_it, tile, tiles, XT: gl.constexpr, num_warps: gl.constexpr
):
    """Ask L2 for the activation bytes of this program's K-tiles ``kt0 .. kt0 + n_it - 1`` (``XT``
    elements of ``x_ptr`` per K-tile row), the 128-byte lines of the ``M`` rows shared out among
    the ``tiles`` row tiles that read them (this one: ``tile``), one line a thread. A hint
    (``prefetch.global.L2``): it returns no value, so it may go out before the PDL wait; a line
    written later by the previous kernel is updated in L2 like any other, and the activations are
    read only after the wait. A split with more lines than its programs have threads gets some."""
    LE: gl.constexpr = (
        128 * 8 // x_ptr.dtype.element_ty.primitive_bitwidth
    )  # elements per 128-byte line
    span = n_it * XT
    lines = span // LE + 1  # a row's slice, unaligned: its first line may be partly another row's
    t = tile + tiles * gl.arange(
        0, 32 * num_warps, layout=gl.BlockedLayout([1], [32], [num_warps], [0])
    )
    ask = (t < M * lines).to(
        gl.int32
    )  # surplus threads ask for nothing (not the last line again: one L2 slice)
    t = gl.minimum(t, M * lines - 1)
    off = (t // lines).to(gl.int64) * stride_xm + kt0 * XT + gl.minimum((t % lines) * LE, span - 1)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; } mov.b32 $0, 0;",
        "=r,l,r",
        [x_ptr + off, ask],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _cluster_rank():
    """This program's rank in its thread-block cluster (0 when launched without one)."""
    return gl.inline_asm_elementwise(
        "mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _cluster_size():
    """Programs in this program's thread-block cluster (1 when launched without one)."""
    return gl.inline_asm_elementwise(
        "mov.u32 $0, %cluster_nctarank;", "=r", [], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _cluster_sync():
    """Barrier of every thread of the cluster: shared-memory writes before it (release) are seen by
    the cluster's reads after it (acquire)."""
    gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release; barrier.cluster.wait.acquire; mov.b32 $0, 0;",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _exchange_store(off, v):
    """Store fp32 ``v`` at byte offset ``off`` of this program's shared memory (its start: the TMA
    ring, no longer in use when this runs)."""
    gl.inline_asm_elementwise(
        "{ .reg .b32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.f32 [a], $2; }"
        " mov.b32 $0, 0;",
        "=r,r,f",
        [off, v],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _exchange_load(off, rank):
    """fp32 at byte offset ``off`` of the shared memory of the cluster's program ``rank``
    (DSMEM)."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 a; mov.u32 a, global_smem; add.u32 a, a, $1;"
        " mapa.shared::cluster.u32 a, a, $2; ld.shared::cluster.f32 $0, [a]; }",
        "=f,r,r",
        [off, rank],
        dtype=gl.float32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _issue_tile(w_desc, x_desc, w_s, x_s, bar, stage, p0, k0, pred, LOAD_X: gl.constexpr):
    """TMA loads of one K-tile: a [BN, 128] box of weight rows and (``LOAD_X``) a [BM, 128] box of
    quantized activations."""
    if LOAD_X:
        mbarrier.expect(bar, w_desc.block_type.nbytes + x_desc.block_type.nbytes, pred=pred)
        _tma_load(x_desc, [0, k0], bar, x_s.index(stage), pred=pred)
    else:
        mbarrier.expect(bar, w_desc.block_type.nbytes, pred=pred)
    _tma_load(w_desc, [p0, k0], bar, w_s.index(stage), pred=pred)


@gluon.jit
def _quantize_tile(xt, xq_s, xs_s, x4_l: gl.constexpr):
    """MXFP8-quantize an activation tile ``xt`` of ``QM`` rows of a K-tile as four 32-blocks, in
    ``SliceLayout(0, x4_l)``: bf16/fp16/fp32 ``[QM, 4, 32]``, or int32 ``[QM, 4, 16]`` words of
    two bf16 each (element 2e in the low half, 2e + 1 in the high half), as ``mxfp8_quantize``
    does: the e4m3 values go to rows ``0..QM-1`` of ``xq_s [BM, 128]`` (the other rows get zeros),
    the blocks' scales ``2^(code - 127)`` (fp32) to columns ``0..QM-1`` of ``xs_s [4, BM]``.

    The e4m3 rounding is the hardware's (``cvt.rn.satfinite``: nearest, ties to even); the scaled
    values lie within +-448 by the choice of code, so saturation never applies and the bytes are
    those of the reference rounding (``jit._round_e4m3``, which the CPU interpreter needs)."""
    QM: gl.constexpr = xt.shape[0]
    BM: gl.constexpr = xq_s.shape[0]
    if xt.dtype == gl.int32:  # a bf16 is the high half of its fp32: one shift or mask per value
        lo = (xt << 16).to(gl.float32, bitcast=True)
        hi = (xt & -65536).to(gl.float32, bitcast=True)
        code = _ue8m0_code(
            gl.maximum(gl.max(gl.abs(lo), axis=2), gl.max(gl.abs(hi), axis=2))
        )  # [QM, 4]
        scale = gl.expand_dims(_pow2_f32(254 - code), 2)
        q2 = gl.join(lo * scale, hi * scale).to(
            gl.float8e4nv
        )  # [QM, 4, 16, 2]: pairs of neighbours
        q = gl.convert_layout(gl.reshape(q2, [QM, 4, 32]), gl.SliceLayout(0, x4_l))
    else:
        xf = xt.to(gl.float32)
        code = _ue8m0_code(gl.max(gl.abs(xf), axis=2))  # [QM, 4]
        q = (xf * gl.expand_dims(_pow2_f32(254 - code), 2)).to(gl.float8e4nv)
    # the MMA reads BM rows and the tile's 128-byte swizzle allows no store to fewer: rows QM..BM-1
    # are zeros, BM / QM - 1 copies of the tile in each thread's registers, written as zeros
    copy = gl.arange(
        0, BM // QM, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, x4_l)))
    )
    first = gl.expand_dims(gl.expand_dims(gl.expand_dims(copy == 0, 1), 2), 3)
    q4 = gl.where(first, gl.expand_dims(q.to(gl.int8, bitcast=True), 0), 0).to(
        gl.float8e4nv, bitcast=True
    )
    xq_s.store(gl.reshape(q4, [BM, 128]))
    xs_s.slice(0, QM, dim=1).store(gl.permute(_pow2_f32(code), (1, 0)))


@gluon.jit
def _part(w_s, x_s, stage, xb, zero, j: gl.constexpr):
    """Async FP8 wgmma of 32-block ``j`` of the weight tile in ``stage`` and the activation tile in
    buffer ``xb`` into a fresh accumulator."""
    w = w_s.index(stage).slice(j * 32, 32, dim=1)
    x = x_s.index(xb).slice(j * 32, 32, dim=1).permute((1, 0))
    return warpgroup_mma(w, x, zero, use_acc=False, is_async=True)


@gluon.jit
def _rescale(acc, part, sw_word, sx, j: gl.constexpr):
    """``acc += part * 2^(cw_j - 127) * sx`` for 32-block ``j`` of the K-tile: ``cw_j`` byte j of
    the rows' 128x4 scale words, ``sx`` the activation columns' scales of block j (fp32)."""
    sw = _pow2_f32((sw_word >> (8 * j)) & 0xFF)
    return acc + part * gl.expand_dims(sw, 1) * gl.expand_dims(sx, 0)


@gluon.jit
def _store_tile(acc, b_ptr, out_ptr, off, mask, lrows, N, HAS_BIAS: gl.constexpr):
    """Store a program's whole ``[BN, BM]`` result (+ the bias of its logical rows ``lrows``) at
    ``out_ptr + off``, in the output's dtype."""
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32), 1)
    gl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _wgmma_decode_kernel(
    w_desc,
    x_desc,
    x_ptr,
    s_ptr,
    xc_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    scale_cp4,
    split_k,
    LAYOUT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    PARTIAL: gl.constexpr,
    SERIAL: gl.constexpr,
    FUSE_QUANT: gl.constexpr,
    BM: gl.constexpr,
    QM: gl.constexpr,
    X_SMEM: gl.constexpr,
    STAGES: gl.constexpr,
    SW_AHEAD: gl.constexpr,
    PDL: gl.constexpr,
    RED_CHUNK: gl.constexpr,
    X_WORDS: gl.constexpr,
    CLUSTER: gl.constexpr,
    RED_E: gl.constexpr,
    PREFETCH: gl.constexpr,
    PHYS: gl.constexpr,
    X_PREFETCH: gl.constexpr,
    num_warps: gl.constexpr,
):
    if PDL and not PREFETCH:  # before any access to memory
        _gdc_wait_and_release()
    BN: gl.constexpr = w_desc.block_type.shape[0]
    # one warpgroup per 64 weight rows (BN = 64, or 128: two warpgroups sharing each activation
    # tile)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BM, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)

    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    k_tiles = K // 128
    if (
        CLUSTER > 1
    ):  # the splits of a row tile are one cluster: its size, not the argument, splits K, evenly
        split_k = _cluster_size()
        split = _cluster_rank()
        pid_n = pid_n // split_k
        kt0 = split * k_tiles // split_k
        n_it = (split + 1) * k_tiles // split_k - kt0
    else:
        per_split = gl.cdiv(k_tiles, split_k)
        kt0 = split * per_split
        n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
    p0 = pid_n * BN

    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
    # fused: two buffers, written in turn (the CTA barrier per tile keeps the warps within a tile
    # of each other, so a buffer is rewritten only after every warp's MMAs on it were waited for)
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [2 if FUSE_QUANT else STAGES, BM, 128], X_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        _issue_tile(
            w_desc,
            x_desc,
            w_s,
            x_s,
            bars.index(s),
            s,
            p0,
            (kt0 + s) * 128,
            s < n_it,
            not FUSE_QUANT,
        )

    rows = p0 + gl.arange(0, BN, layout=row_l)  # physical rows (< the 128-row padded scale rows)
    sw_ptrs = s_ptr + _scale_row_base(
        rows, 0, scale_cp4, LAYOUT
    )  # 128x4 word of (row, scale column 0)
    cols = gl.arange(0, BM, layout=col_l)

    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    zero = gl.zeros([BN, BM], gl.float32, acc_l)
    # scale words come from DRAM: loaded SW_AHEAD (1..3) 128-tiles ahead, in a ring of registers
    last = kt0 + n_it - 1
    sw_word = gl.load(sw_ptrs + kt0 * 128)
    sw_1 = gl.load(sw_ptrs + gl.minimum(kt0 + 1, last) * 128)
    sw_2 = gl.load(sw_ptrs + gl.minimum(kt0 + 2, last) * 128)
    if (
        PDL and PREFETCH
    ):  # the weight's first tiles and scale words are on their way: now the inputs
        if X_PREFETCH:  # and the activations' lines into L2 (a hint, no value read)
            _prefetch_x_l2(
                x_ptr,
                M,
                stride_xm,
                kt0,
                n_it,
                pid_n,
                gl.cdiv(N, BN),
                64 if X_WORDS else 128,
                num_warps,
            )
        _gdc_wait_and_release()
    # bf16 activations (or activation codes, both from L2) of the current tile; the next tile's
    # are loaded one iteration ahead
    if FUSE_QUANT:
        # [QM, 4, 32], QM = M rounded up to a power of two: warp j quantizes 32-block j, a row's
        # block spans 32 / QM threads of QM elements each (x4_l adds the zero rows QM..BM-1)
        # with two warpgroups (128 weight rows) warp j + 4 takes the other half of block j's rows
        G: gl.constexpr = num_warps // 4
        x4_l: gl.constexpr = gl.BlockedLayout(
            [BM // QM, 1, 1, QM // G], [1, QM // G, 1, 32 * G // QM], [1, G, 4, 1], [3, 2, 1, 0]
        )
        x_l: gl.constexpr = gl.SliceLayout(0, x4_l)
        # activation scales: [buffer, block, column] written, [buffer * 4 + block][column] read;
        # columns QM..BM-1 stay zero
        xs_s = gl.allocate_shared_memory(
            gl.float32, [2, 4, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        xs_rows = _reinterpret(
            xs_s, gl.float32, [8, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        z_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])
        for b in gl.static_range(2):
            xs_s.index(b).store(gl.zeros([4, BM], gl.float32, z_l))
        # X_WORDS (bf16): int32 words of two elements, QM / 2 per thread, so the registers carried
        # to the next iteration are the loaded words themselves (carried as separate bf16 values,
        # their unpacking was hoisted next to the load and waited on it: 28 % of the stall samples)
        XE: gl.constexpr = 16 if X_WORDS else 32  # loaded elements per 32-block
        xl_l: gl.constexpr = (
            gl.SliceLayout(
                0,
                gl.BlockedLayout(
                    [1, 1, 1, QM // (2 * G)],
                    [1, QM // G, 1, 32 * G // QM],
                    [1, G, 4, 1],
                    [3, 2, 1, 0],
                ),
            )
            if X_WORDS
            else x_l
        )
        xr = gl.arange(0, QM, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl_l)))
        xb4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl_l)))
        xe = gl.arange(0, XE, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl_l)))
        xrb = gl.expand_dims(
            gl.expand_dims(xr.to(gl.int64) * stride_xm, 1) + gl.expand_dims(xb4 * XE, 0), 2
        )
        x_ptrs = x_ptr + xrb + gl.expand_dims(gl.expand_dims(xe, 0), 1)
        x_mask = (
            xrb + gl.expand_dims(gl.expand_dims(xe, 0), 1)
        ) < M * stride_xm  # rows past M are zeros
        XT: gl.constexpr = 4 * XE  # elements (words) per K-tile row
        xt = gl.load(x_ptrs + kt0 * XT, mask=x_mask, other=0)
    else:
        xc_ptrs = xc_ptr + gl.minimum(cols, M - 1).to(gl.int64) * (
            K // 32
        )  # rows past M repeat row M-1
        sx0 = _pow2_f32(gl.load(xc_ptrs + kt0 * 4))
        sx1 = _pow2_f32(gl.load(xc_ptrs + kt0 * 4 + 1))
        sx2 = _pow2_f32(gl.load(xc_ptrs + kt0 * 4 + 2))
        sx3 = _pow2_f32(gl.load(xc_ptrs + kt0 * 4 + 3))
    for i in range(n_it):
        stage = i % STAGES
        nxt = i + STAGES - 1  # refill the stage of tile i-1, whose MMAs were waited for
        _issue_tile(
            w_desc,
            x_desc,
            w_s,
            x_s,
            bars.index(nxt % STAGES),
            nxt % STAGES,
            p0,
            (kt0 + nxt) * 128,
            nxt < n_it,
            not FUSE_QUANT,
        )
        kn = gl.minimum(kt0 + i + 1, last)
        sw_new = gl.load(sw_ptrs + gl.minimum(kt0 + i + SW_AHEAD, last) * 128)
        if FUSE_QUANT:  # quantize tile i while its weight bytes are still on their way
            xt_next = gl.load(x_ptrs + kn * XT, mask=x_mask, other=0)
            xb = i % 2
            _quantize_tile(xt, x_s.index(xb), xs_s.index(xb), x4_l)
            fence_async_shared()  # the threads' stores, before the wgmma (async proxy) reads them
            _cta_barrier()  # every warp's blocks of the tile are stored
            sx0 = xs_rows.index(xb * 4 + 0).load(col_l)
            sx1 = xs_rows.index(xb * 4 + 1).load(col_l)
            sx2 = xs_rows.index(xb * 4 + 2).load(col_l)
            sx3 = xs_rows.index(xb * 4 + 3).load(col_l)
        else:
            sn0 = _pow2_f32(gl.load(xc_ptrs + kn * 4))
            sn1 = _pow2_f32(gl.load(xc_ptrs + kn * 4 + 1))
            sn2 = _pow2_f32(gl.load(xc_ptrs + kn * 4 + 2))
            sn3 = _pow2_f32(gl.load(xc_ptrs + kn * 4 + 3))
            xb = stage
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        p_0 = _part(w_s, x_s, stage, xb, zero, 0)
        p_1 = _part(w_s, x_s, stage, xb, zero, 1)
        p_2 = _part(w_s, x_s, stage, xb, zero, 2)
        p_3 = _part(w_s, x_s, stage, xb, zero, 3)
        p_0 = warpgroup_mma_wait(num_outstanding=3, deps=(p_0,))
        acc = _rescale(acc, p_0, sw_word, sx0, 0)
        p_1 = warpgroup_mma_wait(num_outstanding=2, deps=(p_1,))
        acc = _rescale(acc, p_1, sw_word, sx1, 1)
        p_2 = warpgroup_mma_wait(num_outstanding=1, deps=(p_2,))
        acc = _rescale(acc, p_2, sw_word, sx2, 2)
        p_3 = warpgroup_mma_wait(num_outstanding=0, deps=(p_3,))
        acc = _rescale(acc, p_3, sw_word, sx3, 3)
        if SW_AHEAD == 1:
            sw_word = sw_new
        elif SW_AHEAD == 2:
            sw_word, sw_1 = sw_1, sw_new
        else:
            sw_word, sw_1, sw_2 = sw_1, sw_2, sw_new
        if FUSE_QUANT:
            xt = xt_next
        else:
            sx0, sx1, sx2, sx3 = sn0, sn1, sn2, sn3
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    lrows = (
        _p32_logical(rows) if LAYOUT == 1 else rows
    )  # trtllm rows are P32-shuffled, cutlass ones logical
    mask = gl.expand_dims(lrows < N, 1) & gl.expand_dims(cols < M, 0)
    off = gl.expand_dims(cols.to(gl.int64), 0) * stride_om + gl.expand_dims(lrows, 1)
    # partials summed in this kernel (SERIAL), or by a second kernel that maps the rows (PHYS),
    # stay in physical row order: contiguous stores and loads (in the P32 order a warp's 8 rows
    # span 4x the 32-byte sectors); else the partials' rows are logical. ``mask`` serves both: a
    # trtllm N is a multiple of 32 and P32 permutes
    # within 32-row groups, so the physical and the logical rows below N are the same set
    ws_off = gl.expand_dims(cols.to(gl.int64), 0) * N + gl.expand_dims(
        rows if SERIAL or PHYS else lrows, 1
    )
    if CLUSTER > 1:
        if (
            split_k > 1
        ):  # each split leaves its partial in its shared memory; each sums a share of the
            # tile's elements over the cluster, in split order (the bits of the serial reduction)
            _exchange_store((gl.expand_dims(rows - p0, 1) * BM + gl.expand_dims(cols, 0)) * 4, acc)
            _cluster_sync()
            red_l: gl.constexpr = gl.BlockedLayout(
                [max(RED_E // (32 * num_warps), 1)], [32], [num_warps], [0]
            )
            share = gl.cdiv(BN * BM, split_k)
            e = split * share + gl.arange(0, RED_E, layout=red_l)
            ok = (e < (split + 1) * share) & (e < BN * BM)
            total = gl.zeros([RED_E], gl.float32, red_l)
            for r in gl.static_range(CLUSTER):
                total = total + _exchange_load(
                    gl.minimum(e, BN * BM - 1) * 4, gl.full([RED_E], r, gl.int32, red_l)
                )
            _cluster_sync()  # the others' shared memory stays until it was read
            pr = p0 + e // BM  # physical rows, then logical
            pr = _p32_logical(pr) if LAYOUT == 1 else pr
            ec = e % BM
            ok = ok & (pr < N) & (ec < M)
            if HAS_BIAS:
                total += gl.load(b_ptr + gl.minimum(pr, N - 1)).to(gl.float32)
            gl.store(
                out_ptr + ec.to(gl.int64) * stride_om + pr,
                total.to(out_ptr.dtype.element_ty),
                mask=ok,
            )
        else:  # launched without clusters: this program ran the whole K
            _store_tile(acc, b_ptr, out_ptr, off, mask, lrows, N, HAS_BIAS)
    elif PARTIAL:
        gl.store(ws_ptr + split.to(gl.int64) * stride_os + ws_off, acc, mask=mask)
        if SERIAL:  # the last split of this row tile to arrive sums the partials: no second launch
            _cta_barrier()  # every thread's partial is stored before the release below
            arrived = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                if HAS_BIAS:  # loaded first: its latency overlaps the partials'
                    bias = gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32)
                # RED_CHUNK partials per round trip to L2 (the loads of a chunk go out together),
                # summed in split order: the bits depend neither on which split arrived last nor
                # on the chunk, nor on the path that computed the partials
                total = gl.zeros([BN, BM], gl.float32, acc_l)
                for sp in range(0, split_k, RED_CHUNK):
                    for j in gl.static_range(RED_CHUNK):
                        total = total + gl.load(
                            ws_ptr + (sp + j) * stride_os + ws_off,
                            mask=mask & (sp + j < split_k),
                            other=0.0,
                            cache_modifier=".cg",
                        )
                if HAS_BIAS:
                    total += gl.expand_dims(bias, 1)
                gl.store(out_ptr + off, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(lock_ptr + pid_n, 0)  # re-arm for the next call
    else:
        _store_tile(acc, b_ptr, out_ptr, off, mask, lrows, N, HAS_BIAS)


@functools.cache
def _smem_layout(rows: int) -> gl.NVMMASharedLayout:
    """The 128-byte swizzled shared layout of a ``[rows, BLOCK_K]`` e4m3 tile, made once per shape
    (building one is slow Python, ``benchmarks/bench_host.py``)."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)


def supported(weight: MXFP8Weight, k: int) -> bool:
    """Whether the kernel can read ``weight`` as it lies: a 128x4 layout, TMA-aligned bytes."""
    d = weight.data
    return (
        weight.layout in LAYOUT_CODE
        and k % BLOCK_K == 0
        and d.is_contiguous()
        and d.data_ptr() % 16 == 0
        and weight.scale.is_contiguous()
        and weight.scale.data_ptr() % 4 == 0
    )


def wgmma_decode(
    x: torch.Tensor,
    weight: MXFP8Weight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    ws: torch.Tensor | None,
    lock: torch.Tensor | None,
    *,
    split_k: int,
    xc: torch.Tensor | None = None,
    stages: int = 2,
    sw_ahead: int = 1,
    pdl: bool = False,
    red_chunk: int = 4,
    x_words: bool = True,
    cluster: bool = False,
    block_n: int = BLOCK_N,
    prefetch: bool = False,
    phys_partials: bool = False,
    x_prefetch: bool = False,
) -> None:
    """Launch the kernel: ``out [M, N]`` (bf16); with ``split_k > 1`` fp32 partials go to ``ws``
    ``[split_k, M, N]`` and are summed by the last program of each row tile to arrive when
    ``lock`` (zeroed int32 arrival counters, one per row tile) is given, else by the caller;
    with ``cluster`` (``split_k`` in ``CLUSTER_SIZES``) the splits of a row tile run as one
    thread-block cluster and sum their partials through its shared memory, each program a share
    of the tile (no ``ws`` or ``lock``). ``block_n``: weight rows per program, 64 (one
    warpgroup) or, from M = 3, 128 (two warpgroups sharing each quantized activation tile, the
    quantization spread over their eight warps).

    ``stages`` TMA buffers in the ring; the weight scale words are loaded ``sw_ahead`` (1..3)
    K-tiles ahead. ``pdl``: launched as a programmatic dependent of the previous kernel in the
    stream, which it waits for before touching memory, and releasing the next one at once (a
    caller summing the partials with a second kernel launches it with PDL too); ``prefetch`` (with
    ``pdl`` and activations quantized here): the weight's first K-tiles and scale words are loaded
    before the wait, and with ``x_prefetch`` also the activations of its K-tiles into L2 (a hint:
    the values are read after the wait). ``phys_partials``: split-K partials in ``ws`` keep the
    weight's physical row
    order (the caller's second kernel maps them to logical rows). ``x_words``: bf16
    activations (M >= 2, 4-byte aligned rows) are loaded as int32 words of two elements, which
    stay packed in the registers carried to the next K-tile (``False``: element by element, as
    fp16/fp32 ones; the same bits).

    Args:
        x: bf16/fp16/fp32 activations ``[M, K]`` (unit stride along K), quantized inside the
            kernel, each program the K-tiles it reads; or e4m3 activations (16-byte aligned, as
            from ``quantize_activations``) read by TMA, with their int32 codes ``xc [M, K/32]``.
    """
    m, k = x.shape
    n = weight.shape[0]
    if block_n not in (64, 128) or (block_n == 128 and m < 3):
        raise ValueError(f"block_n={block_n}: 64, or 128 (two warpgroups) from M = 3")
    if not 1 <= sw_ahead <= 3:
        raise ValueError(f"sw_ahead={sw_ahead}: 1, 2 or 3")
    if m > MAX_M or not supported(weight, k) or x.stride(1) != 1:
        raise LayoutError(
            f"{weight.name or 'weight'}: the wgmma decode kernel needs M <= {MAX_M}, "
            "K % 128 == 0, a trtllm/cutlass weight and 16-byte aligned contiguous bytes"
        )
    fuse = x.dtype != torch.float8_e4m3fn
    if fuse and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LayoutError(
            f"activations of dtype {x.dtype}: bf16/fp16/fp32, or e4m3 with their codes"
        )
    if not fuse and xc is None:
        raise LayoutError("e4m3 activations need their codes (xc)")
    bm = max(8, next_pow2(m))  # the MMA's N: 8, 16 or 32
    w_layout, x_layout = _smem_layout(block_n), _smem_layout(bm)
    w_desc = TensorDescriptor(weight.data, [n, k], [k, 1], [block_n, BLOCK_K], w_layout)
    x_desc = None if fuse else TensorDescriptor(x, [m, k], [k, 1], [bm, BLOCK_K], x_layout)
    cluster = cluster and split_k > 1
    if cluster and split_k not in CLUSTER_SIZES:
        raise ValueError(
            f"split_k={split_k}: a cluster holds {', '.join(map(str, CLUSTER_SIZES))} programs"
        )
    k_tiles = (
        k // BLOCK_K
    )  # every split needs a K-tile (an empty one would read scale words past its end)
    if split_k > k_tiles or (not cluster and (split_k - 1) * cdiv(k_tiles, split_k) >= k_tiles):
        raise ValueError(
            f"split_k={split_k}: leaves a split of K = {k} ({k_tiles} tiles of {BLOCK_K}) empty"
        )
    partial = split_k > 1 and not cluster
    early = (
        prefetch and pdl and fuse
    )  # loads before the PDL wait: only with the activations quantized here
    # bf16 activations go to the kernel as int32 words (two elements each) where they align
    words = (x_words and fuse and x.dtype == torch.bfloat16 and m >= 2 and x.data_ptr() % 4 == 0
             and x.stride(0) % 2 == 0)
    xk, stride_xm = (x.view(torch.int32), x.stride(0) // 2) if words else (x, x.stride(0))
    scale = weight.scale.view(torch.int32)
    cp4 = (k // 32 + 3) // 4
    compiled = _wgmma_decode_kernel[(cdiv(n, block_n), 1 if cluster else split_k)](
        w_desc,
        x_desc,
        xk,
        scale,
        scale if fuse else xc,
        bias if bias is not None else out,
        out,
        ws if partial else out,
        lock if lock is not None else scale,
        m,
        n,
        k,
        stride_xm,
        out.stride(0),
        m * n,
        cp4,
        split_k,
        LAYOUT=LAYOUT_CODE[weight.layout],
        HAS_BIAS=bias is not None,
        PARTIAL=partial,
        SERIAL=partial and lock is not None,
        FUSE_QUANT=fuse,
        BM=bm,
        QM=next_pow2(m),
        X_SMEM=x_layout,
        STAGES=stages,
        SW_AHEAD=sw_ahead,
        PDL=pdl,
        RED_CHUNK=red_chunk,
        X_WORDS=words,
        CLUSTER=split_k if cluster else 0,
        RED_E=block_n * bm >> (split_k.bit_length() - 1) if cluster else 0,
        PREFETCH=early,
        PHYS=phys_partials,
        X_PREFETCH=x_prefetch and early,
        num_warps=block_n // 16,
        enable_fp_fusion=FP_FUSION,
        **({"launch_pdl": True} if pdl else {}),
    )
    # where the wrapper below did not see the compilation (another Triton): from the next launch on
    if cluster:
        _launch_as_clusters(compiled, split_k)


def _launch_as_clusters(compiled, size: int) -> None:
    """Make Triton launch ``compiled`` as clusters of ``size`` programs along the first grid axis
    (its launcher reads the cluster size from the packed metadata ``(num_warps, num_ctas,
    shared)``, and multiplies the first grid dimension by it). The kernel is compiled for one
    CTA per cluster, as Gluon layouts are written here; it reads its rank and the cluster size
    from the special registers, so launched without clusters it computes the whole K itself."""
    meta = getattr(compiled, "packed_metadata", None)
    if meta is not None and meta[1] != size:
        compiled.packed_metadata = (meta[0], size, *meta[2:])


def _compile_for_clusters(do_compile):
    """Wrap the kernel's ``JITFunction._do_compile`` so that a kernel compiled with ``CLUSTER > 1``
    launches as clusters from its first launch on (``_launch_as_clusters``)."""
    index = _wgmma_decode_kernel.arg_names.index("CLUSTER")

    @functools.wraps(do_compile)
    def wrapped(key, signature, device, constexprs, *args, **kwargs):
        kernel = do_compile(key, signature, device, constexprs, *args, **kwargs)
        size = constexprs.get((index,), 0) if isinstance(constexprs, dict) else 0
        if size > 1:
            _launch_as_clusters(kernel, size)
        return kernel

    return wrapped


_wgmma_decode_kernel._do_compile = _compile_for_clusters(_wgmma_decode_kernel._do_compile)
