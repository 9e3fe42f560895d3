"""Which kernel and launch parameters serve a GEMM of shape (M, N, K): pure functions from the
shape and :class:`DeviceFacts` to a :class:`GemmConfig`.

Every tuned number is a field of :data:`TUNED` (one table, each with the measurement that set
it; BENCHMARKS.md, "Design decisions", has the figures). :func:`choose_config` asks the rules
in order (:data:`RULES`) and falls back to the tile kernel:

1. :func:`serving_rule`: Hopper with Gluon, M = 17 .. ``dqmma_max_m``, K % 128 == 0 (the
   dequantizing wgmma kernel, or the FP8 wgmma kernel at M <= ``serve_wgmma_max_m``).
2. :func:`block128_wins` (prefill, where cuBLAS has the 1x128 FP8 recipe):
   :func:`block128_config`; else M >= ``cublas_min_m``: :func:`cublas_config`.
3. :func:`wgmma_rule`: Hopper with Gluon, M <= 16, K % 128 == 0.
4. :func:`gemv_rule`: M <= ``gemv_max_m``.
5. :func:`decode_rule`: M <= ``decode_max_m`` on large-N weights, FP8 tensor cores.
6. :func:`tile_config`.

No torch, no Triton: the facts come from ``probe.device_facts`` on a real device, and tests pass
them in for any device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.hopper.config import (
    CLUSTER_SIZES,
    DECODE_BLOCK_M,
    GEMV_MAX_M,
    WGMMA_BLOCK_K,
    WGMMA_MAX_M,
    GemmConfig,
    Kernel,
    cdiv,
    fit_block_k,
    next_pow2,
    no_empty_splits,
)


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the rules read of the device (``probe.device_facts`` reads them off a real one)."""

    sms: int  # streaming multiprocessors (the interpreter: 4)
    capability: tuple[int, int] | None  # CUDA compute capability; None: the CPU interpreter
    gluon: bool = False  # Triton's Gluon (>= 3.6) is importable
    pdl: bool = False  # kernels may launch as programmatic dependents (``probe.pdl_enabled``)
    weight_prefetch: bool = True  # under PDL, the weight's first tiles before the wait
    clusters: bool = True  # thread-block clusters launch (none refused on this device)
    block_fp8: bool = False  # cuBLAS FP8 GEMM with 1x128 scales (``probe.block_fp8``)

    @property
    def hopper(self) -> bool:
        return self.capability is not None and self.capability[0] == 9

    @property
    def fp8_mma(self) -> bool:
        """FP8 tensor-core dots (SM89+), or the interpreter (which runs them in float32)."""
        return self.capability is None or self.capability >= (8, 9)


