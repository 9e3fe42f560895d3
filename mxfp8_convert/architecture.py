"""Which tensors of a dense checkpoint are linear weights, and of which part of the model.

Decided from the architecture where it can be built: transformers (an optional dependency,
``pip install mxfp8-convert[transformers]``) builds the model that config.json names on the
meta device (no weight is allocated, no remote code is run), and every checkpoint tensor is
mapped to the module that owns it with transformers' own checkpoint renamings. A tensor is a
linear weight when its module is an ``nn.Linear`` (or an expert of a MoE experts module); it is
quantized by default only inside the language model (``get_decoder()``), never when it is the
output projection, a router or a gate (a linear of one output, or of one output per expert).
Name rules (``NameRules``) decide only where the architecture cannot be built (no
transformers, a ``model_type`` it does not know, a config it rejects) or does not have the
tensor; every decision says which way it was made.

Building it costs seconds of imports (transformers' model modules pull in ``torch._dynamo``,
``torch.distributed.tensor`` and triton), so ``decisions()`` keeps the decisions it made for a
checkpoint's tensors in the user's cache (``$XDG_CACHE_HOME/mxfp8-convert/architecture``),
under a key of everything they depend on: this module's source, the installed transformers and
torch (version and their wheel's file list with hashes), config.json and the tensors' names and
shapes. A file that does not read back as exactly the entry for that key is ignored and made
again. Where they are not cached, ``decisions_later()`` makes them in a child process (a fork
of the caller, or this file run as a script) while the caller goes on without them: a
conversion plans on the name rules meanwhile and keeps what it wrote only if the
architecture's plan writes the same bytes (``run.plan_guessing``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: what a checkpoint weight is; ``QUANTIZED_KINDS`` are quantized by default
KINDS = {
    "linear": "a linear layer of the language model",
    "expert": "an expert projection of a MoE block",
    "stacked_experts": "the experts of a MoE block stacked in one 3-D tensor",
    "outside": "a linear layer outside the language model (vision/audio tower, projector, head)",
    "head": "the output projection (lm_head)",
    "router": "a MoE router or a gate",
    "other": "not a linear layer (embedding, norm, convolution, ...)",
}
QUANTIZED_KINDS = ("linear", "expert")
#: config keys that hold the number of routed experts (Qwen-MoE, Mixtral/Llama-4/gpt-oss, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True, slots=True)
class Decision:
    """What one checkpoint weight is: ``kind`` (a key of ``KINDS``), ``basis`` (``architecture``
    or ``names``) and ``why`` (the module class or the rule, in a few words)."""

    kind: str
    basis: str
    why: str

    @property
    def quantized(self) -> bool:
        return self.kind in QUANTIZED_KINDS

    def to_dict(self) -> dict:
        return {"kind": self.kind, "decided_by": self.basis, "why": self.why}


# --- name rules: only where the architecture cannot be built ---------------------------------

#: last name component of modules that are not linear layers whatever their shape
_NOT_LINEAR = re.compile(r"embed|(^|_)(wte|wpe)$|norm|^ln(_|$)")
#: the output projection
_HEAD = re.compile(r"^(lm_head|output|score|classifier|embed_out)$")
#: routers and gates (``mlp.gate``, ``shared_expert_gate``; not ``gate_proj``)
_ROUTER = re.compile(r"(^|_)(gate|router)$")
#: name components of vision/audio towers and multimodal projectors (Qwen2-VL ``visual``,
#: LLaVA ``vision_tower`` / ``multi_modal_projector``, Llama-4 ``vision_model``, Whisper-style
#: ``audio_tower``, Qwen2-VL ``merger``)
_TOWER = re.compile(
    r"^(visual|vision|vision_tower|vision_model|vision_encoder|image_encoder|audio|audio_tower|"
    r"audio_model|audio_encoder|multi_modal_projector|mm_projector|merger|vision_projection)$"
)
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True, slots=True)
class NameRules:
    """The fallback: decide from names and shapes; ``reason`` says why the architecture was
    not used."""

    reason: str
    experts: int = 0

    @property
    def basis(self) -> str:
        return "names"

    def decide(self, tensor: str, shape: tuple[int, ...]) -> Decision:
        """What checkpoint tensor ``tensor`` (``P.weight``, or a stacked ``P``) is."""
        module = tensor[: -len(".weight")] if tensor.endswith(".weight") else tensor
        parts = module.split(".")
        last = parts[-1]
        why = f"name rules ({self.reason})"
        if _NOT_LINEAR.search(last):
            return Decision("other", "names", why)
        if _HEAD.match(last):
            return Decision("head", "names", why)
        if len(shape) == 3:
            return Decision("stacked_experts", "names", why)
        if len(shape) != 2:
            return Decision("other", "names", why)
        if _ROUTER.search(last) or shape[0] == 1 or (self.experts and shape[0] == self.experts):
            return Decision("router", "names", why)
        if any(_TOWER.match(p) for p in parts[:-1]):
            return Decision("outside", "names", why)
        return Decision("expert" if _EXPERT.search(f".{module}.") else "linear", "names", why)


# --- the architecture, built by transformers on the meta device ------------------------------


def _expert_count(config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in EXPERT_COUNT_KEYS:
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return 0


class ModelArchitecture:
    """The modules of the model config.json describes, and how checkpoint names map onto them."""

    basis = "architecture"

    def __init__(self, model, config: dict) -> None:
        import torch.nn as nn

        self.arch = type(model).__name__
        self.experts = _expert_count(config)
        self.fallback = NameRules(f"not a parameter of {self.arch}", self.experts)
        modules = dict(model.named_modules())
        self.params: dict[str, tuple[tuple[int, ...], object]] = {}
        for mname, mod in modules.items():
            for pname, p in mod.named_parameters(recurse=False):
                self.params[f"{mname}.{pname}" if mname else pname] = (tuple(p.shape), mod)
        self.linear = nn.Linear
        self.lm = _language_model_prefix(model, modules)
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = next((n for n, m in modules.items() if out is not None and m is out), None)
        self.rename = _renamer(model, self.params)

    def _owner(self, key: str) -> tuple[str, tuple[int, ...], object] | None:
        mk = self.rename(key)
        if mk in self.params:
            return (mk, *self.params[mk])
        hits = [k for k in self.params if k.endswith("." + key) or key.endswith("." + k)]
        return (hits[0], *self.params[hits[0]]) if len(hits) == 1 else None

    def decide(self, tensor: str, shape: tuple[int, ...]) -> Decision:
        """What checkpoint tensor ``tensor`` (``P.weight``, or a stacked ``P``) is."""
        found = self._owner(tensor)
        if found is None:
            return self.fallback.decide(tensor, shape)
        key, pshape, mod = found
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        cls = type(mod).__name__
        inside = self.lm == "" or owner == self.lm or owner.startswith(self.lm + ".")
        if isinstance(mod, self.linear) and key.endswith(".weight"):
            if tuple(shape) != pshape:
                return NameRules(
                    f"shape {list(shape)} is not {self.arch}'s {list(pshape)}", self.experts
                ).decide(tensor, shape)
            if owner == self.head:
                return Decision("head", "architecture", f"{cls} {owner}: the output projection")
            if mod.out_features == 1 or (self.experts and mod.out_features == self.experts):
                return Decision(
                    "router", "architecture", f"{cls} with {mod.out_features} output(s): a gate"
                )
            if not inside:
                return Decision(
                    "outside", "architecture", f"{cls} outside the language model ({self.lm})"
                )
            return Decision("linear", "architecture", f"{cls} of {self.arch}")
        if len(pshape) == 3 and len(shape) in (2, 3):
            kind = "expert" if len(shape) == 2 else "stacked_experts"
            if not inside:
                kind = "outside"
            return Decision(kind, "architecture", f"{cls} {key.rsplit('.', 1)[-1]} {list(pshape)}")
        kind = "router" if re.search("router|gate", cls, re.IGNORECASE) else "other"
        return Decision(kind, "architecture", cls)


def _language_model_prefix(model, modules: dict) -> str:
    """Module path of the language model: ``get_decoder()`` where it is a proper submodule
    (Qwen2-VL ``model.language_model``), else the whole model (decoders, encoder-decoders)."""
    if getattr(model.config, "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return ""
    try:
        dec = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        return ""
    return next((n for n, m in modules.items() if m is dec), "")


def _renamer(model, params: dict):
    """checkpoint key -> model key, with transformers' own conversion mapping (the renamings
    and expert merges ``from_pretrained`` applies); identity where that API is missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return lambda key: key
    transforms = get_model_conversion_mapping(model) or []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(params, True)
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, converters, prefix, meta)[0]

    return rename


