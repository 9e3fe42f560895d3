"""What an inference-engine plug-in needs from a converted checkpoint, whatever the engine.

Engine-independent; ``engines/vllm.py`` (and an SGLang plug-in) add only their engine's glue:

- :func:`read_checkpoint`: the marker, checked by the runtime's own reader (completion marker,
  ``quant_method``, known ``format_version``, layout names), and every quantized module's shape
  and layout from the shard headers (no tensor data is read);
- :func:`tp_compat` / :func:`first_tp_violation`: the tensor-parallel sizes at which every module
  slices on tile boundaries (docs/FORMAT.md section 2a) and, for any other size, the first module
  that does not;
- :func:`rank_part` / :func:`take_rows` / :func:`take_cols` / :func:`place_rows`: a rank's share
  of a stored tensor, as a view: rows of a column-parallel module (one part of a fused
  ``qkv_proj`` / ``gate_up_proj``, KV heads shared by ``tp / num_kv_heads`` ranks when they are
  fewer than the ranks), K of a row-parallel one; in 128-row / 128-column tiles for laid-out scales;
- :func:`engine_for`: the runtime engine of a layer, chosen once: FlashInfer on the SM100 family,
  our Triton kernels on Hopper, the exact reference on CPU.

This module imports no torch at import time (the converter uses :func:`tp_compat`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import FormatError, LayoutError
from mxfp8_convert.format import (
    CANONICAL_LAYOUT,
    CANONICAL_SUFFIX,
    META_TENSORS,
    SWIZZLED_SUFFIX,
    Marker,
)

if TYPE_CHECKING:
    import torch

#: Tensor-parallel sizes the converter checks and records (marker key ``tp_compat``).
TP_SIZES = (1, 2, 4, 8, 16)
#: Rows / K columns of one scale tile ``[.., .., 512]`` (docs/FORMAT.md section 3).
TILE = 128
CANONICAL = CANONICAL_LAYOUT
SCALE_SUFFIX = SWIZZLED_SUFFIX
CANONICAL_SCALE_SUFFIX = CANONICAL_SUFFIX

# How a tensor-parallel engine splits a projection, by the last part of its module name
# (Llama / Qwen2 / Mistral families in vLLM and SGLang). A name not listed is checked both ways.
COLUMN, ROW, KV_HEADS, EITHER = "column", "row", "kv_heads", "either"
SPLITS = {
    "q_proj": COLUMN, "k_proj": KV_HEADS, "v_proj": KV_HEADS,  # vLLM/SGLang QKVParallelLinear
    "gate_proj": COLUMN, "up_proj": COLUMN,  # MergedColumnParallelLinear
    "o_proj": ROW, "down_proj": ROW,  # RowParallelLinear
}
#: Parameters an engine fuses from several stored modules, parts in order (the shard ids
#: vLLM passes: "q"/"k"/"v" for qkv_proj, 0/1 for gate_up_proj).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Module:
    """One quantized linear module of a checkpoint, as stored: logical ``[n, k]``."""

    name: str
    n: int
    k: int
    layout: str  # the marker's backend ("trtllm"/"cutlass") or "canonical"

    @property
    def split(self) -> str:
        return SPLITS.get(self.name.rpartition(".")[2], EITHER)


@dataclass(frozen=True, slots=True)
class Grid:
    """How indices of one stored tensor map to weight elements, and where a slice may start.

    ``rows``/``cols``: weight rows / K columns per index of dims 0 / 1; ``row_align``/``col_align``:
    slices must start and end on multiples of these (in weight elements).
    """

    rows: int
    cols: int
    row_align: int
    col_align: int


#: (laid out?, tensor) -> grid. Laid-out weights slice where their scale tiles do.
GRIDS = {
    (True, "weight"): Grid(1, 1, TILE, TILE),
    (True, "scale"): Grid(TILE, TILE, TILE, TILE),
    (False, "weight"): Grid(1, 1, 1, 32),
    (False, "scale"): Grid(1, 32, 1, 32),
}


def grid(layout: str, tensor: str) -> Grid:
    """The :class:`Grid` of ``tensor`` (``"weight"`` or ``"scale"``) of a module in ``layout``."""
    return GRIDS[(layout != CANONICAL, tensor)]


@dataclass(frozen=True, slots=True)
class EngineCheckpoint:
    """A converted checkpoint as a plug-in sees it at start-up.

    Attributes:
        path: the folder.
        marker: config.json's ``quantization_config``.
        modules: quantized linear modules by name (``model.layers.0.self_attn.q_proj``).
        num_kv_heads: the config's ``num_key_value_heads`` (``None``: not given).
    """

    path: Path
    marker: dict
    modules: dict[str, Module]
    num_kv_heads: int | None

    @property
    def backend(self) -> str:
        return self.marker["backend"]

    @property
    def tp_compat(self) -> list[int]:
        """The marker's ``tp_compat``; computed from the headers for a version-1 marker."""
        sizes = self.marker.get("tp_compat")
        if sizes is None:
            return tp_compat(self.modules.values(), self.num_kv_heads, self.backend)
        return list(sizes)


