"""mxfp8-convert: lay out MXFP8 checkpoints offline for FlashInfer's mm_mxfp8 kernels.

Public API::

    from mxfp8_convert import convert, plan_conversion, detect, BACKENDS, FORMATS
    result = convert("path/to/model", "trtllm", "path/to/out")
"""

from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BACKENDS, FLASHINFER_LAYOUT_VERSION, FORMAT_VERSION  # noqa: E402
from mxfp8_convert.convert import (  # noqa: E402
    ConversionResult,
    ProgressEvent,
    convert,
    default_output,
    plan_conversion,
)
from mxfp8_convert.errors import ConvertError  # noqa: E402
from mxfp8_convert.formats import FORMATS, detect  # noqa: E402
from mxfp8_convert.plan import ConversionPlan, build_plan  # noqa: E402
from mxfp8_convert.read import open_checkpoint  # noqa: E402

__all__ = [
    "BACKENDS",
    "FORMATS",
    "FLASHINFER_LAYOUT_VERSION",
    "FORMAT_VERSION",
    "ConversionPlan",
    "ConversionResult",
    "ConvertError",
    "ProgressEvent",
    "__version__",
    "build_plan",
    "convert",
    "default_output",
    "detect",
    "open_checkpoint",
    "plan_conversion",
]
