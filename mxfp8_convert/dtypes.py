"""safetensors dtype names -> torch dtypes, with item sizes (one table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxfp8_convert._lazy import torch

if TYPE_CHECKING:
    import torch as _torch

#: safetensors dtype string -> (name of the torch dtype, bytes per element). Order follows
#: safetensors' Dtype. Names, not dtypes: reading headers must not import torch.
ST_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
}

#: dtypes a scale of a MXFP8 weight may have on disk (docs/LAYOUTS.md section 1)
UE8M0_DTYPES = frozenset({"U8", "F8_E8M0"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def itemsize(st_dtype: str) -> int:
    return ST_DTYPES[st_dtype][1]


def torch_dtype(st_dtype: str) -> _torch.dtype:
    return getattr(torch, ST_DTYPES[st_dtype][0])
