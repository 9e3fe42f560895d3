"""safetensors dtype names <-> torch dtypes, with item sizes (one table)."""

from __future__ import annotations

import torch

#: safetensors dtype string -> (torch dtype, bytes per element). Order follows safetensors' Dtype.
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
    "F64": (torch.float64, 8),
}

TORCH_TO_ST: dict[torch.dtype, str] = {dt: name for name, (dt, _) in ST_DTYPES.items()}

#: dtypes a scale of a MXFP8 weight may have on disk (SPEC section 1)
UE8M0_DTYPES = frozenset({"U8", "F8_E8M0"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def itemsize(st_dtype: str) -> int:
    return ST_DTYPES[st_dtype][1]


def torch_dtype(st_dtype: str) -> torch.dtype:
    return ST_DTYPES[st_dtype][0]
