"""Host side of the Hopper engine: the launchers of each kernel family and the public entry points
:func:`triton_linear`, :func:`quantize_activations` and :func:`dequantize_weight`.

A call without ``config`` takes :func:`default_config` (the rules of ``rules.py`` on the facts of
``probe.py``, memoized). Activations are quantized to MXFP8 with FlashInfer's recipe either inside
the GEMM kernel or by :func:`quantize_activations` first; split-K partials are summed by
``reduce.py`` or by the last program of each tile to arrive (an atomic arrival counter). On the
cuBLAS path (``rules.cublas_config``: large M, and M >= ``cublas_min_m`` where the serving rule
does not apply) the weight is dequantized exactly by ``dequant.py`` into a transient bf16
workspace of at most ``dequant_workspace`` elements (chunk by chunk; ``rules.TUNED``) and cuBLAS
multiplies with fp32 accumulation (torch's ``allow_bf16_reduced_precision_reduction`` applies as
to any bf16 matmul); the workspace goes back to torch's caching allocator after the call, the
checkpoint's bytes remain the only resident copy of the weight. On the block-128 path
(``rules.block128_wins``: prefill, where cuBLAS has the 1x128 FP8 recipe) both
operands are regrouped by ``regroup.py`` to one fp32 scale per 128 elements of K (the weight
chunk by chunk into a transient FP8 workspace of as many bytes) and cuBLAS's FP8 GEMM runs on
them: twice the bf16 MMA rate, for the regrouping's rounding of the elements under 2^-6 of their
128-block's largest scale (``regroup.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.hopper import probe
from mxfp8_convert.runtime.hopper.config import (
    GEMV_MAX_M,
    GemmConfig,
    Kernel,
    cdiv,
    fit_block_k,
    next_pow2,
    no_empty_splits,
)
from mxfp8_convert.runtime.hopper.decode import _mxfp8_decode_kernel
from mxfp8_convert.runtime.hopper.dequant import _dequantize_weight_kernel
from mxfp8_convert.runtime.hopper.gemv import _mxfp8_gemv_kernel
from mxfp8_convert.runtime.hopper.jit import FP_FUSION, LAYOUT_CODE
from mxfp8_convert.runtime.hopper.quantize import _quantize_kernel
from mxfp8_convert.runtime.hopper.reduce import _splitk_reduce_kernel
from mxfp8_convert.runtime.hopper.regroup import (
    _regroup_activations_kernel,
    _regroup_weight_kernel,
)
from mxfp8_convert.runtime.hopper.rules import choose_config
from mxfp8_convert.runtime.hopper.tile import _mxfp8_gemm_kernel
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight


@functools.lru_cache(maxsize=4096)
def default_config(m: int, n: int, k: int, device: torch.device, pdl_env: str | None, *,
                   gluon: bool = True) -> GemmConfig:
    """:func:`rules.choose_config` on :func:`probe.device_facts`, memoized per shape, device and
    ``MXFP8_PDL`` value (the other facts do not change within a process but for a refused
    cluster launch, which clears the cache): an eager decode step would otherwise pay the
    rules' Python per linear layer (BENCHMARKS.md, "Host time per eager call").
    ``gluon=False``: as on a device without the Gluon kernel (for a weight it cannot read)."""
    facts = probe.device_facts(device)
    if not gluon:
        facts = dataclasses.replace(facts, gluon=False)
    return choose_config(m, n, k, facts)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if not probe.interpreting():
        raise LayoutError(
            f"the triton engine needs CUDA tensors (got {t.device}); "
            "on CPU use engine='reference' or set TRITON_INTERPRET=1 before importing triton"
        )



def quantize_activations(
    x: torch.Tensor, *, dequantized: bool = True, codes: bool = False, block_m: int = 32,
    block_k: int = 128, permuted: bool = False, pdl: bool = False,
) -> dict[str, torch.Tensor]:
    """Quantize ``x [M, K]`` to MXFP8 (FlashInfer's recipe) with one Triton kernel.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32 with unit stride along K, ``K % 32 == 0``.
        dequantized: also return ``"deq"``: ``q * 2^(code-127)`` as bf16 ``[M, K]`` (exact);
            float32 under the interpreter.
        codes: also return ``"q"`` (float8_e4m3fn ``[M, K]``) and ``"code"`` (uint8 ``[M, K/32]``,
            linear).
        block_m, block_k: tile of one program.
        permuted: ``"deq"`` as float32 ``[M, 4, K/4]`` holding element ``k`` at ``(k % 4, k // 4)``
            (the order in which the GEMV kernel reads weight bytes from int32 words).
        pdl: launched as a programmatic dependent of the previous kernel in the stream (it
            waits for it before reading ``x``) that lets the next kernel launch at once (which
            must wait likewise before reading the outputs).

    Returns:
        dict with the requested tensors.
    """
    _check_device(x)
    m, k = x.shape
    if k % 32 or x.stride(1) != 1:
        raise LayoutError("activations must be [M, K] with K % 32 == 0 and unit K stride, "
                          f"got {list(x.shape)}")
    out: dict[str, torch.Tensor] = {}
    deq_dtype = torch.float32 if x.device.type == "cpu" or permuted else torch.bfloat16
    deq = torch.empty((m, k), dtype=deq_dtype, device=x.device) if dequantized else x
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device) if codes else x
    code = torch.empty((m, k // 32), dtype=torch.uint8, device=x.device) if codes else x
    block_k = min(block_k, next_pow2(k))
    grid = (cdiv(m, block_m), cdiv(k, block_k))
    _quantize_kernel[grid](x, deq, q, code, m, k, x.stride(0), WRITE_DEQ=dequantized,
                           WRITE_Q=codes, BLOCK_M=block_m, BLOCK_K=block_k, PERM_DEQ=permuted,
                           PDL=pdl, HW_ROUND=probe.e4m3_conversion(x.device), num_warps=4,
                           enable_fp_fusion=FP_FUSION,
                           **({"launch_pdl": True} if pdl else {}))
    if dequantized:
        out["deq"] = deq.view(m, 4, k // 4) if permuted else deq
    if codes:
        out["q"] = q.view(torch.float8_e4m3fn)
        out["code"] = code
    return out


_LOCKS: dict[torch.device, torch.Tensor] = {}



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


def _split_k_buffers(out: torch.Tensor, cfg: GemmConfig, tiles: int):
    """``(partial, serial, ws, lock)`` of a launch over ``tiles`` output tiles into ``out`` [M, N]:
    the fp32 split-K workspace (``out`` when unsplit) and the arrival counters (``ws`` when
    unused)."""
    m, n = out.shape
    partial = cfg.split_k > 1
    serial = partial and cfg.serial_reduce
    ws = (torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=out.device) if partial
          else out)
    lock = _tile_locks(out.device, tiles) if serial else ws
    return partial, serial, ws, lock


def _reduce_splits(ws: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
                   has_bias: bool,
                   pdl: bool = False, p32: bool = False, block: int = 1024) -> None:
    """Sum the split-K partials ``ws`` (+ bias) into ``out`` with a second kernel (``pdl``: launched
    as a programmatic dependent of the GEMM, which lets it launch early; ``p32``: the partials' rows
    are in the trtllm weight's physical order)."""
    total = out.shape[0] * out.shape[1]
    _splitk_reduce_kernel[(cdiv(total, block),)](
        ws, bias, out, out.shape[1], total, total, cfg.split_k, HAS_BIAS=has_bias, BLOCK=block,
        PDL=pdl, CHUNK=cfg.red_chunk, RELEASE=cfg.red_release, P32=p32, num_warps=4,
        enable_fp_fusion=FP_FUSION, **({"launch_pdl": True} if pdl else {}),
    )


def _scale_operand(weight: MXFP8Weight) -> torch.Tensor:
    """The scale bytes as the kernel reads them: int32 words for 128x4 tiles, else uint8."""
    s = weight.scale
    if weight.layout == CANONICAL:
        return s
    if not s.is_contiguous() or s.data_ptr() % 4:
        raise LayoutError(f"{weight.name or 'weight'}: 128x4 scale tiles must be contiguous and "
                          "4-byte aligned")
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
    """Run the config's kernels (:data:`_LAUNCHERS`) into ``out`` [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None:
        pdl_env = os.environ.get("MXFP8_PDL")
        cfg = default_config(m, n, k, x.device, pdl_env)
        if cfg.kind in (Kernel.WGMMA, Kernel.DQMMA) and not probe.gluon().supported(weight, k):
            # e.g. canonical or unaligned weight bytes: the rule without the Gluon kernel
            cfg = default_config(m, n, k, x.device, pdl_env, gluon=False)
    else:
        cfg = config
    if k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} does not divide K={k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return _LAUNCHERS[cfg.kind](x, weight, bias, out, cfg)


def _stream_launch(kernel, xs: tuple[torch.Tensor, ...], stride_xm: int, wdata: torch.Tensor,
                   weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
                   cfg: GemmConfig, tiles: int, **constexprs) -> torch.Tensor:
    """Launch one of the Triton weight-stream kernels (tile, decode, GEMV), whose arguments are
    alike: ``(*xs, wdata, scales, bias, out, partials, locks, M, N, K, stride_xm, wdata's row
    stride, out's row stride, the partials' split stride, C, Cp/4, split_k)`` and the shared
    constexprs, on a ``(tiles, split_k)`` grid with the split-K buffers of ``tiles`` output
    tiles; a second kernel sums the partials unless the last program of a tile does
    (``serial_reduce``)."""
    m, (n, k) = out.shape[0], weight.shape
    c, cp4 = _scale_geometry(weight)
    has_bias = bias is not None
    bias_t = bias if has_bias else out
    partial, serial, ws, lock = _split_k_buffers(out, cfg, tiles)
    kernel[(tiles, cfg.split_k)](
        *xs, wdata, _scale_operand(weight), bias_t, out, ws, lock,
        m, n, k, stride_xm, wdata.stride(0), out.stride(0), m * n, c, cp4, cfg.split_k,
        LAYOUT=LAYOUT_CODE[weight.layout], HAS_BIAS=has_bias, BLOCK_N=cfg.block_n,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PARTIAL=partial, SERIAL=serial,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION,
        **constexprs,
    )
    if partial and not serial:
        _reduce_splits(ws, bias_t, out, cfg, has_bias)
    return out


def _check_stream(x: torch.Tensor, cfg: GemmConfig, family: str, max_m: int) -> None:
    m, k = x.shape
    if m > max_m:
        raise LayoutError(f"the {family} kernel serves M <= {max_m}, got M={m}")
    if cfg.block_k % 32 or k % cfg.block_k:
        raise LayoutError(f"block_k={cfg.block_k} must be a multiple of 32 dividing K={k}")


def _launch_tile(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """The tile kernel (+ activation quantization unless fused, + reduce unless serial)."""
    m = x.shape[0]
    a = x if cfg.fuse_quant else quantize_activations(x)["deq"]
    tiles = cdiv(weight.shape[0], cfg.block_n) * cdiv(m, cfg.block_m)
    return _stream_launch(_mxfp8_gemm_kernel, (a,), a.stride(0), weight.data, weight, bias, out,
                          cfg, tiles, QUANT_X=cfg.fuse_quant, DOT_BF16=x.device.type == "cuda",
                          GROUP_N=cfg.group_n)


def _scale_tile(weight: MXFP8Weight, block_k: int) -> int:
    """How the decode kernel reads scales: 2 = one [BN, 2]-word load per 256-wide K-tile (split
    into columns), 1 = [BN, BK/128] words per K-tile, 0 = one load per 32-block (canonical)."""
    if weight.layout == CANONICAL or block_k % 128:
        return 0
    return 2 if block_k == 256 else 1


def _quantize_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 bytes ``[M, K]`` and int32 codes ``[M, K/32]`` of ``x`` (32-bit code loads pipeline)."""
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    xc = torch.empty((m, k // 32), dtype=torch.int32, device=x.device)
    bk = min(128, next_pow2(k))
    _quantize_kernel[(cdiv(m, 16), cdiv(k, bk))](
        x, x, xq, xc, m, k, x.stride(0), WRITE_DEQ=False, WRITE_Q=True, BLOCK_M=16, BLOCK_K=bk,
        HW_ROUND=probe.e4m3_conversion(x.device), num_warps=4, enable_fp_fusion=FP_FUSION)
    return xq.view(torch.float8_e4m3fn), xc


def _launch_wgmma(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """Activation quantization (unless the kernel does it: bf16, fp16 or fp32 activations, the
    same bits as the quantization kernel's), the Gluon wgmma decode kernel, and the split-K
    reduction (unless serial or through a cluster's shared memory). Where the GPU refuses a
    clustered launch (its error names the cluster), the call runs with the partials summed by the
    last program instead, and so does every later call on that device
    (:data:`probe.CLUSTERS_REFUSED`)."""
    gluon = probe.gluon()
    if gluon is None:
        raise LayoutError("the wgmma decode kernel needs Triton's Gluon (triton >= 3.6)")
    xq, xc = (x, None) if cfg.fuse_quant else _quantize_codes(x)
    has_bias = bias is not None
    partial, serial, ws, lock = (False, False, None, None) if cfg.cluster else _split_k_buffers(
        out, cfg, cdiv(weight.shape[0], cfg.block_n))
    try:
        gluon.wgmma_decode(xq, weight, bias, out, ws if partial else None, lock if serial else None,
                           split_k=cfg.split_k, xc=xc, stages=cfg.num_stages,
                           sw_ahead=cfg.sw_ahead, pdl=cfg.pdl, red_chunk=cfg.red_chunk,
                           x_words=cfg.x_words, cluster=cfg.cluster, block_n=cfg.block_n,
                           prefetch=cfg.prefetch, phys_partials=cfg.phys_partials,
                           x_prefetch=cfg.x_prefetch)
    except RuntimeError as err:
        if not cfg.cluster or "cluster" not in str(err).lower():
            raise
        probe.CLUSTERS_REFUSED.add(probe.device_index(x.device))
        default_config.cache_clear()  # the memoized rule chose clusters
        split = no_empty_splits(x.shape[1] // 128, cfg.split_k)  # the global-memory kernel's splits
        fallback = dataclasses.replace(cfg, cluster=False, split_k=split, serial_reduce=True)
        return _launch_wgmma(x, weight, bias, out, fallback)
    if partial and not serial:
        _reduce_splits(ws, bias if has_bias else out, out, cfg, has_bias, pdl=cfg.pdl,
                       p32=weight.layout == "trtllm" and cfg.phys_partials)
    return out


def _launch_decode(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """The decode kernel (+ activation quantization unless fused, + reduce unless serial)."""
    _check_stream(x, cfg, "decode", cfg.block_m)
    xq, xc = (x, x) if cfg.fuse_quant else _quantize_codes(x)
    return _stream_launch(_mxfp8_decode_kernel, (x, xq, xc), x.stride(0), weight.data, weight,
                          bias, out, cfg, cdiv(weight.shape[0], cfg.block_n),
                          FUSE_QUANT=cfg.fuse_quant, FP8_DOT=x.device.type == "cuda",
                          SCALE_TILE=_scale_tile(weight, cfg.block_k))


def _launch_gemv(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """The GEMV kernel (+ activation quantization unless fused, + reduce unless serial)."""
    m, k = x.shape
    _check_stream(x, cfg, "GEMV", min(cfg.block_m, GEMV_MAX_M))
    if cfg.block_m > GEMV_MAX_M:
        raise LayoutError(f"the GEMV kernel serves block_m <= {GEMV_MAX_M}, got {cfg.block_m}")
    wdata = weight.data
    # int32 words need a contiguous, 4-byte aligned weight; any other view takes the generic cast
    words = cfg.words and wdata.is_contiguous() and wdata.data_ptr() % 4 == 0
    if words:
        wdata = wdata.view(torch.int32)
    x_perm = words and not cfg.fuse_quant
    a = x if cfg.fuse_quant else quantize_activations(x, permuted=x_perm)["deq"].view(m, k)
    return _stream_launch(_mxfp8_gemv_kernel, (a,), a.stride(0), wdata, weight, bias, out, cfg,
                          cdiv(weight.shape[0], cfg.block_n), FUSE_QUANT=cfg.fuse_quant,
                          WORDS=words, X_PERM=x_perm)


def dequantize_weight(
    weight: MXFP8Weight, start: int = 0, stop: int | None = None, *,
    out: torch.Tensor | None = None,
    block_n: int = 64, block_k: int = 256,
) -> torch.Tensor:
    """Logical rows ``[start, stop)`` of ``weight`` as exact ``q * 2^(code-127)``, read from the
    laid-out bytes by one Triton kernel (bf16 on CUDA, float32 under the interpreter).

    Args:
        weight: trtllm, cutlass or canonical :class:`MXFP8Weight`.
        start, stop: logical row range (default: every row).
        out: optional ``[stop - start, K]`` tensor with unit K stride to write into.
        block_n, block_k: tile of one program (``block_k`` is fitted to K).

    Returns:
        ``[stop - start, K]`` (``out`` when given).
    """
    _check_device(weight.data)
    n, k = weight.shape
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise LayoutError(
            f"{weight.name or 'weight'}: row range [{start}, {stop}) outside [0, {n})")
    dtype = torch.bfloat16 if weight.data.device.type == "cuda" else torch.float32
    if out is None:
        out = torch.empty((stop - start, k), dtype=dtype, device=weight.data.device)
    elif out.shape != (stop - start, k) or out.stride(1) != 1:
        raise LayoutError(
            f"out must be [{stop - start}, {k}] with unit K stride, got {list(out.shape)}")
    if stop == start:
        return out
    bk = fit_block_k(k, block_k)
    c, cp4 = _scale_geometry(weight)
    grid = (cdiv(stop - start, block_n), k // bk)
    _dequantize_weight_kernel[grid](
        weight.data, _scale_operand(weight), out, stop, start, weight.data.stride(0),
        out.stride(0), c, cp4, LAYOUT=LAYOUT_CODE[weight.layout],
        DOT_BF16=out.dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_K=bk,
        num_warps=4, enable_fp_fusion=FP_FUSION,
    )
    return out


def regroup_activations(
    x: torch.Tensor, *, block_m: int = 32, block_k: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` to MXFP8 (FlashInfer's recipe) and regroup it to one scale per 128
    elements of K (``regroup.py``): ``(q, scale)``, float8_e4m3fn ``[M, K]`` and fp32
    ``[M, K/128]`` with strides ``(1, M)`` (cuBLAS's 1x128 operand). K % 128 == 0."""
    _check_device(x)
    m, k = x.shape
    if k % 128 or x.stride(1) != 1:
        raise LayoutError("activations must be [M, K] with K % 128 == 0 and unit K stride, "
                          f"got {list(x.shape)}")
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((k // 128, m), dtype=torch.float32, device=x.device)
    block_k = fit_block_k(k, block_k)
    _regroup_activations_kernel[(cdiv(m, block_m), k // block_k)](
        x, q, scale, m, k, x.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
        HW_ROUND=probe.e4m3_conversion(x.device), num_warps=4, enable_fp_fusion=FP_FUSION)
    return q.view(torch.float8_e4m3fn), scale.t()


def regroup_weight(
    weight: MXFP8Weight, start: int = 0, stop: int | None = None, *,
    block_n: int = 64, block_k: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical rows ``[start, stop)`` of the laid-out ``weight [N, K]``, one scale per 128
    elements of K (``regroup.py``): ``(q, scale)``, float8_e4m3fn ``[rows, K]`` and fp32
    ``[K/128, rows]`` row-major (cuBLAS's 1x128 operand for ``q.T``). K % 128 == 0."""
    _check_device(weight.data)
    n, k = weight.shape
    stop = n if stop is None else stop
    if k % 128:
        raise LayoutError(f"{weight.name or 'weight'}: K={k} is not a multiple of 128")
    if not 0 <= start <= stop <= n:
        raise LayoutError(
            f"{weight.name or 'weight'}: row range [{start}, {stop}) outside [0, {n})")
    q = torch.empty((stop - start, k), dtype=torch.uint8, device=weight.data.device)
    scale = torch.empty((k // 128, stop - start), dtype=torch.float32, device=weight.data.device)
    if stop > start:
        c, cp4 = _scale_geometry(weight)
        bk = fit_block_k(k, block_k)
        _regroup_weight_kernel[(cdiv(stop - start, block_n), k // bk)](
            weight.data, _scale_operand(weight), q, scale, stop, start, weight.data.stride(0), c,
            cp4, LAYOUT=LAYOUT_CODE[weight.layout], BLOCK_N=block_n, BLOCK_K=bk,
            HW_ROUND=probe.e4m3_conversion(weight.data.device), num_warps=4,
            enable_fp_fusion=FP_FUSION)
    return q.view(torch.float8_e4m3fn), scale


def _launch_block128(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """Activations quantized and regrouped once; per chunk of ``cfg.chunk_n`` weight rows, the
    rows regrouped (``regroup.py``) and ``out[:, chunk] = A @ Wq.T (+ bias)`` by cuBLAS's FP8
    GEMM with 1x128 scales on both operands (``torch._scaled_mm``). Under the interpreter the
    product of the same regrouped values is taken in fp32 by torch."""
    n, k = weight.shape
    if n % 16 or (cfg.chunk_n % 16 and cfg.chunk_n < n):
        raise LayoutError(f"{weight.name or 'weight'}: the block-128 path needs N and its chunks "
                          f"in multiples of 16 rows (cuBLAS), got N={n}, chunk_n={cfg.chunk_n}")
    xq, xs = regroup_activations(x)
    chunk = min(cfg.chunk_n or n, n)
    if bias is not None:
        bias = bias.to(out.dtype)
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        wq, ws = regroup_weight(weight, n0, n1, block_n=cfg.block_n, block_k=cfg.block_k)
        b = None if bias is None else bias[n0:n1]
        if x.device.type == "cpu":
            a = xq.float() * xs.repeat_interleave(128, dim=1)
            w = wq.float() * ws.t().repeat_interleave(128, dim=1)
            res = a @ w.t() if b is None else torch.addmm(b.float(), a, w.t())
        elif chunk == n:  # one chunk: straight into ``out``
            torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=b,
                             out_dtype=torch.bfloat16, out=out)
            break
        else:
            res = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=b,
                                   out_dtype=torch.bfloat16)
        out[:, n0:n1] = res
    return out


def _launch_cublas(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """Activations quantized once; per chunk of ``cfg.chunk_n`` weight rows, the rows dequantized
    into one reused workspace and ``out[:, chunk] = A @ Wd.T (+ bias)`` by cuBLAS (fp32
    accumulation; strided ``out`` column slices are written in place)."""
    n, k = weight.shape
    a = quantize_activations(x)["deq"]
    chunk = min(cfg.chunk_n or n, n)
    ws = torch.empty((chunk, k), dtype=a.dtype, device=x.device)
    if bias is not None:
        bias = bias.to(out.dtype)  # added in fp32 by cuBLAS; a non-bf16 bias is rounded first
    for n0 in range(0, n, chunk):
        n1 = min(n0 + chunk, n)
        wd = dequantize_weight(weight, n0, n1, out=ws[: n1 - n0], block_n=cfg.block_n,
                               block_k=cfg.block_k)
        if bias is None:
            torch.mm(a, wd.t(), out=out[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1], a, wd.t(), out=out[:, n0:n1])
    return out


def _launch_dqmma(
    x: torch.Tensor, weight: MXFP8Weight, bias: torch.Tensor | None, out: torch.Tensor,
    cfg: GemmConfig,
) -> torch.Tensor:
    """Activations quantized (exactly dequantized bf16), the Gluon dequantizing wgmma kernel,
    and the split-K reduction (partials in the weight's physical row order); with ``cfg.pdl``
    the three as a chain of programmatic dependent launches (the GEMM's weight tiles and scale
    words loaded before its wait where ``cfg.prefetch``)."""
    from mxfp8_convert.runtime.hopper import dqmma

    m, k = x.shape
    xd = quantize_activations(x, pdl=cfg.pdl)["deq"]
    partial = cfg.split_k > 1
    ws = (torch.empty((cfg.split_k, m, weight.shape[0]), dtype=torch.float32, device=x.device)
          if partial else None)
    dqmma.dqmma(xd, weight, bias, out, ws, split_k=cfg.split_k, block_n=cfg.block_n,
                block_m=cfg.block_m, stages=cfg.num_stages, specialized=cfg.specialized,
                pdl=cfg.pdl, prefetch=cfg.prefetch)
    if partial:
        has_bias = bias is not None
        _reduce_splits(ws, bias if has_bias else out, out, cfg, has_bias, pdl=cfg.pdl,
                       p32=weight.layout == "trtllm")
    return out


#: The launcher of each kernel family.
_LAUNCHERS = {
    Kernel.TILE: _launch_tile,
    Kernel.DECODE: _launch_decode,
    Kernel.GEMV: _launch_gemv,
    Kernel.CUBLAS: _launch_cublas,
    Kernel.BLOCK128: _launch_block128,
    Kernel.WGMMA: _launch_wgmma,
    Kernel.DQMMA: _launch_dqmma,
}
