"""Write tiny checkpoints that follow docs/FORMAT.md, for the runtime's tests and benchmarks.

The real converter (``mxfp8_convert.convert``) is written elsewhere; this writer implements only
the on-disk contract, so the loader is tested against the contract and not against one writer.
Tensors are laid out with ``mxfp8_convert.layouts`` (through ``MXFP8Weight.from_canonical``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from mxfp8_convert.backends import (
    BACKENDS,
    EPILOGUE_TILE_M,
    FLASHINFER_LAYOUT_VERSION,
    FORMAT_VERSION,
)
from mxfp8_convert.runtime.load import SCALE_SUFFIX
from mxfp8_convert.runtime.weight import CANONICAL, MXFP8Weight


def make_marker(backend_name: str, **overrides) -> dict:
    """The config.json ``quantization_config`` of FORMAT.md section 2."""
    backend = backend_name
    spec = BACKENDS[backend]
    marker = {
        "quant_method": "mxfp8_convert",
        "format_version": FORMAT_VERSION,
        "backend": backend,
        "weight_layout": spec.weight_layout,
        "scale_layout": spec.scale_layout,
        "epilogue_tile_m": EPILOGUE_TILE_M,
        "block_size": 32,
        "weight_dtype": "float8_e4m3fn",
        "scale_dtype": "uint8",
        "scale_suffix": SCALE_SUFFIX,
        "flashinfer_layout_version": FLASHINFER_LAYOUT_VERSION,
        "tool": {"name": "mxfp8-convert", "version": "0.1.0"},
        "source": {"dialect": "sglang_mxfp8", "fingerprint": "sha256:" + "0" * 64,
                   "fingerprint_method": "headers-v1"},
        "ignored_layers": [],
        "original_quantization_config": None,
    }
    marker.update(overrides)
    return marker


def _records(name: str, w: MXFP8Weight, spec_layouts: tuple[str, str]) -> dict:
    n, k = w.shape
    c = k // 32
    wl, sl = spec_layouts if w.layout != CANONICAL else (CANONICAL, CANONICAL)
    scale_name = _scale_name(name, w)
    scale_rec = {"role": "weight_scale", "layout": sl, "logical_shape": [n, c],
                 "padded_shape": [-(-n // 128) * 128, -(-c // 4) * 4],
                 "tile_shape": list(w.scale.shape)}
    if w.layout == CANONICAL:
        scale_rec["reason"] = "kept canonical by the test writer"
    weight_rec = {"role": "weight", "layout": wl, "shape": [n, k]}
    return {f"{name}.weight": weight_rec, scale_name: scale_rec}


def _scale_name(name: str, w: MXFP8Weight) -> str:
    return f"{name}.{SCALE_SUFFIX}" if w.layout != CANONICAL else f"{name}.weight_scale_inv"


def write_checkpoint(
    root: str | Path,
    weights: dict[str, MXFP8Weight],
    other: dict[str, torch.Tensor] | None = None,
    *,
    backend: str,
    shards: int = 1,
    config: dict | None = None,
    complete: bool = True,
    marker: dict | None = None,
    shard_marker: dict | None = None,
) -> Path:
    """Write a converted checkpoint folder.

    Args:
        root: folder to create.
        weights: module name -> laid-out weight (``backend`` layout, or ``canonical``).
        other: every other tensor by full name (biases, norms, embeddings).
        backend: the marker's backend.
        shards: 1 writes ``model.safetensors``; 2+ split weights and scales into different shards.
        config: extra config.json keys (model config).
        complete: write the completion marker (last).
        marker: override the config.json marker (for refusal tests).
        shard_marker: override the shards' marker (for refusal tests).

    Returns:
        ``Path(root)``.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    marker = marker if marker is not None else make_marker(backend)
    spec = BACKENDS[backend]
    files: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    recs: list[dict] = [{} for _ in range(shards)]
    for name, w in sorted(weights.items()):
        scale_name = _scale_name(name, w)
        ws, ss = (0, shards - 1) if shards > 1 else (0, 0)  # weight and scale in different shards
        files[ws][f"{name}.weight"] = w.data.contiguous().cpu()
        files[ss][scale_name] = w.scale.contiguous().cpu()
        r = _records(name, w, (spec.weight_layout, spec.scale_layout))
        recs[ws][f"{name}.weight"] = r[f"{name}.weight"]
        recs[ss][scale_name] = r[scale_name]
    for i, (name, t) in enumerate(sorted((other or {}).items())):
        files[i % shards][name] = t.contiguous().cpu()
    names = ["model.safetensors"]
    if shards > 1:
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    smarker = json.dumps(shard_marker if shard_marker is not None else marker, sort_keys=True)
    for fname, tensors, rec in zip(names, files, recs, strict=True):
        meta = {"mxfp8_convert": smarker, "mxfp8_convert.tensors": json.dumps(rec)}
        save_file(tensors, str(root / fname), metadata=meta)
    if shards > 1:
        weight_map = {t: fname for fname, tensors in zip(names, files, strict=True)
                      for t in tensors}
        total = sum(t.numel() * t.element_size() for tensors in files for t in tensors.values())
        index = {"metadata": {"total_size": total, "mxfp8_convert": marker},
                 "weight_map": dict(sorted(weight_map.items()))}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = {"architectures": ["TinyForTest"], **(config or {}), "quantization_config": marker}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    if complete:
        write_completion(root, backend)
    return root


def write_completion(root: str | Path, backend: str) -> dict:
    """Write the completion marker of FORMAT.md section 1a over every file now in ``root``
    (size and xxh3-128 of each, hashed here with xxhash itself); returns it."""
    root = Path(root)
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != "mxfp8_convert.complete.json":
            files[rel] = {"size": p.stat().st_size,
                          "xxh3_128": xxhash.xxh3_128(p.read_bytes()).hexdigest()}
    done = {"format_version": FORMAT_VERSION, "backend": backend, "tool_version": "0.1.0",
            "source_fingerprint": "sha256:" + "0" * 64, "quantization_errors": {}, "files": files}
    (root / "mxfp8_convert.complete.json").write_text(json.dumps(done))
    return done

