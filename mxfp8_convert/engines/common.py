"""What an inference-engine plug-in needs from a converted checkpoint, whatever the engine.

Engine-independent; ``engines/vllm.py`` and ``engines/sglang.py`` add only their engine's API:

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
  our Triton kernels on Hopper, the exact reference on CPU;
- :class:`RankParameter`, :class:`LinearMethod`, :class:`QuantConfig`: the plug-in classes,
  mixed into each engine's own base classes (``BasevLLMParameter``, ``LinearMethodBase``,
  ``QuantizationConfig``, which vLLM and SGLang name alike): a rank's parameters, their
  loading, the wrap after loading, ``apply`` and the per-module choice of method;
- :class:`ExpertsMethod` / :func:`expert_tensors`: the same for the per-expert projections of a
  fused-MoE layer (an engine's ``w13`` / ``w2`` parameters, the shard ids w1 / w3 / w2);
- :class:`FusedExpertsMethod` / :func:`fused_tensors`: the same for a fused trtllm MoE block
  (docs/FORMAT.md section 3a): each rank's contiguous rows of every expert's ``w13`` and K of
  its ``w2``, which are themselves the fused layout of the rank's intermediate slice.

This module imports no torch at import time (the converter uses :func:`tp_compat`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import FormatError, LayoutError, MarkerError
from mxfp8_convert.format import (
    CANONICAL_LAYOUT,
    CANONICAL_SUFFIX,
    META_TENSORS,
    MOE_LAYOUT,
    QUANT_METHOD,
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
#: How an engine's fused-MoE layer splits one expert's projections (``...experts.<e>.<leaf>``):
#: gate and up (Mixtral's w1 / w3) by rows into ``w13``, down (w2) by K into ``w2``.
EXPERT_SPLITS = {"w1": COLUMN, "w3": COLUMN, "w2": ROW,  # Mixtral
                 "gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW}  # Qwen2/3-MoE, ...
#: The shard ids an engine's fused-MoE loader passes (vLLM's, SGLang's): -> (parameter, part);
#: part 0 / 1 are the gate / up rows of ``w13``, ``None`` the whole K of ``w2``.
EXPERT_SHARDS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


@dataclass(frozen=True, slots=True)
class Module:
    """One quantized linear module of a checkpoint, as stored: logical ``[n, k]``."""

    name: str
    n: int
    k: int
    layout: str  # the marker's backend ("trtllm"/"cutlass") or "canonical"

    @property
    def split(self) -> str:
        if expert_of(self.name) is not None:
            return EXPERT_SPLITS.get(self.name.rpartition(".")[2], EITHER)
        return SPLITS.get(self.name.rpartition(".")[2], EITHER)


def expert_of(name: str) -> tuple[str, int] | None:
    """``(experts prefix, expert index)`` of a per-expert projection ``<prefix>.<e>.<leaf>``
    whose prefix ends in ``experts`` (``model.layers.0.mlp.experts.3.down_proj``), else ``None``."""
    head, _, _leaf = name.rpartition(".")
    prefix, _, index = head.rpartition(".")
    if index.isdigit() and prefix.rpartition(".")[2] == "experts":
        return prefix, int(index)
    return None


@dataclass(frozen=True, slots=True)
class FusedBlock:
    """One fused trtllm MoE block of a checkpoint (docs/FORMAT.md section 3a), as stored.

    ``tensors``: role (``moe_fc1_weight``, ...) -> the name suffix of its tensor (the marker's).
    A rank of ``tp`` holds every expert's intermediate rows ``[r*I/tp, (r+1)*I/tp)``: the
    contiguous rows ``[2r*I/tp, 2(r+1)*I/tp)`` of ``w13`` (and their scale tiles) and the K
    columns ``[r*I/tp, (r+1)*I/tp)`` of ``w2`` (and their tile columns).
    """

    name: str  # e.g. model.layers.0.block_sparse_moe.experts
    experts: int
    hidden: int
    inter: int
    tensors: dict[str, str]


def block_tp_violation(b: FusedBlock, tp: int) -> str | None:
    """Why fused block ``b`` cannot be sliced for ``tp`` ranks on tile boundaries (``None``: it
    can): each rank's I must be a fused block itself (a multiple of 128: 2I/tp rows of ``w13``
    in whole P32 groups and scale tiles, I/tp K columns of ``w2`` in whole tiles)."""
    from mxfp8_convert.layouts.moe import MOE_ALIGN

    if b.inter % tp:
        return f"I={b.inter} does not split in {tp}"
    if (b.inter // tp) % MOE_ALIGN:
        return f"I={b.inter // tp} per rank, not a multiple of {MOE_ALIGN}"
    return None


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
        blocks: fused MoE blocks by name (the marker's ``moe.layers``, shapes from the headers).
    """

    path: Path
    marker: dict
    modules: dict[str, Module]
    num_kv_heads: int | None
    blocks: dict[str, FusedBlock] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return self.marker["backend"]

    @property
    def tp_compat(self) -> list[int]:
        """The marker's ``tp_compat`` (computed from the headers for a version-1 marker), less
        the sizes a fused block does not slice at (a marker written before blocks counted)."""
        sizes = self.marker.get("tp_compat")
        if sizes is None:
            return tp_compat(self.modules.values(), self.num_kv_heads, self.backend,
                             self.blocks.values())
        return [tp for tp in sizes
                if all(block_tp_violation(b, tp) is None for b in self.blocks.values())]


