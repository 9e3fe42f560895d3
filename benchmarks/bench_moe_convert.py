"""Convert a synthetic >= 4 GB MoE MXFP8 checkpoint to trtllm (fused MoE) and, in the same run,
`cp -r` + sync the same files; report median times and the converter's peak RSS.

Qwen3-MoE-style names (``model.layers.L.mlp.experts.E.{gate,up,down}_proj`` + ``weight_scale_inv``,
a bf16 router ``mlp.gate``), packed into shards in order so that layers straddle shards. The
source is streamed to disk from a few random buffers (no NaN codes), so making it costs about
what writing it does.

Usage: python benchmarks/bench_moe_convert.py [--gb 4] [--dir bench-data-moe] [--repeat 3]
       [--hidden 2048] [--intermediate 768] [--experts 128] [--keep] [--verify]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _env import against_cp, timed  # noqa: E402  (_env imports torch only inside banner())

POOL_BYTES = 64 << 20  # distinct random bytes; tensors are cut from it at varying offsets


def tensor_list(
    layers: int, experts: int, h: int, i: int
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor, in file order."""
    out = [("model.embed_tokens.weight", "BF16", (1024, h))]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", "BF16", (h,)),
            (f"{p}.mlp.gate.weight", "BF16", (experts, h)),
        ]
        for e in range(experts):
            for proj, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                out += [
                    (f"{p}.mlp.experts.{e}.{proj}.weight", "F8_E4M3", (n, k)),
                    (f"{p}.mlp.experts.{e}.{proj}.weight_scale_inv", "U8", (n, k // 32)),
                ]
    return out


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = 2 if dtype == "BF16" else 1
    for d in shape:
        n *= d
    return n


def pools() -> dict[str, bytes]:
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 254, (POOL_BYTES,), generator=gen, dtype=torch.int16)
    w = (w + (w >= 0x7F).to(torch.int16)).to(torch.uint8)  # no 0x7F; 0xFF is never drawn
    s = torch.randint(112, 128, (POOL_BYTES // 32,), generator=gen, dtype=torch.int16).to(
        torch.uint8
    )
    b = (torch.randn(POOL_BYTES // 2, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8)
    return {"F8_E4M3": w.numpy().tobytes(), "U8": s.numpy().tobytes(), "BF16": b.numpy().tobytes()}


def write_shard(
    path: Path, entries: list[tuple[str, str, tuple[int, ...]]], data: dict[str, bytes]
) -> None:
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes(dtype, shape)],
        }
        pos += nbytes(dtype, shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for j, (_, dtype, shape) in enumerate(entries):
            n, pool = nbytes(dtype, shape), data[dtype]
            start = (j * 4160) % (
                len(pool) // 2
            )  # a different cut for every tensor (even: bf16 stays aligned)
            while n:
                piece = min(n, len(pool) - start)
                f.write(memoryview(pool)[start : start + piece])
                n, start = n - piece, 0


def make_source(root: Path, gb: float, experts: int, h: int, i: int) -> Path:
    if (root / "model.safetensors.index.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    per_layer = experts * 3 * (h * i + h * i // 32)
    layers = max(1, -(-int(gb * 1e9) // per_layer))
    entries = tensor_list(layers, experts, h, i)
    total = sum(nbytes(d, s) for _, d, s in entries)
    shards = max(2, round(total / 1.2e9))
    groups: list[list] = [[] for _ in range(shards)]
    done = 0
    for entry in entries:  # in order: a shard boundary falls inside a layer's experts
        groups[min(done * shards // total, shards - 1)].append(entry)
        done += nbytes(entry[1], entry[2])
    data = pools()
    weight_map = {}
    for j, group in enumerate(groups):
        fn = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        write_shard(root / fn, group, data)
        weight_map.update({name: fn for name, _, _ in group})
    (root / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        )
    )
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "hidden_size": h,
                "num_hidden_layers": layers,
                "num_experts": experts,
                "moe_intermediate_size": i,
                "quantization_config": {
                    "quant_method": "mxfp8",
                    "fmt": "e4m3",
                    "weight_block_size": [1, 32],
                    "scale_fmt": "ue8m0",
                    "activation_scheme": "dynamic",
                },
            }
        )
    )
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", default="bench-data-moe")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument(
        "--keep", action="store_true", help="also time --moe keep (experts left per-expert)"
    )
    ap.add_argument(
        "--verify", action="store_true", help="verify the last trtllm output against the source"
    )
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = Path(args.dir)
    if args.make_only:
        make_source(base / "src", args.gb, args.experts, args.hidden, args.intermediate)
        return
    here = Path(__file__).parent
    banner = subprocess.run(
        [sys.executable, "-c", "from _env import banner; print(banner())"],
        cwd=here,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(banner)
    # made in a child so that this process stays small and cannot skew the RSS figures
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--make-only",
            "--gb",
            str(args.gb),
            "--dir",
            args.dir,
            "--hidden",
            str(args.hidden),
            "--intermediate",
            str(args.intermediate),
            "--experts",
            str(args.experts),
        ],
        check=True,
    )
    src = base / "src"
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    subprocess.run(
        ["cat", *map(str, shards)], stdout=subprocess.DEVNULL, check=True
    )  # warm the page cache
    # the floor: a process that only imports the converter (fusing MXFP8 experts needs no torch)
    _, idle = timed([sys.executable, "-c", "import mxfp8_convert.convert"])
    convert = [sys.executable, "-m", "mxfp8_convert", str(src), "--backend", "trtllm", "--quiet"]
    contenders = {"mxfp8-convert trtllm (fused MoE)": convert}
    if args.keep:
        contenders["mxfp8-convert trtllm --moe keep"] = [*convert, "--moe", "keep"]
    times, rss = against_cp(src, base / "dst", contenders, args.repeat)
    dst = base / "dst"
    if args.verify:
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run([*convert, "-o", str(dst)], check=True)
        t, _ = timed(
            [
                sys.executable,
                "-m",
                "mxfp8_convert",
                "verify",
                str(dst),
                "--source",
                str(src),
                "--quiet",
            ]
        )
        print(f"verify --source: OK in {t:.1f} s")
    shutil.rmtree(dst, ignore_errors=True)

    cfg = json.loads((src / "config.json").read_text())
    h, i, e = args.hidden, args.intermediate, args.experts
    print(
        f"peak RSS of a process that only imports the converter: {idle / 2**20:.0f} MiB; "
        f"this process: {_self_rss() / 2**20:.0f} MiB"
    )
    print(
        f"source: {size / 1e9:.2f} GB in {len(shards)} shards, "
        f"{cfg['num_hidden_layers']} MoE layers of "
        f"E={e}, H={h}, I={i} (one expert {3 * h * i / 2**20:.1f} MiB, one layer's experts "
        f"{e * 3 * h * i / 2**20:.0f} MiB of e4m3); median of {args.repeat} interleaved runs"
    )
    base_t = statistics.median(times["cp -r + sync"])
    for name, ts in times.items():
        t = statistics.median(ts)
        extra = f"  peak RSS {rss[name] / 2**20:.0f} MiB" if name in rss else ""
        print(
            f"{name:34s} {t:7.2f} s  {size / t / 1e9:5.2f} GB/s  "
            f"speed vs cp+sync {base_t / t:4.2f}x{extra}"
            f"  (runs: {', '.join(f'{x:.2f}' for x in ts)})"
        )


def _self_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
