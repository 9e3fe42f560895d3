"""The bytes of one tensor plan, produced from views of the source. No disk, no rich, no
flashinfer.

``ShardTransform`` produces an output shard's tensors one after the other and hands their bytes
to a sink (``write.ShardWriter``): unchanged bytes straight from the source mapping, P32 rows
from it too, with the shuffle for the sink to do block by block in its one pass, fused MoE
tensors expert by expert (``_fused``), and modules whose canonical bytes must be computed
(laid-out, FP8 and dense sources) one module at a time. The weight is laid out in row chunks
(P32 moves rows only within 32-row blocks, so any chunk of a multiple of 32 rows is laid out on
its own), which keeps memory bounded by the chunk, not the tensor. Scales are ~1/32 of the
weight and are laid out whole. The functions below it are the per-module math, also used by
``verify``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import xxhash

from mxfp8_convert._buffers import SCRATCH, BufferPool
from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.backends import BACKENDS, BackendSpec
from mxfp8_convert.dtypes import torch_dtype
from mxfp8_convert.errors import LayoutError
from mxfp8_convert.format import CANONICAL_LAYOUT, LAYOUTS
from mxfp8_convert.layouts import p32_shuffle_rows, p32_shuffle_rows_array
from mxfp8_convert.layouts.moe import (
    moe_fc1_rows_array,
    moe_fc1_scale_from_canonical_array,
    moe_fc1_scale_to_canonical,
    moe_fc1_weight_to_canonical,
    moe_fc2_scale_from_canonical_array,
    moe_fc2_scale_to_canonical,
    moe_fc2_weight_to_canonical,
)
from mxfp8_convert.layouts.rows import P32_BLOCK
from mxfp8_convert.plan import ModulePlan, MoELayerPlan, TensorPlan
from mxfp8_convert.read import ShardReader, TensorInfo, chunk_ranges, find_bytes

if TYPE_CHECKING:
    from mxfp8_convert.quantize import QuantError

#: bytes read, laid out and queued at a time
CHUNK_BYTES = 32 << 20
#: chunks queued for the writer thread while the next one is read and laid out
PIPELINE_DEPTH = 2
#: modules queued for the helpers beyond the ``in_flight`` they compute: a helper done with a
#: small module takes the next at once instead of waiting until this thread has written the
#: ones before it (BENCHMARKS.md, "Design decisions (conversion)")
QUEUED_AHEAD = 2
E4M3_NAN_BYTES = bytes([0x7F, 0xFF])

_P32_ROWS, _IDENTITY = LAYOUTS["trtllm"].weight, LAYOUTS["cutlass"].weight

#: ``scan(piece, at)``: checks the bytes ``piece`` found at offset ``at`` of the data written
Scan = Callable[[memoryview, int], None]
#: ``lay_out(piece, out)``: ``piece``'s bytes laid out into ``out`` (same size), returned
LayOut = Callable[[memoryview, "np.ndarray"], "np.ndarray"]


class Sink(Protocol):
    """Where ``ShardTransform`` puts a shard's bytes, in order (``write.ShardWriter``).

    ``release(data)`` is called once the sink is done with ``data``; ``scan`` checks every
    piece and ``source`` (a hasher) hashes it, in source order; ``lay_out(piece, out)`` gives
    the bytes to write for each piece of ``granule`` bytes, laid out into ``out`` (all in the
    sink's one pass over the bytes).
    """

    def write(self, data, release=None, *, scan: Scan | None = None, source=None,
              lay_out: LayOut | None = None, granule: int = 1) -> None: ...


class ShardTransform:
    """Produces the bytes of one output shard's tensor plans from views of the source.

    One per shard being written (so per worker thread): it holds the shard's buffer pool, the
    canonical bytes of the modules in flight and the hashes of the source tensors it read.

    Args:
        tensors: the source's tensors by name (``SourceCheckpoint.tensors``).
        modules: module plans by name; ``moe``: fused MoE layer plans by name.
        backend: the target backend.
        reader: the open ``ShardReader`` of a source tensor's file (the caller opens and
            closes them).
        errors: module -> quantization error record, filled as modules are computed (shared
            by the workers: one key per module).
        in_flight: modules whose canonical bytes are computed at once: above 1, the modules
            ``expect`` announces are computed ahead on that many helper threads (each torch op
            of them on as many threads as the process allows), from the shard's first tensor
            on and up to ``QUEUED_AHEAD`` more queued, while this one writes; the bytes, the
            errors and their order are those of computing them one by one. ``close`` stops
            the helpers.
    """

    def __init__(self, tensors: dict[str, TensorInfo], modules: dict[str, ModulePlan],
                 moe: dict[str, MoELayerPlan], backend: BackendSpec,
                 reader: Callable[[TensorInfo], ShardReader], errors: dict[str, dict],
                 *, in_flight: int = 1) -> None:
        self.tensors, self.modules, self.moe, self.backend = tensors, modules, moe, backend
        self.reader, self.errors = reader, errors
        self.pool = BufferPool(CHUNK_BYTES, PIPELINE_DEPTH + 2)  # queued + in hand
        self.pending: dict[str, tuple] = {}  # module -> canonical (q, s) until both are written
        self.hashes: dict[str, xxhash.xxh3_64] = {}  # source_key -> hasher of its bytes
        self.in_flight = in_flight
        self._order: list[ModulePlan] = []  # modules computed ahead, in the order produced
        self._next = 0  # index in _order of the next module to submit
        self._futures: dict[str, Future] = {}
        self._helpers: ThreadPoolExecutor | None = None

    def expect(self, tensors: Iterable[TensorPlan]) -> None:
        """The tensors about to be produced, in order: with ``in_flight`` above 1, the modules
        among them whose canonical bytes are computed one at a time (not fused MoE experts) are
        computed ahead."""
        if self.in_flight <= 1:
            return
        seen = {m.name for m in self._order}
        for t in tensors:
            m = self.modules.get(t.module) if t.module else None
            if (m is not None and t.module not in self.moe and m.action != "dequantize"
                    and computed(m) and m.name not in seen):
                seen.add(m.name)
                self._order.append(m)

    def close(self) -> None:
        """Stop the helper threads: modules not started are dropped, running ones finish."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True, cancel_futures=True)
            self._helpers = None
        self._futures.clear()

    def source_hashes(self) -> dict[str, str]:
        """``source_key -> xxh3_64`` of every source tensor read so far."""
        return {k: h.hexdigest() for k, h in self.hashes.items()}

    def produce(self, t: TensorPlan, sink: Sink) -> Iterator[int]:
        """Queue the output bytes of tensor ``t`` on ``sink``; yield the size of each piece.

        Raises:
            LayoutError: a NaN in the source (e4m3 byte 0x7F/0xFF, UE8M0 byte 255, NaN/Inf in
                a computed module), a bad shape, naming the tensor.
        """
        m = self.modules.get(t.module) if t.module else None
        if self._next < len(self._order):  # the helpers start while tensors before are copied
            self._submit()
        if t.module in self.moe:
            yield from self._fused(t, self.moe[t.module], sink)
        elif m is None:
            yield from self._copy(self.tensors[t.source], sink, check_nan=False)
        elif m.action == "dequantize":
            yield from self._dequantized(t, m, sink)
        elif m.action in ("relayout", "keep") and m.source_backend is None:
            yield from self._stream_mxfp8(t, m, sink)
        else:
            yield from self._from_canonical(t, m, sink)

    # --- sources ---------------------------------------------------------------------------

    def source(self, info: TensorInfo) -> torch.Tensor:
        """Zero-copy view of a source tensor in its own dtype and shape."""
        view = self.reader(info).view(info.begin, info.nbytes)
        return view.view(torch_dtype(info.dtype)).reshape(info.shape)

    def _source_hasher(self, info: TensorInfo):
        """A new hasher for source tensor ``info``'s bytes, or None if they are hashed already."""
        key = source_key(info)
        if key in self.hashes:
            return None
        h = self.hashes[key] = xxhash.xxh3_64()
        return h

    def _hash_whole(self, info: TensorInfo) -> None:
        """Hash source tensor ``info`` in one go (tensors read whole: scales, computed modules)."""
        h = self._source_hasher(info)
        if h is not None:
            h.update(self.reader(info).bytes(info.begin, info.nbytes))

    def _drop(self, m: ModulePlan) -> None:
        """Done with a module's source bytes: let their pages leave the resident set."""
        for info in (m.weight, m.scale):
            if info is not None:
                self.reader(info).drop(info.begin, info.nbytes)

    # --- bytes moved, not computed ---------------------------------------------------------

    def _copy(self, info: TensorInfo, sink: Sink, *, check_nan: bool) -> Iterator[int]:
        """Unchanged bytes: written straight from the source mapping, checked (``check_nan``)
        and hashed in the sink's one pass over each piece.

        Not copy_file_range (what cp does): the writer's one pass copies each piece into its
        direct-write buffer anyway (``write.ShardWriter``), and where it writes buffered the
        kernel copy ran ~1 s slower over 4.33 GB than writes from the mapping (BENCHMARKS.md).
        """
        reader = self.reader(info)
        source = self._source_hasher(info)
        for begin, n in chunk_ranges(info, granule=1, chunk_bytes=CHUNK_BYTES):
            sink.write(reader.bytes(begin, n), lambda _, b=begin, k=n: reader.drop(b, k),
                       scan=nan_scan(info, begin) if check_nan else None, source=source)
            yield n

    def _stream_mxfp8(self, t: TensorPlan, m: ModulePlan, sink: Sink) -> Iterator[int]:
        """Canonical MXFP8 source: the weight streams chunk by chunk, never whole in memory."""
        info = self.tensors[t.source]
        if t.role == "weight_scale":
            yield from self._mxfp8_scale(t, info, sink)
            return
        granule = weight_granule(t)
        if granule == 1:
            yield from self._copy(info, sink, check_nan=True)
            return
        yield from self._rows_from_source(info, sink, granule, p32_rows(t.shape[1]))

    def _rows_from_source(self, info: TensorInfo, sink: Sink, granule: int,
                          lay_out: LayOut) -> Iterator[int]:
        """Weight rows laid out from the source mapping in the sink's one pass, chunk by chunk
        (checked, hashed, shuffled and written there), each chunk's pages dropped once done."""
        reader = self.reader(info)
        source = self._source_hasher(info)
        for begin, n in chunk_ranges(info, granule=granule, chunk_bytes=CHUNK_BYTES):
            sink.write(reader.bytes(begin, n), lambda _, b=begin, k=n: reader.drop(b, k),
                       scan=nan_scan(info, begin), source=source, lay_out=lay_out,
                       granule=granule)
            yield n

    def _mxfp8_scale(self, t: TensorPlan, info: TensorInfo, sink: Sink) -> Iterator[int]:
        """A canonical MXFP8 scale, checked and laid out whole with numpy (no torch)."""
        self._hash_whole(info)
        raw = self.reader(info).bytes(info.begin, info.nbytes)
        s = np.frombuffer(raw, dtype=np.uint8).reshape(info.shape)
        check_scale_codes(s, info.name)
        laid = layout_scale(t, self.backend, s)
        if laid is s:  # kept canonical: same bytes
            yield from self._copy(info, sink, check_nan=False)
            return
        sink.write(laid.reshape(-1))
        yield info.nbytes

    # --- bytes computed one module at a time -----------------------------------------------

    def _canonical(self, m: ModulePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Module ``m``'s canonical (q, s), computed once and kept until both are written."""
        if m.name not in self.pending:
            for info in (m.weight, m.scale):
                if info is not None:
                    self._hash_whole(info)
            future = self._ahead(m)
            q, s, err = future.result() if future is not None else self._compute(m)
            if err is not None:
                self.errors[m.name] = {"action": m.action, **err.to_dict()}
            self.pending[m.name] = (q, s)
        return self.pending[m.name]

    def _compute(self, m: ModulePlan) -> tuple[torch.Tensor, torch.Tensor, QuantError | None]:
        return canonical_module(*self._arguments(m))

    def _arguments(self, m: ModulePlan) -> tuple:
        """``canonical_module``'s arguments for ``m``, its source tensors opened on this thread
        (the shard readers are not shared with the helpers)."""
        scale = self.source(m.scale) if m.scale is not None else None
        src = BACKENDS[m.source_backend] if m.source_backend else None
        return m, self.source(m.weight), scale, src

    def _ahead(self, m: ModulePlan) -> Future | None:
        """The computation of ``m`` if it runs (or ran) on a helper, after submitting the
        modules that follow it, up to ``in_flight`` at once; None: compute it here."""
        if m.name not in self._futures and (
                self._next >= len(self._order) or self._order[self._next] is not m):
            return None  # not expected here (or not in that order): computed in this thread
        self._submit()
        return self._futures.pop(m.name)

    def _submit(self) -> None:
        """Hand the helpers the expected modules not yet submitted, up to ``in_flight +
        QUEUED_AHEAD`` not yet taken by this thread."""
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(  # each keeps its quantizer buffers to the end
                self.in_flight, thread_name_prefix="mxfp8-module", initializer=SCRATCH.keep)
        while (self._next < len(self._order)
               and len(self._futures) < self.in_flight + QUEUED_AHEAD):
            nxt = self._order[self._next]
            self._next += 1
            if nxt.name in self.pending:  # computed here already (produced out of order)
                continue
            self._futures[nxt.name] = self._helpers.submit(
                canonical_module, *self._arguments(nxt))

    def _from_canonical(self, t: TensorPlan, m: ModulePlan, sink: Sink) -> Iterator[int]:
        """Sources whose canonical bytes must be computed first (laid out, FP8, dense): one
        module at a time in memory, released once both of its tensors are written."""
        q, s = self._canonical(m)
        if t.role == "weight_scale":
            sink.write(layout_scale(t, self.backend, s).reshape(-1))
            self.pending.pop(m.name)
            self._drop(m)
            yield t.nbytes
            return
        flat = q.reshape(-1)
        granule = weight_granule(t)
        step = max(granule, CHUNK_BYTES // granule * granule)
        for begin in range(0, flat.numel(), step):
            chunk = flat[begin:begin + step]
            if granule == 1:  # bytes unchanged: write the canonical tensor as it is
                sink.write(chunk)
            else:
                buf = self.pool.get(chunk.numel())
                laid = layout_weight_chunk(t, self.backend, chunk, torch.from_numpy(buf))
                sink.write(laid, lambda _, b=buf: self.pool.release(b))
            yield chunk.numel()

    def _dequantized(self, t: TensorPlan, m: ModulePlan, sink: Sink) -> Iterator[int]:
        """An ignored (or unfit) module of a quantized source, in the model's dtype."""
        scale = self.source(m.scale) if m.scale is not None else None
        src = BACKENDS[m.source_backend] if m.source_backend else None
        out = dequantized_module(m, self.source(m.weight), scale, src, torch_dtype(t.dtype))
        sink.write(out.reshape(-1).view(torch.uint8))
        self._drop(m)
        yield t.nbytes

    def _fused(self, t: TensorPlan, layer: MoELayerPlan, sink: Sink) -> Iterator[int]:
        """A fused MoE tensor, produced expert by expert (it is contiguous per expert).

        Nothing of the tensor's size is allocated: FC2 weights (P32 rows) stream from the
        source mapping with the row shuffle in the sink's pass, as dense weights do; FC1
        weights are laid out in row chunks into the pool's reused buffers; an expert's scales
        (1/32 of its weights) are laid out whole. MXFP8 sources never import torch here.
        Sources whose canonical bytes are computed (FP8, dense, laid out) keep one expert's
        canonical bytes at a time, and its scales from the weight pass for the scale tensor
        (at most one layer's scales, 1/32 of its weights).
        """
        projs = MOE_FUSE[t.role]
        for e in range(layer.experts):
            modules = [layer.module(p, e) for p in projs]
            if t.role == "moe_fc1_weight":
                yield from self._fc1_weight(modules[0], modules[1], sink)
            elif t.role == "moe_fc2_weight":
                yield from self._fc2_weight(modules[0], sink)
            else:
                parts = [self._expert_scale(m) for m in modules]
                out = FUSED_SCALE[t.role](*parts).reshape(-1)
                for m in modules:
                    self._drop(m)
                sink.write(out)
                yield out.size

    def _expert_rows(self, m: ModulePlan) -> tuple[np.ndarray, Scan | None, object]:
        """An expert projection's canonical weight as a uint8 ``[N, K]`` array, with the scan
        and source hasher its bytes still need (None for computed ones: checked when made)."""
        if computed(m):
            q, s = self._canonical(m)
            self.pending[m.name] = (None, s)  # its scale, for the scale tensor
            return q.reshape(m.n, m.k).contiguous().numpy(), None, None
        w = m.weight
        rows = np.frombuffer(self.reader(w).bytes(w.begin, w.nbytes), dtype=np.uint8)
        return rows.reshape(m.n, m.k), nan_scan(w, w.begin), self._source_hasher(w)

    def _fc1_weight(self, up: ModulePlan, gate: ModulePlan, sink: Sink) -> Iterator[int]:
        """One expert's ``w13`` bytes, in chunks of rows laid out into pooled buffers."""
        halves = [self._expert_rows(m) for m in (up, gate)]
        n, k = halves[0][0].shape
        step = max(P32_BLOCK // 2, CHUNK_BYTES // (2 * k) // 16 * 16)  # rows of each half
        for r in range(0, n, step):
            pieces = []
            for rows, scan, source in halves:
                piece = rows[r:r + step]
                if scan is not None or source is not None:
                    mv = memoryview(piece).cast("B")
                    if scan is not None:
                        scan(mv, r * k)
                    if source is not None:
                        source.update(mv)
                pieces.append(piece)
            buf = self.pool.get(2 * pieces[0].size)
            moe_fc1_rows_array(*pieces, out=buf)
            for m in (up, gate):
                if not computed(m):
                    self.reader(m.weight).drop(m.weight.begin + r * k, pieces[0].size)
            sink.write(buf, lambda b: self.pool.release(b))
            yield buf.size

    def _fc2_weight(self, m: ModulePlan, sink: Sink) -> Iterator[int]:
        """One expert's ``w2`` bytes: P32 rows, shuffled in the sink's pass (no copy here)."""
        granule, lay_out = P32_BLOCK * m.k, p32_rows(m.k)
        if not computed(m):
            yield from self._rows_from_source(m.weight, sink, granule, lay_out)
            return
        flat = self._expert_rows(m)[0].reshape(-1)
        step = max(granule, CHUNK_BYTES // granule * granule)
        for begin in range(0, flat.size, step):
            sink.write(flat[begin:begin + step], lay_out=lay_out, granule=granule)
            yield min(step, flat.size - begin)

    def _expert_scale(self, m: ModulePlan) -> np.ndarray:
        """An expert projection's canonical scale, uint8 ``[N, K/32]``, checked and hashed."""
        if computed(m):
            _, s = self._canonical(m)
            self.pending.pop(m.name)
            return s.view(torch.uint8).reshape(m.n, m.k // 32).contiguous().numpy()
        info = m.scale
        self._hash_whole(info)
        raw = self.reader(info).bytes(info.begin, info.nbytes)
        s = np.frombuffer(raw, dtype=np.uint8).reshape(m.n, m.k // 32)
        check_scale_codes(s, info.name)
        return s


def p32_rows(row_bytes: int) -> LayOut:
    """A ``Sink`` layout: P32-shuffle pieces of whole 32-row blocks of ``row_bytes``-byte rows."""
    def lay_out(piece: memoryview, out: np.ndarray) -> np.ndarray:
        rows = np.frombuffer(piece, dtype=np.uint8).reshape(-1, row_bytes)
        return p32_shuffle_rows_array(rows, out)
    return lay_out


def nan_scan(info: TensorInfo, begin: int) -> Scan:
    """A ``Sink`` scan of e4m3 bytes of ``info`` that start at absolute offset ``begin``:
    e4m3 NaN is 0x7F or 0xFF; refuse it, naming the tensor and the [row, col]."""
    def scan(piece, at: int) -> None:
        hit = find_bytes(piece, E4M3_NAN_BYTES)
        if hit >= 0:
            row, col = divmod(begin + at + hit - info.begin, info.shape[-1])
            raise LayoutError(f"{info.file}: weight {info.name!r} holds NaN "
                              f"(e4m3 byte 0x7F/0xFF) at [{row}, {col}]")
    return scan


def source_key(info: TensorInfo) -> str:
    """The name a source tensor's hash is recorded under: its file, span and name."""
    return f"{info.file}\0{info.begin}\0{info.nbytes}\0{info.name}"


def computed(m: ModulePlan) -> bool:
    """Whether a module's canonical bytes are computed (not views of the source's own bytes)."""
    return m.action not in ("relayout", "keep") or m.source_backend is not None


# --- per-module math --------------------------------------------------------------------------


def weight_granule(t: TensorPlan) -> int:
    """Bytes per independent chunk of a weight: 32 rows for a shuffled layout, else 1."""
    if t.role == "weight" and t.layout == _P32_ROWS:
        return P32_BLOCK * t.shape[1]
    return 1


def layout_weight_chunk(t: TensorPlan, backend: BackendSpec, chunk: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Lay out a chunk of ``t``'s canonical weight bytes: uint8 ``[rows*K]`` in, same size out.

    Layouts that keep the bytes return ``chunk`` itself. ``out`` (same size) receives the
    shuffled bytes when given, so a pipeline can reuse its buffers.
    """
    if (t.layout in (CANONICAL_LAYOUT, "copy") or t.layout != backend.weight_layout
            or t.layout == _IDENTITY):
        return chunk
    k = t.shape[1]
    if out is None or t.layout != _P32_ROWS:
        return backend.weight_forward(chunk.view(-1, k)).reshape(-1)
    return p32_shuffle_rows(chunk.view(-1, k), out=out).reshape(-1)


def layout_scale(t: TensorPlan, backend: BackendSpec,
                 s: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """Canonical uint8 ``[N, C]`` scale -> the bytes of ``t`` (tiles, or unchanged if canonical).

    A numpy uint8 array is laid out with numpy (no torch), into a numpy array of the same bytes.
    """
    if isinstance(s, np.ndarray):
        forward = backend.scale_forward_array
    else:
        s = s if s.dtype == torch.uint8 else s.view(torch.uint8)
        forward = backend.scale_forward
    if tuple(s.shape) != tuple(t.logical_shape):
        raise LayoutError(f"scale {t.source!r}: shape {list(s.shape)} "
                          f"!= planned {list(t.logical_shape)}")
    if t.layout == "canonical":
        return s
    out = forward(s)
    if tuple(out.shape) != tuple(t.shape):
        raise LayoutError(f"scale {t.name!r}: laid out to {list(out.shape)}, "
                          f"planned {list(t.shape)} (bug)")
    return out


def canonical_module(
    m: ModulePlan, weight: torch.Tensor, scale: torch.Tensor | None,
    src_backend: BackendSpec | None,
) -> tuple[torch.Tensor, torch.Tensor, QuantError | None]:
    """A module's canonical MXFP8: (uint8 ``[N, K]``, uint8 ``[N, K/32]``, error or None).

    Args:
        m: the module's plan (its ``action`` and ``source_kind`` say which path).
        weight: the source weight as stored (its dtype and shape).
        scale: the source scale as stored, or None for a dense source.
        src_backend: for a laid-out source, the backend its bytes follow.

    Raises:
        LayoutError: NaN/Inf in the source, a scale byte of 255, bad shapes (naming the tensor).
    """
    from mxfp8_convert.quantize import (  # torch at import: only computed modules need it
        block_fp8_to_mxfp8,
        per_tensor_fp8_to_mxfp8,
        quantize_mxfp8_with_error,
    )

    name = m.weight.name
    if m.fused is not None:
        return (*expert_from_fused(m, weight, scale), None)
    if m.source_kind == "dense":
        q, s, err = quantize_mxfp8_with_error(dense_weight(m, weight), name=name)
        return q.view(torch.uint8), s, err
    if m.source_kind == "block_fp8":
        r = block_fp8_to_mxfp8(weight, scale, name=name, scale_name=m.scale.name)
        return r.q.view(torch.uint8), r.s, r.error
    if m.source_kind == "fp8":
        r = per_tensor_fp8_to_mxfp8(weight, scale, name=name, scale_name=m.scale.name)
        return r.q.view(torch.uint8), r.s, r.error
    w = weight.reshape(m.n, m.k).view(torch.uint8)
    s = scale.view(torch.uint8)
    if src_backend is not None:  # undo the source's layout
        w = src_backend.weight_inverse(w)
        s = src_backend.scale_inverse(s, m.n, m.k // 32)
    check_scale_codes(s.reshape(m.n, m.k // 32), m.scale.name)
    return w, s.reshape(m.n, m.k // 32), None


def dense_weight(m: ModulePlan, weight: torch.Tensor) -> torch.Tensor:
    """A dense module's ``[N, K]`` weight: the tensor itself, or its expert's columns of a
    stacked ``[K, N']`` expert slice (``plan.StackedSlice``), transposed."""
    if m.stacked is None:
        return weight.reshape(m.n, m.k)
    cols = {"all": slice(None), "first": slice(0, m.n), "second": slice(m.n, 2 * m.n),
            "even": slice(0, None, 2), "odd": slice(1, None, 2)}[m.stacked.cols]
    return weight.reshape(m.k, -1)[:, cols].t().contiguous()


def dequantized_module(m: ModulePlan, weight: torch.Tensor, scale: torch.Tensor,
                       src_backend: BackendSpec | None, dtype: torch.dtype) -> torch.Tensor:
    """A quantized source module's ``[N, K]`` values in ``dtype``: FP8 sources by their own
    float32 math (``fl32(w) * scale``), MXFP8 ones (laid out or not) from their canonical bytes.

    Raises:
        LayoutError: NaN/Inf in the source, a bad scale (naming the tensor).
    """
    from mxfp8_convert.quantize import check_finite, dequantize_mxfp8

    if m.source_kind in ("block_fp8", "fp8"):
        w = weight.reshape(m.n, m.k)
        check_finite(w, m.weight.name)
        f = scale.to(torch.float32)
        if m.source_kind == "block_fp8":
            rows, cols = torch.arange(m.n) // 128, torch.arange(m.k) // 128
            f = f[rows][:, cols]
        else:
            f = f.reshape(-1, 1) if f.numel() > 1 else f.reshape(())
        return (w.to(torch.float32) * f).to(dtype)
    q, s, _ = canonical_module(m, weight, scale, src_backend)
    out = dequantize_mxfp8(q.reshape(m.n, m.k), s, name=m.weight.name)
    return out.to(dtype)


#: fused MoE tensor role -> the expert projections it is made of, in the layout's argument order
MOE_FUSE = {
    "moe_fc1_weight": ("up", "gate"),
    "moe_fc1_scale": ("up", "gate"),
    "moe_fc2_weight": ("down",),
    "moe_fc2_scale": ("down",),
}
#: fused MoE scale role -> its layout of one expert's numpy scales (the converter's; no torch)
FUSED_SCALE = {
    "moe_fc1_scale": moe_fc1_scale_from_canonical_array,
    "moe_fc2_scale": moe_fc2_scale_from_canonical_array,
}


def expert_from_fused(m: ModulePlan, weight: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert projection's canonical MXFP8, cut out of its expert's fused MoE bytes.

    Args:
        m: a module with ``m.fused`` set (which projection of which expert, H and I).
        weight: that expert's fused weight, ``[2I, H]`` (gate, up) or ``[H, I]`` (down), 1-byte.
        scale: that expert's fused scale tiles (uint8 ``[2I/128, H/128, 512]`` or
            ``[H/128, I/128, 512]``).

    Returns:
        ``(uint8 [N, K], uint8 [N, K/32])``, contiguous.
    """
    f = m.fused
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    if f.proj == "down":
        w = moe_fc2_weight_to_canonical(w.reshape(f.hidden, f.intermediate))
        s = moe_fc2_scale_to_canonical(s, f.hidden, f.intermediate)
    else:
        half = 0 if f.proj == "up" else 1  # FC1 is cat([up, gate])
        w = moe_fc1_weight_to_canonical(w.reshape(2 * f.intermediate, f.hidden))[half]
        s = moe_fc1_scale_to_canonical(s, f.hidden, f.intermediate)[half]
    check_scale_codes(s, f"{m.scale.name} (expert {f.expert} {f.proj})")
    return w, s


def check_scale_codes(s: torch.Tensor | np.ndarray, name: str) -> None:
    """UE8M0 byte 255 is NaN: refuse it, naming the tensor and the first position.

    ``s`` may be a tensor or a numpy uint8 array (the converter's torch-free path).
    """
    if isinstance(s, np.ndarray):  # memchr: no boolean array of the scale's size
        hit = find_bytes(np.ascontiguousarray(s).reshape(-1), b"\xff")
        if hit >= 0:
            idx = [int(i) for i in np.unravel_index(hit, s.shape)]
            raise LayoutError(f"scale {name!r} holds NaN (UE8M0 byte 255) at {idx}")
        return
    bad = s.view(torch.uint8) == 255
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise LayoutError(f"scale {name!r} holds NaN (UE8M0 byte 255) at {idx}")
