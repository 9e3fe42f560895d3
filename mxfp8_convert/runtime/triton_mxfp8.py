"""Triton MXFP8 linear for Hopper (SM90): reads the laid-out weight and scale bytes in place.

Why dequantize-then-bf16-MMA (SPEC.md section 7): SM90 tensor cores have no block-scaled FP8 MMA,
and rescaling FP8 partial products every 32 K-elements reached only ~0.15x bf16. But UE8M0 scales
are powers of two and e4m3 has a 4-bit significand, so ``q * 2^(code-127)`` is *exact* in bf16,
and so are the products of two such values in the fp32-accumulating bf16 MMA. A bf16 ``tl.dot``
on dequantized tiles therefore computes the MXFP8 GEMM (up to fp32 summation order) at bf16
tensor-core rate, while the weight is still streamed from memory as 1.03 bytes per element.

Data flow per output tile ``acc[BLOCK_N, BLOCK_M]`` (transposed, so the dequantized weight tile is
the MMA's register operand and never goes through shared memory as bf16):

- weight rows are gathered in logical order: for trtllm, logical row ``l`` lives at physical row
  ``32*(l//32) + 8*(l%4) + (l%32)//4`` (the inverse of the P32 shuffle, SPEC.md section 2), and its
  scale at the 128x4 offset of that *physical* row; no unshuffled copy is ever made;
- activations are quantized to MXFP8 with FlashInfer's recipe either inside the GEMM (small M:
  cheap, one launch) or by :func:`quantize_activations` into exactly-dequantized bf16 (large M);
- split-K partials (small M: a weight stream needs many CTAs) are summed by a second kernel,
  or, for small weights, by the last CTA of each tile to arrive (an atomic arrival counter).

Rounding to e4m3 is done in fp32 arithmetic (the magic-number trick), not by a float8 cast: it is
bit-exact RNE on every device and in Triton's interpreter, whose float8/bf16 casts truncate.
In the interpreter (``TRITON_INTERPRET=1``, CPU tensors) the dot runs on float32 copies of the
same exact values, because the interpreter's bf16 arithmetic is wrong; results are identical.

This module imports triton at import time; :mod:`mxfp8_convert.runtime` imports it lazily.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight

#: Kernel code of each weight layout (constexpr LAYOUT).
LAYOUT_CODE = {"cutlass": 0, "trtllm": 1, CANONICAL: 2}
_INV_448 = tl.constexpr(1.0 / 448.0)  # rounds to fl32(1/448) in fp32 math, as FlashInfer's host code


# --------------------------------------------------------------------------------------------
# Scalar helpers (all elementwise on fp32 / int32 tensors)
# --------------------------------------------------------------------------------------------
@triton.jit
def _ue8m0_code(amax):
    """int32 UE8M0 code of ceil_pow2(amax / 448), FlashInfer's ``float_to_ue8m0``."""
    v = amax * _INV_448
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    bump = (man > 0) & (exp != 0xFE) & ((exp != 0) | (man > 0x400000))
    return exp + bump.to(tl.int32)


