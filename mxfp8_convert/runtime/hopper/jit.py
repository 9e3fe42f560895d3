"""Triton JIT helpers shared by every kernel of this package (the Gluon kernel too).

Scalar helpers work elementwise on fp32 / int32 tensors. Rounding to e4m3 (ties to even) is
done by the GPU's conversion instruction where the kernel is told so (``HW_ROUND``, from
``probe.e4m3_conversion``: compute capability 8.9 and later), else in fp32 arithmetic (the
magic-number trick, ``_round_e4m3``), which is bit-exact on every device and in Triton's
interpreter, whose float8/bf16 casts do not round ties to even. The address
helpers read the laid-out weight in place: for trtllm, logical row ``l`` lives at physical row
``32*(l//32) + 8*(l%4) + (l%32)//4`` (the inverse of the P32 shuffle, docs/FORMAT.md), its scale
at the 128x4 offset of that *physical* row.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch: Triton releases without it get the wgmma path without PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None

from mxfp8_convert.runtime.weight import CANONICAL

#: Every launch of this package's kernels passes ``enable_fp_fusion`` explicitly: Triton 3.9 warns
#: that its default (fusing a * b + c into one FMA) changes in 3.10; the kernels were validated and
#: tuned with fusion on, and pinning the same value leaves their SASS unchanged.
FP_FUSION = True

#: Kernel code of each weight layout (constexpr LAYOUT).
LAYOUT_CODE = {"cutlass": 0, "trtllm": 1, CANONICAL: 2}
_INV_448 = tl.constexpr(
    1.0 / 448.0
)  # rounds to fl32(1/448) in fp32 math, as FlashInfer's host code


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
    """fp32 ``2^(e_field - 127)`` for e_field in 0..254 (0 gives the subnormal 2^-127; -1 too, 255
    +inf). One max: ``e_field << 23`` is <= 0 exactly where e_field <= 0."""
    bits = tl.maximum(e_field << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
    """Round fp32 ``y`` to the nearest e4m3 value (ties to even), saturating at +-448; NaN stays
    NaN. The same values as the GPU's ``cvt.rn.satfinite.e4m3x2.f32``.

    Adding ``1.5 * 2^(e+20)`` (e = binade of |y|, at least -6 for subnormals) leaves exactly the
    e4m3 ulp ``2^(e-3)`` as the fp32 ulp of the sum, so fp32's RNE add does the rounding.
    """
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # the sign bit alone
    a = tl.minimum(tl.abs(y), 448.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((147 + e) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(y == y, (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True), y)


@triton.jit
def _e4m3_byte(r):
    """uint8 e4m3fn encoding of an fp32 value that is exactly representable in e4m3, or NaN
    (0x7F, sign kept)."""
    bits = r.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    mag = tl.where(
        ex >= 121, ((ex - 120) << 3) | ((bits >> 20) & 0x7), (tl.abs(r) * 512.0).to(tl.int32)
    )
    mag = tl.where(r == r, mag, 0x7F)
    return (mag | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _e4m3_bytes(y, HW_ROUND: tl.constexpr):
    """uint8 e4m3fn bytes of fp32 ``y`` rounded to nearest (ties to even), saturating at +-448:
    by the GPU's conversion (``cvt.rn.satfinite.e4m3x2.f32``, two elements an instruction) where
    ``HW_ROUND`` (``probe.e4m3_conversion``), else in fp32 arithmetic (Triton's interpreter, whose
    float8 cast does not round ties to even)."""
    if HW_ROUND:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return _e4m3_byte(_round_e4m3(y))


@triton.jit
def _mx_fake_quant(xf, AXIS: tl.constexpr, HW_ROUND: tl.constexpr = False):
    """Quantize-dequantize fp32 ``xf`` whose 32-blocks run along ``AXIS`` of a 3-D tensor.

    Returns ``(deq, r, code)``: exact fp32 ``q * 2^(code-127)``, the e4m3 values ``q`` (fp32) and
    the int32 codes (``AXIS`` reduced away). ``HW_ROUND``: rounded by the GPU's conversion
    (``_e4m3_bytes``), the same values.
    """
    code = _ue8m0_code(tl.max(tl.abs(xf), axis=AXIS))
    inv = tl.expand_dims(_pow2_f32(254 - code), AXIS)  # 2^(127-code)
    if HW_ROUND:
        r = (xf * inv).to(tl.float8e4nv).to(tl.float32)
    else:
        r = _round_e4m3(xf * inv)
    deq = r * tl.expand_dims(_pow2_f32(code), AXIS)
    return deq, r, code



@triton.jit
def _physical_rows(rows, LAYOUT: tl.constexpr):
    """Physical rows of logical weight rows ``rows``: trtllm (LAYOUT 1, ``shuffle_matrix_a``)
    stores logical row l at 32*(l//32) + 8*(l%4) + (l%32)//4; the other layouts as they are."""
    if LAYOUT == 1:
        rows = (rows // 32) * 32 + 8 * (rows % 4) + (rows % 32) // 4
    return rows


@triton.jit
def _scale_row_base(rows, scale_c, scale_cp4, LAYOUT: tl.constexpr):
    """Offset of (physical row, scale column 0): in bytes (canonical) or int32 words (128x4)."""
    if LAYOUT == 2:  # canonical: linear uint8 [N, C]
        return rows.to(tl.int64) * scale_c
    else:  # 128x4 byte offset (r//128)*(Cp/4)*512 + (r%32)*16 + ((r%128)//32)*4, in words
        return (rows // 128).to(tl.int64) * (scale_cp4 * 128) + (rows % 32) * 4 + (rows % 128) // 32


@triton.jit
def _p32_logical(rows):
    """The logical rows held by physical rows ``rows`` of a trtllm weight: physical row p holds
    logical row ``32*(p//32) + 4*(q%8) + q//8``, q = p % 32 (the inverse of the gather
    ``32*(l//32) + 8*(l%4) + (l%32)//4`` in the module docstring; the P32 shuffle stays within
    32-row groups)."""
    q = rows % 32
    return rows - q + 4 * (q % 8) + q // 8


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

