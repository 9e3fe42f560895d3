"""``build_plan()``: the whole plan of a conversion, from headers (and ``read.pow2_scales``).

It pairs each quantized weight with its scale (they may sit in different shards), checks
every constraint of the target backend and fails with the full list of offending tensors
before any work starts, groups MoE experts, and lays the output tensors out into shards of
bounded size (``plan.shards``).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from mxfp8_convert._gc import paused_gc
from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BackendSpec
from mxfp8_convert.dtypes import itemsize
from mxfp8_convert.errors import FormatError, IneligibleError, SourceError
from mxfp8_convert.format import (
    CANONICAL_LAYOUT,
    CANONICAL_SUFFIX,
    SWIZZLED_SUFFIX,
    MoeMarker,
    canonical_config,
    is_marker,
    make_marker,
)
from mxfp8_convert.formats import FormatSpec, kv_cache_scheme
from mxfp8_convert.layouts.moe import moe_shape_violations
from mxfp8_convert.plan.classify import (
    candidates,
    fit,
    model_dtype,
    resolve_ignore,
    source_backend,
)
from mxfp8_convert.plan.model import (
    DEQUANTIZED_LAYOUT,
    DROPPED_SUFFIXES,
    KV_SCALE_SUFFIXES,
    MOE_MODES,
    MXFP8_ACTIONS,
    NOT_IGNORED_KINDS,
    ON_INELIGIBLE,
    ConversionPlan,
    ModulePlan,
    MoELayerPlan,
    ShardPlan,
    TensorPlan,
    Unquantized,
    kept,
)
from mxfp8_convert.plan.moe import (
    MOE_BACKENDS,
    check_spelling,
    moe_layer,
    moe_tensors,
    split_experts,
)
from mxfp8_convert.plan.shards import DEFAULT_MAX_SHARD_SIZE, pack, shard_names, shard_size_bytes
from mxfp8_convert.read import SourceCheckpoint


def fingerprint(ckpt: SourceCheckpoint) -> str:
    """``headers-v1`` fingerprint of the source (docs/FORMAT.md section 5), computed once per
    checkpoint object (``ckpt.memo``: a plan records it twice, and ``inspect`` plans every
    backend)."""
    known = ckpt.memo.get("fingerprint")
    if known is not None:
        return known
    h = hashlib.sha256(ckpt.config_raw)
    for rel in sorted(ckpt.shards):
        sh = ckpt.shards[rel]
        h.update(rel.encode() + b"\0" + str(sh.size).encode() + b"\0" + sh.raw)
    known = ckpt.memo["fingerprint"] = "sha256:" + h.hexdigest()
    return known


@paused_gc()  # a module plan per linear, no cycles (``_gc``)
def plan_modules(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    fmt: FormatSpec,
    *,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
    moe: str = "fuse",
    quantize_towers: bool = False,
    strict_ignore: bool = True,
    lossless: dict[str, bool] | None = None,
) -> tuple[list[ModulePlan], list[MoELayerPlan], list[Unquantized]]:
    """What becomes of every module for ``backend``: ``build_plan`` up to, not including,
    laying out the output's tensors and shards (``inspect`` asks this of every backend).
    Arguments and errors as ``build_plan``'s.

    Returns:
        ``(modules, fused MoE layers, weights left as they are)``.
    """
    if on_ineligible not in ON_INELIGIBLE:
        raise FormatError(f"--on-ineligible must be 'error' or 'keep', got {on_ineligible!r}")
    if moe not in MOE_MODES:
        raise FormatError(f"--moe must be 'fuse' or 'keep', got {moe!r}")
    ignored = resolve_ignore(ckpt, list(ignore or []), strict=strict_ignore)
    return _module_plans(ckpt, fmt, backend, ignored, on_ineligible, moe, quantize_towers, lossless)


def _module_plans(
    ckpt,
    fmt,
    backend: BackendSpec,
    ignored: set[str],
    on_ineligible,
    moe: str,
    towers: bool,
    lossless: dict[str, bool] | None = None,
) -> tuple[list[ModulePlan], list[MoELayerPlan], list[Unquantized]]:
    src = source_backend(ckpt, fmt)
    plans, layers, unq = _plan_modules(
        ckpt, fmt, src, backend, ignored, on_ineligible, moe, towers, lossless
    )
    if src is not None and src.name == backend.name and _changes_nothing(plans, layers, backend):
        raise FormatError(
            f"{ckpt.root}: already laid out for {backend.name}",
            hint="nothing to do; use --backend canonical to get plain MXFP8 back",
        )
    return plans, layers, unq


def _changes_nothing(
    plans: list[ModulePlan], layers: list[MoELayerPlan], backend: BackendSpec
) -> bool:
    """Whether converting a checkpoint laid out for ``backend`` to ``backend`` again would
    write what it holds: no module it kept canonical (``--moe keep``, ``--on-ineligible keep``)
    is laid out now, no block is fused or un-fused."""

    def same(m: ModulePlan) -> bool:
        was = m.source_backend == backend.name
        return m.fused is None and was == (m.layout == backend.weight_layout)

    return all(same(m) for m in plans) and all(
        m.fused is not None for layer in layers for m in layer.modules
    )


def _plan_modules(
    ckpt,
    fmt,
    src: BackendSpec | None,
    backend: BackendSpec,
    ignored: set[str],
    on_ineligible,
    moe: str,
    towers: bool,
    lossless: dict[str, bool] | None,
) -> tuple[list[ModulePlan], list[MoELayerPlan], list[Unquantized]]:
    found = candidates(ckpt, fmt, src, backend, ignored, towers, lossless)
    unq = list(found.unquantized)
    dense, blocks = split_experts(found.modules)
    offenders: list[str] = []
    plans = [p for m in dense if (p := fit(m, backend, on_ineligible, offenders, unq)) is not None]
    layers = []
    for block, experts in blocks.items():
        fusable = all(m.stacked is None or m.stacked.fusable for m in experts)
        plans += [m for m in experts if m.action == "dequantize"]  # ignored: not in the block
        experts = [m for m in experts if m.action != "dequantize"]
        if not experts:
            continue
        if moe == "keep" and backend.laid_out:
            plans += [kept(m, "--moe keep") for m in experts]
        elif backend.name not in MOE_BACKENDS or moe == "keep" or not fusable:
            fits = (fit(m, backend, on_ineligible, offenders, unq) for m in experts)
            plans += [p for p in fits if p is not None]
        else:
            layer = moe_layer(block, experts)
            bad = moe_shape_violations(layer.hidden, layer.intermediate)
            if not bad:
                layers.append(layer)
            elif on_ineligible == "error":
                offenders.append(
                    f"{block} [E={layer.experts}, H={layer.hidden}, I={layer.intermediate}]: "
                    + "; ".join(bad)
                )
            else:
                plans += [kept(m, "fused MoE: " + "; ".join(bad)) for m in experts]
    if offenders:
        hint = (
            "use --on-ineligible keep to keep them (canonical MXFP8 where K is a multiple of "
            "32, else as they are), --ignore NAME to leave a module as it is, or another "
            "--backend"
        )
        what = (
            "tensor(s) or MoE block(s)"
            if any(o.startswith(tuple(b + " [E=" for b in blocks)) for o in offenders)
            else "tensor(s)"
        )
        raise IneligibleError(
            f"{len(offenders)} {what} do not fit backend {backend.name}: " + "; ".join(offenders),
            offenders=offenders,
            hint=hint + ("; --moe keep leaves the experts per-expert" if blocks else ""),
        )
    check_spelling(layers)
    return plans, sorted(layers, key=lambda layer: layer.name), unq


def _module_tensors(
    m: ModulePlan, backend: BackendSpec, model_dtype: str = "BF16"
) -> list[TensorPlan]:
    c = m.k // 32
    w = f"{m.name}.weight"
    if m.action == "dequantize":
        return [
            TensorPlan(
                w, "dequantized", model_dtype, (m.n, m.k), DEQUANTIZED_LAYOUT, m.weight.name, m.name
            )
        ]
    if m.layout == CANONICAL_LAYOUT:
        return [
            TensorPlan(
                w,
                "weight",
                "F8_E4M3",
                (m.n, m.k),
                CANONICAL_LAYOUT,
                m.weight.name,
                m.name,
                reason=m.reason,
            ),
            TensorPlan(
                f"{m.name}.{CANONICAL_SUFFIX}",
                "weight_scale",
                "U8",
                (m.n, c),
                CANONICAL_LAYOUT,
                m.scale.name if m.scale else m.weight.name,
                m.name,
                (m.n, c),
                m.reason,
            ),
        ]
    return [
        TensorPlan(
            w, "weight", "F8_E4M3", (m.n, m.k), backend.weight_layout, m.weight.name, m.name
        ),
        TensorPlan(
            f"{m.name}.{SWIZZLED_SUFFIX}",
            "weight_scale",
            "U8",
            backend.scale_shape(m.n, c),
            backend.scale_layout,
            m.scale.name if m.scale else m.weight.name,
            m.name,
            (m.n, c),
        ),
    ]


def _tensor_groups(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    modules: list[ModulePlan],
    layers: list[MoELayerPlan],
    dropped: set[str],
) -> list[tuple[TensorPlan, ...]]:
    """Every output tensor, in groups that share a shard (a module's weight and scale, a fused
    MoE projection and its scale, a copied tensor alone), in source order: by the source
    file and offset of each group's first weight."""
    dtype = model_dtype(ckpt.config)
    rank = {rel: i for i, rel in enumerate(sorted(ckpt.shards))}
    keyed: list[tuple[tuple[int, int, str], tuple[TensorPlan, ...]]] = []

    def at(info) -> tuple[int, int, str]:
        return rank[info.file], info.begin, info.name

    for m in modules:
        keyed.append((at(m.weight), tuple(_module_tensors(m, backend, dtype))))
    for layer in layers:
        fc1, fc2 = {}, {}
        for t in moe_tensors(layer):
            (fc1 if t.role.startswith("moe_fc1") else fc2)[t.role] = t
        keyed.append((at(layer.gate[0].weight), tuple(fc1.values())))
        keyed.append((at(layer.down[0].weight), tuple(fc2.values())))
    consumed = {
        t.name
        for m in (*modules, *(m for layer in layers for m in layer.modules))
        for t in (m.weight, m.scale)
        if t is not None
    }
    for name, info in ckpt.tensors.items():
        if name not in consumed and name not in dropped:
            keyed.append(
                (at(info), (TensorPlan(name, "passthrough", info.dtype, info.shape, "copy", name),))
            )
    keyed.sort(key=lambda g: g[0])
    return [g for _, g in keyed]