@dataclass(frozen=True, slots=True)
class Tuning:
    """The tuned thresholds of the rules, each fitted to sweeps on one H200 (132 SMs) over the
    model shapes of ``shapes.py`` (BENCHMARKS.md, "Design decisions")."""

    # cuBLAS path: from this M, one dequantization of the weight + cuBLAS beat the tile kernel
    # (which dequantizes each weight tile once per M-tile): M = 256 on 15 of 19 shapes, M >= 512
    # on all; at M = 128 the tile kernel won.
    cublas_min_m: int = 256
    # its bf16 weight workspace, elements (128 MiB); 8-32 M elements (kept in L2) were no faster
    dequant_workspace: int = 64 * 1024 * 1024
    # block-128 path (FP8 cuBLAS on operands regrouped to one scale per 128 of K), where cuBLAS
    # runs that recipe (``DeviceFacts.block_fp8``), K % 128 == 0 and N % 16 == 0: from
    # block128_min_m tokens on weights of >= block128_min_n rows. With the regrouping passes
    # rounding by the GPU's conversion (prefill_fp8.py --block128, H100, one chunk) it beat the
    # cuBLAS path on 18 of 19 model weights at M = 2048 (x0.66-1.01 vs x0.58-0.86) and at
    # M = 8192 (x0.71-1.12 vs x0.64-0.96); behind on DeepSeek q_a at M = 2048 (x0.57 vs 0.68, its
    # FP8 GEMM alone x0.78) and on kv_a (N = 576) at M = 8192 (x0.47 vs 0.50), level on kv_a at
    # M = 2048 (x0.66 vs 0.63): N >= 1024 keeps kv_a on the cuBLAS path.
    block128_min_m: int = 2048
    block128_min_n: int = 1024
    # wgmma kernel (M <= 16, Hopper). Below this many weight elements: fewer programs (~2 per SM
    # at M <= 8, ~1 at M = 9..16) and the last program sums the partials; at M = 1 without PDL
    # the GEMV kernel is faster there.
    wgmma_small_weight: int = 8_000_000
    wgmma_mid_weight: int = 20_000_000  # from here ~3 programs per SM at M = 9..16 (below ~2)
    wgmma_huge_weight: int = 64_000_000  # M = 5..8: a second reduction kernel only below this
    wgmma_unsplit_tiles_per_sm: float = 2.5  # row tiles filling 2.5 waves: K unsplit (q_b, kv_b)
    wgmma_max_split: int = 16  # from M = 4: K split at most 16 ways (one round trip to sum)
    wgmma_two_kernel_split: int = 8  # a second kernel sums 2..8 partials (M = 5..8; see rule)
    wgmma_cluster_max_tiles: int = 32  # M = 9..16: clusters only on weights of <= 32 row tiles
    wgmma_cluster_idle_share: float = 0.75  # M <= 8: 16 splits where 8 leave 1/4 of SMs idle
    wgmma_wide_cluster: int = 4  # M = 9..16: 128-row programs in clusters of 4 ...
    wgmma_wide_per_sm: tuple[float, float] = (1.5, 2.0)  # ... where that makes 1.5-2 per SM
    wgmma_wide_min_k: int = 1024  # ... and K has at least 8 K-tiles
    wgmma_split_tiles: int = 4  # M = 9..16, second kernel: splits of 4 K-tiles ...
    wgmma_even_per_sm: int = 4  # ... where that is 2-8 splits of at most 4 programs per SM
    red_chunk: tuple[int, int] = (4, 16)  # partials per round trip: all, clamped to this range
    # GEMV kernel (M <= 2): fastest there on every shape measured
    gemv_max_m: int = 2
    gemv_small_weight: int = 5_000_000  # below: 512-wide K-tiles, fused quantization
    gemv_large_weight: int = 64_000_000  # from here: pre-permuted activations, ~8 programs/SM
    gemv_waves: float = 4.0  # M = 1 between the two: fused quantization, ~4 programs per SM
    gemv_pair_waves: float = 2.0  # M = 2 between the two: pre-permuted activations, ~2 per SM
    gemv_short_rows: tuple[int, int] = (4096, 2048)  # M = 1, N and K from these: 16-row programs
    # decode kernel (no wgmma): M <= 4 on weights with >= 2 waves of 64-row tiles, K >= 1024
    decode_max_m: int = 4
    decode_min_k: int = 1024
    decode_min_tile_waves: int = 2
    decode_waves: float = 2.0
    # tile kernel, M <= 64: one kernel (fused quantization, last-CTA reduction) below this
    # weight size, three kernels (quantize, GEMM, reduce) above
    tile_one_kernel_weight: int = 40_000_000
    tile_small_waves: float = 1.9  # split-K target, programs per SM, one-kernel weights
    tile_large_waves: int = 4  # ... three-kernel weights
    tile_stream_max_m: int = 64  # up to here 64-row weight tiles streamed with split-K
    tile_mid_max_m: int = 1024  # up to here 128x128 tiles (64x64 for N <= 2048)
    tile_narrow_n: int = 2048
    # serving batches (Hopper, Gluon; sweeps of benchmarks/sweep_dqmma.py, M = 32 .. 2048):
    # the dequantizing wgmma kernel (dqmma.py) up to this M; from M = 1024 cuBLAS won every shape
    dqmma_max_m: int = 512
    # above this M, dqmma only on weights of >= dqmma_wide_min_n rows (M = 512: cuBLAS won 8 of
    # the 9 shapes with N < 4096, dqmma 9 of the 10 with N >= 4096), or of <= dqmma_narrow_n
    dqmma_wide_m: int = 256
    dqmma_wide_min_n: int = 4096
    # split-K to ~2 waves of programs up to M = 128 (within 1 % of each row's best split on
    # average), none where the tiles fill a wave; above, ~1 wave and none where the tiles fill
    # half of one (M = 512: mean ratio 0.60 vs 0.56 splitting up to a wave); at least 4 K-tiles
    # a split
    dqmma_waves: float = 2.0
    dqmma_wide_waves: float = 1.0
    dqmma_wide_unsplit_share: float = 0.5
    dqmma_min_split_tiles: int = 4
    # up to M = 128 split-K also where the tiles fill the SMs but leave a short last wave (fewer
    # than this many waves): Qwen gate_up M = 32, 152 tiles, 2 splits x1.05 vs unsplit x0.94
    # (sweep_dqmma.py --launch, 2026-12-01); the next tile counts of the model shapes (224, 288)
    # were as fast unsplit
    dqmma_tail_waves: float = 1.25
    # M = 129..512: 128-token programs (two to four M tiles) on weights of at most this many
    # rows, where 256-token ones leave most SMs idle or split K thin (sweep_dqmma.py --launch
    # --ms 256, 2026-12-01: Llama k_proj x0.79 vs x0.63, Qwen k_proj x0.71 vs x0.62, DeepSeek kv_a
    # x0.75 vs x0.55; N = 4096 as fast either way or slower); above M = 256 instead of cuBLAS
    # (sweep_dqmma.py --tokens --ms 512, 23:47: DeepSeek kv_a x0.69 vs x0.58, Llama k_proj x0.60
    # vs x0.53, Qwen k_proj x0.52 vs x0.51)
    dqmma_narrow_n: int = 1024
    # M = 65..128: one-chain programs of 128 tokens (one M tile: each weight element dequantized
    # once, not once per 64 tokens), one an SM by shared memory, K split to ~this many waves,
    # where the weight's 64-row tiles fit one wave (128 rows per program where K >= this) or its
    # 128-row tiles fill ws_wide_min_share of one (sweep_dqmma.py --tokens --ms 128,
    # 2026-12-01 23:44, trtllm: median x0.80 vs x0.70 for 64-token programs on the rows it takes;
    # DeepSeek expert gate_up x0.97 vs x0.75, Llama down x0.98 vs x0.80, gate_up x0.84 vs
    # x0.63; two waves of them, or tiles that do not fit one, were slower: Qwen gate_up, DeepSeek
    # q_b, kv_b, MLP gate_up)
    dqmma_tall_waves: float = 1.0
    dqmma_tall_wide_k: int = 12288
    # M = 17 .. 32: the FP8 wgmma kernel (activations quantized inside, 128-row programs, a
    # second kernel sums ~1 wave of splits), except on weights whose 64-row tiles fill the SMs
    # or with K >= serve_dqmma_min_k, where dqmma was faster (Llama gate_up/down, DeepSeek q_b,
    # o_proj, MLP: x1.11-1.37 vs x0.88-1.02)
    serve_wgmma_max_m: int = 32
    serve_wgmma_waves: float = 1.0
    # ... and no more programs than SMs: a 128-row program of 32 tokens takes ~152 registers a
    # thread (one per SM), so one more split than that ran a second wave (Llama q_proj: 5 splits
    # of 32 row tiles, 160 programs, x0.98)
    serve_wgmma_per_sm: int = 1
    serve_dqmma_min_k: int = 12288
    # the warp-specialized dqmma (128-row programs of 256 tokens, each weight element
    # dequantized once per 256 tokens, the activations read once per 128 weight rows, not 64)
    # above M = ws_min_m where its programs run unsplit (half the SMs or more) and fill their
    # waves no more than ws_wave_margin worse than the one-chain kernel's 64-row programs (one an
    # SM) fill theirs (the candidates of sweep_dqmma.py --ws-wave, H100, 2026-12-07, trtllm, both
    # kernels storing 16-byte pieces): ahead where the fill is alike, as the activations are
    # read once per 128 weight rows (M = 512 DeepSeek q_b x0.91 vs x0.76, kv_b x0.80 vs x0.65,
    # expert down x0.82 vs x0.74; M = 256 kv_b x0.90 vs x0.76, Qwen gate_up x0.85 vs x0.70,
    # Llama gate_up x0.92 vs x0.88); behind where its waves were 0.18 or more emptier (M = 256
    # DeepSeek MLP gate_up x0.68 vs x0.80, q_b x0.83 vs x0.89; M = 512 Qwen gate_up x0.65 vs
    # x0.71); split K to one wave of them, or 128-token programs, lost on every weight that the
    # one-chain kernel serves (Qwen q_proj M = 512 x0.47 vs x0.81); the earlier sweep
    # (2026-12-01 16:45) had it ahead at the same fill (M = 512 Llama gate_up, DeepSeek o_proj,
    # MLP down x0.84 vs x0.73-0.74) and even at 0.15 emptier (MLP gate_up x0.73 vs x0.75)
    # M = 65..128: one-chain programs of 128 weight rows and 128 tokens in a ring of 2 (96 KB:
    # two an SM), K split to two waves of them, where K >= dqmma_pair_min_k, and up to
    # dqmma_pair_max_m where the weight's tiles do not fit tall_config's one wave
    # (sweep_dqmma.py --tokens --ms 128,80, 23:58: DeepSeek o_proj x1.03 / x1.15 at M = 128 / 80
    # vs x0.98 / x0.92 for the specialized kernel, MLP down x1.02 / x1.18 vs x0.99 / x1.02; at
    # M = 80 Qwen gate_up x0.74 vs x0.57, DeepSeek kv_b x0.69 vs x0.55, q_b x0.65 vs x0.53, MLP
    # gate_up x0.61 vs x0.55 for 64-token programs, which were ahead again at M = 128 on all but
    # Qwen gate_up: q_b x0.73 vs x0.66, kv_b x0.62 vs x0.61, MLP gate_up x0.68 vs x0.51; the
    # boundary at 96 tokens, the second 64-token tile half full, is not measured)
    dqmma_pair_min_k: int = 16384
    dqmma_pair_max_m: int = 96
    dqmma_pair_waves: float = 2.0
    # the dqmma path (quantization, kernel, reduction) as a PDL chain below this weight size
    # (sweep_dqmma.py --pdl, M = 32..512): it hid launch latency on small weights (Qwen k_proj
    # M = 64 7.7 vs 10.1 us, DeepSeek kv_b M = 32 10.2 vs 11.7, Qwen gate_up 16.6 vs 18.7) and
    # slowed large ones at M <= 64 (DeepSeek o_proj M = 32 54.4 vs 46.0 us, Llama gate_up M = 64
    # 37.6 vs 30.9)
    dqmma_pdl_max_weight: int = 32_000_000
    # M = 33..64 on those weights where N >= dqmma_occupancy_min_n: 64-row programs in a ring of
    # 2 (49 KB, four an SM), K split so that about dqmma_occupancy_per_sm programs share each
    # SM (at least dqmma_min_split_tiles K-tiles a split): the kernel is latency-bound with ~1.7
    # warps a scheduler (ncu_dqmma.sh), and on these weights more programs hid more than their
    # partials cost (sweep_dqmma.py --occupancy --ms 48,64, 2026-12-02, against the previous
    # rule side by side, M = 64: Llama q_proj / o_proj x0.89 / x0.91 vs x0.75 / x0.77, Qwen
    # gate_up x0.99 vs x0.86, down_proj x1.08 vs x0.93, o_proj x0.70 vs x0.67, q_proj x0.65 both,
    # DeepSeek kv_b x0.96 vs x0.81, expert down_proj x0.84 vs x0.76; M = 48 median x0.99 vs
    # x0.91); on narrower or larger weights it lost (the first sweep, 18:08: DeepSeek q_a x0.59
    # vs x0.78, expert gate_up x0.71 vs x0.89, DeepSeek o_proj x0.53-1.10 vs x1.19)
    dqmma_occupancy_min_n: int = 2560
    dqmma_occupancy_per_sm: int = 4
    ws_min_m: int = 128
    ws_wave_margin: float = 0.15
    ws_wide_min_share: float = 0.75


