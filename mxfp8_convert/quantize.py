"""MXFP8 quantization math: FlashInfer's quantize recipe, dequantize, FP8 sources, error metrics.

Pure tensor math on CPU or CUDA alike: no disk, no logging, no FlashInfer import. Big tensors
are processed in row chunks, so the extra memory a call needs is a small multiple of one chunk
(a few float32 copies of it; two float64 copies more where the error is reported), never of the
whole tensor; ``chunk_rows=None`` picks chunks of about ``2**20`` elements. A chunk is also the
unit the error's float64 sums are accumulated over. (Smaller, cache-sized pieces were slower on
CPU: torch's per-call cost outweighed the cache misses, 3.3 vs 3.0 ns per element at 2**18.)
On CPU a chunk's working buffers are the calling thread's (``_buffers.Scratch``): they serve
every chunk of a call and go when it returns, or serve call after call inside
``reusing_buffers()``; a conversion keeps them for its threads from module to module.

MXFP8 (docs/LAYOUTS.md section 1): ``float8_e4m3fn`` values, one UE8M0 scale byte ``b`` per 1x32
block along K meaning ``2^(b-127)``; ``b = 255`` is NaN. The quantizer reproduces FlashInfer
0.7.2.post1's host reference ``mxfp8_quantize_host`` (``csrc/nv_internal/tensorrt_llm/thop/
fp8Quantize.cpp``) bit for bit, so a converted checkpoint carries exactly the bytes FlashInfer
would have produced from the same high-precision weights.

On CPU the quantizing passes run in the optional C accelerator ``_cquant.c`` where it is built
(``pip install`` compiles it where a C compiler exists; ``MXFP8_CONVERT_NO_C=1`` turns it off):
one pass per chunk instead of torch's dozen, the same bytes and the same float64 error sums
(tests/test_cquant.py). The torch code below is the fallback and the definition.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from mxfp8_convert._buffers import SCRATCH as _SCRATCH
from mxfp8_convert.errors import LayoutError

MX_BLOCK = 32  # elements per UE8M0 scale, along K
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
UE8M0_BIAS = 127
UE8M0_MAX_CODE = 254  # 255 is NaN
UE8M0_NAN = 255
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# fl32(1/448), the constant the reference multiplies by (``1.f / 448.0f``); not a division.
_INV_E4M3_MAX = (torch.tensor(1.0, dtype=torch.float32) / E4M3_MAX).item()
_CHUNK_ELEMENTS = 1 << 20  # elements per chunk, the unit of the error sums (their rounding)
#: largest UE8M0 code whose dequantized values ``|q| * 2^(code-127) < 2^9 * 2^(code-127)``
#: stay finite in float32 (< 2^128); above it the error is computed in float64 throughout
_F32_EXACT_MAX_CODE = 246
_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1
_F32_HALF_MANTISSA = 1 << 22  # mantissa of 2^-127 (fp32 subnormal)


def _load_cquant():
    """The optional C accelerator (``_cquant.c``, built by ``pip install`` where a compiler is
    found), or None: not built, built from other source (its ``VERSION``), or turned off with
    ``MXFP8_CONVERT_NO_C=1`` (read once, at import). Either way the bytes are the same."""
    if os.environ.get("MXFP8_CONVERT_NO_C", "") not in ("", "0"):
        return None
    try:
        import mxfp8_convert._cquant as _cquant  # a leaf: imports nothing of the package
    except ImportError:
        return None
    return _cquant if getattr(_cquant, "VERSION", None) == 2 else None


_CQUANT = _load_cquant()
#: ``_cquant.quantize``'s source kinds
_C_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3}


@dataclass(frozen=True, slots=True)
class QuantError:
    """How far a dequantized MXFP8 tensor is from its reference.

    ``rel_fro = ||deq - ref||_F / ||ref||_F`` (0 when both are zero, inf when only ref is) and
    ``sqnr_db = 10 log10(||ref||^2 / ||deq - ref||^2)`` (inf when exact, -inf when ref is zero
    and deq is not).
    """

    rel_fro: float
    sqnr_db: float

    def to_dict(self) -> dict[str, float | None]:
        """JSON-safe (RFC 8259 has no infinities): a non-finite value is ``None``, so an exact
        module (``rel_fro`` 0) has ``sqnr_db: null`` (docs/FORMAT.md section 1a)."""
        return {"rel_fro": _finite(self.rel_fro), "sqnr_db": _finite(self.sqnr_db)}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass(frozen=True, slots=True)
class MXFP8Result:
    """An FP8 source tensor converted to MXFP8.

    Attributes:
        q: ``float8_e4m3fn [N, K]``; on the lossless path this is the source tensor itself.
        s: ``uint8 [N, K/32]`` UE8M0 scale codes, linear (row-major) layout.
        lossless: True when the source bytes were kept and its scales mapped exactly.
        error: None when lossless, else the requantization error against the source's
            dequantized float32 values.
    """

    q: torch.Tensor
    s: torch.Tensor
    lossless: bool
    error: QuantError | None

    def __post_init__(self) -> None:
        if self.q.dim() != 2:
            raise LayoutError(f"MXFP8Result needs a 2-D q, got shape {list(self.q.shape)}")
        if self.q.dtype != torch.float8_e4m3fn or self.s.dtype != torch.uint8:
            raise LayoutError(
                f"MXFP8Result needs e4m3 q and uint8 s, got {self.q.dtype} and {self.s.dtype}"
            )
        n, k = self.q.shape
        if tuple(self.s.shape) != (n, k // MX_BLOCK):
            raise LayoutError(
                f"MXFP8Result scale shape {list(self.s.shape)} does not fit q {[n, k]}"
            )
        if self.lossless != (self.error is None):
            raise LayoutError("MXFP8Result carries an error exactly when it is not lossless")

    def to_dict(self) -> dict:
        return {
            "shape": list(self.q.shape),
            "lossless": self.lossless,
            "error": None if self.error is None else self.error.to_dict(),
        }


# --- small helpers --------------------------------------------------------------------------


def reusing_buffers() -> AbstractContextManager[None]:
    """A block inside which this thread's working buffers (about 30 MiB on CPU) serve call
    after call, released at its end: for a caller quantizing many tensors in a row. Outside
    one, each call releases the buffers it filled as it returns; a conversion holds them for
    its threads from module to module."""
    return _SCRATCH.kept()


def _empty_output(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized output tensor; on CPU from numpy, whose large allocations Linux backs
    with transparent huge pages (numpy asks with ``madvise``), so that writing a module's bytes
    takes one page fault per 2 MiB instead of one per 4 KiB."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.empty(n, dtype=np.uint8)).view(dtype).view(shape)


def _row_chunks(n: int, k: int, chunk_rows: int | None) -> Iterator[tuple[int, int]]:
    """Yield ``(r0, r1)`` row ranges covering ``[0, n)``."""
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    if chunk_rows < 1:
        raise LayoutError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for r0 in range(0, n, chunk_rows):
        yield r0, min(n, r0 + chunk_rows)


def _first_true(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True in ``mask`` (error paths only)."""
    flat = int(mask.flatten().nonzero()[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def _check_matrix(x: torch.Tensor, name: str, what: str = "tensor") -> tuple[int, int]:
    """Require a 2-D ``[N, K]`` tensor with ``K % 32 == 0``; return ``(N, K)``."""
    if x.dim() != 2:
        raise LayoutError(f"{name}: MXFP8 needs a 2-D [N, K] {what}, got shape {list(x.shape)}")
    n, k = x.shape
    if k % MX_BLOCK:
        raise LayoutError(
            f"{name}: K = {k} is not a multiple of 32, so it cannot be split into MXFP8 1x32 "
            "blocks",
            hint="keep this tensor in its source precision (add it to the ignore list)",
        )
    return n, k


def _exp2_f32(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2^e`` for int32 ``e`` in ``[-127, 127]``, built from its bits.

    ``2^-127`` is an fp32 subnormal (mantissa ``1 << 22``); bits avoid any library ``exp2``.
    """
    bits = torch.where(
        e > -127,
        (e + 127).bitwise_left_shift(_F32_MANTISSA_BITS),
        torch.full_like(e, _F32_HALF_MANTISSA),
    )
    return bits.to(torch.int32).view(torch.float32)


def _scale_f64(codes: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2^(code-127)`` for UE8M0 codes 0..254 (always a normal float64)."""
    e = codes.to(torch.int64) - UE8M0_BIAS + 1023
    return e.bitwise_left_shift(52).view(torch.float64)


def _as_codes(s: torch.Tensor, name: str) -> torch.Tensor:
    """View a UE8M0 scale tensor (uint8 or float8_e8m0fnu) as uint8 codes."""
    if s.dtype == torch.uint8:
        return s
    if s.dtype == getattr(torch, "float8_e8m0fnu", None):
        return s.view(torch.uint8)
    raise LayoutError(f"{name}: MXFP8 scales must be uint8 or float8_e8m0fnu, got {s.dtype}")


def _as_e4m3(q: torch.Tensor, name: str) -> torch.Tensor:
    if q.dtype == torch.float8_e4m3fn:
        return q
    if q.dtype == torch.uint8:
        return q.view(torch.float8_e4m3fn)
    raise LayoutError(
        f"{name}: MXFP8 values must be float8_e4m3fn (or its uint8 bytes), got {q.dtype}"
    )


def _non_finite(x: torch.Tensor) -> torch.Tensor:
    """Boolean mask of NaN/Inf elements."""
    if x.dtype == torch.float8_e4m3fn:  # no Inf; NaN is S.1111.111. Bytes beat a float copy.
        return x.view(torch.uint8).bitwise_and(0x7F) == 0x7F
    return ~torch.isfinite(x.float())


def check_finite(x: torch.Tensor, name: str, *, chunk_rows: int | None = None) -> None:
    """Raise if a floating tensor (any float dtype, float8 included) holds a NaN or Inf.

    Args:
        x: floating tensor of any shape; checked in chunks of its first dimension.
        name: tensor name for the message.
        chunk_rows: first-dimension rows per chunk (None: about 2**20 elements).

    Raises:
        LayoutError: naming the tensor and the index of the first non-finite element.
    """
    if not x.is_floating_point():
        raise LayoutError(f"{name}: expected a floating tensor, got {x.dtype}")
    if x.dim() == 0:
        x = x.reshape(1)
    row = max(1, x[0].numel()) if x.shape[0] else 1
    for r0, r1 in _row_chunks(x.shape[0], row, chunk_rows):
        bad = _non_finite(x[r0:r1])
        if bad.any():
            idx = _first_true(bad)
            idx = (idx[0] + r0, *idx[1:])
            raise LayoutError(
                f"{name}: non-finite value {x[idx].item()} at index {list(idx)}",
                hint="the source tensor is corrupt or overflowed; fix it before converting",
            )


# --- the FlashInfer recipe ------------------------------------------------------------------


def _ue8m0_ceil_codes(scaled: torch.Tensor) -> torch.Tensor:
    """``float_to_ue8m0`` of fp8Quantize.cpp on a finite, non-negative float32 tensor.

    Code = the exponent of ``scaled`` rounded up to a power of two: +1 when any mantissa bit is
    set, except at exponent 0xFE (the clamp to 254) and for subnormals ``<= 2^-127`` (code 0
    already means ``2^-127``). The reference's explicit ``value == 0 -> 0`` falls out of the
    same bits (exponent 0, mantissa 0), for ``-0.0`` too since the sign bit is masked off.
    """
    bits = scaled.view(torch.int32)
    exponent = bits.bitwise_right_shift(_F32_MANTISSA_BITS).bitwise_and(0xFF)
    mantissa = bits.bitwise_and(_F32_MANTISSA_MASK)
    round_up = (mantissa > 0) & (exponent != UE8M0_MAX_CODE)
    round_up &= ~((exponent == 0) & (mantissa <= _F32_HALF_MANTISSA))
    return exponent + round_up.to(exponent.dtype)


def _quantize_chunk(
    xf: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, name: str, row0: int
) -> torch.Tensor:
    """Quantize float32 rows ``xf [n, K]`` into ``q_out [n, K]`` (e4m3) and ``s_out [n, K/32]``;
    return the codes (int32 ``[n, K/32]``)."""
    n, k = xf.shape
    scratch = _SCRATCH.get("scaled", n * k, torch.float32, xf.device)
    blocks = xf.reshape(n, k // MX_BLOCK, MX_BLOCK)
    # amax and amin, not aminmax or |x|: these two vectorize along a block's 32 values (aminmax
    # over the last dimension does not, |x| is a full-size copy). NaN propagates through both.
    amax = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg_())
    if not torch.isfinite(amax).all():
        r, c = _first_true(~torch.isfinite(amax))
        col = c * MX_BLOCK + int((~torch.isfinite(blocks[r, c])).nonzero()[0])
        raise LayoutError(
            f"{name}: non-finite value {xf[r, col].item()} at row {row0 + r}, column {col}; "
            "MXFP8 cannot encode NaN or Inf",
            hint="the source tensor is corrupt or overflowed; fix it before converting",
        )
    codes = _ue8m0_ceil_codes(amax.mul_(_INV_E4M3_MAX))  # one fp32 multiply, as the reference
    # Reference: inv_scale = (code == 0) ? 1 : exp2f(127 - code). Code 0 keeps x unscaled,
    # so its (tiny) values round to +-0 in e4m3.
    inv = torch.where(codes == 0, torch.ones_like(amax), _exp2_f32(UE8M0_BIAS - codes))
    scaled = torch.mul(blocks, inv.unsqueeze(-1), out=scratch.view(n, k // MX_BLOCK, MX_BLOCK))
    # cutlass' host float_e4m3_t(float) is round-nearest-even with satfinite; torch's cast is
    # RNE but turns |x| >= 480 into NaN, so saturate first: then the two agree on every non-NaN
    # fp32 (checked exhaustively over all 2^32 bit patterns). With the ceil rule above the clamp
    # never binds (|scaled| <= 448 * (1 + 2^-23), which rounds to 448); it is a cheap guard that
    # keeps the cast saturating if the scale rule ever changes.
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)
    q_out.view(n, k // MX_BLOCK, MX_BLOCK).copy_(scaled)
    s_out.copy_(codes)
    return codes


def _e4m3_pair_table() -> np.ndarray:
    """The float32 values of every pair of e4m3 bytes, indexed by the pair read as a native
    uint16, each entry the two float32 as one uint64 (65536 entries, 512 KiB). Looking values up
    two at a time is ~10x faster than torch's float8 -> float32 cast on CPU (0.9 vs 8.9 ns per
    byte; one byte at a time, 1.6 ns)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    pairs = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(values[pairs]).view(np.uint64).reshape(-1)


_E4M3_PAIRS_F32 = _e4m3_pair_table()
#: the same table as int64 entries for ``torch.index_select``, which, unlike ``np.take``, runs
#: without the GIL, so two modules quantized on two threads look their values up side by side
_E4M3_PAIRS_T = torch.from_numpy(_E4M3_PAIRS_F32.view(np.int64))


def _residual_f32(xf: torch.Tensor, q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``dequantize(q) - xf`` in float32 for what :func:`_quantize_chunk` made of ``xf``: exact,
    that is the float64 difference, when every code is at most ``_F32_EXACT_MAX_CODE``.

    Why exact: ``deq = q * 2^(code-127)`` has q's 4 significant bits and a lowest bit of at least
    ``2^(code-136) >= 2^-136`` (float32 reaches ``2^-149``), and is below ``2^128`` for such
    codes, so float32 holds it. ``q`` is ``x * 2^(127-code)`` rounded to nearest e4m3; scaling
    by a power of two keeps ratios, so either ``q = 0`` (then the difference is ``-x``) or ``deq``
    and ``x`` have one sign and lie within a factor of 2 of each other (e4m3's smallest value
    ``2^-9`` comes from ``(2^-10, 1.5 * 2^-9]``; saturation is at 448): Sterbenz's lemma, which
    holds with float32's subnormals, makes ``deq - x`` exact. Code 0 blocks are all +-0 (their
    values are below ``2^-118``).
    """
    n, k = xf.shape
    if q.device.type == "cpu":  # pairs of bytes as native uint16 (int16 widened, masked)
        pairs = _SCRATCH.get("pairs", n * k // 2, torch.int32, q.device)
        pairs.copy_(q.reshape(-1, 2).view(torch.int16).reshape(-1)).bitwise_and_(0xFFFF)
        deq = _SCRATCH.get("deq", n * k // 2, torch.int64, q.device)
        torch.index_select(_E4M3_PAIRS_T, 0, pairs, out=deq)
        deq = deq.view(torch.float32).view(n, k)
    else:
        deq = q.to(torch.float32)
    deq.view(n, k // MX_BLOCK, MX_BLOCK).mul_(_exp2_f32(codes - UE8M0_BIAS).unsqueeze(-1))
    return deq.sub_(xf)


def _quantize_rows(
    rows: Callable[[int, int], torch.Tensor],
    shape: tuple[int, int],
    device: torch.device,
    name: str,
    chunk_rows: int | None,
    measure: bool,
    source: torch.Tensor | None = None,
    e4m3: tuple[torch.Tensor, Callable[[int, int], torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize the ``[N, K]`` float32 values ``rows(r0, r1)`` gives (rows ``r0:r1``) chunk by
    chunk; with ``measure``, also ``[sum (deq - x)^2, sum x^2]`` in float64.

    The sums are the float64 dot products of each chunk's differences and reference values,
    added chunk after chunk, exactly as :func:`quantization_error` computes them: the
    differences come exact from float32 (:func:`_residual_f32`), or, for a chunk with a code
    above ``_F32_EXACT_MAX_CODE``, from the float64 dequantization itself. ``source``, where
    given, holds those values exactly (bf16, fp16 or the float32 themselves: the widening is
    exact), and the float64 reference is widened from it, reading fewer bytes.
    ``e4m3``, for the C accelerator only, is an FP8 source ``(w, multipliers)`` whose values
    ``rows`` computes as ``fl32(w) * m`` with one float32 ``m`` per 1x32 block
    (``multipliers(r0, r1)``, ``[r1 - r0, K/32]``): the accelerator does that multiply itself.

    With the C accelerator (CPU only), one pass of :func:`_c_chunk` per chunk writes the same
    bytes and the same float64 vectors, which go to the same ``torch.dot`` calls; a chunk it
    gives back (a NaN or Inf, whose message the torch path raises, or a code above the float32
    limit) runs the torch path instead.
    """
    n, k = shape
    q = _empty_output((n, k), torch.float8_e4m3fn, device)
    s = _empty_output((n, k // MX_BLOCK), torch.uint8, device)
    sums = torch.zeros(2, dtype=torch.float64, device=device) if measure else None
    native = _CQUANT is not None and device.type == "cpu"
    if native and measure:
        # MKL's dot sums in an order that depends on its thread count, which a thread takes
        # from torch's setting on its first parallel torch op (lazily). The torch path runs
        # such ops before its first dot; the C path does not, so it asks torch now, which sets
        # this thread's count the same way (else a fresh thread's dots use every core).
        torch.get_num_threads()
    with _SCRATCH.kept():  # the buffers serve every chunk (and, where held, every call)
        for r0, r1 in _row_chunks(n, k, chunk_rows) if n * k else ():
            if native:
                d = r = None
                if measure:
                    d = _SCRATCH.get("diff64", (r1 - r0) * k, torch.float64, device)
                    r = _SCRATCH.get("ref64", (r1 - r0) * k, torch.float64, device)
                if e4m3 is not None:
                    top = _c_chunk(e4m3[0][r0:r1], q[r0:r1], s[r0:r1], d, r, e4m3[1](r0, r1))
                else:
                    x = rows(r0, r1) if source is None else source[r0:r1]
                    top = _c_chunk(x, q[r0:r1], s[r0:r1], d, r)
                if top >= 0 and not measure:
                    continue
                if 0 <= top <= _F32_EXACT_MAX_CODE:
                    sums += torch.stack([torch.dot(d, d), torch.dot(r, r)])
                    continue
            xf = rows(r0, r1)
            codes = _quantize_chunk(xf, q[r0:r1], s[r0:r1], name, r0)
            if not measure:
                continue
            if int(codes.max()) > _F32_EXACT_MAX_CODE:
                sums += _error_sums(xf, q[r0:r1], s[r0:r1], name, r0)
                continue
            d = _SCRATCH.get("diff64", xf.numel(), torch.float64, device)
            r = _SCRATCH.get("ref64", xf.numel(), torch.float64, device)
            d.view(r1 - r0, k).copy_(_residual_f32(xf, q[r0:r1], codes))
            r.view(r1 - r0, k).copy_(xf if source is None else source[r0:r1])
            sums += torch.stack([torch.dot(d, d), torch.dot(r, r)])
    return q, s, sums


def _c_chunk(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    diff: torch.Tensor | None,
    ref: torch.Tensor | None,
    mult: torch.Tensor | None = None,
) -> int:
    """``_cquant.quantize`` on CPU rows ``x [n, K]`` (bf16, fp16 or float32; or e4m3 with its
    float32 ``mult [n, K/32]``) into ``q`` and ``s`` (and the float64 ``diff`` and ``ref``
    vectors where given); the largest code, or -1 where ``x`` is not contiguous or its values
    hold a NaN or Inf (the outputs then incomplete)."""
    if not x.is_contiguous():
        return -1
    kind = _C_KINDS[x.dtype]
    src = x.detach().view({2: torch.int32, 3: torch.uint8}.get(kind, torch.int16)).numpy()
    extra = [None, None] if diff is None else [diff.numpy(), ref.numpy()]
    if mult is not None:
        extra.append(mult.contiguous().numpy())
    return _CQUANT.quantize(src, kind, q.view(torch.uint8).numpy(), s.numpy(), *extra)


def _widened(x: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """Rows ``r0:r1`` of ``x`` as float32 (exact), in this thread's scratch buffer."""
    def rows(r0: int, r1: int) -> torch.Tensor:
        out = _SCRATCH.get("xf", (r1 - r0) * x.shape[1], torch.float32, x.device)
        return out.view(r1 - r0, x.shape[1]).copy_(x[r0:r1])

    return rows


def _check_high_precision(x: torch.Tensor, name: str, fn: str) -> None:
    _check_matrix(x, name)
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise LayoutError(f"{name}: {fn} takes bfloat16, float16 or float32, got {x.dtype}")


def quantize_mxfp8(
    x: torch.Tensor, *, name: str = "tensor", chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a high-precision weight to MXFP8 exactly as FlashInfer does.

    Per 1x32 block along K: ``code = ceil_pow2(fl32(amax * fl32(1/448)))`` as a UE8M0 exponent
    (at most 254; 0 for an all-zero block), then ``q = e4m3_rne_satfinite(x * 2^(127-code))`` in
    float32, except that code 0 leaves ``x`` unscaled (so such blocks hold only +-0 bytes:
    ``0x80`` where ``x`` is negative or ``-0.0``). Bit-exact with ``mxfp8_quantize_host``
    (FlashInfer 0.7.2.post1 ``fp8Quantize.cpp``) for float32 input; bf16/fp16 are widened exactly.

    Args:
        x: ``[N, K]`` bfloat16, float16 or float32, ``K % 32 == 0``, any device.
        name: tensor name for error messages.
        chunk_rows: rows per chunk (None: about 2**20 elements per chunk).

    Returns:
        ``(q, s)``: ``q`` float8_e4m3fn ``[N, K]`` and ``s`` uint8 ``[N, K/32]`` (linear layout),
        both contiguous, on ``x``'s device.

    Raises:
        LayoutError: wrong rank, dtype or K, or a NaN/Inf element (message names ``name``).

    Example:
        >>> q, s = quantize_mxfp8(torch.full((1, 32), 448.0))
        >>> int(s[0, 0]), q[0, 0].item()   # amax 448 -> scale 2^0 -> code 127
        (127, 448.0)
    """
    _check_high_precision(x, name, "quantize_mxfp8")
    q, s, _ = _quantize_rows(_widened(x), x.shape, x.device, name, chunk_rows, measure=False,
                             source=x)
    return q, s


def quantize_mxfp8_with_error(
    x: torch.Tensor, *, name: str = "tensor", chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, QuantError]:
    """:func:`quantize_mxfp8` and, in the same pass, its :func:`quantization_error` against ``x``.

    The same bytes as :func:`quantize_mxfp8` and the same error, to the last bit, as
    ``quantization_error(x, q, s, chunk_rows=chunk_rows)`` (the same float64 sums in the same
    order), without its float64 dequantization or its separate NaN/Inf passes: the quantizer's
    own check covers ``x``, and ``q`` holds no NaN by construction.

    Args:
        x: ``[N, K]`` bfloat16, float16 or float32, ``K % 32 == 0``, any device.
        name: tensor name for error messages.
        chunk_rows: rows per chunk (None: about 2**20 elements per chunk).

    Returns:
        ``(q, s, error)``: as :func:`quantize_mxfp8`, and a :class:`QuantError`.

    Raises:
        LayoutError: as :func:`quantize_mxfp8`.
    """
    _check_high_precision(x, name, "quantize_mxfp8_with_error")
    q, s, sums = _quantize_rows(_widened(x), x.shape, x.device, name, chunk_rows, measure=True,
                                source=x)
    return q, s, _to_quant_error(sums)


# --- dequantize and error -------------------------------------------------------------------


def _check_pair(q: torch.Tensor, s: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an MXFP8 ``(q, s)`` pair; return them as (e4m3, uint8) views."""
    n, k = _check_matrix(q, name, "value tensor")
    q, codes = _as_e4m3(q, name), _as_codes(s, name)
    if tuple(codes.shape) != (n, k // MX_BLOCK):
        raise LayoutError(
            f"{name}: scale shape {list(codes.shape)} does not match values {[n, k]} "
            f"(expected {[n, k // MX_BLOCK]}, linear layout)"
        )
    nan = codes == UE8M0_NAN
    if nan.any():
        r, c = _first_true(nan)
        raise LayoutError(f"{name}: scale byte 255 (UE8M0 NaN) at row {r}, scale column {c}")
    return q, codes


def _dequant_chunk(
    q: torch.Tensor, codes: torch.Tensor, name: str, row0: int, f64: bool
) -> torch.Tensor:
    """Dequantize e4m3 rows ``q [n, K]`` with codes ``[n, K/32]`` to float32 (or float64)."""
    n, k = q.shape
    nan = _non_finite(q)  # e4m3fn NaN bytes 0x7F / 0xFF
    if nan.any():
        r, c = _first_true(nan)
        raise LayoutError(f"{name}: e4m3 NaN byte at row {row0 + r}, column {c}")
    v = q.to(torch.float64 if f64 else torch.float32)
    scale = _scale_f64(codes) if f64 else _exp2_f32(codes.to(torch.int32) - UE8M0_BIAS)
    return (v.view(n, k // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(-1)).view(n, k)


def dequantize_mxfp8(
    q: torch.Tensor,
    s: torch.Tensor,
    *,
    name: str = "tensor",
    out_dtype: torch.dtype = torch.float32,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Dequantize MXFP8: ``out[r, k] = float(q[r, k]) * 2^(s[r, k//32] - 127)``.

    Code 0 means ``2^-127`` as in the OCP MX spec and the GEMM kernels. (FlashInfer's
    ``mxfp8_dequantize_host`` turns code 0 into a zero scale instead; the two agree on
    everything :func:`quantize_mxfp8` produces, whose code-0 blocks are all +-0.) The product
    is one float32 multiply, exact unless it leaves float32's range (codes >= 248 can overflow
    to +-inf); ``out_dtype=torch.bfloat16`` rounds that float32 result once.

    Args:
        q: float8_e4m3fn (or uint8 bytes) ``[N, K]``, ``K % 32 == 0``.
        s: uint8 or float8_e8m0fnu ``[N, K/32]``, linear (not swizzled) layout.
        name: tensor name for error messages.
        out_dtype: torch.float32 (default) or torch.bfloat16.
        chunk_rows: rows per chunk (None: about 2**20 elements per chunk).

    Returns:
        ``[N, K]`` tensor of ``out_dtype`` on ``q``'s device.

    Raises:
        LayoutError: bad shapes or dtypes, a scale byte 255 (NaN) or an e4m3 NaN byte.
    """
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise LayoutError(f"{name}: dequantize_mxfp8 outputs float32 or bfloat16, not {out_dtype}")
    q, codes = _check_pair(q, s, name)
    n, k = q.shape
    out = torch.empty((n, k), dtype=out_dtype, device=q.device)
    for r0, r1 in _row_chunks(n, k, chunk_rows):
        out[r0:r1] = _dequant_chunk(q[r0:r1], codes[r0:r1], name, r0, f64=False)
    return out


def _error_sums(
    ref: torch.Tensor, q: torch.Tensor, codes: torch.Tensor, name: str, row0: int
) -> torch.Tensor:
    """``[sum (deq - ref)^2, sum ref^2]`` in float64 for one row chunk."""
    r = ref.to(torch.float64).flatten()
    diff = _dequant_chunk(q, codes, name, row0, f64=True).flatten().sub_(r)
    return torch.stack([torch.dot(diff, diff), torch.dot(r, r)])  # one pass each, no temporary


def _to_quant_error(sums: torch.Tensor) -> QuantError:
    err2, ref2 = (float(v) for v in sums.cpu())
    if err2 == 0.0:
        return QuantError(rel_fro=0.0, sqnr_db=math.inf)
    if ref2 == 0.0:
        return QuantError(rel_fro=math.inf, sqnr_db=-math.inf)
    return QuantError(rel_fro=math.sqrt(err2 / ref2), sqnr_db=10.0 * math.log10(ref2 / err2))


def quantization_error(
    ref: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    *,
    name: str = "tensor",
    chunk_rows: int | None = None,
) -> QuantError:
    """Relative Frobenius error and SQNR of MXFP8 ``(q, s)`` against ``ref``.

    Dequantizes exactly in float64 (code 0 = ``2^-127``) and accumulates in float64, chunk by
    chunk. See :class:`QuantError` for the zero and exact cases.

    Args:
        ref: floating ``[N, K]`` reference (any float dtype), finite.
        q: float8_e4m3fn (or uint8 bytes) ``[N, K]``.
        s: uint8 or float8_e8m0fnu ``[N, K/32]``, linear layout.
        name: tensor name for error messages.
        chunk_rows: rows per chunk (None: about 2**20 elements per chunk).

    Returns:
        :class:`QuantError`.

    Raises:
        LayoutError: shapes disagree, ``ref`` is not finite, or ``s`` holds a 255.
    """
    q, codes = _check_pair(q, s, name)
    if tuple(ref.shape) != tuple(q.shape):
        raise LayoutError(
            f"{name}: reference shape {list(ref.shape)} != MXFP8 shape {list(q.shape)}"
        )
    check_finite(ref, name, chunk_rows=chunk_rows)
    n, k = q.shape
    sums = torch.zeros(2, dtype=torch.float64, device=q.device)
    for r0, r1 in _row_chunks(n, k, chunk_rows):
        sums += _error_sums(ref[r0:r1], q[r0:r1], codes[r0:r1], name, r0)
    return _to_quant_error(sums)


# --- FP8 sources (docs/LAYOUTS.md section 4) -------------------------------------------------


def _source_scale_f32(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A source's multiplier scales as float32, checked finite and positive."""
    if not scale.is_floating_point():
        raise LayoutError(f"{name}: FP8 scales must be a floating tensor, got {scale.dtype}")
    f = scale.to(torch.float32)
    bad = ~torch.isfinite(f) | (f <= 0)
    if bad.any():
        idx = _first_true(bad.reshape(f.shape)) if f.dim() else ()
        raise LayoutError(
            f"{name}: scale {f[idx].item()} at index {list(idx)} is not a finite positive number",
            hint="the source checkpoint's scale tensor is corrupt",
        )
    return f


def _exact_pow2_codes(scale: torch.Tensor) -> torch.Tensor | None:
    """UE8M0 codes of positive float32 scales that are all exact powers of two in
    ``[2^-127, 2^127]``; None if any is not (then the source must be requantized)."""
    bits = scale.contiguous().view(torch.int32)
    exponent = bits.bitwise_right_shift(_F32_MANTISSA_BITS).bitwise_and(0xFF)
    mantissa = bits.bitwise_and(_F32_MANTISSA_MASK)
    normal = (mantissa == 0) & (exponent >= 1) & (exponent <= UE8M0_MAX_CODE)
    tiniest = (exponent == 0) & (mantissa == _F32_HALF_MANTISSA)  # 2^-127 -> code 0
    if not bool((normal | tiniest).all()):
        return None
    return torch.where(normal, exponent, torch.zeros_like(exponent)).to(torch.uint8)


def _check_fp8_weight(w: torch.Tensor, name: str, chunk_rows: int | None) -> tuple[int, int]:
    n, k = _check_matrix(w, name, "weight")
    if w.dtype != torch.float8_e4m3fn:
        raise LayoutError(f"{name}: FP8 source weights must be float8_e4m3fn, got {w.dtype}")
    check_finite(w, name, chunk_rows=chunk_rows)  # e4m3fn NaN bytes 0x7F / 0xFF
    return n, k


def _dequant_source(w: torch.Tensor, row_scale: torch.Tensor, bk: int) -> torch.Tensor:
    """The source's own float32 math, ``fl32(w) * scale``, for rows ``w [n, K]`` whose block
    scales are ``row_scale [n, ceil(K/bk)]``; broadcasts per block instead of gathering."""
    n, k = w.shape
    deq = w.to(torch.float32)
    full = k // bk  # whole column blocks; a ragged last block (K % bk) is scaled on its own
    deq[:, : full * bk].view(n, full, bk).mul_(row_scale[:, :full, None])
    if full * bk < k:
        deq[:, full * bk :].mul_(row_scale[:, full:])
    return deq


def _scaled_fp8_to_mxfp8(
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    name: str,
    chunk_rows: int | None,
) -> MXFP8Result:
    """Convert ``w [N, K]`` with float32 multipliers ``scale [ceil(N/bn), ceil(K/bk)]``."""
    n, k = w.shape
    bn, bk = block
    if w.numel() == 0:
        return MXFP8Result(
            w, torch.zeros((n, k // MX_BLOCK), dtype=torch.uint8, device=w.device), True, None
        )
    codes = _exact_pow2_codes(scale)
    if codes is not None and bk % MX_BLOCK == 0:
        # Every 1x32 block sits inside one source block: keep the bytes, copy the exponent.
        rows = torch.arange(n, device=w.device) // bn
        cols = torch.arange(k // MX_BLOCK, device=w.device) * MX_BLOCK // bk
        return MXFP8Result(w, codes[rows][:, cols].contiguous(), lossless=True, error=None)

    def rows(r0: int, r1: int) -> torch.Tensor:  # the source's float32 values
        return _dequant_source(w[r0:r1], scale[torch.arange(r0, r1, device=w.device) // bn], bk)

    e4m3 = None
    if bk % MX_BLOCK == 0:  # each 1x32 block within one source block: one multiplier each
        cols = torch.arange(k // MX_BLOCK, device=w.device) * MX_BLOCK // bk

        def multipliers(r0: int, r1: int) -> torch.Tensor:
            return scale[torch.arange(r0, r1, device=w.device) // bn][:, cols]

        e4m3 = (w, multipliers)
    q, s, sums = _quantize_rows(rows, (n, k), w.device, name, chunk_rows, measure=True,
                                e4m3=e4m3)
    return MXFP8Result(q, s, lossless=False, error=_to_quant_error(sums))


def block_fp8_to_mxfp8(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: tuple[int, int] = (128, 128),
    name: str = "weight",
    scale_name: str | None = None,
    chunk_rows: int | None = None,
) -> MXFP8Result:
    """Convert a DeepSeek-style block-FP8 weight to MXFP8 (docs/LAYOUTS.md section 4).

    The source value is ``fl32(w) * scale_inv[r // bn, k // bk]`` (a multiplier). When every
    block scale is an exact power of two in ``[2^-127, 2^127]`` (``scale_fmt: ue8m0``
    checkpoints) and ``bk % 32 == 0``, the conversion is lossless: the e4m3 bytes are kept and
    each 1x32 block gets its source block's exponent as UE8M0 code, so ``dequantize_mxfp8``
    returns the source's float32 values exactly. Otherwise each row chunk is dequantized in
    float32 and requantized with :func:`quantize_mxfp8`, and the error is reported.

    Args:
        w: float8_e4m3fn ``[N, K]``, ``K % 32 == 0``; N and K need not be multiples of the block.
        scale_inv: floating ``[ceil(N/bn), ceil(K/bk)]`` multipliers, finite and positive.
        block: ``(bn, bk)`` source block shape.
        name: weight name for messages.
        scale_name: scale name for messages (default ``name + "_scale_inv"``).
        chunk_rows: rows per chunk on the requantize path (None: about 2**20 elements).

    Returns:
        :class:`MXFP8Result`; on the lossless path ``q`` is ``w`` itself (no copy).

    Raises:
        LayoutError: bad shapes/dtypes/block, a NaN byte in ``w``, or a zero, negative, NaN or
            Inf scale (naming the tensor and block).
    """
    scale_name = scale_name or f"{name}_scale_inv"
    n, k = _check_fp8_weight(w, name, chunk_rows)
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise LayoutError(f"{name}: block must be two positive ints, got {block}")
    bn, bk = (int(b) for b in block)
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise LayoutError(
            f"{scale_name}: shape {list(scale_inv.shape)} does not fit weight {[n, k]} with "
            f"{bn}x{bk} blocks (expected {list(want)})"
        )
    scale = _source_scale_f32(scale_inv, scale_name).to(w.device)
    return _scaled_fp8_to_mxfp8(w, scale, (bn, bk), name, chunk_rows)


def per_tensor_fp8_to_mxfp8(
    w: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    name: str = "weight",
    scale_name: str | None = None,
    chunk_rows: int | None = None,
) -> MXFP8Result:
    """Convert a per-tensor or per-channel (per output row) FP8 weight to MXFP8.

    Source value ``fl32(w[r, k]) * weight_scale[r]`` (or the one scalar). Power-of-two scales in
    ``[2^-127, 2^127]`` are lossless (bytes kept, one code per row); anything else is
    dequantized and requantized, with the error reported.

    Args:
        w: float8_e4m3fn ``[N, K]``, ``K % 32 == 0``.
        weight_scale: floating scalar, ``[1]``, ``[N]`` or ``[N, 1]``, finite and positive.
        name: weight name for messages.
        scale_name: scale name for messages (default ``name + "_scale"``).
        chunk_rows: rows per chunk on the requantize path (None: about 2**20 elements).

    Returns:
        :class:`MXFP8Result`; on the lossless path ``q`` is ``w`` itself (no copy).

    Raises:
        LayoutError: bad shapes/dtypes, a NaN byte in ``w``, or a bad scale.
    """
    scale_name = scale_name or f"{name}_scale"
    n, k = _check_fp8_weight(w, name, chunk_rows)
    shape = tuple(weight_scale.shape)
    if weight_scale.numel() == 1 and len(shape) <= 2:
        rows, block = 1, (max(n, 1), max(k, MX_BLOCK))  # one block covers the whole weight
    elif shape in ((n,), (n, 1)):
        rows, block = n, (1, max(k, MX_BLOCK))  # one block per output row
    else:
        raise LayoutError(
            f"{scale_name}: shape {list(shape)} is neither per-tensor ([], [1]) nor "
            f"per-channel ([{n}], [{n}, 1]) for weight {[n, k]}"
        )
    scale = _source_scale_f32(weight_scale, scale_name).reshape(rows, 1).to(w.device)
    return _scaled_fp8_to_mxfp8(w, scale, block, name, chunk_rows)


def fp8_scales_are_pow2(scale: torch.Tensor, *, name: str = "scale") -> bool:
    """True when every multiplier in ``scale`` is an exact power of two in ``[2^-127, 2^127]``:
    then an FP8 source converts to MXFP8 losslessly (bytes kept, scales mapped exactly).

    Raises:
        LayoutError: a zero, negative, NaN or Inf scale (naming ``name``).
    """
    return _exact_pow2_codes(_source_scale_f32(scale, name)) is not None
