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
groups, so a tile's logical rows are its physical ones reordered in registers; cutlass: the
identity) and re-lays the tile through shared memory so that each thread stores 16 contiguous
bytes of one token's output row. Split-K partials go to an fp32 workspace in physical row order
and ``reduce.py`` sums them (``P32``). Rows of the activation box past M are TMA's zero fill and
are never stored.

The e4m3 -> bf16 conversion is bit moves and one bf16x2 multiply per two elements where every
scale code of the weight is <= 134 (:func:`fast_conversion`), else e4m3 -> fp32 -> bf16; the
same bits (:func:`_dq_block`). :func:`_dqmma_ws_kernel` is the warp-specialized variant: a
producer warp issues the TMA loads into an mbarrier ring and one or two consumer warpgroups of
64 rows each run the dequantize / wgmma chain above on their own (the serving rule takes it on
large weights above 64 tokens, with programs of 128 or 256 tokens).

With ``PDL`` (the serving rule's choice on small weights) the quantization kernel, this kernel
and the split-K reduction run as a chain of programmatic dependent launches: this kernel waits
(``griddepcontrol.wait``) before it reads the activations, and with ``PREFETCH`` issues its
first weight tiles and loads its scale words before that (the specialized kernel: its producer
warp), so their DRAM latency overlaps the quantization; then it lets the reduction launch.

Not interpretable (Gluon has no CPU interpreter): validated by the ``gpu`` tests on a Hopper GPU;
``tests/runtime/test_gluon_compile.py`` compiles it for sm_90a on any machine.
"""

from __future__ import annotations

import functools
import weakref

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
from mxfp8_convert.runtime.hopper.jit import (
    FP_FUSION,
    _p32_logical,
    _pow2_f32,
    _scale_row_base,
)
from mxfp8_convert.runtime.hopper.wgmma import LAYOUT_CODE, _gdc_wait_and_release, _tma_load
from mxfp8_convert.runtime.weight import MXFP8Weight

BLOCK_K = 128  # K per pipeline stage: four 32-blocks, one 128x4 scale word per row
X_BOX = 64  # bf16 activation box width (128 bytes: the widest 128-byte-swizzled TMA box)
#: the specialized kernel's registers: ``maxnreg`` for 4 + 4 + 1 (12 allocated) warps or 4 + 1
#: (8) within the 64 K registers of an SM, and the consumer worker's share after setmaxnreg
WS_MAXNREG = {1: 248, 2: 168}
WS_CONS_REGS = {1: 0, 2: 232}


@gluon.jit
def _issue_w(w_desc, x_desc, w_s, bar, stage, p0, k0, pred):
    """The weight half of one K-tile's TMA loads: the stage's barrier expects the whole tile (its
    ``[BN, 128]`` weight bytes and two ``[BM, 64]`` activation boxes), the weight box goes out."""
    mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes, pred=pred)
    _tma_load(w_desc, [p0, k0], bar, w_s.index(stage), pred=pred)


@gluon.jit
def _issue_x(x_desc, x_s, bar, stage, m0, k0, pred):
    """The activation half of one K-tile's TMA loads: two ``[BM, 64]`` boxes."""
    _tma_load(x_desc, [m0, k0], bar, x_s.index(2 * stage), pred=pred)
    _tma_load(x_desc, [m0, k0 + 64], bar, x_s.index(2 * stage + 1), pred=pred)


@gluon.jit
def _issue(w_desc, x_desc, w_s, x_s, bar, stage, p0, m0, k0, pred):
    """TMA loads of one K-tile: ``[BN, 128]`` weight bytes and two ``[BM, 64]`` activation boxes."""
    _issue_w(w_desc, x_desc, w_s, bar, stage, p0, k0, pred)
    _issue_x(x_desc, x_s, bar, stage, m0, k0, pred)


@gluon.jit
def _scale_words(sw_ptrs, kt):
    """The rows' 128x4 scale words of K-tile ``kt`` (``sw_ptrs``: each row's word of K-tile 0),
    from global memory."""
    return gl.load(sw_ptrs + kt * 128)


#: e4m3 -> bf16 by bit moves, two bytes (a row's K-neighbours) at a time, and the block scale
#: by one bf16x2 multiply.
#: ``prmt`` spreads bytes b0, b1 into the halves of a word with their sign bytes replicated
#: above them; ``<< 4`` and the mask leave ``sign << 15 | (byte & 0x7F) << 4`` per
#: half: the bf16 of ``q * 2^-120`` exactly, subnormal e4m3 included (bf16 subnormals); the
#: multiply by ``2^(code - 7)`` (exact in bf16 for code <= 134) then rounds the exact product
#: ``q * 2^(code - 127)`` once, as the fp32 path's final conversion does: the same bits.
_E4M3X2_BF16 = gl.constexpr("""{
.reg .b32 t;
cvt.u32.u16 t, $1;
prmt.b32 t, t, 0, 0x9180;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
mul.rn.bf16x2 $0, t, $2;
}""")
#: largest scale code the bit path takes: ``2^(code - 7)`` must be a normal bf16
FAST_MAX_CODE = 134


@gluon.jit
def _dq_block(w_tile, word, j: gl.constexpr, a_l: gl.constexpr, FAST: gl.constexpr):
    """32-block ``j`` of a shared ``[BN, 128]`` e4m3 tile as exact bf16 ``q * 2^(c-127)`` in the
    register-operand layout ``a_l`` (``word``: the rows' 128x4 scale words, in its row slice).
    ``FAST`` (every scale code <= ``FAST_MAX_CODE``): bit moves and one bf16x2 multiply per two
    elements (:data:`_E4M3X2_BF16`; the register layout pairs K-neighbours of one row, so one
    scale per pair); else e4m3 -> fp32 (exact), times the power of two (exact), -> bf16 (exact:
    4 significant bits). Both give the same bits (``test_dqmma_bit_conversion_matches``); only
    e4m3 NaN (0x7F, 0xFF, never in a quantized weight) differs: finite here, NaN there."""
    return _dq_convert(w_tile.slice(j * 32, 32, dim=1).load(a_l), word, j, FAST)


@gluon.jit
def _dq_convert(q, word, j: gl.constexpr, FAST: gl.constexpr):
    """:func:`_dq_block` of the block's e4m3 fragment ``q``, already in registers."""
    code = (word >> (8 * j)) & 0xFF
    if FAST:
        h = (code + 120) << 7  # bf16 bits of 2^(code - 7)
        sc = gl.expand_dims(h | (h << 16), 1)
        qi = q.to(gl.int8, bitcast=True)
        sc, qi = gl.broadcast(sc, qi)
        return gl.inline_asm_elementwise(_E4M3X2_BF16, "=r,h,r,r", [qi, sc],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    sc = _pow2_f32(code)
    return (q.to(gl.float32) * gl.expand_dims(sc, 1)).to(gl.bfloat16)


@gluon.jit
def _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, i, kt0, n_it, p0, m0,
           a_l: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr):
    """K-tile ``i`` of the program: four 32-blocks, each dequantized (:func:`_dq_block`) while the
    previous block's wgmma runs; once the first block's wgmma is issued with one left in flight,
    the previous tile's have retired and its stage is refilled with tile ``i + STAGES - 1``.
    Returns the accumulator (one wgmma still in flight) and that wgmma's register operand, which
    stays live until a wait retires it."""
    stage = i % STAGES
    mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
    w_tile = w_s.index(stage)
    for j in gl.static_range(4):
        a_next = _dq_block(w_tile, sw_word, j, a_l, FAST)
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
    FAST: gl.constexpr, PDL: gl.constexpr, PREFETCH: gl.constexpr, num_warps: gl.constexpr,
):
    if PDL and not PREFETCH:  # before any access to memory
        _gdc_wait_and_release()
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    srow_l: gl.constexpr = gl.SliceLayout(1, a_l)
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)

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
        _issue_w(w_desc, x_desc, w_s, bars.index(s), s, p0, (kt0 + s) * 128, s < n_it)
        if not PREFETCH:
            _issue_x(x_desc, x_s, bars.index(s), s, m0, (kt0 + s) * 128, s < n_it)

    srows = p0 + gl.arange(0, BN, layout=srow_l)  # physical rows (< the 128-row padded scale rows)
    sw_ptrs = s_ptr + _scale_row_base(srows, 0, scale_cp4, LAYOUT)  # word of (row, scale col 0)
    sw_word = _scale_words(sw_ptrs, kt0)  # scale words from DRAM: two K-tiles ahead
    sw_1 = _scale_words(sw_ptrs, gl.minimum(kt0 + 1, last))
    if PDL and PREFETCH:  # the weight's first tiles and scale words are on their way: now the
        # activations, which the previous kernel (the quantization) writes
        _gdc_wait_and_release()
        for s in gl.static_range(STAGES - 1):
            _issue_x(x_desc, x_s, bars.index(s), s, m0, (kt0 + s) * 128, s < n_it)

    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    a = gl.zeros([BN, 32], gl.bfloat16, a_l)
    # K-tile 0 outside the loop (every split has one): on no path does a non-wgmma instruction
    # define the accumulator while a wgmma is in flight, so ptxas keeps them asynchronous
    acc, a = _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, 0, kt0, n_it, p0, m0, a_l,
                    STAGES, FAST)
    sw_word, sw_1 = sw_1, _scale_words(sw_ptrs, gl.minimum(kt0 + 2, last))
    for i in range(1, n_it):
        sw_new = _scale_words(sw_ptrs, gl.minimum(kt0 + i + 2, last))
        acc, a = _ktile(w_desc, x_desc, w_s, x_s, bars, acc, a, sw_word, i, kt0, n_it, p0, m0,
                        a_l, STAGES, FAST)
        sw_word, sw_1 = sw_1, sw_new
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    _epilogue(acc, gl.arange(0, BN, layout=row_l), p0, m0, b_ptr, out_ptr, ws_ptr, split, M,
              N, stride_om, stride_os, LAYOUT, HAS_BIAS, PARTIAL, num_warps)


