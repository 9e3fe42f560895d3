"""MoE: per-expert modules grouped into the trtllm-gen fused MoE kernel's four tensors, and the
fused tensors of a laid-out source cut back into per-expert modules (docs/LAYOUTS.md section 6).
Headers only."""

from __future__ import annotations

import functools
import re

from mxfp8_convert.backends import BackendSpec
from mxfp8_convert.errors import FormatError, LayoutError
from mxfp8_convert.format import EXPERT_ROLES, MOE_LAYOUT
from mxfp8_convert.plan.model import (
    MOE_TENSORS,
    ExpertSlice,
    ModulePlan,
    MoELayerPlan,
    TensorPlan,
    dequantized,
    revised,
)
from mxfp8_convert.read import SourceCheckpoint, TensorInfo

#: per-expert linear modules of a MoE block under the usual Hub names (docs/LAYOUTS.md section 6):
#: ``<block>.experts.<e>.<proj>``. The ``.experts.`` must follow a dot, so shared experts
#: (``mlp.shared_experts.*``, ``mlp.shared_expert.*``) and routers (``mlp.gate``) stay dense.
EXPERT_RE = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
#: projection name -> role; "gate" is the activated half (w1), "up" the linear half (w3)
EXPERT_PROJS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",  # Qwen2/3-MoE, DeepSeek-V2/V3
    "w1": "gate",
    "w3": "up",
    "w2": "down",  # Mixtral
}
#: backends with a fused-MoE layout (layouts/moe.py); others take experts as dense linears
MOE_BACKENDS = ("trtllm",)


@functools.lru_cache(maxsize=1 << 18)  # asked twice per module, and again per plan by inspect
def expert_key(module: str) -> tuple[str, int, str] | None:
    """``(block, expert, role)`` of a per-expert projection, e.g.
    ``("model.layers.3.mlp.experts", 7, "up")`` for ``model.layers.3.mlp.experts.7.up_proj``;
    None for any other module."""
    block, _, rest = module.rpartition(".experts.")
    expert, dot, proj = rest.partition(".")
    if block and dot and proj in EXPERT_PROJS and expert.isdecimal() and "\n" not in module:
        return f"{block}.experts", int(expert), EXPERT_PROJS[proj]  # what EXPERT_RE finds
    m = EXPERT_RE.match(module)
    if m is None or m["proj"] not in EXPERT_PROJS:
        return None
    return m["block"], int(m["expert"]), EXPERT_PROJS[m["proj"]]


def split_experts(
    modules: list[ModulePlan],
) -> tuple[list[ModulePlan], dict[str, list[ModulePlan]]]:
    dense: list[ModulePlan] = []
    blocks: dict[str, list[ModulePlan]] = {}
    for m in modules:
        key = expert_key(m.name)
        if key is None:
            dense.append(m)
        else:
            blocks.setdefault(key[0], []).append(m)
    return dense, blocks


def moe_layer(block: str, experts: list[ModulePlan]) -> MoELayerPlan:
    """The experts of ``block`` as one fused layer; every expert 0..E-1 needs gate, up and down,
    gate and up ``[I, H]``, down ``[H, I]``."""
    by: dict[tuple[int, str], ModulePlan] = {}
    for m in experts:
        _, e, role = expert_key(m.name)
        if (e, role) in by:
            raise LayoutError(
                f"{block}: expert {e} has two {role} projections ({by[(e, role)].name}, {m.name})"
            )
        by[(e, role)] = revised(m, action=m.action, layout=MOE_LAYOUT, reason=m.reason)
    count = 1 + max(e for e, _ in by)
    missing = next(((e, r) for e in range(count) for r in EXPERT_ROLES if (e, r) not in by), None)
    if missing is not None:
        raise LayoutError(
            f"{block}: expert {missing[0]} has no {missing[1]} projection; the fused MoE "
            f"needs gate, up and down of experts 0..{count - 1}",
            hint="use --moe keep to leave the experts per-expert",
        )
    gate0 = by[(0, "gate")]
    i, h = gate0.n, gate0.k
    for (_, role), m in sorted(by.items()):
        want = (h, i) if role == "down" else (i, h)
        if (m.n, m.k) != want:
            raise LayoutError(
                f"{m.weight.file}: expert weight {m.name + '.weight'!r} is [{m.n}, {m.k}]; with "
                f"H={h}, I={i} (from expert 0's {gate0.name.rsplit('.', 1)[1]}) it must be "
                f"[{want[0]}, {want[1]}]",
                hint="use --moe keep to leave the experts per-expert",
            )
    per = {r: tuple(by[(e, r)] for e in range(count)) for r in EXPERT_ROLES}
    return MoELayerPlan(block, count, h, i, per["gate"], per["up"], per["down"])


def check_spelling(layers: list[MoELayerPlan]) -> None:
    spellings = {tuple(sorted(layer.suffixes.items())): layer.name for layer in layers}
    if len(spellings) > 1:
        (a, la), (b, lb) = list(spellings.items())[:2]
        raise LayoutError(
            f"MoE blocks name their experts differently ({la}: {dict(a)}; {lb}: {dict(b)}); "
            "the marker records one spelling",
            hint="use --moe keep to leave the experts per-expert",
        )


