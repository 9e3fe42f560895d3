"""Dense BF16 -> MXFP8 canonical at Llama-3.2-1B size (issue 25), side by side with `cp -r`.

Builds a synthetic 3.0 GB BF16 checkpoint with Llama-3.2-1B's config and tensor names (lm_head
untied; random weights, no Hub), then times, interleaved in fresh processes: ``cp -r`` +
``sync`` of the same files, ``mxfp8-convert SRC --backend canonical`` with an empty user cache
(each round's own ``XDG_CACHE_HOME``: the architecture is built) and again with the cache that
run left (the architecture's decisions read back), the plain load / quantize / save script
``naive_dense.py`` (+ ``sync``); optionally the converter of an older tree (``--baseline DIR``,
e.g. ``git archive main | tar -x -C DIR``); every converter output is compared byte for byte
with the first's (``cmp``; for JSON files that differ, the keys that do). And, for its share,
a process that only builds the transformers architecture the converter consults. Wall and CPU
time and peak RSS of each child from ``os.wait4``.

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


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (bytes) of one child, from
    ``os.wait4``; this parent never imports torch, so the child's RSS is its own."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{cmd} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def run_round(dst: Path, contenders: dict[str, list[str]], runs: dict, keep: Path,
              cache: Path) -> None:
    """One interleaved round; each contender writes ``dst`` afresh (the converters' outputs are
    moved to ``keep``, under their names, for the byte comparison). Writers but the converter,
    which fsyncs its own output, are followed by a timed ``sync``. ``cache`` (the converters'
    ``XDG_CACHE_HOME``) starts the round empty."""
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    for name, cmd in contenders.items():
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        wall, cpu, peak = timed([*cmd, str(dst)] if "{dst}" not in cmd else cmd)
        if not name.startswith(("mxfp8-convert", "architecture")):
            wall += timed(["sync"])[0]
        runs.setdefault(name, []).append({"wall_s": wall, "cpu_s": cpu, "peak_rss": peak})
        if name.startswith("mxfp8-convert"):
            shutil.rmtree(keep / name, ignore_errors=True)
            shutil.move(str(dst), keep / name)


def json_diff(a, b, at: str = "") -> list[str]:
    """Paths of the keys (or items) where two JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys(), key=str)
                for d in json_diff(a.get(k), b.get(k), f"{at}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in json_diff(x, y, f"{at}[{i}]")]
    return [] if a == b else [at or "."]


def compare(keep: Path, names: list[str]) -> dict[str, dict[str, list[str] | str]]:
    """``cmp`` every file of the first converter's output with the others': other -> file ->
    "same", or the JSON keys that differ, or "DIFFER"."""
    first, out = keep / names[0], {}
    for other in names[1:]:
        for p in sorted((first).iterdir()):
            q = keep / other / p.name
            r = subprocess.run(["cmp", str(p), str(q)], capture_output=True)
            verdict: list[str] | str = "same" if r.returncode == 0 else "DIFFER"
            if r.returncode and p.suffix == ".json" and q.exists():
                verdict = json_diff(json.loads(p.read_text()), json.loads(q.read_text()))
            print(f"cmp {names[0]} vs {other}: {p.name}: {verdict}")
            out.setdefault(other, {})[p.name] = verdict
    return out


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
    cli = ["-P", "-m", "mxfp8_convert", str(src), "--backend", "canonical", "--quiet", "-o"]
    arch = ("import json, sys; from mxfp8_convert.architecture import architecture; "
            "a = architecture(json.load(open(sys.argv[1]))); assert a.basis == 'architecture'")
    cache = base / "xdg-cache"
    env = ["env", f"PYTHONPATH={tree}", f"XDG_CACHE_HOME={cache}", sys.executable]
    contenders = {
        "cp -r + sync": ["cp", "-r", str(src)],
        # the first run of the round builds the architecture, the second reads its decisions
        "mxfp8-convert canonical": [*env, *cli],
        "mxfp8-convert canonical, architecture cached": [*env, *cli],
        "naive_dense.py + sync": [sys.executable, str(HERE / "naive_dense.py"), str(src), "-o"],
        # its share: a process that only builds the architecture (imports torch, transformers)
        "architecture only": ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-c", arch,
                              str(src / "config.json"), "{dst}"],
    }
    if args.baseline:
        contenders["mxfp8-convert canonical@baseline"] = [
            "env", f"PYTHONPATH={Path(args.baseline).resolve()}", f"XDG_CACHE_HOME={cache}",
            sys.executable, *cli]
    subprocess.run(["cat", str(src / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        run_round(dst, contenders, runs, keep, cache)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    same = compare(keep, [n for n in contenders if n.startswith("mxfp8-convert")])
    report(runs, size, same, args)


def report(runs: dict, size: int, same: dict, args) -> None:
    """Per contender: median wall and CPU seconds, wall time over cp's in each round (the
    spread), peak RSS; and the JSON under benchmarks/results/."""
    cp = [r["wall_s"] for r in runs["cp -r + sync"]]
    print(f"source: {size / 1e9:.2f} GB BF16 (Llama-3.2-1B shapes), {args.repeat} interleaved "
          f"rounds; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"converter outputs identical: "
          f"{all(v == 'same' for files in same.values() for v in files.values())}")
    rows = []
    for name, rs in runs.items():
        wall, cpu = [r["wall_s"] for r in rs], [r["cpu_s"] for r in rs]
        ratios = [w / c for c, w in zip(cp, wall, strict=True)]
        peak = max(r["peak_rss"] for r in rs)
        print(f"{name:34s} wall {statistics.median(wall):6.2f} s (x cp per round "
              f"{min(ratios):5.2f}-{max(ratios):5.2f})  CPU {statistics.median(cpu):6.2f} s  "
              f"peak RSS {peak / 2**20:5.0f} MiB  walls {', '.join(f'{t:.2f}' for t in wall)}")
        rows.append({"name": name, "runs": rs, "times_cp_per_round": ratios})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "host": os.uname().nodename, "cores": os.cpu_count(), "bytes": size,
        "outputs_compared": same, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
