"""Publishing a converted checkpoint: its model card (README.md) and the upload to the Hub.

``write_model_card()`` runs inside the conversion, on the staging folder, after ``config.json``
is written and before the completion marker; ``push_to_hub()`` uploads a finished output and
refuses anything else. Like ``write.py`` (whose ``write_bytes`` it reuses) this module touches
disk and the network; it prints nothing and never imports rich.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxfp8_convert._version import __version__
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.errors import MarkerError, OutputError
from mxfp8_convert.format import (
    CANONICAL_SUFFIX,
    COMPLETE_MARKER,
    CONFIG_FILE,
    FINGERPRINT_METHOD,
    META_TENSORS,
    QUANT_METHOD,
    Completion,
    Marker,
    is_marker,
    read_json,
)
from mxfp8_convert.write import write_bytes

if TYPE_CHECKING:
    from huggingface_hub import HfApi

CARD_NAME = "README.md"
#: where the card points engine authors for the on-disk contract
FORMAT_REF = "`docs/FORMAT.md` of mxfp8-convert"
#: front-matter keys of the source card that still hold for the output (license, languages, task)
KEPT_SOURCE_METADATA = (
    "license", "license_name", "license_link", "language", "pipeline_tag", "datasets",
)
#: first line of our card's body: a card that starts with it was written by us, and the source's
#: own card (if any) is what follows ORIGINAL_HEADING, so converting an output again does not
#: nest cards
CARD_MARK = (
    "<!-- mxfp8-convert model card; "
    "the source's own card follows its 'Original model card' heading -->"
)
ORIGINAL_HEADING = "## Original model card"
#: how to load the output; ``{where}`` is a ``snapshot_download(...)`` call or a folder path.
#: Keep in step with ``mxfp8_convert.runtime.load_checkpoint``.
LOAD_SNIPPET = """\
```python
from huggingface_hub import snapshot_download
from mxfp8_convert.runtime import load_checkpoint

path = {where}
ckpt = load_checkpoint(path, device="cuda", backend="{backend}")  # refuses any other layout
# ckpt.weights: module name -> laid-out weight + swizzled scale, fed to flashinfer.mm_mxfp8 as is
```"""


def read_output_info(output_dir: str | Path, completion: dict | None = None) -> tuple[dict, dict]:
    """``(quantization_config, completion record)`` of a converted output.

    Args:
        output_dir: a converted output, or its staging folder (config.json written).
        completion: the completion record, for a staging folder whose marker is not written yet
            (default: read ``mxfp8_convert.complete.json`` if present, else ``{}``).

    Raises:
        MarkerError: config.json is missing, or is neither ours (``quant_method: mxfp8_convert``)
            nor the plain MXFP8 of a ``canonical`` conversion (which the completion record says).
    """
    root = Path(output_dir)
    qc = read_json(root / CONFIG_FILE, CONFIG_FILE).get("quantization_config")
    if completion is None:
        done = root / COMPLETE_MARKER
        completion = Completion.read(root).to_dict() if done.is_file() else {}
    if is_marker(qc):
        Marker.parse(qc, str(root / CONFIG_FILE))
        return qc, completion
    backend = BACKENDS.get(completion.get("backend"))
    if backend is not None and not backend.laid_out and isinstance(qc, dict):
        return qc, completion
    raise MarkerError(f"{root / CONFIG_FILE}: quantization_config is not an mxfp8-convert marker")


def hub_repo_from_path(path: str | Path) -> tuple[str | None, str | None]:
    """``(repo id, commit)`` of a Hub cache snapshot folder
    ``.../models--org--name/snapshots/<sha>``.

    Returns ``(None, None)`` for any other folder. Repo ids cannot contain ``--``, so the split is
    exact.
    """
    p = Path(path)
    if p.parent.name != "snapshots" or not p.parent.parent.name.startswith("models--"):
        return None, None
    return "/".join(p.parent.parent.name.split("--")[1:]), p.name


def _split_card(text: str) -> tuple[dict, str]:
    """(front-matter dict, body) of a model card, parsed by huggingface_hub's ``ModelCard``.

    For a card we wrote (an output converted again) the body is the source's card inside it.
    """
    import yaml
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    match = REGEX_YAML_BLOCK.search(text)
    if match is None:  # checked first: ModelCard logs a warning for a card without front matter
        meta, body = {}, text
    else:
        try:
            card = ModelCard(text, ignore_metadata_errors=True)
            meta, body = card.data.to_dict(), card.text
        except (ValueError, TypeError, yaml.YAMLError):  # broken front matter: keep the body only
            meta, body = {}, text[match.end():]
    if body.lstrip().startswith(CARD_MARK):
        _, _, body = body.partition(f"\n{ORIGINAL_HEADING}\n")
    return meta, body


@dataclass(frozen=True, slots=True)
class OutputFacts:
    """What a model card says about a converted output, read from its files.

    ``qc`` is config.json's ``quantization_config`` (our marker, or plain MXFP8's for the
    ``canonical`` backend), ``record`` the completion record (``{}`` if not known yet), ``kept``
    the modules left in canonical MXFP8 by ``--on-ineligible keep``.
    """

    backend: str
    qc: dict
    record: dict
    kept: tuple[str, ...]

    @property
    def laid_out(self) -> bool:
        return BACKENDS[self.backend].laid_out

    @property
    def fingerprint(self) -> str | None:
        source = self.qc.get("source") or {}
        return source.get("fingerprint") or self.record.get("source_fingerprint")

    @property
    def tool_version(self) -> str:
        return (self.qc.get("tool") or {}).get("version") or self.record.get("tool_version") or "?"


def read_output_facts(output_dir: str | Path, completion: dict | None = None) -> OutputFacts:
    """``OutputFacts`` of an output or staging folder (see ``read_output_info`` for the
    arguments)."""
    qc, record = read_output_info(output_dir, completion)
    backend = qc["backend"] if is_marker(qc) else record["backend"]
    return OutputFacts(backend, qc, record, tuple(_kept_canonical(Path(output_dir))))


def _front_matter(facts: OutputFacts, source_meta: dict, source_repo: str | None) -> str:
    from huggingface_hub import ModelCardData

    kept = {k: source_meta[k] for k in KEPT_SOURCE_METADATA
            if source_meta.get(k) not in (None, "", [])}
    if source_repo:
        kept.update(base_model=source_repo, base_model_relation="quantized")
    tags = ["mxfp8", "mxfp8-convert"]
    if facts.laid_out:
        tags += ["flashinfer", facts.backend, "blackwell"]
        # not transformers (the source's usual value): it would load the laid-out bytes as plain
        # MXFP8
        kept["library_name"] = "mxfp8-convert"
    return ModelCardData(tags=tags, **kept).to_yaml()


def _kept_canonical(output_dir: Path) -> list[str]:
    """Modules left in canonical MXFP8 (``--on-ineligible keep``), from the shards' records."""
    from safetensors import safe_open

    kept = []
    for shard in sorted(output_dir.glob("*.safetensors")):
        with safe_open(str(shard), "np") as f:  # metadata only; "pt" would import torch
            records = json.loads((f.metadata() or {}).get(META_TENSORS, "{}"))
        kept += [n[: -len(".weight")] for n, r in records.items()
                 if r.get("role") == "weight" and r.get("layout") == "canonical"]
    return sorted(kept)


