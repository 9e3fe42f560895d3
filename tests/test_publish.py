"""mxfp8_convert/publish.py: the model card of an output and the Hub upload (a fake HfApi, no
network)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from huggingface_hub import CommitInfo, HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

from mxfp8_convert import __version__, convert
from mxfp8_convert.backends import BACKENDS, FLASHINFER_LAYOUT_VERSION
from mxfp8_convert.errors import MarkerError, OutputError
from mxfp8_convert.plan import COMPLETE_MARKER
from mxfp8_convert.publish import (
    LOAD_SNIPPET,
    hub_repo_from_path,
    make_model_card,
    push_to_hub,
    write_model_card,
)
from mxfp8_convert.synth import SynthSpec, write_checkpoint

TINY = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256)
SOURCE_CARD = """---
license: apache-2.0
language: [en, fr]
pipeline_tag: text-generation
library_name: transformers
tags: [compressed-tensors, llama]
base_model: meta-llama/Llama-3.1-8B
---
# Source model

Trained on many tokens.
"""


LAID_OUT = sorted(name for name, spec in BACKENDS.items() if spec.laid_out)


@pytest.fixture(scope="module", params=LAID_OUT)
def output(request, tmp_path_factory) -> Path:
    """A finished conversion of a tiny synthetic checkpoint, once per kernel backend."""
    root = tmp_path_factory.mktemp(f"pub-{request.param}")
    src = write_checkpoint(root / "src", TINY)
    return Path(convert(str(src), request.param, root / "out").output)


@pytest.fixture(scope="module")
def trtllm_output(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pub-push")
    return Path(convert(str(write_checkpoint(root / "src", TINY)), "trtllm", root / "out").output)


def backend_of(out: Path) -> str:
    return json.loads((out / "config.json").read_text())["quantization_config"]["backend"]


def card_of(out: Path, **kw) -> tuple[str, ModelCard]:
    kw = {"source_card": SOURCE_CARD, "source_repo": "org/model", **kw}
    text = make_model_card(out, **kw)
    return text, ModelCard(text)


def table(text: str) -> dict[str, str]:
    """Two-column Markdown table rows of the card: first cell -> second cell."""
    return {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| (.+) \|$", text, re.M)}


# ---- model card --------------------------------------------------------------------------------


def test_card_front_matter(output):
    _, card = card_of(output)
    data = card.data.to_dict()
    assert data["base_model"] == "org/model"
    assert data["base_model_relation"] == "quantized"
    assert data["tags"] == ["mxfp8", "mxfp8-convert", "flashinfer", backend_of(output), "blackwell"]
    assert data["library_name"] == "mxfp8-convert"  # never transformers: it would load garbage


def test_card_keeps_source_metadata_that_still_holds(output):
    data = card_of(output)[1].data.to_dict()
    kept = (data["license"], data["language"], data["pipeline_tag"])
    assert kept == ("apache-2.0", ["en", "fr"], "text-generation")
    assert "compressed-tensors" not in data["tags"]  # the source's format tags would be wrong here


def test_card_without_source_repo_has_no_base_model(output):
    data = card_of(output, source_repo=None)[1].data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data


def test_card_requirements_table(output):
    backend = backend_of(output)
    spec = BACKENDS[backend]
    rows = table(card_of(output)[0])
    assert rows["kernel"] == f'FlashInfer `mm_mxfp8`, `backend="{backend}"`'
    assert rows["weight layout"] == f"`{spec.weight_layout}`"
    assert rows["scale layout"].startswith(f"`{spec.scale_layout}` (`*.weight_scale_swizzled`")
    assert rows["GPU compute capability"] == ", ".join(
        f"sm_{c} ({c // 10}.{c % 10})" for c in spec.compute_capabilities)
    assert rows["FlashInfer"].startswith(f"`{FLASHINFER_LAYOUT_VERSION}`")
    assert rows["format"] == '`quant_method: "mxfp8_convert"`, format version 2'
    assert rows["converted by"] == f"mxfp8-convert {__version__}"


def test_card_says_it_is_not_plain_mxfp8(output):
    text = card_of(output)[0]
    assert "**This is not a plain MXFP8 checkpoint.**" in text
    assert 'quant_method: "mxfp8_convert"' in text and "docs/FORMAT.md" in text


def test_card_loading_snippet(output):
    text = card_of(output, repo_id="me/model-x")[0]
    code = re.search(r"```python\n(.*?)```", text, re.S)[1]
    compile(code, "snippet", "exec")
    assert "from mxfp8_convert.runtime import load_checkpoint" in code
    assert 'snapshot_download("me/model-x")' in code
    assert f'backend="{backend_of(output)}"' in code
    snippet = LOAD_SNIPPET.format(where='snapshot_download("me/model-x")',
                                  backend=backend_of(output))
    assert code.strip() in snippet


def test_card_provenance(output):
    marker = json.loads((output / "config.json").read_text())["quantization_config"]
    rows = table(card_of(output, source_commit="abc123")[0])
    assert rows["source"] == "[`org/model`](https://huggingface.co/org/model) at `abc123`"
    assert rows["source dialect"] == "`sglang_mxfp8`"
    assert rows["source fingerprint"] == f"`{marker['source']['fingerprint']}` (headers-v1)"
    assert rows["left unquantized"] == "`lm_head`"
    assert rows["kept canonical MXFP8"] == "none"
    assert rows["command"] == (
        f"`mxfp8-convert org/model --backend {backend_of(output)} --revision abc123`")


def test_card_keeps_source_body_below_ours(output):
    text, card = card_of(output)
    ours, theirs = text.split("\n## Original model card\n")
    assert "## How it was made" in ours
    assert theirs.strip() == "# Source model\n\nTrained on many tokens."
    # the source's front matter is not repeated in the body
    assert "license: apache-2.0" not in card.text


def test_card_of_a_converted_output_does_not_nest(output, trtllm_output):
    first = make_model_card(trtllm_output, source_card=SOURCE_CARD, source_repo="org/model")
    again, card = card_of(output, source_card=first, source_repo="me/model-trtllm")
    assert again.count("## Original model card") == 1 and again.count("## How it was made") == 1
    assert again.endswith("## Original model card\n\n# Source model\n\nTrained on many tokens.\n")
    assert (card.data.base_model, card.data.license) == ("me/model-trtllm", "apache-2.0")
    nothing_inside = make_model_card(trtllm_output, source_card=None, source_repo=None)
    assert "## Original model card" not in card_of(output, source_card=nothing_inside)[0]


def test_card_without_source_card(output):
    text = make_model_card(output, source_card=None, source_repo=None)
    assert "## Original model card" not in text
    assert text.startswith("---\n") and "# Model (MXFP8" in text
    assert '"path/to/this/checkpoint"' in text


def test_card_source_without_front_matter(output, caplog):
    with caplog.at_level(logging.WARNING):
        text = make_model_card(output, source_card="# Plain\n\nNo metadata.\n", source_repo=None)
    assert text.endswith("## Original model card\n\n# Plain\n\nNo metadata.\n")
    # huggingface_hub warns about cards without metadata; we check first
    assert caplog.records == []


def test_card_source_with_broken_front_matter(output):
    text = make_model_card(output, source_card="---\nlicense: [mit\n---\n# Body\n",
                           source_repo=None)
    assert "license" not in ModelCard(text).data.to_dict()
    assert text.endswith("## Original model card\n\n# Body\n")


def test_card_source_with_non_string_keys(output):
    text = make_model_card(output, source_card="---\n1: one\nlicense: mit\n---\n# Body\n",
                           source_repo=None)
    assert text.endswith("## Original model card\n\n# Body\n")


def test_card_lists_modules_kept_canonical(tmp_path):
    # K=288 of down_proj is not a multiple of 256: trtllm keeps it canonical with
    # --on-ineligible keep
    spec = SynthSpec(layers=1, hidden=256, intermediate=288, heads=4, kv_heads=2, vocab=256)
    out = convert(str(write_checkpoint(tmp_path / "src", spec)), "trtllm", tmp_path / "out",
                  on_ineligible="keep").output
    rows = table(make_model_card(out, source_card=None, source_repo="org/model"))
    assert rows["kept canonical MXFP8"] == "`model.layers.0.mlp.down_proj`"
    assert rows["command"] == "`mxfp8-convert org/model --backend trtllm --on-ineligible keep`"


def test_card_summarizes_quantized_modules(tmp_path):
    spec = SynthSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                     dialect="dense")
    out = convert(str(write_checkpoint(tmp_path / "src", spec)), "cutlass", tmp_path / "out").output
    errors = json.loads((Path(out) / COMPLETE_MARKER).read_text())["quantization_errors"]
    worst = min(errors, key=lambda n: errors[n]["sqnr_db"])
    rows = table(make_model_card(out, source_card=None, source_repo=None))
    lowest = errors[worst]["sqnr_db"]
    assert rows["quantized here"] == (f"{len(errors)} quantize; lowest SQNR {lowest:.1f} dB "
                                      f"(`{worst}`); per module in `{COMPLETE_MARKER}`")


def test_card_takes_the_completion_record_of_a_staging_folder(trtllm_output, tmp_path):
    stage = staging_copy(trtllm_output, tmp_path / "stage")
    errors = {"a": {"action": "requantize", "rel_fro": 0.01, "sqnr_db": 40.0},
              "b": {"action": "quantize", "rel_fro": 0.02, "sqnr_db": 33.31}}
    rows = table(make_model_card(stage, source_card=None, source_repo=None,
                                 completion={"backend": "trtllm", "quantization_errors": errors}))
    assert rows["quantized here"] == ("1 quantize, 1 requantize; lowest SQNR 33.3 dB (`b`); "
                                      f"per module in `{COMPLETE_MARKER}`")


def test_card_of_canonical_output(trtllm_output, tmp_path):
    out = Path(convert(str(trtllm_output), "canonical", tmp_path / "plain").output)
    text, card = card_of(out, source_repo="me/model-trtllm")
    assert card.data.tags == ["mxfp8", "mxfp8-convert"]
    assert card.data.library_name is None
    assert "# model-trtllm (MXFP8, plain)" in text and "not a plain MXFP8" not in text
    rows = table(text)
    assert rows["format"] == '`quant_method: "mxfp8"`, `weight_block_size: [1, 32]`'
    assert rows["command"] == "`mxfp8-convert me/model-trtllm --backend canonical`"
    assert "kept canonical MXFP8" not in rows


def test_card_refuses_folder_without_marker(tmp_path):
    config = {"quantization_config": {"quant_method": "mxfp8"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MarkerError,
                       match=r"config.json: quantization_config is not an mxfp8-convert marker$"):
        make_model_card(tmp_path, source_card=None, source_repo=None)


# ---- write_model_card (the converter's hook) -----------------------------------------------------


def staging_copy(out: Path, dest: Path) -> Path:
    """``out`` as it is in the staging folder when the card is written: no completion marker yet."""
    shutil.copytree(out, dest)
    (dest / COMPLETE_MARKER).unlink()
    return dest


def test_write_model_card_replaces_source_readme(trtllm_output, tmp_path):
    import xxhash

    stage = staging_copy(trtllm_output, tmp_path / ".out.mxfp8-tmp-1234")
    src = tmp_path / "src"
    write_checkpoint(src, TINY)
    size, digest = write_model_card(stage, src)
    data = (stage / "README.md").read_bytes()
    assert (size, digest) == (len(data), xxhash.xxh3_128(data).hexdigest())
    text = data.decode()
    # titled after the source, not the temp folder
    assert "# src (MXFP8, FlashInfer trtllm layout)" in text
    assert text.endswith("## Original model card\n\n# synthetic model\n\n"
                         "Made by mxfp8_convert.synth for tests and demos.\n")


def test_write_model_card_reads_hub_snapshot_path(trtllm_output, tmp_path):
    snap = tmp_path / "hub" / "models--org--model-x" / "snapshots" / "0123abcd"
    write_checkpoint(snap, TINY)
    stage = staging_copy(trtllm_output, tmp_path / "stage")
    write_model_card(stage, snap, repo_id="me/model-x-trtllm")
    text = (stage / "README.md").read_text()
    assert ModelCard(text).data.base_model == "org/model-x"
    assert table(text)["source"] == (
        "[`org/model-x`](https://huggingface.co/org/model-x) at `0123abcd`")
    assert 'snapshot_download("me/model-x-trtllm")' in text


def test_write_model_card_without_source_readme(trtllm_output, tmp_path):
    src = write_checkpoint(tmp_path / "src", TINY)
    (src / "README.md").unlink()
    stage = staging_copy(trtllm_output, tmp_path / "stage")
    write_model_card(stage, src, source_repo="org/model")
    assert "## Original model card" not in (stage / "README.md").read_text()


@pytest.mark.parametrize("path, want", [
    ("/c/hub/models--org--name/snapshots/abc", ("org/name", "abc")),
    ("/c/hub/models--gpt2/snapshots/abc", ("gpt2", "abc")),
    ("/data/models/tiny-mxfp8", (None, None)),
    ("/c/hub/datasets--org--name/snapshots/abc", (None, None)),
])
def test_hub_repo_from_path(path, want):
    assert hub_repo_from_path(path) == want


# ---- push_to_hub ---------------------------------------------------------------------------------


def fake_api() -> mock.Mock:
    """An HfApi double with HfApi's real signatures (autospec), so a wrong argument fails."""
    api = mock.create_autospec(HfApi, instance=True)
    api.upload_folder.return_value = CommitInfo(
        commit_url="https://huggingface.co/me/m/commit/abc", commit_message="m",
        commit_description="", oid="abc")
    return api


