"""vLLM plug-in: serve a converted checkpoint as it is (``vllm serve OUT``, ``vllm.LLM(model=OUT)``).

Installed as the entry point ``mxfp8_convert`` of the group ``vllm.general_plugins``; vLLM calls
:func:`register` in every process, and the checkpoint's ``quant_method: "mxfp8_convert"`` picks
:class:`MXFP8ConvertConfig`. Nothing is re-laid-out: each rank's parameters are created in their
final layout (e4m3 ``[N_rank, K_rank]``, trtllm rows in their stored P32 order; scale tiles
``[N_rank/128, K_rank/128, 512]``) and the weight loaders copy the rank's slice of the stored
tensors into them (``engines/common.py`` cuts the slices). ``process_weights_after_loading``
only wraps the loaded parameters, without a copy, in the runtime's ``MXFP8Weight``.

Where it runs: the marker's backend through FlashInfer ``mm_mxfp8`` on the SM100 family (vLLM's
own ``vllm::mm_mxfp8`` op), our Triton kernels on Hopper, the exact reference on CPU; chosen once
per layer. Refused at start-up, one line each: a folder without the completion marker, an
unknown ``format_version``, fused MoE blocks, a tensor-parallel size outside ``tp_compat``.
"""

from __future__ import annotations

from typing import Any

import torch
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
from mxfp8_convert.errors import LayoutError, MarkerError

QUANT_METHOD = "mxfp8_convert"
#: compute capability each layout needs in vLLM (capability x10): the FlashInfer backends
#: (trtllm, cutlass: SM100 family) or our Triton engine (SM90); the reference runs anywhere.
MIN_CAPABILITY = 90


class MXFP8Parameter(BasevLLMParameter):
    """A rank's weight or scale tiles; the loaders copy the rank's slice of the stored tensor.

    ``grid`` says how the tensor's indices map to weight rows and K columns (``common.Grid``).
    """

    def __init__(self, data: torch.Tensor, weight_loader, grid: common.Grid, name: str):
        super().__init__(data=data, weight_loader=weight_loader)
        self.grid = grid
        self.what = name

    @property
    def output_dim(self) -> int:
        raise LayoutError(f"{self.what}: a module fused on disk (no q/k/v or gate/up shard id) "
                          "is not supported by the mxfp8_convert plug-in")

    def _rows(self) -> int:
        return self.data.shape[0] * self.grid.rows

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        start, size = common.rank_part(loaded_weight.shape[0] * self.grid.rows, self.tp_size,
                                       self.tp_rank)
        common.place_rows(self.data, self.grid, 0,
                          common.take_rows(loaded_weight, self.grid, start, size, self.what), self.what)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        size = self.data.shape[1] * self.grid.cols
        src = common.take_cols(loaded_weight, self.grid, self.tp_rank * size, size, self.what)
        common.place_rows(self.data, self.grid, 0, src, self.what)

    def _load_part(self, loaded: torch.Tensor, offset: int, size: int, replicas: int) -> None:
        rows = loaded.shape[0] * self.grid.rows
        start, n = common.rank_part(rows, self.tp_size, self.tp_rank, replicas)
        if n != size:
            raise LayoutError(f"{self.what}: part of {rows} rows gives {n} per rank, vLLM expects {size}")
        src = common.take_rows(loaded, self.grid, start, size, self.what)
        common.place_rows(self.data, self.grid, offset, src, self.what)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self._load_part(loaded_weight, kwargs["shard_offset"], kwargs["shard_size"], 1)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        replicas = 1 if kwargs["shard_id"] == "q" else kwargs["num_heads"]
        self._load_part(loaded_weight, kwargs["shard_offset"], kwargs["shard_size"], replicas)


