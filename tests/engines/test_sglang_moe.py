"""The SGLang plug-in's MoE experts in SGLang 0.5.23's real MoE blocks, TP=1 and TP=2, on CPU.

``sglang_moe_worker.py`` builds every layer's MoE block of the model's own SGLang class
(``MixtralMoE``, ``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``) with the config SGLang's
``ModelConfig`` + ``get_quant_config`` pick from the marker, loads it with the model's own
``load_weights`` (SGLang's expert mapping: shard ids w1 / w3 / w2, expert ids), one process per
rank over gloo, and runs it: SGLang's router and ``TopK``, our experts. Checked here,
independently of the plug-in's slicing code:

- each rank's ``w13`` / ``w2`` bytes are the file's slices (every expert's gate rows then its up
  rows of the rank, its K of down; 128x128 scale tiles for cutlass, rows and 32-column blocks
  for canonical experts), and after loading the runtime's experts are views of them;
- each rank's output against an oracle written here: the routing computed from the stored router
  (softmax, top-k, renormalized where the model does), the experts dequantized from canonical
  bytes (the synthetic MXFP8 source, or a ``--backend canonical`` / ``--moe keep`` conversion of
  the BF16 source), the rank's gate / up rows and down K, in float64, activations quantized to
  MXFP8 with the reference recipe. The ranks' partial sums add up to the one-rank oracle.
- the refusals, one line each: fused MoE blocks, a TP size at which an expert does not slice on
  tiles (the same checkpoint loads at TP=1), expert parallelism, experts that are not SwiGLU.

Tolerance: the oracle rounds where the engine's linears write bf16 (gate, up, their SwiGLU
product) but sums in float64, where the engine rounds each expert's down output and the weighted
sum to bf16; a rounding of the engine's float32 accumulation the other way can move an
activation across an e4m3 step (2^-3 relative in that element). Measured relative error
(Frobenius) 0.22-0.30 %, 1/128 allowed; without the bf16 roundings in the oracle it is 0.7-2 %.

Runs in the sglang venv (``make test-engines``); elsewhere it skips, unless
``MXFP8_ENGINE_TESTS=sglang`` says the engine must be there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("MXFP8_ENGINE_TESTS") == "sglang":
    import sglang  # noqa: F401 (make test-engines: the engine must be there, no skip)
else:
    pytest.importorskip("sglang", reason="needs the sglang venv (make test-engines)")

import tiny_models  # noqa: E402
from conftest import convert, free_port  # noqa: E402

from mxfp8_convert.runtime.reference import fake_quantize_mxfp8  # noqa: E402
from mxfp8_convert.synth import SynthSpec, write_checkpoint  # noqa: E402
from tests.checkpoints import load_all  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 540
REL_TOLERANCE = 1 / 128
#: name -> (source, backend options, experts' layout, where the oracle's canonical bytes are)
CKPTS = {
    "mixtral-cutlass": ("mixtral", ("--backend", "cutlass"), "cutlass", "mixtral-keep"),
    "mixtral-keep": ("mixtral", ("--backend", "trtllm", "--moe", "keep"), "canonical",
                     "mixtral-keep"),
    "qwen2moe-cutlass": ("qwen2_moe", ("--backend", "cutlass"), "cutlass", "qwen2moe-canonical"),
    "qwen3moe-cutlass": ("qwen3_moe", ("--backend", "cutlass"), "cutlass", "src-qwen3_moe"),
}
SERVED = list(CKPTS)
#: the refused ones: fused trtllm blocks; experts of I=384 (3 tiles: only TP=1 slices them)
REFUSED = {"mixtral-fused": ("mixtral", ("--backend", "trtllm")),
           "qwen3-tp1only": ("qwen3_tp1only", ("--backend", "cutlass"))}
#: (TP, EP) -> checkpoints each rank builds
RUNS = {(1, 1): [*SERVED, "mixtral-fused", "qwen3-tp1only"],
        (2, 1): [*SERVED, "qwen3-tp1only"],
        (2, 2): ["mixtral-cutlass"]}
QWEN3 = dict(layers=2, hidden=512, intermediate=512, heads=4, kv_heads=2, vocab=256, shards=2,
             experts=4)


def _qwen3(path: Path, inter: int) -> Path:
    """A synthetic MXFP8 Qwen3-MoE (config ``Qwen3MoeForCausalLM``, experts spread over two
    shards), top-2 renormalized (``norm_topk_prob`` set, not left to a default)."""
    write_checkpoint(path, SynthSpec(**QWEN3, moe_intermediate=inter))
    cfg = json.loads((path / "config.json").read_text())
    cfg["norm_topk_prob"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sglang-moe")
    src = {kind: tiny_models.build(kind, base / f"src-{kind}") for kind in ("mixtral", "qwen2_moe")}
    src["qwen3_moe"] = _qwen3(base / "src-qwen3_moe", 256)
    src["qwen3_tp1only"] = _qwen3(base / "src-qwen3_tp1only", 384)
    out = {"src-qwen3_moe": src["qwen3_moe"]}
    for name, (kind, options, *_) in {**CKPTS, **REFUSED}.items():
        out[name] = convert(src[kind], options[1], base / name, *options[2:])
    out["qwen2moe-canonical"] = convert(src["qwen2_moe"], "canonical", base / "qwen2moe-canonical")
    return out


@pytest.fixture(scope="module")
def results(ckpts, tmp_path_factory) -> dict:
    """``results[(tp, ep)][rank][checkpoint]``: what each rank's MoE blocks held and computed."""
    out_dir = tmp_path_factory.mktemp("sglang-moe-ranks")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for (tp, ep), names in RUNS.items():
        port, d = free_port(), out_dir / f"tp{tp}-ep{ep}"
        d.mkdir()
        for rank in range(tp):
            cmd = [sys.executable, "-m", "tests.engines.sglang_moe_worker", str(tp), str(ep),
                   str(rank), str(port), str(d), *(str(ckpts[c]) for c in names)]
            log = open(d / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log),
                          d, rank))
    for p, d, rank in procs:
        try:
            rc = p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        assert rc == 0, f"rank {rank} of {d.name} exited {rc}:\n" + \
            (d / f"rank{rank}.log").read_text()[-3000:]

    def one(tp, ep, rank, i):
        return torch.load(out_dir / f"tp{tp}-ep{ep}" / f"rank{rank}-{i}.pt", weights_only=False)

    return {(tp, ep): {rank: {c: one(tp, ep, rank, i) for i, c in enumerate(names)}
                       for rank in range(tp)} for (tp, ep), names in RUNS.items()}


