"""Put a loaded checkpoint into an existing ``torch.nn.Module`` (e.g. a model built from its config).

Every ``nn.Linear`` whose qualified name has an MXFP8 weight in the checkpoint is replaced by an
:class:`MXFP8Linear` holding the checkpoint's bytes (and its bias, if the checkpoint has one);
every other checkpoint tensor (norms, embeddings, ignored modules such as ``lm_head``) is copied
into the matching parameter or buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.linear import MXFP8Linear
from mxfp8_convert.runtime.load import MXFP8Checkpoint


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What :func:`load_into` did.

    Attributes:
        replaced: module names now served by :class:`MXFP8Linear`.
        copied: parameter/buffer names filled from checkpoint tensors.
        missing: model parameters/buffers the checkpoint did not provide (left as they were).
        unexpected: checkpoint tensors/weights with no place in the model.
    """

    replaced: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"replaced": self.replaced, "copied": self.copied, "missing": self.missing,
                "unexpected": self.unexpected}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _replace_linears(model: nn.Module, ckpt: MXFP8Checkpoint, engine: str, report: LoadReport) -> set[str]:
    """Swap each checkpoint-quantized ``nn.Linear``; returns the checkpoint tensor names used."""
    used: set[str] = set()
    modules = dict(model.named_modules())
    for name, weight in ckpt.weights.items():
        mod = modules.get(name)
        if not isinstance(mod, nn.Linear):
            report.unexpected.append(name)
            continue
        if (mod.out_features, mod.in_features) != weight.shape:
            raise LayoutError(
                f"{name}: model expects [{mod.out_features}, {mod.in_features}], checkpoint has {list(weight.shape)}"
            )
        bias = ckpt.tensors.get(f"{name}.bias")
        if bias is not None:
            used.add(f"{name}.bias")
        elif mod.bias is not None:
            bias = mod.bias.detach()  # no bias in the checkpoint: keep the model's own
        _set_submodule(model, name, MXFP8Linear(weight, bias, engine))
        report.replaced.append(name)
    return used


def _copy_tensors(model: nn.Module, ckpt: MXFP8Checkpoint, used: set[str], report: LoadReport) -> None:
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    replaced = tuple(f"{n}." for n in report.replaced)
    for name, target in state.items():
        if name.startswith(replaced):
            continue
        src = ckpt.tensors.get(name)
        if src is None:
            report.missing.append(name)
            continue
        if src.shape != target.shape:
            raise LayoutError(f"{name}: model expects {list(target.shape)}, checkpoint has {list(src.shape)}")
        with torch.no_grad():
            target.copy_(src)
        used.add(name)
        report.copied.append(name)
    report.unexpected.extend(sorted(set(ckpt.tensors) - used))


def load_into(
    model: nn.Module, ckpt: MXFP8Checkpoint, *, engine: str | None = None, strict: bool = True
) -> LoadReport:
    """Replace ``model``'s quantized ``nn.Linear`` layers and copy every other checkpoint tensor.

    Args:
        model: a module whose names match the checkpoint (e.g. built from its config.json);
            put it on the checkpoint's device first.
        ckpt: from :func:`mxfp8_convert.runtime.load_checkpoint`.
        engine: engine for the new layers; defaults to the one the checkpoint was checked against.
        strict: raise if a model parameter got no tensor or a checkpoint tensor found no place.

    Returns:
        :class:`LoadReport`.

    Raises:
        LayoutError: a shape differs, or (``strict``) something is missing or unexpected.
    """
    report = LoadReport()
    used = _replace_linears(model, ckpt, engine or ckpt.engine, report)
    _copy_tensors(model, ckpt, used, report)
    if strict and (report.missing or report.unexpected):
        raise LayoutError(
            f"checkpoint and model do not match: {len(report.missing)} missing "
            f"({', '.join(report.missing[:3])}), {len(report.unexpected)} unexpected "
            f"({', '.join(report.unexpected[:3])})",
            hint="pass strict=False to load what matches and inspect the report",
        )
    return report
