"""Tiny local model directories shaped like today's checkpoints, from transformers' own config classes: tied
embeddings (Qwen2.5 / Llama 3.2 1B), sliding-window attention (Mistral, Gemma 3), soft-capped logits (Gemma 2),
attention sinks (gpt-oss). Each is saved with a word tokenizer of the built-in data beside it, in fp32 (the dtype is
not what these tests are about), and reused when present."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.core import data

HEADS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
WINDOW = 8  # shorter than the tests' sequences, so the window changes the result


def config_of(kind: str, ids: dict):
    """The config of `kind`; `ids`: vocab_size and the special token ids."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    if kind == "qwen2-tied":  # Qwen2.5-0.5B / 1.5B: tied head, sliding window off
        return Qwen2Config(**HEADS, **ids, tie_word_embeddings=True)
    if kind == "llama-tied":  # Llama 3.2 1B: tied head, rope scaling llama3
        return LlamaConfig(**HEADS, **ids, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "mistral":  # every layer sliding
        return MistralConfig(**HEADS, **ids, sliding_window=WINDOW, head_dim=16)
    if kind == "gemma2":  # alternating sliding/full, attention and final logits soft-capped, tied head
        return Gemma2Config(**HEADS, **ids, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    if kind == "gemma3":  # 5 sliding : 1 full in the real model; here sliding then full
        return Gemma3TextConfig(**HEADS, **ids, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "full_attention"])
    if kind == "gpt-oss":  # attention sinks, alternating sliding/full, a small mixture of experts
        return GptOssConfig(**{**HEADS, "intermediate_size": 64}, **ids, head_dim=16, sliding_window=WINDOW,
                            num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention",
                                                                                     "full_attention"])
    raise ValueError(kind)


def make_dir(root: Path, kind: str) -> Path:
    """<root>/<kind>: a randomly initialised causal LM of that kind and its tokenizer."""
    from transformers import AutoModelForCausalLM

    out = Path(root) / kind
    if (out / "config.json").exists():
        return out
    tokenizer = data.build_word_tokenizer(list(data.builtin_split("causal-lm", "train")["text"]), "causal-lm")
    config = config_of(kind, dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    config.dtype = torch.float32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
