"""Load a converted checkpoint (docs/FORMAT.md) onto a device, refusing anything it cannot trust.

What is checked, before any tensor data is read (FORMAT.md section 6):

1. ``mxfp8_convert.complete.json`` exists and is a valid completion marker: a folder without it
   is a crashed or running conversion (safetensors #295);
2. ``config.json``'s ``quantization_config`` is our marker: ``quant_method == "mxfp8_convert"``,
   a known ``format_version``, and layout names that match our backend table;
3. every file the completion marker lists is inside the folder (no absolute path, no ``..``, no
   link leading out but into the Hub cache's blobs) with its recorded size, and, with
   ``check_hashes=True``, its recorded xxh3-128 hash; every file the loader reads (config, index,
   shards) is listed there, so an index entry cannot lead anywhere else;
4. the marker's backend is what the caller asked for, and the engine that will run it can run it
   on this device (a trtllm checkpoint on an SM120 GPU is refused, not re-laid-out);
5. every shard carries the same marker in its ``__metadata__``;
6. every laid-out module has its weight and scale with the shapes its layout implies.

Bytes are loaded as stored: no shuffle, no swizzle, no re-quantization, ever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path

import torch
from safetensors import safe_open

from mxfp8_convert.errors import LayoutError, MarkerError, SourceError
from mxfp8_convert.format import (  # noqa: F401 - the names are re-exported for old callers
    CANONICAL_SUFFIX,
    COMPLETE_MARKER,
    CONFIG_FILE,
    INDEX_FILE,
    LAYOUT_KEYS,
    LAYOUTS,
    META_MARKER,
    META_TENSORS,
    QUANT_METHOD,
    SINGLE_FILE,
    Completion,
    Marker,
    file_digest,
    read_json,
)
from mxfp8_convert.format import CANONICAL_SUFFIX as CANONICAL_SCALE_SUFFIX
from mxfp8_convert.format import SWIZZLED_SUFFIX as SCALE_SUFFIX
from mxfp8_convert.read import safe_child
from mxfp8_convert.runtime.select import check_engine
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight


@dataclass(frozen=True)
class MXFP8Checkpoint:
    """A loaded converted checkpoint.

    Attributes:
        path: the checkpoint folder.
        marker: config.json's ``quantization_config`` (the layout marker).
        config: the whole config.json.
        engine: the engine the weights were checked against
            (``flashinfer``/``triton``/``reference``).
        weights: module name (``model.layers.0.mlp.up_proj``) -> :class:`MXFP8Weight`.
        tensors: every other tensor (biases, norms, embeddings, ignored modules), by full name.
    """

    path: Path
    marker: dict
    config: dict
    engine: str
    weights: dict[str, MXFP8Weight] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        """The FlashInfer ``mm_mxfp8`` backend the bytes are laid out for."""
        return self.marker["backend"]


def read_marker(path: str | Path, *, backend: str | None = None) -> dict:
    """Check the completion marker and config.json's layout marker; read no tensor data.

    Args:
        path: checkpoint folder.
        backend: the ``mm_mxfp8`` backend the caller will run (``"trtllm"``/``"cutlass"``);
            ``None`` accepts the marker's.

    Returns:
        The marker (``quantization_config``) dict.

    Raises:
        SourceError: ``path`` is not a folder.
        MarkerError: no or invalid completion marker, no/unknown/mismatched layout marker.
    """
    return _read_markers(Path(path), backend)[0]


def _read_markers(root: Path, backend: str | None) -> tuple[dict, Completion]:
    if not root.is_dir():
        raise SourceError(f"{root}: not a checkpoint folder")
    if not (root / COMPLETE_MARKER).is_file():
        raise MarkerError(
            f"{root}: no {COMPLETE_MARKER}: not a complete mxfp8-convert output "
            "(crashed or still running?)",
            hint="re-run the conversion; never load a folder without its completion marker",
        )
    done = Completion.read(root)
    if not (root / CONFIG_FILE).is_file():
        raise MarkerError(f"{root}: no {CONFIG_FILE}, so no layout marker",
                          hint="convert it with mxfp8-convert")
    marker = read_json(root / CONFIG_FILE, CONFIG_FILE).get("quantization_config")
    Marker.parse(marker, f"{root}/{CONFIG_FILE}")
    if done.backend != marker["backend"]:
        raise MarkerError(f"{root}: {COMPLETE_MARKER} says backend {done.backend}, "
                          f"{CONFIG_FILE} says {marker['backend']}")
    if backend is not None and backend != marker["backend"]:
        raise MarkerError(
            f"{root}: checkpoint is laid out for {marker['backend']}, but {backend} was asked for",
            hint=f"run it with backend={marker['backend']!r} or convert the source for {backend}",
        )
    return marker, done


_CHANGED = "the folder changed after conversion: convert again, or see `mxfp8-convert verify`"


def _check_files(root: Path, done: Completion, reads: list[str], check_hashes: bool) -> None:
    """Raise unless every file the completion marker lists is inside ``root`` with its recorded
    size (and hash), and every file in ``reads`` is one of them."""
    for rel in reads:
        if rel not in done.files:
            raise MarkerError(f"{root / rel}: not listed in {COMPLETE_MARKER}", hint=_CHANGED)
    for rel, rec in sorted(done.files.items()):
        p = safe_child(root, rel, what=f"{COMPLETE_MARKER}: file")
        try:
            size = p.stat().st_size if p.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise MarkerError(f"{p}: listed in {COMPLETE_MARKER} but missing or not a file",
                              hint=_CHANGED)
        if size != rec.size:
            raise MarkerError(f"{p}: {size} bytes, {COMPLETE_MARKER} records {rec.size}",
                              hint=_CHANGED)
        if check_hashes and file_digest(p) != rec.xxh3_128:
            raise MarkerError(f"{p}: xxh3_128 differs from {COMPLETE_MARKER}", hint=_CHANGED)


def _check_flashinfer_version(marker: dict, root: Path) -> None:
    try:
        have = importlib_metadata.version("flashinfer-python")
    except importlib_metadata.PackageNotFoundError:
        return  # check_engine already required the module; a source build has no dist metadata
    want = marker["flashinfer_layout_version"]
    if have != want:
        raise MarkerError(
            f"{root}: laid out for FlashInfer {want}, installed FlashInfer is {have}; "
            "kernel layouts are internals",
            hint=f"install flashinfer-python=={want}, or verify the layouts and pass "
            "check_flashinfer_version=False",
        )


def _shard_files(root: Path) -> list[str]:
    index = root / INDEX_FILE
    if index.is_file():
        index_doc = read_json(safe_child(root, INDEX_FILE, what="index"), "index")
        weight_map = index_doc.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{index}: no weight_map")
        if not all(isinstance(rel, str) for rel in weight_map.values()):
            raise SourceError(f"{index}: weight_map must map tensor names to file names")
        shards = sorted(set(weight_map.values()))
        for rel in shards:
            safe_child(root, rel, what=f"{index}: shard")
        return shards
    if (root / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise SourceError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE}")


def _read_shard(root: Path, shard: str, marker: dict, device: str) -> tuple[dict, dict]:
    """All tensors of one shard on ``device`` and its per-tensor records; checks its marker."""
    path = safe_child(root, shard, what="shard")
    if not path.is_file():
        raise SourceError(f"{path}: shard listed in the index is missing")
    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata() or {}
        if META_MARKER not in meta:
            raise MarkerError(f"{path}: shard carries no {META_MARKER} marker in its metadata")
        try:
            shard_marker = json.loads(meta[META_MARKER])
            records = json.loads(meta.get(META_TENSORS, "{}"))
        except ValueError as e:
            raise MarkerError(f"{path}: unreadable marker metadata ({e})") from None
        diff = [k for k in LAYOUT_KEYS if shard_marker.get(k) != marker.get(k)]
        if diff:
            raise MarkerError(f"{path}: shard marker differs from config.json on {', '.join(diff)}")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return tensors, records


def _check_record(records: dict, name: str, layout: str) -> None:
    rec = records.get(name)
    if rec is not None and rec.get("layout") != layout:
        raise MarkerError(f"{name}: per-tensor record says layout {rec.get('layout')!r}, "
                          f"marker says {layout!r}")


def _pair_weights(tensors: dict, records: dict, marker: dict) -> dict[str, MXFP8Weight]:
    """Pop every quantized module (weight + its scale) out of ``tensors``."""
    backend = marker["backend"]
    weights: dict[str, MXFP8Weight] = {}
    for name in sorted(tensors):
        prefix, _, suffix = name.rpartition(".")
        if suffix == SCALE_SUFFIX:
            layout, scale_layout, weight_layout = (
                backend, LAYOUTS[backend].scale, LAYOUTS[backend].weight)
        elif suffix == CANONICAL_SCALE_SUFFIX and records.get(name, {}).get("layout") == CANONICAL:
            layout, scale_layout, weight_layout = CANONICAL, CANONICAL, CANONICAL
        else:
            continue
        wname = f"{prefix}.weight"
        if wname not in tensors:
            raise LayoutError(f"{name}: scale without its weight {wname}")
        _check_record(records, name, scale_layout)
        _check_record(records, wname, weight_layout)
        weights[prefix] = MXFP8Weight(tensors[wname], tensors[name], layout, prefix)
    for prefix, w in weights.items():
        tensors.pop(f"{prefix}.weight")
        tensors.pop(f"{prefix}.{SCALE_SUFFIX if w.layout != CANONICAL else CANONICAL_SCALE_SUFFIX}")
    return weights


def load_checkpoint(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    engine: str = "auto",
    check_flashinfer_version: bool = True,
    check_hashes: bool = False,
) -> MXFP8Checkpoint:
    """Load a converted checkpoint's tensors onto ``device``, exactly as stored.

    Args:
        path: checkpoint folder (docs/FORMAT.md).
        device: where the tensors go (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        backend: the ``mm_mxfp8`` backend you will run; a checkpoint laid out for another is
            refused.
        engine: ``"auto"``, ``"flashinfer"``, ``"triton"`` or ``"reference"``: the engine that will
            run it, checked against the layouts found and the device.
        check_flashinfer_version: for the flashinfer engine, refuse a FlashInfer release other than
            the one the layouts were reproduced from.
        check_hashes: also recompute every listed file's xxh3-128 and compare it with the
            completion marker (reads every byte once more; sizes are always checked).

    Returns:
        :class:`MXFP8Checkpoint` with the MXFP8 weights by module name and every other tensor.

    Raises:
        SourceError, MarkerError, LayoutError, BackendUnavailableError: see the module docstring.
    """
    root = Path(path)
    marker, done = _read_markers(root, backend)
    shards = _shard_files(root)
    has_index = (root / INDEX_FILE).is_file()
    listed = [CONFIG_FILE, *([INDEX_FILE] if has_index else []), *shards]
    _check_files(root, done, listed, check_hashes)
    device = str(torch.device(device))
    name = check_engine(engine, device, marker["backend"])
    if name == "flashinfer" and check_flashinfer_version:
        _check_flashinfer_version(marker, root)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    for shard in shards:
        t, r = _read_shard(root, shard, marker, device)
        tensors.update(t)
        records.update(r)
    weights = _pair_weights(tensors, records, marker)
    if any(w.layout == CANONICAL for w in weights.values()):
        check_engine(name, device, CANONICAL)
    config = read_json(root / CONFIG_FILE, CONFIG_FILE)
    return MXFP8Checkpoint(root, marker, config, name, weights, tensors)
