"""SGLang plug-in: serve a converted checkpoint as it is (``sglang serve --model-path OUT``).

Installed as the entry point ``mxfp8_convert`` of the group ``sglang.srt.plugins``; SGLang calls
:func:`register` in every process before it parses its arguments. SGLang has no registration
API, so :func:`register` puts :class:`MXFP8ConvertConfig` into
``sglang.srt.layers.quantization.QUANTIZATION_METHODS``, its name into the server's
``--quantization`` choices, and :class:`MXFP8ConvertLinearMethod` into
``sglang.srt.layers.linear.WEIGHT_LOADER_V2_SUPPORTED`` (the per-parameter loaders below are the
v2 kind). The checkpoint's ``quant_method: "mxfp8_convert"`` then selects it; no flag is needed.

Nothing is re-laid-out (``engines/common.py`` has the format; this file only maps SGLang's hooks
onto it): each rank's parameters are created in their final layout (e4m3 ``[N_rank, K_rank]``,
trtllm rows in their stored P32 order; scale tiles ``[N_rank/128, K_rank/128, 512]``) and SGLang's
linear layers hand each parameter the stored tensor with ``tp_rank`` and the part's per-rank
offset and size; the parameter copies the rank's slice in. ``process_weights_after_loading``
copies nothing: it wraps the loaded storage in the runtime's ``MXFP8Weight``.

``apply``: on the SM100 family SGLang's own FlashInfer MXFP8 route
(``flashinfer_mxfp8_blockscaled_linear``, the one ``dispatch_w8a8_mxfp8_linear`` picks for its
own MXFP8 checkpoints) with the marker's backend and the stored bytes, where SGLang's route would
first shuffle and swizzle (``Fp8LinearMethod._process_mxfp8_linear_weight_scale``); on Hopper our
Triton kernels; on CPU the exact reference. Chosen once per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers import linear as sgl_linear
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.parameter import BasevLLMParameter
from sglang.srt.layers.quantization import QUANTIZATION_METHODS
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from mxfp8_convert.engines import common
from mxfp8_convert.errors import LayoutError, MarkerError

QUANT_METHOD = "mxfp8_convert"
#: capability x10 SGLang checks before loading: our Triton engine needs SM90, FlashInfer's
#: trtllm/cutlass the SM100 family (checked per layer when it is chosen); CPU has none.
MIN_CAPABILITY = 90


class MXFP8Parameter(BasevLLMParameter):
    """A rank's weight or scale tiles; SGLang's loaders hand it the whole stored tensor.

    ``grid`` maps the tensor's indices to weight rows and K columns (``common.Grid``). Every
    load records the weight rows it filled, so a parameter that SGLang never loaded, or loaded
    in part (a name the model's loader did not map), is refused after loading.
    """

    def __init__(self, data: torch.Tensor, weight_loader, grid: common.Grid, name: str):
        super().__init__(data=data, weight_loader=weight_loader)
        self.grid = grid
        self.what = name
        self.rows_loaded = 0

    @property
    def output_dim(self) -> int:
        raise LayoutError(f"{self.what}: a module fused on disk (no q/k/v or gate/up shard id) "
                          "is not supported by the mxfp8_convert plug-in")

    def _place(self, src: torch.Tensor, offset: int) -> None:
        common.place_rows(self.data, self.grid, offset, src, self.what)
        self.rows_loaded += src.shape[0] * self.grid.rows

    def _part(self, loaded: torch.Tensor, index: int, size: int, presharded: bool) -> torch.Tensor:
        """Rows ``[index * size, (index + 1) * size)`` of a stored tensor (all if presharded)."""
        if presharded:
            return loaded
        return common.take_rows(loaded, self.grid, index * size, size, self.what)

    def load_column_parallel_weight(self, loaded_weight, tp_rank: int,
                                    use_presharded_weights: bool = False) -> None:
        size = self.data.shape[0] * self.grid.rows
        self._place(self._part(loaded_weight, tp_rank, size, use_presharded_weights), 0)

    def load_row_parallel_weight(self, loaded_weight, tp_rank: int,
                                 use_presharded_weights: bool = False) -> None:
        size = self.data.shape[1] * self.grid.cols
        src = loaded_weight if use_presharded_weights else common.take_cols(
            loaded_weight, self.grid, tp_rank * size, size, self.what)
        self._place(src, 0)

    def load_merged_column_weight(self, loaded_weight, **kw) -> None:
        """``gate_up_proj`` part ``shard_id`` (0/1) at its per-rank ``shard_offset``."""
        src = self._part(loaded_weight, kw["tp_rank"], kw["shard_size"],
                         kw.get("use_presharded_weights", False))
        self._place(src, kw["shard_offset"])

    def load_qkv_weight(self, loaded_weight, **kw) -> None:
        """``qkv_proj`` part q/k/v; ``num_heads`` ranks share a KV head when they outnumber them."""
        index = kw["tp_rank"] if kw["shard_id"] == "q" else kw["tp_rank"] // kw["num_heads"]
        src = self._part(loaded_weight, index, kw["shard_size"],
                         kw.get("use_presharded_weights", False))
        self._place(src, kw["shard_offset"])

    def check_loaded(self) -> None:
        rows = self.data.shape[0] * self.grid.rows
        if self.rows_loaded != rows:
            raise LayoutError(f"{self.what}: {self.rows_loaded} of its {rows} rows were loaded "
                              "from the checkpoint", hint="is the tensor missing or misnamed?")


def _sglang_flashinfer(x2d: torch.Tensor, weight, bias):
    """SM100: SGLang's own FlashInfer MXFP8 linear, the marker's backend, the bytes as loaded."""
    from sglang.srt.layers.quantization.fp8_utils import flashinfer_mxfp8_blockscaled_linear

    return flashinfer_mxfp8_blockscaled_linear(
        x2d, weight.data, weight.scale.reshape(-1), bias=bias, output_dtype=torch.bfloat16,
        backend=weight.layout)


def _engine_run(name: str):
    from mxfp8_convert.runtime.select import ENGINES

    return _sglang_flashinfer if name == "flashinfer" else ENGINES[name].run


class MXFP8ConvertLinearMethod(LinearMethodBase):
    """A linear layer of a converted checkpoint, laid out (trtllm/cutlass) or kept canonical."""

    def __init__(self, config: MXFP8ConvertConfig, layout: str, prefix: str):
        self.config = config
        self.layout = layout
        self.prefix = prefix

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        """Per-rank parameters in their final layout; ``skip_block_quant_check`` has no use here."""
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
        layer.weight.check_loaded()
        scale.check_loaded()
        layer.mxfp8_weight = MXFP8Weight(layer.weight.data, scale.data, self.layout, self.prefix)
        layer.mxfp8_engine = common.engine_for(layer.weight.device, self.layout)
        layer.mxfp8_run = _engine_run(layer.mxfp8_engine)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return common.apply_linear(layer.mxfp8_run, layer.mxfp8_weight, x, bias)


class MXFP8ConvertConfig(QuantizationConfig):
    """``quant_method: "mxfp8_convert"``: a checkpoint written by mxfp8-convert (docs/FORMAT.md).

    SGLang passes ``from_config`` the marker plus ``hf_config`` (whose ``_name_or_path`` is the
    model folder) and the model's ``packed_modules_mapping``; the folder is checked as the
    runtime checks it (completion marker first) and its modules are listed from the headers.
    """

    def __init__(self, checkpoint: common.EngineCheckpoint, packed: dict | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.marker = checkpoint.marker
        self.packed_modules_mapping = dict(packed or {})
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

    def _layout_of(self, prefix: str) -> str | None:
        """The layout of module ``prefix`` (or of all the parts SGLang fused into it)."""
        modules = self.checkpoint.modules
        if prefix in modules:
            return modules[prefix].layout
        base, _, leaf = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf) or common.FUSED.get(leaf) or [leaf]
        names = [f"{base}.{p}" if base else p for p in parts]
        found = {modules[n].layout if n in modules else None for n in names}
        if len(found) > 1:
            raise LayoutError(f"{prefix}: its parts {', '.join(names)} are stored in different "
                              "layouts (or some unquantized)")
        return found.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        from sglang.srt.runtime_context import get_parallel

        tp = get_parallel().tp_size
        if self._tp_checked != tp:
            common.check_tp(self.checkpoint, tp)
            self._tp_checked = tp
        layout = self._layout_of(prefix)
        if layout is None:  # ignored, kept unquantized (lm_head, ...)
            return UnquantizedLinearMethod()
        return MXFP8ConvertLinearMethod(self, layout, prefix)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: make SGLang know ``quant_method: mxfp8_convert``."""
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    QUANTIZATION_METHODS[QUANT_METHOD] = MXFP8ConvertConfig
    if QUANT_METHOD not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANT_METHOD])
    if MXFP8ConvertLinearMethod.__name__ not in sgl_linear.WEIGHT_LOADER_V2_SUPPORTED:
        sgl_linear.WEIGHT_LOADER_V2_SUPPORTED.append(MXFP8ConvertLinearMethod.__name__)
