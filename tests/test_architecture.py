"""Which tensors are linear weights (architecture.py, plan.py): from the transformers
architecture built on the meta device, name rules only where it cannot be built; the language
model only by default; ``--ignore`` on the checkpoint's own names; stacked 3-D experts;
modules no MXFP8 layout fits kept under ``--on-ineligible keep``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mxfp8_convert import convert
from mxfp8_convert.convert import plan_conversion
from mxfp8_convert.errors import FormatError, IneligibleError
from mxfp8_convert.quantize import quantize_mxfp8
from mxfp8_convert.verify import verify
from tests import families as fam
from tests.checkpoints import load_all, marker
from tests.hostile import assert_clean_failure, run_cli

pytest.importorskip("transformers")  # the test extra installs it; without it name rules decide


def _quantized(out) -> set[str]:
    """Modules the output holds in MXFP8 (an e4m3 weight with a UE8M0 scale)."""
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        return {
            n[: -len(".weight")]
            for n in names
            if n.endswith(".weight") and f.get_slice(n).get_dtype() == "F8_E4M3"
        }


def _plan(src, backend="canonical", **kw):
    return plan_conversion(src, backend, on_ineligible="keep", **kw)[1]


# --- item 2: the architecture decides ---------------------------------------------------------


def test_bert_embeddings_are_never_quantized(tmp_path):
    cfg = fam.bert_config()
    src = fam.write(tmp_path / "src", cfg, fam.bert_fp32(cfg))
    convert(src, "canonical", tmp_path / "out", on_ineligible="keep")
    assert _quantized(tmp_path / "out") == {f"bert.encoder.layer.0.{m}" for m in fam.BERT_LINEARS}
    plan = _plan(src)
    kinds = {u.name: (u.kind, u.decided_by) for u in plan.unquantized}
    assert kinds["bert.embeddings.token_type_embeddings"] == ("other", "architecture")
    assert kinds["bert.embeddings.position_embeddings"] == ("other", "architecture")
    assert kinds["cls.predictions.transform.dense"] == ("outside", "architecture")
    assert {m.decided_by for m in plan.modules} == {"architecture"}


@pytest.mark.parametrize("new_names", [False, True], ids=["hub-names", "model.visual-names"])
def test_qwen2_vl_vision_tower_and_merger_stay_unless_opted_in(tmp_path, new_names):
    cfg = fam.qwen2_vl_config()
    src = fam.write(tmp_path / "src", cfg, fam.qwen2_vl_bf16(cfg, new_names=new_names))
    lm = "model.language_model.layers.0" if new_names else "model.layers.0"
    vis = "model.visual" if new_names else "visual"
    convert(src, "canonical", tmp_path / "out", on_ineligible="keep")
    assert _quantized(tmp_path / "out") == {f"{lm}.{m}" for m in fam.QWEN2_VL_LM}
    left = set(marker(tmp_path / "out")["ignored_layers"])
    assert {
        f"{vis}.blocks.0.attn.qkv",
        f"{vis}.merger.mlp.0",
        f"{vis}.merger.mlp.2",
        "lm_head",
    } <= left
    convert(src, "canonical", tmp_path / "towers", on_ineligible="keep", quantize_towers=True)
    assert {
        f"{vis}.blocks.0.attn.qkv",
        f"{vis}.blocks.0.mlp.fc1",
        f"{vis}.merger.mlp.0",
    } <= _quantized(tmp_path / "towers")
    assert verify(tmp_path / "towers", src).ok and verify(tmp_path / "out", src).ok


def test_moe_routers_and_scalar_gates_are_not_quantized(tmp_path):
    cfg = fam.qwen2_moe_config()
    src = fam.write(tmp_path / "src", cfg, fam.qwen2_moe_bf16(cfg))
    convert(src, "canonical", tmp_path / "out", on_ineligible="keep")  # keep: the hint's advice
    got = _quantized(tmp_path / "out")
    assert (
        "model.layers.0.mlp.shared_expert_gate" not in got and "model.layers.0.mlp.gate" not in got
    )
    assert {
        "model.layers.0.mlp.experts.1.down_proj",
        "model.layers.0.mlp.shared_expert.up_proj",
    } <= got
    kinds = {u.name: u.kind for u in _plan(src).unquantized}
    assert (
        kinds["model.layers.0.mlp.shared_expert_gate"]
        == kinds["model.layers.0.mlp.gate"]
        == "router"
    )


def test_name_rules_decide_only_where_the_architecture_cannot_be_built(tmp_path):
    cfg = {
        **fam.llama_config(),
        "model_type": "llama_from_the_future",
        "architectures": ["FutureLM"],
    }
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(fam.llama_config()))
    plan = _plan(src)
    assert {m.decided_by for m in plan.modules} == {"names"}
    assert {m.name for m in plan.modules} == set(fam.llama_linears(fam.llama_config()))
    why = {u.name: u.why for u in plan.unquantized}
    assert "llama_from_the_future" in why["lm_head"]
    doc = json.dumps(plan.to_dict())
    assert '"decided_by": "names"' in doc


# --- item 3: --ignore -------------------------------------------------------------------------


def test_ignore_pattern_matching_nothing_is_an_error_naming_it(capsys, tmp_path):
    cfg = fam.qwen2_vl_config()
    src = fam.write(tmp_path / "src", cfg, fam.qwen2_vl_bf16(cfg, new_names=True))
    dest = tmp_path / "out"
    line = assert_clean_failure(
        run_cli(
            capsys,
            src,
            "-b",
            "canonical",
            "-o",
            dest,
            "--on-ineligible",
            "keep",
            "--ignore",
            "vision.*",
        ),
        dest,
    )
    assert "--ignore 'vision.*' matches no module" in line


def test_marker_records_exact_names_and_ignored_fp8_modules_are_dequantized(capsys, tmp_path):
    """Qwen3-FP8-style block FP8 with --ignore: the ignored module is written BF16 (no 128x128
    scale left behind), the marker lists it by name, and verify accepts the output."""
    cfg = fam.llama_config()
    t = fam.llama_dense(cfg)
    g = fam.gen(1)
    from mxfp8_convert.synth import fp8_scales, random_e4m3

    for m, (n, k) in fam.llama_linears(cfg).items():
        t[f"{m}.weight"] = random_e4m3((n, k), g)
        t[f"{m}.weight_scale_inv"] = fp8_scales((-(-n // 128), -(-k // 128)), g, pow2=False).to(
            torch.bfloat16
        )
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    src = fam.write(tmp_path / "src", {**cfg, "quantization_config": qc}, t)
    for backend in ("canonical", "cutlass"):
        out = tmp_path / backend
        code, _, err = run_cli(
            capsys,
            src,
            "-b",
            backend,
            "-o",
            out,
            "--on-ineligible",
            "keep",
            "--ignore",
            "*.mlp.down_proj",
            "--ignore",
            "model.layers.0.self_attn.o_proj",
            "--json",
        )
        assert code == 0, err
        got, _ = load_all(out)
        for m in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
            assert got[f"{m}.weight"].dtype == torch.bfloat16 and f"{m}.weight_scale_inv" not in got
            s = t[f"{m}.weight_scale_inv"].float()
            n, k = s.shape[0] * 128, s.shape[1] * 128
            want = (
                t[f"{m}.weight"].float()
                * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            )
            assert torch.equal(got[f"{m}.weight"], want.to(torch.bfloat16))
        left = marker(out)["ignored_layers"]
        assert "model.layers.0.mlp.down_proj" in left and "*.mlp.down_proj" not in left
        code, _, err = run_cli(capsys, "verify", out, "--source", src)
        assert code == 0, err


# --- item 4: stacked 3-D experts --------------------------------------------------------------


def _expert(t, name, e, sel) -> torch.Tensor:
    """Expert ``e``'s [N, K] weight out of a stacked [E, K, N'] tensor, by the family's layout."""
    x = t[name][e].float()
    n = x.shape[1] // (1 if sel == "all" else 2)
    cols = {
        "all": slice(None),
        "first": slice(0, n),
        "second": slice(n, None),
        "even": slice(0, None, 2),
        "odd": slice(1, None, 2),
    }[sel]
    return x[:, cols].t().contiguous().to(torch.bfloat16)


