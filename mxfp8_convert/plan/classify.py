"""Module classification: which tensors of the source are linear modules, paired with their
scales and checked, and what each becomes before and after the backend's constraints.

Decided from headers, and from the one fact about data a plan needs, which the reader computes:
whether an FP8 scale maps losslessly to UE8M0 (``read.pow2_scales``).
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass
from operator import itemgetter

from mxfp8_convert.architecture import QUANTIZED_KINDS, NameRules
from mxfp8_convert.backends import BACKENDS, BackendSpec
from mxfp8_convert.dtypes import FLOAT_DTYPES, UE8M0_DTYPES
from mxfp8_convert.errors import FormatError, LayoutError, SourceError
from mxfp8_convert.format import CANONICAL_SUFFIX, SWIZZLED_SUFFIX, Marker
from mxfp8_convert.formats import FormatSpec
from mxfp8_convert.plan.model import (
    ModulePlan,
    StackedSlice,
    Unquantized,
    dequantized,
    kept,
    module_of,
)
from mxfp8_convert.plan.moe import expert_slice, fused_moe_blocks, unfused_experts
from mxfp8_convert.read import SourceCheckpoint, TensorInfo, pow2_scales


def _matches_any(module: str, patterns: list[str]) -> bool:
    return any(_matches(module, p) for p in patterns)


def _matches(module: str, pattern: str) -> bool:
    """``--ignore`` semantics: the checkpoint's module name (tensor name less ``.weight``) equals
    the pattern, matches it as an fnmatch pattern, or ends with ``.PATTERN``."""
    return (
        module == pattern or fnmatch.fnmatchcase(module, pattern) or module.endswith("." + pattern)
    )


def module_names(ckpt: SourceCheckpoint) -> set[str]:
    """Every module name ``--ignore`` can match: tensor names less ``.weight``, stacked expert
    tensors and fused MoE blocks."""
    names = {n[: -len(".weight")] for n in ckpt.tensors if n.endswith(".weight")}
    names |= {n for n, i in ckpt.tensors.items() if len(i.shape) == 3}
    return names | set(fused_moe_blocks(ckpt))


def resolve_ignore(ckpt: SourceCheckpoint, patterns: list[str], *, strict: bool = True) -> set[str]:
    """The exact module names ``--ignore`` patterns select.

    Raises:
        FormatError: ``strict`` and a pattern matches no module of the checkpoint.
    """
    if not patterns:
        return set()
    names = module_names(ckpt)
    out: set[str] = set()
    for p in patterns:
        hits = {n for n in names if _matches(n, p)}
        if not hits and strict:
            raise FormatError(
                f"--ignore {p!r} matches no module of {ckpt.root}",
                hint="patterns match the checkpoint's own names (tensor names less "
                "'.weight'; `inspect` lists them), e.g. 'model.visual.*'",
            )
        out |= hits
    return out


def find_modules(
    ckpt: SourceCheckpoint, fmt: FormatSpec, ignore
) -> list[tuple[str, TensorInfo, TensorInfo | None]]:
    """Pair each quantized weight with its scale; for dense sources, each weight the
    architecture (or the name rules) calls a linear of the language model. ``ignore``: module
    names (or patterns) left out."""
    patterns = list(ignore)
    if fmt.kind == "dense":
        arch = dense_architecture(ckpt)
        return sorted(
            (module_of(n), i, None)
            for n, i in ckpt.tensors.items()
            if n.endswith(".weight")
            and i.dtype in FLOAT_DTYPES
            and len(i.shape) == 2
            and arch.decide(n, i.shape).quantized
            and not _matches_any(module_of(n), patterns)
        )
    pairs = _quantized_pairs(ckpt, fmt)
    if not patterns:
        return list(pairs)
    return [(m, w, s) for m, w, s in pairs if not _matches_any(m, patterns)]


def _quantized_pairs(
    ckpt: SourceCheckpoint, fmt: FormatSpec
) -> list[tuple[str, TensorInfo, TensorInfo]]:
    """``(module, weight, scale)`` of every quantized weight, by module name (``_pairs``), found
    once per checkpoint object and scale names (``ckpt.memo``: ``inspect`` lists the modules and
    plans every backend from one search). Callers do not change the list."""
    suffixes = _scale_suffixes(fmt)
    pairs = ckpt.memo.get(("pairs", suffixes))
    if pairs is None:
        pairs = ckpt.memo["pairs", suffixes] = _pairs(ckpt, suffixes)
    return pairs


def _pairs(
    ckpt: SourceCheckpoint, suffixes: tuple[str, ...]
) -> list[tuple[str, TensorInfo, TensorInfo]]:
    """Each float8 weight with the first of its scales ``suffixes`` names.

    Raises:
        SourceError: a scale without its weight, a float8 weight without a scale.
    """
    tensors = ckpt.tensors
    out = []
    dotted = tuple("." + x for x in suffixes)
    for name, info in tensors.items():
        if name.endswith(dotted):  # one test of every name against all the suffixes
            for suffix in suffixes:
                weight = name[: -len(suffix)] + "weight"
                if name.endswith("." + suffix) and weight not in tensors:
                    raise SourceError(f"{info.file}: scale {name!r} has no weight {weight!r}")
        if info.dtype != "F8_E4M3" or not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        scale = None
        for x in suffixes:
            scale = tensors.get(f"{module}.{x}")
            if scale is not None:
                break
        if scale is None:
            raise SourceError(
                f"{info.file}: weight {name!r} is float8_e4m3fn but has no scale "
                f"{module + '.' + suffixes[0]!r}"
            )
        out.append((module, info, scale))
    return sorted(out, key=itemgetter(0))


class Guess:
    """While active (``guessing()``), ``dense_architecture`` does not wait for an architecture
    that is not cached: it starts a child process making its decisions (``pending``, for the
    tensors of ``key``) and answers by the name rules; ``resolve()`` waits for them, and the
    plans made after it use them (those of the checkpoint asked about, and of one opened again
    while the guess is still in ``_GUESS``)."""

    def __init__(self) -> None:
        self.active, self.key, self.pending, self.rules = True, None, None, None
        self.memo: dict | None = None  # of the checkpoint whose architecture is pending
        self.made = None  # the decisions, once resolved

    def resolve(self) -> None:
        """Wait for the decisions; from now on ``dense_architecture`` answers with them."""
        self.active = False
        if self.pending is not None:
            self.made = self.pending.result()
            self.memo["architecture"] = self.made
            self.pending = None

    def close(self) -> None:
        """Stop the child process, if it still runs."""
        self.active = False
        if self.pending is not None:
            self.pending.close()
            self.pending = None


#: the ``Guess`` of the plan being made, if any
_GUESS: list[Guess] = []


def dense_architecture(ckpt: SourceCheckpoint):
    """``architecture.decisions(config, weights)`` for the float weights this module asks
    about, made once per checkpoint object (``ckpt.memo``; building the architecture imports
    transformers; the decisions are cached across runs). Under an active ``Guess``, the name
    rules while the architecture is built in a child process."""
    from mxfp8_convert.architecture import _expert_count, decisions, decisions_later

    made = ckpt.memo.get("architecture")
    if made is not None:
        return made
    queries = [(n, tuple(i.shape)) for n, i in sorted(ckpt.tensors.items())
               if i.dtype in FLOAT_DTYPES and (len(i.shape) == 3
                                               or (len(i.shape) == 2 and n.endswith(".weight")))]
    key = (ckpt.config_raw, tuple(queries))
    guess = _GUESS[-1] if _GUESS else None
    if guess is not None and guess.made is not None and guess.key == key:
        made = guess.made  # the checkpoint opened again once the guess was resolved
    else:
        if guess is not None and guess.active:
            if guess.key != key:
                guess.close()
                guess.active, guess.key, guess.memo = True, key, ckpt.memo
                guess.pending = decisions_later(ckpt.config, queries)
                if guess.pending is not None:
                    guess.rules = NameRules("while the architecture is built",
                                            _expert_count(ckpt.config))
            if guess.pending is not None:
                return guess.rules
        made = decisions(ckpt.config, queries)
    ckpt.memo["architecture"] = made
    return made


def _scale_suffixes(fmt: FormatSpec) -> tuple[str, ...]:
    # a laid-out checkpoint holds swizzled scales, and canonical ones for modules it kept
    return (SWIZZLED_SUFFIX, CANONICAL_SUFFIX) if fmt.kind == "laid_out" else (fmt.scale_suffix,)


def _check_mxfp8_pair(w: TensorInfo, s: TensorInfo) -> tuple[int, int]:
    shape = w.shape
    if (
        len(shape) == 2
        and not shape[1] % 32
        and s.dtype in UE8M0_DTYPES
        and s.shape == (shape[0], shape[1] // 32)
    ):
        return shape  # every check below passes
    n, k = _check_weight(w)
    if s.dtype not in UE8M0_DTYPES:
        raise LayoutError(
            f"{s.file}: scale {s.name!r} has dtype {s.dtype}; MXFP8 scales are U8 or F8_E8M0"
        )
    if tuple(s.shape) != (n, k // 32):
        raise LayoutError(
            f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; weight {w.name!r} "
            f"[{n}, {k}] needs [{n}, {k // 32}]"
        )
    return n, k


def _check_weight(w: TensorInfo) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise LayoutError(
            f"{w.file}: weight {w.name!r} has shape {list(w.shape)}; "
            "only 2-D linear weights are supported"
        )
    n, k = w.shape
    if k % 32:
        raise LayoutError(
            f"{w.file}: weight {w.name!r} has K={k}, not a multiple of 32 (MXFP8 blocks are 1x32)"
        )
    return n, k


def _check_laid_out_pair(w: TensorInfo, s: TensorInfo, src: BackendSpec) -> tuple[int, int]:
    n, k = _check_weight(w)
    if s.name.endswith("." + CANONICAL_SUFFIX):
        return _check_mxfp8_pair(w, s)
    want = tuple(src.scale_shape(n, k // 32))
    if s.dtype != "U8" or tuple(s.shape) != want:
        raise LayoutError(
            f"{s.file}: scale {s.name!r} is {s.dtype} {list(s.shape)}; a {src.name} scale of "
            f"weight {w.name!r} [{n}, {k}] is U8 {list(want)}"
        )
    return n, k


def _check_fp8_pair(fmt: FormatSpec, w: TensorInfo, s: TensorInfo) -> tuple[int, int]:
    """Shapes of a block/per-tensor FP8 pair (its scale's values: ``fp8_lossless``). K need not
    be a multiple of 32: the backend check says what becomes of such a module."""
    n, k = _check_2d(w)
    if s.dtype not in FLOAT_DTYPES:
        raise LayoutError(
            f"{s.file}: scale {s.name!r} has dtype {s.dtype}; FP8 scales are floating point"
        )
    if fmt.kind == "block_fp8":
        want = (-(-n // 128), -(-k // 128))
        if tuple(s.shape) != want:
            raise LayoutError(
                f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; weight {w.name!r} "
                f"[{n}, {k}] with 128x128 blocks needs {list(want)}"
            )
    elif math.prod(s.shape) not in (1, n) or len(s.shape) > 2:
        raise LayoutError(
            f"{s.file}: scale {s.name!r} has shape {list(s.shape)}; per-tensor or per-channel "
            f"scales of weight {w.name!r} [{n}, {k}] are [], [1], [{n}] or [{n}, 1]"
        )
    return n, k


def fp8_lossless(ckpt: SourceCheckpoint, fmt: FormatSpec) -> dict[str, bool]:
    """Scale name -> whether that FP8 pair converts losslessly (``read.pow2_scales``: every
    multiplier an exact power of two in ``[2^-127, 2^127]``); {} for other formats.

    Raises:
        LayoutError: a scale that is not a finite positive number.
    """
    if fmt.kind not in ("block_fp8", "fp8"):
        return {}
    return pow2_scales(ckpt.root, [s for _, _, s in _quantized_pairs(ckpt, fmt)])


def source_backend(ckpt: SourceCheckpoint, fmt: FormatSpec) -> BackendSpec | None:
    if fmt.kind != "laid_out":
        return None
    qc = (ckpt.config or {}).get("quantization_config")
    marker = Marker.parse(qc, f"{ckpt.root}/config.json", error=FormatError)
    return BACKENDS[marker.backend]


def _classify(fmt, src, w, s, lossless: dict[str, bool]) -> tuple[int, int, str]:
    """(N, K, action before backend constraints) of one module."""
    if fmt.kind == "dense":
        return (*_check_2d(w), "quantize")
    if fmt.kind in ("block_fp8", "fp8"):  # the pair's shapes are checked already (_candidates)
        n, k = w.shape
        return n, k, "lossless" if lossless[s.name] else "requantize"
    n, k = _check_laid_out_pair(w, s, src) if src is not None else _check_mxfp8_pair(w, s)
    return n, k, "relayout"


def _check_2d(w: TensorInfo) -> tuple[int, int]:
    """``[N, K]`` of a weight whose K need not fit MXFP8 blocks (the backend check says so)."""
    if len(w.shape) != 2:
        raise LayoutError(
            f"{w.file}: weight {w.name!r} has shape {list(w.shape)}; "
            "only 2-D linear weights are supported"
        )
    return w.shape


@dataclass(frozen=True, slots=True)
class _Found:
    """What the search of a source found: modules to plan, weights left as they are."""

    modules: list[ModulePlan]
    unquantized: list[Unquantized]


def candidates(
    ckpt,
    fmt,
    src: BackendSpec | None,
    backend: BackendSpec,
    ignored: set[str],
    towers: bool,
    lossless: dict[str, bool] | None = None,
) -> _Found:
    """Every linear module of the source, classified and planned for ``backend`` before its
    constraints are checked, and every other weight with why it is left as it is. Ignored
    modules of a quantized source are planned dequantized."""
    if fmt.kind == "dense":
        return _dense_candidates(ckpt, backend, ignored, towers)
    classified, unq = _classified(ckpt, fmt, src, lossless)
    out = []
    layout, kind = backend.weight_layout, fmt.kind
    for module, w, s, n, k, action, src_name in classified:
        m = ModulePlan(module, n, k, w, s, action, layout, None, kind, src_name)
        out.append(dequantized(m, "--ignore") if module in ignored else m)
    if src is not None:
        out += unfused_experts(ckpt, fmt, src, backend, ignored)
    return _Found(out, list(unq))


def _classified(ckpt, fmt, src: BackendSpec | None, lossless: dict[str, bool] | None):
    """The backend-independent part of ``candidates`` for a quantized source: every pair with
    its ``(module, weight, scale, N, K, action, source backend)``, and the weights left as
    they are. Kept for the next plan of the same checkpoint object (``ckpt.memo``: ``inspect``
    plans every backend), format and scale facts (compared by identity)."""
    key = ("classified", fmt.name, src.name if src is not None else None)
    known = ckpt.memo.get(key)
    if known is not None and known[0] is lossless:
        return known[1]
    given = lossless
    pairs = _quantized_pairs(ckpt, fmt)
    if fmt.kind in ("block_fp8", "fp8"):
        for _, w, s in pairs:  # shapes first: a bad pair fails before any scale is read
            _check_fp8_pair(fmt, w, s)
        if lossless is None:
            lossless = pow2_scales(ckpt.root, [s for _, _, s in pairs])
    if fmt.kind in ("block_fp8", "fp8"):  # what _classify says, without a call per pair
        out = [(module, w, s, *w.shape, "lossless" if lossless[s.name] else "requantize", None)
               for module, w, s in pairs]
    elif fmt.kind == "mxfp8" and src is None:
        out = [(module, w, s, *_check_mxfp8_pair(w, s), "relayout", None)
               for module, w, s in pairs]
    else:
        out = []
        for module, w, s in pairs:
            n, k, action = _classify(fmt, src, w, s, lossless)
            swizzled = src is not None and s.name.endswith("." + SWIZZLED_SUFFIX)
            out.append((module, w, s, n, k, action, src.name if swizzled else None))
    consumed = {t.name for _, w, s in pairs for t in (w, s)}
    if src is not None:  # the fused MoE tensors a laid-out source holds are un-fused
        consumed |= {
            t.name
            for tensors in fused_moe_blocks(ckpt).values()
            for t in tensors.values()
            if t is not None
        }
    unq = _left_as_they_are(ckpt, consumed)
    ckpt.memo[key] = (given, (out, unq))
    return out, unq


def _left_as_they_are(ckpt: SourceCheckpoint, consumed: set[str]) -> list[Unquantized]:
    """The float weights of a quantized source that no module takes, and their kinds."""
    unq = []
    rules = NameRules("not quantized in the source")
    left = sorted(
        name
        for name, info in ckpt.tensors.items()
        if name not in consumed
        and info.dtype in FLOAT_DTYPES
        and (len(info.shape) == 3 or len(info.shape) == 2 and name.endswith(".weight"))
    )
    for name in left:
        info = ckpt.tensors[name]
        d = rules.decide(module_of(name), info.shape)
        unq.append(
            Unquantized(
                module_of(name), info.shape, d.kind, "not quantized in the source", "source"
            )
        )
    return unq


def _dense_candidates(ckpt, backend: BackendSpec, ignored: set[str], towers: bool) -> _Found:
    """Float weights: the linears the architecture (or the name rules) puts in the language
    model, or outside it with ``towers``; stacked 3-D experts where their layout is known."""
    arch = dense_architecture(ckpt)
    out, unq = [], []
    for name, info in sorted(ckpt.tensors.items()):
        if info.dtype not in FLOAT_DTYPES or len(info.shape) not in (2, 3):
            continue
        if len(info.shape) == 2 and not name.endswith(".weight"):
            continue
        module = module_of(name)
        d = arch.decide(name, info.shape)
        wanted = d.kind in (*QUANTIZED_KINDS, "stacked_experts") or (towers and d.kind == "outside")
        if not wanted:
            unq.append(Unquantized(module, info.shape, d.kind, d.why, d.basis))
        elif module in ignored:
            unq.append(Unquantized(module, info.shape, "ignored", "--ignore", d.basis))
        elif d.kind == "stacked_experts":
            found = _stacked_experts(ckpt, name, info, backend, d)
            out += found.modules
            unq += found.unquantized
        elif len(info.shape) == 2:
            out.append(_quantized_dense(module, *info.shape, info, backend, d.basis))
    return _Found(out, unq)


def _quantized_dense(module: str, n: int, k: int, weight: TensorInfo, backend: BackendSpec,
                     basis: str, stacked: StackedSlice | None = None) -> ModulePlan:
    """Float weight ``weight`` (or, ``stacked``, an expert's columns of it) quantized for
    ``backend``, found by ``basis`` ("architecture" or "names")."""
    return ModulePlan(module, n, k, weight, None, "quantize", backend.weight_layout, None,
                      "dense", None, decided_by=basis, stacked=stacked)


@dataclass(frozen=True, slots=True)
class StackedLayout:
    """How a family stores its experts stacked: tensor name -> the projections it holds (and
    their columns), and whether the trtllm-gen fused MoE kernel computes that family's experts
    (a plain SiLU-gated MLP without biases)."""

    projs: dict
    fusable: bool


#: model_type -> layout of ``<block>.gate_up_proj [E, H, 2I]`` / ``<block>.down_proj [E, I, H]``
#: (K is axis 1: the modules compute ``x @ W[e]``)
STACKED_EXPERTS = {
    # Llama-4: gate_up.chunk(2, dim=-1): gate first (Llama4TextExperts)
    "llama4_text": StackedLayout(
        {"gate_up_proj": (("gate", "first"), ("up", "second")), "down_proj": (("down", "all"),)},
        fusable=True,
    ),
    # gpt-oss: gate_up[..., ::2], gate_up[..., 1::2]; clamped SwiGLU with biases (GptOssExperts)
    "gpt_oss": StackedLayout(
        {"gate_up_proj": (("gate", "even"), ("up", "odd")), "down_proj": (("down", "all"),)},
        fusable=False,
    ),
}
STACKED_EXPERTS["llama4"] = STACKED_EXPERTS["llama4_text"]
_STACKED_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _stacked_experts(ckpt, name: str, info: TensorInfo, backend: BackendSpec, d) -> _Found:
    """Per-expert modules ``<block>.<e>.{gate,up,down}_proj`` cut out of a stacked tensor whose
    layout ``STACKED_EXPERTS`` knows and whose shape fits the config; else the tensor is left
    as it is, saying why."""
    cfg = ckpt.config or {}
    text = _text_config(cfg)
    model_type = text.get("model_type", cfg.get("model_type"))
    block, _, tensor = name.rpartition(".")
    layout = STACKED_EXPERTS.get(model_type) if isinstance(model_type, str) else None
    projs = layout.projs.get(tensor) if layout is not None else None
    if projs is None:
        why = f"stacked experts of {model_type!r}: layout of {tensor!r} unknown, left as it is"
        return _Found([], [Unquantized(name, info.shape, "stacked_experts", why, d.basis)])
    e, k, cols = info.shape
    h, i = text.get("hidden_size"), text.get("intermediate_size")
    want = (h, 2 * i) if tensor == "gate_up_proj" else (i, h)
    if not isinstance(h, int) or not isinstance(i, int) or (k, cols) != want:
        why = (
            f"stacked experts [E, K, N] = {list(info.shape)} do not fit hidden_size={h}, "
            f"intermediate_size={i} of config.json; left as they are"
        )
        return _Found([], [Unquantized(name, info.shape, "stacked_experts", why, d.basis)])
    n = cols // len(projs)
    out = [
        _quantized_dense(f"{block}.{x}.{_STACKED_NAMES[proj]}", n, k, expert_slice(info, x),
                         backend, d.basis, StackedSlice(proj, x, sel, layout.fusable))
        for x in range(e)
        for proj, sel in projs
    ]
    return _Found(out, [])


#: ``violations`` already computed: (id of the backend, N, K) -> (the backend, its violations)
_VIOLATIONS: dict[tuple[int, int, int], tuple[BackendSpec, tuple[str, ...]]] = {}


def violations(backend: BackendSpec, n: int, k: int) -> tuple[str, ...]:
    """``backend.violations(n, k)``, computed once per backend and shape (a model has a few
    shapes and many modules of each; hashing the spec itself would cost more than this)."""
    hit = _VIOLATIONS.get((id(backend), n, k))
    if hit is None or hit[0] is not backend:
        hit = _VIOLATIONS[(id(backend), n, k)] = (backend, tuple(backend.violations(n, k)))
    return hit[1]


def fit(
    m: ModulePlan,
    backend: BackendSpec,
    on_ineligible: str,
    offenders: list[str],
    unquantized: list[Unquantized],
) -> ModulePlan | None:
    """``m`` if ``backend`` takes it; else (``keep``) ``m`` kept canonical, or, where K has no
    1x32 blocks, left in the source's precision (dense: as it is, quantized: dequantized);
    else None (noted in ``offenders``)."""
    if m.action == "dequantize":
        return m
    bad = violations(backend, m.n, m.k)
    if not bad:
        return m
    if on_ineligible == "error":
        offenders.append(f"{m.name}.weight [{m.n}, {m.k}]: {', '.join(bad)}")
        return None
    if m.k % 32 == 0:
        return kept(m, "; ".join(bad))
    if m.source_kind == "dense":
        unquantized.append(
            Unquantized(m.name, (m.n, m.k), "ineligible", "; ".join(bad), m.decided_by)
        )
        return None
    return dequantized(m, "; ".join(bad))


#: config.json ``torch_dtype`` / ``dtype`` -> the safetensors dtype dequantized weights take
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def model_dtype(cfg: dict | None) -> str:
    """The dtype of the model's unquantized weights (config.json), BF16 if it names none of
    ``MODEL_DTYPES``; a value that is not a dtype name at all is an error."""
    cfg = cfg or {}
    text = _text_config(cfg)
    for where, c in (("", cfg), ("text_config.", text)):
        for key in ("torch_dtype", "dtype"):
            value = c.get(key)
            if value is not None and not isinstance(value, str):
                raise FormatError(
                    f"config.json: {where}{key} is {json.dumps(value)}, not a dtype name "
                    f"such as {', '.join(map(repr, MODEL_DTYPES))}"
                )
            if value in MODEL_DTYPES:
                return MODEL_DTYPES[value]
    return "BF16"
