"""P32 row shuffle (trtllm weight layout): FlashInfer parity, the LAYOUTS.md formula, golden bytes,
round-trip properties. docs/LAYOUTS.md section 2, ``mxfp8_convert/layouts/rows.py``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts import p32_row_indices, p32_shuffle_rows, p32_unshuffle_rows

# Row counts: multiples of 32 that are not multiples of 128 (96, 160, 576 = fused MLA qkv), and
# a few aligned ones.
ROWS = [32, 64, 96, 128, 160, 576, 1024]

# Golden: x = arange(64) as a [64, 1] uint8 weight; output row p holds input row
# 32*(p//32) + 4*(p%8) + (p%32)//8 (docs/LAYOUTS.md section 2), written out once by hand from that
# formula: within each 32-row block the rows go 0, 4, ..., 28, then 1, 5, ..., 29, and so on.
GOLDEN_P32_64x1 = [
    0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29,
    2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31,
    32, 36, 40, 44, 48, 52, 56, 60, 33, 37, 41, 45, 49, 53, 57, 61,
    34, 38, 42, 46, 50, 54, 58, 62, 35, 39, 43, 47, 51, 55, 59, 63,
]  # fmt: skip


def spec_source_row(p: int) -> int:
    """docs/LAYOUTS.md section 2, in Python ints: the input row that lands at output row ``p``."""
    return 32 * (p // 32) + 4 * (p % 8) + (p % 32) // 8


# --- FlashInfer parity (its helpers run on CPU) --------------------------------------------


@pytest.mark.parametrize("n", ROWS)
def test_row_indices_equal_flashinfer(flashinfer, n):
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    x = torch.zeros(n, 1, dtype=torch.uint8)
    want = get_shuffle_matrix_a_row_indices(x, 128)
    assert torch.equal(p32_row_indices(n), want)


@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("k", [32, 96, 256])
def test_shuffle_equals_flashinfer_shuffle_matrix_a(flashinfer, n, k, random_bytes, same_bytes):
    x = random_bytes((n, k), seed=n * 1000 + k, dtype=torch.float8_e4m3fn)
    same_bytes(p32_shuffle_rows(x), flashinfer.shuffle_matrix_a(x, 128), f"P32 [{n}, {k}]")


@pytest.mark.parametrize("epilogue_tile_m", [128, 256, 384])
def test_any_epilogue_tile_multiple_of_128_gives_the_same_permutation(flashinfer, epilogue_tile_m):
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    x = torch.zeros(256, 1, dtype=torch.uint8)
    assert torch.equal(get_shuffle_matrix_a_row_indices(x, epilogue_tile_m), p32_row_indices(256))


# --- LAYOUTS.md formula, element by element -------------------------------------------------------


@pytest.mark.parametrize("n", [32, 96, 160])
def test_shuffle_matches_spec_formula_row_by_row(n, random_bytes):
    x = random_bytes((n, 3), seed=n)
    rows_in, rows_out = x.tolist(), p32_shuffle_rows(x).tolist()
    for p in range(n):
        assert rows_out[p] == rows_in[spec_source_row(p)], f"output row {p}"
    assert p32_row_indices(n).tolist() == [spec_source_row(p) for p in range(n)]


def test_shuffle_matches_spec_view_transpose(random_bytes, same_bytes):
    x = random_bytes((96, 40), seed=7)
    want = x.view(3, 8, 4, 40).transpose(1, 2).reshape(96, 40)
    same_bytes(p32_shuffle_rows(x), want, "P32 vs view/transpose")


# --- golden bytes ---------------------------------------------------------------------------


def test_golden_trtllm_weight_shuffle(same_bytes):
    x = torch.arange(64, dtype=torch.uint8).reshape(64, 1)
    got = p32_shuffle_rows(x)
    same_bytes(got.flatten(), torch.tensor(GOLDEN_P32_64x1, dtype=torch.uint8), "P32 golden")
    same_bytes(p32_unshuffle_rows(got), x, "P32 golden inverse")


def test_golden_two_byte_rows_move_whole_rows(same_bytes):
    # [32, 2] with row r = (r, 100 + r): bytes of a row stay together and in order.
    x = torch.stack([torch.arange(32), 100 + torch.arange(32)], dim=1).to(torch.uint8)
    want = [b for p in GOLDEN_P32_64x1[:32] for b in (p, 100 + p)]
    same_bytes(p32_shuffle_rows(x).flatten(), torch.tensor(want, dtype=torch.uint8))


# --- properties -------------------------------------------------------------------------------

row_counts = st.one_of(
    st.sampled_from([32, 96, 160, 576]), st.integers(1, 20).map(lambda b: 32 * b)
)
trailing = st.sampled_from([(), (1,), (32,), (96,), (4, 8)])
one_byte = st.sampled_from([torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu])


@settings(max_examples=40, deadline=None)
@given(n=row_counts, rest=trailing, dtype=one_byte, seed=st.integers(0, 2**31))
def test_round_trip_is_bit_exact(n, rest, dtype, seed, random_bytes, same_bytes):
    x = random_bytes((n, *rest), seed, dtype)
    y = p32_shuffle_rows(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    same_bytes(p32_unshuffle_rows(y), x, "unshuffle(shuffle(x))")
    same_bytes(p32_shuffle_rows(p32_unshuffle_rows(x)), x, "shuffle(unshuffle(x))")
    same_bytes(y, x[p32_row_indices(n)], "shuffle vs row indices")


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 12), data=st.data())
def test_shuffle_commutes_with_slicing_rows_at_multiples_of_32(
    blocks, data, random_bytes, same_bytes
):
    n = 32 * blocks
    a = data.draw(st.integers(0, blocks - 1), label="first block")
    b = data.draw(st.integers(a + 1, blocks), label="end block")
    x = random_bytes((n, 8), seed=n + a)
    same_bytes(p32_shuffle_rows(x)[32 * a : 32 * b], p32_shuffle_rows(x[32 * a : 32 * b]))


def test_shuffle_returns_a_new_contiguous_tensor_from_a_view(random_bytes, same_bytes):
    base = random_bytes((64, 64), seed=3)
    x = base[:, ::2]  # non-contiguous
    same_bytes(p32_shuffle_rows(x), p32_shuffle_rows(x.contiguous()))


@pytest.mark.parametrize("n", [1, 16, 31, 33, 100, 130])
def test_rejects_rows_not_multiple_of_32(n):
    x = torch.zeros(n, 4, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=f"rows % 32 == 0, got {n} rows"):
        p32_shuffle_rows(x)
    with pytest.raises(LayoutError, match="rows % 32 == 0"):
        p32_unshuffle_rows(x)
    with pytest.raises(LayoutError, match="rows % 32 == 0"):
        p32_row_indices(n)


def test_rejects_a_zero_dimensional_tensor():
    with pytest.raises(LayoutError, match="at least one dimension"):
        p32_shuffle_rows(torch.tensor(3, dtype=torch.uint8))


@pytest.mark.parametrize("n", [0, 32, 96, 4096])
def test_row_order_is_row_indices_without_torch(n):
    from mxfp8_convert.layouts import p32_row_order

    assert p32_row_order(n) == p32_row_indices(n).tolist()
    with pytest.raises(LayoutError):
        p32_row_order(n + 8)


@pytest.mark.parametrize("n,k", [(32, 1), (96, 7), (256, 256)])
def test_numpy_twins_equal_the_torch_shuffle(n, k):
    """p32_shuffle_rows_array (the converter's torch-free in-memory shuffle) == p32_shuffle_rows,
    read-only input, into a given flat buffer or a new array; the unshuffle undoes it."""
    import numpy as np

    from mxfp8_convert.layouts import p32_shuffle_rows_array, p32_unshuffle_rows_array

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    want = p32_shuffle_rows(x).numpy()
    ro = x.numpy().copy()
    ro.flags.writeable = False
    out = np.full(n * k, 7, dtype=np.uint8)
    assert np.array_equal(p32_shuffle_rows_array(ro, out), want)
    assert np.array_equal(out.reshape(n, k), want)
    assert np.array_equal(p32_shuffle_rows_array(ro), want)
    assert np.array_equal(p32_unshuffle_rows_array(want), x.numpy())
    with pytest.raises(LayoutError):
        p32_shuffle_rows_array(np.zeros((n + 8, k), np.uint8))
    with pytest.raises(LayoutError):
        p32_shuffle_rows_array(np.zeros(32, np.uint8))


@pytest.mark.parametrize("n,k", [(32, 1), (96, 7), (256, 256)])
def test_shuffle_into_a_given_buffer(n, k):
    """p32_shuffle_rows(x, out=buf) fills a flat pooled buffer with the rows in the order the
    formula gives (spec_source_row), and returns it viewed as [N, K]."""
    x = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    buf = torch.full((n * k,), 7, dtype=torch.uint8)
    got = p32_shuffle_rows(x, out=buf)
    want = torch.stack([x[spec_source_row(p)] for p in range(n)])
    assert got.shape == (n, k) and got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, want) and torch.equal(buf.view(n, k), want)
