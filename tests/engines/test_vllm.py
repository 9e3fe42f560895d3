"""vLLM serves converted checkpoints through the plug-in, at TP=1 and TP=2, both layouts.

The oracle is our own runtime on the same converted folder (``load_into`` a transformers model,
reference engine), independent of the plug-in's slicing, fusing and of vLLM's model code, scored
teacher-forced on the tokens vLLM generated. Both run float32 activations and the same MXFP8
linear (activations quantized to e4m3 with FlashInfer's recipe, exact products, float32 sums,
one rounding to bf16). What differs is float32 rounding elsewhere (attention, norms, the
all-reduce) and, at TP=2, one more bf16 rounding of each rank's partial row-parallel sum. The
e4m3 activation quantization turns any such difference into a whole e4m3 step (1/16 to 1/8 of
an element) wherever a value sits near a rounding boundary: measured on these models, our runtime
itself moves its logprobs by up to 0.41 (0.09 for the argmax token) when its linear outputs are
perturbed by 2^-23 relative, and by up to 1.0 (0.17) at 2^-8, the size of TP=2's extra rounding
(the run prints its own figure, ``CALIBRATION``). Hence:

- tokens: each token vLLM picks is the oracle's argmax, or within TIE_TOL of it (a near-tie
  that the arithmetic above decides either way); the count of exact argmax picks is reported;
- logprobs of the picked tokens: within LOGPROB_TOL of the oracle's.

Every TP=2 case: each rank rounds its partial sum of a row-parallel module (o_proj, down_proj,
the MoE experts' down) to bf16, and a tiny random model sits near ties often enough for that to
move a token beyond TIE_TOL (measured: a MoE gap of 0.35 at one token, 0.15 once the oracle
rounds as two ranks do; a dense llama/trtllm gap of 0.295). So at TP=2 the oracle runs those
modules as the ranks do (conftest ``_split_linear`` and ``_split_experts``: each rank's K columns
of every row-parallel weight, rows of every expert's gate/up, by plain indexing of the canonical
bytes, a fused block's rank slices laid out again from them, each rank's output bf16, the ranks
summed in float32, a bias on rank 0 only); everything else, and the tolerances, as above.

A wrong slice, tile, head or part offset moves logprobs by whole units and picks tokens far
below the oracle's argmax from the first token on (and tests/engines/test_layers.py checks the
bytes of every rank's parameters exactly).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import (
    MAX_TOKENS,
    ROOT,
    copy_checkpoint,
    engine_env,
    engine_results,
    free_port,
    report,
    run_engine,
    runtime_model,
    source_greedy,
    teacher_forced,
)

TIE_TOL = 0.25
LOGPROB_TOL = 0.5
#: relative perturbation of the runtime's linear outputs for the printed calibration (TP=2's
#: extra bf16 rounding of partial sums is of this size)
CALIBRATION = 2.0 ** -8
EXAMPLE = str(ROOT / "examples" / "serve_with_vllm.py")
SERVED = ("llama", "cutlass", 1)  # this one is checked through the OpenAI server instead
CASES = [(k, b, tp) for k in ("llama", "qwen2") for b in ("trtllm", "cutlass") for tp in (1, 2)]
#: MoE checkpoints whose experts are stored per expert: vLLM's fused-MoE layer, our method
#: and fused trtllm MoE blocks (the trtllm default for a MoE model): our fused-block method
MOE_CASES = [*[("mixtral", b, tp) for b in ("cutlass", "trtllm-moe-keep", "trtllm")
               for tp in (1, 2)],
             ("qwen2_moe", "cutlass", 1), ("qwen2_moe", "cutlass", 2),
             ("qwen3_moe", "trtllm", 1), ("qwen3_moe", "trtllm", 2)]


def _compare(case, got: list[dict], prompts: list[list[int]], oracle) -> None:
    model, noisy, source = oracle
    worst, worst_gap, spread, exact, total, lead = 0.0, 0.0, 0.0, 0, 0, []
    for g, prompt, s in zip(got, prompts, source, strict=True):
        rows = teacher_forced(model, prompt, g["token_ids"])
        moved = teacher_forced(noisy, prompt, g["token_ids"])
        for i, t in enumerate(g["token_ids"]):
            gap = float(rows[i].max() - rows[i, t])
            assert gap <= TIE_TOL, (case, i, t, int(rows[i].argmax()), gap)
            worst_gap = max(worst_gap, gap)
            exact += int(int(rows[i].argmax()) == t)
            total += 1
            worst = max(worst, abs(g["logprobs"][i] - float(rows[i, t])))
            spread = max(spread, abs(float(moved[i, t] - rows[i, t])))
        same = 0
        while same < len(s["token_ids"]) and s["token_ids"][same] == g["token_ids"][same]:
            same += 1
        lead.append(same)
    report(f"{'/'.join(map(str, case))}: {exact}/{total} tokens our runtime's argmax, the rest "
           f"within {worst_gap:.3f} of it (tol {TIE_TOL}); max |dlogprob| {worst:.3f} (tol "
           f"{LOGPROB_TOL}; our runtime's own spread at {CALIBRATION:.0e}: {spread:.3f}); "
           f"leading tokens equal to the unquantized BF16 source: {lead} of {MAX_TOKENS}")
    assert worst <= LOGPROB_TOL, (case, worst)


@pytest.fixture(scope="session")
def oracle(models, prompt_ids):
    """(our runtime, the same perturbed, the source's free-running greedy) per (kind, backend,
    tp); ``tp`` > 1 splits the row-parallel linears and MoE experts over emulated ranks."""
    cache: dict = {}

    def get(kind: str, backend: str, tp: int = 1):
        key = (kind, backend, tp)
        if key not in cache:
            src, out = models[(kind, "source")], models[(kind, backend)]
            cache[key] = (runtime_model(out, src, tp=tp),
                          runtime_model(out, src, CALIBRATION, tp=tp),
                          source_greedy(src, prompt_ids))
        return cache[key]

    return get


@pytest.mark.parametrize("case", [c for c in CASES if c != SERVED] + MOE_CASES,
                         ids=lambda c: f"{c[0]}-{c[1]}-tp{c[2]}")
def test_generate_matches_runtime(case, models, prompt_ids, oracle):
    """examples/serve_with_vllm.py: vLLM's greedy tokens and logprobs agree with our runtime."""
    kind, backend, tp = case
    proc = run_engine([EXAMPLE, str(models[(kind, backend)]), "--tp", str(tp), "--json",
                       "--dtype", "float32", "--enforce-eager", "--max-tokens", str(MAX_TOKENS),
                       "--prompt-ids", json.dumps(prompt_ids)])
    got = engine_results(proc)
    assert [r["prompt_token_ids"] for r in got] == prompt_ids
    _compare(case, got, prompt_ids, oracle(kind, backend, tp))


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_openai_server_answers_a_completion(models, prompt_ids, oracle):
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1: one completion, then stop."""
    kind, backend, tp = SERVED
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(models[(kind, backend)]), "--host", "127.0.0.1", "--port", str(port), "--dtype",
         "float32", "--max-model-len", "256", "--enforce-eager", "--served-model-name", "tiny"],
        env=engine_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-4000:]
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start within 300 s"
                time.sleep(2)
        got = []
        for ids in prompt_ids:
            out = _post(f"{base}/v1/completions", {
                "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True})
            lp = out["choices"][0]["logprobs"]
            got.append({"token_ids": [int(t.split(":")[1]) for t in lp["tokens"]],
                        "logprobs": lp["token_logprobs"]})
        _compare(SERVED, got, prompt_ids, oracle(kind, backend))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


REFUSE = """
import sys
from vllm import LLM
if __name__ == "__main__":
    for folder in sys.argv[1:]:
        try:
            LLM(model=folder, max_model_len=256, enforce_eager=True)
            print("LOADED", folder)
        except Exception as e:
            print("REFUSED", folder, type(e).__name__, str(e).replace(chr(10), " | "))