def config_kv_heads(config: dict) -> int | None:
    """The config's ``num_key_value_heads`` (its ``text_config``'s for a multimodal one)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    kv = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    return kv if isinstance(kv, int) and kv > 0 else None


def check_marker(marker: dict, where: str, fused: bool = False) -> dict:
    """Check a ``quantization_config`` dict with the runtime's marker rules; refuse fused MoE
    blocks unless the engine's plug-in serves them (``fused``).

    Raises:
        MarkerError: not our marker, unknown ``format_version``, layout names that do not match.
        FormatError: the checkpoint holds fused MoE blocks and ``fused`` is off.
    """
    parsed = Marker.parse(marker, where)
    if parsed.moe is not None and not fused:
        first = (parsed.moe.layers or ("?",))[0]
        raise FormatError(
            f"{where}: fused MoE blocks ({first}, ...) are not served by this engine's "
            "mxfp8_convert plug-in yet",
            hint="serve it with vLLM or mxfp8_convert.runtime",
        )
    return marker


def read_blocks(ckpt, marker: dict, where: str) -> dict[str, FusedBlock]:
    """The fused MoE blocks the marker lists, each checked against the shard headers
    (``ckpt``: the folder's ``open_checkpoint``).

    Raises:
        LayoutError: a block's tensor missing, or a dtype or shape that does not fit the others.
    """
    from mxfp8_convert.plan.moe import fused_moe_shape

    moe = Marker.parse(marker, where).moe
    if moe is None:
        return {}
    names = moe.tensor_names()
    out = {}
    for block in moe.layers:
        found = {role: ckpt.tensors.get(f"{block}.{suffix}") for role, suffix in names.items()}
        e, h, i = fused_moe_shape(block, found)
        out[block] = FusedBlock(block, e, h, i, names)
    return out


def read_checkpoint(path: str | Path, fused: bool = False) -> EngineCheckpoint:
    """Check a converted folder as the runtime does and list its quantized modules and fused
    MoE blocks (headers only); ``fused``: the engine's plug-in serves fused blocks.

    Raises:
        SourceError / MarkerError / FormatError / LayoutError: one line naming the file or module.
    """
    from mxfp8_convert.read import open_checkpoint
    from mxfp8_convert.runtime.load import read_marker

    root = Path(path)
    marker = check_marker(read_marker(root), f"{root}/config.json", fused=fused)
    ckpt = open_checkpoint(root)
    records: dict[str, dict] = {}
    for header in ckpt.shards.values():
        try:
            records.update(json.loads(header.metadata.get(META_TENSORS, "{}")))
        except ValueError:
            raise LayoutError(
                f"{root / header.relpath}: unreadable {META_TENSORS} metadata") from None
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
    return EngineCheckpoint(root, marker, modules, config_kv_heads(ckpt.config or {}),
                            read_blocks(ckpt, marker, f"{root}/config.json"))


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


def tp_compat(modules, num_kv_heads: int | None, backend: str, blocks=()) -> list[int]:
    """The sizes of :data:`TP_SIZES` at which every module and fused MoE block slices (see
    :func:`tp_violation`, :func:`block_tp_violation`)."""
    modules, blocks = list(modules), list(blocks)
    return [tp for tp in TP_SIZES
            if all(tp_violation(m, tp, num_kv_heads, backend) is None for m in modules)
            and all(block_tp_violation(b, tp) is None for b in blocks)]


def first_tp_violation(ckpt: EngineCheckpoint, tp: int) -> str | None:
    """One line naming the first module or fused MoE block (in name order) that ``tp`` ranks
    cannot slice."""
    for name in sorted({*ckpt.modules, *ckpt.blocks}):
        if name in ckpt.blocks:
            b = ckpt.blocks[name]
            why = block_tp_violation(b, tp)
            if why:
                return (f"{name} fused MoE block (E={b.experts}, H={b.hidden}, I={b.inter}, "
                        f"{MOE_LAYOUT}) at tensor parallel {tp}: {why}")
            continue
        m = ckpt.modules[name]
        why = tp_violation(m, tp, ckpt.num_kv_heads, ckpt.backend)
        if why:
            return (f"{name} [{m.n}, {m.k}] ({m.split}-parallel, {m.layout}) "
                    f"at tensor parallel {tp}: {why}")
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


def take_rows(t: torch.Tensor, g: Grid, start: int, size: int,
              what: str = "tensor") -> torch.Tensor:
    """Weight rows ``[start, start + size)`` of stored tensor ``t`` (a view, no copy)."""
    return _narrow(t, 0, start, size, g.rows, g.row_align, what)


def take_cols(t: torch.Tensor, g: Grid, start: int, size: int,
              what: str = "tensor") -> torch.Tensor:
    """K columns ``[start, start + size)`` of stored tensor ``t`` (a view, no copy)."""
    return _narrow(t, 1, start, size, g.cols, g.col_align, what)


def rank_share(t: torch.Tensor, g: Grid, axis: int, index: int, size: int, shares: int | None,
               what: str = "tensor") -> torch.Tensor:
    """Share ``index`` of ``size`` weight rows (``axis`` 0) or K columns (``axis`` 1) of stored
    tensor ``t``, which must hold ``shares`` such shares (not checked when ``None``): a view.

    Raises:
        LayoutError: ``t`` is not ``shares`` shares of ``size``, or the share is off its tiles.
    """
    per = g.rows if axis == 0 else g.cols
    stored = t.shape[axis] * per
    if shares is not None and stored != shares * size:
        kind = f"a stored part of {stored} rows" if axis == 0 else f"K={stored} stored"
        unit = f"the {size} rows" if axis == 0 else f"the K={size}"
        raise LayoutError(f"{what}: {kind} is not {shares} shares of {unit} per rank the "
                          "engine expects")
    return (take_rows if axis == 0 else take_cols)(t, g, index * size, size, what)


def place_rows(dest: torch.Tensor, g: Grid, offset: int, src: torch.Tensor,
               what: str = "tensor") -> None:
    """Copy ``src`` (a stored tensor's rows) into ``dest`` at weight row ``offset``, bytes as
    they are."""
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


# --- The plug-in classes both engines share ------------------------------------------------------
# vLLM's and SGLang's linear layers have the same hooks (SGLang's are adapted from vLLM's): each
# adapter mixes these classes into its engine's base classes and states only what differs (its
# imports, how it learns the TP size, its FlashInfer route, how it hands over the marker).

#: Capability x10 the engines check before loading: our Triton engine needs SM90, FlashInfer's
#: trtllm/cutlass the SM100 family (checked per layer when it is chosen); CPU has none.
MIN_CAPABILITY = 90


class RankParameter:
    """A rank's weight or scale tiles, mixed into the engine's ``BasevLLMParameter``.

    The engine's layer hands each ``load_*`` the whole stored tensor (one module, or one q/k/v or
    gate/up part of a fused parameter); the parameter copies the rank's slice in on tile
    boundaries (:class:`Grid` ``grid``), bytes as stored. vLLM passes only the tensor and the
    part's per-rank ``shard_offset`` / ``shard_size`` (rank and TP size are the layer's, given at
    creation); SGLang adds ``tp_rank`` and ``use_presharded_weights`` (the tensor is already this
    rank's) and keeps no TP size on its layers (``tp_size`` ``None``: a stored part is then
    checked against its tiles and bounds, not against the count of ranks). Every load records
    the weight rows it filled (:meth:`check_loaded`); ``counts``: the parameter whose tally an
    alias of it (the same storage under another name) adds to.
    """

    def __init__(self, data, weight_loader, grid: Grid, name: str, tp_rank: int | None,
                 tp_size: int | None, counts: RankParameter | None = None):
        super().__init__(data=data, weight_loader=weight_loader)
        self.grid = grid
        self.what = name
        self.tp_rank, self.tp_size = tp_rank, tp_size  # the layer's (vLLM sets the global ones)
        self.rows_loaded = 0
        self.counts = self if counts is None else counts

    @property
    def output_dim(self) -> int:
        """Asked by the engines' loaders only for a module fused on disk: refused."""
        raise LayoutError(f"{self.what}: a module fused on disk (no q/k/v or gate/up shard id) "
                          "is not supported by the mxfp8_convert plug-in")

    def _place(self, src: torch.Tensor, offset: int) -> None:
        place_rows(self.data, self.grid, offset, src, self.what)
        self.counts.rows_loaded += src.shape[0] * self.grid.rows

    def _load_rows(self, loaded: torch.Tensor, offset: int, size: int, index: int,
                   shares: int | None, presharded: bool) -> None:
        """Rows ``[index * size, (index + 1) * size)`` of ``loaded`` (a stored tensor of ``shares``
        such shares; all of it if ``presharded``) into this parameter's rows from ``offset``."""
        if not presharded:
            loaded = rank_share(loaded, self.grid, 0, index, size, shares, self.what)
        self._place(loaded, offset)

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor, tp_rank: int | None = None,
                                    use_presharded_weights: bool = False) -> None:
        """A column-parallel module: the rank's rows."""
        rank = self.tp_rank if tp_rank is None else tp_rank
        self._load_rows(loaded_weight, 0, self.data.shape[0] * self.grid.rows, rank,
                        self.tp_size, use_presharded_weights)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor, tp_rank: int | None = None,
                                 use_presharded_weights: bool = False) -> None:
        """A row-parallel module: the rank's K columns."""
        rank = self.tp_rank if tp_rank is None else tp_rank
        size = self.data.shape[1] * self.grid.cols
        if not use_presharded_weights:
            loaded_weight = rank_share(loaded_weight, self.grid, 1, rank, size, self.tp_size,
                                       self.what)
        self._place(loaded_weight, 0)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kw) -> None:
        """``gate_up_proj`` part ``shard_id`` (0/1) at its per-rank ``shard_offset``."""
        rank = kw.get("tp_rank", self.tp_rank)
        self._load_rows(loaded_weight, kw["shard_offset"], kw["shard_size"], rank, self.tp_size,
                        kw.get("use_presharded_weights", False))

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kw) -> None:
        """``qkv_proj`` part q/k/v; ``num_heads`` ranks share a KV head when they outnumber them."""
        rank = kw.get("tp_rank", self.tp_rank)
        replicas = 1 if kw["shard_id"] == "q" else kw["num_heads"]
        shares = None if self.tp_size is None else self.tp_size // replicas
        self._load_rows(loaded_weight, kw["shard_offset"], kw["shard_size"], rank // replicas,
                        shares, kw.get("use_presharded_weights", False))

    def check_loaded(self) -> None:
        """Refuse a parameter the loads did not fill (a name the model's loader did not map).

        Raises:
            LayoutError: fewer (or more) weight rows were loaded than the parameter holds.
        """
        rows = self.data.shape[0] * self.grid.rows
        if self.rows_loaded != rows:
            raise LayoutError(f"{self.what}: {self.rows_loaded} of its {rows} rows were loaded "
                              "from the checkpoint", hint="is the tensor missing or misnamed?")


