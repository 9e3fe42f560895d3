"""vLLM plug-in: serve a converted checkpoint as it is (``vllm serve OUT``, ``LLM(model=OUT)``).

Installed as the entry point ``mxfp8_convert`` of the group ``vllm.general_plugins``; vLLM calls
:func:`register` in every process, and the checkpoint's ``quant_method: "mxfp8_convert"`` picks
:class:`MXFP8ConvertConfig`. Nothing is re-laid-out: each rank's parameters are created in their
final layout (e4m3 ``[N_rank, K_rank]``, trtllm rows in their stored P32 order; scale tiles
``[N_rank/128, K_rank/128, 512]``) and the weight loaders copy the rank's slice of the stored
tensors into them. ``process_weights_after_loading`` only wraps the loaded parameters, without a
copy, in the runtime's ``MXFP8Weight``. All of that is ``engines/common.py``'s
(:class:`~mxfp8_convert.engines.common.RankParameter`, ``LinearMethod``, ``QuantConfig``); this
file states only vLLM's API: its base classes and registration decorators, its TP size, its
FlashInfer route, and that vLLM hands over the marker first and the model folder after.

MoE checkpoints are served through vLLM's fused-MoE layer (``RoutedExperts``): experts stored
per expert (cutlass, trtllm ``--moe keep``) by :class:`MXFP8ConvertExpertsMethod`
(``common.ExpertsMethod``): each rank's ``w13`` (every expert's gate rows, then its up rows) and
``w2`` (its K of down) in their final layout, the same loading by tiles, and the runtime's
``MXFP8Experts`` on views of them; fused trtllm blocks (docs/FORMAT.md section 3a) by
:class:`MXFP8ConvertFusedExpertsMethod` (``common.FusedExpertsMethod``): each rank's contiguous
share of the stored ``w13`` rows and ``w2`` K, its tiles, run by the runtime's fused
``MXFP8Experts``. vLLM routes, runs the shared experts and all-reduces.

Where it runs: the marker's backend through FlashInfer ``mm_mxfp8`` on the SM100 family (vLLM's
own ``vllm::mm_mxfp8`` op), our Triton kernels on Hopper, the exact reference on CPU; chosen once
per layer. Refused at start-up, one line each: a folder without the completion marker, an
unknown ``format_version``, a tensor-parallel size outside ``tp_compat`` (a fused block whose
I/tp is not a multiple of 128 included), expert parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import BasevLLMParameter

from mxfp8_convert.engines import common

QUANT_METHOD = common.QUANT_METHOD


class MXFP8Parameter(common.RankParameter, BasevLLMParameter):
    """A rank's weight or scale tiles (``common.RankParameter``) as a vLLM parameter."""


