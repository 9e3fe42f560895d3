"""The plan: what happens to every tensor, decided from headers alone.

``build_plan()`` reads no tensor data itself: the one fact about data it needs (whether an FP8
scale maps losslessly to UE8M0) comes from the reader (``read.pow2_scales``). It pairs each
quantized weight with its scale (they may sit in different shards), checks every constraint
of the target backend, and fails with the full list of offending tensors before any work
starts. ``convert()`` consumes the plan; ``--dry-run`` prints it.

- ``model``: the frozen dataclasses (``ConversionPlan``, ``ShardPlan``, ``TensorPlan``,
  ``ModulePlan``, ``MoELayerPlan``...) and the tables of actions;
- ``classify``: which tensors are linear modules, paired and checked, and what each becomes;
- ``moe``: per-expert modules grouped for the fused MoE kernel, and fused sources un-fused;
- ``shards``: the output tensors laid out into Hub-style shards of bounded size;
- ``build``: ``build_plan()`` and the marker it records.
"""

from mxfp8_convert.format import (
    CANONICAL_SUFFIX,
    COMPLETE_MARKER,
    EXPERT_ROLES,
    MOE_LAYOUT,
    SWIZZLED_SUFFIX,
    make_marker,
)
from mxfp8_convert.plan.build import (
    build_plan,
    fingerprint,
    marker_tp_compat,
    moe_marker,
    plan_modules,
    quantization_config,
)
from mxfp8_convert.plan.classify import (
    MODEL_DTYPES,
    STACKED_EXPERTS,
    StackedLayout,
    dense_architecture,
    find_modules,
    fp8_lossless,
    model_dtype,
    module_names,
    resolve_ignore,
)
from mxfp8_convert.plan.model import (
    ACTIONS,
    DEQUANTIZED_LAYOUT,
    DROPPED_SUFFIXES,
    KV_SCALE_SUFFIXES,
    MOE_MODES,
    MOE_TENSORS,
    MXFP8_ACTIONS,
    NOT_IGNORED_KINDS,
    ON_INELIGIBLE,
    ConversionPlan,
    ExpertSlice,
    ModulePlan,
    MoELayerPlan,
    ShardPlan,
    StackedSlice,
    TensorPlan,
    Unquantized,
)
from mxfp8_convert.plan.moe import (
    EXPERT_PROJS,
    EXPERT_RE,
    MOE_BACKENDS,
    expert_key,
    expert_slice,
    fused_moe_blocks,
    fused_moe_shape,
)

__all__ = [
    "ACTIONS",
    "CANONICAL_SUFFIX",
    "COMPLETE_MARKER",
    "DEQUANTIZED_LAYOUT",
    "DROPPED_SUFFIXES",
    "EXPERT_PROJS",
    "EXPERT_RE",
    "EXPERT_ROLES",
    "KV_SCALE_SUFFIXES",
    "MODEL_DTYPES",
    "MOE_BACKENDS",
    "MOE_LAYOUT",
    "MOE_MODES",
    "MOE_TENSORS",
    "MXFP8_ACTIONS",
    "NOT_IGNORED_KINDS",
    "ON_INELIGIBLE",
    "STACKED_EXPERTS",
    "SWIZZLED_SUFFIX",
    "ConversionPlan",
    "ExpertSlice",
    "ModulePlan",
    "MoELayerPlan",
    "ShardPlan",
    "StackedLayout",
    "StackedSlice",
    "TensorPlan",
    "Unquantized",
    "build_plan",
    "dense_architecture",
    "expert_key",
    "expert_slice",
    "find_modules",
    "fingerprint",
    "fp8_lossless",
    "fused_moe_blocks",
    "fused_moe_shape",
    "make_marker",
    "marker_tp_compat",
    "model_dtype",
    "module_names",
    "moe_marker",
    "plan_modules",
    "quantization_config",
    "resolve_ignore",
]
