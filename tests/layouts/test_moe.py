"""Tests for mxfp8_convert/layouts/moe.py: trtllm-gen MXFP8 fused-MoE weight and scale layout.

Parity is checked against FlashInfer's own CPU-runnable helpers, applied the way
``flashinfer/fused_moe/prepare.py::prepare_trtllm_fp8_block_weights`` and the upstream test
``tests/moe/trtllm_gen_fused_moe_utils.py`` apply them. ``block_scale_interleave`` needs CUDA,
so the 128x4 step is checked against the docs/LAYOUTS.md section 2 offset formula instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts import moe
from mxfp8_convert.layouts.rows import p32_shuffle_rows
from mxfp8_convert.layouts.swizzle import swizzle_128x4
from tests.checkpoints import spec_swizzle_128x4

fi_core = pytest.importorskip("flashinfer.fused_moe.core")
fi_shuffle_matrix_a = pytest.importorskip("flashinfer").shuffle_matrix_a

EPILOGUE_TILE_M = 128


def rand_bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def first_diff(got: torch.Tensor, want: torch.Tensor, dims: tuple[str, ...]) -> str:
    """Name the first differing element, e.g. 'expert 1, row 37, byte 5: got 3, want 9'."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)} != {list(want.shape)}"
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return "equal"
    idx = tuple(bad[0].tolist())
    where = ", ".join(f"{d} {i}" for d, i in zip(dims, idx, strict=True))
    return f"{where}: got {int(got[idx])}, want {int(want[idx])}"


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, dims: tuple[str, ...]) -> None:
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert got.shape == want.shape and torch.equal(got, want), first_diff(got, want, dims)


W_DIMS = ("expert", "row", "byte")
TILE_DIMS = ("expert", "row tile", "col tile", "byte")


# --- FlashInfer references, one expert at a time -------------------------------------------


def fi_fc1_weight(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """prepare.py path: w13[_maybe_get_cached_w3_w1_permute_indices(cache, w13, 128)]."""
    out = []
    for e in range(up.shape[0]):
        w13 = torch.cat([up[e], gate[e]])
        perm = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w13, EPILOGUE_TILE_M)
        out.append(w13[perm])
    return torch.stack(out)


