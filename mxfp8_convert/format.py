"""The on-disk contract of an mxfp8-convert output: docs/FORMAT.md in code.

Every name a converted checkpoint carries on disk is defined here once (file names, tensor-name
suffixes, ``quant_method`` values, safetensors metadata keys, layout names, the fused MoE
tensors), together with the two records it holds:

* :class:`Marker`: config.json's ``quantization_config`` of a laid-out checkpoint (FORMAT.md
  section 2), also JSON-encoded in every shard's ``__metadata__`` and in the index;
* :class:`Completion`: the completion marker ``mxfp8_convert.complete.json``, written last
  (FORMAT.md section 1a).

Both parse from JSON dicts with validation (our own errors, one line naming the file) and give
back the same dicts with ``to_dict()``. :func:`read_json` is the one reader of these files.
This module imports nothing but the error module, so engine plug-ins can use it alone.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from mxfp8_convert.errors import ConvertError, MarkerError

# --------------------------------------------------------------------------------------------
# Versions and fixed values of the marker (FORMAT.md section 2)
# --------------------------------------------------------------------------------------------
#: version of this contract; a reader refuses versions it does not know (2: ``tp_compat``)
FORMAT_VERSION = 2
#: versions this release reads: version 1 has the same tensors and bytes, no ``tp_compat``
READABLE_FORMAT_VERSIONS = (1, 2)
#: FlashInfer release whose kernel layouts the output follows (recorded in every output)
FLASHINFER_LAYOUT_VERSION = "0.7.2.post1"
#: the trtllm-gen epilogue tile the P32 shuffle is made for; every known caller uses 128
EPILOGUE_TILE_M = 128
#: MXFP8 block: one UE8M0 scale per 1x32 weights along K
BLOCK_SIZE = 32
WEIGHT_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "uint8"
TOOL_NAME = "mxfp8-convert"
#: how ``source.fingerprint`` is computed (FORMAT.md section 5)
FINGERPRINT_METHOD = "headers-v1"

# --------------------------------------------------------------------------------------------
# quant_method values
# --------------------------------------------------------------------------------------------
#: config.json ``quant_method`` of a laid-out checkpoint; no engine knows it unless it
#: implements FORMAT.md
QUANT_METHOD = "mxfp8_convert"
#: ``quant_method`` of plain SGLang/Miles MXFP8 (the ``canonical`` backend's output)
CANONICAL_QUANT_METHOD = "mxfp8"

# --------------------------------------------------------------------------------------------
# File names (FORMAT.md section 1)
# --------------------------------------------------------------------------------------------
CONFIG_FILE = "config.json"
#: written when the output has more than one shard (or the source had an index)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: the completion marker, written last: a folder without it is not a result
COMPLETE_MARKER = "mxfp8_convert.complete.json"
#: suffix of the work folder ``.<name>.mxfp8-partial`` beside the destination
PARTIAL_SUFFIX = ".mxfp8-partial"
#: how the manifests of a work folder (and their temporary files) begin
PARTIAL_MANIFEST_PREFIX = "mxfp8_convert.partial"
#: manifest of a work folder (whole conversion)
PARTIAL_MANIFEST = f"{PARTIAL_MANIFEST_PREFIX}.json"
#: glob of the manifests of a conversion split into parts
PART_MANIFEST_GLOB = f"{PARTIAL_MANIFEST_PREFIX}.part-*-of-*.json"


def part_manifest(part: int, num_parts: int) -> str:
    """Manifest name of part ``part`` of ``num_parts`` (matches :data:`PART_MANIFEST_GLOB`)."""
    return f"{PARTIAL_MANIFEST_PREFIX}.part-{part}-of-{num_parts}.json"


# --------------------------------------------------------------------------------------------
# Tensor names and safetensors metadata (FORMAT.md section 3)
# --------------------------------------------------------------------------------------------
#: scale tensor suffix of a laid-out module: ``P.weight_scale_swizzled``
SWIZZLED_SUFFIX = "weight_scale_swizzled"
#: scale tensor suffix of a module kept canonical (and of plain SGLang/Miles MXFP8)
CANONICAL_SUFFIX = "weight_scale_inv"
#: ``__metadata__`` key (and index ``metadata`` key) holding the marker, JSON-encoded
META_MARKER = "mxfp8_convert"
#: ``__metadata__`` key holding the shard's per-tensor records, JSON-encoded
META_TENSORS = "mxfp8_convert.tensors"
#: layout name of tensors kept in canonical MXFP8 (per-tensor records, ``MXFP8Weight.layout``)
CANONICAL_LAYOUT = "canonical"


@dataclass(frozen=True, slots=True)
class KernelLayout:
    """The layout names recorded for one backend: the marker's ``weight_layout`` and
    ``scale_layout``, and the per-tensor records' ``layout``."""

    weight: str
    scale: str


