"""Write the bundled demo checkpoint: a tiny Llama-style SGLang MXFP8 model in two shards.

Deterministic (seeded), a few MB, with realistic tensor names, an ignored bf16 lm_head and one
module whose weight and scale sit in different shards. Usage:
    python examples/make_demo_model.py examples/tiny-mxfp8
"""

import sys

from mxfp8_convert.synth import SynthSpec, write_checkpoint

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "examples/tiny-mxfp8"
    spec = SynthSpec(layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=4, vocab=1024,
                     shards=2)
    print(write_checkpoint(out, spec))