def _vllm_flashinfer(x2d: torch.Tensor, weight, bias):
    """SM100: vLLM's own FlashInfer MXFP8 ops, the marker's backend, the bytes as loaded."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize
    from vllm.utils import flashinfer as vllm_flashinfer

    a, a_sf = mxfp8_e4m3_quantize(x2d, is_sf_swizzled_layout=True)
    out = vllm_flashinfer.mm_mxfp8(a, weight.data.t(), a_sf, weight.scale.reshape(-1),
                                   torch.bfloat16, backend=weight.layout)
    return out if bias is None else out + bias.to(out.dtype)


@register_weight_loader_v2_supported_method
class MXFP8ConvertLinearMethod(common.LinearMethod, LinearMethodBase):
    """A linear layer of a converted checkpoint (``common.LinearMethod``) as a vLLM method.

    vLLM's own loader refuses a parameter no checkpoint tensor names (``Following weights were
    not initialized``), and its ``ReplicatedLinear`` copies whole tensors without the per-rank
    loaders, so the loaded rows are not counted here (``check_loads`` off).
    """

    parameter = MXFP8Parameter

    @staticmethod
    def flashinfer_route():
        """vLLM's ``mm_mxfp8`` where this vLLM has it (else the runtime's FlashInfer call)."""
        from vllm.utils import flashinfer as vllm_flashinfer

        return _vllm_flashinfer if hasattr(vllm_flashinfer, "mm_mxfp8") else None


class MXFP8ConvertExpertsMethod(common.ExpertsMethod, FusedMoEMethodBase):
    """The per-expert projections of a fused-MoE layer (``common.ExpertsMethod``) as vLLM's MoE
    method: ``RoutedExperts`` calls :meth:`apply` with the router's ``topk_weights`` and
    ``topk_ids`` (no modular kernel: vLLM runs the shared experts and the all-reduce itself).

    Its ``load_weights`` maps ``experts.<e>.<gate|up|down>`` to ``w13_...`` / ``w2_...`` with the
    shard ids w1 / w3 / w2 and calls each parameter's ``weight_loader`` (set by
    ``common.ExpertsMethod.register``, replacing vLLM's, which would narrow the tiles as weight
    rows).
    """

    def __init__(self, config, layout: str, prefix: str, layer):
        FusedMoEMethodBase.__init__(self, layer.moe_config)
        common.ExpertsMethod.__init__(self, config, layout, prefix)

    @staticmethod
    def layer_tp(layer) -> tuple[int, int]:
        return layer.moe_config.tp_rank, layer.moe_config.tp_size

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return self.run_experts(x, topk_weights, topk_ids)


class MXFP8ConvertFusedExpertsMethod(common.FusedExpertsMethod, FusedMoEMethodBase):
    """A fused trtllm MoE block (``common.FusedExpertsMethod``) as vLLM's MoE method, called as
    :class:`MXFP8ConvertExpertsMethod` is.

    vLLM's ``RoutedExperts.load_weights`` reads a 3-D ``experts.w13*`` tensor as every expert's
    ``[gate; up]`` halves (``chunk(2, dim=1)``; Mixtral's names map ``w13_weight`` to a
    ``w13_weight_weight`` it does not have, Qwen's match nothing), which is not this layout. So
    the layer's ``load_weights`` is wrapped: the block's four stored tensors (named as the
    parameters, ``w13_weight``, ...) go to :meth:`load_fused`, anything else to vLLM's.
    """

    def __init__(self, config, block: common.FusedBlock, prefix: str, layer):
        FusedMoEMethodBase.__init__(self, layer.moe_config)
        common.FusedExpertsMethod.__init__(self, config, block, prefix)

    @staticmethod
    def layer_tp(layer) -> tuple[int, int]:
        return layer.moe_config.tp_rank, layer.moe_config.tp_size

    def register(self, layer, tensors) -> None:
        for name, data in tensors:
            layer.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))
        ours = {name for name, _ in tensors}
        engine_load = layer.load_weights

        def load_weights(weights):
            taken = []

            def others():
                for name, loaded in weights:
                    if name in ours:
                        self.load_fused(layer, name, loaded)
                        taken.append(name)
                    else:
                        yield name, loaded

            yield from engine_load(others())
            yield from taken

        layer.load_weights = load_weights

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return self.run_experts(x, topk_weights, topk_ids)


@register_quantization_config(QUANT_METHOD)
class MXFP8ConvertConfig(common.QuantConfig, QuantizationConfig):
    """``quant_method: "mxfp8_convert"`` (``common.QuantConfig``) as a vLLM quantization config.

    vLLM passes ``from_config`` the marker alone and the model folder later
    (:meth:`maybe_update_config`), then sets the model's ``packed_modules_mapping``.
    """

    linear_base = LinearBase
    linear_method = MXFP8ConvertLinearMethod
    unquantized = UnquantizedLinearMethod
    experts_base = RoutedExperts
    experts_method = MXFP8ConvertExpertsMethod
    fused_experts_method = MXFP8ConvertFusedExpertsMethod

    def __init__(self, marker: dict):
        super().__init__()
        self.marker = marker

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MXFP8ConvertConfig:
        return cls(common.check_marker(dict(config), "config.json quantization_config",
                                       fused=True))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Check the folder as the runtime does (completion marker first) and list its modules."""
        self.checkpoint = common.read_checkpoint(model_name, fused=True)

    @staticmethod
    def tp_size() -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    @staticmethod
    def experts_refusal(layer) -> str | None:
        parallel = layer.moe_config.moe_parallel_config
        if parallel.use_ep:
            return (f"expert parallelism (EP size {parallel.ep_size}) is not supported; "
                    "serve it with tensor parallelism")
        return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: importing this module registers the config."""
    return None
