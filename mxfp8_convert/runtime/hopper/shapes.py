"""Linear shapes ``(name, N, K)`` of the models the Hopper rules were tuned and are tested on
(N = out, K = in features); benchmarks and tests both import them from here."""

LLAMA3_8B = [  # hidden 4096, 32 heads / 8 KV heads x 128, MLP 14336
    ("llama3-8b.q_proj", 4096, 4096),
    ("llama3-8b.k_proj", 1024, 4096),  # v_proj is the same shape
    ("llama3-8b.o_proj", 4096, 4096),
    ("llama3-8b.gate_up_proj", 14336, 4096),
    ("llama3-8b.down_proj", 4096, 14336),
]
QWEN3_4B = [  # hidden 2560, 32 heads / 8 KV heads x 128, MLP 9728
    ("qwen3-4b.q_proj", 4096, 2560),
    ("qwen3-4b.k_proj", 1024, 2560),
    ("qwen3-4b.o_proj", 2560, 4096),
    ("qwen3-4b.gate_up_proj", 9728, 2560),
    ("qwen3-4b.down_proj", 2560, 9728),
]
DEEPSEEK_V3 = [  # hidden 7168; MLA ranks q 1536, kv 512 (+64 rope); 128 heads; MLP 18432;
    # experts 2048
    ("deepseek-v3.q_a_proj", 1536, 7168),
    ("deepseek-v3.kv_a_proj_with_mqa", 576, 7168),
    ("deepseek-v3.q_b_proj", 24576, 1536),
    ("deepseek-v3.kv_b_proj", 32768, 512),
    ("deepseek-v3.o_proj", 7168, 16384),
    ("deepseek-v3.mlp.gate_up_proj", 18432, 7168),
    ("deepseek-v3.mlp.down_proj", 7168, 18432),
    ("deepseek-v3.expert.gate_up_proj", 2048, 7168),
    ("deepseek-v3.expert.down_proj", 7168, 2048),
]
MODEL_SHAPES = LLAMA3_8B + QWEN3_4B + DEEPSEEK_V3
