"""The device facts the selection rules read (:class:`~rules.DeviceFacts`), from torch, the CUDA
driver, Triton and the environment.

``MXFP8_PDL`` controls programmatic dependent launch: unset or ``1`` (default) on where the device
allows it, ``strict`` on with every memory access after the wait, ``0`` off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from mxfp8_convert.runtime.hopper import jit
from mxfp8_convert.runtime.hopper.rules import DeviceFacts

#: Devices (by index) on which the GPU refused a clustered launch of the wgmma kernel (a cluster
#: of that size did not fit: a partitioned or smaller Hopper): their split-K partials go through
#: global memory from then on (``launch._launch_wgmma``).
CLUSTERS_REFUSED: set[int] = set()
#: SMs the rules assume under the CPU interpreter.
INTERPRETER_SMS = 4


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def e4m3_conversion(device: torch.device) -> bool:
    """Whether kernels on ``device`` round to e4m3 by the GPU's conversion instruction
    (``cvt.rn.satfinite.e4m3x2.f32``: compute capability 8.9 and later) rather than in fp32
    arithmetic (``jit._e4m3_bytes``); never under the interpreter, whose float8 cast does not
    round ties to even."""
    return (device.type == "cuda" and not interpreting()
            and _capability(device_index(device)) >= (8, 9))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for ``torch.device("cuda")``)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def gluon():
    """The Gluon kernel's module (``wgmma.py``), or None where Gluon (Triton >= 3.6's
    ``triton.experimental.gluon``) is missing."""
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return None  # Gluon's Hopper API before 3.6 differs from the one the kernel is written for
    try:
        from mxfp8_convert.runtime.hopper import wgmma
    except ImportError:
        return None
    return wgmma


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, or None where torch does not say."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        v = get() if get is not None else 0
    except RuntimeError:
        return None
    return (v // 1000, v % 1000 // 10) if v else None


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA version torch was built with, or None for a build without CUDA."""
    if not torch.version.cuda:
        return None
    return tuple(int(v) for v in torch.version.cuda.split(".")[:2])


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels may launch as programmatic dependents (PDL): on Hopper or newer, with a
    CUDA 12.4+ build of torch and driver (CUDA graphs capture the programmatic edges), a Triton
    with ``gdc_wait``, unless ``MXFP8_PDL=0``. FlashInfer enables PDL on the same GPUs
    (``device_support_pdl``). Each kernel waits for the previous one before it reads the
    activations or writes anything (``wgmma.wgmma_decode``); only the weight's first tile and
    scale words are loaded before that wait (:func:`weight_prefetch`; the activations' lines are
    only asked of L2 then, a hint that reads no value), so the previous kernel must not be the one
    that writes the weight (an in-place weight update is followed by a synchronization, or run
    with ``MXFP8_PDL=strict``). A kernel launched without the attribute is not affected."""
    cuda = torch_cuda_version()
    if (os.environ.get("MXFP8_PDL", "1") == "0" or jit.gdc_wait is None or device.type != "cuda"
            or cuda is None):
        return False
    driver = driver_cuda_version()  # minor-version compatibility: a 12.4+ torch on older drivers
    return (cuda >= (12, 4) and (driver is None or driver >= (12, 4))
            and torch.cuda.get_device_capability(device)[0] >= 9)


_BLOCK_FP8: dict[int, bool] = {}


def block_fp8(device: torch.device) -> bool:
    """Whether cuBLAS runs an FP8 GEMM with one fp32 scale per 128 elements of K on both
    operands here (``torch._scaled_mm``'s 1x128 x 1x128 recipe: Hopper and a CUDA 12.9+ build
    of torch; then asked once per device, :func:`scaled_mm_1x128`)."""
    cuda = torch_cuda_version()
    if (device.type != "cuda" or cuda is None or cuda < (12, 9)
            or torch.cuda.get_device_capability(device) != (9, 0)):
        return False
    index = device_index(device)
    if index not in _BLOCK_FP8:
        _BLOCK_FP8[index] = scaled_mm_1x128(device)
    return _BLOCK_FP8[index]


def scaled_mm_1x128(device: torch.device) -> bool:
    """A 128 x 256 x 128 ``torch._scaled_mm`` with 1x128 scales on both operands runs on
    ``device`` (its refusal is a RuntimeError)."""
    a = torch.zeros((128, 256), dtype=torch.float8_e4m3fn, device=device)
    s = torch.ones((2, 128), dtype=torch.float32, device=device)  # [K/128, M] and [K/128, N]
    try:
        torch._scaled_mm(a, a.t(), scale_a=s.t(), scale_b=s, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def weight_prefetch() -> bool:
    """Whether kernels launched with PDL load the weight's first K-tile and scale words, and ask L2
    for the activations' lines, before waiting for the previous kernel (default), or touch every
    byte after it (``MXFP8_PDL=strict``)."""
    return os.environ.get("MXFP8_PDL", "1") != "strict"


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of ``device`` (a CUDA GPU, or the CPU under Triton's interpreter)."""
    if device.type != "cuda":
        return DeviceFacts(sms=num_sms(device), capability=None, weight_prefetch=weight_prefetch())
    cap = tuple(torch.cuda.get_device_capability(device))
    return DeviceFacts(
        sms=num_sms(device), capability=cap, gluon=cap[0] == 9 and gluon() is not None,
        pdl=pdl_enabled(device), weight_prefetch=weight_prefetch(),
        clusters=device_index(device) not in CLUSTERS_REFUSED, block_fp8=block_fp8(device),
    )
