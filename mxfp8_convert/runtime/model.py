"""Put a loaded checkpoint into an existing ``torch.nn.Module`` (a model built from its config).

Every ``nn.Linear`` whose qualified name has an MXFP8 weight in the checkpoint is replaced by an
:class:`MXFP8Linear` holding the checkpoint's bytes (and its bias, if the checkpoint has one);
every MoE experts module of a transformers model (3-D ``gate_up_proj`` / ``down_proj``) whose
experts the checkpoint holds, fused (trtllm) or per expert, by an :class:`MXFP8Experts`; every
other checkpoint tensor (norms, embeddings, ignored modules such as ``lm_head``) is copied into
the matching parameter or persistent buffer.

What is matched is the model's ``state_dict``: buffers it does not save (rotary ``inv_freq``
and other values computed from the config) are not checkpoint tensors, and tied parameters
(``lm_head.weight`` = ``embed_tokens.weight``) are filled by either name. For a transformers
model, checkpoint names are first renamed as transformers renames them when it loads that
architecture (e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import Marker
from mxfp8_convert.plan import expert_key
from mxfp8_convert.runtime.experts import ExpertsFace, MXFP8Experts, experts_face
from mxfp8_convert.runtime.linear import MXFP8Linear
from mxfp8_convert.runtime.load import MXFP8Checkpoint
from mxfp8_convert.runtime.moe import MXFP8MoEWeights, moe_blocks
from mxfp8_convert.runtime.weight import MXFP8Weight


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What :func:`load_into` did.

    Attributes:
        replaced: module names now served by :class:`MXFP8Linear` or :class:`MXFP8Experts`.
        copied: parameter/buffer names filled from checkpoint tensors.
        missing: model parameters/buffers the checkpoint did not provide (left as they were).
        unexpected: checkpoint tensors/weights with no place in the model.
    """

    replaced: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "replaced": self.replaced,
            "copied": self.copied,
            "missing": self.missing,
            "unexpected": self.unexpected,
        }


@dataclass(frozen=True, slots=True)
class _Named:
    """The checkpoint under the model's names."""

    weights: dict[str, MXFP8Weight]
    tensors: dict[str, torch.Tensor]
    blocks: dict[str, str]  # fused MoE block, model name -> checkpoint name


def _renamer(model: nn.Module) -> Callable[[str], str]:
    """How transformers renames checkpoint keys for ``model``'s architecture; identity otherwise."""
    if not type(model).__module__.startswith("transformers."):
        return lambda key: key
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    if not isinstance(model, PreTrainedModel):
        return lambda key: key
    rules = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: rename_source_key(key, rules, [])[0]


def _named(model: nn.Module, ckpt: MXFP8Checkpoint) -> _Named:
    rename = _renamer(model)

    def module(name: str) -> str:
        return rename(f"{name}.weight").removesuffix(".weight")

    blocks = {module(b): b for b in moe_blocks(ckpt)}
    return _Named(
        {module(n): w for n, w in ckpt.weights.items()},
        {rename(n): t for n, t in ckpt.tensors.items()},
        blocks,
    )


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _experts(model: nn.Module) -> dict[str, ExpertsFace]:
    """The model's experts modules by name."""
    faces = (experts_face(name, mod) for name, mod in model.named_modules())
    return {f.name: f for f in faces if f is not None}


def _check_experts(face: ExpertsFace, kind: str, have: tuple[int, int, int]) -> None:
    face.check(kind)
    if have != face.shape:
        want = face.shape
        raise LayoutError(
            f"{face.name}: model expects E={want[0]}, H={want[1]}, I={want[2]} experts, "
            f"checkpoint has E={have[0]}, H={have[1]}, I={have[2]}"
        )


def _load_fused(model, ck: _Named, ckpt, experts, engine, report, used) -> None:
    """Each fused MoE block of the checkpoint into the model's experts module of that name."""
    for block, source in ck.blocks.items():
        if block not in experts:
            mod = dict(model.named_modules()).get(block)
            what = (
                "no such module"
                if mod is None
                else f"a {type(mod).__name__}, not an experts module"
            )
            raise LayoutError(
                f"{block}: the checkpoint holds this MoE block fused (trtllm), "
                f"but the model has {what}",
                hint="build the model with transformers >= 5 (3-D experts), "
                "convert with --moe keep, "
                "or run the block with MXFP8MoEWeights.from_checkpoint",
            )
        weights = MXFP8MoEWeights.from_checkpoint(ckpt, source)
        _check_experts(
            experts[block], "fused", (weights.num_experts, weights.hidden, weights.intermediate)
        )
        _set_submodule(model, block, MXFP8Experts.fused(weights, engine))
        report.replaced.append(block)
        names = Marker.parse(ckpt.marker, f"{ckpt.path}/config.json").moe.tensor_names()
        for suffix in names.values():
            ck.tensors.pop(f"{block}.{suffix}", None)
        used.add(block)


