"""Models for the three families: built-in presets (no download), hub ids and local directories."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .args import DECODERS, task_module
from .boundary import diagnose, explain, loading
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


def preset_config(task: str, preset: str, vocab_size: int = 30522, num_labels: int = 2,
                  **token_ids: int | None) -> PretrainedConfig:
    """tiny: trains in seconds on CPU. base: BERT-base, GPT-2 124M and ViT-B/16 dimensions with random weights.
    The decoders (tiny-llama ...): shared/tasks/decoder_presets.py, copied with the causal-lm and sft tasks.

    token_ids: pad/bos/eos ids of the tokenizer the model is built for.
    """
    from transformers import BertConfig, GPT2Config, ViTConfig

    if preset in DECODERS:
        module = task_module("decoder-presets", why=f"--model_preset {preset}", task="causal-lm")
        return module.preset_config(task, preset, vocab_size, num_labels, **token_ids)
    if task == "text-classification":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    max_position_embeddings=128, vocab_size=vocab_size) if preset == "tiny" else {}
        return BertConfig(num_labels=num_labels, **dims, **token_ids)
    if task in ("causal-lm", "sft"):
        dims = dict(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=vocab_size) if preset == "tiny" else {}
        # GPT-2's default bos/eos (50256) lie outside the tiny vocabulary: transformers warned on every causal-lm run
        # (the config is read before the tokenizer's ids are known)
        ids = {"bos_token_id": None, "eos_token_id": None} if preset == "tiny" else {}
        return GPT2Config(**dims, **{**ids, **token_ids})
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                image_size=32, patch_size=8) if preset == "tiny" else {}
    return ViTConfig(num_labels=num_labels, **dims)


def model_source(args: argparse.Namespace) -> str:
    """What the run trains, as results.json names it."""
    return args.model_name_or_path or f"preset:{args.model_preset}"


def check_model_path(name: str | None, flag: str = "--model_name_or_path") -> None:
    """A path that does not exist fails now, not after a hub lookup that cannot succeed; a folder of another kind (a
    PEFT adapter, a training checkpoint, a saved dataset, a folder without config.json) is named for what it is."""
    if not name:
        return
    if not Path(name).expanduser().exists() and name.startswith(("/", ".", "~")):
        found, fix = diagnose("model", name)
        raise InputError(f"{flag} {name!r} does not exist. {fix + ' ' if fix.startswith('Did') else ''}Pass an "
                         "existing directory, a hub id, or leave it unset to build a model from --model_preset.")
    found, _ = diagnose("model", name) if Path(name).expanduser().exists() else ("", "")
    if found and not found.startswith("config.json but no weights"):  # weights are checked where they load
        raise InputError(explain("model", flag, name))


def load_pretrained_config(args: argparse.Namespace, **overrides: object) -> PretrainedConfig:
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig

    name = args.model_name_or_path
    for path in sorted(Path(name).glob("*.safetensors")):  # else a bare header error in from_pretrained
        try:
            safe_open(str(path), "pt").keys()
        except SafetensorError as err:
            raise InputError(f"{path} is truncated or corrupt ({err}). Copy or download it again.") from None
    with loading("config", "--model_name_or_path", name):
        config = AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code, **overrides)
        saved = type(config).get_config_dict(name)[0]
    check_fits_task(config, args.task, name)
    if quant := getattr(config, "quantization_config", None):  # GPTQ, AWQ, bitsandbytes, fp8, mxfp4 (gpt-oss) ...
        method = (quant if isinstance(quant, dict) else quant.to_dict()).get("quant_method", "unnamed")
        # Packed integer or fp8 weights take no gradient steps; each quantizer's loader fails on its own terms.
        raise InputError(f"{name!r} stores its weights quantized (quantization_config, quant_method {method}): "
                         "they cannot be trained as they are. Pass the checkpoint it was quantized from (bf16 or "
                         "fp32; recipes/qlora.py quantizes that to 4 bits itself, on load), or load this one "
                         "dequantized and save_pretrained a copy without quantization_config.")
    trained, labels = len(saved.get("id2label") or {}), overrides.get("num_labels")
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


def router_loss_missing(config: PretrainedConfig, task: str) -> str:
    """A mixture of experts (its config has output_router_logits) whose Transformers class for `task` returns no
    router aux_loss (the MoE classifiers): that class's name, for the rule table ("": it returns one, or no MoE)."""
    if getattr(config, "output_router_logits", None) is None:
        return ""
    import transformers

    classes = getattr(transformers, _AUTO_CLASS_NAMES[task])._model_mapping
    if type(config) not in classes:  # remote code brings its own classes: trusted to return what its config asks
        return ""
    cls = classes[type(config)]
    output = inspect.signature(cls.forward).return_annotation
    if isinstance(output, str):  # `from __future__ import annotations` in its module
        output = getattr(sys.modules[cls.__module__], output, None) or getattr(transformers.modeling_outputs, output,
                                                                               None)
    return "" if "aux_loss" in getattr(output, "__dataclass_fields__", {}) else cls.__name__


