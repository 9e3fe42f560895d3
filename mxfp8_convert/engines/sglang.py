"""SGLang plug-in: serve a converted checkpoint as it is (``sglang serve --model-path OUT``).

Installed as the entry point ``mxfp8_convert`` of the group ``sglang.srt.plugins``; SGLang calls
:func:`register` in every process before it parses its arguments. SGLang has no registration
API, so :func:`register` puts :class:`MXFP8ConvertConfig` into
``sglang.srt.layers.quantization.QUANTIZATION_METHODS``, its name into the server's
``--quantization`` choices, and :class:`MXFP8ConvertLinearMethod` into
``sglang.srt.layers.linear.WEIGHT_LOADER_V2_SUPPORTED`` (the per-parameter loaders are the v2
kind). The checkpoint's ``quant_method: "mxfp8_convert"`` then selects it; no flag is needed.

Nothing is re-laid-out: each rank's parameters are created in their final layout (e4m3
``[N_rank, K_rank]``, trtllm rows in their stored P32 order; scale tiles
``[N_rank/128, K_rank/128, 512]``) and SGLang's linear layers hand each parameter the stored
tensor with ``tp_rank`` and the part's per-rank offset and size; the parameter copies the rank's
slice in. ``process_weights_after_loading`` copies nothing: it wraps the loaded storage in the
runtime's ``MXFP8Weight``. All of that is ``engines/common.py``'s
(:class:`~mxfp8_convert.engines.common.RankParameter`, ``LinearMethod``, ``QuantConfig``); this
file states only SGLang's API: its base classes, the registration above, its TP size, its
FlashInfer route, and that SGLang hands over the marker with the model folder.

``apply``: on the SM100 family SGLang's own FlashInfer MXFP8 route
(``flashinfer_mxfp8_blockscaled_linear``, the one ``dispatch_w8a8_mxfp8_linear`` picks for its
own MXFP8 checkpoints) with the marker's backend and the stored bytes, where SGLang's route would
first shuffle and swizzle (``Fp8LinearMethod._process_mxfp8_linear_weight_scale``); on Hopper our
Triton kernels; on CPU the exact reference. Chosen once per layer.

MoE checkpoints whose experts are stored per expert (cutlass, trtllm ``--moe keep``) are served
through SGLang's ``FusedMoE`` by :class:`MXFP8ConvertExpertsMethod` (``common.ExpertsMethod``,
the vLLM plug-in's too): each rank's ``w13`` (every expert's gate rows, then its up rows) and
``w2`` (its K of down) in their final layout, filled by tiles from the stored bytes through the
loaders SGLang's Mixtral / Qwen2-MoE / Qwen3-MoE ``load_weights`` call (shard ids w1 / w3 / w2,
the checkpoint's expert index), run by the runtime's ``MXFP8Experts`` on views of them. SGLang
routes (its ``TopK``, standard output: the method declares no runner backend), runs the shared
experts and reduces the ranks. Refused at start-up, one line each: fused MoE blocks, expert
parallelism, a MoE layer whose experts are not plain SwiGLU (another activation, biases, clamped
or scaled routing, shared experts fused into the layer).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers import linear as sgl_linear
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.moe.topk import TopKOutputChecker
from sglang.srt.layers.parameter import BasevLLMParameter
from sglang.srt.layers.quantization import QUANTIZATION_METHODS
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
)
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from mxfp8_convert.engines import common
from mxfp8_convert.errors import LayoutError, MarkerError

QUANT_METHOD = common.QUANT_METHOD


class MXFP8Parameter(common.RankParameter, BasevLLMParameter):
    """A rank's weight or scale tiles (``common.RankParameter``) as an SGLang parameter."""


def _sglang_flashinfer(x2d: torch.Tensor, weight, bias):
    """SM100: SGLang's own FlashInfer MXFP8 linear, the marker's backend, the bytes as loaded."""
    from sglang.srt.layers.quantization.fp8_utils import flashinfer_mxfp8_blockscaled_linear

    return flashinfer_mxfp8_blockscaled_linear(
        x2d, weight.data, weight.scale.reshape(-1), bias=bias, output_dtype=torch.bfloat16,
        backend=weight.layout)


class MXFP8ConvertLinearMethod(common.LinearMethod, LinearMethodBase):
    """A linear layer of a converted checkpoint (``common.LinearMethod``) as an SGLang method.

    SGLang's loader skips a checkpoint tensor no parameter is named for and reports no
    parameter left unfilled, so every parameter's loaded rows are checked after loading
    (``check_loads``): a misnamed tensor is refused, never served as uninitialised memory.
    """

    parameter = MXFP8Parameter
    check_loads = True
    #: SGLang's Llama-family loaders rename ``*.weight_scale_inv`` to ``*.weight_scale`` (the
    #: FP8 checkpoints' suffix) before they look the parameter up; other models keep the name
    scale_aliases = {common.CANONICAL_SCALE_SUFFIX: ("weight_scale",)}

    @staticmethod
    def flashinfer_route():
        return _sglang_flashinfer

    @staticmethod
    def layer_tp(layer) -> tuple[None, None]:
        """SGLang hands every load its ``tp_rank`` and keeps no TP size on its layers (k/v may
        use a group of their own), so neither is taken from the layer."""
        return None, None