def test_push_calls(trtllm_output):
    api = fake_api()
    url = push_to_hub(trtllm_output, "me/m", api=api)
    assert url == "https://huggingface.co/me/m/commit/abc"
    assert api.mock_calls == [
        mock.call.create_repo("me/m", private=False, exist_ok=True, repo_type="model"),
        mock.call.upload_folder(
            folder_path=str(trtllm_output), repo_id="me/m", repo_type="model", revision=None,
            commit_message=f"Upload trtllm MXFP8 layout (mxfp8-convert {__version__})"),
    ]


def test_push_private_to_branch(trtllm_output):
    api = fake_api()
    push_to_hub(trtllm_output, "me/m", private=True, revision="trtllm", commit_message="hi",
                api=api)
    assert api.mock_calls == [
        mock.call.create_repo("me/m", private=True, exist_ok=True, repo_type="model"),
        mock.call.create_branch("me/m", branch="trtllm", exist_ok=True, repo_type="model"),
        mock.call.upload_folder(folder_path=str(trtllm_output), repo_id="me/m", repo_type="model",
                                revision="trtllm", commit_message="hi"),
    ]


def test_push_to_pr_ref_creates_no_branch(trtllm_output):
    api = fake_api()
    push_to_hub(trtllm_output, "me/m", revision="refs/pr/3", api=api)
    assert [c[0] for c in api.mock_calls] == ["create_repo", "upload_folder"]