@gluon.jit
def _epilogue(acc, rows, p0, m0, b_ptr, out_ptr, ws_ptr, split, M, N, stride_om, stride_os,
              LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
              NW: gl.constexpr):
    """Store the ``[BN, BM]`` accumulator of physical weight rows ``p0 + rows`` (``rows``: the
    accumulator's row slice) and tokens ``m0 ..`` (both kernels, ``NW`` warps): fp32 partials in
    physical row order, or the output's logical columns with the bias. The wgmma accumulator
    gives a thread two tokens of rows 8 apart: eight rows of a token are 16 bytes of bf16 output,
    half a 32-byte sector, so for the output trtllm rows are put in logical order in registers
    (P32 exchanges the 4 x 8 halves of a 32-row group's index) and the tile goes through shared
    memory to a layout of 8 contiguous elements a thread: whole 16-byte stores, whole sectors.
    Eight fp32 partials already fill a sector; they are stored from the accumulator."""
    if PARTIAL:  # physical row order (contiguous); reduce.py maps the rows (P32)
        r = p0 + rows
        c = m0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        mask = gl.expand_dims(r < N, 1) & gl.expand_dims(c < M, 0)
        off = gl.expand_dims(c.to(gl.int64), 0) * N + gl.expand_dims(r, 1)
        gl.store(ws_ptr + split.to(gl.int64) * stride_os + off, acc, mask=mask)
    else:
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        st_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, NW], [0, 1])
        if HAS_BIAS:
            lrows = _p32_logical(p0 + rows) if LAYOUT == 1 else p0 + rows
            acc += gl.expand_dims(gl.load(b_ptr + gl.minimum(lrows, N - 1)).to(gl.float32), 1)
        v = acc.to(out_ptr.dtype.element_ty)
        if LAYOUT == 1:  # physical 32 g + 8 a + b holds logical 32 g + 4 b + a
            v = gl.reshape(gl.permute(gl.reshape(v, [BN // 32, 4, 8, BM]), (0, 2, 1, 3)),
                           [BN, BM])
        v = gl.convert_layout(v, st_l)
        r = p0 + gl.arange(0, BN, layout=gl.SliceLayout(1, st_l))
        c = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st_l))
        mask = gl.expand_dims(r < N, 1) & gl.expand_dims(c < M, 0)
        off = gl.expand_dims(c.to(gl.int64), 0) * stride_om + gl.expand_dims(r, 1)
        gl.store(out_ptr + off, v, mask=mask)


@gluon.jit
def _ws_ktile(w_s, x_s, full, empty, acc, a, word, i, a_l: gl.constexpr, WG: gl.constexpr,
              CONS: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr):
    """Consumer ``WG``'s K-tile ``i``: wait for the stage, four 32-blocks dequantized while the
    previous block's wgmma runs; after the first wgmma wait the previous tile's wgmmas have
    retired (and so have this warpgroup's fragment loads of it), and its stage is released."""
    stage = i % STAGES
    mbarrier.wait(full.index(stage), (i // STAGES) & 1)
    w_tile = w_s.index(stage * CONS + WG)
    for j in gl.static_range(4):
        a_next = _dq_block(w_tile, word, j, a_l, FAST)
        xb = x_s.index(2 * stage + j // 2).slice((j % 2) * 32, 32, dim=1).permute((1, 0))
        acc = warpgroup_mma(a_next, xb, acc, is_async=True)
        acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
        a = a_next
        if j == 0:  # (no proxy fence: the fragment loads' values are in registers, consumed)
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    return acc, a


@gluon.jit
def _ws_part(w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M, N,
             stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split,
             LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
             STAGES: gl.constexpr, FAST: gl.constexpr, CONS: gl.constexpr, ROLE: gl.constexpr,
             PDL: gl.constexpr, PREFETCH: gl.constexpr):
    """One partition of :func:`_dqmma_ws_kernel`: ``ROLE`` < ``CONS`` a consumer warpgroup (64
    weight rows), ``ROLE == CONS`` the producer warp."""
    if ROLE == CONS:  # producer: one warp, TMA loads into the ring, no CTA barrier
        nbytes: gl.constexpr = CONS * w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes
        start = 0
        if PDL:  # the first STAGES weight tiles before the wait (every stage is free), then the
            # activations, which the previous kernel (the quantization) writes; the consumers
            # read nothing that kernel writes before the activations, and store after them
            if PREFETCH:
                for s in gl.static_range(STAGES):
                    mbarrier.expect(full.index(s), nbytes, pred=s < n_it)
                    for c in gl.static_range(CONS):
                        _tma_load(w_desc, [p0 + 64 * c, (kt0 + s) * 128], full.index(s),
                                  w_s.index(s * CONS + c), pred=s < n_it)
            _gdc_wait_and_release()
            if PREFETCH:
                for s in gl.static_range(STAGES):
                    _issue_x(x_desc, x_s, full.index(s), s, m0, (kt0 + s) * 128, s < n_it)
                start = STAGES
        for i in range(start, n_it):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
            bar = full.index(stage)
            k0 = (kt0 + i) * 128
            mbarrier.expect(bar, nbytes)
            for c in gl.static_range(CONS):
                _tma_load(w_desc, [p0 + 64 * c, k0], bar, w_s.index(stage * CONS + c))
            _tma_load(x_desc, [m0, k0], bar, x_s.index(2 * stage))
            _tma_load(x_desc, [m0, k0 + 64], bar, x_s.index(2 * stage + 1))
    else:
        if PDL and not PREFETCH:  # (MXFP8_PDL=strict) not even the scale words before the wait
            _gdc_wait_and_release()
        BM: gl.constexpr = x_desc.block_type.shape[0]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        srow_l: gl.constexpr = gl.SliceLayout(1, a_l)
        r0 = p0 + 64 * ROLE
        last = kt0 + n_it - 1
        sw_ptrs = s_ptr + _scale_row_base(r0 + gl.arange(0, 64, layout=srow_l), 0, scale_cp4,
                                          LAYOUT)
        sw_word = _scale_words(sw_ptrs, kt0)  # scale words from DRAM: two K-tiles ahead
        sw_1 = _scale_words(sw_ptrs, gl.minimum(kt0 + 1, last))
        acc = gl.zeros([64, BM], gl.float32, acc_l)
        a = gl.zeros([64, 32], gl.bfloat16, a_l)
        acc, a = _ws_ktile(w_s, x_s, full, empty, acc, a, sw_word, 0, a_l, ROLE, CONS, STAGES,
                           FAST)
        sw_word, sw_1 = sw_1, _scale_words(sw_ptrs, gl.minimum(kt0 + 2, last))
        for i in range(1, n_it):
            sw_new = _scale_words(sw_ptrs, gl.minimum(kt0 + i + 2, last))
            acc, a = _ws_ktile(w_s, x_s, full, empty, acc, a, sw_word, i, a_l, ROLE, CONS,
                               STAGES, FAST)
            sw_word, sw_1 = sw_1, sw_new
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        _epilogue(acc, gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l)), r0, m0, b_ptr,
                  out_ptr, ws_ptr, split, M, N, stride_om, stride_os, LAYOUT, HAS_BIAS, PARTIAL,
                  4)


@gluon.jit
def _dqmma_ws_kernel(
    w_desc, x_desc, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_om, stride_os, scale_cp4, split_k,
    LAYOUT: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, STAGES: gl.constexpr,
    FAST: gl.constexpr, CONS: gl.constexpr, CONS_REGS: gl.constexpr, PDL: gl.constexpr,
    PREFETCH: gl.constexpr, num_warps: gl.constexpr,
):
    """Warp-specialized :func:`_dqmma_kernel`: a ``[64 CONS, BM]`` tile of ``out^T`` per program,
    one producer warp issuing the TMA loads into a ring of ``STAGES`` stages (full / empty
    mbarriers; no CTA-wide barrier in the K loop) and ``CONS`` consumer warpgroups of 64 weight
    rows each sharing the activation boxes, each running its own dequantize / wgmma chain, so one
    warpgroup's conversion runs under the other's MMAs."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    m_tiles = gl.cdiv(M, BM)
    pid_n = gl.program_id(0) // m_tiles  # the M tiles of a weight tile run side by side (L2)
    m0 = (gl.program_id(0) % m_tiles) * BM
    split = gl.program_id(1)
    k_tiles = K // 128
    per_split = gl.cdiv(k_tiles, split_k)
    kt0 = split * per_split
    n_it = gl.minimum(kt0 + per_split, k_tiles) - kt0
    p0 = pid_n * (64 * CONS)

    w_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES * CONS, 64, 128], w_desc.layout)
    x_s = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BM, 64], x_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONS)
    if CONS == 2:
        gl.warp_specialize([
            (_ws_part, (w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M,
                        N, stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split, LAYOUT,
                        HAS_BIAS, PARTIAL, STAGES, FAST, CONS, 0, PDL, PREFETCH)),
            (_ws_part, (w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M,
                        N, stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split, LAYOUT,
                        HAS_BIAS, PARTIAL, STAGES, FAST, CONS, 1, PDL, PREFETCH)),
            (_ws_part, (w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M,
                        N, stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split, LAYOUT,
                        HAS_BIAS, PARTIAL, STAGES, FAST, CONS, 2, PDL, PREFETCH)),
        ], [4, 1], [CONS_REGS, 24])
    else:
        gl.warp_specialize([
            (_ws_part, (w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M,
                        N, stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split, LAYOUT,
                        HAS_BIAS, PARTIAL, STAGES, FAST, CONS, 0, PDL, PREFETCH)),
            (_ws_part, (w_desc, x_desc, w_s, x_s, full, empty, s_ptr, b_ptr, out_ptr, ws_ptr, M,
                        N, stride_om, stride_os, scale_cp4, p0, m0, kt0, n_it, split, LAYOUT,
                        HAS_BIAS, PARTIAL, STAGES, FAST, CONS, 1, PDL, PREFETCH)),
        ], [1], [24])


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


_FAST: dict[int, tuple] = {}  # id(scale) -> (weakref, _version, every code <= FAST_MAX_CODE)


def fast_conversion(scale: torch.Tensor) -> bool:
    """Whether every UE8M0 code of ``scale`` is <= :data:`FAST_MAX_CODE` (the bit conversion's
    range), read once per scale tensor and version (one reduction and a host sync on the first
    call; inside CUDA-graph capture, where no sync may happen, an unread scale takes the fp32
    path)."""
    hit = _FAST.get(id(scale))
    if hit is not None and hit[0]() is scale and hit[1] == scale._version:
        return hit[2]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool(scale.max() <= FAST_MAX_CODE) if scale.numel() else True
    key = id(scale)
    _FAST[key] = (weakref.ref(scale, lambda _r: _FAST.pop(key, None)), scale._version, ok)
    return ok


def dqmma(xd: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
          ws: torch.Tensor | None, *, split_k: int, block_n: int, block_m: int,
          stages: int, specialized: bool = False, fast: bool | None = None, pdl: bool = False,
          prefetch: bool = False) -> None:
    """Launch the kernel: ``out [M, N]`` (bf16) from ``xd [M, K]``, the exactly dequantized bf16
    MXFP8 activations (``quantize_activations(x)["deq"]``, 16-byte aligned rows); with ``split_k
    > 1`` fp32 partials go to ``ws [split_k, M, N]`` in the weight's physical row order, for the
    caller to sum (``reduce.py`` with ``P32`` for trtllm). ``block_n``: weight rows per program
    (64 per warpgroup: 64, 128 or 256); ``block_m``: tokens per program (16..256, a power of
    two); ``stages``: TMA buffers in the ring. ``specialized``: :func:`_dqmma_ws_kernel` (a
    producer warp and ``block_n / 64`` consumer warpgroups; 64 or 128 rows). ``fast``: the bit
    conversion (default: :func:`fast_conversion` of the weight's scale; False: the fp32 path).
    ``pdl``: launched as a programmatic dependent of the previous kernel in the stream (the
    quantization that wrote ``xd``), which it waits for before reading the activations and
    storing, releasing the next kernel (the reduction) at once; ``prefetch`` (with ``pdl``): the
    weight's first tiles and scale words are loaded before the wait (the weight must not be
    written by the previous kernels)."""
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
    if specialized and block_n not in (64, 128):
        raise ValueError(f"block_n={block_n}: the specialized kernel takes 64 or 128 rows")
    if fast is None:
        fast = fast_conversion(weight.scale)
    box_n = 64 if specialized else block_n
    w_desc = TensorDescriptor(weight.data, [n, k], [k, 1], [box_n, BLOCK_K],
                              _smem_layout(box_n, BLOCK_K, "float8e4nv"))
    x_desc = TensorDescriptor(xd, [m, k], [xd.stride(0), 1], [block_m, X_BOX],
                              _smem_layout(block_m, X_BOX, "bfloat16"))
    partial = split_k > 1
    if specialized:
        cons = block_n // 64
        _dqmma_ws_kernel[(cdiv(n, block_n) * cdiv(m, block_m), split_k)](
            w_desc, x_desc, weight.scale.view(torch.int32), bias if bias is not None else out,
            out, ws if partial else out, m, n, k, out.stride(0), m * n, (k // 32 + 3) // 4,
            split_k, LAYOUT=LAYOUT_CODE[weight.layout], HAS_BIAS=bias is not None,
            PARTIAL=partial, STAGES=stages, FAST=fast, CONS=cons, CONS_REGS=WS_CONS_REGS[cons],
            PDL=pdl, PREFETCH=prefetch and pdl, num_warps=4, maxnreg=WS_MAXNREG[cons],
            enable_fp_fusion=FP_FUSION, **({"launch_pdl": True} if pdl else {}),
        )
        return
    _dqmma_kernel[(cdiv(n, block_n) * cdiv(m, block_m), split_k)](
        w_desc, x_desc, weight.scale.view(torch.int32), bias if bias is not None else out, out,
        ws if partial else out, m, n, k, out.stride(0), m * n, (k // 32 + 3) // 4, split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], HAS_BIAS=bias is not None, PARTIAL=partial,
        STAGES=stages, FAST=fast, PDL=pdl, PREFETCH=prefetch and pdl, num_warps=block_n // 16,
        enable_fp_fusion=FP_FUSION, **({"launch_pdl": True} if pdl else {}),
    )
