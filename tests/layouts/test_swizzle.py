"""128x4 (cutlass weight scales, activations) and 8x4 (trtllm activations) scale swizzles.

Proof of the layout, in four independent ways: FlashInfer's own pure-torch references and kernel
index functions (CPU), the LAYOUTS.md section 2 offset formulas in Python ints, golden bytes, and
round-trip / shape / stride / tensor-parallel-slicing properties. GPU parity with
``flashinfer.block_scale_interleave`` and ``mxfp8_quantize`` runs under the ``gpu`` marker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.layouts import (
    swizzle_8x4,
    swizzle_128x4,
    swizzled_8x4_shape,
    swizzled_128x4_shape,
    unswizzle_8x4,
    unswizzle_128x4,
)

# Named unaligned shapes (rows, scale cols): torchao's (100, 3) and (50, 10), the fused MLA
# N = 576, single rows/cols, and a tile-aligned one.
NAMED = [(1, 1), (2, 2), (100, 3), (50, 10), (129, 5), (256, 8), (576, 7), (300, 13)]

FI_SWIZZLE_REFS = [  # pure-torch [R, C] -> flat 128x4 bytes, inside FlashInfer 0.7.2.post1
    "flashinfer.diffusion_ops.minimax_h3_fc1_swiglu:_swizzle_sf_128x4",
    "flashinfer.experimental.b12x.moe._shared.kernels.reference_flashinfer:_block_scale_interleave_128x4_torch",
]
FI_UNSWIZZLE_REFS = [  # pure-torch flat 128x4 bytes -> [R, C]
    "flashinfer.trace.templates.gemm:_unswizzle_sf_128x4",  # the mm_mxfp8 trace reference
    "flashinfer.diffusion_ops.minimax_h3_fc1_swiglu:_unswizzle_sf_128x4",
    "flashinfer.gemm.gemm_bf16_fp4:_unswizzle_sf_128x4",
]

# FlashInfer builds its block-scale kernels for SM90 and newer only (get_fp4_quantization_module).
SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="FlashInfer's block-scale kernels need SM90+",
)


def ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def spec_offset_128x4(r: int, c: int, cp: int) -> int:
    """docs/LAYOUTS.md section 2, in Python ints."""
    return (
        (r // 128) * (cp // 4) * 512
        + (c // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + c % 4
    )


def spec_offset_8x4(r: int, c: int, cp: int) -> int:
    """docs/LAYOUTS.md section 2, in Python ints."""
    return (r // 8) * (cp // 4) * 32 + (c // 4) * 32 + (r % 8) * 4 + c % 4


def expected_bytes(s: torch.Tensor, row_pad: int, offset) -> torch.Tensor:
    """Lay ``s`` out element by element with an offset formula; every other byte is 0."""
    rows, cols = s.shape
    cp = ceil_to(cols, 4)
    out = bytearray(ceil_to(rows, row_pad) * cp)
    values = s.view(torch.uint8).tolist()
    for r in range(rows):
        for c in range(cols):
            out[offset(r, c, cp)] = values[r][c]
    return torch.frombuffer(out, dtype=torch.uint8)


def landing_offsets(layout, rows: int, cols: int) -> torch.Tensor:
    """``off[r, c]`` = flat output byte where ``layout`` puts element ``(r, c)``.

    Positions need more than a byte, so lay out the four bytes of ``r*cols + c + 1`` one plane
    at a time and reassemble them; 0 marks a padding byte.
    """
    pos = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(rows, cols)
    out = torch.zeros(0, dtype=torch.int64)
    for k in range(4):
        plane = layout(((pos >> (8 * k)) & 255).to(torch.uint8)).flatten().to(torch.int64)
        out = plane << (8 * k) if k == 0 else out | (plane << (8 * k))
    where = torch.full((rows * cols + 1,), -1, dtype=torch.int64)
    where[out] = torch.arange(out.numel())
    hit = out[out > 0]
    assert hit.numel() == rows * cols and hit.unique().numel() == rows * cols, "not a bijection"
    return where[1:].reshape(rows, cols)


def kernel_index_function(flashinfer, name: str):
    """A FlashInfer CuTe-DSL index function (``quantization_cute_dsl_utils.py``) as plain Python.

    The function bodies are integer arithmetic on ``Int32``; we read the source, drop the
    ``@cute.jit`` decorator and run it on Python ints, so the kernel's own formula is checked.
    """
    path = Path(flashinfer.__file__).parent / "quantization" / "quantization_cute_dsl_utils.py"
    if not path.exists():
        pytest.fail(f"FlashInfer {flashinfer.__version__}: {path} is gone")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            node.decorator_list = []
            namespace = {"Int32": int}
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
            return namespace[name]
    pytest.fail(f"FlashInfer {flashinfer.__version__}: no {name} in {path}")


# --- FlashInfer parity on CPU -----------------------------------------------------------------


@pytest.mark.parametrize("ref", FI_SWIZZLE_REFS)
@pytest.mark.parametrize("rows, cols", NAMED)
def test_128x4_equals_flashinfer_reference_swizzle(
    flashinfer_ref, ref, rows, cols, random_bytes, same_bytes
):
    s = random_bytes((rows, cols), seed=rows * 97 + cols)
    same_bytes(
        swizzle_128x4(s).flatten(), flashinfer_ref(ref)(s), f"128x4 [{rows}, {cols}] vs {ref}"
    )


@pytest.mark.parametrize("ref", FI_UNSWIZZLE_REFS)
@pytest.mark.parametrize("rows, cols", NAMED)
def test_128x4_inverts_with_flashinfer_reference_unswizzle(
    flashinfer_ref, ref, rows, cols, random_bytes, same_bytes
):
    s = random_bytes((rows, cols), seed=rows * 89 + cols)
    got = flashinfer_ref(ref)(swizzle_128x4(s).flatten(), rows, cols)
    same_bytes(got, s, f"{ref}(swizzle_128x4(s))")


def test_128x4_stacked_equals_flashinfer_batched_references(
    flashinfer_ref, random_bytes, same_bytes
):
    s = random_bytes((3, 100, 5), seed=11)  # block_scale_interleave's 3-D input: [E, R, C]
    forward = flashinfer_ref(FI_SWIZZLE_REFS[1])
    same_bytes(swizzle_128x4(s).flatten(), forward(s), "stacked 128x4 vs FlashInfer")
    inverse = flashinfer_ref("flashinfer.trace.templates.gemm:_unswizzle_batched_sf_128x4")
    same_bytes(inverse(swizzle_128x4(s).flatten(), 3, 100, 5), s, "FlashInfer batched unswizzle")


@pytest.mark.parametrize("rows, cols", NAMED)
def test_128x4_flat_size_equals_flashinfer(flashinfer_ref, rows, cols):
    size = flashinfer_ref(
        "flashinfer.quantization.fp8_quantization:_compute_swizzled_layout_sf_size"
    )
    tr, tc, tb = swizzled_128x4_shape(rows, cols)
    assert tr * tc * tb == size(rows, cols, 128)
    tr, tc, tb = swizzled_8x4_shape(rows, cols)
    assert tr * tc * tb == size(rows, cols, 8)


@pytest.mark.parametrize("name, rows, cols", [
    *(("128x4", r, c) for r, c in [(1, 1), (100, 3), (129, 5), (200, 9)]),
    *(("8x4", r, c) for r, c in [(1, 1), (3, 5), (17, 6), (64, 9)]),
])
def test_equals_flashinfer_kernel_index_function(flashinfer, name, rows, cols):
    forward = {"128x4": swizzle_128x4, "8x4": swizzle_8x4}[name]
    index = kernel_index_function(flashinfer, f"compute_sf_index_swizzled_{name}_gpu")
    off, cp = landing_offsets(forward, rows, cols).tolist(), ceil_to(cols, 4)
    for r in range(rows):
        for c in range(cols):
            assert off[r][c] == index(r, c, cp), f"{name} element ({r}, {c})"


# --- LAYOUTS.md formulas, element by element ------------------------------------------------------


@pytest.mark.parametrize("rows, cols", NAMED)
def test_128x4_matches_spec_formula(rows, cols, random_bytes, same_bytes):
    s = random_bytes((rows, cols), seed=rows + cols, dtype=torch.float8_e8m0fnu)
    want = expected_bytes(s, 128, spec_offset_128x4)
    same_bytes(swizzle_128x4(s), want.reshape(swizzled_128x4_shape(rows, cols)), "128x4 vs formula")


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (8, 4), (17, 6), (100, 3), (50, 10)])
def test_8x4_matches_spec_formula(rows, cols, random_bytes, same_bytes):
    s = random_bytes((rows, cols), seed=rows * 3 + cols)
    want = expected_bytes(s, 8, spec_offset_8x4)
    same_bytes(swizzle_8x4(s), want.reshape(swizzled_8x4_shape(rows, cols)), "8x4 vs formula")


# --- golden bytes (cutlass weight scale = plain 128x4; trtllm activation 8x4) ------------------
# Derived once by hand from the LAYOUTS.md formulas above, kept as literals: a layout change that
# still round-trips fails here. Bytes not listed are 0 (padding, or zero input).


def from_sparse(size: int, nonzero: dict[int, int]) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    for offset, value in nonzero.items():
        out[offset] = value
    return out


def test_golden_128x4_dense_2x2(same_bytes):
    s = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8)  # Rp = 128, Cp = 4: one 512-byte tile
    # (0,0) -> 0, (0,1) -> 1, (1,0) -> 1*16 = 16, (1,1) -> 17
    same_bytes(swizzle_128x4(s).flatten(), from_sparse(512, {0: 1, 1: 2, 16: 3, 17: 4}))


def test_golden_128x4_cutlass_two_by_two_tiles(same_bytes):
    s = torch.zeros(130, 6, dtype=torch.uint8)  # Rp = 256, Cp = 8: tiles [2, 2, 512], 2048 bytes
    marks = {(0, 0): 1, (0, 3): 2, (1, 0): 3, (31, 0): 4, (32, 0): 5, (33, 1): 6,
             (127, 2): 7, (0, 4): 8, (5, 5): 9, (128, 0): 10, (129, 5): 11}  # fmt: skip
    for (r, c), v in marks.items():
        s[r, c] = v
    golden = {
        0: 1,  # (0, 0)
        3: 2,  # (0, 3): c%4 = 3
        16: 3,  # (1, 0): (r%32)*16
        496: 4,  # (31, 0): 31*16
        4: 5,  # (32, 0): ((r%128)//32)*4 = 4
        21: 6,  # (33, 1): 16 + 4 + 1
        510: 7,  # (127, 2): 31*16 + 3*4 + 2
        512: 8,  # (0, 4): next column tile, (c//4)*512
        593: 9,  # (5, 5): 512 + 5*16 + 1
        1024: 10,  # (128, 0): next row tile, (r//128)*(Cp/4)*512 = 1024
        1553: 11,  # (129, 5): 1024 + 512 + 16 + 1
    }
    same_bytes(swizzle_128x4(s).flatten(), from_sparse(2048, golden), "128x4 golden")
    same_bytes(unswizzle_128x4(from_sparse(2048, golden), 130, 6), s, "128x4 golden inverse")


def test_golden_8x4_dense_3x5(same_bytes):
    s = (torch.arange(15) + 1).reshape(3, 5).to(torch.uint8)  # s[r, c] = 5r + c + 1
    # Rp = 8, Cp = 8: two 32-byte tiles; byte (r%8)*4 + c%4 inside tile c//4.
    golden = [
        1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 0, 0, 0, 0,  # tile (0, 0): rows 0-2, cols 0-3
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # rows 3-7 (padding)
        5, 0, 0, 0, 10, 0, 0, 0, 15, 0, 0, 0, 0, 0, 0, 0,  # tile (0, 1): col 4, cols 5-7 padding
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]  # fmt: skip
    same_bytes(swizzle_8x4(s).flatten(), torch.tensor(golden, dtype=torch.uint8), "8x4 golden")


def test_golden_8x4_sparse_10x6(same_bytes):
    s = torch.zeros(10, 6, dtype=torch.uint8)  # Rp = 16, Cp = 8: tiles [2, 2, 32], 128 bytes
    for (r, c), v in {(0, 0): 1, (7, 3): 2, (8, 0): 3, (9, 5): 4, (2, 4): 5}.items():
        s[r, c] = v
    # (7,3) -> 7*4 + 3 = 31; (8,0) -> (r//8)*(Cp/4)*32 = 64; (9,5) -> 64 + 32 + 4 + 1 = 101;
    # (2,4) -> 32 + 2*4 = 40
    golden = {0: 1, 31: 2, 64: 3, 101: 4, 40: 5}
    same_bytes(swizzle_8x4(s).flatten(), from_sparse(128, golden), "8x4 golden")


# --- properties -------------------------------------------------------------------------------

rows_st = st.one_of(st.sampled_from([1, 50, 100, 127, 128, 129, 576]), st.integers(1, 300))
cols_st = st.one_of(st.sampled_from([1, 3, 4, 5, 10]), st.integers(1, 12))
batch_st = st.sampled_from([(), (1,), (3,), (2, 2)])
dtype_st = st.sampled_from([torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn])
LAYOUTS = {  # name: (forward, inverse, shape function, row padding)
    "128x4": (swizzle_128x4, unswizzle_128x4, swizzled_128x4_shape, 128),
    "8x4": (swizzle_8x4, unswizzle_8x4, swizzled_8x4_shape, 8),
}


@pytest.mark.parametrize("name", LAYOUTS)
@settings(max_examples=40, deadline=None)
@given(rows=rows_st, cols=cols_st, batch=batch_st, dtype=dtype_st, seed=st.integers(0, 2**31))
def test_round_trip_shape_and_expert_stride(
    name, rows, cols, batch, dtype, seed, random_bytes, same_bytes
):
    forward, inverse, shape_fn, row_pad = LAYOUTS[name]
    s = random_bytes((*batch, rows, cols), seed, dtype)
    t = forward(s)
    assert t.dtype == torch.uint8 and t.is_contiguous()
    assert tuple(t.shape) == (*batch, *shape_fn(rows, cols))
    same_bytes(inverse(t, rows, cols), s, f"{name} inverse(forward(s))")
    same_bytes(inverse(t.reshape(*batch, -1), rows, cols), s, f"{name} inverse of flat bytes")
    # Stacked [E, R, C]: expert e's bytes are its own flat buffer, at stride Rp*Cp.
    stride = ceil_to(rows, row_pad) * ceil_to(cols, 4)
    flat, experts = t.flatten(), s.reshape(-1, rows, cols)
    for e in range(experts.shape[0]):
        same_bytes(
            flat[e * stride : (e + 1) * stride], forward(experts[e]).flatten(), f"expert {e}"
        )
    # Padding bytes are 0.
    padded = inverse(t, ceil_to(rows, row_pad), ceil_to(cols, 4))
    assert not padded[..., rows:, :].any() and not padded[..., :, cols:].any()


@settings(max_examples=25, deadline=None)
@given(rows=rows_st, cols=cols_st, batch=batch_st, seed=st.integers(0, 2**31))
def test_128x4_stacked_equals_flashinfer_reference(
    flashinfer_ref, rows, cols, batch, seed, random_bytes, same_bytes
):
    forward = flashinfer_ref(FI_SWIZZLE_REFS[1])  # accepts [R, C] and [E, R, C]
    s = random_bytes((*batch, rows, cols), seed).reshape(-1, rows, cols)
    same_bytes(swizzle_128x4(s).flatten(), forward(s), "128x4 vs FlashInfer reference")


@settings(max_examples=30, deadline=None)
@given(rows=rows_st, cols=st.integers(1, 24), data=st.data())
def test_128x4_tile_slices_are_the_layout_of_tp_slices(rows, cols, data, random_bytes, same_bytes):
    """LAYOUTS.md section 2: slicing tiles at multiples of 128 rows / 128 K = laying out the TP
    slice."""
    s = random_bytes((rows, cols), seed=rows * 31 + cols)
    t = swizzle_128x4(s)
    tr, tc, _ = t.shape
    a = data.draw(st.integers(0, tr - 1), label="first row tile")
    b = data.draw(st.integers(a + 1, tr), label="end row tile")
    same_bytes(t[a:b], swizzle_128x4(s[128 * a : 128 * b]), "column-parallel (row) slice")
    i = data.draw(st.integers(0, tc - 1), label="first K tile")
    j = data.draw(st.integers(i + 1, tc), label="end K tile")
    same_bytes(t[:, i:j], swizzle_128x4(s[:, 4 * i : 4 * j]), "row-parallel (K) slice")


def test_2d_view_sliced_along_k_has_right_shape_wrong_bytes(random_bytes):
    """LAYOUTS.md section 2's warning: why the output is 3-D tiles and not a 2-D [Rp, Cp] view."""
    s = random_bytes((128, 8), seed=5)
    wrong = swizzle_128x4(s).reshape(128, 8)[:, :4]
    right = swizzle_128x4(s[:, :4]).reshape(128, 4)
    assert wrong.shape == right.shape and not torch.equal(wrong, right)


