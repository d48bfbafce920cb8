"""What a decoder's attention does beyond plain causal attention, read from its config (any family, not its name):
sliding windows, soft-capping, attention sinks, other layer types. Per-document packing (shared/tasks/packing.py)
and the techniques that split attention (ulysses, tensor_parallel, pipeline_stages) read it; a copy for another task
carries none of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


SLIDING = "sliding_attention"


def layer_attention_types(config: PretrainedConfig) -> list[str]:
    """Each block's attention: the config's layer_types where it has them (Gemma 2/3, Qwen2/3, gpt-oss ...), else
    sliding in every block when it sets a sliding_window (Mistral: its model masks every layer so), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = SLIDING if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * (getattr(config, "num_hidden_layers", 0) or 0)


def attention_features(config: PretrainedConfig, model: nn.Module | None = None) -> dict[str, object]:
    """What a causal LM's attention and head do beyond plain causal attention, from its config (any family, not its
    name): {"sliding window": its width, "attention soft-capping" / "final logit soft-capping": the cap, "attention
    sinks": True (a `sinks` parameter: read from `model` when given), "<type> layers": another layer type}."""
    found: dict[str, object] = {}
    types = set(layer_attention_types(config))
    if SLIDING in types:
        found["sliding window"] = config.sliding_window
    found.update({f"{t} layers": True for t in types - {SLIDING, "full_attention"}})
    for key, name in (("attn_logit_softcapping", "attention soft-capping"),
                      ("final_logit_softcapping", "final logit soft-capping")):
        if getattr(config, key, None):
            found[name] = getattr(config, key)
    if model is not None and any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in model.named_parameters()):
        found["attention sinks"] = True
    return found