def expert_slice(info: TensorInfo, expert: int) -> TensorInfo:
    """Expert ``expert``'s bytes of a stacked ``[E, ...]`` tensor, as a tensor of its own
    (same name and file, shape ``[...]``): the fused tensors are contiguous per expert."""
    per = info.nbytes // info.shape[0]
    return TensorInfo(
        info.name, info.dtype, tuple(info.shape[1:]), info.file, info.begin + expert * per, per
    )


def fused_moe_blocks(ckpt: SourceCheckpoint) -> dict[str, dict[str, TensorInfo | None]]:
    """The fused MoE tensors of a laid-out checkpoint: block -> role -> tensor (None if missing)."""
    blocks = set()
    suffixes = tuple("." + suffix for suffix, _, _ in MOE_TENSORS.values())
    for name in ckpt.tensors:
        if name.endswith(suffixes):  # one test of every name against all four
            blocks.update(name[: -len(s)] for s in suffixes if name.endswith(s))
    return {
        b: {role: ckpt.tensors.get(f"{b}.{suffix}") for role, (suffix, _, _) in MOE_TENSORS.items()}
        for b in sorted(blocks)
    }


def fused_moe_shape(block: str, tensors: dict[str, TensorInfo | None]) -> tuple[int, int, int]:
    """``(E, H, I)`` of a fused MoE block, checking each of its four tensors' dtype and shape.

    Raises:
        LayoutError: a tensor missing, or a dtype or shape that does not fit the others.
    """
    for role, t in tensors.items():
        if t is None:
            raise LayoutError(
                f"{block}: fused MoE tensor {block}.{MOE_TENSORS[role][0]!r} is missing"
            )
    w13 = tensors["moe_fc1_weight"]
    if len(w13.shape) != 3 or w13.shape[1] % 2:
        raise LayoutError(
            f"{w13.file}: {w13.name!r} has shape {list(w13.shape)}; "
            "a fused FC1 weight is [E, 2I, H]"
        )
    e, two_i, h = w13.shape
    for role, t in tensors.items():
        _, dtype, shape_of = MOE_TENSORS[role]
        want = shape_of(h, two_i // 2, e)
        if t.dtype != dtype or tuple(t.shape) != want:
            raise LayoutError(
                f"{t.file}: {t.name!r} is {t.dtype} {list(t.shape)}; in a fused MoE block of "
                f"E={e}, H={h}, I={two_i // 2} it is {dtype} {list(want)}"
            )
    return e, h, two_i // 2


def _experts_suffixes(ckpt: SourceCheckpoint, block: str) -> dict[str, str]:
    moe = ((ckpt.config or {}).get("quantization_config") or {}).get("moe")
    names = moe.get("experts_suffixes") if isinstance(moe, dict) else None
    if not isinstance(names, dict) or not all(isinstance(names.get(r), str) for r in EXPERT_ROLES):
        raise FormatError(
            f"config.json: the checkpoint holds fused MoE tensors ({block}) but its marker has "
            "no moe.experts_suffixes {gate, up, down}"
        )
    return names


def unfused_experts(
    ckpt, fmt, src: BackendSpec, backend: BackendSpec, ignored: set[str]
) -> list[ModulePlan]:
    """Each expert projection of each fused MoE block of a laid-out source, as a module (an
    ignored block's experts dequantized)."""
    out = []
    for block, tensors in fused_moe_blocks(ckpt).items():
        e_count, h, i = fused_moe_shape(block, tensors)
        names = _experts_suffixes(ckpt, block)
        for e in range(e_count):
            for role in EXPERT_ROLES:
                fc = "moe_fc2" if role == "down" else "moe_fc1"
                w, s = (expert_slice(tensors[f"{fc}_{part}"], e) for part in ("weight", "scale"))
                n, k = (h, i) if role == "down" else (i, h)
                m = ModulePlan(
                    f"{block}.{e}.{names[role]}",
                    n,
                    k,
                    w,
                    s,
                    "relayout",
                    backend.weight_layout,
                    None,
                    fmt.kind,
                    src.name,
                    ExpertSlice(role, e, h, i),
                )
                skip = block in ignored or m.name in ignored
                out.append(dequantized(m, "--ignore") if skip else m)
    return out


def moe_tensors(layer: MoELayerPlan) -> list[TensorPlan]:
    e, h, i = layer.experts, layer.hidden, layer.intermediate
    logical = {"moe_fc1_scale": (e, 2 * i, h // 32), "moe_fc2_scale": (e, h, i // 32)}
    return [
        TensorPlan(
            layer.tensor_name(role),
            role,
            dtype,
            shape_of(h, i, e),
            MOE_LAYOUT,
            layer.gate[0].weight.name,
            layer.name,
            logical.get(role),
        )
        for role, (_, dtype, shape_of) in MOE_TENSORS.items()
    ]