#: backend -> layout names (FORMAT.md sections 2-3); ``canonical`` is plain MXFP8, no kernel
LAYOUTS: dict[str, KernelLayout] = {
    "trtllm": KernelLayout(weight="p32_rows", scale="pad128_p32_128x4"),
    "cutlass": KernelLayout(weight="identity", scale="128x4"),
    "canonical": KernelLayout(weight=CANONICAL_LAYOUT, scale="linear"),
}
#: the backends whose outputs carry a :class:`Marker` (FlashInfer ``mm_mxfp8`` backends)
LAID_OUT_BACKENDS = tuple(b for b, lay in LAYOUTS.items() if lay.weight != CANONICAL_LAYOUT)

# --------------------------------------------------------------------------------------------
# Fused MoE blocks (FORMAT.md section 3a)
# --------------------------------------------------------------------------------------------
#: ``moe.layout`` of fused MoE tensors (and their per-tensor records' ``layout``)
MOE_LAYOUT = "trtllm_fused_moe"
#: fused tensor of one block by role -> its name suffix (``<block>.<suffix>``)
MOE_TENSORS: dict[str, str] = {
    "moe_fc1_weight": "w13_weight",
    "moe_fc1_scale": "w13_weight_scale_swizzled",
    "moe_fc2_weight": "w2_weight",
    "moe_fc2_scale": "w2_weight_scale_swizzled",
}
#: the kernel and recipe the marker's ``moe`` entry names (descriptive strings, fixed)
MOE_KERNEL = ("trtllm_fp8_block_scale_moe (Fp8QuantizationType.MxFp8, use_shuffled_weight=True, "
              "weight_layout=MajorK)")
