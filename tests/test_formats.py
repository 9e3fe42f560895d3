"""Source format detection (formats.py): positive evidence only, unsupported schemes refused by
name from whichever file declares them, no run that converts nothing, ModelOpt FP8 declared
only in hf_quant_config.json, and what becomes of its activation and KV-cache scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mxfp8_convert import convert
from mxfp8_convert.errors import FormatError
from mxfp8_convert.verify import verify
from tests import families as fam
from tests.checkpoints import leftovers, marker
from tests.hostile import assert_clean_failure, run_cli

CFG = fam.llama_config()


def _refused(capsys, src, dest, *args) -> str:
    line = assert_clean_failure(run_cli(capsys, src, "-b", "cutlass", "-o", dest, *args), dest)
    _, _, err = run_cli(capsys, src, "-b", "cutlass", "-o", dest, *args)
    assert "--source-format" not in err, err  # never a hint to relabel what is not supported
    return line


@pytest.mark.parametrize(
    "args",
    [(), ("--source-format", "compressed_tensors_mxfp8"), ("--source-format", "sglang_mxfp8")],
)
def test_nvfp4_declared_only_in_hf_quant_config_is_refused_by_name(capsys, tmp_path, args):
    tensors, hfq = fam.modelopt_nvfp4(CFG)
    src = fam.write(tmp_path / "src", CFG, tensors, {"hf_quant_config.json": hfq})
    line = _refused(capsys, src, tmp_path / "out", *args)
    assert "hf_quant_config.json: ModelOpt NVFP4 is not supported" in line


def test_awq_declared_only_in_quant_config_json_is_refused_by_name(capsys, tmp_path):
    tensors, qc = fam.autoawq(CFG)
    src = fam.write(tmp_path / "src", CFG, tensors, {"quant_config.json": qc})
    assert "quant_config.json: AWQ 4-bit is not supported" in _refused(
        capsys, src, tmp_path / "out"
    )
    (src / "quant_config.json").unlink()  # the tensors alone say what it is
    assert "AWQ/GPTQ packed int4 (qweight)" in _refused(capsys, src, tmp_path / "out")


@pytest.mark.parametrize(
    "args", [(), ("--source-format", "sglang_mxfp8"), ("--source-format", "fp8")]
)
def test_gpt_oss_mxfp4_is_refused_also_with_source_format(capsys, tmp_path, args):
    cfg = {**fam.gpt_oss_config(), "quantization_config": fam.GPT_OSS_MXFP4_QC}
    src = fam.write(tmp_path / "src", cfg, fam.gpt_oss_mxfp4(cfg))
    assert "config.json: quant_method 'mxfp4' is not supported" in _refused(
        capsys, src, tmp_path / "out", *args
    )


def test_mxfp4_tensors_without_a_config_are_refused(capsys, tmp_path):
    cfg = fam.gpt_oss_config()
    src = fam.write(tmp_path / "src", cfg, fam.gpt_oss_mxfp4(cfg))
    line = _refused(capsys, src, tmp_path / "out", "--source-format", "compressed_tensors_mxfp8")
    assert "_proj_blocks" in line and "MXFP4" in line


def test_fp8_declared_over_bf16_weights_is_refused(capsys, tmp_path):
    cfg = {**CFG, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    src = fam.write(tmp_path / "src", cfg, fam.llama_dense(CFG))
    line = _refused(capsys, src, tmp_path / "out")
    assert "no float8_e4m3fn weight" in line and "BF16" in line


def test_ct_int8_is_refused_by_name(capsys, tmp_path):
    qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
            }
        },
    }
    src = fam.write(tmp_path / "src", {**CFG, "quantization_config": qc}, fam.llama_dense(CFG))
    assert "compressed-tensors int8 channel" in _refused(capsys, src, tmp_path / "out")


def test_a_run_that_converts_nothing_is_an_error_unless_asked(capsys, tmp_path):
    src = fam.write(tmp_path / "src", CFG, fam.llama_dense(CFG))
    dest = tmp_path / "out"
    line = assert_clean_failure(
        run_cli(capsys, src, "-b", "cutlass", "-o", dest, "--ignore", "model.layers.*"), dest
    )
    assert "no module would be converted" in line
    code, _, err = run_cli(
        capsys,
        src,
        "-b",
        "cutlass",
        "-o",
        dest,
        "--ignore",
        "model.layers.*",
        "--allow-no-quantized",
    )
    assert code == 0, err
    with safe_open(dest / "model.safetensors", "pt") as f:
        assert all(f.get_slice(n).get_dtype() != "F8_E4M3" for n in f.keys())


# --- ModelOpt FP8 -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["trtllm", "canonical"])
def test_modelopt_fp8_in_hf_quant_config_only_converts_and_verifies(tmp_path, backend):
    tensors, hfq = fam.modelopt_fp8(CFG)
    src = fam.write(tmp_path / "src", CFG, tensors, {"hf_quant_config.json": hfq})
    r = convert(src, backend, tmp_path / "out", on_ineligible="keep")
    assert r.plan.format == "fp8"
    assert r.plan.to_dict()["modules_by_action"] == {"lossless": len(fam.llama_linears(CFG))}
    report = verify(tmp_path / "out", src)
    assert report.ok, report.mismatches[:3]
    assert report.modules_compared == len(fam.llama_linears(CFG))


def test_modelopt_fp8_drops_activation_scales_and_keeps_kv_cache_scales(capsys, tmp_path):
    tensors, hfq = fam.modelopt_fp8(CFG)
    src = fam.write(tmp_path / "src", CFG, tensors, {"hf_quant_config.json": hfq})
    code, out, err = run_cli(
        capsys, src, "-b", "cutlass", "-o", tmp_path / "out", "--on-ineligible", "keep"
    )
    assert code == 0, err
    assert "dropped" in out and "static activation scales" in out and "KV-cache scales" in out
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        k_scale = f.get_tensor("model.layers.0.self_attn.k_proj.k_scale")
    assert not any(n.endswith(".input_scale") for n in names)
    assert {
        "model.layers.0.self_attn.k_proj.k_scale",
        "model.layers.0.self_attn.v_proj.v_scale",
    } <= names
    assert torch.equal(k_scale, tensors["model.layers.0.self_attn.k_proj.k_scale"])
    # the scheme in compressed-tensors' kv_cache_scheme form, which vLLM and SGLang read
    assert marker(tmp_path / "out")["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    assert verify(tmp_path / "out", src).ok


def test_verify_uses_the_recorded_format_and_accepts_source_format(capsys, tmp_path):
    """An output made with --source-format records it, and verify uses it (or the one asked)."""
    tensors, hfq = fam.modelopt_fp8(CFG)
    src = fam.write(tmp_path / "src", CFG, tensors, {"hf_quant_config.json": hfq})
    convert(src, "canonical", tmp_path / "out", source_format="fp8")
    done = json.loads((tmp_path / "out" / "mxfp8_convert.complete.json").read_text())
    assert done["source_format"] == "fp8"
    (src / "hf_quant_config.json").unlink()  # nothing declares the format any more
    assert verify(tmp_path / "out", src).ok
    code, _, err = run_cli(
        capsys, "verify", tmp_path / "out", "--source", src, "--source-format", "fp8"
    )
    assert code == 0, err
    with pytest.raises(FormatError, match="dense"):
        verify(tmp_path / "out", src, source_format="dense")
    assert leftovers(tmp_path) == []