#: The one table of tuned thresholds (the rules read nothing else).
TUNED = Tuning()


def _pow2_split(tiles: int, k_tiles: int, target: int, min_k_tiles: int) -> int:
    """Smallest power-of-two split-K with ``tiles * split >= target`` (splits >= min_k_tiles)."""
    split = 1
    while tiles * split < target and k_tiles // (split * 2) >= min_k_tiles:
        split *= 2
    return split


def _wave_eff(ctas: int, sms: int) -> float:
    return ctas / (cdiv(ctas, sms) * sms)


def _waves_split(n: int, k: int, block_n: int, block_k: int, sms: int, waves: float) -> int:
    """Split-K up to ~``waves`` x SMs programs, each split >= 1 K-tile, none empty."""
    tiles, k_tiles = cdiv(n, block_n), k // block_k
    return no_empty_splits(k_tiles, max(1, min(cdiv(int(waves * sms), tiles), k_tiles)))


def decode_config(m: int, n: int, k: int, facts: DeviceFacts, *, block_n: int = 64,
                  block_k: int = 256, num_warps: int = 4, num_stages: int = 5,
                  fuse_quant: bool = False, waves: float = TUNED.decode_waves,
                  serial_reduce: bool = True) -> GemmConfig:
    """Decode kernel: ``block_n`` weight rows per program, split-K up to ~``waves`` x SMs
    programs (each split keeps >= 1 K-tile; no empty splits)."""
    bk = fit_block_k(k, block_k)
    return GemmConfig(block_n, DECODE_BLOCK_M, bk, Kernel.DECODE,
                      split_k=_waves_split(n, k, block_n, bk, facts.sms, waves),
                      fuse_quant=fuse_quant, num_warps=num_warps, num_stages=num_stages,
                      serial_reduce=serial_reduce)


