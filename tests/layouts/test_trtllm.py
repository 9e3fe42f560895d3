"""trtllm weight-scale layout: pad rows to ceil128(N), P32 row shuffle, 128x4 swizzle.

``flashinfer.shuffle_matrix_sf_a`` refuses CPU tensors, so the CPU proof rebuilds its composition
from FlashInfer's own pieces (``get_shuffle_matrix_sf_a_row_indices``, ``shuffle_matrix_a`` and
its pure-torch 128x4 reference) and checks element offsets against LAYOUTS.md section 2; the CUDA
function itself is compared under the ``gpu`` marker.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts import (
    p32_shuffle_rows,
    swizzle_128x4,
    trtllm_scale_from_canonical,
    trtllm_scale_shape,
    trtllm_scale_to_canonical,
    unswizzle_128x4,
)

# [N, C] scale shapes: N = 576 (fused MLA qkv, not a multiple of 128), other multiples of 32
# that need row padding, C not a multiple of 4, and aligned ones.
SHAPES = [(32, 1), (96, 3), (128, 4), (160, 6), (576, 7), (256, 224), (4096, 16)]
FI_SWIZZLE_REF = (
    "flashinfer.experimental.b12x.moe._shared.kernels.reference_flashinfer"
    ":_block_scale_interleave_128x4_torch"
)

# FlashInfer builds its block-scale kernels for SM90 and newer only (get_fp4_quantization_module).
SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="FlashInfer's block-scale kernels need SM90+",
)


def ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_rows(s: torch.Tensor, rows: int) -> torch.Tensor:
    out = s.new_zeros((rows, s.shape[1]))
    out[: s.shape[0]] = s
    return out


def spec_shuffled_row(r: int) -> int:
    """Where P32 moves logical row ``r`` (the inverse of LAYOUTS.md's
    ``32*(p//32) + 4*(p%8) + (p%32)//8``)."""
    return 32 * (r // 32) + 8 * (r % 4) + (r % 32) // 4


def spec_offset(r: int, c: int, cp: int) -> int:
    """LAYOUTS.md section 2: trtllm byte offset of logical scale element ``(r, c)``, in Python
    ints."""
    p = spec_shuffled_row(r)
    return (
        (p // 128) * (cp // 4) * 512
        + (c // 4) * 512
        + (p % 32) * 16
        + ((p % 128) // 32) * 4
        + c % 4
    )


def flashinfer_composition(flashinfer, s: torch.Tensor, swizzle) -> torch.Tensor:
    """``shuffle_matrix_sf_a(s, 128, 32)`` as FlashInfer composes it, minus the CUDA-only kernel."""
    from flashinfer.utils import get_shuffle_matrix_sf_a_row_indices

    padded = pad_rows(s.view(torch.uint8), ceil_to(s.shape[0], 128))  # SGLang pads first
    idx = get_shuffle_matrix_sf_a_row_indices(padded, 128, 32)
    return swizzle(padded[idx]).flatten()


# --- FlashInfer parity on CPU -----------------------------------------------------------------


@pytest.mark.parametrize("n, c", SHAPES)
def test_equals_flashinfer_row_indices_then_128x4(
    flashinfer, flashinfer_ref, n, c, random_bytes, same_bytes
):
    s = random_bytes((n, c), seed=n + c, dtype=torch.float8_e8m0fnu)
    got = trtllm_scale_from_canonical(s).flatten()
    same_bytes(got, flashinfer_composition(flashinfer, s, swizzle_128x4), "vs FI rows + our 128x4")
    reference = flashinfer_ref(FI_SWIZZLE_REF)
    same_bytes(got, flashinfer_composition(flashinfer, s, reference), "vs FI rows + FI 128x4 ref")


@pytest.mark.parametrize("n, c", SHAPES)
def test_unswizzled_rows_equal_flashinfer_shuffle_matrix_a(
    flashinfer, flashinfer_ref, n, c, random_bytes, same_bytes
):
    s = random_bytes((n, c), seed=3 * n + c)
    np_ = ceil_to(n, 128)
    unswizzle = flashinfer_ref("flashinfer.trace.templates.gemm:_unswizzle_sf_128x4")
    rows = unswizzle(trtllm_scale_from_canonical(s).flatten(), np_, c)
    same_bytes(rows, flashinfer.shuffle_matrix_a(pad_rows(s, np_), 128), "P32 rows of the scale")


# --- LAYOUTS.md formula, element by element -------------------------------------------------------


@pytest.mark.parametrize("n, c", [(32, 1), (96, 3), (160, 6), (288, 9)])
def test_matches_spec_formula(n, c, random_bytes, same_bytes):
    s = random_bytes((n, c), seed=n * 7 + c)
    cp, values = ceil_to(c, 4), s.tolist()
    want = bytearray(ceil_to(n, 128) * cp)
    for r in range(n):
        for col in range(c):
            want[spec_offset(r, col, cp)] = values[r][col]
    got = trtllm_scale_from_canonical(s)
    same_bytes(
        got, torch.frombuffer(want, dtype=torch.uint8).reshape(got.shape), "trtllm vs formula"
    )


def test_scale_row_p_belongs_to_shuffled_weight_row_p(random_bytes, same_bytes):
    """Module docstring: scale row p of the layout is the scale of physical weight row p."""
    s = random_bytes((576, 5), seed=2)
    rows = unswizzle_128x4(trtllm_scale_from_canonical(s), 640, 5)
    same_bytes(rows[:576], p32_shuffle_rows(s), "scale rows vs P32 weight rows")
    assert not rows[576:].any(), "padding rows must be 0"


# --- golden bytes -------------------------------------------------------------------------------
# Derived once by hand from the formula above and kept as literals. Bytes not listed are 0.


def from_sparse(size: int, nonzero: dict[int, int]) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    for offset, value in nonzero.items():
        out[offset] = value
    return out


def test_golden_32x1(same_bytes):
    # s[r, 0] = r + 1; padded to 128 rows, one 512-byte tile. Row r moves to p = 8*(r%4) + r//4
    # and lands at byte p*16: rows 0, 4, 8, ... at 0, 16, 32, ...; rows 1, 5, ... at 128, 144, ...
    s = (torch.arange(32) + 1).reshape(32, 1).to(torch.uint8)
    golden = {
        0: 1, 16: 5, 32: 9, 48: 13, 64: 17, 80: 21, 96: 25, 112: 29,
        128: 2, 144: 6, 160: 10, 176: 14, 192: 18, 208: 22, 224: 26, 240: 30,
        256: 3, 272: 7, 288: 11, 304: 15, 320: 19, 336: 23, 352: 27, 368: 31,
        384: 4, 400: 8, 416: 12, 432: 16, 448: 20, 464: 24, 480: 28, 496: 32,
    }  # fmt: skip
    same_bytes(trtllm_scale_from_canonical(s).flatten(), from_sparse(512, golden), "trtllm golden")


def test_golden_160x6_two_by_two_tiles(same_bytes):
    s = torch.zeros(160, 6, dtype=torch.uint8)  # Np = 256, Cp = 8: tiles [2, 2, 512]
    marks = {(0, 0): 1, (1, 0): 2, (4, 0): 3, (31, 3): 4, (33, 1): 5, (5, 4): 6,
             (130, 5): 7, (159, 0): 8}  # fmt: skip
    for (r, c), v in marks.items():
        s[r, c] = v
    golden = {
        0: 1,  # (0, 0): p = 0
        128: 2,  # (1, 0): p = 8, 8*16
        16: 3,  # (4, 0): p = 1
        499: 4,  # (31, 3): p = 31, 31*16 + 3
        133: 5,  # (33, 1): p = 40, (40%32)*16 + (40//32)*4 + 1
        656: 6,  # (5, 4): p = 9, 512 + 9*16
        1793: 7,  # (130, 5): p = 144, 1024 + 512 + 16*16 + 1
        1520: 8,  # (159, 0): p = 159, 1024 + 31*16
    }
    same_bytes(trtllm_scale_from_canonical(s).flatten(), from_sparse(2048, golden), "trtllm golden")
    same_bytes(trtllm_scale_to_canonical(from_sparse(2048, golden), 160, 6), s, "golden inverse")


# --- properties -------------------------------------------------------------------------------

rows_st = st.one_of(st.sampled_from([32, 96, 160, 576]), st.integers(1, 12).map(lambda b: 32 * b))
cols_st = st.one_of(st.sampled_from([1, 3, 4, 5, 7]), st.integers(1, 12))
batch_st = st.sampled_from([(), (1,), (3,), (2, 2)])
dtype_st = st.sampled_from([torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn])


@settings(max_examples=40, deadline=None)
@given(n=rows_st, c=cols_st, batch=batch_st, dtype=dtype_st, seed=st.integers(0, 2**31))
def test_round_trip_shape_and_expert_stride(n, c, batch, dtype, seed, random_bytes, same_bytes):
    s = random_bytes((*batch, n, c), seed, dtype)
    t = trtllm_scale_from_canonical(s)
    assert t.dtype == torch.uint8 and t.is_contiguous()
    assert tuple(t.shape) == (*batch, *trtllm_scale_shape(n, c))
    same_bytes(trtllm_scale_to_canonical(t, n, c), s, "to_canonical(from_canonical(s))")
    same_bytes(trtllm_scale_to_canonical(t.reshape(*batch, -1), n, c), s, "from flat bytes")
    stride = ceil_to(n, 128) * ceil_to(c, 4)
    flat, experts = t.flatten(), s.reshape(-1, n, c)
    for e in range(experts.shape[0]):
        same_bytes(
            flat[e * stride : (e + 1) * stride],
            trtllm_scale_from_canonical(experts[e]).flatten(),
            f"expert {e}",
        )


@settings(max_examples=20, deadline=None)
@given(n=rows_st, c=cols_st, experts=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_stacked_equals_flashinfer_composition_per_expert(
    flashinfer, n, c, experts, seed, random_bytes, same_bytes
):
    s = random_bytes((experts, n, c), seed)
    want = torch.cat(
        [flashinfer_composition(flashinfer, s[e], swizzle_128x4) for e in range(experts)]
    )
    same_bytes(trtllm_scale_from_canonical(s).flatten(), want, "stacked trtllm vs FlashInfer")


@settings(max_examples=30, deadline=None)
@given(n=rows_st, c=st.integers(1, 24), data=st.data())
def test_tile_slices_are_the_layout_of_tp_slices(n, c, data, random_bytes, same_bytes):
    """LAYOUTS.md section 2: P32 stays inside 32-row blocks, so tiles slice like the plain 128x4."""
    s = random_bytes((n, c), seed=n * 13 + c)
    t = trtllm_scale_from_canonical(s)
    tr, tc, _ = t.shape
    a = data.draw(st.integers(0, tr - 1), label="first row tile")
    b = data.draw(st.integers(a + 1, tr), label="end row tile")
    same_bytes(
        t[a:b], trtllm_scale_from_canonical(s[128 * a : 128 * b]), "row (column-parallel) slice"
    )
    i = data.draw(st.integers(0, tc - 1), label="first K tile")
    j = data.draw(st.integers(i + 1, tc), label="end K tile")
    same_bytes(
        t[:, i:j], trtllm_scale_from_canonical(s[:, 4 * i : 4 * j]), "K (row-parallel) slice"
    )


# --- dtypes and errors --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16])
def test_rejects_wider_dtypes(dtype):
    with pytest.raises(LayoutError, match="expected a 1-byte dtype"):
        trtllm_scale_from_canonical(torch.zeros(32, 4, dtype=dtype))
    with pytest.raises(LayoutError, match="expected a 1-byte dtype"):
        trtllm_scale_to_canonical(torch.zeros(1, 1, 512, dtype=dtype), 32, 4)


def test_to_canonical_rejects_tiles_of_another_shape():
    t = trtllm_scale_from_canonical(torch.zeros(96, 3, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="do not hold a"):
        trtllm_scale_to_canonical(t, 160, 3)


def test_rejects_rows_not_multiple_of_32():
    with pytest.raises(LayoutError):
        trtllm_scale_from_canonical(torch.zeros(100, 4, dtype=torch.uint8))


def test_rejects_one_dimensional_scales():
    with pytest.raises(LayoutError):
        trtllm_scale_from_canonical(torch.zeros(32, dtype=torch.uint8))


# --- GPU: FlashInfer's own shuffle_matrix_sf_a (refuses CPU tensors) ---------------------------


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("n, c", SHAPES)
@pytest.mark.parametrize("num_elts_per_sf", [32, 16])  # LAYOUTS.md: does not change the bytes
def test_equals_shuffle_matrix_sf_a_on_cuda(
    flashinfer, n, c, num_elts_per_sf, random_bytes, same_bytes
):
    s = random_bytes((n, c), seed=n + 5 * c)
    padded = pad_rows(s, ceil_to(n, 128)).cuda()  # FlashInfer asserts rows % 128 == 0
    want = flashinfer.shuffle_matrix_sf_a(padded, 128, num_elts_per_sf)
    same_bytes(trtllm_scale_from_canonical(s).flatten(), want.flatten(), "vs shuffle_matrix_sf_a")
    same_bytes(trtllm_scale_from_canonical(s.cuda()).flatten(), want.flatten(), "on CUDA")


# --- numpy twin (the converter's torch-free path) ----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12).map(lambda b: 32 * b), c=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_array_equals_torch_from_canonical(n, c, seed):
    import numpy as np

    from mxfp8_convert.layouts import trtllm_scale_from_canonical_array, trtllm_scale_shape

    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 256, (n, c), dtype=torch.uint8, generator=gen)
    got = trtllm_scale_from_canonical_array(s.numpy())
    assert got.dtype == np.uint8 and got.shape == trtllm_scale_shape(n, c)
    assert got.tobytes() == trtllm_scale_from_canonical(s).numpy().tobytes()


def test_array_refuses_rows_not_multiple_of_32():
    import numpy as np

    from mxfp8_convert.layouts import trtllm_scale_from_canonical_array

    with pytest.raises(LayoutError, match="N % 32"):
        trtllm_scale_from_canonical_array(np.zeros((48, 4), dtype=np.uint8))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12).map(lambda b: 32 * b), c=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_array_inverse_is_exact_and_equals_torch(n, c, seed):
    """trtllm_scale_to_canonical_array undoes the numpy forward on random bytes (tiles or flat),
    and reads random tiles as the torch inverse does."""
    import numpy as np

    from mxfp8_convert.layouts import (
        trtllm_scale_from_canonical_array,
        trtllm_scale_shape,
        trtllm_scale_to_canonical_array,
    )

    rng = np.random.default_rng(seed)
    s = rng.integers(0, 256, (n, c), dtype=np.uint8)
    tiles = trtllm_scale_from_canonical_array(s)
    for laid in (tiles, tiles.reshape(-1)):
        back = trtllm_scale_to_canonical_array(laid, n, c)
        assert back.dtype == np.uint8 and back.shape == (n, c) and np.array_equal(back, s)
    noise = rng.integers(0, 256, trtllm_scale_shape(n, c), dtype=np.uint8)
    want = trtllm_scale_to_canonical(torch.from_numpy(noise.copy()), n, c).numpy()
    assert np.array_equal(trtllm_scale_to_canonical_array(noise, n, c), want)


@pytest.mark.parametrize("n, c", [(128, 4), (256, 8), (512, 32), (16384, 1024), (128, 36)])
def test_array_of_aligned_shapes_equals_torch(n, c):
    """Shapes with nothing to pad take the one-copy path: the bytes of the torch layout, also
    from a view at an odd offset (a scale inside the source mapping)."""
    import numpy as np

    from mxfp8_convert.layouts import trtllm_scale_from_canonical_array

    raw = np.random.default_rng(n + c).integers(0, 256, n * c + 1, dtype=np.uint8)
    s = raw[1:].reshape(n, c)
    want = trtllm_scale_from_canonical(torch.from_numpy(s.copy())).numpy()
    got = trtllm_scale_from_canonical_array(s)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()
