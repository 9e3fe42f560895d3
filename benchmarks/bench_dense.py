"""Dense BF16 -> MXFP8 canonical at Llama-3.2-1B size (issue 25), side by side with `cp -r`.

Builds a synthetic 3.0 GB BF16 checkpoint with Llama-3.2-1B's config and tensor names (lm_head
untied; random weights, no Hub), then times, interleaved in fresh processes: ``cp -r`` +
``sync`` of the same files, ``mxfp8-convert SRC --backend canonical``, and the plain
load / quantize / save script ``naive_dense.py`` (+ ``sync``); optionally the converter of an
older tree (``--baseline DIR``, e.g. ``git archive main | tar -x -C DIR``), whose output is then
compared byte for byte with ours (``cmp``). Peak RSS of each child from ``os.wait4``.

Usage: python benchmarks/bench_dense.py [--dir /tmp/bench-dense] [--repeat 2] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _env import timed  # noqa: E402

#: Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B), lm_head untied so that it is stored
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}


def llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
           "lm_head.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                f"{p}.mlp.down_proj.weight": (h, i)}
    return out


def make_source(root: Path) -> Path:
    """The checkpoint, written once (normal(0, 0.02) weights, ones for the norms)."""
    import torch  # only in the child that makes the data: the timing parent stays small
    from safetensors.torch import save_file

    if (root / "model.safetensors").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in llama_shapes(LLAMA_3_2_1B).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(root / ".model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(LLAMA_3_2_1B, indent=2))
    (root / ".model.safetensors").rename(root / "model.safetensors")
    return root


def run_round(src: Path, dst: Path, contenders: dict[str, list[str]], times: dict, rss: dict,
              keep: Path | None) -> None:
    """One interleaved round; each contender writes ``dst`` afresh (``keep``: the output of each
    converter is moved there, under its name, for the byte comparison)."""
    for name, cmd in contenders.items():
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        t, r = timed([*cmd, "-o", str(dst)] if cmd[0] != "cp" else [*cmd, str(dst)])
        t_sync, _ = timed(["sync"])
        if name.startswith("mxfp8-convert"):
            t_sync = 0.0  # the converter fsyncs its own output
        times.setdefault(name, []).append(t + t_sync)
        rss[name] = max(rss.get(name, 0), r)
        if keep is not None and name.startswith("mxfp8-convert"):
            shutil.rmtree(keep / name, ignore_errors=True)
            shutil.move(str(dst), keep / name)


def compare(keep: Path, names: list[str]) -> bool:
    """``cmp`` every file of the first converter's output with the others'."""
    first, same = keep / names[0], True
    for other in names[1:]:
        for p in sorted((first).iterdir()):
            r = subprocess.run(["cmp", str(p), str(keep / other / p.name)], capture_output=True)
            verdict = "same" if r.returncode == 0 else "DIFFER"
            print(f"cmp {names[0]} vs {other}: {p.name}: {verdict}")
            same &= r.returncode == 0
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/bench-dense")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--baseline", help="also time (and cmp against) the converter of this tree")
    ap.add_argument("--out", default=str(HERE / "results" / "dense.json"))
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = Path(args.dir)
    if args.make_only:
        make_source(base / "src")
        return
    subprocess.run([sys.executable, __file__, "--make-only", "--dir", args.dir], check=True)
    src, dst, keep = base / "src", base / "dst", base / "outputs"
    keep.mkdir(exist_ok=True)
    size = sum(p.stat().st_size for p in src.iterdir())
    tree = os.environ.get("PYTHONPATH", str(HERE.parent))
    cli = ["-P", "-m", "mxfp8_convert", str(src), "--backend", "canonical", "--quiet"]
    contenders = {"cp -r + sync": ["cp", "-r", str(src)],
                  "mxfp8-convert canonical": ["env", f"PYTHONPATH={tree}", sys.executable, *cli],
                  "naive_dense.py + sync": [sys.executable, str(HERE / "naive_dense.py"), str(src)]}
    if args.baseline:
        contenders["mxfp8-convert canonical@baseline"] = [
            "env", f"PYTHONPATH={Path(args.baseline).resolve()}", sys.executable, *cli]
    subprocess.run(["cat", str(src / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
    times: dict[str, list[float]] = {}
    rss: dict[str, int] = {}
    for _ in range(args.repeat):
        run_round(src, dst, contenders, times, rss, keep)
    shutil.rmtree(dst, ignore_errors=True)
    same = compare(keep, [n for n in contenders if n.startswith("mxfp8-convert")])
    report(times, rss, size, same, args)


def report(times: dict, rss: dict, size: int, same: bool, args) -> None:
    cp = times["cp -r + sync"]
    rows = []
    print(f"source: {size / 1e9:.2f} GB BF16 (Llama-3.2-1B shapes), {args.repeat} interleaved "
          f"rounds; load average {os.getloadavg()[0]:.1f}")
    for name, ts in times.items():
        ratios = [t / c for c, t in zip(cp, ts, strict=True)]
        print(f"{name:34s} median {statistics.median(ts):6.2f} s  x cp per round "
              f"{min(ratios):5.2f}-{max(ratios):5.2f}  peak RSS {rss[name] / 2**20:6.0f} MiB  "
              f"runs {', '.join(f'{t:.2f}' for t in ts)}")
        rows.append({"name": name, "seconds": ts, "times_cp_per_round": ratios,
                     "peak_rss": rss[name]})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "host": os.uname().nodename, "cores": os.cpu_count(), "bytes": size,
        "outputs_identical": same, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