def _not_plain_swiglu(layer) -> list[str]:
    """What SGLang's ``FusedMoE`` ``layer`` asks beyond ``MXFP8Experts``' math:
    ``down(silu(gate(x)) * up(x))`` per expert, weighted by the router's top-k weights."""
    cfg = layer.moe_runner_config
    extra = [("activation " + repr(cfg.activation), cfg.activation != "silu"),
             ("ungated experts", not cfg.is_gated),
             ("biases", layer.with_bias),
             ("router weights on the input", cfg.apply_router_weight_on_input),
             ("uncombined top-k outputs", cfg.no_combine),
             ("clamped or scaled SwiGLU", any(v is not None for v in (
                 cfg.gemm1_alpha, cfg.gemm1_beta, cfg.gemm1_clamp_limit, cfg.swiglu_limit))),
             ("a routed scaling factor", cfg.routed_scaling_factor not in (None, 1.0)),
             ("shared experts fused into the layer", layer.num_fused_shared_experts > 0)]
    return [what for what, bad in extra if bad]


class MXFP8ConvertExpertsMethod(common.ExpertsMethod, FusedMoEMethodBase):
    """The per-expert projections of a ``FusedMoE`` layer (``common.ExpertsMethod``) as SGLang's
    MoE method. ``FusedMoE`` calls :meth:`create_weights` with the rank's I, then
    :meth:`create_moe_runner` (no runner: :meth:`apply` runs the experts itself, so SGLang's
    ``TopK`` gives standard top-k ids and weights), then per forward :meth:`apply` with the
    dispatcher's output; the combine input it returns is this rank's partial sum."""

    def __init__(self, config, layout: str, prefix: str, layer):
        FusedMoEMethodBase.__init__(self)
        common.ExpertsMethod.__init__(self, config, layout, prefix)

    @staticmethod
    def layer_tp(layer) -> tuple[int, int]:
        return layer.moe_tp_rank, layer.moe_tp_size

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        """Refuse a layer whose experts are not plain SwiGLU (one line naming what is not)."""
        extra = _not_plain_swiglu(layer)
        if extra:
            raise LayoutError(f"{self.prefix}: the layer's experts have {', '.join(extra)}; "
                              "MXFP8 experts run SwiGLU experts without biases only")
        self.moe_runner_config = moe_runner_config

    def apply(self, layer, dispatch_output) -> StandardCombineInput:
        """The rank's experts on the dispatcher's tokens; a lazy (bypassed) top-k, which a model
        may ask for by name, is routed first."""
        topk = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk):
            topk = topk.to_standard()
        if not TopKOutputChecker.format_is_standard(topk):
            raise LayoutError(f"{self.prefix}: top-k output {topk.format.name} is not the "
                              "standard (ids, weights) the MXFP8 experts take")
        x = dispatch_output.hidden_states
        return StandardCombineInput(self.run_experts(x, topk.topk_weights, topk.topk_ids))


class MXFP8ConvertConfig(common.QuantConfig, QuantizationConfig):
    """``quant_method: "mxfp8_convert"`` (``common.QuantConfig``) as an SGLang quantization config.

    SGLang passes ``from_config`` the marker plus ``hf_config`` (whose ``_name_or_path`` is the
    model folder) and the model's ``packed_modules_mapping``; the folder is checked as the
    runtime checks it (completion marker first) and its modules are listed from the headers.
    """

    linear_base = LinearBase
    linear_method = MXFP8ConvertLinearMethod
    unquantized = UnquantizedLinearMethod
    experts_base = FusedMoE
    experts_method = MXFP8ConvertExpertsMethod

    def __init__(self, checkpoint: common.EngineCheckpoint, packed: dict | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.marker = checkpoint.marker
        self.packed_modules_mapping = dict(packed or {})

    def get_scaled_act_names(self) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MXFP8ConvertConfig:
        extra = ("hf_config", "packed_modules_mapping")
        marker = {k: v for k, v in config.items() if k not in extra}
        common.check_marker(marker, "config.json quantization_config")
        path = getattr(config.get("hf_config"), "_name_or_path", None)
        if not path:
            raise MarkerError("the mxfp8_convert plug-in needs a local checkpoint folder as the "
                              "model", hint="pass --model-path OUT, the converted folder")
        return cls(common.read_checkpoint(path), config.get("packed_modules_mapping"))

    @staticmethod
    def tp_size() -> int:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_size

    @staticmethod
    def experts_refusal(layer) -> str | None:
        if layer.moe_ep_size > 1:
            return (f"expert parallelism (EP size {layer.moe_ep_size}) is not supported; "
                    "serve it with tensor parallelism")
        return None


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: make SGLang know ``quant_method: mxfp8_convert``."""
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    QUANTIZATION_METHODS[QUANT_METHOD] = MXFP8ConvertConfig
    if QUANT_METHOD not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANT_METHOD])
    if MXFP8ConvertLinearMethod.__name__ not in sgl_linear.WEIGHT_LOADER_V2_SUPPORTED:
        sgl_linear.WEIGHT_LOADER_V2_SUPPORTED.append(MXFP8ConvertLinearMethod.__name__)
