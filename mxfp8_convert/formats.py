"""Table of source checkpoint formats: how each is recognised and how its tensors pair up.

``FORMATS`` is ordered most specific first; ``detect()`` returns the first whose ``matches``
accepts the config. Sources: docs/LAYOUTS.md section 4 (config keys and tensor names of each
dialect).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mxfp8_convert.errors import FormatError
from mxfp8_convert.format import CANONICAL_QUANT_METHOD, CANONICAL_SUFFIX
from mxfp8_convert.format import QUANT_METHOD as LAID_OUT_QUANT_METHOD  # docs/FORMAT.md


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """One source dialect.

    ``kind`` says what a quantized linear holds: ``mxfp8`` (e4m3 + UE8M0 1x32 scales),
    ``block_fp8`` (e4m3 + float32 128x128 multipliers), ``fp8`` (e4m3 + per-tensor/channel
    float32), ``dense`` (bf16/fp16/fp32 weights, nothing quantized) or ``laid_out`` (ours).
    """

    name: str
    kind: str
    scale_suffix: str | None  # tensor-name suffix pairing a weight with its scale
    description: str
    matches: Callable[[dict, dict], bool]
    ignored: Callable[[dict, dict], list[str]]

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "scale_suffix": self.scale_suffix,
                "description": self.description}


def _qc(cfg: dict) -> dict:
    q = cfg.get("quantization_config")
    return q if isinstance(q, dict) else {}


def _list(v) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def _block_size(q: dict) -> list:
    v = q.get("weight_block_size")
    return list(v) if isinstance(v, list) else []


def _is_sglang_mxfp8(cfg: dict, hfq: dict) -> bool:
    q = _qc(cfg)
    return q.get("quant_method") == CANONICAL_QUANT_METHOD or (q.get("quant_method") == "fp8" and _block_size(q) == [1, 32])


def _ct_groups(cfg: dict) -> list[dict]:
    q = _qc(cfg)
    if q.get("quant_method") != "compressed-tensors":
        return []
    groups = q.get("config_groups")
    if not isinstance(groups, dict):
        return []
    return [g["weights"] for g in groups.values() if isinstance(g, dict) and isinstance(g.get("weights"), dict)]


def _is_ct_mxfp8(cfg: dict, hfq: dict) -> bool:
    return any(
        w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "group"
        and w.get("group_size") == 32
        for w in _ct_groups(cfg)
    )


def _is_ct_fp8(cfg: dict, hfq: dict) -> bool:
    return any(
        w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("tensor", "channel")
        for w in _ct_groups(cfg)
    )


def _is_ct_block_fp8(cfg: dict, hfq: dict) -> bool:
    return any(
        w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "block"
        for w in _ct_groups(cfg)
    )


def _modelopt_algo(cfg: dict, hfq: dict) -> str | None:
    q = _qc(cfg)
    if q.get("quant_method") == "modelopt":
        return str(q.get("quant_algo") or "").upper() or None
    inner = hfq.get("quantization") if isinstance(hfq.get("quantization"), dict) else {}
    return str(inner.get("quant_algo") or "").upper() or None


def _is_block_fp8(cfg: dict, hfq: dict) -> bool:
    q = _qc(cfg)
    return q.get("quant_method") == "fp8" and _block_size(q) == [128, 128]


def _is_fp8(cfg: dict, hfq: dict) -> bool:
    q = _qc(cfg)
    return (q.get("quant_method") == "fp8" and not _block_size(q)) or (
        q.get("quant_method") == "modelopt" and _modelopt_algo(cfg, hfq) == "FP8"
    )


def _is_dense(cfg: dict, hfq: dict) -> bool:
    return not _qc(cfg) and not hfq


def _ignored_sglang(cfg: dict, hfq: dict) -> list[str]:
    q = _qc(cfg)
    return _list(q.get("modules_to_not_convert")) + _list(q.get("ignored_layers"))


def _ignored_ct(cfg: dict, hfq: dict) -> list[str]:
    return _list(_qc(cfg).get("ignore"))


def _ignored_modelopt(cfg: dict, hfq: dict) -> list[str]:
    inner = hfq.get("quantization") if isinstance(hfq.get("quantization"), dict) else {}
    return _list(_qc(cfg).get("ignore")) + _list(inner.get("exclude_modules"))


def _none(cfg: dict, hfq: dict) -> list[str]:
    return []


FORMATS: tuple[FormatSpec, ...] = (
    FormatSpec("mxfp8_convert", "laid_out", None, "a checkpoint already laid out by mxfp8-convert",
               lambda c, h: _qc(c).get("quant_method") == LAID_OUT_QUANT_METHOD, _none),
    FormatSpec("modelopt_mxfp8", "mxfp8", "weight_scale", "NVIDIA ModelOpt MXFP8",  # ModelOpt exports
               lambda c, h: _modelopt_algo(c, h) == "MXFP8", _ignored_modelopt),
    FormatSpec("compressed_tensors_mxfp8", "mxfp8", "weight_scale", "compressed-tensors MXFP8 (group 32)",  # llm-compressor
               _is_ct_mxfp8, _ignored_ct),
    FormatSpec("sglang_mxfp8", "mxfp8", CANONICAL_SUFFIX, "SGLang / Miles MXFP8",  # sglang mxfp8 loader
               _is_sglang_mxfp8, _ignored_sglang),
    FormatSpec("block_fp8", "block_fp8", CANONICAL_SUFFIX, "DeepSeek-style 128x128 block FP8",  # DeepSeek-V3
               _is_block_fp8, _ignored_sglang),
    FormatSpec("compressed_tensors_block_fp8", "block_fp8", "weight_scale", "compressed-tensors FP8_BLOCK",
               _is_ct_block_fp8, _ignored_ct),
    FormatSpec("fp8", "fp8", "weight_scale", "per-tensor / per-channel FP8",  # vLLM fp8, ModelOpt FP8
               _is_fp8, _ignored_modelopt),
    FormatSpec("compressed_tensors_fp8", "fp8", "weight_scale", "compressed-tensors FP8 / FP8_DYNAMIC",
               _is_ct_fp8, _ignored_ct),
    FormatSpec("dense", "dense", None, "BF16 / FP16 / FP32 (no quantization_config)", _is_dense, _none),
)

FORMATS_BY_NAME: dict[str, FormatSpec] = {f.name: f for f in FORMATS}


def get_format(name: str) -> FormatSpec:
    try:
        return FORMATS_BY_NAME[name]
    except KeyError:
        raise FormatError(
            f"unknown source format {name!r}", hint=f"choose one of: {', '.join(FORMATS_BY_NAME)}"
        ) from None


def detect(config: dict | None, hf_quant_config: dict | None, tensor_names: set[str]) -> FormatSpec:
    """The source dialect, from config.json, hf_quant_config.json and then tensor names.

    Raises:
        FormatError: a quantization_config no entry of FORMATS understands.
    """
    cfg, hfq = config or {}, hf_quant_config or {}
    for spec in FORMATS:
        if spec.matches(cfg, hfq) and (spec.kind != "dense" or not _names_look_quantized(tensor_names)):
            return spec
    by_names = _detect_by_names(tensor_names)
    if by_names is not None and not _qc(cfg):
        return by_names
    q = _qc(cfg)
    what = f"quant_method {q.get('quant_method')!r}" if q else "tensor names without a quantization_config"
    raise FormatError(
        f"config.json: unsupported source format ({what})",
        hint=f"pass --source-format with one of: {', '.join(FORMATS_BY_NAME)}",
    )


def _names_look_quantized(names: set[str]) -> bool:
    return any(n.endswith((f".{CANONICAL_SUFFIX}", ".weight_scale")) for n in names)


def _detect_by_names(names: set[str]) -> FormatSpec | None:
    """No quantization_config: fall back on the scale tensors' names."""
    if any(n.endswith(f".{CANONICAL_SUFFIX}") for n in names):
        return FORMATS_BY_NAME["sglang_mxfp8"]
    if any(n.endswith(".weight_scale") for n in names):
        return FORMATS_BY_NAME["compressed_tensors_mxfp8"]
    return None
