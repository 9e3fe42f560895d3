"""Load a converted checkpoint (docs/FORMAT.md) onto a device, refusing anything it cannot trust.

What is checked, before any tensor data is read (FORMAT.md section 6):

1. ``mxfp8_convert.complete.json`` exists and is JSON: a folder without it is a crashed or
   running conversion (safetensors #295);
2. ``config.json``'s ``quantization_config`` is our marker: ``quant_method == "mxfp8_convert"``,
   a known ``format_version``, and layout names that match our backend table;
3. the marker's backend is what the caller asked for, and the engine that will run it can run it
   on this device (a trtllm checkpoint on an SM120 GPU is refused, not re-laid-out);
4. every shard carries the same marker in its ``__metadata__``;
5. every laid-out module has its weight and scale with the shapes its layout implies.

Bytes are loaded as stored: no shuffle, no swizzle, no re-quantization, ever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path

import torch
from safetensors import safe_open

from mxfp8_convert.backends import (
    BACKENDS,
    EPILOGUE_TILE_M,
    FLASHINFER_LAYOUT_VERSION,
    FORMAT_VERSION,
)
from mxfp8_convert.errors import LayoutError, MarkerError, SourceError
from mxfp8_convert.runtime.select import check_engine
from mxfp8_convert.runtime.weight import CANONICAL, KERNEL_LAYOUTS, MXFP8Weight

COMPLETE_MARKER = "mxfp8_convert.complete.json"
QUANT_METHOD = "mxfp8_convert"
SCALE_SUFFIX = "weight_scale_swizzled"
CANONICAL_SCALE_SUFFIX = "weight_scale_inv"
META_MARKER = "mxfp8_convert"
META_TENSORS = "mxfp8_convert.tensors"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Marker keys that define the bytes; a shard's marker must agree with config.json on each.
LAYOUT_KEYS = (
    "quant_method", "format_version", "backend", "weight_layout", "scale_layout",
    "epilogue_tile_m", "block_size", "weight_dtype", "scale_dtype", "scale_suffix",
    "flashinfer_layout_version",
)
_FIXED = {"block_size": 32, "weight_dtype": "float8_e4m3fn", "scale_dtype": "uint8",
          "scale_suffix": SCALE_SUFFIX, "epilogue_tile_m": EPILOGUE_TILE_M}


@dataclass(frozen=True)
class MXFP8Checkpoint:
    """A loaded converted checkpoint.

    Attributes:
        path: the checkpoint folder.
        marker: config.json's ``quantization_config`` (the layout marker).
        config: the whole config.json.
        engine: the engine the weights were checked against (``flashinfer``/``triton``/``reference``).
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


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MarkerError(f"{path}: cannot read {what} ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise MarkerError(f"{path}: {what} is not a JSON object")
    return data


def _check_marker_fields(marker: dict, where: str) -> None:
    """Raise MarkerError unless ``marker`` describes a layout this runtime knows."""
    qm = marker.get("quant_method")
    if qm != QUANT_METHOD:
        raise MarkerError(
            f"{where}: quant_method is {qm!r}, not {QUANT_METHOD!r}: not an mxfp8-convert output",
            hint="convert it first with `mxfp8-convert convert`",
        )
    if marker.get("format_version") != FORMAT_VERSION:
        raise MarkerError(
            f"{where}: format_version {marker.get('format_version')!r} is not supported (this runtime reads {FORMAT_VERSION})",
            hint="upgrade mxfp8-convert",
        )
    backend = marker.get("backend")
    if backend not in KERNEL_LAYOUTS:
        raise MarkerError(f"{where}: unknown backend {backend!r} (this runtime reads {', '.join(KERNEL_LAYOUTS)})")
    spec = BACKENDS[backend]
    expected = {**_FIXED, "weight_layout": spec.weight_layout, "scale_layout": spec.scale_layout}
    for key, want in expected.items():
        if marker.get(key) != want:
            raise MarkerError(f"{where}: marker {key}={marker.get(key)!r} does not match backend {backend} ({want!r})")


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
        MarkerError: no completion marker, no/unknown/mismatched layout marker.
    """
    root = Path(path)
    if not root.is_dir():
        raise SourceError(f"{root}: not a checkpoint folder")
    if not (root / COMPLETE_MARKER).is_file():
        raise MarkerError(
            f"{root}: no {COMPLETE_MARKER}: not a complete mxfp8-convert output (crashed or still running?)",
            hint="re-run the conversion; never load a folder without its completion marker",
        )
    _read_json(root / COMPLETE_MARKER, "the completion marker")
    if not (root / "config.json").is_file():
        raise MarkerError(f"{root}: no config.json, so no layout marker", hint="convert it with mxfp8-convert")
    marker = _read_json(root / "config.json", "config.json").get("quantization_config")
    if not isinstance(marker, dict):
        raise MarkerError(f"{root}/config.json: no quantization_config: not an mxfp8-convert output",
                          hint="convert it first with `mxfp8-convert convert`")
    _check_marker_fields(marker, f"{root}/config.json")
    if backend is not None and backend != marker["backend"]:
        raise MarkerError(
            f"{root}: checkpoint is laid out for {marker['backend']}, but {backend} was asked for",
            hint=f"run it with backend={marker['backend']!r} or convert the source for {backend}",
        )
    return marker


def _check_flashinfer_version(marker: dict, root: Path) -> None:
    try:
        have = importlib_metadata.version("flashinfer-python")
    except importlib_metadata.PackageNotFoundError:
        return  # check_engine already required the module; a source build has no dist metadata
    want = marker.get("flashinfer_layout_version", FLASHINFER_LAYOUT_VERSION)
    if have != want:
        raise MarkerError(
            f"{root}: laid out for FlashInfer {want}, installed FlashInfer is {have}; kernel layouts are internals",
            hint=f"install flashinfer-python=={want}, or verify the layouts and pass check_flashinfer_version=False",
        )


def _shard_files(root: Path) -> list[str]:
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "the index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{index}: no weight_map")
        return sorted(set(weight_map.values()))
    if (root / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise SourceError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE}")


def _read_shard(root: Path, shard: str, marker: dict, device: str) -> tuple[dict, dict]:
    """All tensors of one shard on ``device`` and its per-tensor records; checks its marker."""
    path = root / shard
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
        raise MarkerError(f"{name}: per-tensor record says layout {rec.get('layout')!r}, marker says {layout!r}")


def _pair_weights(tensors: dict, records: dict, marker: dict) -> dict[str, MXFP8Weight]:
    """Pop every quantized module (weight + its scale) out of ``tensors``."""
    spec = BACKENDS[marker["backend"]]
    weights: dict[str, MXFP8Weight] = {}
    for name in sorted(tensors):
        prefix, _, suffix = name.rpartition(".")
        if suffix == SCALE_SUFFIX:
            layout, scale_layout, weight_layout = spec.name, spec.scale_layout, spec.weight_layout
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
) -> MXFP8Checkpoint:
    """Load a converted checkpoint's tensors onto ``device``, exactly as stored.

    Args:
        path: checkpoint folder (docs/FORMAT.md).
        device: where the tensors go (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        backend: the ``mm_mxfp8`` backend you will run; a checkpoint laid out for another is refused.
        engine: ``"auto"``, ``"flashinfer"``, ``"triton"`` or ``"reference"``: the engine that will
            run it, checked against the layouts found and the device.
        check_flashinfer_version: for the flashinfer engine, refuse a FlashInfer release other than
            the one the layouts were reproduced from.

    Returns:
        :class:`MXFP8Checkpoint` with the MXFP8 weights by module name and every other tensor.

    Raises:
        SourceError, MarkerError, LayoutError, BackendUnavailableError: see the module docstring.
    """
    root = Path(path)
    marker = read_marker(root, backend=backend)
    device = str(torch.device(device))
    name = check_engine(engine, device, marker["backend"])
    if name == "flashinfer" and check_flashinfer_version:
        _check_flashinfer_version(marker, root)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    for shard in _shard_files(root):
        t, r = _read_shard(root, shard, marker, device)
        tensors.update(t)
        records.update(r)
    weights = _pair_weights(tensors, records, marker)
    if any(w.layout == CANONICAL for w in weights.values()):
        check_engine(name, device, CANONICAL)
    config = _read_json(root / "config.json", "config.json")
    return MXFP8Checkpoint(root, marker, config, name, weights, tensors)