def _shards(
    ckpt: SourceCheckpoint, groups: list[tuple[TensorPlan, ...]], max_bytes: int
) -> tuple[ShardPlan, ...]:
    """The groups packed into named shards (``shards``); each keeps the ``__metadata__`` of the
    source shards it draws on (the first file's value where two differ). No tensors at all:
    one ``model.safetensors`` holding none, so that the output is still a checkpoint."""
    packed = pack(groups, max_bytes) or [[]]
    out = []
    for name, tensors in zip(shard_names(len(packed)), packed, strict=True):
        files = sorted({ckpt.tensors[t.source].file for t in tensors if t.source in ckpt.tensors})
        meta: dict[str, str] = {}
        for rel in files or sorted(ckpt.shards)[:1]:
            for k, v in ckpt.shards[rel].metadata.items():
                meta.setdefault(k, v)
        out.append(ShardPlan(name, tuple(sorted(tensors, key=_sort_key)), tuple(meta.items())))
    return tuple(out)


def _layer_shards(layers: list[MoELayerPlan], shards: tuple[ShardPlan, ...]) -> list[MoELayerPlan]:
    """Each fused MoE layer with the output shard of its fused FC1 weight."""
    where = {t.name: s.name for s in shards for t in s.tensors if t.role == "moe_fc1_weight"}
    return [replace(layer, shard=where[layer.tensor_name("moe_fc1_weight")]) for layer in layers]


