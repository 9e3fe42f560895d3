"""``MXFP8Experts``: the MXFP8 experts of one MoE block behind a transformers experts face.

transformers (5.x) holds a MoE block's experts as one module with 3-D parameters
``gate_up_proj [E, 2I, H]`` (rows ``[gate; up]``) and ``down_proj [E, H, I]``, called as
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
(``transformers.integrations.moe.use_experts_implementation``). :func:`experts_face` says
whether a module is such an experts module and whether this runtime can serve it (SwiGLU, no
biases, not transposed); :class:`MXFP8Experts` replaces it, holding either

- a fused trtllm block (:class:`MXFP8MoEWeights`, run by :func:`mxfp8_fused_moe`), or
- per-expert MXFP8 weights (a checkpoint converted for cutlass, or with ``--moe keep``), each
  projection run by :func:`mxfp8_linear`: ``down(bf16(silu(gate(x)) * up(x)))``.

Routing stays the model's own (its router computes ``top_k_index`` and ``top_k_weights``), and
the output has the dtype of ``hidden_states``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mxfp8_convert.errors import LayoutError
from mxfp8_convert.runtime.linear import check_input_dtype, mxfp8_linear
from mxfp8_convert.runtime.moe import MXFP8MoEWeights, mxfp8_fused_moe
from mxfp8_convert.runtime.weight import MXFP8Weight

#: roles of the projections of one expert, in the order :class:`MXFP8Experts` keeps them
EXPERT_ROLES = ("gate", "up", "down")
_PROBE = torch.linspace(-8.0, 8.0, 64)


@dataclass(frozen=True, slots=True)
class ExpertsFace:
    """A transformers experts module as :class:`MXFP8Experts` sees it."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    unsupported: tuple[str, ...]  # what this runtime does not run (empty: it can serve it)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.experts, self.hidden, self.intermediate)

    def check(self, kind: str) -> None:
        """Raise LayoutError if the module's math is not what MXFP8 experts run."""
        if self.unsupported:
            raise LayoutError(
                f"{self.name}: the checkpoint holds these experts in MXFP8 ({kind}), but the "
                f"model's experts have {', '.join(self.unsupported)}; MXFP8 experts run "
                "SwiGLU experts without biases only"
            )