def fi_fc1_weight_test_path(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Upstream test path: shuffle_matrix_a(reorder_rows_for_gated_act_gemm(w13), 128)."""
    out = []
    for e in range(up.shape[0]):
        w13 = torch.cat([up[e], gate[e]])
        out.append(fi_shuffle_matrix_a(fi_core.reorder_rows_for_gated_act_gemm(w13), 128))
    return torch.stack(out)


def fi_fc1_scale(up_s: torch.Tensor, gate_s: torch.Tensor) -> torch.Tensor:
    """prepare.py path with the CUDA-only block_scale_interleave replaced by the LAYOUTS.md
    formula."""
    out = []
    for e in range(up_s.shape[0]):
        s = torch.cat([up_s[e], gate_s[e]])
        perm = fi_core._maybe_get_cached_w3_w1_permute_indices(
            {}, s, EPILOGUE_TILE_M, num_elts_per_sf=32
        )
        out.append(spec_swizzle_128x4(s[perm].contiguous()))
    return torch.stack(out)


def fi_fc2_weight(down: torch.Tensor) -> torch.Tensor:
    out = []
    for e in range(down.shape[0]):
        perm = fi_core.get_w2_permute_indices_with_cache({}, down[e], EPILOGUE_TILE_M)
        out.append(down[e][perm])
    return torch.stack(out)


def fi_fc2_scale(down_s: torch.Tensor) -> torch.Tensor:
    out = []
    for e in range(down_s.shape[0]):
        perm = fi_core.get_w2_permute_indices_with_cache(
            {}, down_s[e], EPILOGUE_TILE_M, num_elts_per_sf=32
        )
        out.append(spec_swizzle_128x4(down_s[e][perm].contiguous()))
    return torch.stack(out)


def expert_tensors(e: int, h: int, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "up": rand_bytes(e, i, h, seed=seed),
        "gate": rand_bytes(e, i, h, seed=seed + 1),
        "down": rand_bytes(e, h, i, seed=seed + 2),
        "up_s": rand_bytes(e, i, h // 32, seed=seed + 3),
        "gate_s": rand_bytes(e, i, h // 32, seed=seed + 4),
        "down_s": rand_bytes(e, h, i // 32, seed=seed + 5),
    }


SIZES = st.sampled_from([128, 256, 384])


# --- parity with FlashInfer -----------------------------------------------------------------


def test_interleave_matches_reorder_rows_for_gated_act_gemm():
    w13 = rand_bytes(3, 256, 64)
    want = torch.stack([fi_core.reorder_rows_for_gated_act_gemm(w) for w in w13])
    assert_bytes_equal(moe.gated_interleave_rows(w13), want, W_DIMS)
    assert_bytes_equal(moe.gated_deinterleave_rows(want), w13, W_DIMS)


def test_fc1_row_indices_match_w3_w1_permute_indices():
    for i in (128, 256, 512):
        w13 = torch.empty(2 * i, 32, dtype=torch.uint8)
        want = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w13, EPILOGUE_TILE_M)
        assert torch.equal(moe.moe_fc1_row_indices(i), want), f"I={i}"


@settings(max_examples=12, deadline=None)
@given(e=st.integers(1, 3), h=SIZES, i=SIZES, seed=st.integers(0, 2**16))
def test_forward_matches_flashinfer(e, h, i, seed):
    t = expert_tensors(e, h, i, seed)
    fc1_w = moe.moe_fc1_weight_from_canonical(t["up"], t["gate"])
    assert_bytes_equal(fc1_w, fi_fc1_weight(t["up"], t["gate"]), W_DIMS)
    assert_bytes_equal(fc1_w, fi_fc1_weight_test_path(t["up"], t["gate"]), W_DIMS)
    fc1_s = moe.moe_fc1_scale_from_canonical(t["up_s"], t["gate_s"])
    want_s = fi_fc1_scale(t["up_s"], t["gate_s"]).view(moe.moe_fc1_scale_shape(h, i, e))
    assert_bytes_equal(fc1_s, want_s, TILE_DIMS)
    assert_bytes_equal(
        moe.moe_fc2_weight_from_canonical(t["down"]), fi_fc2_weight(t["down"]), W_DIMS
    )
    fc2_s = moe.moe_fc2_scale_from_canonical(t["down_s"])
    want_s = fi_fc2_scale(t["down_s"]).view(moe.moe_fc2_scale_shape(h, i, e))
    assert_bytes_equal(fc2_s, want_s, TILE_DIMS)


@settings(max_examples=12, deadline=None)
@given(h=SIZES, i=SIZES, chunk=st.sampled_from([16, 32, 48, 128]), seed=st.integers(0, 2**16))
def test_numpy_forward_in_row_chunks_matches_flashinfer(h, i, chunk, seed):
    """The converter's numpy path: FC1 weights laid out in chunks of ``chunk`` rows of each half
    (any multiple of 16), FC1/FC2 scales per expert, against FlashInfer's permutations."""
    t = expert_tensors(1, h, i, seed)
    up, gate = t["up"][0].numpy(), t["gate"][0].numpy()
    parts = [moe.moe_fc1_rows_array(up[r:r + chunk], gate[r:r + chunk]) for r in range(0, i, chunk)]
    got = torch.from_numpy(np.concatenate(parts))[None]
    assert_bytes_equal(got, fi_fc1_weight(t["up"], t["gate"]), W_DIMS)
    out = np.full(2 * i * h, 7, dtype=np.uint8)  # into a given buffer, every byte overwritten
    moe.moe_fc1_rows_array(up, gate, out=out)
    assert_bytes_equal(torch.from_numpy(out).view(1, 2 * i, h), got, W_DIMS)
    fc1_s = moe.moe_fc1_scale_from_canonical_array(t["up_s"][0].numpy(), t["gate_s"][0].numpy())
    want = fi_fc1_scale(t["up_s"], t["gate_s"]).view(moe.moe_fc1_scale_shape(h, i, 1))
    assert_bytes_equal(torch.from_numpy(fc1_s)[None], want, TILE_DIMS)
    fc2_s = moe.moe_fc2_scale_from_canonical_array(t["down_s"][0].numpy())
    want = fi_fc2_scale(t["down_s"]).view(moe.moe_fc2_scale_shape(h, i, 1))
    assert_bytes_equal(torch.from_numpy(fc2_s)[None], want, TILE_DIMS)


def test_numpy_forward_refuses_bad_shapes():
    a = np.zeros((24, 64), dtype=np.uint8)
    with pytest.raises(LayoutError, match="24 rows of each half is not a multiple of 16"):
        moe.moe_fc1_rows_array(a, a)
    with pytest.raises(LayoutError, match="must be the same"):
        moe.moe_fc1_rows_array(a[:16], a[:32])
    s = np.zeros((96, 8), dtype=np.uint8)  # I = 96: not a multiple of 128
    with pytest.raises(LayoutError, match="H=256, I=96"):
        moe.moe_fc1_scale_from_canonical_array(s, s)
    with pytest.raises(LayoutError, match="H=96"):
        moe.moe_fc2_scale_from_canonical_array(np.zeros((96, 4), np.uint8))


def test_first_diff_names_the_place():
    a = torch.zeros(2, 64, 8, dtype=torch.uint8)
    b = a.clone()
    b[1, 37, 5] = 9
    b[1, 40, 0] = 1
    assert first_diff(a, b, W_DIMS) == "expert 1, row 37, byte 5: got 0, want 9"


def test_swizzle_128x4_matches_spec_formula():
    s = rand_bytes(384, 12, seed=7)
    got = swizzle_128x4(s)
    assert_bytes_equal(got.flatten(), spec_swizzle_128x4(s), ("byte",))


# --- round trips and shapes -----------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(e=st.integers(1, 3), h=SIZES, i=SIZES, seed=st.integers(0, 2**16))
def test_round_trip_and_shapes(e, h, i, seed):
    t = expert_tensors(e, h, i, seed)
    fc1_w = moe.moe_fc1_weight_from_canonical(t["up"], t["gate"])
    fc1_s = moe.moe_fc1_scale_from_canonical(t["up_s"], t["gate_s"])
    fc2_w = moe.moe_fc2_weight_from_canonical(t["down"])
    fc2_s = moe.moe_fc2_scale_from_canonical(t["down_s"])
    assert fc1_w.shape == moe.moe_fc1_weight_shape(h, i, num_experts=e)
    assert fc1_s.shape == moe.moe_fc1_scale_shape(h, i, num_experts=e)
    assert fc2_w.shape == moe.moe_fc2_weight_shape(h, i, num_experts=e)
    assert fc2_s.shape == moe.moe_fc2_scale_shape(h, i, num_experts=e)

    up, gate = moe.moe_fc1_weight_to_canonical(fc1_w)
    assert_bytes_equal(up, t["up"], W_DIMS)
    assert_bytes_equal(gate, t["gate"], W_DIMS)
    up_s, gate_s = moe.moe_fc1_scale_to_canonical(fc1_s, h, i)
    assert_bytes_equal(up_s, t["up_s"], W_DIMS)
    assert_bytes_equal(gate_s, t["gate_s"], W_DIMS)
    assert_bytes_equal(moe.moe_fc2_weight_to_canonical(fc2_w), t["down"], W_DIMS)
    assert_bytes_equal(moe.moe_fc2_scale_to_canonical(fc2_s, h, i), t["down_s"], W_DIMS)
    # FlashInfer's kernel-shaped [E, rows, cols] view of the tiles, flattened, reads back too.
    up_s2, _ = moe.moe_fc1_scale_to_canonical(fc1_s.reshape(e, 2 * i, h // 32).reshape(e, -1), h, i)
    assert_bytes_equal(up_s2, t["up_s"], W_DIMS)


def test_unbatched_and_dtype_kept():
    up = rand_bytes(128, 256, seed=1).view(torch.float8_e4m3fn)
    gate = rand_bytes(128, 256, seed=2).view(torch.float8_e4m3fn)
    w = moe.moe_fc1_weight_from_canonical(up, gate)
    assert w.dtype == torch.float8_e4m3fn and w.shape == moe.moe_fc1_weight_shape(256, 128)
    back_up, back_gate = moe.moe_fc1_weight_to_canonical(w)
    assert back_up.dtype == torch.float8_e4m3fn
    assert_bytes_equal(back_up, up, ("row", "byte"))
    assert_bytes_equal(back_gate, gate, ("row", "byte"))
    s = rand_bytes(128, 8, seed=3)
    tiles = moe.moe_fc1_scale_from_canonical(s, s.clone())
    assert tiles.dtype == torch.uint8 and tiles.shape == moe.moe_fc1_scale_shape(256, 128)


@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 2)])
@pytest.mark.parametrize("i", [16, 48, 128])
def test_fused_fc1_permutation_is_interleave_then_p32(lead, i):
    # The one-pass FC1 permutation equals the two documented steps, done with rows.py.
    up, gate = rand_bytes(*lead, i, 8, seed=i), rand_bytes(*lead, i, 8, seed=i + 1)
    steps = moe.gated_interleave_rows(torch.cat([up, gate], dim=-2)).reshape(-1, 2 * i, 8)
    want = torch.stack([p32_shuffle_rows(m) for m in steps]).reshape(*lead, 2 * i, 8)
    got = moe._fc1_pack(up, gate)
    assert torch.equal(got, want), first_diff(got, want, ("batch",) * len(lead) + ("row", "byte"))
    back_up, back_gate = moe._fc1_unpack(got)
    assert torch.equal(back_up, up) and torch.equal(back_gate, gate)