def _sort_key(t: TensorPlan) -> tuple[int, str]:
    # widest dtype first, as safetensors' own writer does, so every tensor stays aligned
    return (-itemsize(t.dtype), t.name)


def _check_unique_names(shards: tuple[ShardPlan, ...], ckpt: SourceCheckpoint) -> None:
    """A source tensor named like one the conversion writes (``P.weight_scale_swizzled`` beside
    a converted ``P``) would be written twice, and a loader could read the wrong bytes."""
    seen: set[str] = set()
    for shard in shards:
        for t in shard.tensors:
            if t.name in seen:
                where = ckpt.tensors[t.name].file if t.name in ckpt.tensors else shard.name
                raise SourceError(
                    f"{where}: tensor {t.name!r} has the name of a tensor the conversion writes"
                )
            seen.add(t.name)


@paused_gc()
def build_plan(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    fmt: FormatSpec,
    *,
    on_ineligible: str = "error",
    ignore: list[str] | None = None,
    moe: str = "fuse",
    quantize_towers: bool = False,
    allow_no_quantized: bool = False,
    strict_ignore: bool = True,
    lossless: dict[str, bool] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> ConversionPlan:
    """Decide every output tensor from the source's headers.

    Args:
        ckpt: the opened source (headers only).
        backend: target backend from ``BACKENDS``.
        fmt: source format from ``formats.detect`` or ``--source-format``.
        on_ineligible: ``"error"`` (fail listing every offender) or ``"keep"`` (leave them in
            canonical MXFP8, or where K has no 1x32 blocks in the source's precision, and
            record why).
        ignore: module-name patterns (``_matches``) to leave unquantized; a quantized source's
            ignored modules are written dequantized to the model's dtype.
        moe: ``"fuse"``: per-expert MoE weights become the fused MoE kernel's tensors where the
            backend has that layout (trtllm), else they are linears like any other; ``"keep"``:
            they stay per-expert canonical MXFP8.
        quantize_towers: dense sources: also quantize the linears outside the language model
            (vision/audio towers, projectors, task heads).
        allow_no_quantized: plan a plain copy when no module would be converted.
        strict_ignore: a pattern of ``ignore`` that matches no module is an error.
        lossless: FP8 sources: ``fp8_lossless(ckpt, fmt)``, when already computed (it reads
            every scale; ``inspect`` plans three backends from one reading).
        max_shard_size: bound of an output shard, in bytes or as a size like ``"5GB"``
            (``shards.shard_size_bytes``); a group of tensors larger than that (a module's
            weight and scale) gets a shard of its own.

    Returns:
        The frozen plan.

    Raises:
        IneligibleError: tensors (or MoE blocks) fail the backend's constraints and
            ``on_ineligible="error"``.
        LayoutError / SourceError / FormatError: malformed pairs, missing partners or experts,
            unsupported format, an ``ignore`` pattern matching nothing, nothing to convert.
    """
    modules, layers, unquantized = plan_modules(
        ckpt,
        backend,
        fmt,
        on_ineligible=on_ineligible,
        ignore=ignore,
        moe=moe,
        quantize_towers=quantize_towers,
        strict_ignore=strict_ignore,
        lossless=lossless,
    )
    converts = bool(layers) or any(m.action in MXFP8_ACTIONS for m in modules)
    if not allow_no_quantized and not converts:
        raise FormatError(
            f"{ckpt.root}: no module would be converted to MXFP8 ({fmt.name} source, "
            f"{len(unquantized)} weights left as they are)",
            hint="pass --allow-no-quantized to write a plain copy anyway",
        )
    quantized = fmt.kind != "dense"
    named = [n for n in ckpt.tensors if n.endswith((*DROPPED_SUFFIXES, *KV_SCALE_SUFFIXES))]
    dropped = tuple(sorted(n for n in named if quantized and n.endswith(DROPPED_SUFFIXES)))
    kv = tuple(sorted(n for n in named if quantized and n.endswith(KV_SCALE_SUFFIXES)))
    groups = _tensor_groups(ckpt, backend, modules, layers, set(dropped))
    shards = _shards(ckpt, groups, shard_size_bytes(max_shard_size))
    layers = _layer_shards(layers, shards)
    _check_unique_names(shards, ckpt)
    left = sorted(
        {u.name for u in unquantized if u.kind not in NOT_IGNORED_KINDS}
        | {m.name for m in modules if m.action == "dequantize"}
    )
    mxfp8 = [m for m in modules if m.action in MXFP8_ACTIONS]
    tp = marker_tp_compat(ckpt, mxfp8, backend, layers) if backend.laid_out else None
    marker = quantization_config(ckpt, backend, fmt, left, layers, tp, kv)
    return ConversionPlan(
        source=str(ckpt.root),
        backend=backend.name,
        format=fmt.name,
        shards=shards,
        modules=tuple(modules),
        copied_files=ckpt.other_files,
        marker=marker,
        indexed=ckpt.indexed,
        fingerprint=fingerprint(ckpt),
        kept=tuple(m.name for m in modules if m.layout == CANONICAL_LAYOUT and backend.laid_out),
        moe=tuple(layers),
        moe_mode=moe,
        unquantized=tuple(unquantized),
        dropped=dropped,
        kv_scales=kv,
        quantize_towers=quantize_towers,
    )


def marker_tp_compat(ckpt: SourceCheckpoint, modules, backend: BackendSpec,
                     layers=()) -> list[int]:
    """The marker's ``tp_compat`` (docs/FORMAT.md section 2a): tensor-parallel sizes at which
    every quantized linear module and every fused MoE block (``layers``) slices on tile
    boundaries."""
    from mxfp8_convert.engines.common import (
        CANONICAL,
        FusedBlock,
        Module,
        config_kv_heads,
        tp_compat,
    )

    mods = [
        Module(m.name, m.n, m.k, CANONICAL if m.layout == "canonical" else backend.name)
        for m in modules
    ]
    blocks = [FusedBlock(b.name, b.experts, b.hidden, b.intermediate, {}) for b in layers]
    return tp_compat(mods, config_kv_heads(ckpt.config or {}), backend.name, blocks)


def _original_config(ckpt: SourceCheckpoint) -> dict | None:
    """The source's own quantization_config; for one of our outputs, the one it came from."""
    q = (ckpt.config or {}).get("quantization_config")
    if is_marker(q):
        q = q.get("original_quantization_config")
    return q if isinstance(q, dict) else None


def moe_marker(layers: list[MoELayerPlan] | tuple[MoELayerPlan, ...]) -> MoeMarker | None:
    """The marker's ``moe`` entry (docs/FORMAT.md section 2): None without fused MoE tensors."""
    if not layers:
        return None
    return MoeMarker(
        experts_suffixes=layers[0].suffixes, layers=tuple(layer.name for layer in layers)
    )


def quantization_config(
    ckpt: SourceCheckpoint,
    backend: BackendSpec,
    fmt: FormatSpec,
    ignored: list[str],
    moe_layers: list[MoELayerPlan] | tuple[MoELayerPlan, ...] = (),
    tp_compat: list[int] | None = None,
    kv_scales: tuple[str, ...] = (),
) -> dict:
    """The ``quantization_config`` of the output: the marker (docs/FORMAT.md section 2), or plain
    MXFP8's for the canonical backend. ``ignored``: exact names of the linear modules left
    unquantized; ``kv_scales``: the KV-cache scales kept (their scheme goes with them)."""
    original = _original_config(ckpt)
    kv = None
    if kv_scales:
        kv = kv_cache_scheme(ckpt.config or {}, ckpt.hf_quant_config or {})
    if not backend.laid_out:
        return canonical_config(original, ignored, kv)
    return make_marker(
        backend.name,
        dialect=fmt.name,
        fingerprint=fingerprint(ckpt),
        tool_version=__version__,
        ignored_layers=ignored,
        moe=moe_marker(moe_layers),
        original=original,
        tp_compat=tp_compat,
        kv_cache_scheme=kv,
    ).to_dict()
