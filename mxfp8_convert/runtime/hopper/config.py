"""What one GEMM call runs: the kernel (:class:`Kernel`) and its launch parameters.

Pure Python (no torch, no Triton), shared by the selection rules (``rules.py``), the launchers
(``launch.py``) and the Gluon kernel's launcher (``wgmma.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields


class Kernel(enum.Enum):
    """The kernel family a config runs (one module each in this package)."""

    TILE = "tile"  # tile.py: dequantized weight tiles, bf16 MMA; any M
    DECODE = "decode"  # decode.py: weight stream, one FP8 MMA per 32-block; M <= DECODE_BLOCK_M
    GEMV = "gemv"  # gemv.py: weight stream on CUDA cores; M <= GEMV_MAX_M
    CUBLAS = "cublas"  # dequant.py + cuBLAS: the weight dequantized chunk by chunk; large M
    BLOCK128 = "block128"  # regroup.py + cuBLAS FP8, one scale per 128 of K; large M, K % 128 == 0
    WGMMA = "wgmma"  # wgmma.py (Gluon): FP8 wgmma per 32-block, four in flight; Hopper, M <= 32
    DQMMA = "dqmma"  # dqmma.py (Gluon): weight dequantized in registers, bf16 wgmma; Hopper, M > 16


#: The decode kernel pads M to this (the N of its FP8 MMA); it serves M <= DECODE_BLOCK_M.
DECODE_BLOCK_M = 16
#: The GEMV kernel keeps one accumulator per activation row; it serves M <= GEMV_MAX_M.
GEMV_MAX_M = 4
#: The wgmma rule (decode) serves M <= WGMMA_MAX_M (the kernel: up to 32, ``serving_rule``), K in
#: tiles of WGMMA_BLOCK_K (the dqmma kernel's K-tile too).
WGMMA_MAX_M = 16
WGMMA_BLOCK_K = 128
#: Programs per thread-block cluster the wgmma kernel's launch accepts: up to 8 (portable), and
#: 16, which Triton's launcher allows as non-portable (Hopper, Blackwell).
CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8, 16)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile shape and launch parameters of one GEMM call (``block_n`` = weight rows per tile)."""

    block_n: int
    block_m: int
    block_k: int
    kind: Kernel = Kernel.TILE
    split_k: int = 1
    fuse_quant: bool = True  # activations quantized inside the GEMM kernel (else by one before)
    num_warps: int = 4
    num_stages: int = 3
    group_n: int = 8  # tile: weight tiles that walk down M together (L2 reuse)
    serial_reduce: bool = False  # split-K: the last program of a tile sums the partials
    words: bool = True  # gemv: convert the weight bytes from int32 words with integer ops
    chunk_n: int = 0  # cublas, block128: weight rows per chunk (0: as many as the workspace holds)
    sw_ahead: int = 1  # wgmma: K-tiles ahead of use that the weight scale words are loaded
    pdl: bool = False  # wgmma: programmatic dependent launch (``wgmma.wgmma_decode``)
    red_chunk: int = 4  # wgmma: split-K partials loaded per round trip when they are summed
    x_words: bool = True  # wgmma, fused: bf16 activations loaded as int32 words of two
    cluster: bool = False  # wgmma, split-K: a row tile's splits are one cluster, summed via DSMEM
    prefetch: bool = False  # wgmma with PDL: the weight's first tiles loaded before the wait
    red_release: bool = False  # wgmma with PDL: the reduction kernel releases the next at once
    phys_partials: bool = False  # wgmma, two kernels: partials in the weight's physical row order
    x_prefetch: bool = False  # wgmma, prefetch: activation lines asked of L2 before the wait
    specialized: bool = False  # dqmma: a TMA producer warp and block_n / 64 consumer warpgroups

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["kind"] = self.kind.value
        return d


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python: Triton's is a constexpr function, slow to call on the
    launch paths (``benchmarks/bench_host.py``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (n >= 1)."""
    return 1 << (n - 1).bit_length()


def fit_block_k(k: int, want: int) -> int:
    """Largest of ``want, want/2, ..., 32`` dividing ``k`` (K % 32 == 0 is checked earlier)."""
    bk = want
    while k % bk:
        bk //= 2
    return bk


def no_empty_splits(k_tiles: int, split: int) -> int:
    """The split-K count the kernels that give each split ``cdiv(k_tiles, split)`` K-tiles really
    use: at most ``split``, none of the splits empty."""
    return cdiv(k_tiles, cdiv(k_tiles, split))