def engine_run(name: str, flashinfer=None):
    """``run(x2d, weight, bias)`` of runtime engine ``name``; for ``"flashinfer"``, the engine's
    own FlashInfer MXFP8 route where it has one (``flashinfer``), else the runtime's."""
    if name == "flashinfer" and flashinfer is not None:
        return flashinfer
    from mxfp8_convert.runtime.select import ENGINES

    return ENGINES[name].run


class LinearMethod:
    """A linear layer of a converted checkpoint, laid out (trtllm/cutlass) or kept canonical;
    mixed into the engine's ``LinearMethodBase``.

    The adapter sets :attr:`parameter` (its :class:`RankParameter` class), :attr:`check_loads`
    (whether its loader leaves a misnamed tensor's parameter unfilled without a word),
    :attr:`scale_aliases` (the names the engine's model loaders may rename a stored scale to:
    the scale is registered under those too, the same storage) and :meth:`flashinfer_route`,
    :meth:`layer_tp`. Nothing is re-laid-out: the rank's parameters are created in their final
    layout (:func:`rank_tensors`), and after loading wrapped, without a copy, in the runtime's
    ``MXFP8Weight``.
    """

    parameter: type
    check_loads = False
    scale_aliases: dict[str, tuple[str, ...]] = {}

    def __init__(self, config, layout: str, prefix: str):
        self.config = config
        self.layout = layout
        self.prefix = prefix

    @staticmethod
    def flashinfer_route():
        """The engine's own FlashInfer MXFP8 linear (``run(x2d, weight, bias)``), or ``None``."""
        return None

    @staticmethod
    def layer_tp(layer) -> tuple[int | None, int | None]:
        """The layer's tensor-parallel rank and size (vLLM's layers keep both)."""
        return layer.tp_rank, layer.tp_size

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        """Per-rank parameters in their final layout, under the checkpoint's tensor names."""
        loader = extra_weight_attrs["weight_loader"]
        tensors = rank_tensors(self.layout, self.prefix, output_partition_sizes,
                               input_size_per_partition)
        rank, ranks = self.layer_tp(layer)
        for name, data, g in tensors:
            param = self.parameter(data=data, weight_loader=loader, grid=g,
                                   name=f"{self.prefix}.{name}", tp_rank=rank, tp_size=ranks)
            layer.register_parameter(name, param)
            for alias in self.scale_aliases.get(name, ()):
                layer.register_parameter(alias, self.parameter(
                    data=data, weight_loader=loader, grid=g, name=f"{self.prefix}.{alias}",
                    tp_rank=rank, tp_size=ranks, counts=param))
        layer.mxfp8_scale_name = tensors[1][0]

    def process_weights_after_loading(self, layer) -> None:
        """No copy, no re-layout: the runtime's weight type over the loaded parameters' storage."""
        from mxfp8_convert.runtime.weight import MXFP8Weight

        scale = getattr(layer, layer.mxfp8_scale_name)
        if self.check_loads:
            layer.weight.check_loaded()
            scale.check_loaded()
        layer.mxfp8_weight = MXFP8Weight(layer.weight.data, scale.data, self.layout, self.prefix)
        layer.mxfp8_engine = engine_for(layer.weight.device, self.layout)
        route = self.flashinfer_route() if layer.mxfp8_engine == "flashinfer" else None
        layer.mxfp8_run = engine_run(layer.mxfp8_engine, route)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_linear(layer.mxfp8_run, layer.mxfp8_weight, x, bias)