# --- dtypes and errors --------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.int8])
def test_one_byte_dtypes_lay_out_as_their_uint8_view(name, dtype, random_bytes, same_bytes):
    forward, inverse, _, _ = LAYOUTS[name]
    s = random_bytes((100, 3), seed=1, dtype=dtype)
    t = forward(s)
    same_bytes(t, forward(s.view(torch.uint8)))
    same_bytes(inverse(t.view(torch.float8_e8m0fnu), 100, 3), s)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16, torch.float32])
def test_rejects_wider_dtypes(name, dtype):
    forward, inverse, shape_fn, _ = LAYOUTS[name]
    with pytest.raises(LayoutError, match="expected a 1-byte dtype"):
        forward(torch.zeros(4, 4, dtype=dtype))
    with pytest.raises(LayoutError, match="expected a 1-byte dtype"):
        inverse(torch.zeros(shape_fn(4, 4), dtype=dtype), 4, 4)


@pytest.mark.parametrize("name", LAYOUTS)
def test_rejects_one_dimensional_scales(name):
    with pytest.raises(
        LayoutError, match=r"needs a \[\.\.\., rows, cols\] tensor, got shape \[5\]"
    ):
        LAYOUTS[name][0](torch.zeros(5, dtype=torch.uint8))


@pytest.mark.parametrize("name", LAYOUTS)
def test_inverse_rejects_tiles_of_another_shape(name):
    forward, inverse, _, _ = LAYOUTS[name]
    t = forward(torch.zeros(100, 3, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="do not hold a"):
        inverse(t, 300, 3)
    with pytest.raises(LayoutError, match="do not hold a"):
        inverse(t.flatten()[:-1], 100, 3)


def test_mismatch_message_names_the_first_differing_tile(same_bytes):
    t = swizzle_128x4(torch.zeros(256, 4, dtype=torch.uint8))
    bad = t.clone()
    bad[1, 0, 37] = 9  # byte 37 of row tile 1 = (r%32)*16 + ((r%128)//32)*4 + c%4 at r=162, c=1
    with pytest.raises(AssertionError, match=r"128x4 tile \(1, 0\) byte 37 = scale row 162, col 1"):
        same_bytes(bad, t, "demo")


# --- GPU: FlashInfer's CUDA kernels (block_scale_interleave and mxfp8_quantize refuse CPU) ----


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("shape", [(128, 4), (100, 3), (576, 224), (3, 100, 5), (2, 256, 56)])
def test_128x4_equals_block_scale_interleave_on_cuda(flashinfer, shape, random_bytes, same_bytes):
    s = random_bytes(shape, seed=sum(shape))
    want = flashinfer.block_scale_interleave(s.cuda())
    same_bytes(swizzle_128x4(s).flatten(), want, f"128x4 {list(shape)} vs block_scale_interleave")
    same_bytes(swizzle_128x4(s.cuda()).flatten(), want, "128x4 on CUDA vs block_scale_interleave")


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("m, k", [(256, 512), (200, 4096), (77, 96)])
@pytest.mark.parametrize("name", ["128x4", "8x4"])
def test_swizzle_equals_mxfp8_quantize_scales_on_cuda(flashinfer, name, m, k, same_bytes):
    from flashinfer import SfLayout

    forward, inverse, shape_fn, row_pad = LAYOUTS[name]
    layout = {"128x4": SfLayout.layout_128x4, "8x4": SfLayout.layout_8x4}[name]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    _, linear = flashinfer.mxfp8_quantize(x, sf_swizzle_layout=SfLayout.layout_linear)
    _, swizzled = flashinfer.mxfp8_quantize(x, sf_swizzle_layout=layout)
    linear = linear.view(torch.uint8).reshape(m, k // 32).cpu()
    swizzled = swizzled.view(torch.uint8).flatten().cpu()
    assert swizzled.numel() == ceil_to(m, row_pad) * ceil_to(k // 32, 4)
    same_bytes(inverse(swizzled, m, k // 32), linear, f"{name} unswizzle(mxfp8_quantize)")
    if m % row_pad == 0 and (k // 32) % 4 == 0:  # no padding, whose bytes the kernel may skip
        same_bytes(forward(linear).flatten(), swizzled, f"{name} vs mxfp8_quantize")


# --- numpy twin (the converter's torch-free path) ----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_128x4_array_equals_torch_swizzle(rows, cols, seed):
    import numpy as np

    from mxfp8_convert.layouts import swizzle_128x4_array

    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    got = swizzle_128x4_array(s.numpy())
    assert got.dtype == np.uint8 and got.shape == swizzled_128x4_shape(rows, cols)
    assert got.tobytes() == swizzle_128x4(s).numpy().tobytes()


@pytest.mark.parametrize("rows, cols", NAMED)
def test_128x4_array_of_unaligned_bytes_equals_torch(rows, cols):
    """The converter hands in views of the source mapping at any offset (int32 words unaligned)."""
    import numpy as np

    from mxfp8_convert.layouts import swizzle_128x4_array

    raw = np.random.default_rng(rows * cols).integers(0, 256, rows * cols + 1, dtype=np.uint8)
    s = raw[1:].reshape(rows, cols)
    want = swizzle_128x4(torch.from_numpy(s.copy())).numpy()
    assert swizzle_128x4_array(s).tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_128x4_array_inverse_is_exact_and_equals_torch(rows, cols, seed):
    """unswizzle_128x4_array undoes swizzle_128x4_array on random bytes (tiles or flat), and
    reads random tiles as the torch unswizzle does."""
    import numpy as np

    from mxfp8_convert.layouts import swizzle_128x4_array, unswizzle_128x4_array

    rng = np.random.default_rng(seed)
    s = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    tiles = swizzle_128x4_array(s)
    for laid in (tiles, tiles.reshape(-1)):
        back = unswizzle_128x4_array(laid, rows, cols)
        assert back.dtype == np.uint8 and back.shape == (rows, cols) and np.array_equal(back, s)
    noise = rng.integers(0, 256, swizzled_128x4_shape(rows, cols), dtype=np.uint8)
    want = unswizzle_128x4(torch.from_numpy(noise.copy()), rows, cols).numpy()
    assert np.array_equal(unswizzle_128x4_array(noise, rows, cols), want)


def test_128x4_array_inverse_rejects_tiles_of_another_shape():
    import numpy as np

    from mxfp8_convert.layouts import unswizzle_128x4_array

    with pytest.raises(LayoutError, match=r"do not hold a \[128, 8\] scale"):
        unswizzle_128x4_array(np.zeros(512, dtype=np.uint8), 128, 8)