@triton.jit
def _pow2_f32(e_field):
    """fp32 ``2^(e_field - 127)`` for e_field in 0..254 (0 gives the subnormal 2^-127)."""
    bits = tl.where(e_field <= 0, 0x400000, e_field << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
    """Round fp32 ``y`` to the nearest e4m3 value (ties to even), saturating at +-448.

    Adding ``1.5 * 2^(e+20)`` (e = binade of |y|, at least -6 for subnormals) leaves exactly the
    e4m3 ulp ``2^(e-3)`` as the fp32 ulp of the sum, so fp32's RNE add does the rounding.
    """
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # the sign bit alone
    a = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((147 + e) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(r):
    """uint8 e4m3fn encoding of an fp32 value that is exactly representable in e4m3."""
    bits = r.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    mag = tl.where(ex >= 121, ((ex - 120) << 3) | ((bits >> 20) & 0x7), (tl.abs(r) * 512.0).to(tl.int32))
    return (mag | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _mx_fake_quant(xf, AXIS: tl.constexpr):
    """Quantize-dequantize fp32 ``xf`` whose 32-blocks run along ``AXIS`` of a 3-D tensor.

    Returns ``(deq, r, code)``: exact fp32 ``q * 2^(code-127)``, the e4m3 values ``q`` (fp32) and
    the int32 codes (``AXIS`` reduced away).
    """
    code = _ue8m0_code(tl.max(tl.abs(xf), axis=AXIS))
    inv = tl.expand_dims(_pow2_f32(254 - code), AXIS)  # 2^(127-code)
    r = _round_e4m3(xf * inv)
    deq = r * tl.expand_dims(_pow2_f32(code), AXIS)
    return deq, r, code


# --------------------------------------------------------------------------------------------
# Activation quantization: x [M, K] -> exactly dequantized A (bf16/fp32) and/or (q, code)
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, deq_ptr, q_ptr, code_ptr, M, K, stride_xm,
    WRITE_DEQ: tl.constexpr, WRITE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32))
    deq, r, code = _mx_fake_quant(xf, 2)
    if WRITE_DEQ:
        d = tl.reshape(deq, (BLOCK_M, BLOCK_K))
        tl.store(deq_ptr + rows * K + offs_k[None, :], d.to(deq_ptr.dtype.element_ty), mask=mask)
    if WRITE_Q:
        q = tl.reshape(_e4m3_byte(r), (BLOCK_M, BLOCK_K))
        tl.store(q_ptr + rows * K + offs_k[None, :], q, mask=mask)
        offs_c = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        cmask = (offs_m < M)[:, None] & (offs_c < K // 32)[None, :]
        tl.store(code_ptr + rows * (K // 32) + offs_c[None, :], code.to(tl.uint8), mask=cmask)


# --------------------------------------------------------------------------------------------
# The GEMM
# --------------------------------------------------------------------------------------------
@triton.jit
def _scale_row_base(rows, scale_c, scale_cp4, LAYOUT: tl.constexpr):
    """Offset of (physical row, scale column 0): in bytes (canonical) or int32 words (128x4)."""
    if LAYOUT == 2:  # canonical: linear uint8 [N, C]
        return rows.to(tl.int64) * scale_c
    else:  # 128x4 byte offset (r//128)*(Cp/4)*512 + (r%32)*16 + ((r%128)//32)*4, in words
        return (rows // 128).to(tl.int64) * (scale_cp4 * 128) + (rows % 32) * 4 + (rows % 128) // 32


@triton.jit
def _load_codes(s_base, kt, BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr):
    """int32 UE8M0 codes [BN, BLOCK_K/32] of K-tile ``kt``.

    128x4 layouts are read as int32 words (the 4 codes of scale columns 4j..4j+3 of a row are
    one aligned word), so the load is wide enough for cp.async and gets software-pipelined.
    """
    c = kt * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    if LAYOUT == 2:
        return tl.load(s_base + c[None, :]).to(tl.int32)
    else:
        words = tl.load(s_base + ((c // 4) * 128)[None, :])
        return (words >> (8 * (c % 4))[None, :]) & 0xFF


@triton.jit
def _dequant_weight(w, code, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr):
    """e4m3 [BN, BK] and int32 codes [BN, BK/32] -> exact ``w * 2^(code-127)`` (bf16 or fp32)."""
    if DOT_BF16:
        sc = tl.where(code == 0, 0x40, code << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        wd = w.to(tl.bfloat16)
    else:
        sc = _pow2_f32(code)
        wd = w.to(tl.float32)
    wd = tl.reshape(wd, (BLOCK_N, BLOCK_K // 32, 32)) * sc[:, :, None]
    return tl.reshape(wd, (BLOCK_N, BLOCK_K))


@triton.jit
def _tile_ids(N, M, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr):
    """(pid_n, pid_m): GROUP_N weight tiles walk down M together, so both operands hit L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_N * num_m
    first_n = (pid // width) * GROUP_N
    group = tl.minimum(tl.cdiv(N, BLOCK_N) - first_n, GROUP_N)
    return first_n + (pid % width) % group, (pid % width) // group


@triton.jit(do_not_specialize=["M", "split_k"])
def _mxfp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, scale_c, scale_cp4, split_k,
    LAYOUT: tl.constexpr, QUANT_X: tl.constexpr, DOT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_IN_REGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, SERIAL: tl.constexpr, GROUP_N: tl.constexpr,
):
    """out[M, N] (or split-K fp32 partials) of fq(x) @ dq(W).T on laid-out W bytes.

    W_IN_REGS: compute acc^T = W_tile @ A_tile^T so the dequantized weight is the MMA's register
    operand; otherwise acc = A_tile @ W_tile^T with the dequantized weight staged in shared memory.
    """
    pid_n, pid_m = _tile_ids(N, M, BLOCK_N, BLOCK_M, GROUP_N)
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = tl.program_id(1) * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)  # clamp the tail: loads stay in bounds, stores are masked
    rows_n = rows  # logical output column of each tile row (clamped), for the bias
    if LAYOUT == 1:  # gather: logical row l lives at physical row 32*(l//32) + 8*(l%4) + (l%32)//4
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
    cols = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_base = s_ptr + _scale_row_base(rows, scale_c, scale_cp4, LAYOUT)[:, None]
    if W_IN_REGS:
        x_ptrs = x_ptr + cols[None, :] * stride_xm + offs_k[:, None]  # A^T tile [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + cols[:, None] * stride_xm + offs_k[None, :]  # A tile [BM, BK]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for kt in range(kt0, kt1):
        w = tl.load(w_ptrs + kt * BLOCK_K)
        wd = _dequant_weight(w, _load_codes(s_base, kt, BLOCK_K, LAYOUT), BLOCK_N, BLOCK_K, DOT_BF16)
        xa = tl.load(x_ptrs + kt * BLOCK_K)
        if W_IN_REGS:
            if QUANT_X:
                deq, _r, _c = _mx_fake_quant(tl.reshape(xa.to(tl.float32), (BLOCK_K // 32, 32, BLOCK_M)), 1)
                xa = tl.reshape(deq, (BLOCK_K, BLOCK_M))
            if DOT_BF16:
                acc = tl.dot(wd, xa.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(wd, xa.to(tl.float32), acc, input_precision="ieee")
        else:
            if QUANT_X:
                deq, _r, _c = _mx_fake_quant(tl.reshape(xa.to(tl.float32), (BLOCK_M, BLOCK_K // 32, 32)), 2)
                xa = tl.reshape(deq, (BLOCK_M, BLOCK_K))
            if DOT_BF16:
                acc = tl.dot(xa.to(tl.bfloat16), tl.trans(wd), acc)
            else:
                acc = tl.dot(xa.to(tl.float32), tl.trans(wd), acc, input_precision="ieee")

    if W_IN_REGS:
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
        res = tl.trans(acc)
    else:
        if HAS_BIAS and not PARTIAL:
            acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
        res = acc
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if not PARTIAL:
        tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * stride_os + out_off, res, mask=mask)
        if SERIAL:  # the last split of this tile to arrive sums the partials: no second launch
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, split_k):
                    total += tl.load(ws_ptr + s * stride_os + out_off, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
                tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)  # re-arm for the next call


@triton.jit(do_not_specialize=["total", "stride_ps", "split_k"])
def _splitk_reduce_kernel(p_ptr, b_ptr, out_ptr, N, total, stride_ps, split_k,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in range(1, split_k):
        acc += tl.load(p_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile shape and launch parameters of one GEMM call (``block_n`` = weight rows per tile)."""

    block_n: int
    block_m: int
    block_k: int
    split_k: int = 1
    fuse_quant: bool = True
    num_warps: int = 4
    num_stages: int = 3
    group_n: int = 8
    w_in_regs: bool = True
    serial_reduce: bool = False  # split-K: the last CTA of a tile sums the partials (one launch)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _fit_block_k(k: int, want: int) -> int:
    """Largest of ``want, want/2, ..., 32`` dividing ``k`` (K % 32 == 0 is checked earlier)."""
    bk = want
    while k % bk:
        bk //= 2
    return bk


#: Below this many weight elements a decode GEMM runs as one kernel (activation quantization
#: fused, split-K reduced by the last CTA); above it, three (quantize, GEMM, reduce) are faster.
SMALL_WEIGHT = 40_000_000


def _pow2_split(tiles: int, k_tiles: int, target: int, min_k_tiles: int) -> int:
    """Smallest power-of-two split-K with ``tiles * split >= target`` (each split >= min_k_tiles)."""
    split = 1
    while tiles * split < target and k_tiles // (split * 2) >= min_k_tiles:
        split *= 2
    return split


def _wave_eff(ctas: int, sms: int) -> float:
    return ctas / (triton.cdiv(ctas, sms) * sms)


def choose_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Tile choice by M bucket; rules fitted to a sweep on one H200 (benchmarks/NOTES_gemm.md).

    - M <= 64 (decode): a weight stream. 64-row weight tiles, split-K up to ~2 CTAs per SM for
      small weights (< 40 M elements: one kernel, activations quantized inside the GEMM, the last
      CTA of each tile reduces the splits) and ~4 per SM for large ones (separate quantize and
      reduce kernels, which then cost less than the fused quantization's ALU work).
    - M <= 1024: 128x128 tiles (64x64 when N <= 2048), split-K while < half the SMs are busy.
    - larger: 128x256x64 tiles, 8 warps; split-K=2 when it fixes a poor last wave.
    """
    sms = _num_sms(device)
    small = n * k < SMALL_WEIGHT
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        cfg = GemmConfig(64, bm, _fit_block_k(k, 128), fuse_quant=small and m <= 16,
                         num_warps=4, num_stages=4, serial_reduce=small)
        tiles = triton.cdiv(n, 64) * triton.cdiv(m, bm)
        target = int(1.9 * sms) if small else 4 * sms
        return dataclasses.replace(cfg, split_k=_pow2_split(tiles, k // cfg.block_k, target, 2))
    if m <= 1024:
        if n <= 2048:
            cfg = GemmConfig(64, 64, _fit_block_k(k, 128), fuse_quant=False, num_warps=4, num_stages=4)
        else:
            cfg = GemmConfig(128, 128, _fit_block_k(k, 64), fuse_quant=False, num_warps=8, num_stages=4)
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        return dataclasses.replace(cfg, split_k=_pow2_split(tiles, k // cfg.block_k, sms // 2, 4),
                                   serial_reduce=False)
    cfg = GemmConfig(128, 256, _fit_block_k(k, 64), fuse_quant=False, num_warps=8,
                     num_stages=4 if m <= 4096 else 3, serial_reduce=False)
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, 256)
    if _wave_eff(2 * tiles, sms) > _wave_eff(tiles, sms) + 0.1 and k // 2 >= 2048:
        cfg = dataclasses.replace(cfg, split_k=2)
    return cfg


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if not interpreting():
        raise LayoutError(
            f"the triton engine needs CUDA tensors (got {t.device}); "
            "on CPU use engine='reference' or set TRITON_INTERPRET=1 before importing triton"
        )


def quantize_activations(
    x: torch.Tensor, *, dequantized: bool = True, codes: bool = False, block_m: int = 32,
    block_k: int = 128,
) -> dict[str, torch.Tensor]:
    """Quantize ``x [M, K]`` to MXFP8 (FlashInfer's recipe) with one Triton kernel.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 with unit stride along K, ``K % 32 == 0``.
        dequantized: also return ``"deq"``: ``q * 2^(code-127)`` as bf16 ``[M, K]`` (exact);
            float32 under the interpreter.
        codes: also return ``"q"`` (float8_e4m3fn ``[M, K]``) and ``"code"`` (uint8 ``[M, K/32]``,
            linear).
        block_m, block_k: tile of one program.

    Returns:
        dict with the requested tensors.
    """
    _check_device(x)
    m, k = x.shape
    if k % 32 or x.stride(1) != 1:
        raise LayoutError(f"activations must be [M, K] with K % 32 == 0 and unit K stride, got {list(x.shape)}")
    out: dict[str, torch.Tensor] = {}
    deq_dtype = torch.float32 if x.device.type == "cpu" else torch.bfloat16
    deq = torch.empty((m, k), dtype=deq_dtype, device=x.device) if dequantized else x
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device) if codes else x
    code = torch.empty((m, k // 32), dtype=torch.uint8, device=x.device) if codes else x
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    _quantize_kernel[grid](x, deq, q, code, m, k, x.stride(0), WRITE_DEQ=dequantized,
                           WRITE_Q=codes, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)
    if dequantized:
        out["deq"] = deq
    if codes:
        out["q"] = q.view(torch.float8_e4m3fn)
        out["code"] = code
    return out


_LOCKS: dict[torch.device, torch.Tensor] = {}


def _tile_locks(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 arrival counters of the serial split-K reduction, zero between calls.

    Each counter is reset by the CTA that finishes its tile, so the buffer is allocated (zeroed)
    once and reused; grow it before capturing a CUDA graph. Calls that run concurrently on two
    streams of one device must not share it: use ``serial_reduce=False`` there.
    """
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


def _scale_operand(weight: MXFP8Weight) -> torch.Tensor:
    """The scale bytes as the kernel reads them: int32 words for 128x4 tiles, else uint8."""
    s = weight.scale
    if weight.layout == CANONICAL:
        return s
    if not s.is_contiguous() or s.data_ptr() % 4:
        raise LayoutError(f"{weight.name or 'weight'}: 128x4 scale tiles must be contiguous and 4-byte aligned")
    return s.view(torch.int32)


def _scale_geometry(weight: MXFP8Weight) -> tuple[int, int]:
    """(C, Cp/4) of the weight's scale buffer: linear columns and 128x4 column tiles."""
    n, k = weight.shape
    c = k // 32
    return c, (c + 3) // 4


def triton_linear(
    x: torch.Tensor,
    weight: MXFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``bf16(fq(x) @ dq(W).T + bias)`` on the laid-out bytes of ``weight``.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 activations (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        weight: trtllm, cutlass or canonical :class:`MXFP8Weight` on the same device.
        bias: optional ``[N]``, added in fp32 before the rounding to bf16.
        out: optional contiguous bf16 ``[M, N]`` to write into.
        config: tile choice; :func:`choose_config` when omitted.

    Returns:
        bf16 ``[M, N]`` (``out`` when given).
    """
    _check_device(x)
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise LayoutError(f"{weight.name or 'weight'}: input has K={k}, weight has K={kw}")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise LayoutError(f"out must be a contiguous bf16 [{m}, {n}] tensor")
    if m == 0:
        return out
    if x.device.type == "cpu":  # interpreter: its fp32->bf16 cast truncates; round on the host
        out.copy_(_launch(x, weight, bias, torch.empty((m, n), device=x.device), config))
        return out
    return _launch(x, weight, bias, out, config)


def _launch(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    config: GemmConfig | None,
) -> torch.Tensor:
    """Run the quantize (large M), GEMM and split-K reduce kernels into ``out`` [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or choose_config(m, n, k, x.device)
    if k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} does not divide K={k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    a = x if cfg.fuse_quant else quantize_activations(x)["deq"]
    c, cp4 = _scale_geometry(weight)
    has_bias = bias is not None
    bias_t = bias if has_bias else out
    partial = cfg.split_k > 1
    serial = partial and cfg.serial_reduce
    ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if partial else out
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    lock = _tile_locks(x.device, tiles) if serial else ws
    _mxfp8_gemm_kernel[(tiles, cfg.split_k)](
        a, weight.data, _scale_operand(weight), bias_t, out, ws, lock,
        m, n, k, a.stride(0), weight.data.stride(0), n, m * n, c, cp4, cfg.split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], QUANT_X=cfg.fuse_quant, W_IN_REGS=cfg.w_in_regs,
        DOT_BF16=x.device.type == "cuda", HAS_BIAS=has_bias,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        PARTIAL=partial, SERIAL=serial, GROUP_N=cfg.group_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if partial and not serial:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias_t, out, n, m * n, m * n, cfg.split_k,
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )
    return out
