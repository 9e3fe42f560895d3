"""The Gluon wgmma decode kernel compiles for sm_90a without a GPU, with its MMAs in flight.

Gluon has no CPU interpreter, so its numerics are proven by the ``gpu`` tests on an H200
(tests/runtime/test_triton_gpu.py::test_wgmma_configs_agree). Here, on any machine, Triton
compiles the kernel for Hopper as it would at launch and we read the SASS: four FP8 wgmma per
K-tile issued before the first wait (``DEPBAR.LE gsb0, 0x3``), TMA loads, no local-memory spills,
and, with the activations quantized in the kernel, the proxy fence between the threads' stores of
the e4m3 tile and the wgmma that reads it, the hardware's e4m3 conversion of just the M rows
(rounded up to a power of two), and no CTA barrier beyond the three a K-tile needs.
"""

from __future__ import annotations

import re

import pytest
import torch

wgmma_mod = pytest.importorskip("mxfp8_convert.runtime.hopper.wgmma")
from mxfp8_convert.runtime.hopper.jit import FP_FUSION  # noqa: E402  (compiled as launched)
from tests.runtime.sass import cuobjdump_sass, instructions  # noqa: E402


def _sass(
    bm: int,
    layout: str,
    serial: bool,
    fuse: bool,
    qm: int = 0,
    pdl: bool = False,
    words: bool = False,
    cluster: int = 0,
    block_n: int = 64,
    prefetch: bool = False,
    x_prefetch: bool = False,
) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    n, k = 4096, 4096
    bk = wgmma_mod.BLOCK_K
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    wd = TensorDescriptor(w, [n, k], [k, 1], [block_n, bk],
                          gl.NVMMASharedLayout.get_default_for([block_n, bk], gl.float8e4nv))
    x_smem = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)
    sig = {
        "w_desc": mangle_type(wd),
        "x_desc": "constexpr",
        "x_ptr": "*bf16",
        "s_ptr": "*i32",
        "xc_ptr": "*i32",
        "b_ptr": "*bf16",
        "out_ptr": "*bf16",
        "ws_ptr": "*fp32",
        "lock_ptr": "*i32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_xm": "i32",
        "stride_om": "i32",
        "stride_os": "i32",
        "scale_cp4": "i32",
        "split_k": "i32",
    }
    const = {"x_desc": None}
    if words:  # bf16 activations as int32 words of two
        sig["x_ptr"] = "*i32"
    if not fuse:  # e4m3 activations by TMA
        xq = torch.empty(16, k, dtype=torch.float8_e4m3fn)
        sig.update(
            x_desc=mangle_type(TensorDescriptor(xq, [16, k], [k, 1], [bm, bk], x_smem)),
            x_ptr="*fp8e4nv",
        )
        const = {}
    const.update(
        {
            "LAYOUT": wgmma_mod.LAYOUT_CODE[layout],
            "HAS_BIAS": True,
            "PARTIAL": True,
            "SERIAL": serial,
            "FUSE_QUANT": fuse,
            "BM": bm,
            "QM": qm or bm,
            "X_SMEM": x_smem,
            "STAGES": 2,
            "SW_AHEAD": 3,
            "PDL": pdl,
            "RED_CHUNK": 4,
            "X_WORDS": words,
            "CLUSTER": cluster,
            "RED_E": block_n * bm >> (cluster.bit_length() - 1) if cluster else 0,
            "PREFETCH": prefetch,
            "PHYS": False,
            "X_PREFETCH": x_prefetch,
            "num_warps": block_n // 16,
        }
    )
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("x_ptr", "s_ptr", "xc_ptr", "out_ptr", "ws_ptr", "K", "stride_xm")}
    src = GluonASTSource(
        fn=wgmma_mod._wgmma_decode_kernel, signature=sig, constexprs=const, attrs=attrs
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": block_n // 16, "enable_fp_fusion": FP_FUSION},
    )
    assert kernel.metadata.shared <= 64 * 1024
    return cuobjdump_sass(kernel.asm["cubin"])