def test_interleave_round_trip_any_rows():
    x = rand_bytes(2, 6, 5, seed=4)  # the interleave alone only needs an even row count
    assert_bytes_equal(moe.gated_deinterleave_rows(moe.gated_interleave_rows(x)), x, W_DIMS)


# --- golden bytes: a layout change cannot pass by round-tripping alone ----------------------


def test_golden_fc1_weight_rows():
    # Row j of up holds byte j, row j of gate holds 128 + j.
    up = torch.arange(128, dtype=torch.uint8).view(1, 128, 1).expand(1, 128, 128)
    gate = up + 128
    w = moe.moe_fc1_weight_from_canonical(up, gate)
    assert bool((w == w[..., :1]).all()), "rows must move whole"
    first_block = [0, 2, 4, 6, 8, 10, 12, 14, 128, 130, 132, 134, 136, 138, 140, 142,
                   1, 3, 5, 7, 9, 11, 13, 15, 129, 131, 133, 135, 137, 139, 141, 143]  # fmt: skip
    assert w[0, :32, 0].tolist() == first_block
    assert w[0, 32:40, 0].tolist() == [16, 18, 20, 22, 24, 26, 28, 30]
    assert w[0, 255, 0].item() == 255  # gate row I-1 stays last


def test_golden_fc2_weight_rows():
    down = torch.arange(128, dtype=torch.uint8).view(1, 128, 1).expand(1, 128, 128)
    w = moe.moe_fc2_weight_from_canonical(down)
    assert w[0, :32, 0].tolist() == [
        0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29,
        2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31,
    ]  # fmt: skip