def decode_rule(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """The decode kernel where FP8 tensor-core dots exist, M <= ``decode_max_m``, K >=
    ``decode_min_k`` (a multiple of 256) and the 64-row tiles fill ``decode_min_tile_waves``
    waves without split-K (:data:`TUNED`); else None."""
    t = TUNED
    if (m <= t.decode_max_m and k >= t.decode_min_k and k % 256 == 0
            and cdiv(n, 64) >= t.decode_min_tile_waves * facts.sms and facts.fp8_mma):
        return decode_config(m, n, k, facts)
    return None


def gemv_config(m: int, n: int, k: int, facts: DeviceFacts, *, block_n: int = 32,
                block_k: int = 256, num_warps: int = 4, fuse_quant: bool = True,
                waves: float = TUNED.gemv_waves, serial_reduce: bool = True,
                words: bool = True) -> GemmConfig:
    """GEMV kernel: ``block_n`` weight rows per program, split-K up to ~``waves`` x SMs programs
    (each split keeps >= 1 K-tile; no empty splits)."""
    if m > GEMV_MAX_M:
        raise LayoutError(f"the GEMV kernel serves M <= {GEMV_MAX_M}, got M={m}")
    bk = fit_block_k(k, block_k)
    return GemmConfig(block_n, next_pow2(max(m, 1)), bk, Kernel.GEMV,
                      split_k=_waves_split(n, k, block_n, bk, facts.sms, waves),
                      fuse_quant=fuse_quant, num_warps=num_warps, num_stages=1,
                      serial_reduce=serial_reduce, words=words)


def gemv_rule(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """The GEMV kernel at M <= ``gemv_max_m``, K % 128 == 0 (else None), by weight size
    (:data:`TUNED`): under ``gemv_small_weight`` 512-wide K-tiles (K % 512 == 0); from
    ``gemv_large_weight`` pre-permuted activations, ~8 programs per SM; between, M = 1 fused
    quantization, ~``gemv_waves`` programs per SM (16-row programs from ``gemv_short_rows``),
    M = 2 pre-permuted activations, ~``gemv_pair_waves`` per SM."""
    t = TUNED
    if m > t.gemv_max_m or k % 128:
        return None
    if n * k < t.gemv_small_weight and k % 512 == 0:
        return gemv_config(m, n, k, facts, block_k=512)
    if n * k >= t.gemv_large_weight:
        return gemv_config(m, n, k, facts, fuse_quant=False, waves=8)
    if m == 1:
        short_n, short_k = t.gemv_short_rows
        return gemv_config(m, n, k, facts, block_n=16 if n >= short_n and k >= short_k else 32)
    return gemv_config(m, n, k, facts, fuse_quant=False, waves=t.gemv_pair_waves)


def _red_chunk(split: int) -> int:
    """Split-K partials loaded per round trip when the last program of a row tile sums them: all
    of them, within :data:`TUNED` ``red_chunk``."""
    lo, hi = TUNED.red_chunk
    return min(hi, max(lo, next_pow2(split)))


def wgmma_config(m: int, n: int, k: int, facts: DeviceFacts, *, stages: int = 2,
                 waves: float = 3.0, serial_reduce: bool = True, fuse_quant: bool = False,
                 sw_ahead: int = 1, pdl: bool = False, red_chunk: int = 0, max_split: int = 0,
                 cluster: bool = False, block_n: int = 64) -> GemmConfig:
    """Gluon wgmma kernel: ``block_n`` physical weight rows per program (64: one warpgroup; 128:
    two, sharing each quantized activation tile), 128-wide K-tiles in a ring of ``stages`` TMA
    buffers, scale words ``sw_ahead`` K-tiles ahead, split-K up to ~``waves`` x SMs programs (none
    where the row tiles fill ``wgmma_unsplit_tiles_per_sm`` waves, :data:`TUNED`), at most
    ``max_split`` when given; partials summed by the last program of a row tile
    (``serial_reduce``) or by a second kernel; activations quantized inside (``fuse_quant``) or by
    a kernel before. ``cluster``: a row tile's splits are one thread-block cluster, summed through
    distributed shared memory; the split is then the largest of :data:`CLUSTER_SIZES` up to the
    one above (no cluster where that is 1)."""
    tiles = cdiv(n, block_n)
    k_tiles = k // WGMMA_BLOCK_K
    if tiles >= TUNED.wgmma_unsplit_tiles_per_sm * facts.sms:
        split = 1
    else:
        split = max(1, min(cdiv(int(waves * facts.sms), tiles), k_tiles))
    split = min(split, max_split or split)
    if cluster:  # the K-tiles spread evenly over the cluster (none empty)
        split = max(s for s in (1, *CLUSTER_SIZES) if s <= split)
        cluster = split > 1
    else:
        split = no_empty_splits(k_tiles, split)
    return GemmConfig(block_n, WGMMA_MAX_M, WGMMA_BLOCK_K, Kernel.WGMMA, split_k=split,
                      fuse_quant=fuse_quant, num_warps=block_n // 16, num_stages=stages,
                      serial_reduce=serial_reduce, sw_ahead=sw_ahead, pdl=pdl,
                      red_chunk=red_chunk or _red_chunk(split), cluster=cluster)


def wgmma_pdl(m: int, split_k: int, facts: DeviceFacts) -> bool:
    """Programmatic dependent launch where the device allows it, except for an unsplit K at
    M > 8 (the next call's programs, launched early into free slots, end up unevenly spread)."""
    return facts.pdl and not (m > 8 and split_k == 1)


def launch_options(cfg: GemmConfig, m: int, facts: DeviceFacts) -> GemmConfig:
    """The wgmma rule's launch options: PDL where :func:`wgmma_pdl`, with the weight's first tile
    and scale words loaded and the activations' lines asked of L2 before the wait
    (``prefetch``, ``x_prefetch``; unless ``weight_prefetch`` is off); partials summed by a second
    kernel are stored in the weight's physical row order (``phys_partials``), loaded after the
    first in one chunk, and under PDL that kernel lets the next launch at once
    (``red_release``)."""
    pdl = wgmma_pdl(m, cfg.split_k, facts)
    two_kernel = cfg.split_k > 1 and not cfg.cluster and not cfg.serial_reduce
    chunk = min(TUNED.red_chunk[1], next_pow2(cfg.split_k - 1)) if two_kernel else cfg.red_chunk
    early = pdl and facts.weight_prefetch
    return dataclasses.replace(cfg, pdl=pdl, prefetch=early, x_prefetch=early,
                               red_release=pdl and two_kernel, phys_partials=two_kernel,
                               red_chunk=chunk)


def _wide_split(n: int, k: int, facts: DeviceFacts) -> int:
    """At M = 9..16, where a second kernel sums the partials: the split of K (2..16, none empty,
    at least ``wgmma_split_tiles`` K-tiles each) that gives 128-row programs
    ``wgmma_wide_per_sm`` programs per SM (:data:`TUNED`), the most even (a row tile lasts as long
    as its longest split), then the most programs; 0 where none does."""
    t = TUNED
    k_tiles, pairs = k // WGMMA_BLOCK_K, cdiv(n, 128)
    lo, hi = t.wgmma_wide_per_sm
    fits = [s for s in {no_empty_splits(k_tiles, s) for s in range(2, 17)}
            if s >= 2 and cdiv(k_tiles, s) >= t.wgmma_split_tiles
            and lo <= pairs * s / facts.sms <= hi]
    return max(fits, key=lambda s: (k_tiles / (s * cdiv(k_tiles, s)), s), default=0)


def _wgmma_clustered(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """The wgmma rule's cluster configs (the splits of a row tile summed through distributed
    shared memory), or None: at M = 9..16, 128-row programs in clusters of
    ``wgmma_wide_cluster`` where that makes ``wgmma_wide_per_sm`` programs per SM; else at M <= 8
    wherever K is split (~3 programs per SM, at most 8 splits, 16 where 8 leave
    ``wgmma_cluster_idle_share`` of the SMs idle) and at M = 9..16 on weights of at most
    ``wgmma_cluster_max_tiles`` row tiles (~2 per SM, up to 16 splits); at least two K-tiles a
    split (:data:`TUNED`)."""
    t = TUNED
    if not facts.clusters:
        return None
    lo, hi = t.wgmma_wide_per_sm
    wide = t.wgmma_wide_cluster * cdiv(n, 128) / facts.sms  # 128-row programs per SM
    if m > 8 and k >= t.wgmma_wide_min_k and lo <= wide <= hi:
        return wgmma_config(m, n, k, facts, waves=16, fuse_quant=True, sw_ahead=2,
                            max_split=t.wgmma_wide_cluster, cluster=True, block_n=128)
    tiles = cdiv(n, 64)
    if m <= 8 or tiles <= t.wgmma_cluster_max_tiles:
        idle = tiles * 8 < t.wgmma_cluster_idle_share * facts.sms
        cap = min(16 if m > 8 or idle else 8, k // 256)
        cfg = wgmma_config(m, n, k, facts, waves=3 if m <= 8 else 2, fuse_quant=True, sw_ahead=2,
                           max_split=cap, cluster=True)
        return cfg if cfg.cluster else None
    return None


def wgmma_rule(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """The Gluon wgmma kernel's config, or None off Hopper, without Gluon, at M > 16, K % 128 != 0,
    and at M = 1 on weights under ``wgmma_small_weight`` without PDL (:data:`TUNED`). Activations
    quantized inside the kernel, scale words two K-tiles ahead, :func:`launch_options`.

    Clusters first (:func:`_wgmma_clustered`); elsewhere the partials go through global memory,
    split-K up to this many programs per SM ("waves"; from M = 4 at most ``wgmma_max_split``
    splits), by weight size:

    ========  ======================  =====================  ================
    M         < wgmma_small_weight    .. wgmma_mid_weight    larger
    ========  ======================  =====================  ================
    1..8      2                       3                      3
    9..16     1                       2                      3
    ========  ======================  =====================  ================

    The last program of a row tile sums them, or a second kernel: at M = 5..8 where K is split
    2..``wgmma_two_kernel_split`` ways on weights from ``wgmma_small_weight`` to under
    ``wgmma_huge_weight``; at M = 9..16 wherever K is split, except more than
    ``wgmma_two_kernel_split`` splits of a weight under ``wgmma_small_weight``. There, 128-row
    programs with :func:`_wide_split` where it finds a split; else splits of
    ``wgmma_split_tiles`` K-tiles where that is 2..``wgmma_two_kernel_split`` splits of at most
    ``wgmma_even_per_sm`` programs per SM.
    """
    t = TUNED
    if m > WGMMA_MAX_M or k % WGMMA_BLOCK_K or not facts.hopper:
        return None
    size = n * k
    if (size < t.wgmma_small_weight and m == 1 and not facts.pdl) or not facts.gluon:
        return None
    if (cfg := _wgmma_clustered(m, n, k, facts)) is not None:
        return launch_options(cfg, m, facts)
    if m <= 8:
        waves = 2 if size < t.wgmma_small_weight else 3
    else:
        waves = 1 if size < t.wgmma_small_weight else 2 if size < t.wgmma_mid_weight else 3
    cfg = wgmma_config(m, n, k, facts, waves=waves, fuse_quant=True, sw_ahead=2,
                       max_split=t.wgmma_max_split if m >= 4 else 0)
    split = cfg.split_k
    if m <= 8:
        two_kernel = (m >= 5 and 1 < split <= t.wgmma_two_kernel_split
                      and t.wgmma_small_weight <= size < t.wgmma_huge_weight)
    else:
        two_kernel = split > 1 and (size >= t.wgmma_small_weight
                                    or split <= t.wgmma_two_kernel_split)
        even = k // WGMMA_BLOCK_K // t.wgmma_split_tiles
        if two_kernel and (wide := _wide_split(n, k, facts)):
            cfg = dataclasses.replace(cfg, block_n=128, num_warps=8, split_k=wide)
        elif (two_kernel and even * t.wgmma_split_tiles * WGMMA_BLOCK_K == k
              and 2 <= even <= t.wgmma_two_kernel_split
              and cdiv(n, 64) * even <= t.wgmma_even_per_sm * facts.sms):
            cfg = dataclasses.replace(cfg, split_k=even)
    return launch_options(dataclasses.replace(cfg, serial_reduce=not two_kernel), m, facts)


def cublas_config(m: int, n: int, k: int, *, chunk_n: int = 0) -> GemmConfig:
    """The cuBLAS path: 64 x 256 dequantization tiles, ``chunk_n`` rows per chunk (default: the
    most multiple-of-128 rows whose bf16 copy fits ``dequant_workspace``, :data:`TUNED`)."""
    if not chunk_n:
        chunk_n = min(n, max(128, TUNED.dequant_workspace // k // 128 * 128))
    return GemmConfig(64, 0, fit_block_k(k, 256), Kernel.CUBLAS, fuse_quant=False,
                      chunk_n=chunk_n)


def block128_config(m: int, n: int, k: int, *, chunk_n: int = 0) -> GemmConfig:
    """The block-128 path: 64 x 256 regrouping tiles, ``chunk_n`` rows per chunk (default: the
    most multiple-of-128 rows whose FP8 copy fits the bytes of the cuBLAS path's workspace,
    ``2 * dequant_workspace`` elements, :data:`TUNED`: every model shape in one chunk, where two
    chunks of half that cost DeepSeek o_proj / MLP down / MLP gate_up at M = 8192 x0.92 / 0.93 /
    0.98 against x1.01 / 1.03 / 1.16 in one, prefill_fp8.py --block128, H100)."""
    if not chunk_n:
        chunk_n = min(n, max(128, 2 * TUNED.dequant_workspace // k // 128 * 128))
    return GemmConfig(64, 0, fit_block_k(k, 256), Kernel.BLOCK128, fuse_quant=False,
                      chunk_n=chunk_n)


def block128_wins(m: int, n: int, k: int, facts: DeviceFacts) -> bool:
    """The block-128 path serves (M, N, K) (:data:`TUNED`, ``block128_*``): cuBLAS has the
    recipe, K % 128 == 0, N % 16 == 0 (cuBLAS's FP8 operands), M >= ``block128_min_m`` and N >=
    ``block128_min_n``."""
    t = TUNED
    return (facts.block_fp8 and k % 128 == 0 and n % 16 == 0 and m >= t.block128_min_m
            and n >= t.block128_min_n)


def tile_config(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig:
    """The tile kernel, by M (:data:`TUNED`): up to ``tile_stream_max_m`` 64-row weight tiles,
    split-K up to ~``tile_small_waves`` programs per SM on weights under
    ``tile_one_kernel_weight`` (one kernel: activations quantized inside at M <= 16, the last
    program of a tile sums the splits) and ~``tile_large_waves`` on larger ones (quantize, GEMM
    and reduce kernels); up to ``tile_mid_max_m`` 128x128 tiles (64x64 where N <=
    ``tile_narrow_n``), split-K while fewer than half the SMs are busy; above, 128x256x64 tiles,
    8 warps, split-K = 2 where it fixes a poor last wave."""
    t, sms = TUNED, facts.sms
    small = n * k < t.tile_one_kernel_weight
    if m <= t.tile_stream_max_m:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        cfg = GemmConfig(64, bm, fit_block_k(k, 128), fuse_quant=small and m <= 16,
                         num_warps=4, num_stages=4, serial_reduce=small)
        tiles = cdiv(n, 64) * cdiv(m, bm)
        target = int(t.tile_small_waves * sms) if small else t.tile_large_waves * sms
        return dataclasses.replace(cfg, split_k=_pow2_split(tiles, k // cfg.block_k, target, 2))
    if m <= t.tile_mid_max_m:
        if n <= t.tile_narrow_n:
            cfg = GemmConfig(64, 64, fit_block_k(k, 128), fuse_quant=False, num_warps=4,
                             num_stages=4)
        else:
            cfg = GemmConfig(128, 128, fit_block_k(k, 64), fuse_quant=False, num_warps=8,
                             num_stages=4)
        tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
        split = _pow2_split(tiles, k // cfg.block_k, sms // 2, 4)
        return dataclasses.replace(cfg, split_k=split, serial_reduce=False)
    cfg = GemmConfig(128, 256, fit_block_k(k, 64), fuse_quant=False, num_warps=8,
                     num_stages=4 if m <= 4096 else 3, serial_reduce=False)
    tiles = cdiv(n, 128) * cdiv(m, 256)
    if _wave_eff(2 * tiles, sms) > _wave_eff(tiles, sms) + 0.1 and k // 2 >= 2048:
        cfg = dataclasses.replace(cfg, split_k=2)
    return cfg


def _dqmma_block_m(m: int, n: int) -> int:
    """:func:`dqmma_config`'s default tokens a program."""
    return 32 if m <= 32 else 64 if m <= 128 else 128 if n <= TUNED.dqmma_narrow_n else 256


def dqmma_config(m: int, n: int, k: int, facts: DeviceFacts, *, block_n: int = 64,
                 block_m: int = 0, stages: int = 3, waves: float = 0.0,
                 specialized: bool = False) -> GemmConfig:
    """The dequantizing wgmma kernel (``dqmma.py``): ``block_n`` weight rows and ``block_m`` tokens
    per program (default: 32 up to M = 32, 64 up to M = 128, 128 where N <= ``dqmma_narrow_n``,
    else 256), ``stages`` TMA buffers; split-K to ~``waves`` x SMs programs (at
    most that many where one program fills an SM: the specialized kernel, 128 or 256 tokens)
    (default ``dqmma_waves`` up to M = 128, else ``dqmma_wide_waves``), at least
    ``dqmma_min_split_tiles`` K-tiles a split, none where the tiles fill ``dqmma_tail_waves`` waves
    (above M = 128: ``dqmma_wide_unsplit_share`` of the SMs) (:data:`TUNED`)."""
    t = TUNED
    bm = block_m or _dqmma_block_m(m, n)
    waves = waves or (t.dqmma_waves if m <= 128 else t.dqmma_wide_waves)
    tiles, k_tiles = cdiv(n, block_n) * cdiv(m, bm), k // WGMMA_BLOCK_K
    split = 1
    if tiles < facts.sms * (t.dqmma_tail_waves if m <= 128 else t.dqmma_wide_unsplit_share):
        target = int(waves * facts.sms)
        # one program an SM (the specialized kernel's ~200 KB ring; 128 or 256 tokens: 120 or
        # 216 KB): no more programs than the waves hold; else up to three share an SM
        alone = specialized or bm >= 128
        split = max(1, min(target // tiles if alone else cdiv(target, tiles),
                           k_tiles // t.dqmma_min_split_tiles))
    return GemmConfig(block_n, bm, WGMMA_BLOCK_K, Kernel.DQMMA,
                      split_k=no_empty_splits(k_tiles, split), fuse_quant=False,
                      num_warps=4 if specialized else block_n // 16, num_stages=stages,
                      specialized=specialized)


def tall_config(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """At M = 65..128: the one-chain dqmma kernel's programs of 128 tokens, K split to
    ``dqmma_tall_waves`` waves, where the weight's 64-row tiles fit the SMs (128 rows a program
    where K >= ``dqmma_tall_wide_k``) or its 128-row tiles fit them and fill
    ``ws_wide_min_share`` of them (:data:`TUNED`); else None."""
    t = TUNED
    if not 64 < m <= 128:
        return None
    if cdiv(n, 64) <= facts.sms:
        block_n = 128 if k >= t.dqmma_tall_wide_k else 64
    elif t.ws_wide_min_share * facts.sms <= cdiv(n, 128) <= facts.sms:
        block_n = 128
    else:
        return None
    return dqmma_config(m, n, k, facts, block_n=block_n, block_m=128, waves=t.dqmma_tall_waves)


def pair_config(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig:
    """At M = 65..128: the one-chain dqmma kernel's programs of 128 weight rows and 128 tokens in
    a ring of 2, two an SM, K split to ``dqmma_pair_waves`` waves of them (:data:`TUNED`)."""
    return dqmma_config(m, n, k, facts, block_n=128, block_m=128, stages=2,
                        waves=TUNED.dqmma_pair_waves)


def occupancy_config(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """At M = 33..64 (``dqmma_config``'s 64-token programs) on weights of fewer than
    ``dqmma_pdl_max_weight`` elements and at least ``dqmma_occupancy_min_n`` rows: 64-row programs
    in a ring of 2, K split for about ``dqmma_occupancy_per_sm`` programs an SM (at least
    ``dqmma_min_split_tiles`` K-tiles a split) (:data:`TUNED`); else None."""
    t = TUNED
    if not (32 < m <= 64 and n * k < t.dqmma_pdl_max_weight and n >= t.dqmma_occupancy_min_n):
        return None
    tiles, k_tiles = cdiv(n, 64), k // WGMMA_BLOCK_K
    split = max(1, min(round(t.dqmma_occupancy_per_sm * facts.sms / tiles),
                       k_tiles // t.dqmma_min_split_tiles))
    return dataclasses.replace(dqmma_config(m, n, k, facts, stages=2),
                               split_k=no_empty_splits(k_tiles, split))


def specialized_wins(m: int, n: int, k: int, facts: DeviceFacts) -> bool:
    """Whether the serving rule takes the warp-specialized dqmma at M = ``ws_min_m`` + 1 ..
    ``dqmma_max_m``: its 128-row programs of 256 tokens run unsplit
    (``dqmma_wide_unsplit_share`` of the SMs or more) and their waves are no more than
    ``ws_wave_margin`` emptier than those of :func:`dqmma_config`'s one-chain programs (one an
    SM) (:data:`TUNED`)."""
    t = TUNED
    if not t.ws_min_m < m <= t.dqmma_max_m:
        return False
    ws = cdiv(n, 128) * cdiv(m, 256)
    one = cdiv(n, 64) * cdiv(m, _dqmma_block_m(m, n))
    return (ws >= t.dqmma_wide_unsplit_share * facts.sms
            and _wave_eff(ws, facts.sms) >= _wave_eff(one, facts.sms) - t.ws_wave_margin)


def dqmma_launch(cfg: GemmConfig, n: int, k: int, facts: DeviceFacts) -> GemmConfig:
    """The dqmma path's launch options: where the device allows PDL and the weight has fewer
    than ``dqmma_pdl_max_weight`` elements (:data:`TUNED`), the quantization, the kernel and the
    split-K reduction as a chain of programmatic dependent launches, each releasing the next at
    once; the kernel's first weight tiles and scale words before its wait (unless
    ``weight_prefetch`` is off)."""
    pdl = facts.pdl and n * k < TUNED.dqmma_pdl_max_weight
    return dataclasses.replace(cfg, pdl=pdl, prefetch=pdl and facts.weight_prefetch,
                               red_release=pdl and cfg.split_k > 1)


def serving_rule(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """Serving batches on Hopper with Gluon, M = 17 .. ``dqmma_max_m``, K % 128 == 0 (else None):
    :func:`dqmma_config` (warp-specialized where :func:`specialized_wins`: 128-row programs of 256
    tokens); at M = 65..128 with K >= ``dqmma_pair_min_k`` :func:`pair_config` (two 128-token
    programs an SM), else :func:`tall_config` where it gives one (128-token programs, one an SM),
    else up to M = ``dqmma_pair_max_m`` :func:`pair_config`; at M <= ``serve_wgmma_max_m`` the
    FP8 wgmma kernel instead (128-row programs,
    split-K to ~``serve_wgmma_waves`` waves, at most ``serve_wgmma_per_sm`` programs per SM, summed
    by a second kernel, :func:`launch_options`) unless the weight's 64-row tiles fill the SMs or
    K >= ``serve_dqmma_min_k``; at M = 33..64 :func:`occupancy_config` where it gives one;
    above ``dqmma_wide_m`` only for N >= ``dqmma_wide_min_n`` or N <=
    ``dqmma_narrow_n`` (None: cuBLAS) (:data:`TUNED`)."""
    t = TUNED
    if (not facts.hopper or not facts.gluon or k % WGMMA_BLOCK_K
            or not WGMMA_MAX_M < m <= t.dqmma_max_m):
        return None
    if m > t.dqmma_wide_m and t.dqmma_narrow_n < n < t.dqmma_wide_min_n:
        return None
    if specialized_wins(m, n, k, facts):
        return dqmma_launch(dqmma_config(m, n, k, facts, block_n=128, block_m=256,
                                         specialized=True, stages=2), n, k, facts)
    if 64 < m <= 128 and k >= t.dqmma_pair_min_k:
        return dqmma_launch(pair_config(m, n, k, facts), n, k, facts)
    if (cfg := tall_config(m, n, k, facts)) is not None:
        return dqmma_launch(cfg, n, k, facts)
    if 64 < m <= t.dqmma_pair_max_m:
        return dqmma_launch(pair_config(m, n, k, facts), n, k, facts)
    if (m <= t.serve_wgmma_max_m and cdiv(n, 64) < facts.sms
            and k < t.serve_dqmma_min_k):
        per_sm = max(1, t.serve_wgmma_per_sm * facts.sms // cdiv(n, 128))
        cfg = wgmma_config(m, n, k, facts, waves=t.serve_wgmma_waves, fuse_quant=True,
                           sw_ahead=2, max_split=min(t.wgmma_max_split, per_sm), block_n=128,
                           serial_reduce=False)
        return launch_options(dataclasses.replace(cfg, serial_reduce=cfg.split_k == 1), m,
                              facts)
    if (cfg := occupancy_config(m, n, k, facts)) is not None:
        return dqmma_launch(cfg, n, k, facts)
    return dqmma_launch(dqmma_config(m, n, k, facts), n, k, facts)


#: The rules :func:`choose_config` asks, in order, below ``cublas_min_m``.
RULES = (wgmma_rule, gemv_rule, decode_rule)


def choose_config(m: int, n: int, k: int, facts: DeviceFacts) -> GemmConfig:
    """The config of a GEMM ``[M, K] x [N, K]^T`` on a device with ``facts`` (module docstring)."""
    if (cfg := serving_rule(m, n, k, facts)) is not None:
        return cfg
    if block128_wins(m, n, k, facts):
        return block128_config(m, n, k)
    if m >= TUNED.cublas_min_m:
        return cublas_config(m, n, k)
    for rule in RULES:
        if (cfg := rule(m, n, k, facts)) is not None:
            return cfg
    return tile_config(m, n, k, facts)