def _cases():
    return [(tp, rank, c) for tp in (1, 2) for rank in range(tp) for c in SERVED]


def _experts_prefix(res: dict, layer: int) -> str:
    return f"model.layers.{layer}.{res['attr']}.experts"


def _names(name: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if name.startswith("mixtral") else ("gate_proj", "up_proj",
                                                                   "down_proj")


@pytest.mark.parametrize("tp,rank,name", _cases())
def test_sglang_picks_the_experts_method_and_keeps_the_loaded_storage(results, tp, rank, name):
    res = results[(tp, 1)][rank][name]
    assert "error" not in res, res.get("error")
    assert res["quantization"] == "mxfp8_convert" and res["config"] == "MXFP8ConvertConfig"
    for layer in res["layers"]:
        assert layer["method"] == "MXFP8ConvertExpertsMethod"
        assert layer["layout"] == CKPTS[name][2]
        assert layer["engine"] == "reference"  # CPU
        assert layer["tp"] == (rank, tp)
        assert layer["same_storage"], "process_weights_after_loading moved a parameter"
        assert all(layer["views"].values()), layer["views"]  # the runtime's experts: views


@pytest.mark.parametrize("tp,rank,name", _cases())
def test_rank_expert_bytes_are_the_files_slices(ckpts, results, tp, rank, name):
    """Per expert: ``w13`` = the rank's rows of gate, then of up; ``w2`` = its K of down; scale
    tiles of 128 rows / 128 K (cutlass) or scale rows and K/32 blocks (canonical), as stored."""
    stored = load_all(ckpts[name])[0]
    res = results[(tp, 1)][rank][name]
    gate, up, down = _names(name)
    laid_out = CKPTS[name][2] == "cutlass"
    sfx = "weight_scale_swizzled" if laid_out else "weight_scale_inv"
    for i, layer in enumerate(res["layers"]):
        p = _experts_prefix(res, i)
        params = layer["params"]
        experts = params["w13_weight"].shape[0]
        inter = stored[f"{p}.0.{gate}.weight"].shape[0]
        r0, r1 = rank * inter // tp, (rank + 1) * inter // tp
        tile = 128 if laid_out else 1  # weight rows per scale index, dim 0
        kblock = 128 if laid_out else 32  # K columns per scale index, dim 1
        assert sorted(params) == sorted(["w13_weight", f"w13_{sfx}", "w2_weight", f"w2_{sfx}"])
        for e in range(experts):
            def w(proj, q=f"{p}.{e}"):
                return stored[f"{q}.{proj}.weight"].view(torch.uint8)

            def s(proj, q=f"{p}.{e}"):
                return stored[f"{q}.{proj}.{sfx}"]

            assert torch.equal(params["w13_weight"][e], torch.cat([w(gate)[r0:r1],
                                                                   w(up)[r0:r1]])), (p, e)
            assert torch.equal(params[f"w13_{sfx}"][e],
                               torch.cat([s(gate)[r0 // tile:r1 // tile],
                                          s(up)[r0 // tile:r1 // tile]])), (p, e)
            assert torch.equal(params["w2_weight"][e], w(down)[:, r0:r1]), (p, e)
            assert torch.equal(params[f"w2_{sfx}"][e],
                               s(down)[:, r0 // kblock:r1 // kblock]), (p, e)


def _dequantize(q: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """float64 ``q * 2^(code - 127)`` per 1x32 block of canonical MXFP8 bytes."""
    n, k = q.shape
    scale = torch.exp2(code.view(torch.uint8).double() - 127)
    return (q.view(torch.float8_e4m3fn).double().reshape(n, k // 32, 32)
            * scale.unsqueeze(-1)).reshape(n, k)


def _routing(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool):
    probs = (x.double() @ router.double().t()).softmax(-1)
    w, ids = torch.topk(probs, top_k)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), ids


def _model_routing(ckpts, name: str) -> tuple[int, bool]:
    """(top-k, renormalized?) as the model defines them: Mixtral always renormalizes; the
    Qwen MoE models when config.json's ``norm_topk_prob`` says so."""
    cfg = json.loads((ckpts[name] / "config.json").read_text())
    renorm = True if name.startswith("mixtral") else bool(cfg["norm_topk_prob"])
    return cfg["num_experts_per_tok"], renorm


def _oracle(ckpts, name: str, res: dict, i: int, tp: int, rank: int):
    """``(out, ids)``: rank ``rank``'s partial sum of layer ``i``'s experts on its tokens,
    float64 (see the module docstring; rows / K of the rank by plain indexing), and the experts
    each token is routed to."""
    canon = load_all(ckpts[CKPTS[name][3]])[0]
    gate, up, down = _names(name)
    p = _experts_prefix(res, i)
    layer = res["layers"][i]
    x = layer["x"]
    top_k, renorm = _model_routing(ckpts, name)
    weights, ids = _routing(x, canon[f"{p.rpartition('.')[0]}.gate.weight"], top_k, renorm)

    def dq(e, proj):
        q = f"{p}.{e}.{proj}"
        return _dequantize(canon[f"{q}.weight"], canon[f"{q}.weight_scale_inv"])

    inter = canon[f"{p}.0.{gate}.weight"].shape[0]
    rows = slice(rank * inter // tp, (rank + 1) * inter // tp)
    a = fake_quantize_mxfp8(x).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            g = (a[t] @ dq(e, gate)[rows].t()).bfloat16().float()  # each linear writes bf16
            u = (a[t] @ dq(e, up)[rows].t()).bfloat16().float()
            h = fake_quantize_mxfp8((F.silu(g) * u).bfloat16().unsqueeze(0))[0].double()
            out[t] += weights[t, j] * (h @ dq(e, down)[:, rows].t())
    return out, ids


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("tp,rank,name", _cases())
def test_experts_output_equals_the_float64_oracle(ckpts, results, tp, rank, name):
    """SGLang's router and TopK choose the oracle's experts, and the rank's partial sum (the
    combine input of its ``FusedMoE``; for Mixtral and Qwen3-MoE also the whole block's
    output) equals the oracle's within the tolerance."""
    res = results[(tp, 1)][rank][name]
    for i, layer in enumerate(res["layers"]):
        want, ids = _oracle(ckpts, name, res, i, tp, rank)
        assert torch.equal(layer["topk_ids"].sort(-1).values.long(), ids.sort(-1).values)
        _, renorm = _model_routing(ckpts, name)
        assert layer["renormalize"] == renorm
        err = _rel(layer["experts_out"], want)
        print(f"{name} tp={tp} rank={rank} layer {i}: relative error {err:.2e}")
        assert err < REL_TOLERANCE
        if "block_out" in layer:
            assert torch.equal(layer["block_out"], layer["experts_out"])
        assert torch.equal(layer["bypassed_out"], layer["experts_out"])  # routed by apply


@pytest.mark.parametrize("name", SERVED)
def test_the_ranks_partial_sums_add_up_to_the_one_rank_oracle(ckpts, results, name):
    res = results[(1, 1)][0][name]
    for i in range(len(res["layers"])):
        want, _ = _oracle(ckpts, name, res, i, 1, 0)
        got = sum(results[(2, 1)][r][name]["layers"][i]["experts_out"].double() for r in (0, 1))
        assert _rel(got, want) < REL_TOLERANCE


def _one_line(err: str) -> str:
    assert err and "\n" not in err, err
    return err


def test_refusals_are_one_line_at_start_up(results):
    fused = _one_line(results[(1, 1)][0]["mixtral-fused"].get("error", ""))
    assert "fused MoE blocks (model.layers.0.block_sparse_moe.experts, ...)" in fused, fused
    for rank in (0, 1):
        err = _one_line(results[(2, 1)][rank]["qwen3-tp1only"].get("error", ""))
        assert "tensor parallel 2 is not in this checkpoint's tp_compat [1]" in err, err
        assert "model.layers.0.mlp.experts.0.down_proj [512, 384]" in err, err
        ep = _one_line(results[(2, 2)][rank]["mixtral-cutlass"].get("error", ""))
        assert ep == ("LayoutError: model.layers.0.block_sparse_moe.experts: expert parallelism "
                      "(EP size 2) is not supported; serve it with tensor parallelism"), ep
    assert "error" not in results[(1, 1)][0]["qwen3-tp1only"]  # the same checkpoint at TP=1
    for name in SERVED:
        err = _one_line(results[(1, 1)][0][name]["unsupported"])
        assert err.startswith("LayoutError: model.layers.0.") and err.endswith(
            ".experts: the layer's experts have activation 'gelu'; MXFP8 experts run SwiGLU "
            "experts without biases only"), err
        for layer in results[(1, 1)][0][name]["layers"]:
            err = _one_line(layer["triton_format_error"])
            assert err.startswith("LayoutError: model.layers.") and err.endswith(
                ".experts: top-k output TRITON_KERNEL is not the standard (ids, weights) the "
                "MXFP8 experts take"), err
