"""Output shards: the plan's tensors laid out into files of bounded size, named and indexed as
Hub checkpoints are (docs/FORMAT.md section 1).

The packing is huggingface_hub's ``split_torch_state_dict_into_shards`` (what transformers'
``save_pretrained`` calls), applied to groups of tensors that must share a file (a module's
weight and scale, a fused MoE projection and its scale) in source order: a group goes into the
current shard unless it would take it past the bound, then a new shard starts; a group larger
than the bound gets a shard of its own. One shard is ``model.safetensors`` (no index), more are
``model-00001-of-0000N.safetensors`` beside ``model.safetensors.index.json``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mxfp8_convert.errors import FormatError
from mxfp8_convert.format import SINGLE_FILE
from mxfp8_convert.plan.model import TensorPlan

#: ``--max-shard-size`` by default: huggingface_hub's ``MAX_SHARD_SIZE`` (transformers 4's
#: ``save_pretrained`` default; 5's is 50GB); about the Hub's own shards of large models
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: huggingface_hub ``constants.SAFETENSORS_WEIGHTS_FILE_PATTERN``; ``suffix`` is
#: ``-{i:05d}-of-{n:05d}`` (1-based), or empty for a single shard
SHARD_PATTERN = "model{suffix}.safetensors"


def shard_size_bytes(value: int | str) -> int:
    """``--max-shard-size`` in bytes: an int, or a size like ``"5GB"`` (10^9, as transformers
    and huggingface_hub read it) or ``"4GiB"`` (2^30), read by pydantic's ``ByteSize``.

    Raises:
        FormatError: not a size, or not positive.
    """
    if isinstance(value, bool):
        raise FormatError(f"--max-shard-size {value!r} is not a size like 5GB")
    if isinstance(value, int):
        size = value
    else:
        from pydantic import ByteSize, TypeAdapter, ValidationError

        try:
            size = int(TypeAdapter(ByteSize).validate_python(str(value).strip()))
        except ValidationError:
            raise FormatError(
                f"--max-shard-size {value!r} is not a size like 5GB or 4GiB"
            ) from None
    if size <= 0:
        raise FormatError(f"--max-shard-size must be positive, got {value!r}")
    return size


def pack(groups: Sequence[Sequence[TensorPlan]], max_bytes: int) -> list[list[TensorPlan]]:
    """The tensors of ``groups`` (in order) split into shards of at most ``max_bytes`` each,
    a group never split; a group over the bound alone in a shard (placed where it was met, so
    it may come before the shard being filled, as in huggingface_hub). No shard is empty."""
    shards: list[list[TensorPlan]] = []
    current: list[TensorPlan] = []
    size = 0
    for group in groups:
        n = sum(t.nbytes for t in group)
        if n > max_bytes:
            shards.append(list(group))
            continue
        if size + n > max_bytes and current:
            shards.append(current)
            current, size = [], 0
        current += group
        size += n
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """File names of ``count`` output shards: ``model.safetensors`` alone, else
    ``model-00001-of-000NN.safetensors``... (five digits at least, as huggingface_hub writes)."""
    if count == 1:
        return [SINGLE_FILE]
    return [SHARD_PATTERN.format(suffix=f"-{i + 1:05d}-of-{count:05d}") for i in range(count)]