@contextmanager
def _quiet(transformers):
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def architecture(config: dict | None) -> ModelArchitecture | NameRules:
    """The model config.json describes, built on the meta device, or the name rules (with the
    reason) where it cannot be built. Never runs remote code."""
    if not isinstance(config, dict) or not config:
        return NameRules("no config.json")
    experts = _expert_count(config)
    try:
        import torch
        import transformers
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return NameRules("transformers is not installed", experts)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return NameRules(
            f"model_type {model_type!r} unknown to transformers {transformers.__version__}", experts
        )
    # a deep copy: transformers standardizes nested dicts in place (it adds ``rope_theta`` to
    # ``rope_scaling``), which would leak into the output's config.json
    kwargs = copy.deepcopy(
        {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")})
    with _quiet(transformers):
        try:
            cfg = AutoConfig.for_model(model_type, **kwargs)
            cls = _model_class(transformers, config, cfg)
            with torch.device("meta"):
                model = cls(cfg)
        except Exception as e:  # noqa: BLE001 - any config transformers rejects: say so, use names
            return NameRules(
                f"transformers cannot build {model_type!r}: {type(e).__name__}", experts
            )
    return ModelArchitecture(model, config)


def _model_class(transformers, config: dict, cfg):
    """The class ``architectures`` names (a transformers model class), else the causal-LM or
    base model class of the config."""
    from transformers import PreTrainedModel

    for name in config.get("architectures") or []:
        try:
            cls = getattr(transformers, name) if isinstance(name, str) else None
        except (AttributeError, ImportError):  # not a transformers class, or its deps missing
            cls = None
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        mapping = auto._model_mapping
        if type(cfg) in mapping:
            return mapping[type(cfg)]
    raise ValueError(f"no transformers model class for {type(cfg).__name__}")


# --- the decisions, cached per (code, transformers, torch, config, tensors) -------------------

#: version of the cache files' contents; bump it when they change
CACHE_FORMAT = 1
#: set to anything but ``0`` to neither read nor write the cache (the architecture is built)
NO_CACHE_ENV = "MXFP8_CONVERT_NO_CACHE"
#: (tensor name, shape) of a checkpoint weight whose decision is asked for
Query = tuple[str, tuple[int, ...]]


class CachedDecisions:
    """The architecture's decisions for a checkpoint's tensors, read from the cache; a tensor
    they do not cover is decided by the architecture itself, built then (``build``)."""

    basis = "architecture"

    def __init__(self, made: dict[Query, Decision], build: Callable[[], object]) -> None:
        self.made, self._build, self._arch = made, build, None

    def decide(self, tensor: str, shape: tuple[int, ...]) -> Decision:
        """What checkpoint tensor ``tensor`` (``P.weight``, or a stacked ``P``) is."""
        d = self.made.get((tensor, tuple(shape)))
        if d is not None:
            return d
        if self._arch is None:
            self._arch = self._build()
        return self._arch.decide(tensor, shape)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mxfp8-convert`` (XDG: an unset, empty or relative value means
    ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mxfp8-convert"


def decisions(config: dict | None, tensors: list[Query]) -> ModelArchitecture | NameRules | \
        CachedDecisions:
    """``architecture(config)`` for deciding ``tensors``, through the cache: on a hit nothing
    is built (transformers is not imported); on a miss the architecture is built and, where it
    could be (``basis == "architecture"``), its decisions for ``tensors`` are cached. A cache
    that cannot be read or written is passed over: the decisions are the same either way.
    ``MXFP8_CONVERT_NO_CACHE=1`` leaves the cache alone (nothing read, nothing written)."""
    if os.environ.get(NO_CACHE_ENV, "") not in ("", "0"):
        return architecture(config)
    key = _cache_key(config, tensors)
    if key is None:  # no config.json, or no transformers: nothing worth caching
        return architecture(config)
    path = cache_root() / "architecture" / f"{key}.json"
    made = _read_cache(path, key, tensors)
    if made is not None:
        return CachedDecisions(made, lambda: architecture(config))
    arch = architecture(config)
    if arch.basis == "architecture":
        _write_cache(path, key, [(t, arch.decide(*t)) for t in tensors])
    return arch


def decisions_later(config: dict | None, tensors: list[Query]) -> Pending | None:
    """``decisions(config, tensors)`` made by a child process where they would be built here
    (not cached: the architecture is built), so that the caller need not wait for transformers'
    imports (``Pending.start()`` starts it); None where ``decisions()`` answers at once (a
    cache hit, no config.json, no transformers)."""
    if not isinstance(config, dict) or not config:
        return None
    key = _cache_key(config, tensors)
    if key is None:
        return None
    path = None
    if os.environ.get(NO_CACHE_ENV, "") in ("", "0"):
        path = cache_root() / "architecture" / f"{key}.json"
        if _read_cache(path, key, tensors) is not None:
            return None
    try:
        return Pending(config, tensors, key, path)
    except OSError:  # no temporary folder: decisions() builds it here
        return None


class Pending:
    """The decisions for ``tensors`` being made by a child process (``_child``: it builds the
    architecture with transformers; it never touches the caller's files). ``start()`` starts
    it; ``result()`` waits for it, caches its decisions as ``decisions()`` does (at ``path``;
    None: not cached), and makes them here where the child did not answer (it failed, was
    killed, or wrote anything but its answer): the same decisions, and any error raised here
    as it is today."""

    #: fork the child (Linux): it has what this process imported, torch included, and imports
    #: only transformers; elsewhere (macOS forbids forking a process that loaded some system
    #: frameworks) it is a new interpreter running this file, which imports torch itself; so
    #: it is too where this process runs other threads (a library caller's): a fork copies the
    #: locks they hold, and a child that waits on one of them never answers
    FORK = sys.platform == "linux"

    def __init__(self, config: dict, tensors: list[Query], key: str, path: Path | None) -> None:
        self.config, self.tensors, self.key, self.path = config, tensors, key, path
        self._folder = tempfile.TemporaryDirectory(prefix="mxfp8-convert-architecture-")
        try:
            (Path(self._folder.name) / "in.json").write_text(json.dumps(
                {"config": config, "tensors": [[n, list(shape)] for n, shape in tensors]}))
        except BaseException:
            self._folder.cleanup()
            raise
        self._proc: _Forked | subprocess.Popen | None = None
        self._made: CachedDecisions | NameRules | ModelArchitecture | None = None

    def start(self) -> None:
        """Start the child, once (best after torch is imported here, where it is forked)."""
        if self._proc is not None or self._made is not None:
            return
        folder = Path(self._folder.name)
        if self.FORK and threading.active_count() == 1:
            self._proc = _Forked(folder)
            return
        try:  # -P: the script's folder (this package) is not put on sys.path
            self._proc = subprocess.Popen(
                [sys.executable, "-P", str(Path(__file__).resolve()), str(folder)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:  # no process to start: result() builds it here
            self._proc = _Forked(None)

    def done(self) -> bool:
        """Whether ``result()`` returns without waiting for a child (False before ``start()``)."""
        return self._made is not None or (self._proc is not None and self._proc.poll() is not None)

    def result(self) -> CachedDecisions | NameRules | ModelArchitecture:
        """What ``decisions(config, tensors)`` returns on a cache miss, for the same tensors."""
        if self._made is None:
            self.start()
            self._proc.wait()
            made = self._answer()
            self.close()
            if made is None:  # the child did not answer: build the architecture here
                made = architecture(self.config)
                if self.path is not None and made.basis == "architecture":
                    _write_cache(self.path, self.key, [(t, made.decide(*t)) for t in self.tensors])
            self._made = made
        return self._made

    def _answer(self) -> CachedDecisions | NameRules | None:
        try:
            doc = json.loads((Path(self._folder.name) / "out.json").read_bytes())
        except (OSError, ValueError):
            return None
        got = doc.get("decisions") if isinstance(doc, dict) else None
        if self._proc.returncode != 0 or not isinstance(got, list) or len(got) != len(
                self.tensors) or not all(isinstance(d, list) for d in got):
            return None
        made = _entries(self.tensors, [[n, *d] for (n, _), d in zip(self.tensors, got,
                                                                    strict=True)])
        if made is None:
            return None
        if doc.get("basis") == "names":
            rules = NameRules(doc.get("reason"), doc.get("experts"))
            same = all(rules.decide(*t) == made[t] for t in self.tensors)
            return rules if isinstance(rules.reason, str) and same else None
        if self.path is not None:
            _write_cache(self.path, self.key, list(made.items()))
        return CachedDecisions(made, lambda: architecture(self.config))

    def close(self) -> None:
        """Stop the child (if it still runs) and remove its files."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._folder.cleanup()


class _Forked:
    """``_child(folder)`` in a fork of this process, as much of ``subprocess.Popen`` as
    ``Pending`` uses. The child writes nothing to this process's stdout or stderr and never
    returns into its code (``os._exit``). ``folder`` None, or no fork: a child that failed."""

    def __init__(self, folder: Path | None) -> None:
        self.returncode: int | None = 1
        try:
            pid = os.fork() if folder is not None else -1
        except OSError:
            pid = -1
        if pid == 0:
            code = 1
            try:
                null = open(os.devnull, "w")  # noqa: SIM115 - for as long as the child lives
                os.dup2(null.fileno(), 1)
                os.dup2(null.fileno(), 2)
                sys.stdout = sys.stderr = null  # not the parent's streams (or their locks)
                _child(folder)
                code = 0
            finally:
                os._exit(code)
        self.pid = pid
        if pid > 0:
            self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _child(folder: Path) -> None:
    """The child of ``Pending``: the decisions for ``folder/in.json``'s config and tensors, in
    ``folder/out.json`` (written whole, then renamed)."""
    doc = json.loads((folder / "in.json").read_bytes())
    tensors = [(name, tuple(shape)) for name, shape in doc["tensors"]]
    arch = architecture(doc["config"])
    out = {"basis": arch.basis,
           "decisions": [[d.kind, d.basis, d.why] for d in (arch.decide(*t) for t in tensors)]}
    if isinstance(arch, NameRules):
        out |= {"reason": arch.reason, "experts": arch.experts}
    (folder / "out.tmp").write_text(json.dumps(out))
    os.replace(folder / "out.tmp", folder / "out.json")


def _installed(dist: str) -> list[str] | None:
    """What identifies an installed distribution without importing it: where it is, its
    version and the sha256 of its RECORD (every file of a wheel install, with its hash)."""
    from importlib import metadata, util

    try:
        d = metadata.distribution(dist)
        spec = util.find_spec(dist)
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None:
        return None
    record = d.read_text("RECORD") or ""
    return [str(spec.origin), d.version, hashlib.sha256(record.encode()).hexdigest()]


def _cache_key(config: dict | None, tensors: list[Query]) -> str | None:
    if not isinstance(config, dict) or not config:
        return None
    transformers = _installed("transformers")
    if transformers is None:
        return None
    doc = {"format": CACHE_FORMAT, "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
           "transformers": transformers, "torch": _installed("torch"), "config": config,
           "tensors": [[n, list(shape)] for n, shape in tensors]}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(raw.encode()).hexdigest()


def _read_cache(path: Path, key: str, tensors: list[Query]) -> dict[Query, Decision] | None:
    """The cached decisions for ``tensors``, or None unless the file holds exactly them."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):  # missing, unreadable, not JSON
        return None
    if (not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("key") != key
            or not isinstance(doc.get("decisions"), list)):
        return None
    return _entries(tensors, doc["decisions"])


def _entries(tensors: list[Query], entries: list) -> dict[Query, Decision] | None:
    """``[name, kind, basis, why]`` for each of ``tensors``, in order, as decisions; None
    unless ``entries`` are exactly that."""
    if len(entries) != len(tensors):
        return None
    made = {}
    for (name, shape), entry in zip(tensors, entries, strict=True):
        if (not isinstance(entry, list) or len(entry) != 4 or entry[0] != name
                or entry[1] not in KINDS or entry[2] not in ("architecture", "names")
                or not isinstance(entry[3], str)):
            return None
        made[(name, shape)] = Decision(entry[1], entry[2], entry[3])
    return made


def _write_cache(path: Path, key: str, made: list[tuple[Query, Decision]]) -> None:
    """Write the entry atomically (a temporary file renamed over it); never fails the caller."""
    doc = {"format": CACHE_FORMAT, "key": key,
           "decisions": [[name, d.kind, d.basis, d.why] for (name, _), d in made]}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:  # read-only or full disk, no home: the next run builds the architecture
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


if __name__ == "__main__":  # the child process of ``Pending``
    _child(Path(sys.argv[1]))