def _load_per_expert(model, ck: _Named, experts, engine, report, used) -> None:
    """Per-expert MXFP8 weights (``B.<e>.gate_proj`` ...) into the model's experts module ``B``."""
    by_block: dict[str, dict[tuple[int, str], tuple[str, MXFP8Weight]]] = {}
    for name, w in ck.weights.items():
        key = expert_key(name)
        if key is not None and key[0] in experts:
            by_block.setdefault(key[0], {})[(key[1], key[2])] = (name, w)
    for block, found in sorted(by_block.items()):
        mod = MXFP8Experts.per_expert(block, {k: w for k, (_, w) in found.items()}, engine)
        _check_experts(
            experts[block], "per expert", (mod.num_experts, mod.hidden, mod.intermediate)
        )
        _set_submodule(model, block, mod)
        report.replaced.append(block)
        used.update(name for name, _ in found.values())


def _replace_linears(
    model: nn.Module, ck: _Named, engine: str, report: LoadReport, used: set[str]
) -> None:
    """Swap each checkpoint-quantized ``nn.Linear``."""
    modules = dict(model.named_modules())
    for name, weight in ck.weights.items():
        if name in used:
            continue
        mod = modules.get(name)
        if not isinstance(mod, nn.Linear):
            report.unexpected.append(name)
            continue
        if (mod.out_features, mod.in_features) != weight.shape:
            raise LayoutError(
                f"{name}: model expects [{mod.out_features}, {mod.in_features}], "
                f"checkpoint has {list(weight.shape)}"
            )
        bias = ck.tensors.pop(f"{name}.bias", None)
        if bias is None and mod.bias is not None:
            bias = mod.bias.detach()  # no bias in the checkpoint: keep the model's own
        _set_submodule(model, name, MXFP8Linear(weight, bias, engine))
        report.replaced.append(name)


def _copy_tensors(model: nn.Module, ck: _Named, report: LoadReport) -> None:
    """Fill the model's saved state (parameters and persistent buffers) from checkpoint tensors;
    tied entries (one tensor under several names) are filled once, by any of their names."""
    replaced = tuple(f"{n}." for n in report.replaced)  # their bytes came with the weights
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, target in model.state_dict(keep_vars=True).items():
        if not name.startswith(replaced):
            groups.setdefault(id(target), []).append((name, target))
    used: set[str] = set()
    for entries in groups.values():
        target = entries[0][1]
        found = [(n, ck.tensors[n]) for n, _ in entries if n in ck.tensors]
        if not found:
            report.missing.extend(n for n, _ in entries)
            continue
        for name, src in found:
            if src.shape != target.shape:
                raise LayoutError(
                    f"{name}: model expects {list(target.shape)}, checkpoint has {list(src.shape)}"
                )
        with torch.no_grad():
            target.copy_(found[0][1])
        used.update(n for n, _ in found)
        report.copied.extend(n for n, _ in found)
    report.unexpected.extend(sorted(set(ck.tensors) - used))


def load_into(
    model: nn.Module, ckpt: MXFP8Checkpoint, *, engine: str | None = None, strict: bool = True
) -> LoadReport:
    """Replace ``model``'s quantized ``nn.Linear`` layers and MoE experts, copy every other tensor.

    Args:
        model: a module whose names match the checkpoint (e.g. built from its config.json with
            transformers); put it on the checkpoint's device first.
        ckpt: from :func:`mxfp8_convert.runtime.load_checkpoint`.
        engine: engine for the new layers; defaults to the one the checkpoint was checked against.
        strict: raise if a model parameter got no tensor or a checkpoint tensor found no place.

    Returns:
        :class:`LoadReport`.

    Raises:
        LayoutError: a shape differs; a MoE block cannot be served (the model's experts module
            is of a kind this runtime does not run, or a fused block has no experts module to go
            to); an experts module of the model got no weights (even with ``strict=False``: its
            experts would stay as initialized); or (``strict``) something is missing or unexpected.
    """
    engine = engine or ckpt.engine
    report = LoadReport()
    ck = _named(model, ckpt)
    experts = _experts(model)
    used: set[str] = set()
    _load_fused(model, ck, ckpt, experts, engine, report, used)
    _load_per_expert(model, ck, experts, engine, report, used)
    _replace_linears(model, ck, engine, report, used)
    _copy_tensors(model, ck, report)
    empty = [
        b for b in experts if b not in report.replaced and f"{b}.gate_up_proj" in report.missing
    ]
    if empty:
        raise LayoutError(
            f"{empty[0]}: the checkpoint holds no experts for this MoE block "
            f"({len(empty)} block(s) in all); they would stay as initialized",
            hint="convert the model's MoE checkpoint, or load a model without these blocks",
        )
    if strict and (report.missing or report.unexpected):
        raise LayoutError(
            f"checkpoint and model do not match: {len(report.missing)} missing "
            f"({', '.join(report.missing[:3])}), {len(report.unexpected)} unexpected "
            f"({', '.join(report.unexpected[:3])})",
            hint="pass strict=False to load what matches and inspect the report",
        )
    return report