def test_golden_fc1_scale_bytes():
    # Rows labelled: up row j = j, gate row j = 128 + j (every column alike).
    up_s = torch.arange(128, dtype=torch.uint8).view(128, 1).expand(128, 4)
    t = moe.moe_fc1_scale_from_canonical(up_s, up_s + 128)
    assert t.shape == (2, 1, 512)
    flat = t.flatten()
    # Bytes 0..15: physical rows 0, 32, 64, 96 (canonical up 0, 16, 32, 48), columns 0..3.
    assert flat[:16].tolist() == [0] * 4 + [16] * 4 + [32] * 4 + [48] * 4
    # Bytes 16..31: physical rows 1, 33, 65, 97 = up 2, 18, 34, 50.
    assert flat[16:32].tolist() == [2] * 4 + [18] * 4 + [34] * 4 + [50] * 4
    # Bytes 128..143: physical rows 8, 40, 72, 104 = gate 0, 16, 32, 48.
    assert flat[128:144].tolist() == [128] * 4 + [144] * 4 + [160] * 4 + [176] * 4
    # Columns labelled: up (j, c) = c, gate (j, c) = 4 + c.
    cols = torch.arange(4, dtype=torch.uint8).expand(128, 4)
    flat = moe.moe_fc1_scale_from_canonical(cols, cols + 4).flatten()
    assert flat[:16].tolist() == [0, 1, 2, 3] * 4
    assert flat[128:144].tolist() == [4, 5, 6, 7] * 4


# --- constraints ----------------------------------------------------------------------------


def test_shape_violations():
    assert moe.moe_shape_violations(7168, 2048) == []
    assert moe.moe_shape_violations(128, 128) == []
    bad = moe.moe_shape_violations(2880, 2880)  # gpt-oss-like: 2880 = 22.5 * 128
    assert any(m.startswith("H=2880 is not a multiple of 128") for m in bad)
    assert any(m.startswith("I=2880 is not a multiple of 128") for m in bad)
    assert not any("2I=" in m for m in bad)  # 5760 = 45 * 128
    bad = moe.moe_shape_violations(4096, 96)
    assert [m.split(" (")[0] for m in bad] == [
        "I=96 is not a multiple of 128",
        "2I=192 is not a multiple of 128",
    ]
    assert moe.moe_shape_violations(4096, 0) == ["I=0 is not positive"]


def test_bad_shapes_raise():
    x = rand_bytes(1, 96, 4096)
    with pytest.raises(LayoutError, match=r"I=96 is not a multiple of 128"):
        moe.moe_fc1_weight_from_canonical(x, x)
    with pytest.raises(LayoutError, match="same shape and dtype"):
        moe.moe_fc1_weight_from_canonical(rand_bytes(1, 128, 128), rand_bytes(1, 128, 256))
    with pytest.raises(LayoutError, match="H=96"):
        moe.moe_fc2_scale_from_canonical(rand_bytes(1, 96, 4))
    with pytest.raises(LayoutError, match="1-byte dtype"):
        moe.moe_fc2_weight_from_canonical(torch.zeros(1, 128, 128, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="do not hold"):
        moe.moe_fc2_scale_to_canonical(rand_bytes(1, 1, 1, 512), 128, 256)