def train_router(config: PretrainedConfig, name: str) -> None:
    """A mixture of experts trains its router's load-balancing loss, whatever the config shipped with: Mixtral's and
    Qwen-MoE's published configs switch it off (it only matters in training)."""
    if getattr(config, "output_router_logits", None) is False:
        logging.getLogger("recipes").info("%s: output_router_logits set to True for training (the router's "
                                          "load-balancing loss, router_aux_loss_coef %s)", name,
                                          getattr(config, "router_aux_loss_coef", None))
        config.output_router_logits = True


def check_positions(config: PretrainedConfig, max_seq_length: int) -> None:
    """Tokens past the position embeddings crash the forward pass mid-run (an index error in the embedding)."""
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and max_seq_length > positions:
        raise InputError(f"--max_seq_length {max_seq_length} exceeds the model's {positions} positions. "
                         f"Pass --max_seq_length {positions} or less.")


def check_router(config: PretrainedConfig, name: str) -> None:
    """A mixture of experts whose config routes each token to more experts than it has (or to none): the first
    forward failed in torch.topk ('selected index k out of range'), after the data was read and the model built."""
    experts = next((v for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(v := getattr(config, k, None), int) and v > 0), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts and isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise InputError(f"{name}: config.json routes each token to num_experts_per_tok {top_k} experts of the "
                         f"model's {experts}: the first forward would fail (torch.topk) or route nothing. Set "
                         f"num_experts_per_tok between 1 and {experts}: the value the checkpoint was trained with "
                         "(Mixtral: 2).")


def weights_dtype(args: argparse.Namespace, config: PretrainedConfig) -> torch.dtype:
    """The dtype the weights train in (--weights_dtype): fp32 (a bf16 checkpoint upcast: fp32 master weights), bf16,
    or auto: the dtype the config says the weights are stored in (transformers' dtype="auto"; none given: fp32)."""
    choice = getattr(args, "weights_dtype", "fp32")
    if choice != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]
    stored = getattr(config, "dtype", None)
    return getattr(torch, stored) if isinstance(stored, str) else stored or torch.float32


def check_weights_dtype(args: argparse.Namespace, config: PretrainedConfig, mixed_precision: str,
                        main: bool = True) -> torch.dtype:
    """The weights' training dtype, before any weight loads: refused under fp16 unless fp32; said aloud for auto."""
    dtype, stored = weights_dtype(args, config), str(getattr(config, "dtype", None)).removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    if dtype.itemsize < 4 and dtype != torch.bfloat16:  # auto over an fp16 (or fp8 ...) checkpoint
        # Pure fp16 weights have no master copy and no loss scaling: small updates round away, gradients underflow.
        raise InputError(f"--weights_dtype auto: {args.model_name_or_path or 'the model'} stores its weights in "
                         f"{name}, and training them in it has no fp32 master copy and no loss scaling (updates "
                         "round away, gradients underflow: the loss turns nan). Pass --weights_dtype fp32 (the "
                         "default: the checkpoint upcast; add --mixed_precision fp16 or bf16 to compute in 16 bits) "
                         "or --weights_dtype bf16.")
    if dtype != torch.float32 and mixed_precision == "fp16":
        why = "--weights_dtype bf16" if args.weights_dtype == "bf16" else f"--weights_dtype auto, stored in {stored}"
        # GradScaler's loss scaling keeps small fp16 gradients from flushing to zero before they reach fp32 master
        # weights; over 16-bit masters the update itself rounds away, and a bf16 weight past fp16's 65504 overflows.
        raise InputError(f"--mixed_precision fp16 over {name} master weights ({why}): fp16 loss scaling protects "
                         "small gradients on their way to fp32 master weights; over 16-bit masters the updates round "
                         "away whatever the scale, and bf16 values beyond fp16's range (65504) overflow when autocast "
                         "casts them. Pass --weights_dtype fp32 (the default: fp32 masters, the checkpoint upcast), "
                         "or --mixed_precision bf16.")
    if main and args.weights_dtype == "auto":
        logging.getLogger("recipes").warning(
            "--weights_dtype auto: the weights load in their stored dtype, %s%s", name, "" if dtype == torch.float32
            else ": pure 16-bit training, no fp32 master copy (gradients and optimizer state in it too), unless the "
            "sharding keeps one of its own (DeepSpeed; FSDP2 under mixed precision). --weights_dtype fp32 keeps fp32 "
            "master weights.")
    return dtype


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
    train_router(config, model_source(args))
    dtype = weights_dtype(args, config)  # read before from_pretrained/from_config rewrite config.dtype
    if args.model_name_or_path:
        with loading("model", "--model_name_or_path", args.model_name_or_path):
            model, info = auto.from_pretrained(
                args.model_name_or_path, config=config, trust_remote_code=args.trust_remote_code,
                ignore_mismatched_sizes=getattr(args, "ignore_mismatched_sizes", False), output_loading_info=True,
                dtype=dtype, **attn)
        check_loaded(args.model_name_or_path, model, info, lm_head=args.task in ("causal-lm", "sft"))
        return model
    return auto.from_config(config, dtype=dtype, **attn)