def _k_loop(sass: str) -> list[str]:
    """The instructions of the K-tile loop: up to its back edge, the first backward branch after
    the QGMMAs that jumps to before them (the mbarrier wait's retry blocks, also jumping back,
    lie past the end of the kernel)."""
    ins = instructions(sass)
    mma = [a for a, t in ins if "QGMMA" in t]
    edges = [(a, int(m.group(1), 16)) for a, t in ins if (m := re.search(r"BRA (0x[0-9a-f]+)", t))]
    end, start = min((a, target) for a, target in edges if target < mma[0] and a > mma[-1])
    return [t for a, t in ins if start <= a <= end]


@pytest.mark.parametrize("fuse,bm,qm,words", [
    (True, 8, 1, False), (True, 8, 8, False), (True, 16, 16, False), (True, 8, 2, True),
    (True, 8, 8, True), (True, 16, 16, True), (True, 32, 32, True), (False, 8, 0, False),
    (False, 16, 0, False), (False, 32, 0, False)],
    ids=["fused-m1", "fused-m8", "fused-m16", "fused-m2-words", "fused-m8-words",
         "fused-m16-words", "fused-m32-words", "e4m3-by-tma-m8", "e4m3-by-tma-m16",
         "e4m3-by-tma-m32"])
@pytest.mark.parametrize("layout,serial", [("trtllm", True), ("cutlass", False)])
def test_wgmma_kernel_compiles_for_sm90_with_mmas_in_flight(bm, qm, words, layout, serial, fuse):
    sass = _sass(bm, layout, serial, fuse, qm, words=words)
    assert (
        len(re.findall(rf"QGMMA\.64x{bm}x32\.F32\.E4M3\.E4M3", sass)) == 4
    )  # one per 32-block of the tile
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", sass)
    assert waits == ["3", "2", "1", "0"]  # each part waited for while the later ones still run
    # by TMA: weights and (not fused) activations, in the prologue and the loop
    assert len(re.findall(r"UTMALDG", sass)) == 2 * (1 if fuse else 2)
    loop = _k_loop(sass)
    # fused: the e4m3 tile written by the threads is made visible to the async proxy (wgmma)
    assert any(t.startswith("FENCE.VIEW.ASYNC.S") for t in loop) == fuse
    assert not re.search(r"\b(STL|LDL)\b", sass)  # no register spills
    if fuse:
        # the CTA barriers of a K-tile: the two Triton puts before the TMA issue (mbarrier expect,
        # copy) and the one after the tile's stores; the activation scales travel with the tile
        # (no layout conversion through shared memory and its own barriers; with bf16 words, none
        # between the packed and the unpacked order either)
        assert sum(t.startswith("BAR.SYNC") for t in loop) == 3
        # e4m3 rounding by the hardware conversion, QM rows: one cvt per 2 values a thread holds
        assert sum("F2FP.SATFINITE.E4M3.F32" in t for t in loop) == max(qm // 2, 1)


@pytest.mark.parametrize("cluster", [0, 4])
@pytest.mark.parametrize("qm,words", [(4, True), (16, True), (16, False)])
def test_two_warpgroups_share_one_quantized_activation_tile(qm, words, cluster):
    """128 weight rows per program (``block_n=128``, eight warps): each warpgroup issues the four
    FP8 wgmma of its 64 rows per K-tile, in flight as in a 64-row program, on the one e4m3 tile the
    eight warps quantized together: each thread converts half the values it would in a 64-row
    program (warps j and j + 4 take the two halves of 32-block j's rows); the CTA barriers per
    K-tile are the three of a 64-row program and one at its end (a warpgroup waits only for its own
    MMAs, so neither may refill a ring stage or rewrite an activation buffer the other still
    reads); no spills, and at most 128 registers a thread: two programs fit an SM, which the rule
    counts on (``WGMMA_WIDE_PER_SM``)."""
    bm = 8 if qm <= 8 else 16
    wide = _sass(
        bm, "trtllm", not cluster, True, qm, pdl=True, words=words, cluster=cluster, block_n=128
    )
    narrow = _sass(bm, "trtllm", not cluster, True, qm, pdl=True, words=words, cluster=cluster)
    assert len(re.findall(rf"QGMMA\.64x{bm}x32\.F32\.E4M3\.E4M3", wide)) == 4
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", wide) == ["3", "2", "1", "0"]
    loop = _k_loop(wide)
    assert sum("F2FP.SATFINITE.E4M3.F32" in t for t in loop) == max(qm // 4, 1)
    assert sum("F2FP.SATFINITE.E4M3.F32" in t for t in _k_loop(narrow)) == max(qm // 2, 1)
    assert sum(t.startswith("BAR.SYNC") for t in loop) == 4 and loop[-2].startswith("BAR.SYNC")
    assert not re.search(r"\b(STL|LDL)\b", wide)

    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", wide)) < 128


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "e4m3-by-tma"])
def test_pdl_waits_for_the_previous_kernel_before_any_memory_access(fuse):
    """Launched as a programmatic dependent, the kernel waits for the previous kernel
    (``griddepcontrol.wait``: ACQBULK) before its first load, store, TMA or mbarrier operation,
    then lets the next kernel launch (PREEXIT); without PDL neither instruction is there."""
    memory = re.compile(
        r"\b(LDG|STG|LDS|STS|ATOM|ATOMG|RED|UTMALDG|UTMAPF|SYNCS)\b"
    )  # not LDC: parameters
    sass = _sass(8, "trtllm", True, fuse, pdl=True)
    ins = [t for _, t in instructions(sass)]
    first_wait = next(i for i, t in enumerate(ins) if t.startswith("ACQBULK"))
    assert not any(memory.search(t) for t in ins[:first_wait])
    assert any(t.startswith("PREEXIT") for t in ins[first_wait:])
    plain = _sass(8, "trtllm", True, fuse)
    assert "ACQBULK" not in plain and "PREEXIT" not in plain


@pytest.mark.parametrize("x_prefetch", [False, True], ids=["weight", "weight+x-lines"])
@pytest.mark.parametrize("words", [True, False], ids=["words", "elements"])
def test_prefetch_loads_only_the_weight_before_the_wait(x_prefetch, words):
    """With ``PREFETCH`` (the rule's choice under PDL) the kernel loads the weight's first K-tile
    (TMA) and its scale words for the first three K-tiles (``SW_AHEAD``; two rows a thread: six
    32-bit loads) before ``griddepcontrol.wait``, and nothing else: the activations (int32 words
    or bf16 elements, 128-bit loads) are read, and anything is stored, only after the wait. With
    ``X_PREFETCH`` each thread also asks L2 for one line of the activations (``CCTL.E.PF2``, the
    SASS of ``prefetch.global.L2``: no register receives a value) before the wait; without it,
    none."""
    sass = _sass(
        16,
        "trtllm",
        False,
        True,
        qm=16,
        pdl=True,
        words=words,
        prefetch=True,
        x_prefetch=x_prefetch,
    )
    ins = [t for _, t in instructions(sass)]
    wait = next(i for i, t in enumerate(ins) if t.startswith("ACQBULK"))
    before, after = ins[:wait], ins[wait:]
    assert any("UTMALDG" in t for t in before)
    loads = [t for t in before if re.search(r"\bLDG\b", t)]
    assert len(loads) == 6 and all(re.search(r"\bLDG\.E\s", t) for t in loads), loads
    assert not any(re.search(r"\b(STG|STS|ATOM|ATOMG|RED)\b", t) for t in before)
    pf = re.compile(
        r"^(@!?P\d+ )?CCTL\.E\.PF2 "
    )  # predicated: threads past the split's lines ask for none
    assert sum(bool(pf.match(t)) for t in before) == x_prefetch
    assert not any(pf.match(t) for t in after)
    assert any(
        re.search(r"\bLDG\.E\.128\b", t) for t in after
    )  # the activation words, or 8 elements
    assert any(t.startswith("PREEXIT") for t in after)


def test_launcher_refuses_what_the_kernel_cannot_read():
    """``wgmma_decode`` checks its arguments before anything is launched (so this runs on CPU):
    each refusal names the problem, and the output is left as it was."""
    from mxfp8_convert.errors import LayoutError
    from mxfp8_convert.runtime.weight import MXFP8Weight

    n, k = 128, 256
    q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    w = MXFP8Weight.from_canonical(
        q, torch.full((n, k // 32), 127, dtype=torch.uint8), "trtllm", "proj"
    )
    out = torch.full((4, n), float("nan"), dtype=torch.bfloat16)

    def launch(x, **kw):
        wgmma_mod.wgmma_decode(x, w, None, out, None, None, **{"split_k": 1, **kw})

    with pytest.raises(LayoutError, match="dtype torch.int8"):
        launch(torch.zeros(4, k, dtype=torch.int8))
    with pytest.raises(LayoutError, match="need their codes"):
        launch(torch.zeros(4, k, dtype=torch.float8_e4m3fn))
    with pytest.raises(LayoutError, match="proj: .*M <= 32"):
        launch(torch.zeros(33, k, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="proj: .*M <= 32"):
        launch(torch.zeros(k, 4, dtype=torch.bfloat16).t())  # K not contiguous
    with pytest.raises(ValueError, match="sw_ahead=4"):
        launch(torch.zeros(4, k, dtype=torch.bfloat16), sw_ahead=4)
    # no split of K without a K-tile: 10 splits of 32 tiles are 8 of 4 and two empty ones
    kk = 4096
    wk = MXFP8Weight.from_canonical(
        torch.zeros(n, kk, dtype=torch.float8_e4m3fn),
        torch.full((n, kk // 32), 127, dtype=torch.uint8),
        "trtllm",
        "proj",
    )
    x = torch.zeros(4, kk, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split_k=10: leaves a split of K = 4096 .* empty"):
        wgmma_mod.wgmma_decode(x, wk, None, out, None, None, split_k=10)
    with pytest.raises(ValueError, match="split_k=16: leaves a split of K = 256 .* empty"):
        launch(torch.zeros(4, k, dtype=torch.bfloat16), split_k=16, cluster=True)
    assert out.isnan().all()  # refused before anything was launched or written


def _regs(operand: str) -> set[int]:
    """Register numbers an operand names (``R16``, ``[R28.64+0x10]``: R28 and R29)."""
    out = set()
    for r, wide in re.findall(r"\bR(\d+)(\.64)?", operand):
        out.update({int(r), int(r) + 1} if wide else {int(r)})
    return out


@pytest.mark.parametrize("bm,qm", [(8, 4), (8, 8), (16, 16)])
def test_activation_words_are_used_one_k_tile_after_their_load(bm, qm):
    """bf16 activations travel as int32 words (``X_WORDS``): the K-loop loads the next tile's words
    and no instruction of the same iteration reads them, so their L2 latency hides behind a whole
    K-tile (loaded as bf16 elements, the registers carried were the unpacked halves, and the
    unpacking waited on the load in the same iteration: 28 % of the stall samples, Nsight Compute
    on the H200)."""
    loop = _k_loop(_sass(bm, "trtllm", True, True, qm, words=True))
    loads = [
        (i, t) for i, t in enumerate(loop) if re.search(r"\bLDG\.E\.(64|128)\b", t)
    ]  # scale words: LDG.E
    assert len(loads) == max(
        1, qm // 8
    )  # QM / 2 words a thread: one 8- or 16-byte load, two at QM = 16
    for i, t in loads:
        dest = _regs(t.split("LDG", 1)[1].split(",")[0])
        dest = {r + j for r in dest for j in range(4 if ".128" in t else 2)}
        for later in loop[i + 1:]:
            op, _, args = re.sub(r"^@!?U?P\w+\s+", "", later).partition(" ")
            parts = args.split(",")
            sources = parts if op.startswith(("ST", "RED", "ATOM", "BAR", "BRA")) else parts[1:]
            assert not dest & set().union(*map(_regs, sources)), (
                f"{later} reads the words {t} loaded"
            )


def test_launch_helpers_match_triton():
    """The launch path's plain-Python ``cdiv`` / next power of two and its cached shared layouts
    are Triton's own values (``benchmarks/bench_host.py`` times why they exist)."""
    import triton
    from triton.experimental.gluon import language as gl

    from mxfp8_convert.runtime.hopper.config import cdiv, next_pow2

    for a in range(1, 600):
        assert next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 7, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for rows in (8, 16, wgmma_mod.BLOCK_N):
        expect = gl.NVMMASharedLayout.get_default_for([rows, wgmma_mod.BLOCK_K], gl.float8e4nv)
        assert wgmma_mod._smem_layout(rows) == expect and wgmma_mod._smem_layout(
            rows
        ) is wgmma_mod._smem_layout(rows)


@pytest.mark.parametrize("bm,cluster", [(16, 8), (16, 16), (8, 3)])
def test_cluster_reduction_goes_through_distributed_shared_memory(bm, cluster):
    """With the splits of a row tile as one cluster (``CLUSTER``), the partials meet in shared
    memory, not in global memory: two cluster-wide barriers (the partials are stored; they were
    read), between them each thread's loads of its share from the cluster's ``CLUSTER`` programs
    (generic loads of the distributed shared window: ``RED_E`` elements over 128 threads, at
    least one each), no global atomics (no arrival counters) and no more registers than the
    kernel without clusters (the peak bounds how many programs share an SM)."""
    sass = _sass(bm, "trtllm", False, True, bm, pdl=True, words=True, cluster=cluster)
    plain = _sass(bm, "trtllm", False, True, bm, pdl=True, words=True)
    ins = [t for _, t in instructions(sass)]
    arrive = [i for i, t in enumerate(ins) if t.startswith("UCGABAR_ARV")]
    wait = [i for i, t in enumerate(ins) if t.startswith("UCGABAR_WAIT")]
    assert len(arrive) == len(wait) == 2 and arrive[0] < wait[0] < arrive[1] < wait[1]
    red_e = 64 * bm >> (cluster.bit_length() - 1)
    assert sum(
        re.search(r"\bLD\.E", t) is not None for t in ins[wait[0] : arrive[1]]
    ) == cluster * max(red_e // 128, 1)
    assert not re.search(r"\b(ATOMG|ATOM|RED|STL|LDL)\b", sass)
    assert not re.search(r"\bLD\.E", plain)

    def regs(s):  # registers per thread, allocated in groups of 8
        return -(-(max(int(r) for r in re.findall(r"\bR(\d+)\b", s)) + 1) // 8)

    assert regs(sass) <= regs(plain)


def test_cluster_kernels_launch_as_clusters_from_their_first_launch():
    """Triton compiles the kernel for one CTA; a ``CLUSTER > 1`` kernel is made to launch as
    clusters by the wrapper around its ``JITFunction._do_compile``, which sets the cluster size
    in the packed metadata that Triton's launcher reads (``(num_warps, num_ctas, shared)``, the
    launcher multiplying the first grid dimension by ``num_ctas``). Checked here against the
    installed Triton's own signatures, so an upgrade that moves them fails in CI, not on a GPU."""
    import inspect
    from types import SimpleNamespace

    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction

    assert list(inspect.signature(JITFunction._do_compile).parameters)[:5] == [
        "self", "key", "signature", "device", "constexprs"]
    meta = SimpleNamespace(num_warps=4, num_ctas=1, shared=21504)
    assert CUDABackend.pack_metadata(None, meta) == (4, 1, 21504)
    kernel = wgmma_mod._wgmma_decode_kernel
    assert kernel._do_compile.__wrapped__ is not None  # the wrapper is in place
    index = kernel.arg_names.index("CLUSTER")

    def compile_(key, signature, device, constexprs, options, attrs, warmup):
        return SimpleNamespace(packed_metadata=(4, 1, 21504))

    wrapped = wgmma_mod._compile_for_clusters(compile_)
    assert wrapped("k", {}, 0, {(index,): 8}, None, None, False).packed_metadata == (4, 8, 21504)
    assert wrapped("k", {}, 0, {(index,): 16}, None, None, True).packed_metadata == (4, 16, 21504)
    assert wrapped("k", {}, 0, {(index,): 0}, None, None, False).packed_metadata == (4, 1, 21504)
    launched = SimpleNamespace(packed_metadata=(4, 1, 21504))
    wgmma_mod._launch_as_clusters(launched, 5)  # after a launch the wrapper did not see
    assert launched.packed_metadata == (4, 5, 21504)


def test_a_refused_cluster_launch_falls_back_to_global_memory(monkeypatch):
    """Where the GPU refuses a clustered launch (CUDA's error 912, "cluster misconfiguration",
    which Triton's launcher raises), the call runs again with the partials summed by the last
    program, split so that no split is empty, and the device's rule chooses no clusters from then
    on; any other launch error is raised as it is."""
    import mxfp8_convert.runtime.hopper.launch as tri
    from mxfp8_convert.runtime import MXFP8Weight, quantize_mxfp8
    from mxfp8_convert.runtime.hopper import Kernel, probe, wgmma_rule

    calls = []
    error = ["Triton Error [CUDA]: cluster misconfiguration"]

    class FakeGluon:
        @staticmethod
        def wgmma_decode(x, weight, bias, out, ws, lock, *, split_k, cluster, **kwargs):
            calls.append((split_k, cluster, ws is not None, lock is not None))
            if cluster:
                raise RuntimeError(error[0])

    monkeypatch.setattr(probe, "gluon", lambda: FakeGluon)
    monkeypatch.setattr(probe, "CLUSTERS_REFUSED", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(probe, "num_sms", lambda device: 132)
    dev = torch.device("cuda")
    assert wgmma_rule(
        2, 576, 7168, probe.device_facts(dev)
    ).cluster  # DeepSeek kv_a: 16 splits, one cluster
    q, code = quantize_mxfp8(torch.randn(576, 7168))
    w = MXFP8Weight.from_canonical(q, code, "trtllm")
    x = torch.randn(2, 7168).bfloat16()
    out = torch.empty(2, 576, dtype=torch.bfloat16)
    cfg = tri.GemmConfig(64, 16, 128, Kernel.WGMMA, split_k=16, sw_ahead=2, cluster=True)
    error[0] = "Triton Error [CUDA]: out of memory"
    with pytest.raises(RuntimeError, match="out of memory"):
        tri._launch_wgmma(x, w, None, out, cfg)
    assert not probe.CLUSTERS_REFUSED
    error[0] = "Triton Error [CUDA]: cluster misconfiguration"
    calls.clear()
    tri._launch_wgmma(x, w, None, out, cfg)
    # 56 K-tiles: 16 clustered splits, then 14 of 4 K-tiles each, last-program reduction
    assert calls == [(16, True, False, False), (14, False, True, True)]
    assert probe.CLUSTERS_REFUSED == {0}
    assert not wgmma_rule(2, 576, 7168, probe.device_facts(dev)).cluster


def _dqmma_sass(block_n: int, bm: int, stages: int, layout: str, partial: bool,
                fast: bool = True, specialized: bool = False, pdl: bool = False,
                prefetch: bool = False) -> tuple[str, int]:
    """SASS and shared-memory bytes of the dequantizing wgmma kernel compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from mxfp8_convert.runtime.hopper import dqmma

    n, k = 4096, 4096
    box = 64 if specialized else block_n
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    x = torch.empty(512, k, dtype=torch.bfloat16)
    wd = TensorDescriptor(w, [n, k], [k, 1], [box, 128], dqmma._smem_layout(box, 128, "float8e4nv"))
    xd = TensorDescriptor(x, [512, k], [k, 1], [bm, 64], dqmma._smem_layout(bm, 64, "bfloat16"))
    sig = {"w_desc": mangle_type(wd), "x_desc": mangle_type(xd), "s_ptr": "*i32", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "stride_om": "i32", "stride_os": "i32", "scale_cp4": "i32", "split_k": "i32"}
    const = {"LAYOUT": dqmma.LAYOUT_CODE[layout], "HAS_BIAS": True, "PARTIAL": partial,
             "STAGES": stages, "FAST": fast, "PDL": pdl, "PREFETCH": prefetch}
    fn, options = dqmma._dqmma_kernel, {"num_warps": block_n // 16, "enable_fp_fusion": FP_FUSION}
    if specialized:
        cons = block_n // 64
        const.update(CONS=cons, CONS_REGS=dqmma.WS_CONS_REGS[cons])
        fn, options = dqmma._dqmma_ws_kernel, {"num_warps": 4, "maxnreg": dqmma.WS_MAXNREG[cons],
                                               "enable_fp_fusion": FP_FUSION}
    const["num_warps"] = options["num_warps"]
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("s_ptr", "out_ptr", "ws_ptr", "N", "K", "stride_om", "stride_os")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    sass = cuobjdump_sass(kernel.asm["cubin"])
    return sass, kernel.metadata.shared


@pytest.mark.parametrize("block_n,bm,stages,layout,partial,fast", [
    (64, 32, 3, "trtllm", True, True), (64, 64, 3, "cutlass", False, False),
    (64, 256, 3, "trtllm", False, True), (128, 128, 4, "cutlass", True, True),
    (128, 256, 2, "trtllm", True, False)])
def test_dqmma_kernel_keeps_its_bf16_wgmmas_in_flight(block_n, bm, stages, layout, partial, fast):
    """The dequantizing wgmma kernel (issue 26) for sm_90a: bf16 wgmma with the weight as the
    register operand (``HGMMA ... R``: no shared-memory copy of the dequantized tile), two k16
    instructions per 32-block, four blocks a K-tile (the first K-tile peeled off the loop: 8 in
    all); the e4m3 conversion: with ``FAST`` the bit moves and one bf16x2 multiply per two
    elements (``HMUL2.BF16``, 8 per block and thread), no hardware e4m3 conversion; else the
    hardware's e4m3 -> f16 pairs; each wgmma left in flight while the next block is dequantized
    (``DEPBAR.LE gsb0, 0x1``; only the final wait drains: ptxas did not serialize them, which it
    does when a non-wgmma instruction may define the accumulator while one is in flight); weight
    and activation tiles by TMA; no spills; the ring within the 227 KB of shared memory a block
    may have."""
    sass, shared = _dqmma_sass(block_n, bm, stages, layout, partial, fast)
    mma = re.findall(rf"HGMMA\.64x{bm}x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
    assert len(mma) == 16, len(mma)
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") >= 8
    assert ("F2FP.F16.E4M3.UNPACK_B" in sass) != fast
    assert sass.count("HMUL2.BF16_V2") == (64 if fast else 0)
    assert "UTMALDG" in sass
    ins = instructions(sass)
    hgmma = [a for a, t in ins if "HGMMA" in t]
    assert not [t for a, t in ins if hgmma[0] <= a <= hgmma[-1] and re.search(r"\b(STL|LDL)\b", t)]
    assert shared <= 227 * 1024


@pytest.mark.parametrize("block_n,bm,stages,layout,partial", [
    (128, 128, 4, "trtllm", True), (64, 64, 6, "cutlass", False)])
def test_specialized_dqmma_has_no_cta_barrier_in_its_k_loop(block_n, bm, stages, layout, partial):
    """The warp-specialized dqmma for sm_90a: each consumer warpgroup (``block_n / 64``) issues
    its own 16 bf16 wgmmas (register operand, left in flight), converts with the bit path, and
    synchronizes only within itself (named barriers of 128 threads: ``BAR.SYNC n, 0x80``) and
    through the ring's mbarriers (``SYNCS``); the producer warp issues the TMA loads; the
    partitions' registers are re-divided (``USETMAXREG``); no spills in the K loops."""
    sass, shared = _dqmma_sass(block_n, bm, stages, layout, partial, specialized=True)
    cons = block_n // 64
    mma = re.findall(rf"HGMMA\.64x{bm}x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
    assert len(mma) == 16 * cons, len(mma)
    assert sass.count("HMUL2.BF16_V2") == 64 * cons
    assert "UTMALDG" in sass and "USETMAXREG" in sass and "SYNCS.ARRIVE" in sass
    ins = instructions(sass)
    loops = []  # K loops: a backward branch over one K-tile's 8 HGMMAs
    for a, t in ins:
        if (j := re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)) and int(j[1], 16) < a:
            body = [u for b, u in ins if int(j[1], 16) <= b <= a]
            if sum("HGMMA" in u for u in body) == 8:
                loops.append(body)
    assert len(loops) >= cons, len(loops)
    in_loops = [t for body in sorted(loops, key=len)[:cons] for t in body]  # the innermost
    bars = [t for t in in_loops if "BAR.SYNC" in t]
    assert bars and all(re.search(r"BAR\.SYNC\.DEFER_BLOCKING 0x[0-9a-f]+, 0x80$", t.strip())
                        for t in bars), bars
    assert not [t for t in in_loops if re.search(r"\b(STL|LDL)\b", t)]
    assert shared <= 227 * 1024


@pytest.mark.parametrize("block_n,bm,stages,layout,specialized", [
    (64, 256, 3, "trtllm", False), (64, 128, 3, "cutlass", False), (128, 64, 3, "trtllm", False),
    (128, 256, 2, "trtllm", True), (128, 128, 4, "cutlass", True)])
def test_dqmma_epilogue_stores_whole_16_byte_pieces(block_n, bm, stages, layout, specialized):
    """The dqmma epilogue's bf16 output for sm_90a leaves in 16-byte stores only (``STG.E.128``:
    a thread's 8 contiguous elements of one token's row), exactly the tile's bytes over 16 per
    thread (the specialized kernel: per consumer), where the wgmma accumulator's own layout
    would give one 2-byte store per element; the exchange through shared memory keeps the
    kernel within the 227 KB a block may have."""
    sass, shared = _dqmma_sass(block_n, bm, stages, layout, False, specialized=specialized)
    stores = re.findall(r"\bSTG\.E[.\w]*", sass)
    threads = 128 if specialized else 2 * block_n  # each consumer's code stores its 64 rows
    assert set(stores) == {"STG.E.128"}, sorted(set(stores))
    assert len(stores) * threads * 16 == block_n * bm * 2
    assert shared <= 227 * 1024


@pytest.mark.parametrize("specialized", [False, True], ids=["one-chain", "specialized"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["strict", "weight-first"])
def test_dqmma_pdl_reads_the_activations_only_after_the_wait(specialized, prefetch):
    """The dqmma kernel as a programmatic dependent of the quantization kernel that writes its
    activations (issue 26). Per partition (the specialized kernel's code is split by its
    ``setmaxnreg``: consumers, then the producer warp): with ``PREFETCH`` off (``MXFP8_PDL=strict``)
    every partition waits (``griddepcontrol.wait``: ACQBULK) before any global-memory access;
    with it, the only TMA loads before the wait are the weight's (the one-chain kernel's prologue:
    one box per stage but the last; the producer: two 64-row boxes per stage), beside the scale
    words' loads, nothing is stored before it, and the activations' boxes come after it. The
    next kernel (the split-K reduction) is released after the wait (PREEXIT); without PDL neither
    instruction is there."""
    block_n, bm, stages = (128, 128, 4) if specialized else (64, 64, 3)
    sass, _ = _dqmma_sass(block_n, bm, stages, "trtllm", True, specialized=specialized,
                          pdl=True, prefetch=prefetch)
    ins = [t for _, t in instructions(sass)]
    cuts = [i for i, t in enumerate(ins) if "USETMAXREG" in t] if specialized else []
    parts = [ins[a:b] for a, b in zip([0, *cuts], [*cuts, len(ins)], strict=True)]
    glob = re.compile(r"\b(LDG|STG|ATOM|ATOMG|RED|UTMALDG)\b")
    parts = [p for p in parts if any(glob.search(t) for t in p)]
    assert len(parts) == (3 if specialized else 1)
    for p in parts:
        wait = next((i for i, t in enumerate(p) if t.startswith("ACQBULK")), len(p))
        before, after = p[:wait], p[wait:]
        if not prefetch:
            assert wait < len(p) and not [t for t in before if glob.search(t)]
        if wait < len(p):
            assert not [t for t in before if re.search(r"\b(STG|ATOM|ATOMG|RED)\b", t)]
            assert any(t.startswith("PREEXIT") for t in after)
            if prefetch:
                tma = [t for t in before if "UTMALDG" in t]
                assert len(tma) == (2 * stages if specialized else stages - 1), tma
                assert any("UTMALDG" in t for t in after)  # the activation boxes
    if prefetch and specialized:  # only the producer waits; the consumers need its loads
        assert sum(any(t.startswith("ACQBULK") for t in p) for p in parts) == 1
    plain, _ = _dqmma_sass(block_n, bm, stages, "trtllm", True, specialized=specialized)
    assert "ACQBULK" not in plain and "PREEXIT" not in plain