def config_kv_heads(config: dict) -> int | None:
    """The config's ``num_key_value_heads`` (its ``text_config``'s for a multimodal one)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kv = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    return kv if isinstance(kv, int) and kv > 0 else None


def check_marker(marker: dict, where: str) -> dict:
    """Check a ``quantization_config`` dict with the runtime's marker rules; refuse fused MoE.

    Raises:
        MarkerError: not our marker, unknown ``format_version``, layout names that do not match.
        FormatError: the checkpoint holds fused MoE blocks (not served by the plug-ins yet).
    """
    parsed = Marker.parse(marker, where)
    if parsed.moe is not None:
        first = (parsed.moe.layers or ("?",))[0]
        raise FormatError(
            f"{where}: fused MoE blocks ({first}, ...) are not served by the engine plug-ins yet",
            hint="serve it with mxfp8_convert.runtime, or convert with --moe keep",
        )
    return marker


def read_checkpoint(path: str | Path) -> EngineCheckpoint:
    """Check a converted folder as the runtime does and list its quantized modules (headers only).

    Raises:
        SourceError / MarkerError / FormatError / LayoutError: one line naming the file or module.
    """
    from mxfp8_convert.read import open_checkpoint
    from mxfp8_convert.runtime.load import read_marker

    root = Path(path)
    marker = check_marker(read_marker(root), f"{root}/config.json")
    ckpt = open_checkpoint(root)
    records: dict[str, dict] = {}
    for header in ckpt.shards.values():
        try:
            records.update(json.loads(header.metadata.get(META_TENSORS, "{}")))
        except ValueError:
            raise LayoutError(f"{root / header.relpath}: unreadable {META_TENSORS} metadata") from None
    modules: dict[str, Module] = {}
    for name, info in ckpt.tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == SCALE_SUFFIX:
            layout = marker["backend"]
        elif suffix == CANONICAL_SCALE_SUFFIX and records.get(name, {}).get("layout") == CANONICAL:
            layout = CANONICAL
        else:
            continue
        weight = ckpt.tensors.get(f"{prefix}.weight")
        if weight is None or len(weight.shape) != 2:
            raise LayoutError(f"{info.file}: {name} has no 2-D weight {prefix}.weight beside it")
        modules[prefix] = Module(prefix, weight.shape[0], weight.shape[1], layout)
    return EngineCheckpoint(root, marker, modules, config_kv_heads(ckpt.config or {}))


def _rank_rows(m: Module, tp: int, num_kv_heads: int | None) -> tuple[int, str | None]:
    """Rows of ``m`` on each rank of ``tp`` (column-parallel), or why they are not whole heads."""
    if m.split != KV_HEADS or not num_kv_heads:
        return (m.n // tp, None) if m.n % tp == 0 else (0, f"N={m.n} does not split in {tp}")
    kv = num_kv_heads
    if m.n % kv:
        return 0, f"N={m.n} is not {kv} whole KV heads"
    if tp >= kv:  # each rank holds one KV head, shared by tp/kv ranks
        return (m.n // kv, None) if tp % kv == 0 else (0, f"{kv} KV heads do not divide over {tp}")
    return (m.n // tp, None) if kv % tp == 0 else (0, f"{kv} KV heads do not split in {tp}")


def _piece_problems(m: Module, n: int, k: int, backend: str) -> list[str]:
    g = grid(m.layout, "weight")
    out = []
    if n % g.row_align:
        out.append(f"{n} rows per rank, not a multiple of {g.row_align}")
    if k % g.col_align:
        out.append(f"K={k} per rank, not a multiple of {g.col_align}")
    if m.layout != CANONICAL:
        out.extend(f"per rank {v}" for v in BACKENDS[backend].violations(n, k))
    return out


def tp_violation(m: Module, tp: int, num_kv_heads: int | None, backend: str) -> str | None:
    """Why ``m`` cannot be sliced for ``tp`` ranks on tile boundaries (``None``: it can).

    Column-parallel modules split their rows (KV projections by whole heads, replicated when the
    heads are fewer than the ranks), row-parallel ones their K; a module whose split is not known
    must slice both ways. Each rank's piece must start on a tile (128 rows, 128 K columns; for a
    canonical module, 32 K columns) and still be a module its backend's kernel takes.
    """
    pieces: list[tuple[int, int]] = []
    if m.split in (COLUMN, KV_HEADS, EITHER):
        rows, why = _rank_rows(m, tp, num_kv_heads)
        if why:
            return why
        pieces.append((rows, m.k))
    if m.split in (ROW, EITHER):
        if m.k % tp:
            return f"K={m.k} does not split in {tp}"
        pieces.append((m.n, m.k // tp))
    problems = [p for n, k in pieces for p in _piece_problems(m, n, k, backend)]
    return "; ".join(problems) or None


def tp_compat(modules, num_kv_heads: int | None, backend: str) -> list[int]:
    """The sizes of :data:`TP_SIZES` at which every module slices (see :func:`tp_violation`)."""
    modules = list(modules)
    return [tp for tp in TP_SIZES
            if all(tp_violation(m, tp, num_kv_heads, backend) is None for m in modules)]


def first_tp_violation(ckpt: EngineCheckpoint, tp: int) -> str | None:
    """One line naming the first module (in name order) that ``tp`` ranks cannot slice."""
    for name in sorted(ckpt.modules):
        m = ckpt.modules[name]
        why = tp_violation(m, tp, ckpt.num_kv_heads, ckpt.backend)
        if why:
            return f"{name} [{m.n}, {m.k}] ({m.split}-parallel, {m.layout}) at tensor parallel {tp}: {why}"
    return None


def check_tp(ckpt: EngineCheckpoint, tp: int) -> None:
    """Refuse a tensor-parallel size the checkpoint does not slice at (one line, first module).

    Raises:
        LayoutError: ``tp`` is not in ``tp_compat``.
    """
    if tp in ckpt.tp_compat:
        return
    why = first_tp_violation(ckpt, tp) or f"{tp} is not one of the sizes checked ({TP_SIZES})"
    raise LayoutError(
        f"{ckpt.path}: tensor parallel {tp} is not in this checkpoint's tp_compat "
        f"{ckpt.tp_compat}: {why}",
        hint="serve it at one of the tp_compat sizes",
    )


def rank_part(rows: int, tp: int, rank: int, replicas: int = 1) -> tuple[int, int]:
    """``(start, size)``, in weight rows, of rank ``rank``'s share of a part of ``rows`` rows.

    ``replicas`` ranks hold the same share (KV heads fewer than ranks: ``tp / num_kv_heads``).
    """
    shards = tp // replicas
    if rows % shards:
        raise LayoutError(f"{rows} rows do not split in {shards}")
    size = rows // shards
    return (rank // replicas) * size, size


def _narrow(t: torch.Tensor, dim: int, start: int, size: int, per: int, align: int, what: str):
    if start % align or size % align:
        raise LayoutError(f"{what}: slice [{start}, {start + size}) of dim {dim} is not on a "
                          f"multiple of {align}", hint="serve it at one of its tp_compat sizes")
    if (start + size) // per > t.shape[dim]:
        raise LayoutError(f"{what}: slice [{start}, {start + size}) is past its {list(t.shape)}")
    return t.narrow(dim, start // per, size // per)


def take_rows(t: torch.Tensor, g: Grid, start: int, size: int, what: str = "tensor") -> torch.Tensor:
    """Weight rows ``[start, start + size)`` of stored tensor ``t`` (a view, no copy)."""
    return _narrow(t, 0, start, size, g.rows, g.row_align, what)


def take_cols(t: torch.Tensor, g: Grid, start: int, size: int, what: str = "tensor") -> torch.Tensor:
    """K columns ``[start, start + size)`` of stored tensor ``t`` (a view, no copy)."""
    return _narrow(t, 1, start, size, g.cols, g.col_align, what)


def place_rows(dest: torch.Tensor, g: Grid, offset: int, src: torch.Tensor, what: str = "tensor") -> None:
    """Copy ``src`` (a stored tensor's rows) into ``dest`` at weight row ``offset``, bytes as they are."""
    part = _narrow(dest, 0, offset, src.shape[0] * g.rows, g.rows, g.row_align, what)
    if part.shape != src.shape or part.dtype != src.dtype:
        raise LayoutError(f"{what}: {src.dtype} {list(src.shape)} does not fit "
                          f"{part.dtype} {list(part.shape)} at row {offset}")
    part.copy_(src)


def engine_for(device, layout: str) -> str:
    """The runtime engine of a layer in ``layout`` on ``device``, chosen once per layer.

    FlashInfer on the SM100 family (the marker's backend), our Triton kernels on Hopper, the
    exact reference on CPU (``MXFP8_CONVERT_ENGINE`` overrides, as in the runtime). A module
    kept canonical runs on Triton where FlashInfer would be chosen (FlashInfer reads only laid
    out bytes).

    Raises:
        BackendUnavailableError / MarkerError: the engine cannot run ``layout`` here.
    """
    from mxfp8_convert.runtime.select import auto_engine, check_engine

    name = auto_engine(device)
    if layout == CANONICAL and name == "flashinfer":
        name = "triton"
    return check_engine(name, device, layout)


def rank_tensors(layout: str, prefix: str, output_partition_sizes: list[int], k: int):
    """The empty per-rank tensors of a linear layer in ``layout``, in their final layout.

    ``output_partition_sizes`` are this rank's row counts of the layer's parts (one, or the
    fused q/k/v or gate/up parts) and ``k`` its K. Returns ``[(name, tensor, grid), ...]`` for
    the weight (``float8_e4m3fn [N_rank, K_rank]``) and the scale (``uint8`` tiles
    ``[N_rank/128, K_rank/128, 512]``, or ``[N_rank, K_rank/32]`` kept canonical), under the
    checkpoint's tensor names.

    Raises:
        LayoutError: a part is not on whole scale tiles (the ``tp_compat`` check is the
            engine's start-up refusal; this is the last guard).
    """
    from mxfp8_convert._lazy import torch

    n = sum(output_partition_sizes)
    g_w, g_s = grid(layout, "weight"), grid(layout, "scale")
    for size in output_partition_sizes:
        if size % g_s.row_align or k % g_s.col_align:
            raise LayoutError(f"{prefix}: per-rank part [{size}, {k}] is not on "
                              f"{g_s.row_align}-row / {g_s.col_align}-column tiles")
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(n // g_s.rows, k // g_s.cols, *([512] if g_s.rows > 1 else []),
                        dtype=torch.uint8)
    suffix = SCALE_SUFFIX if layout != CANONICAL else CANONICAL_SCALE_SUFFIX
    return [("weight", weight, g_w), (suffix, scale, g_s)]


def apply_linear(run, weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` through the layer's engine ``run`` on any leading shape, in ``x``'s
    dtype (the kernels write bf16)."""
    out = run(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