def check_loaded(name: str, model: nn.Module, info: dict, lm_head: bool = False) -> None:
    """Weights of the model's body that the checkpoint lacks would train from random values while the run reports
    fine-tuning `name` (a config.json whose model_type or sizes were edited, weights of another model): refused.
    Outside the body (a new task head: classifier, score, DistilBERT's pre_classifier) and a pooler, missing weights
    are expected: they are what fine-tuning a classifier starts from random. A causal LM's head (`lm_head`) is not
    new: a checkpoint without it, whose config.json does not tie it to the embedding, would train a random head."""
    body = getattr(model, "base_model_prefix", "") + "."
    head = model.get_output_embeddings() if lm_head else None
    head_name = next((n + "." for n, m in model.named_modules() if m is head and n), None)
    if head_name and (lost := [k for k in info.get("missing_keys", []) if k.startswith(head_name)]):
        raise InputError(f"--model_name_or_path {name!r}: the language-model head {lost[0]!r} is not in its "
                         "checkpoint, and config.json does not tie it to the input embedding (tie_word_embeddings: "
                         f"{getattr(model.config, 'tie_word_embeddings', None)}): the run would "
                         "fine-tune a randomly initialised head. If the model ties its head to the embedding (Qwen2.5,"
                         " Llama 3.2 1B, Gemma), set \"tie_word_embeddings\": true in config.json; else copy the "
                         "checkpoint again with its lm_head weights.")
    missing = [k for k in info.get("missing_keys", []) if k.startswith(body) and ".pooler." not in k]
    # Weights of the body that config.json has no place for (num_hidden_layers lowered, a deeper model's weights):
    # dropped on load, and a smaller model than the checkpoint trained. A ViTModel's pooler is not used: expected.
    extra = [k for k in info.get("unexpected_keys", []) if k.startswith(body) and ".pooler." not in k]
    if extra:
        raise InputError(f"--model_name_or_path {name!r}: {len(extra)} weights of its checkpoint have no place in "
                         f"the model config.json describes (e.g. {sorted(extra)[:3]}) and would be dropped: a smaller "
                         "model than the checkpoint would train (num_hidden_layers or another size edited, or "
                         "another model's weights). Use the config.json saved with these weights.")
    if missing:
        total = sum(1 for _ in model.state_dict())
        raise InputError(f"--model_name_or_path {name!r}: {len(missing)} of the model's {total} weights are not in "
                         f"its checkpoint (e.g. {missing[:3]}) and would start from random values: config.json does "
                         "not describe these weights (an edited model_type or size, or another model's weights). "
                         "Save the model again with save_pretrained, or fix config.json.")


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks (BERT/ViT encoder.layer, GPT-2 transformer.h, Llama model.layers ...)."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"Found no ModuleList of {n} transformer blocks in {type(model).__name__}.")