def experts_face(name: str, module: nn.Module) -> ExpertsFace | None:
    """The experts face of a transformers experts module (3-D ``gate_up_proj``, ``down_proj``),
    None for any other module. Its ``unsupported`` lists biases, transposed weights, a post-expert
    norm, a ``down_proj`` of another shape, or a gate other than ``silu(gate) * up``."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (
        not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor))
        or gate_up.dim() != 3
    ):
        return None
    e, two_i, h = (int(d) for d in gate_up.shape)
    i = two_i // 2
    unsupported = [
        what
        for what, bad in (
            ("biases", getattr(module, "has_bias", False) or hasattr(module, "gate_up_proj_bias")),
            ("transposed weights", getattr(module, "is_transposed", False)),
            ("a post-expert norm", getattr(module, "has_post_expert_norm", False)),
            (f"down_proj {list(down.shape)} (not [{e}, {h}, {i}])", tuple(down.shape) != (e, h, i)),
        )
        if bad
    ]
    if not unsupported and not _is_swiglu(module, i):
        unsupported.append("an activation other than silu(gate) * up over [gate; up]")
    return ExpertsFace(name, e, h, i, tuple(unsupported))


def _is_swiglu(module: nn.Module, i: int) -> bool:
    """Whether the module gates as ``silu(gate) * up`` over ``[gate; up]`` (checked on values)."""
    act = getattr(module, "act_fn", None)
    if act is None:
        return False
    with torch.no_grad():
        if not torch.equal(act(_PROBE), F.silu(_PROBE)):
            return False
        apply_gate = getattr(module, "_apply_gate", None)
        if apply_gate is None:
            return True  # the plain loop: gate, up = linear(x, gate_up).chunk(2)
        x = torch.randn(2, 2 * i, generator=torch.Generator().manual_seed(0))
        return torch.allclose(apply_gate(x), F.silu(x[:, :i]) * x[:, i:])


class MXFP8Experts(nn.Module):
    """Drop-in inference replacement for a transformers experts module.

    Build it with :meth:`fused` or :meth:`per_expert`. Buffers move with ``.to()`` byte for byte
    (stored as uint8, so ``model.to(dtype)`` leaves them alone).

    Args:
        name: the module's name (for messages).
        experts, hidden, intermediate: E, H, I.
        engine: engine for :func:`mxfp8_fused_moe` / :func:`mxfp8_linear`.
    """

    def __init__(
        self, name: str, experts: int, hidden: int, intermediate: int, engine: str = "auto"
    ) -> None:
        super().__init__()
        self.name, self.num_experts, self.hidden, self.intermediate = (
            name,
            experts,
            hidden,
            intermediate,
        )
        self.engine = engine
        self.kind = ""
        self._layouts: tuple[str, ...] = ()

    @classmethod
    def fused(cls, weights: MXFP8MoEWeights, engine: str = "auto") -> MXFP8Experts:
        """The fused trtllm block of a checkpoint (``MXFP8MoEWeights.from_checkpoint``)."""
        m = cls(weights.name, weights.num_experts, weights.hidden, weights.intermediate, engine)
        m.kind = "fused"
        for field in ("w13", "w13_scale", "w2", "w2_scale"):
            m.register_buffer(field, getattr(weights, field).view(torch.uint8))
        return m

    @classmethod
    def per_expert(
        cls, name: str, weights: dict[tuple[int, str], MXFP8Weight], engine: str = "auto"
    ) -> MXFP8Experts:
        """Per-expert projections ``(expert, role) -> weight``, experts ``0..E-1``, roles
        gate, up and down."""
        count = 1 + max(e for e, _ in weights)
        missing = [f"{e}.{r}" for e in range(count) for r in EXPERT_ROLES if (e, r) not in weights]
        if missing:
            raise LayoutError(
                f"{name}: the checkpoint has no expert projection(s) {', '.join(missing[:3])}"
            )
        i, h = weights[(0, "gate")].shape
        for (e, role), w in sorted(weights.items()):
            want = (h, i) if role == "down" else (i, h)
            if w.shape != want:
                raise LayoutError(
                    f"{w.name or name}: expert {e} {role} is {list(w.shape)}; "
                    f"expert 0 makes it {list(want)}"
                )
        m = cls(name, count, h, i, engine)
        m.kind = "per-expert"
        m._layouts = tuple(weights[(e, r)].layout for e in range(count) for r in EXPERT_ROLES)
        for e in range(count):
            for r in EXPERT_ROLES:
                w = weights[(e, r)]
                m.register_buffer(f"e{e}_{r}_data", w.data.view(torch.uint8))
                m.register_buffer(f"e{e}_{r}_scale", w.scale)
        return m

    def _weight(self, e: int, role: str) -> MXFP8Weight:
        layout = self._layouts[e * len(EXPERT_ROLES) + EXPERT_ROLES.index(role)]
        return MXFP8Weight(
            getattr(self, f"e{e}_{role}_data").view(torch.float8_e4m3fn),
            getattr(self, f"e{e}_{role}_scale"),
            layout,
            f"{self.name}.{e}.{role}",
        )

    def mx_weights(self) -> MXFP8MoEWeights:
        """The held fused bytes as :class:`MXFP8MoEWeights` (no copy); fused only."""
        f8 = torch.float8_e4m3fn
        return MXFP8MoEWeights(
            self.w13.view(f8),
            self.w13_scale,
            self.w2.view(f8),
            self.w2_scale,
            self.hidden,
            self.intermediate,
            self.name,
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        check_input_dtype(hidden_states, self.name)
        if self.kind == "fused":
            out = mxfp8_fused_moe(
                hidden_states, top_k_index, top_k_weights, self.mx_weights(), engine=self.engine
            )
        else:
            out = self._per_expert_forward(hidden_states, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)

    def _per_expert_forward(self, x, ids, weights) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise LayoutError(f"{self.name}: top_k_index outside [0, {self.num_experts})")
        out = torch.zeros((t, self.hidden), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1).float()
        for e in torch.unique(flat).tolist():
            pairs = (flat == e).nonzero().squeeze(1)
            tok = pairs // k
            xs = x[tok]
            gate = mxfp8_linear(xs, self._weight(e, "gate"), engine=self.engine).float()
            up = mxfp8_linear(xs, self._weight(e, "up"), engine=self.engine).float()
            h = (F.silu(gate) * up).to(torch.bfloat16)
            y = mxfp8_linear(h, self._weight(e, "down"), engine=self.engine).float()
            out.index_add_(0, tok, y * w[pairs].unsqueeze(1))
        return out.to(torch.bfloat16)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
            f"{self.kind}, engine={self.engine}"
        )
