"""Table of source checkpoint formats: how each is recognised and how its tensors pair up.

``FORMATS`` is ordered most specific first; ``detect()`` returns the first whose ``matches``
accepts the config. Sources: docs/LAYOUTS.md section 4 (config keys and tensor names of each
dialect).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mxfp8_convert.dtypes import FLOAT_DTYPES, UE8M0_DTYPES
from mxfp8_convert.errors import FormatError
from mxfp8_convert.format import CANONICAL_QUANT_METHOD, CANONICAL_SUFFIX
from mxfp8_convert.format import QUANT_METHOD as LAID_OUT_QUANT_METHOD  # docs/FORMAT.md
from mxfp8_convert.read import QUANT_FILES


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
    method = q.get("quant_method")
    return method == CANONICAL_QUANT_METHOD or (method == "fp8" and _block_size(q) == [1, 32])


def _ct_groups(cfg: dict) -> list[dict]:
    q = _qc(cfg)
    if q.get("quant_method") != "compressed-tensors":
        return []
    groups = q.get("config_groups")
    if not isinstance(groups, dict):
        return []
    return [g["weights"] for g in groups.values()
            if isinstance(g, dict) and isinstance(g.get("weights"), dict)]


def _is_ct_mxfp8(cfg: dict, hfq: dict) -> bool:
    return any(
        w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "group"
        and w.get("group_size") == 32
        for w in _ct_groups(cfg)
    )


def _is_ct_fp8(cfg: dict, hfq: dict) -> bool:
    return any(
        w.get("num_bits") == 8 and w.get("type") == "float"
        and w.get("strategy") in ("tensor", "channel")
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
    # ModelOpt FP8 says so in config.json, or only in hf_quant_config.json
    per_tensor = q.get("quant_method") == "fp8" and not _block_size(q)
    return per_tensor or _modelopt_algo(cfg, hfq) == "FP8"


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
    FormatSpec("modelopt_mxfp8", "mxfp8", "weight_scale", "NVIDIA ModelOpt MXFP8",
               lambda c, h: _modelopt_algo(c, h) == "MXFP8", _ignored_modelopt),  # ModelOpt exports
    FormatSpec("compressed_tensors_mxfp8", "mxfp8", "weight_scale",
               "compressed-tensors MXFP8 (group 32)",
               _is_ct_mxfp8, _ignored_ct),  # llm-compressor
    FormatSpec("sglang_mxfp8", "mxfp8", CANONICAL_SUFFIX, "SGLang / Miles MXFP8",
               _is_sglang_mxfp8, _ignored_sglang),  # sglang mxfp8 loader
    FormatSpec("block_fp8", "block_fp8", CANONICAL_SUFFIX, "DeepSeek-style 128x128 block FP8",
               _is_block_fp8, _ignored_sglang),  # DeepSeek-V3
    FormatSpec("compressed_tensors_block_fp8", "block_fp8", "weight_scale",
               "compressed-tensors FP8_BLOCK",
               _is_ct_block_fp8, _ignored_ct),
    FormatSpec("fp8", "fp8", "weight_scale", "per-tensor / per-channel FP8",
               _is_fp8, _ignored_modelopt),  # vLLM fp8, ModelOpt FP8
    FormatSpec("compressed_tensors_fp8", "fp8", "weight_scale",
               "compressed-tensors FP8 / FP8_DYNAMIC",
               _is_ct_fp8, _ignored_ct),
    FormatSpec("dense", "dense", None, "BF16 / FP16 / FP32 (no quantization_config)",
               _is_dense, _none),
)

FORMATS_BY_NAME: dict[str, FormatSpec] = {f.name: f for f in FORMATS}


def get_format(name: str) -> FormatSpec:
    try:
        return FORMATS_BY_NAME[name]
    except KeyError:
        raise FormatError(
            f"unknown source format {name!r}", hint=f"choose one of: {', '.join(FORMATS_BY_NAME)}"
        ) from None


def detect(config: dict | None, hf_quant_config: dict | None, tensors) -> FormatSpec:
    """The source dialect, from config.json, hf_quant_config.json and the tensors.

    ``tensors`` maps names to ``read.TensorInfo`` (dtypes and shapes are evidence too); a set of
    names is accepted, and then only names count. See ``detect_source`` for the rules.

    Raises:
        FormatError: a declared scheme this tool does not read (named), or no format that the
            config and the tensors agree on.
    """
    files = {"hf_quant_config.json": hf_quant_config} if hf_quant_config else {}
    return detect_source(config, files, tensors)


def detect_source(config: dict | None, quant_files: dict[str, object], tensors,
                  source_format: str | None = None) -> FormatSpec:
    """The source's format, on positive evidence only.

    1. Every file that declares a quantization (config.json ``quantization_config`` and
       ``QUANT_FILES``) must declare a scheme of ``FORMATS``: any other (NVFP4, MXFP4, AWQ,
       GPTQ, int8, bitsandbytes, ...) is refused by name, whatever ``source_format`` says.
    2. So are tensors only such schemes write (``UNSUPPORTED_TENSORS``).
    3. The format is ``source_format``, else the first of ``FORMATS`` the declarations match,
       else (nothing declared) the one the tensors show: float8 weights with UE8M0 or float
       scales, or none (dense).
    4. The tensors must agree with it (``evidence_problem``).
    """
    cfg = config or {}
    hfq = quant_files.get("hf_quant_config.json")
    hfq = hfq if isinstance(hfq, dict) else {}
    for file, q in _declarations(cfg, quant_files):
        what = _unsupported_scheme(file, q)
        if what is not None:
            raise FormatError(f"{file}: {what} is not supported; mxfp8-convert reads MXFP8, FP8 "
                              "and BF16/FP16/FP32 checkpoints", hint=REFUSED_HINT)
    infos = tensors if isinstance(tensors, dict) else {n: None for n in tensors}
    refused = tuple(suffix for suffix, _ in UNSUPPORTED_TENSORS)
    for name in infos:
        if not name.endswith(refused):  # one test of every name against all the suffixes
            continue
        for suffix, what in UNSUPPORTED_TENSORS:
            if name.endswith(suffix):
                raise FormatError(f"tensor {name!r}: {what} is not supported; mxfp8-convert reads "
                                  "MXFP8, FP8 and BF16/FP16/FP32 checkpoints", hint=REFUSED_HINT)
    if source_format is not None:
        spec = get_format(source_format)
    else:
        spec = next((f for f in FORMATS if f.kind != "dense" and f.matches(cfg, hfq)), None)
        if spec is None:
            spec = _detect_by_tensors(infos)
    problem = evidence_problem(spec, infos)
    if problem is not None:
        raise FormatError(problem,
                          hint="the config and the tensors disagree; nothing was converted")
    return spec


#: what a refusal suggests instead
REFUSED_HINT = "convert the BF16/FP16 original, or an MXFP8 or FP8 export of it"
#: ModelOpt ``quant_algo`` values whose tensors are one of FORMATS (the rest are refused)
MODELOPT_ALGOS = ("FP8", "MXFP8")
#: tensor-name suffixes only schemes this tool does not read produce -> the scheme
UNSUPPORTED_TENSORS = (
    (".qweight", "AWQ/GPTQ packed int4 (qweight)"),  # AutoAWQ, AutoGPTQ
    (".qzeros", "AWQ/GPTQ packed int4 (qzeros)"),
    ("_proj_blocks", "MXFP4 (*_blocks with *_scales)"),  # gpt-oss
    (".weight_scale_2", "NVFP4 (weight_scale_2)"),  # ModelOpt NVFP4
    (".weight_packed", "compressed-tensors packed int4/FP4 (weight_packed)"),  # llm-compressor
    (".weight_global_scale", "NVFP4 (weight_global_scale)"),  # llm-compressor NVFP4
    (".SCB", "bitsandbytes int8 (SCB)"),  # bitsandbytes LLM.int8
    (".absmax", "bitsandbytes 4-bit (absmax)"),  # bitsandbytes nf4/fp4
)


def _declarations(cfg: dict, quant_files: dict[str, object]) -> list[tuple[str, dict]]:
    declared = cfg.get("quantization_config") is not None
    out = [("config.json", cfg["quantization_config"])] if declared else []
    return out + [(f, quant_files[f]) for f in QUANT_FILES if f in quant_files]


def _unsupported_scheme(file: str, q) -> str | None:
    """The name of the scheme ``file`` declares if this tool cannot read it, else None."""
    if not isinstance(q, dict):
        return f"a quantization declaration that is not a JSON object ({type(q).__name__})"
    if file == "hf_quant_config.json":
        inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else q
        return _modelopt_problem(inner.get("quant_algo"), inner.get("kv_cache_quant_algo"))
    if file != "config.json":  # AutoAWQ / AutoGPTQ side files
        awq = "w_bit" in q or "zero_point" in q
        method = str(q.get("quant_method") or ("awq" if awq else "gptq"))
        bits = q.get("w_bit", q.get("bits"))
        return f"{method.upper()}" + (f" {bits}-bit" if bits is not None else "")
    method = q.get("quant_method")
    if method in (LAID_OUT_QUANT_METHOD, CANONICAL_QUANT_METHOD):
        return None
    if method == "modelopt":
        return _modelopt_problem(q.get("quant_algo"), q.get("kv_cache_quant_algo"))
    if method == "fp8":
        size = _block_size(q)
        return None if size in ([], [128, 128], [1, 32]) else f"fp8 with weight_block_size {size}"
    if method == "compressed-tensors":
        return _ct_problem(q)
    if method is None:
        return "a quantization_config without quant_method"
    return f"quant_method {method!r}"


def _modelopt_problem(algo, kv_algo) -> str | None:
    if algo is not None and str(algo).upper() not in MODELOPT_ALGOS:
        return f"ModelOpt {algo}"
    if kv_algo is not None and str(kv_algo).upper() != "FP8":
        return f"ModelOpt KV cache {kv_algo}"
    return None


def _ct_problem(q: dict) -> str | None:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return "compressed-tensors without config_groups"
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            return f"compressed-tensors group {name!r} without weights"
        ok = w.get("num_bits") == 8 and w.get("type") == "float" and (
            w.get("strategy") in ("tensor", "channel", "block")
            or (w.get("strategy") == "group" and w.get("group_size") == 32))
        if not ok:
            size = f" group {w.get('group_size')}" if w.get("group_size") else ""
            kind = f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')}{size}"
            return (f"compressed-tensors {kind} "
                    f"(format {q.get('format')!r}, group {name!r})")
    kv = q.get("kv_cache_scheme")
    if isinstance(kv, dict) and not (kv.get("num_bits") == 8 and kv.get("type") == "float"):
        return f"compressed-tensors KV cache {kv.get('type')}{kv.get('num_bits')}"
    return None


def _scale_of(infos: dict, weight: str, suffix: str):
    return infos.get(weight[: -len("weight")] + suffix)


def _detect_by_tensors(infos: dict) -> FormatSpec:
    """Nothing declared: float8 weights and their scales say what the checkpoint is."""
    for name, info in sorted(infos.items()):
        if not name.endswith(".weight") or (info is not None and info.dtype != "F8_E4M3"):
            continue
        for suffix, mx, fp in ((CANONICAL_SUFFIX, "sglang_mxfp8", "block_fp8"),
                               ("weight_scale", "compressed_tensors_mxfp8", "fp8")):
            s = _scale_of(infos, name, suffix)
            if s is not None or (info is None and name[: -len("weight")] + suffix in infos):
                if s is None or s.dtype in UE8M0_DTYPES:
                    return FORMATS_BY_NAME[mx]
                blocks = suffix == "weight_scale" or len(s.shape) == 2
                return FORMATS_BY_NAME[fp if blocks else "fp8"]
        if info is not None:
            raise FormatError(f"tensor {name!r} is float8_e4m3fn but has no weight_scale or "
                              f"{CANONICAL_SUFFIX}, and no config declares a quantization")
    return FORMATS_BY_NAME["dense"]


def evidence_problem(spec: FormatSpec, infos: dict) -> str | None:
    """Why the tensors do not show format ``spec`` (None if they do, or only names are known).

    Quantized formats need at least one float8_e4m3fn ``.weight`` with its scale, of the scale
    dtype the format stores (UE8M0 for MXFP8, floating point for FP8), and no float8 weight
    whose scale says otherwise; dense sources hold no float8 weight.
    """
    if spec.kind == "laid_out" or any(v is None for v in infos.values()):
        return None
    f8 = {n: i for n, i in infos.items()
          if n.endswith(".weight") and i.dtype in ("F8_E4M3", "F8_E5M2")}
    if spec.kind == "dense":
        if f8:
            name = min(f8)
            return (f"{f8[name].file}: tensor {name!r} is {f8[name].dtype}; a dense checkpoint "
                    "holds no float8 weight")
        return None
    want = UE8M0_DTYPES if spec.kind == "mxfp8" else FLOAT_DTYPES
    wanted = "U8 or F8_E8M0" if spec.kind == "mxfp8" else "floating point"
    kind = "MXFP8" if spec.kind == "mxfp8" else "FP8"
    found, wrong = 0, False
    for name, info in f8.items():
        s = _scale_of(infos, name, spec.scale_suffix)
        if s is None:
            continue
        if s.dtype not in want or info.dtype != "F8_E4M3":
            wrong = True
            break
        found += 1
    for name, info in sorted(f8.items()) if wrong else ():  # the first wrong pair by name
        s = _scale_of(infos, name, spec.scale_suffix)
        if s is not None and (s.dtype not in want or info.dtype != "F8_E4M3"):
            return (f"{s.file}: scale {s.name!r} has dtype {s.dtype}; {kind} scales are {wanted} "
                    f"(weight {name!r} is {info.dtype}; the source declares {spec.description})")
    if not found:
        dtypes = sorted({i.dtype for n, i in infos.items() if n.endswith(".weight")})
        return (f"{spec.name}: no float8_e4m3fn weight with a {spec.scale_suffix} scale "
                f"(weights are {', '.join(dtypes) or 'absent'}); "
                f"the checkpoint is not {spec.description}")
    return None


def kv_cache_scheme(cfg: dict, hfq: dict) -> dict | None:
    """The FP8 KV-cache scheme a source declares, in compressed-tensors' ``kv_cache_scheme``
    form (how vLLM and SGLang read it), or None: ModelOpt's ``kv_cache_quant_algo: FP8``
    (hf_quant_config.json or config.json) or a compressed-tensors ``kv_cache_scheme``."""
    q = _qc(cfg)
    if isinstance(q.get("kv_cache_scheme"), dict):
        return dict(q["kv_cache_scheme"])
    inner = hfq.get("quantization") if isinstance(hfq.get("quantization"), dict) else {}
    algo = q.get("kv_cache_quant_algo") or inner.get("kv_cache_quant_algo")
    if algo is not None and str(algo).upper() == "FP8":
        return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                "symmetric": True}
    return None