def _rows(pairs: list[tuple[str, str]]) -> str:
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in pairs)


def _codes(names: list[str] | tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "none"


def _compute_capabilities(backend: str) -> str:
    return ", ".join(f"sm_{c} ({c // 10}.{c % 10})" for c in BACKENDS[backend].compute_capabilities)


def _laid_out_sections(facts: OutputFacts, repo_id: str | None) -> list[str]:
    m, b = facts.qc, facts.backend
    where = (f'snapshot_download("{repo_id}")' if repo_id
             else '"path/to/this/checkpoint"  # or snapshot_download("<this repo id>")')
    return [
        "MXFP8 weights and scales laid out offline by mxfp8-convert for FlashInfer's `mm_mxfp8` "
        f'kernel with `backend="{b}"`, so an engine loads them as stored: no re-shuffling or '
        "re-swizzling at start-up.\n",
        "> [!WARNING]\n"
        "> **This is not a plain MXFP8 checkpoint.** Its weight rows may be shuffled and its "
        'scales are swizzled, so its `config.json` says `quant_method: "mxfp8_convert"`. '
        "Loaded as plain MXFP8 it gives silent garbage; "
        f"only engines that implement the format of {FORMAT_REF} can run it.\n",
        "## Requirements\n",
        _rows([
            ("kernel", f'FlashInfer `mm_mxfp8`, `backend="{b}"`'),
            ("weight layout", f"`{m['weight_layout']}`"),
            ("scale layout", f"`{m['scale_layout']}` (`*.{m.get('scale_suffix')}`, uint8 UE8M0)"),
            ("GPU compute capability", _compute_capabilities(b)),
            ("FlashInfer", f"`{m.get('flashinfer_layout_version')}` "
                           "(the layouts are byte-identical to its helpers)"),
            ("format",
             f'`quant_method: "{QUANT_METHOD}"`, format version {m.get("format_version")}'),
            ("converted by", f"mxfp8-convert {facts.tool_version}"),
        ]) + "\n",
        "## Loading\n",
        LOAD_SNIPPET.format(where=where, backend=b) + "\n",
    ]


def _canonical_sections(facts: OutputFacts) -> list[str]:
    return [
        "Plain MXFP8 in the SGLang/Miles dialect, written by mxfp8-convert with "
        "`--backend canonical`: "
        "e4m3 weights and uint8 UE8M0 scales, one per 1x32 block, in their natural row-major "
        "order. "
        "There is no kernel layout: engines that read SGLang MXFP8 load it as is, and "
        "`mxfp8-convert --backend trtllm|cutlass` lays it out for FlashInfer.\n",
        "## Format\n",
        _rows([
            ("format",
             f'`quant_method: "{facts.qc.get("quant_method")}"`, `weight_block_size: [1, 32]`'),
            ("scales", f"`*.{CANONICAL_SUFFIX}`, uint8 UE8M0, `[N, K/32]`"),
            ("converted by", f"mxfp8-convert {facts.tool_version}"),
        ]) + "\n",
    ]


def _quantized(errors: dict) -> str | None:
    """Summary of the modules this conversion (re)quantized, or None if it only moved bytes."""
    if not errors:
        return None
    actions = Counter(e.get("action", "?") for e in errors.values())
    def sqnr(n: str) -> float:  # null: exact (infinite SQNR)
        v = errors[n].get("sqnr_db")
        return float("inf") if v is None else v

    worst = min(errors, key=sqnr)
    lowest = "exact" if sqnr(worst) == float("inf") else f"{sqnr(worst):.1f} dB"
    return (", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
            + f"; lowest SQNR {lowest} (`{worst}`)")


def _provenance(facts: OutputFacts, source_repo: str | None, source_commit: str | None,
                command: str) -> str:
    src = facts.qc.get("source") or {}
    where = "a local folder"
    if source_repo:
        where = f"[`{source_repo}`](https://huggingface.co/{source_repo})"
    pairs = [("source", where + (f" at `{source_commit}`" if source_commit else ""))]
    if src.get("dialect"):
        pairs.append(("source dialect", f"`{src['dialect']}`"))
    if facts.fingerprint:
        method = src.get("fingerprint_method", FINGERPRINT_METHOD)
        pairs.append(("source fingerprint", f"`{facts.fingerprint}` ({method})"))
    pairs.append(("left unquantized", _codes(facts.qc.get("ignored_layers") or [])))
    if facts.laid_out:
        pairs.append(("kept canonical MXFP8", _codes(facts.kept)))
    quantized = _quantized(facts.record.get("quantization_errors") or {})
    if quantized:
        pairs.append(("quantized here", quantized + "; per module in `" + COMPLETE_MARKER + "`"))
    pairs.append(("command", f"`{command}`"))
    return _rows(pairs)


def default_command(facts: OutputFacts, source_repo: str | None, source_commit: str | None) -> str:
    """The ``mxfp8-convert`` command line that reproduces the output, as far as its files tell."""
    cmd = f"mxfp8-convert {source_repo or 'MODEL'} --backend {facts.backend}"
    if source_repo and source_commit:
        cmd += f" --revision {source_commit}"
    return cmd + (" --on-ineligible keep" if facts.kept else "")


def make_model_card(
    output_dir: str | Path,
    *,
    source_card: str | None,
    source_repo: str | None,
    source_commit: str | None = None,
    repo_id: str | None = None,
    name: str | None = None,
    command: str | None = None,
    completion: dict | None = None,
) -> str:
    """The README.md (Hub model card) of a converted output.

    Reads the output's ``config.json`` marker, its shards' metadata and its completion record,
    which a staging folder does not have yet: the converter passes it as ``completion``.

    Args:
        output_dir: the converted output (or its staging folder).
        source_card: the source's README.md text, or None. Its front matter keys in
            ``KEPT_SOURCE_METADATA`` are kept; its body follows ours under "Original model card".
        source_repo: Hub repo id of the source (becomes ``base_model``), or None if unknown.
        source_commit: the source's Hub commit, recorded in the provenance table.
        repo_id: where the output will be uploaded, for the loading snippet (else a local path).
        name: the title's model name (default: the last part of ``source_repo``, else "Model").
        command: the command that made the output (default: ``default_command(...)``).
        completion: the completion record about to be written (staging folders only).

    Returns:
        The card: YAML front matter, then Markdown.

    Raises:
        MarkerError: ``output_dir`` is not an mxfp8-convert output (see ``read_output_info``).
    """
    facts = read_output_facts(output_dir, completion)
    meta, body = _split_card(source_card) if source_card else ({}, "")
    title = name or (source_repo.split("/")[-1] if source_repo else "Model")
    kind = f"FlashInfer {facts.backend} layout" if facts.laid_out else "plain"
    parts = [f"---\n{_front_matter(facts, meta, source_repo)}\n---\n{CARD_MARK}\n",
             f"# {title} (MXFP8, {kind})\n"]
    parts += _laid_out_sections(facts, repo_id) if facts.laid_out else _canonical_sections(facts)
    parts += ["## How it was made\n", _provenance(facts, source_repo, source_commit,
              command or default_command(facts, source_repo, source_commit)) + "\n"]
    if body.strip():
        parts += [ORIGINAL_HEADING + "\n", body.strip() + "\n"]
    return "\n".join(parts)


def write_model_card(output_dir: str | Path, source_root: str | Path, *,
                     source_repo: str | None = None,
                     repo_id: str | None = None, command: str | None = None,
                     completion: dict | None = None, mode: int = 0o644) -> tuple[int, str]:
    """Write ``output_dir/README.md`` (replacing the copied source README) from the marker.

    Call it on the staging folder after the shards, copied files and ``config.json`` are
    written, before the completion marker; record the returned size and hash in its ``files``.

    Args:
        output_dir: the staging folder of the conversion.
        source_root: the source folder (a Hub snapshot folder names its repo and commit).
        source_repo: the source's Hub repo id (default: read from a Hub snapshot path, else none).
        repo_id: where the output will be pushed, if known (for the loading snippet).
        command: the command line that made the output (default: rebuilt from the marker).
        completion: the completion record about to be written (its ``files`` are not needed).
        mode: permission bits of the card (capped at 0644).

    Returns:
        ``(size, xxh3_128 hex)`` of the README written, as ``write.write_bytes`` returns.

    Raises:
        MarkerError: ``output_dir/config.json`` is not written yet or is not ours.
        OutputError: README.md cannot be written.
    """
    root = Path(source_root)
    path_repo, commit = hub_repo_from_path(root)
    source_card = _source_card(root)
    repo = source_repo or path_repo
    card = make_model_card(output_dir, source_card=source_card, source_repo=repo,
                           source_commit=commit if repo == path_repo else None, repo_id=repo_id,
                           name=None if repo else root.resolve().name, command=command,
                           completion=completion)
    return write_bytes(Path(output_dir) / CARD_NAME, card.encode("utf-8"), mode=mode)


def _source_card(root: Path) -> str | None:
    """The source's README, checked as it is opened (a regular file inside the model folder;
    a FIFO is not waited on); one we cannot or may not read is dropped: the card says enough."""
    from mxfp8_convert.errors import SourceError
    from mxfp8_convert.read import open_source_file

    if not os.path.lexists(root / CARD_NAME):
        return None
    try:
        f, _ = open_source_file(root, CARD_NAME)
    except SourceError:
        return None
    try:
        with f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def read_completion_marker(output_dir: str | Path) -> dict:
    """The completion marker of a finished output.

    Raises:
        OutputError: the folder has no ``mxfp8_convert.complete.json`` or it is unreadable.
    """
    root = Path(output_dir)
    if not root.is_dir():
        raise OutputError(f"{root}: no such folder")
    if not (root / COMPLETE_MARKER).is_file():
        raise OutputError(f"{root}: no {COMPLETE_MARKER}, so not a finished mxfp8-convert output",
                          hint="convert again; "
                          "a folder without its completion marker is not a result")
    return Completion.read(root, error=OutputError).to_dict()


def _hub_error(e: Exception, repo_id: str, revision: str | None) -> OutputError:
    """One line for a failed Hub call; the response's own message when there is one."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, HFValidationError):
        return OutputError(f"{repo_id!r}: not a valid Hub repo id ({e})", hint="use org/name")
    if isinstance(e, OfflineModeIsEnabled):
        return OutputError(f"{repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded",
                           hint="unset HF_HUB_OFFLINE to push")
    if isinstance(e, LocalTokenNotFoundError):
        return OutputError(f"{repo_id}: no Hugging Face token found",
                           hint="set HF_TOKEN or run `hf auth login`")
    if isinstance(e, RepositoryNotFoundError):
        return OutputError(f"{repo_id}: repository not found on the Hub, or no access to it",
                           hint="check the id and that the token can write to it")
    if isinstance(e, RevisionNotFoundError):
        return OutputError(f"{repo_id}: revision {revision!r} not found")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return OutputError(f"{repo_id}: the Hub refused the upload (HTTP {status})",
                           hint="use a token with write access to this repo (HF_TOKEN)")
    detail = getattr(e, "server_message", None) or str(e)
    what = f"HTTP {status}" if status else type(e).__name__
    return OutputError(f"{repo_id}: upload to the Hub failed ({what}: {detail})")


def push_to_hub(
    output_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    api: HfApi | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a finished output folder to the Hub model repo ``repo_id`` (created if needed).

    The folder is uploaded as is: its README.md is the card the converter wrote.

    Args:
        output_dir: a converted output; one without its completion marker is refused.
        repo_id: ``org/name`` of the target model repo.
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to commit to; created from main if it does not exist (default: main).
        token: Hub token for the default ``HfApi`` (default: HF_TOKEN or the saved login);
            unused when ``api`` is given.
        api: an ``HfApi``-like object (tests pass a fake).
        commit_message: default ``"Upload <backend> MXFP8 layout (mxfp8-convert <version>)"``.

    Returns:
        The URL of the commit.

    Raises:
        OutputError: the folder is not a finished output, or a Hub call failed (one line).
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, HTTPError

    complete = read_completion_marker(output_dir)
    api = api if api is not None else HfApi(token=token)
    message = commit_message or (f"Upload {complete.get('backend')} MXFP8 layout "
                                 f"(mxfp8-convert {complete.get('tool_version', __version__)})")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and not revision.startswith("refs/pr/"):  # PR refs exist already
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(output_dir), repo_id=repo_id, repo_type="model",
                                 revision=revision, commit_message=message)
    # HTTPError: the HTTP client's base (status and transport errors); OSError: HfHubHTTPError,
    # missing token, offline mode and the older requests-based clients' connection errors
    except (HTTPError, OSError, HFValidationError) as e:
        raise _hub_error(e, repo_id, revision) from None
    return getattr(info, "commit_url", None) or str(info)