MOE_FC1 = "cat([up, gate]) rows interleaved then P32"
MOE_FC2 = "P32"
MOE_SCALES = "same rows, 128x4"
#: the projections of an expert, as keys of ``moe.experts_suffixes``
EXPERT_ROLES = ("gate", "up", "down")


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def read_json(path: str | Path, what: str, *, error: type[ConvertError] = MarkerError) -> dict:
    """The JSON object in ``path`` (a config, index, marker or manifest of ours).

    Args:
        path: the file.
        what: what it is, for messages (``"completion marker"``).
        error: the error class to raise (the caller's: verify, publish, the loader).

    Raises:
        error: ``"<path>: no <what>"``, or ``"<path>: unreadable <what> (<reason>)"`` for a file
            that cannot be read, is not UTF-8 JSON or is not a JSON object.
    """
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no {what}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON
        raise error(f"{p}: unreadable {what} ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise error(f"{p}: unreadable {what} (not a JSON object)")
    return obj


class _Invalid(ValueError):
    """A value that does not fit its key; the parser adds the file and the key."""


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _Invalid(f"{v!r} is not a string")
    return v


def _str_or_null(v: Any) -> str | None:
    return None if v is None else _str(v)


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _Invalid(f"{v!r} is not true or false")
    return v


def _int(v: Any) -> int:
    if type(v) is not int:
        raise _Invalid(f"{v!r} is not an integer")
    return v


def _names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _Invalid(f"{v!r} is not a list of strings")
    return tuple(v)


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise _Invalid(f"{v!r} is not a list of integers")
    return tuple(v)


def _str_map(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        raise _Invalid(f"{v!r} is not an object of strings")
    return dict(v)


def _object_or_null(v: Any) -> dict | None:
    if v is not None and not isinstance(v, dict):
        raise _Invalid(f"{v!r} is not an object or null")
    return v


def _key(check, *, default: Any = MISSING, absent: Any = MISSING, factory: Any = MISSING):
    """A record key: ``check(json value) -> field value`` (raises ``_Invalid``); ``default`` /
    ``factory`` for construction; ``absent``: the value when the file lacks the key (else the
    key is required)."""
    return field(default=default, default_factory=factory,
                 metadata={"check": check, "absent": absent})


def _plain(v: Any) -> Any:
    """A field value as JSON: records to dicts, tuples to lists."""
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


class _Record:
    """A JSON object with one dataclass field per key, in the order written."""

    __slots__ = ()

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def _parse(cls, d: Any, where: str, error: type[ConvertError]):
        if not isinstance(d, dict):
            raise error(f"{where}: {d!r} is not an object")
        values = {}
        for f in fields(cls):
            if f.name not in d:
                if f.metadata["absent"] is MISSING:
                    raise error(f"{where}: no {f.name!r}")
                values[f.name] = f.metadata["absent"]
                continue
            try:
                values[f.name] = f.metadata["check"](d[f.name])
            except _Invalid as e:
                raise error(f"{where}: {f.name}: {e}") from None
        return cls(**values)


def _record(cls):
    """``check`` for a nested record field (or null, when the field's ``absent`` is None)."""
    def check(v):
        if v is None:
            return None
        try:
            return cls._parse(v, "", _NestedError)
        except _NestedError as e:
            raise _Invalid(str(e).removeprefix(": ")) from None
    return check


class _NestedError(ConvertError):
    pass


# --------------------------------------------------------------------------------------------
# The marker (FORMAT.md section 2)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Tool(_Record):
    """``tool``: what wrote the output."""

    name: str = _key(_str, default=TOOL_NAME)
    version: str = _key(_str)


@dataclass(frozen=True, slots=True, kw_only=True)
class Source(_Record):
    """``source``: what the output was made from."""

    dialect: str = _key(_str)  # a FormatSpec name: sglang_mxfp8, compressed_tensors_mxfp8, ...
    fingerprint: str = _key(_str)  # sha256:<hex>, FORMAT.md section 5
    fingerprint_method: str = _key(_str, default=FINGERPRINT_METHOD)


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeMarker(_Record):
    """``moe``: the fused MoE blocks (FORMAT.md section 3a)."""

    layout: str = _key(_str, default=MOE_LAYOUT)
    kernel: str = _key(_str, default=MOE_KERNEL)
    fc1: str = _key(_str, default=MOE_FC1)
    fc2: str = _key(_str, default=MOE_FC2)
    scales: str = _key(_str, default=MOE_SCALES)
    tensors: dict[str, str] = _key(_str_map, factory=lambda: dict(MOE_TENSORS), absent=MOE_TENSORS)
    experts_suffixes: dict[str, str] = _key(_str_map)  # role (EXPERT_ROLES) -> source name
    layers: tuple[str, ...] = _key(_names)  # every fused block, e.g. model.layers.3.mlp.experts

    def tensor_names(self) -> dict[str, str]:
        """Role -> name suffix of the fused tensors (the marker's, over the defaults)."""
        return {**MOE_TENSORS, **self.tensors}


#: marker keys that define the bytes: a shard's marker must agree with config.json on each
LAYOUT_KEYS = (
    "quant_method", "format_version", "backend", "weight_layout", "scale_layout",
    "epilogue_tile_m", "block_size", "weight_dtype", "scale_dtype", "scale_suffix",
    "flashinfer_layout_version",
)


_CONVERT = "convert it first with `mxfp8-convert convert`"
_SAME_RELEASE = "use the mxfp8-convert release that wrote it"


def _identity_problem(quant_method: Any, format_version: Any) -> tuple[str, str] | None:
    """Another tool's marker, or one of another format version: (message, hint), else None."""
    if quant_method != QUANT_METHOD:
        return (f"quant_method is {quant_method!r}, not {QUANT_METHOD!r}: "
                "not an mxfp8-convert output"), _CONVERT
    if format_version not in READABLE_FORMAT_VERSIONS:
        readable = ", ".join(map(str, READABLE_FORMAT_VERSIONS))
        return (f"format_version {format_version!r} is not supported "
                f"(this release reads {readable})"), _SAME_RELEASE
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Marker(_Record):
    """config.json's ``quantization_config`` of a laid-out checkpoint (FORMAT.md section 2).

    One field per key, in the order written; a new key is one line here (its check, its
    default, and its value in markers written before it, ``absent``). ``Marker.parse`` refuses
    a marker of another tool, another format version, an unknown backend or layout names that do
    not match the backend.
    """

    quant_method: str = _key(_str, default=QUANT_METHOD)
    format_version: int = _key(_int, default=FORMAT_VERSION)
    backend: str = _key(_str)
    weight_layout: str = _key(_str)
    scale_layout: str = _key(_str)
    epilogue_tile_m: int = _key(_int, default=EPILOGUE_TILE_M)
    block_size: int = _key(_int, default=BLOCK_SIZE)
    weight_dtype: str = _key(_str, default=WEIGHT_DTYPE)
    scale_dtype: str = _key(_str, default=SCALE_DTYPE)
    scale_suffix: str = _key(_str, default=SWIZZLED_SUFFIX)
    flashinfer_layout_version: str = _key(_str, default=FLASHINFER_LAYOUT_VERSION)
    tool: Tool = _key(_record(Tool))
    source: Source = _key(_record(Source))
    ignored_layers: tuple[str, ...] = _key(_names, default=())
    moe: MoeMarker | None = _key(_record(MoeMarker), default=None, absent=None)
    #: tensor-parallel sizes at which every module slices on tile boundaries (FORMAT.md 2a)
    tp_compat: tuple[int, ...] | None = _key(_ints, default=None, absent=None)
    #: the source's FP8 KV cache, compressed-tensors ``kv_cache_scheme`` form (FORMAT.md 2)
    kv_cache_scheme: dict | None = _key(_object_or_null, default=None, absent=None)
    original_quantization_config: dict | None = _key(_object_or_null, default=None, absent=None)

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise MarkerError(f"marker: {problem[0]}", hint=problem[1])

    def problem(self) -> tuple[str, str | None] | None:
        """What makes this marker unreadable for this release, and a hint (None if nothing)."""
        first = _identity_problem(self.quant_method, self.format_version)
        if first:
            return first
        if self.backend not in LAID_OUT_BACKENDS:
            return f"unknown backend {self.backend!r} (known: {', '.join(LAID_OUT_BACKENDS)})", None
        for key, want in self.expected().items():
            if getattr(self, key) != want:
                return (f"marker {key}={getattr(self, key)!r} does not match backend "
                        f"{self.backend} ({want!r})"), None
        if self.moe is not None and self.moe.layout != MOE_LAYOUT:
            return f"fused MoE layout {self.moe.layout!r} is not {MOE_LAYOUT!r}", None
        return None

    def expected(self) -> dict[str, Any]:
        """The keys whose value the backend fixes, with that value."""
        lay = LAYOUTS[self.backend]
        return {"weight_layout": lay.weight, "scale_layout": lay.scale, "block_size": BLOCK_SIZE,
                "weight_dtype": WEIGHT_DTYPE, "scale_dtype": SCALE_DTYPE,
                "scale_suffix": SWIZZLED_SUFFIX, "epilogue_tile_m": EPILOGUE_TILE_M}

    @classmethod
    def parse(cls, d: Any, where: str, *, error: type[ConvertError] = MarkerError) -> Marker:
        """Validate a ``quantization_config`` dict read from ``where`` (a file name, for messages).

        Raises:
            error: one line ``"<where>: <what is wrong>"``; a ``quant_method`` of another tool
                and an unknown ``format_version`` are named before anything else.
        """
        if not isinstance(d, dict):
            raise error(f"{where}: no quantization_config: not an mxfp8-convert output",
                        hint=_CONVERT)
        first = _identity_problem(d.get("quant_method"), d.get("format_version"))
        if first:
            raise error(f"{where}: {first[0]}", hint=first[1])
        try:
            return cls._parse(d, where, error)
        except MarkerError as e:
            if error is MarkerError and str(e).startswith(f"{where}: "):
                raise
            raise error(f"{where}: {str(e).removeprefix('marker: ')}", hint=e.hint) from None

    @property
    def layout(self) -> KernelLayout:
        return LAYOUTS[self.backend]


def make_marker(backend: str, *, dialect: str, fingerprint: str, tool_version: str,
                ignored_layers: list[str] | tuple[str, ...] = (),
                moe: MoeMarker | None = None, original: dict | None = None,
                tp_compat: list[int] | tuple[int, ...] | None = None,
                kv_cache_scheme: dict | None = None) -> Marker:
    """The marker of an output laid out for ``backend`` (``trtllm`` or ``cutlass``).

    ``ignored_layers`` is sorted and deduplicated; ``original`` is the source's own
    ``quantization_config``. Raises MarkerError for a backend without a kernel layout.
    """
    if backend not in LAID_OUT_BACKENDS:
        raise MarkerError(f"backend {backend!r} has no kernel layout, so no marker")
    lay = LAYOUTS[backend]
    return Marker(backend=backend, weight_layout=lay.weight, scale_layout=lay.scale,
                  tool=Tool(version=tool_version),
                  source=Source(dialect=dialect, fingerprint=fingerprint),
                  ignored_layers=tuple(sorted(set(ignored_layers))), moe=moe,
                  tp_compat=None if tp_compat is None else tuple(tp_compat),
                  kv_cache_scheme=kv_cache_scheme, original_quantization_config=original)


def canonical_config(original: dict | None, ignored_layers: list[str] | tuple[str, ...],
                     kv_cache_scheme: dict | None = None) -> dict:
    """config.json ``quantization_config`` of plain SGLang/Miles MXFP8 (``canonical`` output).
    ``ignored_layers``: the exact names of the linear modules left unquantized."""
    ignored = sorted(set(ignored_layers))
    if original and original.get("quant_method") == CANONICAL_QUANT_METHOD:
        # came from SGLang MXFP8: its config back, with the modules this output leaves unquantized
        if set(original.get("ignored_layers") or []) == set(ignored):
            return original
        return {**original, "ignored_layers": ignored}
    out = {"quant_method": CANONICAL_QUANT_METHOD, "fmt": "e4m3",
           "weight_block_size": [1, BLOCK_SIZE], "scale_fmt": "ue8m0",
           "activation_scheme": "dynamic", "ignored_layers": ignored}
    return {**out, "kv_cache_scheme": kv_cache_scheme} if kv_cache_scheme else out


def is_marker(qc: Any) -> bool:
    """Whether a ``quantization_config`` claims to be ours (``quant_method``), valid or not."""
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


# --------------------------------------------------------------------------------------------
# The completion marker (FORMAT.md section 1a)
# --------------------------------------------------------------------------------------------
_HEX128 = re.compile(r"[0-9a-f]{32}")


def check_relpath(rel: Any) -> str:
    """``rel`` if it is a normalised relative POSIX path inside a folder (no ``..``, no leading
    ``/``, one spelling per file), else raise ``_Invalid``."""
    if (not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel or rel.startswith("/")
            or ".." in rel.split("/") or posixpath.normpath(rel) != rel):
        raise _Invalid(f"{rel!r} is not a path inside the folder")
    return rel


@dataclass(frozen=True, slots=True, kw_only=True)
class FileRecord(_Record):
    """One file of the output: its size in bytes and the hex xxh3-128 digest of its bytes."""

    size: int = _key(_int)
    xxh3_128: str = _key(_str)

    def __post_init__(self) -> None:
        if self.size < 0 or not _HEX128.fullmatch(self.xxh3_128):
            raise MarkerError(f"file record: size {self.size!r} / xxh3_128 {self.xxh3_128!r} "
                              "is not a size and a 32-digit hex digest")


def _files(v: Any) -> dict[str, FileRecord]:
    if not isinstance(v, dict):
        raise _Invalid(f"{v!r} is not an object")
    out = {}
    for rel, rec in v.items():
        check_relpath(rel)
        try:
            out[rel] = FileRecord._parse(rec, "", _NestedError)
        except (_NestedError, MarkerError) as e:
            raise _Invalid(f"{rel!r}: {str(e).removeprefix(': ')}") from None
    return out


def _errors(v: Any) -> dict[str, dict]:
    if not isinstance(v, dict) or not all(isinstance(x, dict) for x in v.values()):
        raise _Invalid(f"{v!r} is not an object of objects")
    return dict(v)


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion(_Record):
    """The completion marker ``mxfp8_convert.complete.json`` (FORMAT.md section 1a).

    ``files`` lists every file of the output but this one, by relative path;
    ``quantization_errors`` holds, per module quantized or requantized, its error against the
    source (``action``, ``rel_fro``, ``sqnr_db``).
    """

    format_version: int = _key(_int, default=FORMAT_VERSION)
    backend: str = _key(_str)
    tool_version: str = _key(_str)
    source_fingerprint: str = _key(_str)
    #: the source format the conversion read, and whether linears outside the language model
    #: were quantized: ``verify --source`` plans the source again with both
    source_format: str | None = _key(_str_or_null, default=None, absent=None)
    quantize_towers: bool = _key(_bool, default=False, absent=False)
    quantization_errors: dict[str, dict] = _key(_errors, factory=dict)
    files: dict[str, FileRecord] = _key(_files, factory=dict)

    def __post_init__(self) -> None:
        if self.format_version not in READABLE_FORMAT_VERSIONS:
            raise MarkerError(f"completion marker: format_version {self.format_version!r} "
                              f"is not one of {', '.join(map(str, READABLE_FORMAT_VERSIONS))}")
        if self.backend not in LAYOUTS:
            raise MarkerError(f"completion marker: unknown backend {self.backend!r}")

    @classmethod
    def parse(cls, d: Any, where: str, *, error: type[ConvertError] = MarkerError) -> Completion:
        """Validate a completion record read from ``where``.

        Raises:
            error: ``"<where>: not a format_version 1 completion marker (<what>)"``.
        """
        versions = "/".join(map(str, READABLE_FORMAT_VERSIONS))
        what = f"not a format_version {versions} completion marker"
        try:
            return cls._parse(d, where, _NestedError)
        except (_NestedError, MarkerError) as e:
            detail = str(e).removeprefix(f"{where}: ").removeprefix("completion marker: ")
            raise error(f"{where}: {what} ({detail})") from None

    @classmethod
    def read(cls, root: str | Path, *, error: type[ConvertError] = MarkerError) -> Completion:
        """The completion marker of output folder ``root`` (see :func:`read_json` and
        :meth:`parse` for the errors)."""
        path = Path(root) / COMPLETE_MARKER
        return cls.parse(read_json(path, "completion marker", error=error), str(path), error=error)


def file_digest(path: str | Path, *, follow_links: bool = True) -> str:
    """The ``xxh3_128`` of a ``files`` entry: hex xxh3-128 digest of the file's bytes.

    The file must be a regular one (a FIFO is refused, not waited on). ``follow_links=False``
    refuses a link too (our own work folder's files); a downloaded output's files may be links
    into the Hub cache's blobs, which the loader and ``verify`` check are inside the folder."""
    import errno
    import os
    import stat

    import xxhash

    h = xxhash.xxh3_128()
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_record(size: int, digest: str) -> dict:
    """The JSON of one ``files`` entry (a :class:`FileRecord`)."""
    return FileRecord(size=size, xxh3_128=digest).to_dict()