@pytest.mark.parametrize("family", ["llama4", "gpt_oss"])
def test_stacked_experts_are_quantized_per_expert(tmp_path, family):
    cfg, t = {"llama4": (fam.llama4_config(), None), "gpt_oss": (fam.gpt_oss_config(), None)}[
        family
    ]
    t = fam.llama4_bf16(cfg) if family == "llama4" else fam.gpt_oss_bf16(cfg)
    block = (
        "model.layers.0.feed_forward.experts"
        if family == "llama4"
        else "model.layers.0.mlp.experts"
    )
    halves = ("first", "second") if family == "llama4" else ("even", "odd")  # gate, up
    src = fam.write(tmp_path / "src", cfg, t)
    convert(src, "canonical", tmp_path / "out", on_ineligible="keep")
    got, _ = load_all(tmp_path / "out")
    assert f"{block}.gate_up_proj" not in got
    for e in range(cfg["num_local_experts"]):
        for proj, name, sel in (
            ("gate_proj", "gate_up_proj", halves[0]),
            ("up_proj", "gate_up_proj", halves[1]),
            ("down_proj", "down_proj", "all"),
        ):
            q, s = quantize_mxfp8(_expert(t, f"{block}.{name}", e, sel))
            assert torch.equal(
                got[f"{block}.{e}.{proj}.weight"].view(torch.uint8), q.view(torch.uint8)
            ), (e, proj)
            assert torch.equal(got[f"{block}.{e}.{proj}.weight_scale_inv"], s)
    assert verify(tmp_path / "out", src).ok


