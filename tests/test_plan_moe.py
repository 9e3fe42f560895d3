"""``plan.expert_key`` takes plain names apart without its regex: every name must give what
``EXPERT_RE`` (the documented rule) gives."""

from __future__ import annotations

import pytest

from mxfp8_convert.plan import EXPERT_PROJS, EXPERT_RE, expert_key


def _by_regex(module: str):
    m = EXPERT_RE.match(module)
    if m is None or m["proj"] not in EXPERT_PROJS:
        return None
    return m["block"], int(m["expert"]), EXPERT_PROJS[m["proj"]]


NAMES = [
    "model.layers.3.mlp.experts.7.up_proj",
    "model.layers.3.mlp.experts.7.w2",
    "model.layers.3.mlp.experts.007.gate_proj",
    "a.experts.b.experts.1.down_proj",  # the last ".experts." is the block's
    "model.layers.3.mlp.experts.7.up_proj.extra",
    "model.layers.3.mlp.experts.x7.up_proj",
    "model.layers.3.mlp.experts..up_proj",
    "model.layers.3.mlp.experts.7.",
    "model.layers.3.mlp.experts.7.other_proj",
    "model.layers.3.mlp.shared_experts.gate_proj",
    "model.layers.3.mlp.shared_experts.0.gate_proj",
    ".experts.0.w1",  # nothing before the block's ".experts"
    "x.experts.0.w1",
    "experts.0.w1",
    "model.layers.3.mlp.experts.\u0663.w1",  # an Arabic-Indic digit: \\d matches it, int reads it
    "model.layers.3.mlp.experts.\u00b2.w1",  # a superscript: not a decimal digit
    "model.layers.3.mlp.experts.7.w1\n",  # "$" matches before a final newline
    "model.la\nyers.3.mlp.experts.7.w1",  # "." does not match a newline
    "model.layers.3.mlp.gate",
    "",
]


@pytest.mark.parametrize("name", NAMES)
def test_expert_key_is_what_the_regex_gives(name):
    expert_key.cache_clear()
    assert expert_key(name) == _by_regex(name)


def test_revised_changes_action_layout_and_reason_only():
    """``revised`` builds the tuple itself: what ``_replace`` of those three fields gives, every
    other field (defaults overridden) as it was."""
    from mxfp8_convert.plan.model import ModulePlan, revised
    from mxfp8_convert.read import TensorInfo

    w = TensorInfo("m.weight", "F8_E4M3", (256, 512), "a.safetensors", 8, 256 * 512)
    s = TensorInfo("m.weight_scale_inv", "U8", (256, 16), "b.safetensors", 8, 256 * 16)
    m = ModulePlan("m", 256, 512, w, s, "relayout", "trtllm", "r", "laid_out", "cutlass",
                   "fused-slice", "names", "stacked-slice")
    got = revised(m, action="keep", layout="canonical", reason="why")
    assert got == m._replace(action="keep", layout="canonical", reason="why")
    assert type(got) is ModulePlan and got.stacked == "stacked-slice"
