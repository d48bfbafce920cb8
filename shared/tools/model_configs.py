"""Built-in copies of the published config.json of models people fine-tune, for the memory planner (shared/tools/
plan.py) when AutoConfig cannot read a hub id offline (this project's CI has no network, and a hub lookup that cannot
succeed retries for half a minute).

Each entry is (model_type, the config.json values the planner's formulas read). Only those values: dimensions, the
vocabulary, tied embeddings, experts, positions, and the dtype the weights are published in (from_pretrained loads
them in it, and Accelerate trains them in it unless FSDP upcasts them). Every other field keeps transformers' default
for the model type, which does not change a parameter count. tests/test_plan.py holds each count built from these
to the size its model card publishes.
"""

from __future__ import annotations

BF16 = {"dtype": "bfloat16"}  # config.json "torch_dtype": "bfloat16"

# https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json (and -3B, Llama-3.1-8B, Llama-3.1-70B)
_LLAMA_3 = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, **BF16)
LLAMA = {
    "meta-llama/Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, head_dim=64, tie_word_embeddings=True, **_LLAMA_3),
    "meta-llama/Llama-3.2-3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                    num_attention_heads=24, head_dim=128, tie_word_embeddings=True, **_LLAMA_3),
    "meta-llama/Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, tie_word_embeddings=False, **_LLAMA_3),
    "meta-llama/Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, tie_word_embeddings=False, **_LLAMA_3),
}
# Llama 3 (8192 positions) and 3.3 (70B Instruct only) have the 3.1 dimensions.
LLAMA["meta-llama/Meta-Llama-3-8B"] = {**LLAMA["meta-llama/Llama-3.1-8B"], "max_position_embeddings": 8192}
LLAMA["meta-llama/Meta-Llama-3-70B"] = {**LLAMA["meta-llama/Llama-3.1-70B"], "max_position_embeddings": 8192}
LLAMA["meta-llama/Llama-3.3-70B-Instruct"] = LLAMA["meta-llama/Llama-3.1-70B"]

# https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (and the other sizes): bias on q, k, v
_QWEN = dict(vocab_size=151936, **BF16)
_QWEN_BIG = dict(vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=131072, **BF16)
QWEN2 = {
    "Qwen/Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, **_QWEN),
    "Qwen/Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                              num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=131072,
                              **_QWEN),
    "Qwen/Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, **_QWEN),
    "Qwen/Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, **_QWEN_BIG),
    "Qwen/Qwen2.5-14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                             num_key_value_heads=8, **_QWEN_BIG),
    "Qwen/Qwen2.5-32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                             num_key_value_heads=8, **_QWEN_BIG),
    "Qwen/Qwen2.5-72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, **_QWEN_BIG),
}
# https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (and the other sizes): head_dim 128, q/k RMSNorm, no bias
_QWEN3 = dict(head_dim=128, num_key_value_heads=8, max_position_embeddings=40960, **_QWEN)
QWEN3 = {
    "Qwen/Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            tie_word_embeddings=True, **_QWEN3),
    "Qwen/Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                            tie_word_embeddings=True, **_QWEN3),
    "Qwen/Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          tie_word_embeddings=True, **_QWEN3),
    "Qwen/Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          tie_word_embeddings=False, **_QWEN3),
    "Qwen/Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                           tie_word_embeddings=False, **_QWEN3),
    "Qwen/Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                           tie_word_embeddings=False, **_QWEN3),
}
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 128 experts of width 768, 8 per token, every block
QWEN3_MOE = {
    "Qwen/Qwen3-30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                               tie_word_embeddings=False, max_position_embeddings=40960, **_QWEN),
}
# https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json; v0.3 grew the vocabulary to 32768
_MISTRAL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=32768, **BF16)
MISTRAL = {
    "mistralai/Mistral-7B-v0.1": dict(vocab_size=32000, **_MISTRAL),
    "mistralai/Mistral-7B-v0.3": dict(vocab_size=32768, **_MISTRAL),
}
# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: 8 experts, 2 per token
MIXTRAL = {
    "mistralai/Mixtral-8x7B-v0.1": dict(vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, **_MISTRAL),
}
# https://huggingface.co/google/gemma-7b/blob/main/config.json (and gemma-2b): head_dim 256, tied, 256k vocabulary
_GEMMA = dict(vocab_size=256000, head_dim=256, max_position_embeddings=8192, tie_word_embeddings=True, **BF16)
GEMMA = {
    "google/gemma-2b": dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                            num_key_value_heads=1, **_GEMMA),
    "google/gemma-7b": dict(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=16, **_GEMMA),
}
# https://huggingface.co/google/gemma-2-9b/blob/main/config.json (and 2b, 27b): its logits are soft-capped at 30
_GEMMA2 = dict(_GEMMA, final_logit_softcapping=30.0)
GEMMA2 = {
    "google/gemma-2-2b": dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                              num_key_value_heads=4, **_GEMMA2),
    "google/gemma-2-9b": dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                              num_attention_heads=16, num_key_value_heads=8, **_GEMMA2),
    "google/gemma-2-27b": dict(hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                               num_attention_heads=32, num_key_value_heads=16, **{**_GEMMA2, "head_dim": 128}),
}
# https://huggingface.co/gpt2-xl/blob/main/config.json (and the others); published in fp32 (no torch_dtype)
GPT2 = {
    "gpt2": {},
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25),
}
# https://huggingface.co/bert-large-uncased/blob/main/config.json, google/vit-large-patch16-224
_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
BERT = {"bert-base-uncased": {}, "bert-large-uncased": _LARGE}
VIT = {"google/vit-base-patch16-224": {}, "google/vit-large-patch16-224": _LARGE}

KNOWN_CONFIGS: dict[str, tuple[str, dict]] = {
    name: (model_type, dims)
    for model_type, table in (("llama", LLAMA), ("qwen2", QWEN2), ("qwen3", QWEN3), ("qwen3_moe", QWEN3_MOE),
                              ("mistral", MISTRAL), ("mixtral", MIXTRAL), ("gemma", GEMMA), ("gemma2", GEMMA2),
                              ("gpt2", GPT2), ("bert", BERT), ("vit", VIT))
    for name, dims in table.items()
}
# Fine-tuned variants publish the base model's dimensions: "-Instruct", "-it", "-Base" (Qwen3's pre-trained ones).
VARIANT_SUFFIXES = ("-Instruct", "-it", "-Base")


def known_config(name: str) -> tuple[str, str, dict] | None:
    """(the built-in id it matched, model_type, config values) for a hub id or its fine-tuned variant; None: unknown.
    Case does not matter; Mistral's "-Instruct-v0.3" is the base "-v0.3"."""
    lower = {k.lower(): k for k in KNOWN_CONFIGS}
    candidates = [name, name.replace("-Instruct-", "-")]
    candidates += [name.removesuffix(s) for s in VARIANT_SUFFIXES if name.endswith(s)]
    for candidate in candidates:
        key = lower.get(candidate.lower())
        if key:
            model_type, dims = KNOWN_CONFIGS[key]
            return key, model_type, dims
    return None


__all__ = ["KNOWN_CONFIGS", "known_config"]