def test_llama4_stacked_experts_fuse_for_trtllm_and_gpt_oss_does_not(tmp_path):
    cfg = fam.llama4_config()
    src = fam.write(tmp_path / "l4", cfg, fam.llama4_bf16(cfg))
    plan = _plan(src, "trtllm")
    assert [layer.name for layer in plan.moe] == ["model.layers.0.feed_forward.experts"]
    cfg = fam.gpt_oss_config()
    src = fam.write(tmp_path / "oss", cfg, fam.gpt_oss_bf16(cfg))
    plan = _plan(src, "trtllm")  # clamped SwiGLU with biases: not the fused kernel's experts
    assert not plan.moe and "model.layers.0.mlp.experts.0.gate_proj" in {
        m.name for m in plan.modules
    }


def test_stacked_experts_of_unknown_layout_are_said(capsys, tmp_path):
    cfg = fam.llama4_config()
    t = fam.llama4_bf16(cfg)
    t["model.layers.0.feed_forward.experts.gate_up_proj"] = t[
        "model.layers.0.feed_forward.experts.gate_up_proj"
    ][:, :, :-32].contiguous()  # does not fit intermediate_size: layout unknown
    src = fam.write(tmp_path / "src", cfg, t)
    code, out, err = run_cli(
        capsys, src, "-b", "canonical", "-o", tmp_path / "out", "--on-ineligible", "keep", "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    stacked = [u for u in doc["plan"]["unquantized"] if u["kind"] == "stacked_experts"]
    assert [u["name"] for u in stacked] == ["model.layers.0.feed_forward.experts.gate_up_proj"]
    assert "left as they are" in stacked[0]["why"]
    code, out, err = run_cli(
        capsys, src, "-b", "cutlass", "-o", tmp_path / "o2", "--on-ineligible", "keep"
    )
    assert code == 0 and "NOT quantized" in out


# --- item 7: a dense module no MXFP8 layout fits ----------------------------------------------


def test_dense_module_with_k_588_is_kept_under_keep_and_the_error_points_at_ignore(
    capsys, tmp_path
):
    cfg = fam.llama_config()
    t = fam.llama_dense(cfg)
    t["model.vision_tower.patch_embedding.linear.weight"] = fam.randn((256, 588), fam.gen(2))
    src = fam.write(tmp_path / "src", cfg, t)
    dest = tmp_path / "out"
    with pytest.raises(IneligibleError) as e:
        convert(src, "cutlass", dest, quantize_towers=True)
    assert "K=588" in str(e.value) and "--ignore" in e.value.hint and "keep" in e.value.hint
    convert(src, "cutlass", dest, quantize_towers=True, on_ineligible="keep")
    got, _ = load_all(dest)
    assert torch.equal(
        got["model.vision_tower.patch_embedding.linear.weight"],
        t["model.vision_tower.patch_embedding.linear.weight"],
    )
    assert "model.vision_tower.patch_embedding.linear" in marker(dest)["ignored_layers"]
    with pytest.raises(FormatError, match="matches no module"):
        convert(src, "cutlass", tmp_path / "o2", ignore=["vision_tower.patch_embed"])


@pytest.mark.parametrize("model_type", [["llama4"], {"a": 1}, 4])
def test_stacked_experts_of_a_model_type_that_is_no_name_are_said(capsys, tmp_path, model_type):
    """A config whose model_type is not a string: its stacked experts are of no known layout."""
    cfg = fam.llama4_config()
    for c in (cfg, cfg.get("text_config") or {}):
        if "model_type" in c:
            c["model_type"] = model_type
    src = fam.write(tmp_path / "src", cfg, fam.llama4_bf16(fam.llama4_config()))
    code, out, err = run_cli(
        capsys, src, "-b", "cutlass", "-o", tmp_path / "out", "--on-ineligible", "keep", "--json"
    )
    assert code == 0, err
    stacked = [u for u in json.loads(out)["plan"]["unquantized"] if u["kind"] == "stacked_experts"]
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in [u["name"] for u in stacked]
