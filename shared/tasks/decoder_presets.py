"""The decoder presets (--model_preset tiny-llama, tiny-moe, tiny-qwen2, tiny-qwen3-moe, tiny-mistral): today's
decoders (RMSNorm, rotary positions, grouped-query attention, SwiGLU, an untied head), as Llama and Mixtral (a
mixture of experts) build them. They serve text: a causal LM, or a classifier on the last token.

shared/core/models.py preset_config loads this module by name; it is copied with the causal-lm and sft tasks
(`python -m shared.tools.cp RECIPE DEST --task causal-lm`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# 4 query heads share 2 key/value heads (GQA): 2 tensor-parallel processes each take 1 KV head and its 2 queries.
_TINY_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
# 4 experts, each token routed to 2; the router's load-balancing loss counts in training (output_router_logits).
# Jitter off: it draws random numbers in the forward, so runs that differ only in batching would not match.
_TINY_MOE = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                 router_jitter_noise=0.0)


# Shaped as today's checkpoints ship (issue 33): stored in bf16 (config.json's dtype: --weights_dtype fp32, the
# default, upcasts it); Qwen2.5 / Llama 3.2 1B-3B tie the head to the embedding; Qwen3-MoE and Mixtral ship
# output_router_logits false (the recipes switch it on: models.train_router); Mistral and Gemma attend within a
# sliding window (16 tokens here: shorter than the sequences the tests and the presets sweep train on).
_SHIPPED = {"tiny-qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
            "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                                      output_router_logits=False, router_aux_loss_coef=0.001,
                                                      head_dim=16)),
            "tiny-mistral": ("MistralConfig", dict(sliding_window=16))}


def preset_config(task: str, preset: str, vocab_size: int, num_labels: int, **token_ids: int | None
                  ) -> PretrainedConfig:
    """The config of decoder preset `preset` for `task` (token_ids: the tokenizer's pad/bos/eos ids)."""
    from transformers import LlamaConfig, MixtralConfig

    if task == "image-classification":  # refused earlier by the rule table; a direct caller gets it here
        raise ValueError(f"--model_preset {preset} is a text model; --task image-classification needs a ViT")
    if preset in _SHIPPED:
        import transformers

        name, shape = _SHIPPED[preset]
        return getattr(transformers, name)(vocab_size=vocab_size, num_labels=num_labels,
                                           **{**_TINY_DECODER, **shape}, dtype="bfloat16", **token_ids)
    if preset == "tiny-moe":
        return MixtralConfig(vocab_size=vocab_size, num_labels=num_labels, **_TINY_DECODER, **_TINY_MOE,
                             **token_ids)
    return LlamaConfig(vocab_size=vocab_size, num_labels=num_labels, **_TINY_DECODER, **token_ids)
