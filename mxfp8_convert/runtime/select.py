"""Table of runtime engines and the automatic choice between them.

| engine | runs on | layouts | how |
|---|---|---|---|
| ``flashinfer`` | SM100 family (per the layout's compute capabilities) | trtllm, cutlass |
``mm_mxfp8`` |
| ``triton`` | Hopper SM90 (any CUDA GPU with bf16 MMA, SM80+) | trtllm, cutlass, canonical | our
kernel |
| ``reference`` | anywhere (CPU included) | all | invert layout, float32 matmul |

``engine="auto"`` picks flashinfer on SM100+, triton on SM80/SM90, reference on CPU; the
environment variable ``MXFP8_CONVERT_ENGINE`` overrides ``auto``. Adding an engine means one
entry in ``ENGINES``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import BackendUnavailableError, MarkerError
from mxfp8_convert.runtime.weight import CANONICAL, KERNEL_LAYOUTS, MXFP8Weight

ENV_ENGINE = "MXFP8_CONVERT_ENGINE"


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, refusing a CUDA device this machine does not have.

    Raises:
        BackendUnavailableError: CUDA asked for but torch has no CUDA, finds no GPU, or fewer
            GPUs than the index (instead of torch's bare ``AssertionError``).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if torch.version.cuda is None and torch.version.hip is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
    elif not torch.cuda.is_available():
        why = "torch finds no CUDA GPU"
    elif device.index is not None and device.index >= torch.cuda.device_count():
        why = f"torch finds {torch.cuda.device_count()} CUDA GPU(s)"
    else:
        return device
    raise BackendUnavailableError(
        f"device {device!s} is not available: {why}",
        hint="use device='cpu' (the reference engine), or install a CUDA torch")


def _capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _where(device: torch.device) -> str:
    if device.type != "cuda":
        return f"device {device}"
    return f"{torch.cuda.get_device_name(device)} (SM{_capability(device)})"


def _check_flashinfer(device: torch.device, layout: str) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"engine 'flashinfer' needs an SM100-family GPU, got {_where(device)}",
            hint="use engine='reference' on CPU",
        )
    cc = _capability(device)
    if layout not in KERNEL_LAYOUTS:
        raise MarkerError(
            f"engine 'flashinfer' cannot run layout {layout!r} without re-laying it out",
            hint="use engine='triton' or 'reference', or convert the module for trtllm/cutlass",
        )
    supported = BACKENDS[layout].compute_capabilities
    if cc not in supported:
        others = [b for b in KERNEL_LAYOUTS if cc in BACKENDS[b].compute_capabilities]
        hint = (
            "use engine='triton'"
            if cc < 100
            else f"convert for {' or '.join(others) or 'another backend'}"
        )
        raise (MarkerError if others else BackendUnavailableError)(
            f"checkpoint is laid out for FlashInfer's {layout} mm_mxfp8, which runs on "
            f"SM{'/'.join(map(str, supported))}; this GPU is {_where(device)}",
            hint=hint,
        )
    if importlib.util.find_spec("flashinfer") is None:
        from mxfp8_convert.runtime.sm100 import INSTALL_HINT

        raise BackendUnavailableError(
            "engine 'flashinfer' needs FlashInfer, which is not installed", hint=INSTALL_HINT
        )


def _check_triton(device: torch.device, layout: str) -> None:
    if importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(
            "engine 'triton' needs Triton, which is not installed",
            hint="pip install 'mxfp8-convert[triton]', or use engine='reference'",
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return  # Triton's interpreter: tests only
    if device.type != "cuda" or _capability(device) < 80:
        raise BackendUnavailableError(
            f"engine 'triton' needs a CUDA GPU with bf16 tensor cores (SM80+), "
            f"got {_where(device)}",
            hint="use engine='reference' (or TRITON_INTERPRET=1 for tests on CPU)",
        )


def _check_reference(device: torch.device, layout: str) -> None:
    return None


def _run_flashinfer(x, weight, bias):
    from mxfp8_convert.runtime.sm100 import flashinfer_linear

    return flashinfer_linear(x, weight, bias)


def _run_triton(x, weight, bias):
    from mxfp8_convert.runtime.hopper.launch import triton_linear

    return triton_linear(x, weight, bias)


def _run_reference(x, weight, bias):
    from mxfp8_convert.runtime.reference import reference_linear

    q, code = weight.canonical()
    return reference_linear(x, q, code, bias)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One way to run an MXFP8 linear: which layouts it reads and where it can run."""

    name: str
    layouts: tuple[str, ...]
    check: Callable[[torch.device, str], None]  # raises when it cannot run `layout` on `device`
    run: Callable[
        [torch.Tensor, MXFP8Weight, torch.Tensor | None], torch.Tensor
    ]  # x [M, K] -> bf16


ENGINES: dict[str, EngineSpec] = {
    "flashinfer": EngineSpec("flashinfer", KERNEL_LAYOUTS, _check_flashinfer, _run_flashinfer),
    "triton": EngineSpec("triton", (*KERNEL_LAYOUTS, CANONICAL), _check_triton, _run_triton),
    "reference": EngineSpec(
        "reference", (*KERNEL_LAYOUTS, CANONICAL), _check_reference, _run_reference
    ),
}


def auto_engine(device: torch.device | str) -> str:
    """The engine ``auto`` means on ``device`` (``MXFP8_CONVERT_ENGINE`` overrides it)."""
    forced = os.environ.get(ENV_ENGINE)
    if forced:
        return resolve_engine(forced, device)
    device = check_device(device)
    if device.type != "cuda":
        return "reference"
    return "flashinfer" if _capability(device) >= 100 else "triton"


def resolve_engine(engine: str, device: torch.device | str) -> str:
    """Map ``"auto"`` to a concrete engine name; reject unknown names."""
    if engine == "auto":
        return auto_engine(device)
    if engine not in ENGINES:
        raise BackendUnavailableError(
            f"unknown engine {engine!r}", hint=f"choose one of: auto, {', '.join(ENGINES)}"
        )
    return engine


def check_engine(engine: str, device: torch.device | str, layout: str) -> str:
    """Resolve ``engine`` and make sure it can run ``layout`` on ``device``; returns its name.

    Raises:
        BackendUnavailableError: the engine's package or GPU is missing.
        MarkerError: the checkpoint's layout is not one this engine runs here.
    """
    device = check_device(device)
    name = resolve_engine(engine, device)
    spec = ENGINES[name]
    if layout not in spec.layouts:
        raise MarkerError(f"engine {name!r} cannot run layout {layout!r}")
    spec.check(device, layout)
    return name