"""


def _moe_checkpoint(root, backend: str = "trtllm") -> object:
    """A tiny Mixtral (2 experts, H=512, I=128) converted for ``backend`` (trtllm: a fused MoE
    block; cutlass: per-expert projections of 128 rows; either on whole tiles only at TP=1),
    converted once per session."""
    import torch
    import transformers
    from conftest import convert

    src, out = root / "moe", root / f"moe-{backend}"
    if (out / "config.json").exists():
        return out
    if (src / "config.json").exists():
        return convert(src, backend, out)
    cfg = transformers.MixtralConfig(vocab_size=384, hidden_size=512, intermediate_size=128,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=128, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((root / "llama" / f).read_bytes())
    return convert(src, backend, out)


def test_start_up_refusals_are_one_line(models, tmp_path):
    """No completion marker, an unknown format_version: refused before any weight, one line
    each; in the same engine process, fused MoE blocks (trtllm's default for a MoE model), once
    refused, now load."""
    base = models[("llama", "trtllm")]
    no_marker = copy_checkpoint(base, tmp_path / "no-marker")
    (no_marker / "mxfp8_convert.complete.json").unlink()
    future = copy_checkpoint(base, tmp_path / "future")
    cfg = json.loads((future / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 99
    (future / "config.json").write_text(json.dumps(cfg))
    moe = _moe_checkpoint(base.parent)
    assert json.loads((moe / "config.json").read_text())["quantization_config"]["moe"]
    script = tmp_path / "refuse.py"
    script.write_text(REFUSE)
    proc = run_engine([str(script), str(no_marker), str(future), str(moe)])
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines()
             if ln.startswith(("REFUSED", "LOADED"))}
    want = {
        no_marker: ("MarkerError",
                    "no mxfp8_convert.complete.json: not a complete mxfp8-convert output"),
        future: ("MarkerError", "format_version 99 is not supported"),
    }
    for folder, (kind, text) in want.items():
        line = lines.get(str(folder), "")
        assert line.startswith("REFUSED"), (folder, line, proc.stderr[-3000:])
        assert f" {kind} " in line and text in line, (line, text)
        assert " | " not in line, line  # one line
        report(f"refused: {line}")
    assert lines.get(str(moe), "").startswith("LOADED"), (lines.get(str(moe)),
                                                          proc.stderr[-3000:])


def _refusal(proc, want: str) -> str:
    """The engine start failed and a line of its output (the workers log to stdout) holds the
    one-line refusal ``want``; returns that line from the error's message on."""
    assert proc.returncode != 0
    hits = [ln for ln in (proc.stdout + proc.stderr).splitlines() if want in ln]
    assert hits, proc.stderr[-4000:]
    return hits[0].split("LayoutError: ")[-1]


def test_tp_outside_tp_compat_is_refused(models):
    """An MLP of 9 tiles slices at TP=1 only: TP=2 is refused naming the first module."""
    folder = models[("llama_tp1", "cutlass")]
    marker = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert marker["tp_compat"] == [1]
    proc = run_engine([EXAMPLE, str(folder), "--tp", "2", "--json", "--max-tokens", "1",
                       "--enforce-eager"])
    want = ("tensor parallel 2 is not in this checkpoint's tp_compat [1]: "
            "model.layers.0.mlp.down_proj [512, 1152] (row-parallel, cutlass) "
            "at tensor parallel 2: K=576 per rank, not a multiple of 128")
    report(f"refused at TP=2: {_refusal(proc, want)}")


@pytest.mark.parametrize("backend", ["cutlass", "trtllm"])
def test_moe_tp_outside_tp_compat_is_refused(models, backend):
    """Experts of I=128 slice on tiles at TP=1 only: TP=2 is refused naming the first expert
    projection (cutlass) or the fused block and its I (trtllm) that does not."""
    folder = _moe_checkpoint(models[("llama", "source")].parent, backend)
    marker = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (marker["moe"] is None) == (backend == "cutlass") and marker["tp_compat"] == [1]
    proc = run_engine([EXAMPLE, str(folder), "--tp", "2", "--json", "--max-tokens", "1",
                       "--enforce-eager"])
    block = "model.layers.0.block_sparse_moe.experts"
    want = "tensor parallel 2 is not in this checkpoint's tp_compat [1]: " + {
        "cutlass": f"{block}.0.w1 [128, 512] (column-parallel, cutlass) at tensor parallel 2: "
                   "64 rows per rank, not a multiple of 128",
        "trtllm": f"{block} fused MoE block (E=2, H=512, I=128, trtllm_fused_moe) at tensor "
                  "parallel 2: I=64 per rank, not a multiple of 128"}[backend]
    report(f"refused at TP=2: {_refusal(proc, want)}")


EP = """
import sys
from vllm import LLM
if __name__ == "__main__":
    LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, tensor_parallel_size=2,
        enable_expert_parallel=True)
"""


def test_expert_parallel_is_refused(models, tmp_path):
    """Expert parallelism: refused at start-up in one line naming the MoE layer."""
    script = tmp_path / "ep.py"
    script.write_text(EP)
    proc = run_engine([str(script), str(models[("mixtral", "cutlass")])])
    want = ("model.layers.0.block_sparse_moe.experts: expert parallelism (EP size 2) is not "
            "supported; serve it with tensor parallelism")
    report(f"refused with EP: {_refusal(proc, want)}")