def test_push_refuses_folder_without_completion_marker(trtllm_output, tmp_path):
    stage = staging_copy(trtllm_output, tmp_path / "half")
    api = fake_api()
    with pytest.raises(OutputError) as e:
        push_to_hub(stage, "me/m", api=api)
    assert str(e.value) == f"{stage}: no {COMPLETE_MARKER}, so not a finished mxfp8-convert output"
    assert e.value.hint == "convert again; a folder without its completion marker is not a result"
    assert api.mock_calls == []


def test_push_refuses_unreadable_completion_marker(trtllm_output, tmp_path):
    stage = staging_copy(trtllm_output, tmp_path / "bad")
    (stage / COMPLETE_MARKER).write_text("{not json")
    with pytest.raises(
        OutputError,
        match=r"^.*mxfp8_convert.complete.json: unreadable completion marker \(.*\)$",
    ):
        push_to_hub(stage, "me/m", api=fake_api())


def test_push_refuses_missing_folder(tmp_path):
    with pytest.raises(OutputError, match="no such folder$"):
        push_to_hub(tmp_path / "nope", "me/m", api=fake_api())


def http_error(cls, status: int, msg: str = "boom"):
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(msg, response=response, server_message=msg)


@pytest.mark.parametrize("error, message", [
    (http_error(RepositoryNotFoundError, 404),
     "me/m: repository not found on the Hub, or no access to it"),
    (http_error(HfHubHTTPError, 403), "me/m: the Hub refused the upload (HTTP 403)"),
    (http_error(HfHubHTTPError, 500, "server exploded"),
     "me/m: upload to the Hub failed (HTTP 500: server exploded)"),
    (OfflineModeIsEnabled("offline"), "me/m: HF_HUB_OFFLINE is set, so nothing can be uploaded"),
    (ConnectionError("network unreachable"),
     "me/m: upload to the Hub failed (ConnectionError: network unreachable)"),
])
def test_push_maps_hub_errors_to_one_line(trtllm_output, error, message):
    api = fake_api()
    api.upload_folder.side_effect = error
    with pytest.raises(OutputError) as e:
        push_to_hub(trtllm_output, "me/m", api=api)
    assert str(e.value) == message


def test_push_maps_invalid_repo_id(trtllm_output):
    from huggingface_hub.errors import HFValidationError

    api = fake_api()
    api.create_repo.side_effect = HFValidationError(
        "Repo id must be in the form 'repo_name' or 'namespace/repo_name'")
    with pytest.raises(OutputError, match=r"^'a/b/c': not a valid Hub repo id \(Repo id must be"):
        push_to_hub(trtllm_output, "a/b/c", api=api)
