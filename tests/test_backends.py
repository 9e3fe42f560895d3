"""The BACKENDS table: constraints, round trips and FlashInfer parity, for every entry.

Generic tests iterate ``BACKENDS``, so a new entry is covered as soon as it is added. The tests
with hand-written expectations (exact violation phrases, FlashInfer references) fail for a
backend they do not know yet, asking for its expectations rather than passing silently.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxfp8_convert.backends import (
    BACKENDS,
    FLASHINFER_LAYOUT_VERSION,
    KERNEL_BACKENDS,
    get_backend,
)
from mxfp8_convert.errors import ConvertError
from mxfp8_convert.layouts import unswizzle_128x4

# kernel backends (FlashInfer mm_mxfp8 layouts); the canonical target is tested at the end
NAMES = list(KERNEL_BACKENDS)

# (N, K) -> backend -> exact violation phrases (docs/LAYOUTS.md section 3).
VIOLATIONS = {
    (576, 7168): {"trtllm": [], "cutlass": []},  # fused MLA qkv: N % 128 != 0 is fine
    (160, 256): {"trtllm": [], "cutlass": []},
    (14336, 4096): {"trtllm": [], "cutlass": []},
    (128, 128): {"trtllm": ["K=128 is not a multiple of 256"], "cutlass": []},
    (4096, 7200): {"trtllm": ["K=7200 is not a multiple of 256"], "cutlass": []},  # 7168 + 32
    (100, 4096): {
        "trtllm": ["N=100 is not a multiple of 32", "N=100 < 128"],
        "cutlass": ["N=100 is not a multiple of 32", "N=100 < 128"],
    },
    (4096, 96): {
        "trtllm": ["K=96 is not a multiple of 256", "K=96 < 128"],
        "cutlass": ["K=96 < 128"],
    },
    (64, 256): {"trtllm": ["N=64 < 128"], "cutlass": ["N=64 < 128"]},
    (4096, 100): {
        "trtllm": [
            "K=100 is not a multiple of 32",
            "K=100 is not a multiple of 256",
            "K=100 < 128",
        ],
        "cutlass": ["K=100 is not a multiple of 32", "K=100 < 128"],
    },
    (4112, 4096): {  # 4112 = 16 * 257: a multiple of 16, not of 32
        "trtllm": ["N=4112 is not a multiple of 32"],
        "cutlass": ["N=4112 is not a multiple of 32"],
    },
}


def expected_for(table: dict, name: str):
    if name not in table:
        pytest.fail(f"backend {name!r} is new: add its hand-written expectations to this test")
    return table[name]


def eligible_shapes(spec) -> list[tuple[int, int]]:
    """Small [N, K] weights this backend accepts (N not a multiple of 128 among them)."""
    shapes = [
        (n, k) for n in (128, 160, 576) for k in (256, 512, 7168 // 8) if not spec.violations(n, k)
    ]
    assert shapes, f"{spec.name}: no small eligible shape; extend the candidates"
    return shapes


# --- constraints ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n, k", list(VIOLATIONS))
def test_violations_exact_phrases(name, n, k):
    want = expected_for(VIOLATIONS[(n, k)], name)
    assert sorted(BACKENDS[name].violations(n, k)) == sorted(want)


#: docs/FORMAT.md section 4 ("Backend constraints"), written out here: backend -> (N rule, K rule)
FORMAT_MD_CONSTRAINTS = {
    "trtllm": (lambda n: n % 32 == 0 and n >= 128, lambda k: k % 256 == 0 and k >= 128),
    "cutlass": (lambda n: n % 32 == 0 and n >= 128, lambda k: k % 32 == 0 and k >= 128),
}


@pytest.mark.parametrize("name", NAMES)
def test_violations_empty_exactly_where_format_md_allows(name):
    """The table engines read (FORMAT.md section 4), not the BackendSpec fields restated."""
    n_ok, k_ok = expected_for(FORMAT_MD_CONSTRAINTS, name)
    spec = BACKENDS[name]
    for n in range(0, 700, 16):
        for k in range(0, 1100, 16):
            assert (spec.violations(n, k) == []) == (n_ok(n) and k_ok(k)), f"{name} [{n}, {k}]"


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_needs_blocks_of_32(name):
    """MXFP8 has one scale per 1x32 block; a backend with K % 32 != 0 cannot exist."""
    spec = BACKENDS[name]
    assert spec.k_multiple % 32 == 0 and spec.min_n >= 1 and spec.min_k >= 32
    assert spec.violations(4096, 4096 + 16)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_weight_and_scale_round_trip(name, data, seed, random_bytes, same_bytes):
    spec = BACKENDS[name]
    n, k = data.draw(st.sampled_from(eligible_shapes(spec)), label="[N, K]")
    c = k // 32
    w = random_bytes((n, k), seed, torch.float8_e4m3fn)
    s = random_bytes((n, c), seed + 1, torch.float8_e8m0fnu)

    w_out = spec.weight_forward(w)
    assert w_out.shape == w.shape and w_out.dtype == w.dtype
    same_bytes(spec.weight_inverse(w_out), w, f"{name} weight inverse(forward)")

    s_out = spec.scale_forward(s)
    assert tuple(s_out.shape) == tuple(spec.scale_shape(n, c)) and s_out.dtype == torch.uint8
    same_bytes(spec.scale_inverse(s_out, n, c), s, f"{name} scale inverse(forward)")


@pytest.mark.parametrize("name", NAMES)
def test_stacked_scales_are_per_expert_at_fixed_stride(name, random_bytes, same_bytes):
    spec = BACKENDS[name]
    n, k = eligible_shapes(spec)[0]
    s = random_bytes((3, n, k // 32), seed=4)
    out = spec.scale_forward(s)
    assert tuple(out.shape) == (3, *spec.scale_shape(n, k // 32))
    for e in range(3):
        same_bytes(out[e], spec.scale_forward(s[e]), f"{name} expert {e}")
    same_bytes(spec.scale_inverse(out, n, k // 32), s, f"{name} stacked inverse")


@pytest.mark.parametrize("name", NAMES)
def test_scale_row_p_belongs_to_physical_weight_row_p(name, random_bytes, same_bytes):
    """Whatever a backend does to weight rows, it does to scale rows (128x4-tiled scales)."""
    spec = BACKENDS[name]
    shapes = eligible_shapes(spec)
    n, k = next(((n, k) for n, k in shapes if n % 128), shapes[0])  # prefer a padded N
    if spec.scale_shape(n, k // 32)[-1] != 512:
        pytest.skip(f"{name}: scales are not 128x4 tiles")
    # Tag row r of the weight and of its scale with the same byte (r % 251 + 1, never 0).
    tag = (torch.arange(n) % 251 + 1).to(torch.uint8)
    w = tag[:, None].expand(n, k).contiguous()
    s = tag[:, None].expand(n, k // 32).contiguous()
    tiles = spec.scale_forward(s)
    rows = unswizzle_128x4(tiles, tiles.shape[-3] * 128, k // 32)
    same_bytes(rows[:n, :1], spec.weight_forward(w)[:, :1], f"{name} scale rows vs weight rows")


# --- FlashInfer parity, per backend -----------------------------------------------------------


#: FlashInfer's own pure-torch 128x4 swizzle ([R, C] -> flat bytes, = block_scale_interleave,
#: which refuses CPU tensors); tests/layouts/test_swizzle.py proves the two agree on a GPU
FI_128X4 = (
    "flashinfer.experimental.b12x.moe._shared.kernels.reference_flashinfer"
    ":_block_scale_interleave_128x4_torch"
)


def flashinfer_layout(flashinfer, swizzle, name: str, w: torch.Tensor, s: torch.Tensor):
    """(weight bytes, flat scale bytes) as FlashInfer's CPU helpers lay them out for ``name``."""
    from flashinfer.utils import get_shuffle_matrix_sf_a_row_indices

    if name == "cutlass":  # unchanged weight; block_scale_interleave(s)
        return w, swizzle(s)
    if name == "trtllm":  # shuffle_matrix_a(w, 128); shuffle_matrix_sf_a(pad128(s), 128, 32)
        padded = s.new_zeros((-(-s.shape[0] // 128) * 128, s.shape[1]))
        padded[: s.shape[0]] = s
        idx = get_shuffle_matrix_sf_a_row_indices(padded, 128, 32)
        return flashinfer.shuffle_matrix_a(w, 128), swizzle(padded[idx])
    pytest.fail(f"backend {name!r} is new: say how FlashInfer lays it out in this test")


@pytest.mark.parametrize("name", NAMES)
def test_equals_flashinfer_layout(flashinfer, flashinfer_ref, name, random_bytes, same_bytes):
    spec = BACKENDS[name]
    swizzle = flashinfer_ref(FI_128X4)
    for n, k in eligible_shapes(spec):
        w = random_bytes((n, k), seed=n + k, dtype=torch.float8_e4m3fn)
        s = random_bytes((n, k // 32), seed=n * k)
        want_w, want_s = flashinfer_layout(flashinfer, swizzle, name, w, s)
        same_bytes(spec.weight_forward(w), want_w, f"{name} weight [{n}, {k}]")
        same_bytes(spec.scale_forward(s).flatten(), want_s, f"{name} scale [{n}, {k // 32}]")


def test_installed_flashinfer_is_the_version_the_layouts_target(flashinfer):
    assert flashinfer.__version__ == FLASHINFER_LAYOUT_VERSION, (
        f"installed FlashInfer {flashinfer.__version__}, "
        f"layouts target {FLASHINFER_LAYOUT_VERSION}: "
        "re-check docs/LAYOUTS.md section 2 against it before bumping"
    )


# --- the table itself -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_to_dict_is_json_with_stable_keys(name):
    d = BACKENDS[name].to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["name"] == name
    assert set(d) == {
        "name",
        "weight_layout",
        "scale_layout",
        "constraints",
        "compute_capabilities",
    }
    assert set(d["constraints"]) == {"n_multiple", "k_multiple", "min_n", "min_k"}


def test_known_backends_and_their_layout_names():
    """These names go into every output's marker (docs/FORMAT.md): renaming one is a format
    change."""
    names = {n: (b.weight_layout, b.scale_layout) for n, b in BACKENDS.items()}
    assert names["trtllm"] == ("p32_rows", "pad128_p32_128x4")
    assert names["cutlass"] == ("identity", "128x4")


def test_get_backend():
    assert get_backend("trtllm") is BACKENDS["trtllm"]
    with pytest.raises(ConvertError, match="^unknown backend 'nope'$") as info:
        get_backend("nope")
    assert info.value.hint == f"choose one of: {', '.join(BACKENDS)}"


def test_canonical_target_is_plain_mxfp8():
    spec = BACKENDS["canonical"]
    assert not spec.laid_out and spec.compute_capabilities == ()
    assert set(BACKENDS) - set(KERNEL_BACKENDS) == {"canonical"}
    assert spec.violations(576, 7200) == [] and spec.violations(100, 96) == []
    assert spec.violations(4096, 100) == ["K=100 is not a multiple of 32"]
    s = torch.randint(0, 256, (100, 3), dtype=torch.uint8)
    assert spec.scale_forward(s) is s and spec.scale_shape(100, 3) == (100, 3)
    assert torch.equal(spec.scale_inverse(s, 100, 3), s)