def _vllm_flashinfer(x2d: torch.Tensor, weight, bias):
    """SM100: vLLM's own FlashInfer MXFP8 ops, the marker's backend, the bytes as loaded."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize
    from vllm.utils import flashinfer as vllm_flashinfer

    a, a_sf = mxfp8_e4m3_quantize(x2d, is_sf_swizzled_layout=True)
    out = vllm_flashinfer.mm_mxfp8(a, weight.data.t(), a_sf, weight.scale.reshape(-1),
                                   torch.bfloat16, backend=weight.layout)
    return out if bias is None else out + bias.to(out.dtype)


def _engine_run(name: str):
    from mxfp8_convert.runtime.select import ENGINES

    if name == "flashinfer":
        from vllm.utils import flashinfer as vllm_flashinfer

        if hasattr(vllm_flashinfer, "mm_mxfp8"):
            return _vllm_flashinfer
    return ENGINES[name].run


@register_weight_loader_v2_supported_method
class MXFP8ConvertLinearMethod(LinearMethodBase):
    """A linear layer of a converted checkpoint, laid out (trtllm/cutlass) or kept canonical."""

    def __init__(self, config: MXFP8ConvertConfig, layout: str, prefix: str):
        self.config = config
        self.layout = layout
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        loader = extra_weight_attrs["weight_loader"]
        tensors = common.rank_tensors(self.layout, self.prefix, output_partition_sizes,
                                      input_size_per_partition)
        for name, data, g in tensors:
            layer.register_parameter(name, MXFP8Parameter(
                data=data, weight_loader=loader, grid=g, name=f"{self.prefix}.{name}"))
        layer.mxfp8_scale_name = tensors[1][0]

    def process_weights_after_loading(self, layer) -> None:
        """No copy, no re-layout: the runtime's weight type over the loaded parameters' storage."""
        from mxfp8_convert.runtime.weight import MXFP8Weight

        scale = getattr(layer, layer.mxfp8_scale_name)
        layer.mxfp8_weight = MXFP8Weight(layer.weight.data, scale.data, self.layout, self.prefix)
        layer.mxfp8_engine = common.engine_for(layer.weight.device, self.layout)
        layer.mxfp8_run = _engine_run(layer.mxfp8_engine)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return common.apply_linear(layer.mxfp8_run, layer.mxfp8_weight, x, bias)


@register_quantization_config(QUANT_METHOD)
class MXFP8ConvertConfig(QuantizationConfig):
    """``quant_method: "mxfp8_convert"``: a checkpoint written by mxfp8-convert (docs/FORMAT.md)."""

    def __init__(self, marker: dict):
        super().__init__()
        self.marker = marker
        self.checkpoint: common.EngineCheckpoint | None = None
        self._tp_checked: int | None = None

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MXFP8ConvertConfig:
        return cls(common.check_marker(dict(config), "config.json quantization_config"))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Check the folder as the runtime does (completion marker first) and list its modules."""
        self.checkpoint = common.read_checkpoint(model_name)

    def _modules(self) -> common.EngineCheckpoint:
        if self.checkpoint is None:
            raise MarkerError("the mxfp8_convert plug-in needs a local checkpoint folder as the model")
        return self.checkpoint

    def _layout_of(self, prefix: str) -> str | None:
        """The layout of module ``prefix`` (or of all the parts vLLM fused into it)."""
        ckpt = self._modules()
        base, _, leaf = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf) or common.FUSED.get(leaf) or [leaf]
        names = [f"{base}.{p}" if base else p for p in parts]
        found = {ckpt.modules[n].layout if n in ckpt.modules else None for n in names}
        if prefix in ckpt.modules:
            found = {ckpt.modules[prefix].layout}
        if len(found) > 1:
            raise LayoutError(f"{prefix}: its parts {', '.join(names)} are stored in different layouts")
        return found.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = get_tensor_model_parallel_world_size()
        if self._tp_checked != tp:
            common.check_tp(self._modules(), tp)
            self._tp_checked = tp
        layout = self._layout_of(prefix)
        if layout is None:  # ignored, kept unquantized (lm_head, ...)
            return UnquantizedLinearMethod()
        return MXFP8ConvertLinearMethod(self, layout, prefix)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: importing this module registers the config."""
    return None
