"""Models for the three families: built-in presets (no download), hub ids and local directories."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from .errors import InputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers is imported where it is used: a recipe's --help and its start-up refusals need not wait for it.
_AUTO_CLASS_NAMES = {
    "text-classification": "AutoModelForSequenceClassification",
    "causal-lm": "AutoModelForCausalLM",
    "image-classification": "AutoModelForImageClassification",
    "sft": "AutoModelForCausalLM",
}


# Task heads: new, randomly initialised layers that train in full precision, never quantized or pruned.
HEAD_NAMES = ("classifier", "score", "lm_head")


def __getattr__(name: str) -> object:
    if name == "AUTO_CLASSES":  # {task: the transformers Auto class that builds its model}
        import transformers

        return {task: getattr(transformers, cls) for task, cls in _AUTO_CLASS_NAMES.items()}
    raise AttributeError(name)


# Decoder presets (--model_preset; shared/core/args.py PRESETS): today's decoders (RMSNorm, rotary positions,
# grouped-query attention, SwiGLU, an untied head), as Llama and Mixtral (a mixture of experts) build them. They
# serve text: a causal LM, or a classifier on the last token.
DECODER_PRESETS = {"tiny-llama": "llama", "tiny-moe": "mixtral"}
# 4 query heads share 2 key/value heads (GQA): 2 tensor-parallel processes each take 1 KV head and its 2 queries.
_TINY_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
# 4 experts, each token routed to 2; the router's load-balancing loss counts in training (output_router_logits).
# Jitter off: it draws random numbers in the forward, so runs that differ only in batching would not match.
_TINY_MOE = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                 router_jitter_noise=0.0)


def preset_config(task: str, preset: str, vocab_size: int = 30522, num_labels: int = 2,
                  **token_ids: int | None) -> PretrainedConfig:
    """tiny: trains in seconds on CPU. base: BERT-base, GPT-2 124M and ViT-B/16 dimensions with random weights.
    tiny-llama, tiny-moe: a Llama-style decoder and a Mixtral-style mixture of experts, as small as tiny, for text.

    token_ids: pad/bos/eos ids of the tokenizer the model is built for.
    """
    from transformers import BertConfig, GPT2Config, LlamaConfig, MixtralConfig, ViTConfig

    if preset in DECODER_PRESETS:
        if task == "image-classification":  # refused earlier by the rule table; a direct caller gets it here
            raise ValueError(f"--model_preset {preset} is a text model; --task image-classification needs a ViT")
        if preset == "tiny-moe":
            return MixtralConfig(vocab_size=vocab_size, num_labels=num_labels, **_TINY_DECODER, **_TINY_MOE,
                                 **token_ids)
        return LlamaConfig(vocab_size=vocab_size, num_labels=num_labels, **_TINY_DECODER, **token_ids)
    if task == "text-classification":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    max_position_embeddings=128, vocab_size=vocab_size) if preset == "tiny" else {}
        return BertConfig(num_labels=num_labels, **dims, **token_ids)
    if task in ("causal-lm", "sft"):
        dims = dict(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=vocab_size) if preset == "tiny" else {}
        return GPT2Config(**dims, **token_ids)
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                image_size=32, patch_size=8) if preset == "tiny" else {}
    return ViTConfig(num_labels=num_labels, **dims)


def model_source(args: argparse.Namespace) -> str:
    """What the run trains, as results.json names it."""
    return args.model_name_or_path or f"preset:{args.model_preset}"


def check_model_path(name: str | None) -> None:
    """A path that does not exist fails now, not after a hub lookup that cannot succeed."""
    if name and not Path(name).expanduser().exists() and name.startswith(("/", ".", "~")):
        raise InputError(f"--model_name_or_path {name!r} does not exist. Pass an existing directory, a hub id, "
                         "or leave it unset to build a model from --model_preset.")


def unreachable(name: str, err: Exception) -> SystemExit:
    """The error for a hub id or directory that from_pretrained could not read."""
    return SystemExit(f"Could not load {name!r}: it is not a local directory and the hub did not serve it "
                      f"({err.__class__.__name__}: {str(err).splitlines()[0]}). Check the id or the network, pass a "
                      "local directory, or leave --model_name_or_path unset to use --model_preset.")


def load_pretrained_config(args: argparse.Namespace, **overrides: object) -> PretrainedConfig:
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig

    name = args.model_name_or_path
    for path in sorted(Path(name).glob("*.safetensors")):  # else a bare header error in from_pretrained
        try:
            safe_open(str(path), "pt").keys()
        except SafetensorError as err:
            raise InputError(f"{path} is truncated or corrupt ({err}). Copy or download it again.") from None
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code, **overrides)
    except OSError as err:
        raise unreachable(name, err) from None
    check_fits_task(config, args.task, name)
    trained, labels = len(type(config).get_config_dict(name)[0].get("id2label") or {}), overrides.get("num_labels")
    if "Classification" in str(config.architectures) and trained not in (0, labels or trained) and not getattr(
            args, "ignore_mismatched_sizes", False):  # its head's saved weights would not load
        raise InputError(f"{name!r} is a classifier of {trained} labels, and the data has {labels}. Pass --ignore_"
                         f"mismatched_sizes to train a new head of {labels} labels on the rest, or data of {trained}.")
    return config


def model_config(args: argparse.Namespace) -> PretrainedConfig:
    """The config of the model the run trains, read before any weight loads: --model_name_or_path's, or the preset's."""
    return load_pretrained_config(args) if args.model_name_or_path else preset_config(args.task, args.model_preset)


def check_fits_task(config: PretrainedConfig, task: str, name: str) -> None:
    """A model whose architecture has no head for the task, or would train it wrongly, is refused before loading."""
    from transformers.models.auto import modeling_auto

    mappings = {"text-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "image-classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}
    mappings["sft"] = mappings["causal-lm"]
    kind = config.model_type
    if getattr(config, "auto_map", None):  # remote code brings its own classes: Transformers' tables don't know
        return
    if kind not in mappings[task]:
        serves = [t for t, m in mappings.items() if kind in m]
        raise InputError(f"{name!r} is a {kind} model, which has no {task} head in Transformers. "
                         + (f"Pass --task {' or --task '.join(serves)}, or " if serves else "Pass ")
                         + f"a model built for {task}.")
    bidirectional = (task in ("causal-lm", "sft") and kind in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
                     and not getattr(config, "is_decoder", False) and not getattr(config, "is_encoder_decoder", False))
    if bidirectional:
        # Its attention sees every position: as a causal LM each token would see the one it predicts, and the loss
        # would fall to 0 having learned nothing.
        raise InputError(f"{name!r} is a bidirectional {kind} encoder: as a causal LM each token would attend to "
                         "the token it predicts. Use a decoder model (GPT-2, Llama ...), or set \"is_decoder\": true "
                         "in its config.json.")


def check_positions(config: PretrainedConfig, max_seq_length: int) -> None:
    """Tokens past the position embeddings crash the forward pass mid-run (an index error in the embedding)."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and max_seq_length > positions:
        raise InputError(f"--max_seq_length {max_seq_length} exceeds the model's {positions} positions. "
                         f"Pass --max_seq_length {positions} or less.")


def build_model(args: argparse.Namespace, config: PretrainedConfig) -> nn.Module:
    """From the hub or a directory when --model_name_or_path is set, else from `config` with random weights."""
    import transformers

    auto = getattr(transformers, _AUTO_CLASS_NAMES[args.task])
    if args.disable_dropout:
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    # Unset: Transformers picks (sdpa where the model has it). flash_attention_2 needs a GPU and flash-attn.
    attn = {"attn_implementation": args.attn_implementation} if getattr(args, "attn_implementation", None) else {}
    if args.model_name_or_path:
        return auto.from_pretrained(args.model_name_or_path, config=config, trust_remote_code=args.trust_remote_code,
                                    ignore_mismatched_sizes=getattr(args, "ignore_mismatched_sizes", False), **attn)
    return auto.from_config(config, **attn)


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks (BERT/ViT encoder.layer, GPT-2 transformer.h, Llama model.layers ...)."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"Found no ModuleList of {n} transformer blocks in {type(model).__name__}.")