def expert_tensors(layout: str, prefix: str, experts: int, hidden: int, inter: int):
    """The empty per-rank tensors of a fused-MoE layer's experts in ``layout``, final layout.

    ``inter`` is this rank's I of each expert. Returns ``[(name, tensor, grid), ...]``:
    ``w13_weight`` e4m3 ``[E, 2I, H]`` (each expert's gate rows, then its up rows),
    ``w2_weight`` ``[E, H, I]`` and their scales beside them (``w13_<scale suffix>``: tiles
    ``[E, 2I/128, H/128, 512]``, or ``[E, 2I, H/32]`` kept canonical; ``w2_...`` likewise), each
    expert's slab what :func:`rank_tensors` makes for one linear of those parts.

    Raises:
        LayoutError: a part is not on whole scale tiles.
    """
    from mxfp8_convert._lazy import torch

    out = []
    for stem, parts, k in (("w13", [inter, inter], hidden), ("w2", [hidden], inter)):
        for name, t, g in rank_tensors(layout, f"{prefix}.{stem}", parts, k):
            out.append((f"{stem}_{name}", torch.zeros(experts, *t.shape, dtype=t.dtype), g))
    return out


class ExpertsMethod:
    """The per-expert MXFP8 projections of one fused-MoE layer (a checkpoint converted for
    cutlass, or for trtllm with ``--moe keep``), mixed into the engine's MoE method base.

    Each rank holds, per expert, its rows of gate and up (``w13``, column-parallel) and its K of
    down (``w2``, row-parallel), created in their final layout (:func:`expert_tensors`) and filled
    by :meth:`load_expert` with the rank's slice of each stored projection on tile boundaries,
    bytes as stored. After loading, every expert's three projections are wrapped without a copy
    in the runtime's ``MXFP8Weight`` and run by its ``MXFP8Experts`` (the same code
    ``load_into`` puts in a transformers model): ``down(bf16(silu(gate(x)) * up(x)))``, the
    routing weights applied to each expert's output; routing is the engine's.

    The adapter gives :meth:`layer_tp` (the layer's TP rank and size). Both engines' fused-MoE
    layers map a checkpoint's expert index to the rank's local one with
    ``_map_global_expert_id_to_local_expert_id`` (``-1``: not on this rank), which
    :meth:`register`'s loaders use.
    """

    def __init__(self, config, layout: str, prefix: str):
        self.config = config
        self.layout = layout
        self.prefix = prefix
        self.loaded: dict[str, set] = {}
        self.experts = None

    @staticmethod
    def layer_tp(layer) -> tuple[int, int]:
        raise NotImplementedError

    def register(self, layer, tensors) -> None:
        """Register ``tensors`` (:func:`expert_tensors`) on ``layer`` as plain parameters whose
        ``weight_loader`` (called by the engine's model loaders with the shard ids w1 / w3 / w2
        and the checkpoint's expert index) is :meth:`load_expert`'s, replacing the engine's,
        which would narrow the tiles as weight rows."""
        from mxfp8_convert._lazy import torch

        for name, data, _ in tensors:
            param = torch.nn.Parameter(data, requires_grad=False)
            param.weight_loader = self._loader(layer, name)
            layer.register_parameter(name, param)

    def _loader(self, layer, name: str):
        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id,
                          return_success=False):
            local = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if local != -1:
                self.load_expert(layer, param, loaded_weight, name, shard_id, local)
            return (local != -1) if return_success else None

        return weight_loader

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype, **extra):
        tensors = expert_tensors(self.layout, self.prefix, num_experts, hidden_size,
                                 intermediate_size_per_partition)
        layer.mxfp8_grids = {name: g for name, _, g in tensors}
        layer.mxfp8_scale_suffix = tensors[1][0].partition("_")[2]
        self.register(layer, tensors)

    def load_expert(self, layer, param, loaded: torch.Tensor, name: str, shard_id: str,
                    expert: int) -> None:
        """Stored projection ``shard_id`` (w1 gate / w3 up / w2 down) of local expert ``expert``
        into parameter ``name`` of ``layer``: the rank's rows of gate / up at the part's offset
        in ``w13``, the rank's K of down."""
        if shard_id not in EXPERT_SHARDS:
            raise LayoutError(f"{self.prefix}: unknown expert shard id {shard_id!r}")
        stem, part = EXPERT_SHARDS[shard_id]
        g = layer.mxfp8_grids[name]
        what = f"{self.prefix}.{expert}.{shard_id} ({name})"
        rank, ranks = self.layer_tp(layer)
        dest = param.data[expert]
        if loaded.dim() != dest.dim():
            raise LayoutError(f"{what}: stored {list(loaded.shape)} is not one expert's "
                              f"projection (the rank holds {list(dest.shape)})")
        if part is None:  # down: the rank's K
            size = dest.shape[1] * g.cols
            place_rows(dest, g, 0, rank_share(loaded, g, 1, rank, size, ranks, what), what)
        else:  # gate / up: the rank's rows, at the part's offset
            size = dest.shape[0] * g.rows // 2
            place_rows(dest, g, part * size, rank_share(loaded, g, 0, rank, size, ranks, what),
                       what)
        self.loaded.setdefault(name, set()).add((expert, shard_id))

    def check_loaded(self, layer) -> None:
        """Refuse experts the loads did not fill (a stored projection missing or misnamed).

        Raises:
            LayoutError: names the first parameter and expert left unfilled.
        """
        for name in layer.mxfp8_grids:
            experts = getattr(layer, name).shape[0]
            shards = ("w2",) if name.startswith("w2_") else ("w1", "w3")
            done = self.loaded.get(name, set())
            missing = [(e, s) for e in range(experts) for s in shards if (e, s) not in done]
            if missing:
                e, s = missing[0]
                raise LayoutError(f"{self.prefix}: {name} of expert {e} ({s}) was not loaded "
                                  f"from the checkpoint ({len(missing)} parts missing)",
                                  hint="is the tensor missing or misnamed?")

    def process_weights_after_loading(self, layer) -> None:
        """No copy, no re-layout: each expert's gate, up and down as the runtime's
        ``MXFP8Weight`` over views of the loaded parameters, run by ``MXFP8Experts``."""
        from mxfp8_convert.runtime.experts import MXFP8Experts
        from mxfp8_convert.runtime.weight import MXFP8Weight

        self.check_loaded(layer)
        suffix = layer.mxfp8_scale_suffix
        w13, s13 = layer.w13_weight.data, getattr(layer, f"w13_{suffix}").data
        w2, s2 = layer.w2_weight.data, getattr(layer, f"w2_{suffix}").data
        rows = layer.mxfp8_grids[f"w13_{suffix}"].rows
        inter = w13.shape[1] // 2
        weights = {}
        for e in range(w13.shape[0]):
            for role, (lo, hi) in (("gate", (0, inter)), ("up", (inter, 2 * inter))):
                weights[(e, role)] = MXFP8Weight(w13[e, lo:hi], s13[e, lo // rows:hi // rows],
                                                 self.layout, f"{self.prefix}.{e}.{role}")
            weights[(e, "down")] = MXFP8Weight(w2[e], s2[e], self.layout,
                                               f"{self.prefix}.{e}.down")
        engine = engine_for(w13.device, self.layout)
        self.experts = MXFP8Experts.per_expert(self.prefix, weights, engine=engine)

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` on this rank's share, in ``x``'s dtype
        (the engine reduces the ranks' partial sums)."""
        return self.experts(x, topk_ids, topk_weights)


#: role of a fused block's tensor -> (dim a rank's share is cut along, weight rows or K columns
#: per index of that dim): w13 by its rows (dim 1; tiles of 128 rows for the scale), w2 by K
#: (dim 2; tiles of 128 K columns for the scale).
FUSED_SHARES = {"moe_fc1_weight": (1, 1), "moe_fc1_scale": (1, TILE),
                "moe_fc2_weight": (2, 1), "moe_fc2_scale": (2, TILE)}


def fused_tensors(block: FusedBlock, inter: int):
    """The empty per-rank tensors of fused block ``block`` in their final layout, this rank's I
    ``inter``: ``[(role, name, tensor), ...]`` under the checkpoint's tensor names (the
    marker's ``moe.tensors``): ``w13_weight`` e4m3 ``[E, 2I, H]``, its scale tiles
    ``[E, 2I/128, H/128, 512]``, ``w2_weight`` ``[E, H, I]``, its tiles ``[E, H/128, I/128, 512]``.

    Raises:
        LayoutError: ``inter`` is not a fused block's I (a multiple of 128).
    """
    from mxfp8_convert._lazy import torch
    from mxfp8_convert.layouts.moe import (
        moe_fc1_scale_shape,
        moe_fc1_weight_shape,
        moe_fc2_scale_shape,
        moe_fc2_weight_shape,
    )

    e, h = block.experts, block.hidden
    f8, u8 = torch.float8_e4m3fn, torch.uint8
    shapes = {"moe_fc1_weight": (moe_fc1_weight_shape, f8),
              "moe_fc1_scale": (moe_fc1_scale_shape, u8),
              "moe_fc2_weight": (moe_fc2_weight_shape, f8),
              "moe_fc2_scale": (moe_fc2_scale_shape, u8)}
    try:
        return [(role, block.tensors[role], torch.zeros(shape(h, inter, e), dtype=dtype))
                for role, (shape, dtype) in shapes.items()]
    except LayoutError as err:
        raise LayoutError(f"{block.name}: per-rank I={inter}: {err}") from None


def fused_share(stored: torch.Tensor, dest: torch.Tensor, role: str, rank: int, ranks: int,
                what: str) -> torch.Tensor:
    """Rank ``rank``'s share of a stored fused-block tensor of ``role`` (all experts): the
    contiguous slice of :data:`FUSED_SHARES`'s dim that ``dest`` (the rank's parameter) holds, a
    view; the stored tensor must be ``ranks`` such shares and agree with ``dest`` elsewhere.

    Raises:
        LayoutError: the stored tensor is not ``ranks`` shares of ``dest``.
    """
    dim, _ = FUSED_SHARES[role]
    want = list(dest.shape)
    want[dim] *= ranks
    if list(stored.shape) != want or stored.element_size() != 1:
        raise LayoutError(f"{what}: stored {stored.dtype} {list(stored.shape)} is not {ranks} "
                          f"shares of the rank's {dest.dtype} {list(dest.shape)}")
    size = dest.shape[dim]
    return stored.narrow(dim, rank * size, size)


class FusedExpertsMethod:
    """A fused trtllm MoE block of a checkpoint (docs/FORMAT.md section 3a), mixed into the
    engine's MoE method base.

    Each rank holds every expert's intermediate rows ``[r*I/R, (r+1)*I/R)``: the contiguous rows
    ``[2r*I/R, 2(r+1)*I/R)`` of each expert's stored ``w13`` (cat([up, gate]) interleaved then
    P32 moves rows only within 32-row groups, and group ``b`` holds rows ``16b .. 16b+15`` of
    both halves, so that block is the fused layout of the rank's I/R rows of up and gate) with
    their scale tiles, and the K columns ``[r*I/R, (r+1)*I/R)`` of each expert's ``w2`` with
    their tile columns. The parameters are created in that final layout (:func:`fused_tensors`)
    and filled by :meth:`load_fused` with the rank's slice of each stored tensor, bytes as
    stored. After loading they are wrapped without a copy in the runtime's ``MXFP8MoEWeights``
    and run by its fused ``MXFP8Experts`` (the code ``load_into`` uses: FlashInfer's trtllm-gen
    MoE on the SM100 family, Triton on Hopper, the exact reference on CPU); routing is the
    engine's.

    The adapter gives :meth:`layer_tp` (the layer's TP rank and size) and :meth:`register`.
    """

    def __init__(self, config, block: FusedBlock, prefix: str):
        self.config = config
        self.block = block
        self.prefix = prefix
        self.loaded: set[str] = set()
        self.experts = None

    @staticmethod
    def layer_tp(layer) -> tuple[int, int]:
        raise NotImplementedError

    def register(self, layer, tensors) -> None:
        """Register ``tensors`` (``[(name, tensor), ...]``) on ``layer`` as the engine's
        parameters, each filled by :meth:`load_fused` from the stored tensor of that name."""
        raise NotImplementedError

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype, **extra):
        b = self.block
        if (num_experts, hidden_size) != (b.experts, b.hidden):
            raise LayoutError(f"{self.prefix}: the engine's layer has E={num_experts}, "
                              f"H={hidden_size}; the stored block E={b.experts}, H={b.hidden}")
        tensors = fused_tensors(b, intermediate_size_per_partition)
        layer.mxfp8_roles = {name: role for role, name, _ in tensors}
        self.register(layer, [(name, t) for _, name, t in tensors])

    def load_fused(self, layer, name: str, loaded: torch.Tensor) -> None:
        """Stored tensor ``name`` of the block (all experts) into the layer's parameter of that
        name: the rank's share (:func:`fused_share`), bytes as stored."""
        from mxfp8_convert._lazy import torch

        dest = getattr(layer, name).data
        rank, ranks = self.layer_tp(layer)
        what = f"{self.prefix}.{name}"
        src = fused_share(loaded, dest, layer.mxfp8_roles[name], rank, ranks, what)
        dest.view(torch.uint8).copy_(src.view(torch.uint8))
        self.loaded.add(name)

    def check_loaded(self, layer) -> None:
        """Refuse a parameter the loads did not fill (a stored tensor missing or misnamed).

        Raises:
            LayoutError: names the first parameter left unfilled.
        """
        missing = [n for n in layer.mxfp8_roles if n not in self.loaded]
        if missing:
            raise LayoutError(f"{self.prefix}: {missing[0]} was not loaded from the checkpoint",
                              hint="is the tensor missing or misnamed?")

    def process_weights_after_loading(self, layer) -> None:
        """No copy, no re-layout: the loaded parameters as the runtime's ``MXFP8MoEWeights``,
        run by its fused ``MXFP8Experts``."""
        from mxfp8_convert.runtime.experts import MXFP8Experts
        from mxfp8_convert.runtime.moe import MXFP8MoEWeights

        self.check_loaded(layer)
        by_role = {role: getattr(layer, name).data for name, role in layer.mxfp8_roles.items()}
        w13 = by_role["moe_fc1_weight"]
        weights = MXFP8MoEWeights(w13, by_role["moe_fc1_scale"], by_role["moe_fc2_weight"],
                                  by_role["moe_fc2_scale"], self.block.hidden,
                                  w13.shape[1] // 2, self.prefix)
        self.experts = MXFP8Experts.fused(weights, engine=engine_for(w13.device, "trtllm"))

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` on this rank's share, in ``x``'s dtype
        (the engine reduces the ranks' partial sums)."""
        return self.experts(x, topk_ids, topk_weights)


class QuantConfig:
    """``quant_method: "mxfp8_convert"``: a checkpoint written by mxfp8-convert (docs/FORMAT.md);
    mixed into the engine's ``QuantizationConfig``.

    The adapter sets :attr:`linear_base` (the engine's ``LinearBase``), :attr:`linear_method`
    and :attr:`unquantized` (its method classes), and where it serves MoE
    :attr:`experts_base` (its fused-MoE layer class), :attr:`experts_method` (our
    :class:`ExpertsMethod` for per-expert projections) and :attr:`fused_experts_method` (fused
    trtllm blocks); it gives :meth:`tp_size` and :meth:`experts_refusal` and fills
    :attr:`checkpoint` (:func:`read_checkpoint` of the model folder) when the engine says where
    the folder is. ``packed_modules_mapping`` is the engine's (set by it per model).
    """

    linear_base: type
    linear_method: type
    unquantized: type
    experts_base: type | None = None
    experts_method: type | None = None
    fused_experts_method: type | None = None
    checkpoint: EngineCheckpoint | None = None
    _tp_checked: int | None = None

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list:
        from mxfp8_convert._lazy import torch

        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @staticmethod
    def tp_size() -> int:
        """The engine's tensor-parallel size of this process."""
        raise NotImplementedError

    def engine_checkpoint(self) -> EngineCheckpoint:
        if self.checkpoint is None:
            raise MarkerError("the mxfp8_convert plug-in needs a local checkpoint folder as the "
                              "model", hint="pass the converted folder as the model")
        return self.checkpoint

    def layout_of(self, prefix: str) -> str | None:
        """The layout of module ``prefix`` (or of all the parts the engine fused into it);
        ``None``: not quantized (ignored, ``lm_head``, ...)."""
        modules = self.engine_checkpoint().modules
        if prefix in modules:
            return modules[prefix].layout
        base, _, leaf = prefix.rpartition(".")
        packed = getattr(self, "packed_modules_mapping", None) or {}
        parts = packed.get(leaf) or FUSED.get(leaf) or [leaf]
        names = [f"{base}.{p}" if base else p for p in parts]
        found = {modules[n].layout if n in modules else None for n in names}
        if len(found) > 1:
            raise LayoutError(f"{prefix}: its parts {', '.join(names)} are stored in different "
                              "layouts (or some unquantized)")
        return found.pop()

    @staticmethod
    def experts_refusal(layer) -> str | None:
        """Why the engine's fused-MoE ``layer`` cannot be served (expert parallelism), or None."""
        return None

    def experts_layout(self, prefix: str) -> str | None:
        """The layout of the per-expert projections ``<prefix>.<e>.<leaf>`` of a fused-MoE layer;
        ``None``: its experts are not quantized."""
        found = {m.layout for name, m in self.engine_checkpoint().modules.items()
                 if (expert_of(name) or ("",))[0] == prefix}
        if len(found) > 1:
            raise LayoutError(f"{prefix}: its experts are stored in different layouts "
                              f"({', '.join(sorted(found))})")
        return found.pop() if found else None

    def _check_tp(self) -> None:
        """Once per TP size: the checkpoint's ``tp_compat`` (fused blocks are refused by
        :func:`check_marker` for an engine without :attr:`fused_experts_method`)."""
        tp = self.tp_size()
        if self._tp_checked != tp:
            check_tp(self.engine_checkpoint(), tp)
            self._tp_checked = tp

    def get_quant_method(self, layer, prefix: str):
        """Our method for a quantized linear layer or fused-MoE layer's experts (per-expert
        projections, or a fused block; the TP size checked once against ``tp_compat``), the
        engine's unquantized one for a linear layer kept unquantized, ``None`` (the engine's
        own) for anything else."""
        if self.experts_base is not None and isinstance(layer, self.experts_base):
            self._check_tp()
            block = self.engine_checkpoint().blocks.get(prefix)
            layout = None if block is not None else self.experts_layout(prefix)
            if block is None and layout is None:
                return None
            why = self.experts_refusal(layer)
            if why:
                raise LayoutError(f"{prefix}: {why}", hint="serve it at tensor parallel only")
            if block is not None:
                return self.fused_experts_method(self, block, prefix, layer)
            return self.experts_method(self, layout, prefix, layer)
        if not isinstance(layer, self.linear_base):
            return None
        self._check_tp()
        layout = self.layout_of(prefix)
        if layout is None:
            return self.unquantized()
        return self.linear_method(self, layout, prefix)
