"""Memory planner: which recipe, launch config and combination of techniques fits a model on given hardware, predicted
from the model's config.

    python -m shared.tools.plan --model_name_or_path gpt2-xl --num_gpus 8 --gpu_memory 24GB --seq_len 1024 \\
        --per_device_batch_size 8
    python -m shared.tools.plan --model_name_or_path meta-llama/Llama-3.1-8B --num_gpus 8 --gpu_memory 80GB \\
        --seq_len 4096 --per_device_batch_size 2

The model is built on the meta device (no weights are allocated or downloaded); a hub id that cannot be read offline
is looked up in the built-in copies of published configs (shared/tools/model_configs.py). The search covers every
recipe's own rows (TECHNIQUES), the combinations recipes/combined.py runs (sharding x offload x checkpointing x
precision x optimizer x LoRA / QLoRA x chunked loss), and the tensor-parallel, expert-parallel and HSDP layouts where
the model has them. For each the planner predicts bytes per device (weights, gradients, optimizer state, activations,
working buffers) and on the host (offloaded states, runtime), checks it against shared/core/rules.py (the recipe's
own start-up check), ranks what fits by expected speed and prints the `accelerate launch` command that runs it, with
placeholders (NVME_DIR, ...) to fill. A row that cannot run gets one short reason; `--explain ROW` prints the rule
in full, its fix and the row's figures. When nothing fits it names the nearest changes that would (a smaller batch,
checkpointing, offload, more GPUs). The formulas, and what was checked against measurement, are in docs/planner.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core import quiet, rules
from .catalogue import NOT_PLANNED, recipes_support
from .model_configs import KNOWN_CONFIGS, known_config

GB = 10**9
GiB = 2**30
MiB = 2**20
# Resident memory of one recipe process on CPU besides model state and activations: Python, torch, transformers,
# accelerate, datasets, the lazily imported modules, the data and the allocator's slack. Measured on the CI machine
# (docs/planner.md); pass --runtime_memory for another machine. A process forked from one that has already imported
# the stack (benchmarks/matrix.py) maps the libraries' pages only as it touches them: 85 MiB less.
CPU_RUNTIME_BYTES = 535 * MiB
FORKED_RUNTIME_BYTES = 450 * MiB
# torchao's low-bit AdamW steps through torch.compile: inductor and its compiled kernels add to a CPU process's RSS
# (measured in the quick matrix, 2026-12-01: +88 to +94 MiB over the baseline of each task)
TORCHAO_STEP_RUNTIME_BYTES = 90 * MiB

# ---------------------------------------------------------------- the model, from its config only


@dataclass
class ModelSpec:
    """Everything the formulas need about a model: parameter tensors and transformer dimensions."""

    name: str
    task: str
    family: str  # bert | gpt2 | vit | decoder (Llama-style) | generic: which activation accounting applies
    tensor_numels: list[int]  # every parameter tensor once (tied weights once)
    linear_weights: list[tuple[int, int, int]]  # (in, out, numel) of Linear / Conv1D weights bnb would quantize
    head_weight_numel: int  # the output head's weight (lm_head / classifier): kept in 16 bits when quantizing
    lora_targets: list[tuple[int, int]]  # (in, out) of the modules LoRA adapts: PEFT's "all-linear", as the recipes
    head_numel: int  # parameters of the head PEFT trains beside the adapters (modules_to_save)
    layer_params: int  # one transformer block
    block_linear_numel: int  # Linear / Conv1D weights inside the transformer blocks (and MoE routers)
    all_linear_numel: int  # every weight autocast casts to 16 bits: Linear, Conv1D, Conv2d, the head included
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    seq_tokens: int | None  # fixed positions (ViT patches + [CLS]); None: --seq_len decides
    image_size: int = 0
    num_labels: int = 2
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    activation: str = "gelu"
    model_type: str = ""
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: one per query head
    head_dim: int = 0  # 0: hidden / heads
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys (Qwen3)
    norms_per_layer: int = 2  # RMSNorms on the residual stream per block (Gemma-2: 4)
    experts: int = 0  # mixture of experts: experts per block (0: a dense MLP)
    experts_per_token: int = 0
    expert_intermediate: int = 0  # one expert's MLP width
    expert_numel: int = 0  # parameters of the experts, all blocks
    layer_expert_numel: int = 0  # parameters of one block's experts
    weight_bytes: int = 4  # bytes per weight as the recipes train them (--weights_dtype; auto: the checkpoint's)
    checkpoint_bytes: int = 4  # bytes per weight in the checkpoint (its config's dtype); presets fp32
    weights_dtype: str = "auto"  # the --weights_dtype that gave weight_bytes (auto: as loaded)
    tp_split_numel: int = -1  # parameters the model's own tensor-parallel plan splits; -1: it ships none (PLANS)
    logit_transform: str = ""  # a config entry that changes the logits after the head, e.g. final_logit_softcapping=30
    max_positions: int = 0  # position embeddings (0: not limited)
    # LoRA on parameters, not modules: PEFT's "all-linear" adapts a mixture of experts' routers and 3-D expert weights
    # (target_parameters); per entry the sizes of its A and B per unit of rank r
    lora_param_targets: list[tuple[int, int]] = field(default_factory=list)
    eager_attention: bool = False  # the scores are materialised: Gemma-2's soft-capped attention has no sdpa kernel
    # Facts the recipes' built checks read (shared/core/rules.py Run): the planner hands them to the same rules.
    tp_plans: tuple[str, ...] = ()  # model types shared/techniques/tensor_parallel.py can split, this one if it ships
    ep_dispatch: bool | None = None  # its base_model_ep_plan sends tokens to the experts' processes
    outside_linear: str = ""  # the blocks' weights no nn.Linear holds (a mixture of experts' experts), in words

    @property
    def num_params(self) -> int:
        return sum(self.tensor_numels)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_numels)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: a mixture of experts runs experts_per_token of its experts."""
        if not self.experts:
            return self.num_params
        return round(self.num_params - self.expert_numel * (1 - self.experts_per_token / self.experts))

    @property
    def q_width(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)


TASK_OF_MODEL_TYPE = {"gpt2": "causal-lm", "bert": "text-classification", "vit": "image-classification"}
# The decoders the hub's fine-tuned models are: a causal LM unless --task says otherwise.
DECODER_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3")
SIXTEEN_BIT = ("bfloat16", "float16")


def builtin_vocab_size(task: str, preset: str) -> int:
    """The vocabulary the recipes give a preset on the built-in data (shared/core/tasks.py): the local word tokenizer's
    for the tiny presets, raised to BERT's 30522 for the base preset."""
    if task == "image-classification":
        return 30522
    from ..core import data

    n = len(data.build_word_tokenizer(data.builtin_split(task, "train")["text"], task))
    return n if preset.startswith("tiny") else max(n, 30522)


def load_config(name: str | None, preset: str, task: str | None, vocab_size: int | None, num_labels: int | None,
                trust_remote_code: bool = False):
    """(config, task, source) from a preset, a local directory or a hub id; the offline fallback is the built-in copy
    of a published config (shared/tools/model_configs.py)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from ..core.models import preset_config

    if name is None:
        task = task or ("causal-lm" if preset in ("tiny-llama", "tiny-moe") else "text-classification")
        if preset in ("tiny-llama", "tiny-moe") and task == "image-classification":
            raise SystemExit(f"--model_preset {preset} is a decoder for text: pass --task causal-lm or "
                             "text-classification, or --model_preset tiny for images.")
        labels = num_labels or (4 if task == "image-classification" else 2)  # the built-in data's classes
        vocab = vocab_size or builtin_vocab_size(task, preset)
        return preset_config(task, preset, vocab_size=vocab, num_labels=labels), task, f"preset:{preset}"
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():
        raise SystemExit(f"--model_name_or_path {name!r} does not exist. Pass an existing directory, a hub id, "
                         "or leave it unset to use --model_preset.")
    config = source = None
    if Path(name).expanduser().is_dir():
        config, source = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), name
    else:  # the local cache first; then the built-in copy of a well-known config; then the hub
        try:
            config, source = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code,
                                                        local_files_only=True), name
        except (OSError, ValueError):
            known = known_config(name)
            if known:
                key, model_type, dims = known
                config = CONFIG_MAPPING[model_type](**dims)
                source = f"{name} (built-in copy of {key}'s published config.json)"
    if config is None:
        try:
            config, source = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), name
        except (OSError, ValueError) as err:
            raise SystemExit(f"Could not read the config of {name!r} ({err.__class__.__name__}: "
                             f"{str(err).splitlines()[0][:200]}). Pass a local directory holding config.json, "
                             f"a reachable hub id, one of the {len(KNOWN_CONFIGS)} built-in ids (--list_models), "
                             "or --model_preset.") from None
    task = task or TASK_OF_MODEL_TYPE.get(config.model_type) or (
        "causal-lm" if config.model_type in DECODER_TYPES else None)
    if task is None:
        raise SystemExit(f"Cannot tell the task of model type {config.model_type!r}: pass --task.")
    if vocab_size:
        config.vocab_size = vocab_size
    if num_labels:
        config.num_labels = num_labels
    return config, task, source


def _dtype_bytes(config) -> int:
    """Bytes per weight as from_pretrained loads the checkpoint (transformers 5: dtype="auto", the config's dtype);
    a preset built from its config is fp32."""
    dtype = getattr(config, "dtype", None)
    return 2 if str(dtype).removeprefix("torch.") in SIXTEEN_BIT else 4


def _own_tp_split(model, config) -> int:
    """Parameters the model's own tensor-parallel plan splits (transformers' base_model_tp_plan: column-wise weights
    and biases, row-wise weights), plus the embedding and the head, split over the vocabulary; -1: no own plan."""
    own = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not own:
        return -1
    patterns = [(re.compile(r"(?:.+\.)?" + re.escape(k).replace(r"\*", r"\d+") + r"(?:\.weight|\.bias)?"), style)
                for k, style in own.items()]
    split = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or name.split(".")[0] == "lm_head":
            split += p.numel()
            continue
        style = next((s for rx, s in patterns if rx.fullmatch(name)), "")
        if "colwise" in style or ("rowwise" in style and not name.endswith(".bias")):
            split += p.numel()
    return split


def model_spec(config, task: str, name: str, disable_dropout: bool = False) -> ModelSpec:
    """Build the model on the meta device (nothing allocated) and read what the formulas need from it."""
    import torch
    from torch import nn
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import set_zero3_state
    from transformers.pytorch_utils import Conv1D

    from ..core.models import AUTO_CLASSES, HEAD_NAMES, transformer_layers  # the heads bnb leaves unquantized
    from ..techniques.expert_parallel import dispatches_tokens
    from ..techniques.quant import weights_outside_linear
    from ..techniques.tensor_parallel import PLANS

    # Outside ZeRO-3's zero.Init, which transformers enters for every model built while a ZeRO-3 run is set up (the
    # preflight of one): under it these meta tensors would be partitioned to 1-D shards of the real shapes, and
    # its weight initialization copies out of them. Initializing meta tensors is half the build: skipped.
    with torch.device("meta"), set_zero3_state(), no_init_weights():
        model = AUTO_CLASSES[task].from_config(config)
        model.tie_weights()  # part of the initialization skipped: a tied head is the embedding, counted once
    params = list(model.named_parameters())  # tied weights appear once
    linear, lora, head_weight, head, conv = [], [], 0, 0, 0
    block = transformer_layers(model)[0]
    block_ids = {id(m) for layer in transformer_layers(model) for m in layer.modules()}
    block_names = [n for n, _ in block.named_modules()]
    decoder = any(n.endswith(("mlp.gate_proj", "mlp.experts")) for n in block_names)
    family = config.model_type if config.model_type in ("bert", "gpt2", "vit") else (
        "decoder" if decoder else "generic")
    block_linear = 0
    for mname, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            conv += module.weight.numel()
            continue
        if isinstance(module, nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif isinstance(module, Conv1D):
            fan_in, fan_out = module.weight.shape
        elif type(module).__name__.endswith("Router") and id(module) in block_ids:  # MoE routers: F.linear on a weight
            block_linear += module.weight.numel()
            continue
        else:
            continue
        if id(module) in block_ids:
            block_linear += module.weight.numel()
        is_head = mname.split(".")[0] in HEAD_NAMES
        if is_head:
            head_weight = module.weight.numel()
            if task != "causal-lm":
                head += sum(p.numel() for p in module.parameters())
        else:
            linear.append((fan_in, fan_out, module.weight.numel()))
            lora.append((fan_in, fan_out))  # the recipes' target_modules="all-linear": every Linear but the head
    layer_params = sum(p.numel() for p in block.parameters())
    cfg = config
    hidden_dropout = getattr(cfg, "hidden_dropout_prob", getattr(cfg, "resid_pdrop", 0.0)) or 0.0
    attention_dropout = getattr(cfg, "attention_probs_dropout_prob", getattr(cfg, "attn_pdrop", 0.0)) or 0.0
    embedding_dropout = getattr(cfg, "embd_pdrop", hidden_dropout) or 0.0
    if family == "decoder":  # Llama-style decoders: no dropout in the blocks (attention_dropout is 0 when published)
        hidden_dropout = embedding_dropout = 0.0
        attention_dropout = getattr(cfg, "attention_dropout", 0.0) or 0.0
    if disable_dropout:
        hidden_dropout = attention_dropout = embedding_dropout = 0.0
    seq_tokens = None
    if family == "vit":
        seq_tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    expert_names = [n for n, _ in params if ".experts." in n]
    expert_numel = sum(p.numel() for n, p in params if ".experts." in n)
    head_dim = getattr(cfg, "head_dim", None) or 0
    norms = [m for m in block.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight")]
    softcap = getattr(cfg, "final_logit_softcapping", None)
    # PEFT 0.21's all-linear on a mixture of experts (measured on tiny-moe: exact): the router, r h and r experts; each
    # 3-D expert weight (E, out, in), r E in and r E out, gate_up_proj at rank 2r (it fuses two matrices)
    param_targets = []
    if expert_names:
        for module in model.modules():
            if type(module).__name__.endswith("Router") and id(module) in block_ids:
                param_targets.append((module.weight.shape[1], module.weight.shape[0]))
        for pname, p in params:
            if ".experts." in pname and p.dim() == 3:
                rank = 2 if "gate_up" in pname else 1
                param_targets.append((rank * p.shape[0] * p.shape[2], rank * p.shape[0] * p.shape[1]))
    return ModelSpec(
        name=name, task=task, family=family,
        tensor_numels=[p.numel() for _, p in params],
        linear_weights=linear, head_weight_numel=head_weight, lora_targets=lora, head_numel=head,
        layer_params=layer_params, block_linear_numel=block_linear,
        all_linear_numel=sum(n for _, _, n in linear) + head_weight + conv,
        hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
        intermediate=getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size,
        vocab=getattr(cfg, "vocab_size", 0) or 0, seq_tokens=seq_tokens,
        image_size=getattr(cfg, "image_size", 0) or 0, num_labels=getattr(cfg, "num_labels", 2),
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout, embedding_dropout=embedding_dropout,
        activation=getattr(cfg, "activation_function", None) or getattr(cfg, "hidden_act", "gelu"),
        model_type=cfg.model_type, kv_heads=getattr(cfg, "num_key_value_heads", None) or 0, head_dim=head_dim,
        qk_norm=any(m.weight.numel() != cfg.hidden_size for m in norms),
        norms_per_layer=sum(1 for m in norms if m.weight.numel() == cfg.hidden_size) or 2,
        experts=experts if expert_names else 0, experts_per_token=getattr(cfg, "num_experts_per_tok", 0) or 0,
        expert_intermediate=getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", 0) or 0,
        expert_numel=expert_numel,
        layer_expert_numel=sum(p.numel() for n, p in block.named_parameters() if n.startswith("mlp.experts.")),
        # GPT-2, BERT and ViT split by shared/techniques/tensor_parallel.py's PLANS, whatever their config ships
        weight_bytes=_dtype_bytes(cfg), checkpoint_bytes=_dtype_bytes(cfg),
        tp_split_numel=-1 if family in ("bert", "gpt2", "vit") else _own_tp_split(model, cfg),
        logit_transform=f"final_logit_softcapping={softcap:g}" if softcap else "",
        max_positions=getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None) or 0,
        lora_param_targets=param_targets,
        eager_attention=bool(getattr(cfg, "attn_logit_softcapping", None)),
        tp_plans=tuple(PLANS) + ((cfg.model_type,) if getattr(cfg, "base_model_tp_plan", None) else ()),
        ep_dispatch=dispatches_tokens(getattr(cfg, "base_model_ep_plan", None)) if experts else None,
        outside_linear=weights_outside_linear(model),
    )


# ---------------------------------------------------------------- published model-state formulas


def zero_model_state_bytes(num_params: float, num_devices: int, stage: int, k: float = 12.0) -> float:
    """Per-device model-state bytes of mixed-precision Adam in the ZeRO paper (Rajbhandari et al. 2020, Fig. 1):
    2 bytes of 16-bit weights + 2 of 16-bit gradients + K=12 of fp32 master weights, momentum and variance.
    Stage 1 shards the optimizer state, 2 also the gradients, 3 also the weights, over N devices."""
    psi, n = num_params, num_devices
    return {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (2 + 2 + k) * psi / n}[stage]


def nf4_bytes(numel: int, blocksize: int = 64, double_quant: bool = True, nested_blocksize: int = 256) -> float:
    """Bytes of one weight in bitsandbytes NF4: 4 bits per value plus one absmax per block of 64 values, fp32, or
    with double quantization (QLoRA) an 8-bit absmax plus an fp32 absmax per 256 blocks and one fp32 offset."""
    blocks = math.ceil(numel / blocksize)
    if not double_quant:
        return numel / 2 + 4 * blocks
    return numel / 2 + blocks + 4 * math.ceil(blocks / nested_blocksize) + 4


def int8_bytes(numel: int, out_features: int) -> float:
    """LLM.int8 weight: one int8 per value plus one fp32 scale per output row."""
    return numel + 4 * out_features


def adam_state_bytes(numels: list[int], eight_bit: bool = False, step_tensor: bool = True,
                     dtype_bytes: int = 4) -> float:
    """AdamW's state over the trainable tensors. torch: exp_avg and exp_avg_sq in the parameter's dtype (fp32: 8
    B/param; a bf16 checkpoint trained as loaded: 4) plus a 4-byte `step` tensor per parameter tensor. bitsandbytes
    8-bit: uint8 moments (2 B/param) and two fp32 absmax per block of 256; tensors under 4096 elements keep 32-bit
    state (min_8bit_size)."""
    total = 0.0
    for n in numels:
        if eight_bit and n >= 4096:
            total += 2 * n + 2 * 4 * math.ceil(n / 256) + 4
        else:
            total += 2 * (4 if eight_bit else dtype_bytes) * n + (4 if step_tensor else 0)
    return total


# --optim of recipes/optim_low_bit.py: (bits per element of each moment, block size, code-book entries), from torchao
# 0.18's optim/subclass_4bit.py, subclass_8bit.py, subclass_fp8.py. A tensor is quantized when it has at least 4096
# elements and a multiple of the block (adam.py's _new_buffer); the others keep fp32 moments.
TORCHAO_STATES = {"adamw_torchao_4bit": (4, 128, 16), "adamw_torchao_8bit": (8, 256, 256),
                  "adamw_torchao_fp8": (8, 256, 0)}


def torchao_adam_state_bytes(numels: list[int], optim: str) -> float:
    """torchao's low-bit AdamW state: per quantized moment the codes, an fp32 scale per block and its own code book;
    a 4-byte `step` per tensor. Measured on live tensors: within 4 bytes on a 0.8M-parameter GPT-2."""
    bits, block, book = TORCHAO_STATES[optim]
    total = 0.0
    for n in numels:
        if n >= 4096 and n % block == 0:
            total += 2 * (n * bits // 8 + 4 * (n // block) + 4 * book) + 4
        else:
            total += 8 * n + 4
    return total


# ---------------------------------------------------------------- activations


@dataclass
class Activations:
    saved: float  # bytes autograd keeps from forward to backward (what probes.saved_activation_bytes counts)
    layer: float  # added back at peak in backward: the block being recomputed under checkpointing
    transient: float  # extra bytes alive at the loss (logits copies) on top of `saved`
    weight_copies: float  # 16-bit copies of the weights autocast keeps for backward (inside `saved`)


def loss_saved_bytes(spec: ModelSpec, batch: int, seq: int, loss_chunk: int = 0) -> float:
    """A causal LM's loss, from the final hidden states on (results.json's `loss_saved_bytes[_plain]`, fp32): what
    autograd keeps of the head and the cross-entropy. Plain: the head's input (E h) and the fp32 log-softmax of every
    shifted position, b (s-1) V. Chunked: each chunk's checkpoint keeps only its inputs, views of the hidden states
    and of the padded targets (E int64); its logits are rebuilt in backward."""
    e = batch * seq
    if loss_chunk:
        return e * spec.hidden * 4 + e * 8
    return e * spec.hidden * 4 + batch * (seq - 1) * (spec.vocab * 4 + 8)


def activation_bytes(spec: ModelSpec, batch: int, seq: int | None, precision: str = "fp32",
                     checkpointing: bool = False, kernels: str = "cuda", checkpoint_every: int = 1,
                     selective: bool = False, loss_chunk: int = 0, tp: int = 1, weights16: bool = False
                     ) -> Activations:
    """Bytes saved for backward in one forward, counted tensor by tensor from the HF implementations.

    E = batch*seq tokens, h hidden, I intermediate, a heads. Per block (element counts, dtype per kind below):
      residual stream: the inputs of the 2 LayerNorms, 2 E h (+ mean and rstd, 4 E fp32)
      Linear inputs: QKV (one input for the 3 projections) and MLP-in, 2 E h; MLP-out, E I
      activation function: GELU (BERT, ViT) saves its input, E I; GPT-2's tanh "gelu_new" is 4 elementwise
        ops that save 4 E I
      attention: the "math" kernel saves q, k, v, the out-projection input (4 E h) and with attention dropout the
        softmax, the mask and the dropped probabilities (3 b a s^2). Flash-style kernels (CUDA always; CPU when
        attention dropout is 0) save q, k, v, out (4 E h, in the Linear outputs' dtype) and the log-sum-exp
        (b a s fp32), no s^2 term.
      dropout after the attention output and after the MLP: 2 masks of E h (CPU: in the tensor's dtype;
        CUDA: 1 byte per element)
    Plus embeddings (token ids, embedding LayerNorm input, dropout mask), the final LayerNorm input, the head
    input, and for a causal LM the fp32 log-softmax of the logits, batch*(seq-1)*vocab*4 bytes; with the chunked
    loss (`loss_chunk` tokens per chunk) the padded targets instead, and one chunk's logits alive at a time.
    bf16/fp16 autocast: the residual stream and LayerNorm stay fp32, Linear inputs and outputs are 16-bit (2 B),
    CPU's autocast runs attention in fp32, and a 16-bit copy of every Linear weight is kept for backward.
    `weights16`: the weights already are 16-bit when the matmuls run (a bf16 checkpoint, DeepSpeed's bf16, FSDP's
    mixed precision): no autocast copies of them. Llama-style decoders (family "decoder"): decoder_layer_bytes.
    Checkpointing (HF, non-reentrant): a block keeps only its input (E h residual); in backward one block at a
    time is recomputed, so `layer` is added back at peak. `checkpoint_every` K: only blocks K, 2K, ... are
    checkpointed (L // K of them), the others keep all of the above. `selective` (op-level, recipes/
    activation_checkpointing.py's keep_matmuls): a checkpointed block keeps its input and its matmul and attention
    outputs: QKV 3 E h, out-projection E h, MLP-in E I, MLP-out E h (Linear outputs' dtype), and the attention
    output, E h + the log-sum-exp b a s fp32 (flash) or the scores b a s^2 + E h (math kernel).
    `tp`: tensor parallel over tp processes: the heads and the MLP's inner width are 1/tp (Megatron's split), the
    residual stream, the norms and the inputs of the column-wise layers whole.
    """
    s = spec.seq_tokens or seq
    if s is None:
        raise ValueError("seq_len is needed for this model")
    b, h, i_, a, n_layers = batch, spec.hidden, spec.intermediate, spec.heads, spec.layers
    e = b * s
    half = precision in ("bf16", "fp16") or (weights16 and spec.family == "decoder")
    res_b = 4  # residual stream / LayerNorm inputs: fp32 under autocast
    lin_b = 2 if half else 4

    if spec.family == "decoder":
        mode = "bf16" if weights16 else ("autocast" if half else "fp32")
        per_layer, kept_selective = decoder_layer_bytes(spec, b, s, mode, kernels, tp)
        res_b = 2 if mode == "bf16" else 4
        block16 = 2 * (spec.block_linear_numel + (spec.expert_numel if kernels == "cuda" else 0)) / tp \
            if mode == "autocast" else 0.0
        outer16 = 2 * (spec.all_linear_numel - spec.block_linear_numel) if mode == "autocast" else 0.0
        head_dim = spec.head_dim or h // a
        outer = e * 8  # token ids
        if not checkpointing or checkpoint_every > 1:  # rotary cos and sin, shared by every block not checkpointed
            outer += 2 * s * head_dim * res_b
        outer += e * h * (4 + res_b) + 4 * e  # the final RMSNorm
        outer += e * h * lin_b  # the head's input (its own 16-bit copy under autocast)
        if spec.logit_transform:  # Gemma-2's soft cap: tanh keeps its output, the logits' size
            outer += e * spec.vocab * lin_b
        if spec.task == "causal-lm":
            outer += b * (s - 1) * 8  # the shifted targets the loss keeps
    else:
        attn_b = 4 if (not half or kernels == "cpu") else 2

        def mask_b(dtype_bytes: int) -> int:
            return 1 if kernels == "cuda" else dtype_bytes

        math_attention = kernels == "cpu" and spec.attention_dropout > 0
        per_layer = 2 * e * h * res_b + 4 * e * 4  # LayerNorm inputs + stats
        per_layer += 2 * e * h * lin_b  # QKV-in, MLP-in: the column-wise layers' inputs, whole under TP
        inner = e * i_ * lin_b  # MLP-out input
        inner += (4 if spec.activation == "gelu_new" else 1) * e * i_ * lin_b
        if math_attention:
            inner += 3 * e * h * attn_b + e * h * lin_b + 3 * b * a * s * s * attn_b
        else:
            # the flash kernels take 16-bit inputs as they are: q, k, v, out in the Linear outputs' dtype
            inner += 4 * e * h * lin_b + b * a * s * 4
        per_layer += inner / tp
        if spec.hidden_dropout > 0:
            per_layer += 2 * e * h * mask_b(lin_b)
        if half and spec.family != "gpt2":
            per_layer += 2 * e * h * lin_b  # measured: separate q/k/v projections keep 2 more 16-bit E h under autocast
        kept_selective = 5 * e * h * lin_b + e * i_ * lin_b
        kept_selective += (b * a * s * s + e * h) * attn_b if math_attention else e * h * lin_b + b * a * s * 4

        # autocast's 16-bit weight copies: of the blocks' Linear layers, and of the layers outside them (head, pooler,
        # patch convolution) which checkpointing does not recompute
        copies = half and not weights16
        block16 = 2 * spec.block_linear_numel / tp if copies else 0.0
        outer16 = 2 * (spec.all_linear_numel - spec.block_linear_numel) if copies else 0.0

        if spec.family == "vit":
            outer = b * 3 * spec.image_size**2 * (2 if half else 4)  # pixels into the patch convolution
        else:
            outer = e * 8 * (2 if spec.family == "bert" else 1)  # token ids (+ BERT's token type ids)
            outer += e * 8  # the attention mask the recipes pass (int64)
            if spec.family == "bert" and math_attention:
                outer += b * s * s * 4  # expanded for the math kernel to a float (b, 1, s, s) mask, kept once
            if spec.embedding_dropout > 0:
                outer += e * h * mask_b(4)
        if spec.family == "bert":  # embedding LayerNorm input; the pooler keeps the last block's output (fp32)
            outer += e * h * 4 + 2 * e * 4 + (0 if half else e * h * 4)
        else:  # final LayerNorm input, and the head's input: the whole sequence for GPT-2, the [CLS] slice for ViT
            outer += e * h * 4 + 2 * e * 4 + (e * h * lin_b if spec.family != "vit" else (0 if half else e * h * 4))
    transient = 0.0
    if spec.task == "causal-lm" and loss_chunk:
        outer += e * 8  # the shifted, padded targets (int64) the chunks keep; no log-softmax
        # alive while one chunk is rebuilt and differentiated: its logits, their fp32 copy, the log-softmax
        transient = min(loss_chunk, e) * spec.vocab * ((lin_b + 4 + 4) if half else 4 * 2)
    elif spec.task == "causal-lm":
        logits = b * s * spec.vocab
        outer += b * (s - 1) * spec.vocab * 4  # log-softmax output, fp32 (the loss upcasts)
        # alive at the loss besides: the logits (16-bit under autocast), their fp32 copy, the shifted contiguous copy
        transient = logits * (lin_b + 4 + 4) if half else logits * 4 * 2

    if not checkpointing:
        return Activations(saved=outer + n_layers * per_layer + block16 + outer16, layer=per_layer,
                           transient=transient, weight_copies=block16 + outer16)
    kept = e * h * res_b  # a checkpointed block's input
    if selective:
        kept += kept_selective
    # Blocks every, 2*every, ... are checkpointed. Backward runs from the last block to the first, freeing each
    # block's activations; a checkpointed block's are rebuilt first, while the blocks before it still hold theirs.
    # So the peak is the largest of: all that forward saved, and for each checkpointed block j the blocks before it
    # plus block j rebuilt. Checkpointing only the last block (every = L) saves nothing at that peak.
    held = [kept if (j + 1) % checkpoint_every == 0 else per_layer + block16 / n_layers for j in range(n_layers)]
    base = outer + outer16
    saved = base + sum(held)
    peak = max([saved] + [base + sum(held[:j]) + per_layer + block16 / n_layers
                          for j in range(n_layers) if (j + 1) % checkpoint_every == 0])
    plain = sum(1 for j in range(n_layers) if (j + 1) % checkpoint_every)
    return Activations(saved=saved, layer=peak - saved, transient=transient,
                       weight_copies=outer16 + plain * block16 / n_layers)


def decoder_layer_bytes(spec: ModelSpec, b: int, s: int, mode: str, kernels: str = "cuda", tp: int = 1
                        ) -> tuple[float, float]:
    """(bytes one Llama-style block saves for backward, what selective checkpointing keeps of it), counted tensor by
    tensor from transformers' Llama / Mistral / Qwen / Mixtral blocks with saved_tensors_hooks (tests/test_plan.py).

    mode: fp32 | autocast (fp32 weights, bf16 matmuls) | bf16 (the weights already 16-bit). E = b s tokens, h hidden,
    q and kv the query and key/value widths (heads x head_dim: grouped-query attention), I the MLP width.
      each RMSNorm: its fp32 input (the residual stream, or an fp32 copy of a 16-bit one), the normalized output in
        the stream's dtype, and the rstd: E h (4 + stream bytes) + 4 E
      attention: the q, k, v projections' input (fp32: one tensor; autocast: each projection its own 16-bit copy, 3);
        q, k, v after the rotary embedding, the kernel's output (the out-projection's input, the same storage) and its
        log-sum-exp: E (2q + 2kv) + 4 b a s. Qwen3's q/k RMSNorm: E (q + kv) (4 + 16-bit) more.
      SwiGLU MLP: the input of gate and up (autocast: 2 copies), gate's output (SiLU's input), SiLU's output, up's
        output and their product (down's input): 4 E I.
      mixture of experts (transformers' grouped_mm experts): the router's input, its softmax (E x experts fp32), the
        top-k indices and weights and the permutations (40 B per routed token), and per routed token (E k of them)
        its gathered input and its output (2 h), gate_up's output (2 I_e), SiLU's output and the product (2 I_e). On
        CPU autocast leaves grouped_mm in fp32; on CUDA the planner counts it in 16 bits (not measured).
    Gemma-2 (eager attention, no sdpa kernel for its soft cap): q, the key and value repeated to every head, the
    out-projection's input (4 E q) and per score 8 bytes (tanh's output, the fp32 softmax, its 16-bit copy).
    Under tensor parallel the heads and the MLP's (or each expert's) width are 1/tp; norms and inputs are whole."""
    e, h, a = b * s, spec.hidden, spec.heads
    kv_heads, q, kv = spec.kv_heads or a, spec.q_width, spec.kv_width
    stream_b = 2 if mode == "bf16" else 4
    lin_b = 4 if mode == "fp32" else 2
    norm = e * h * (4 + stream_b) + 4 * e
    copies = {"fp32": 1, "autocast": 3, "bf16": 1}[mode]  # tensors holding the q/k/v projections' input
    whole = spec.norms_per_layer * norm + copies * e * h * lin_b
    inner = e * (2 * q + 2 * kv) * lin_b + 4 * b * a * s
    if spec.eager_attention:
        inner = 4 * e * q * lin_b + 8 * b * a * s * s
    if spec.qk_norm:
        inner += e * (q + kv) * (4 + lin_b) + 4 * e * (a + kv_heads)
    if spec.experts:
        routed = e * spec.experts_per_token
        exp_b = 4 if mode == "fp32" or (mode == "autocast" and kernels == "cpu") else 2
        whole += e * h * lin_b + 40 * routed + 4 * e + 4 * e * spec.experts + routed * 2 * h * exp_b
        inner += 4 * routed * spec.expert_intermediate * exp_b
        selective = routed * (2 * h + 2 * spec.expert_intermediate) * exp_b
    else:
        whole += (2 if mode == "autocast" else 1) * e * h * lin_b  # gate's and up's input
        inner += 4 * e * spec.intermediate * lin_b
        selective = e * (2 * spec.intermediate + h) * lin_b  # gate's, up's and down's outputs
    selective += e * (q + 2 * kv + h) * lin_b + 4 * b * a * s  # q, k, v, the out-projection's output, log-sum-exp
    return whole + inner / tp, selective / tp


@dataclass(frozen=True)
class Recompute:
    """One activation checkpointing setting of recipes/activation_checkpointing.py, as the planner sees it."""

    every: int  # --checkpoint_every (0: no checkpointing)
    selective: bool  # --checkpointing_policy selective
    activations: float  # bytes at peak: saved for backward + the block being recomputed
    recompute: float  # the share of the blocks' forward run again in backward (full checkpointing of all: 1)

    @property
    def flags(self) -> tuple[str, ...]:
        return ((("--checkpoint_every", str(self.every)) if self.every > 1 else ())
                + (("--checkpointing_policy", "selective") if self.selective else ()))


def compile_saving(spec: ModelSpec, batch: int, seq: int | None, mode: str, checkpointing: bool) -> float:
    """Bytes torch.compile (inductor) keeps out of the saved activations, a stated adjustment: in every block not
    checkpointed, each RMSNorm saves its input and rstd, not the fp32 copy eager keeps (4 E h), and the fused SiLU x up
    saves its inputs and output, not SiLU's own output (E I in the matmuls' dtype). Decoders only; checkpointed blocks
    keep their input alone either way. Against torchtune's Llama 3.2 3B table (+ Compile: -9.0 GiB): 0.97x."""
    if spec.family != "decoder" or checkpointing or spec.experts:
        return 0.0
    e = batch * (spec.seq_tokens or seq or 0)
    lin_b = 4 if mode == "fp32" else 2
    return spec.layers * (spec.norms_per_layer * 4 * e * spec.hidden + e * spec.intermediate * lin_b)


# Selective checkpointing recomputes LayerNorm, GELU, adds and reshapes, not the matmuls: a prior for its extra step
# time as a share of full checkpointing's, from one noisy BERT-base reading (x1.10 vs x1.36 on a shared 2-core CPU);
# not yet measured on a quiet machine or a GPU (docs/checkpointing.md).
SELECTIVE_RECOMPUTE = 0.3


def offloaded_activation_bytes(spec: ModelSpec, act: Activations, batch: int, seq: int | None, mode: str,
                               precision: str = "fp32", weights16: bool = False) -> float:
    """Bytes recipes/activation_offloading.py moves off the device in one forward. checkpointed: each checkpointed
    block's input, the residual stream E h (fp32 under autocast; 16-bit when the weights are), exactly what the
    tiny run's ledger counts. all: every saved tensor but about one block's, which backward brings back at a time
    (tensors under --offload_min_bytes stay too: at 32 KiB, none of a real model's per-token tensors)."""
    if mode == "checkpointed":
        res_b = 2 if weights16 and spec.family == "decoder" else 4
        return spec.layers * batch * (spec.seq_tokens or seq) * spec.hidden * res_b
    return max(0.0, act.saved - act.layer)


def recompute_options(spec: ModelSpec, batch: int, seq: int | None, precision: str = "fp32",
                      kernels: str = "cuda", weights16: bool = False) -> list[Recompute]:
    """Every distinct setting, least recompute first: none, full on L // K blocks for K = L .. 1, selective."""
    n_layers = spec.layers
    none = activation_bytes(spec, batch, seq, precision, False, kernels, weights16=weights16)
    options = [Recompute(0, False, none.saved, 0.0)]
    for every in range(n_layers, 0, -1):
        if every < n_layers and n_layers // every == n_layers // (every + 1):
            continue  # the same number of blocks as a larger K: as much recompute, no less memory
        act = activation_bytes(spec, batch, seq, precision, True, kernels, every, weights16=weights16)
        options.append(Recompute(every, False, act.saved + act.layer, (n_layers // every) / n_layers))
    act = activation_bytes(spec, batch, seq, precision, True, kernels, 1, selective=True, weights16=weights16)
    options.append(Recompute(1, True, act.saved + act.layer, SELECTIVE_RECOMPUTE))
    # A setting that recomputes more and saves nothing over one that recomputes less (checkpointing only the last
    # block: backward rebuilds it while every other block still holds its activations) is never a choice.
    kept: list[Recompute] = []
    for o in sorted(options, key=lambda o: (o.recompute, o.activations)):
        if not kept or o.activations < min(k.activations for k in kept):
            kept.append(o)
    return kept


def least_recompute(spec: ModelSpec, batch: int, seq: int | None, budget: float, precision: str = "fp32",
                    kernels: str = "cuda") -> Recompute | None:
    """The setting that recomputes least among those whose activations fit in `budget` bytes; None: none fits."""
    return next((o for o in recompute_options(spec, batch, seq, precision, kernels) if o.activations <= budget), None)


def sequence_parallel_activations(spec: ModelSpec, batch: int, seq: int, n: int, precision: str = "fp32",
                                  kernels: str = "cuda", weights16: bool = False) -> Activations:
    """Per process under Ulysses sequence parallel over n processes (recipes/sequence_parallel.py).

    Every per-token tensor holds the chunk's seq/n tokens; attention keeps q, k, v and out of the whole sequence for
    heads/n, the same bytes as seq/n tokens of all heads (and the flash kernels' log-sum-exp, b a/n s). So: one
    process's activations at seq/n, plus in each block the all-to-all's output, kept as the out-projection's input
    (E/n h, Linear dtype), and the loss's log-softmax of every position of the chunk (the whole sequence's drops its
    last). The math kernel (CPU, attention dropout) keeps b a/n s^2 per score tensor, not b a (s/n)^2.
    """
    chunk = seq // n
    act = activation_bytes(spec, batch, chunk, precision, False, kernels, weights16=weights16)
    lin_b = 2 if precision in ("bf16", "fp16") or weights16 else 4
    extra = spec.layers * batch * chunk * spec.hidden * lin_b + (batch * spec.vocab * 4 if spec.task == "causal-lm"
                                                                  else 0)
    if kernels == "cpu" and spec.attention_dropout > 0:
        extra += spec.layers * 3 * batch * spec.heads * (seq * seq / n - chunk * chunk) * 4  # CPU attention: fp32
    return Activations(saved=act.saved + extra, layer=act.layer, transient=act.transient,
                       weight_copies=act.weight_copies)


# ---------------------------------------------------------------- techniques: one line each

@dataclass(frozen=True)
class Technique:
    """A recipe + launch config and what it does to memory. Adding one is adding a line to TECHNIQUES. The fields
    are shared/core/rules.py's Run fields, in its words (compat_run passes them on as they are)."""

    name: str
    recipe: str  # recipes/<recipe>.py (its SUPPORT: catalogue.recipes_support) ("": no recipe runs this layout yet)
    config: str | None  # accelerate_configs/<config>; None: the data-parallel config for --num_gpus
    sharding: str = "ddp"  # ddp (one process: none) | zero1 | zero2 | zero3 | fsdp
    offload: str = "none"  # none | cpu | nvme: where the optimizer state (and with offload_params, the weights) go
    offload_params: bool = False  # the parameters offloaded too (ZeRO-3 offload_param, FSDP offload_params)
    precision: str | None = None  # fixed precision; None: fp32 and bf16 (--mixed_precision) are both planned
    checkpointing: bool = False
    optimizer: str = "adamw"  # adamw | adamw_bnb_8bit | TORCHAO_STATES' keys (--optim names) | adamw_in_backward
    load_in: str = "full"  # full | 8bit | 4bit (NF4): base weights quantized, LoRA adapters trained
    dora: bool = False  # the LoRA adapters as DoRA: one trained magnitude per adapted output beside A and B
    loss_chunk: int = 0  # causal LM: tokens per chunk of the chunked loss (techniques/chunked_loss.py); 0: plain
    args: tuple[str, ...] = ()
    speed: float = 1.0  # relative step time (prior, see docs/planner.md), before the precision and checkpointing
    splits_sequence: bool = False  # each device holds seq/N of every sequence (sequence parallel)
    tp: int = 0  # tensor-parallel group size (recipes/tensor_parallel.py): -1 all devices, N with FSDP2 across groups
    lora: bool = False  # LoRA adapters on the full-precision base (load_in != full implies adapters too)
    quant_storage: str = "uint8"  # --bnb_4bit_quant_storage: ZeRO-3 / FSDP shard 4-bit weights stored as bfloat16
    ep: bool = False  # expert parallel: each process holds experts/N whole experts, the dense weights FSDP2-sharded
    hsdp: bool = False  # hybrid sharding: FSDP within a node, replicas across nodes
    act_offload: str = ""  # all | checkpointed: saved activations moved to the host (recipes/activation_offloading.py)
    selective: bool = False  # with checkpointing: --checkpointing_policy selective (keep matmul and attention outputs)
    compile: bool = False  # --torch_compile regional: inductor fuses the elementwise ops (compile_saving)
    paged: bool = False  # bitsandbytes' PagedAdamW8bit (--paged): the 8-bit state in CUDA unified memory

    @property
    def adapters(self) -> bool:
        return self.lora or self.load_in != "full"


# The launches recipes/combined.py runs (accelerate_configs/): sharding, offload, and a speed prior each.
LAUNCHES: dict[str, dict] = {
    "ddp": dict(config=None, sharding="ddp"),
    "zero1": dict(config="zero1.yaml", sharding="zero1"),
    "zero2": dict(config="zero2.yaml", sharding="zero2"),
    "zero3": dict(config="zero3.yaml", sharding="zero3", speed=1.15),
    "zero2_offload": dict(config="zero2_offload.yaml", sharding="zero2", offload="cpu", speed=1.6),
    "zero3_offload": dict(config="zero3_offload.yaml", sharding="zero3", offload="cpu", offload_params=True,
                          speed=2.5),
    "zero3_nvme": dict(config="zero3_nvme.yaml", sharding="zero3", offload="nvme", offload_params=True, speed=4.0),
    "fsdp": dict(config="fsdp.yaml", sharding="fsdp", speed=1.15),
    "fsdp_offload": dict(config="fsdp_offload.yaml", sharding="fsdp", offload="cpu", offload_params=True, speed=2.5),
}
# QLoRA's dequantizing matmuls: 4-bit x1.2, int8 x1.6 (priors); LoRA on a 16-bit base: no weight gradients, no
# optimizer step on the base (a prior of x0.8).
ADAPTER_SPEED = {"lora": 0.8, "4bit": 1.2, "8bit": 1.6}


def _launch(name: str) -> dict:
    return {k: v for k, v in LAUNCHES[name].items() if k != "config"}


TECHNIQUES: list[Technique] = [
    Technique("baseline", "baseline", None),
    Technique("mixed_precision", "mixed_precision", None, precision="bf16", args=("--mixed_precision", "bf16")),
    Technique("activation_checkpointing", "activation_checkpointing", None, checkpointing=True),
    # torch.compile through Accelerate (--torch_compile regional), in the recipes that compile (rules.py `compiles`);
    # its saving is a stated adjustment (compile_saving), its speed a prior from torchtune's table (x0.79)
    Technique("baseline_compiled", "baseline", None, compile=True, args=("--torch_compile", "regional"), speed=0.8),
    Technique("activation_checkpointing_compiled", "activation_checkpointing", None, checkpointing=True, compile=True,
              args=("--torch_compile", "regional"), speed=0.8),
    Technique("optim_8bit", "optim_8bit", None, optimizer="adamw_bnb_8bit"),
    # PagedAdamW8bit: the state in CUDA unified memory, outside torch's allocator, paged to the host under pressure
    Technique("optim_8bit_paged", "optim_8bit", None, optimizer="adamw_bnb_8bit", paged=True, args=("--paged",)),
    Technique("optim_4bit", "optim_low_bit", None, optimizer="adamw_torchao_4bit",
              args=("--optim", "adamw_torchao_4bit")),
    Technique("optim_fp8", "optim_low_bit", None, optimizer="adamw_torchao_fp8", args=("--optim", "adamw_torchao_fp8")),
    Technique("optimizer_in_backward", "optimizer_in_backward", None, optimizer="adamw_in_backward"),
    *(Technique(name, "zero", f"{name}.yaml", **_launch(name)) for name in ("zero1", "zero2", "zero3")),
    # ZeRO-2 with optimizer offload is recipes/zero.py's launch (zero2_offload.yaml says so); zero3_offload.py runs
    # the ZeRO-3 offload configs (parameters offloaded too)
    Technique("zero2_offload", "zero", "zero2_offload.yaml", **_launch("zero2_offload")),
    *(Technique(name, "zero3_offload", f"{name}.yaml", **_launch(name)) for name in ("zero3_offload", "zero3_nvme")),
    *(Technique(name, "fsdp", f"{name}.yaml", **_launch(name)) for name in ("fsdp", "fsdp_offload")),
    # recipes/qlora.py checkpoints the blocks unless --no_gradient_checkpointing
    Technique("qlora_8bit", "qlora", None, precision="bf16", load_in="8bit", checkpointing=True,
              args=("--load_in", "8bit"), speed=ADAPTER_SPEED["8bit"]),
    Technique("qlora_4bit", "qlora", None, precision="bf16", load_in="4bit", checkpointing=True,
              args=("--load_in", "4bit"), speed=ADAPTER_SPEED["4bit"]),
    # DoRA's step: 1.33x LoRA's (benchmarks/dora.py, docs/dora.md)
    Technique("qlora_4bit_dora", "qlora", None, precision="bf16", load_in="4bit", dora=True, checkpointing=True,
              args=("--load_in", "4bit", "--use_dora"), speed=1.6),
    Technique("chunked_loss", "chunked_loss", None, loss_chunk=1024),
    # Saved activations to the host (recipes/activation_offloading.py). Speed priors, not measured on a GPU yet
    # (benchmarks/gpu_check.py measures them): every activation over PCIe and back, partly overlapped, x1.3; the
    # block inputs only, one E h tensor per block, x1.05 on top of checkpointing's recompute.
    Technique("activation_offloading", "activation_offloading", None, act_offload="all", speed=1.3),
    Technique("activation_offloading_checkpointed", "activation_offloading", None, checkpointing=True,
              act_offload="checkpointed", args=("--offload_mode", "checkpointed"), speed=1.05),
    # the global batch is one device's (the devices split sequences): a prior of 1.1 for the 4 all-to-alls a block
    Technique("sequence_parallel", "sequence_parallel", None, splits_sequence=True, speed=1.1),
    # Tensor parallel trains fp32 here (bf16 not yet run with TP); one group of all devices, or groups of 2 x FSDP2.
    Technique("tensor_parallel", "tensor_parallel", None, precision="fp32", tp=-1, speed=1.2),
    Technique("tensor_parallel_fsdp", "tensor_parallel", "tp2_dp2.yaml", precision="fp32", tp=2,
              args=("--tp_size", "2"), speed=1.2),
]
# bf16 on tensor cores takes about half the time of fp32; checkpointing adds one forward (about a third).
PRECISION_SPEED = {"fp32": 1.0, "bf16": 0.5}
CHECKPOINTING_SPEED = 4 / 3


def _signature(t: Technique) -> tuple:
    """What a row does to memory, whichever recipe runs it: a combination a single-technique row already shows is
    planned once, as that row (its recipe teaches the one technique)."""
    return (t.sharding, t.offload, t.offload_params, t.checkpointing, t.optimizer, t.load_in, t.adapters, t.dora,
            bool(t.loss_chunk), t.splits_sequence, t.tp, t.ep, t.hsdp, t.act_offload, t.selective, t.compile, t.paged)


def combined_techniques() -> list[Technique]:
    """The combinations recipes/combined.py runs (its --help): each launch config x --gradient_checkpointing x
    --optim adamw_bnb_8bit x --lora / --load_in 8bit / 4bit x --chunked_loss; rules.py decides which train."""
    shown = {_signature(t) for t in TECHNIQUES}
    out = []
    for launch, conf in LAUNCHES.items():
        for adapter in ("", "lora", "4bit", "8bit"):
            if adapter and conf.get("offload") and not conf.get("offload_params"):
                continue  # offloading the adapters' few optimizer states moves nothing that matters
            for optim in ("adamw", "adamw_bnb_8bit") if not adapter else ("adamw",):
                for ckpt in (False, True, "selective") if not adapter else (False, True):
                    for chunked in (False, True):
                        sharded = conf["sharding"] in ("zero3", "fsdp")
                        storage = "bfloat16" if adapter == "4bit" and sharded else "uint8"
                        name = "+".join(part for part, on in (
                            (launch, True), ("sel_ckpt" if ckpt == "selective" else "ckpt", bool(ckpt)),
                            ("adam8", optim != "adamw"),
                            ({"lora": "lora", "4bit": "qlora4", "8bit": "qlora8"}.get(adapter, ""), bool(adapter)),
                            ("chunked", chunked)) if on)
                        args = [*(("--gradient_checkpointing",) if ckpt else ()),
                                *(("--checkpointing_policy", "selective") if ckpt == "selective" else ()),
                                *(("--optim", optim) if optim != "adamw" else ()),
                                *(("--lora",) if adapter else ()),
                                *(("--load_in", adapter) if adapter in ("4bit", "8bit") else ()),
                                *(("--bnb_4bit_quant_storage", storage) if storage != "uint8" else ()),
                                *(("--chunked_loss",) if chunked else ())]
                        speed = conf.get("speed", 1.0) * ADAPTER_SPEED.get(adapter, 1.0)
                        tech = Technique(name, "combined", conf["config"], **_launch(launch) | {"speed": speed},
                                         precision="bf16" if adapter in ("4bit", "8bit") else None,
                                         checkpointing=bool(ckpt), selective=ckpt == "selective", optimizer=optim,
                                         load_in=adapter if adapter in ("4bit", "8bit") else "full",
                                         lora=adapter == "lora", quant_storage=storage,
                                         loss_chunk=1024 if chunked else 0, args=tuple(args))
                        if _signature(tech) not in shown:
                            out.append(tech)
    return out


COMBINED = combined_techniques()
# Expert parallel (recipes/expert_parallel.py, transformers' DistributedConfig(ep_size=N, fsdp_size=N)): the experts
# split over all processes, the dense weights FSDP2-sharded over all of them. Planned for mixtures of experts.
EXPERT_PARALLEL = Technique("expert_parallel", "expert_parallel", None, ep=True, speed=1.2)
# HSDP (recipes/fsdp.py --dp_shard_size G, accelerate_configs/hsdp.yaml): FSDP2 on Accelerate's (dp_replicate =
# nodes, dp_shard = GPUs per node) mesh: the states divide by the GPUs of one node, the all-gathers stay inside it.
HSDP = Technique("hsdp", "fsdp", "hsdp.yaml", sharding="fsdp", hsdp=True, speed=1.15)


def search_space(spec: ModelSpec, num_gpus: int, gpus_per_node: int) -> list[Technique]:
    """Every row the planner weighs for this model and hardware: the recipes' own rows, recipes/combined.py's
    combinations, tensor parallel in every group size that divides a node, expert parallel, HSDP."""
    rows = [*TECHNIQUES, *COMBINED]
    for tp in (4, 8, 16):  # tp2_dp2.yaml's --tp_size 2 and one group of all are rows of their own
        if tp < num_gpus and num_gpus % tp == 0 and tp <= gpus_per_node:
            rows.append(Technique(f"tensor_parallel_tp{tp}", "tensor_parallel", None, precision="fp32", tp=tp,
                                  args=("--tp_size", str(tp)), speed=1.2))
    if spec.experts:
        rows.append(EXPERT_PARALLEL)
    if gpus_per_node < num_gpus:
        rows.append(HSDP)
    return rows


def has_recipe(tech: Technique) -> bool:
    """The recipe is in this checkout and in the catalogue (expert_parallel: being written)."""
    return _recipe_here(tech.recipe)


@functools.cache
def _recipe_here(recipe: str) -> bool:
    """A recipe of the catalogue (recipes_support), in this checkout, and not in catalogue.py's NOT_PLANNED."""
    return (bool(recipe) and recipe in recipes_support() and recipe not in NOT_PLANNED
            and (CONFIGS.parent / "recipes" / f"{recipe}.py").exists())


def _no_recipe_reason(tech: Technique) -> str:
    if not tech.recipe:
        return "modelled only; no recipe runs this layout yet"
    if tech.recipe in recipes_support() and tech.recipe in NOT_PLANNED:
        return f"shared/tools/catalogue.py marks recipes/{tech.recipe}.py not planned ({NOT_PLANNED[tech.recipe]})"
    return f"recipes/{tech.recipe}.py is not in this checkout yet"


@functools.cache
def _refusals(tech: Technique, precision: str, n: int, task: str, seq_len: int, facts: ModelFacts
              ) -> tuple[str, ...]:
    """rules.refusals of the row's run, once per distinct run (the batch size does not change what it refuses)."""
    return tuple(rules.refusals(compat_run(tech, precision, n, task, seq_len, facts)))


@dataclass
class Prediction:
    technique: Technique
    precision: str
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0  # gathered shards, optimizer temporaries, logits at the loss
    host: float = 0.0  # per process, offloaded states (and offloaded activations: host_activations of it)
    host_activations: float = 0.0
    nvme: float = 0.0  # per process
    trainable: int = 0
    notes: list[str] = field(default_factory=list)
    recompute: float = 1.0  # under checkpointing: the share of the blocks' forward recomputed (Recompute)
    args: tuple[str, ...] = ()  # the recipe flags the planner chose (the checkpointing setting)
    compute_half: bool = False  # the matmuls run in 16 bits: bf16 autocast, or 16-bit weights
    extra_speed: float = 1.0  # the chunked loss recomputes the head's forward in backward
    label: str = ""  # the precision as listed: a 16-bit checkpoint trained without autocast is "bf16" too

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def states_anywhere(self) -> float:
        """Params, gradients and optimizer state on the device and the host: what a CPU run holds, where the two
        are one memory."""
        return self.model_states + self.host - self.host_activations

    @property
    def device_peak(self) -> float:
        # In backward the gradients appear while the activations are freed, so the live bytes peak somewhere
        # between weights + optimizer + max(activations, gradients) and the sum of all four. The sum is what the
        # CPU runs measured (the allocator does not hand freed activation blocks back to gradients of another
        # size), and the safe side on a GPU: an upper bound by at most min(activations, gradients).
        return self.weights + self.optimizer + self.activations + self.grads + self.buffers

    @property
    def speed(self) -> float:
        t = self.technique
        recompute = 1 + (CHECKPOINTING_SPEED - 1) * self.recompute if t.checkpointing else 1.0
        precision = "bf16" if self.compute_half else self.precision
        return t.speed * PRECISION_SPEED[precision] * recompute * self.extra_speed

    @property
    def prec(self) -> str:
        return self.label or self.precision

    @property
    def row(self) -> str:
        """The row's name for --explain: technique:precision."""
        return f"{self.technique.name}:{self.prec}"

    @property
    def parts(self) -> int:
        """Techniques combined: between rows of one speed, the simpler is listed first."""
        t = self.technique
        return (1 + t.checkpointing + (t.optimizer != "adamw") + t.adapters + bool(t.loss_chunk)
                + (t.offload != "none"))


# ---------------------------------------------------------------- tensor parallel, and tensor x data parallel


def tensor_parallel_bytes(spec: ModelSpec, tp: int, dp: int = 1, shard_vocab: bool = False,
                          weight_bytes: int = 4) -> dict[str, float]:
    """Per-device parameter, gradient and AdamW-state bytes of recipes/tensor_parallel.py on a (dp, tp) mesh.

    Megatron's split (shared/techniques/tensor_parallel.py PLANS): every block's Linear weights and its column-wise
    biases (q, k, v and the MLP's up projection) hold 1/tp; the row-wise biases, norms, embeddings and head are whole on
    each process of a TP group (--shard_vocab: the [vocab, hidden] embedding, tied to the head, 1/tp too). A model that
    ships its own plan (Llama, Qwen, Mistral, Mixtral, Gemma: base_model_tp_plan) splits what that plan names, every
    expert's MLP included, and its embedding and head over the vocabulary (spec.tp_split_numel). dp > 1: FSDP2 then
    splits everything by dp (evenly: its padding is under a row per tensor). weight_bytes: the parameters' dtype
    (AdamW's moments are in it too)."""
    if spec.tp_split_numel >= 0:
        split = spec.tp_split_numel
    else:
        split = spec.block_linear_numel + spec.layers * (3 * spec.hidden + spec.intermediate)
        if shard_vocab:
            split += spec.vocab * spec.hidden
    per_device = (split / tp + (spec.num_params - split)) / dp
    return {"param_bytes": weight_bytes * per_device, "grad_bytes": weight_bytes * per_device,
            "optimizer_state_bytes": 2 * weight_bytes * per_device + 4 * spec.num_tensors}  # moments; a 4-byte step


def predict(spec: ModelSpec, tech: Technique, precision: str, num_devices: int, batch: int, seq: int | None,
            kernels: str = "cuda", lora_r: int = 8, gpus_per_node: int | None = None) -> Prediction:
    """Bytes per device (and per process on the host / NVMe) of one training step with this technique."""
    n = num_devices
    p = Prediction(tech, precision)
    numels = spec.tensor_numels
    psi = spec.num_params
    half = precision in ("bf16", "fp16")
    wb = spec.weight_bytes  # as loaded: a bf16 checkpoint trains in bf16 unless FSDP or DeepSpeed keep fp32 masters
    deepspeed = tech.sharding.startswith("zero")
    stage = int(tech.sharding[-1]) if deepspeed else (3 if tech.sharding == "fsdp" else 0)
    fsdp = tech.sharding == "fsdp" or tech.ep  # FSDP2 (expert parallel: for the dense weights)
    # Accelerate's FSDP2 under mixed precision: fp32 masters, bf16 compute copies (expert parallel's FSDP2 is
    # transformers' own, which keeps the weights as loaded, under autocast)
    fsdp_mp = tech.sharding == "fsdp" and half
    shard = (gpus_per_node or n) if tech.hsdp else n
    tp = (n if tech.tp < 0 else tech.tp) if tech.tp else 1
    weights16 = tech.load_in == "full" and (wb == 2 or (half and deepspeed) or fsdp_mp)
    p.compute_half = half or wb == 2
    p.label = "bf16" if p.compute_half and precision == "fp32" else precision
    if tech.loss_chunk:  # each chunk's head forward runs again in backward: 2 E h V of a step's ~6 E Psi FLOPs
        p.extra_speed = 1 + spec.head_weight_numel / (3 * spec.active_params)
    act = (sequence_parallel_activations(spec, batch, seq, n, precision, kernels, weights16) if tech.splits_sequence
           else activation_bytes(spec, batch, seq, precision, tech.checkpointing, kernels, loss_chunk=tech.loss_chunk,
                                 tp=tp, weights16=weights16, selective=tech.selective))
    if tech.selective:
        p.recompute = SELECTIVE_RECOMPUTE
    if tech.compile:
        saved = compile_saving(spec, batch, seq, "bf16" if weights16 else ("autocast" if half else "fp32"),
                               tech.checkpointing)
        act = Activations(act.saved - saved, act.layer, act.transient, act.weight_copies)
        p.notes.append("torch.compile: a stated adjustment, not a measurement here: inductor's fused RMSNorm and SiLU "
                       "save neither the norm's fp32 copy nor SiLU's output (decoders; docs/planner.md)")

    if tech.adapters:  # LoRA / QLoRA: a frozen base, the adapters (and a new head) trained in fp32
        # each adapter is two tensors, A (r x in) and B (out x r)
        adapters = [lora_r * d for i, o in [*spec.lora_targets, *spec.lora_param_targets] for d in (i, o)]
        magnitudes = [o for _, o in spec.lora_targets] if tech.dora else []  # DoRA: one per adapted output
        trainable = [*adapters, *magnitudes, *([spec.head_numel] if spec.head_numel else [])]
        p.trainable = sum(trainable)
        linear = sum(num for _, _, num in spec.linear_weights)
        if tech.load_in != "full":
            # bitsandbytes' weights; prepare_model_for_kbit_training casts every other weight to fp32
            base = sum(nf4_bytes(num) if tech.load_in == "4bit" else int8_bytes(num, out)
                       for _, out, num in spec.linear_weights) + 4 * (psi - linear)
            p.activations = act.saved - act.weight_copies
            # bitsandbytes dequantizes one weight at a time to the compute dtype (forward, and again in backward for
            # the input's gradient) and frees it after the matmul: one layer's 16-bit copy is alive at a time
            p.buffers += 2 * max(num for _, _, num in spec.linear_weights)
        else:  # the base as loaded (DeepSpeed's bf16 casts it); FSDP2 upcasts only what trains
            base = (2 if deepspeed and half else wb) * (psi - spec.head_numel)
            p.activations = act.saved
        shard_base = n if stage == 3 else 1
        shard_g = n if stage >= 2 else 1
        shard_o = n if stage >= 1 else 1
        p.weights = base / shard_base + 4 * p.trainable / shard_base
        p.grads = 4 * p.trainable / shard_g
        p.optimizer = (12 * p.trainable / n if deepspeed else
                       adam_state_bytes(trainable, eight_bit=tech.optimizer == "adamw_bnb_8bit") / shard_o)
        if stage == 3:  # the gathered block and the prefetched one
            p.buffers += 2 * base / psi * spec.layer_params
        p.notes.append(f"{'DoRA' if tech.dora else 'LoRA'} r={lora_r} on {len(spec.lora_targets)} modules ("
                       "all-linear); activations counted as full fine-tuning's (an upper bound"
                       + ("; DoRA's weight norms, one dequantized weight at a time, are not counted)" if tech.dora
                          else ")"))
        if tech.offload != "none":
            p.host += p.optimizer
            p.optimizer = 0.0
        if tech.offload_params:
            p.host += p.weights
            p.weights = 0.0
    elif tech.tp:
        # Megatron's split: the block matrices 1/tp, the rest whole in a group; FSDP2 then divides all by dp.
        states = tensor_parallel_bytes(spec, tp, max(1, n // tp), weight_bytes=wb)
        p.trainable = psi
        p.weights, p.grads, p.optimizer = (states[k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
        p.activations = act.saved
        p.notes.append(f"tensor parallel {tp} x data parallel {max(1, n // tp)}: the heads and MLP widths 1/{tp} in "
                       "the activations, the residual stream whole")
        if n // tp > 1:
            p.buffers += 2 * wb * spec.layer_params / tp  # FSDP2 gathers a block's TP shard, and prefetches the next
    elif deepspeed:
        # DeepSpeed keeps 16-bit (or fp32) weights and gradients, and inside the optimizer an fp32 copy of its
        # partition beside m and v: K=12 in fp32 too (ZeRO clones the partition even when the model is fp32;
        # measured: optimizer state 1.50x the 8 bytes/param of AdamW alone, ZeRO-2, 2 processes). Plus, in mixed
        # precision, as its own estimator counts, an fp32 gradient partition for the optimizer: built in step() and
        # freed after it (measured: not alive between steps), so a buffer in the peak, not a held gradient; with
        # offload it is allocated once on the host and kept.
        w = 2 if half else wb
        k = 12
        p.trainable = psi
        shard_w, shard_g, shard_o = (n if stage >= 3 else 1), (n if stage >= 2 else 1), n
        p.weights = w * psi / shard_w
        p.grads = w * psi / shard_g
        fp32_grads = 4 * psi / n if half else 0
        p.optimizer = k * psi / shard_o
        if tech.optimizer == "adamw_bnb_8bit":  # bitsandbytes steps DeepSpeed's fp32 partitions: 8-bit moments
            p.optimizer = 4 * psi / shard_o + adam_state_bytes([math.ceil(psi / shard_o)], eight_bit=True)
        p.activations = act.saved  # DeepSpeed casts the model itself: no autocast copies (weights16)
        if stage == 3:
            p.buffers += 2 * w * max(spec.layer_params, max(numels))  # gathered block + the prefetched one
        if tech.offload == "none":
            p.buffers += fp32_grads
        else:
            off = p.optimizer + fp32_grads
            p.optimizer = 0.0
            if tech.offload == "nvme":
                p.nvme += off
                p.host += 4 * psi / n  # pinned swap buffers, about one fp32 partition
            else:
                p.host += off
        if tech.offload_params:  # the weight partitions too; the device keeps the gathered blocks
            if tech.offload == "nvme":
                p.nvme += p.weights
            else:
                p.host += p.weights
            p.weights = 0.0
        if tech.offload != "none" and stage < 3:
            # ZeRO-Offload copies each reduced gradient into the host partition and frees the device's
            # (stage_1_and_2.py: `clear_grad_attribute(param)  #offload only`): what stays is the reduction buckets,
            # two of reduce_bucket_size elements (Accelerate's "auto": hidden x hidden) with overlap_comm. DeepSpeed's
            # estimate_zero2_model_states_mem_needs(cpu_offload=True) counts 2 Psi on the device: the weights alone.
            p.grads = 2 * w * spec.hidden * spec.hidden
        elif tech.offload != "none":  # ZeRO-3's gradient partitions live on the optimizer's device: the host
            p.host += p.grads
            p.grads = 0.0
    else:
        # Accelerate: weights, gradients and torch AdamW's moments in the parameters' dtype (fp32 for the presets and
        # fp32 checkpoints; FSDP2 upcasts a 16-bit checkpoint to fp32 masters under mixed precision); autocast's
        # 16-bit weight copies are in the activations
        p.trainable = psi
        wt = 4 if fsdp_mp else wb
        parts = shard if fsdp else 1
        p.weights = wt * psi / parts
        p.grads = wt * psi / parts
        eight = tech.optimizer == "adamw_bnb_8bit"
        if tech.optimizer in TORCHAO_STATES:
            p.optimizer = torchao_adam_state_bytes(numels, tech.optimizer) / parts
        else:
            p.optimizer = adam_state_bytes(numels, eight_bit=eight, dtype_bytes=wt) / parts
        if tech.optimizer == "adamw_in_backward":  # each gradient is freed in its hook once its parameter has stepped
            p.grads = wt * max(numels)
        if tech.paged:  # cudaMallocManaged: on the device while it has room, paged out to the host under pressure
            p.host += p.optimizer
            p.optimizer = 0.0
            p.notes.append("paged 8-bit AdamW: its state is in CUDA unified memory, outside torch's allocator "
                           "(torch.cuda.max_memory_allocated does not see it); counted on the host, where it goes "
                           "when the device is full; it costs PCIe time then")
        p.activations = act.saved
        if fsdp:  # FSDP gathers a block (and prefetches the next) in the compute dtype; EP's experts stay local
            unit = (max(spec.layer_params - spec.layer_expert_numel, spec.vocab * spec.hidden) if tech.ep
                    else max(spec.layer_params, max(numels)))
            p.buffers += 2 * (2 if fsdp_mp else wt) * unit
        if tech.ep:  # the all-to-all's buffers: each routed token's hidden state sent and received
            s = spec.seq_tokens or seq or 0
            p.buffers += 2 * batch * s * spec.experts_per_token * spec.hidden * (2 if p.compute_half else 4)
            p.notes.append(f"expert parallel over {n}: {spec.experts // n if spec.experts >= n else 0} whole experts "
                           "per process, the dense weights FSDP2-sharded; routing assumed balanced")
        if tech.hsdp:
            p.notes.append(f"HSDP: sharded over the {shard} GPUs of a node, replicated across "
                           f"{math.ceil(n / shard)} nodes")
        if tech.offload_params:
            p.host += p.weights + p.grads + p.optimizer
            p.weights = p.grads = p.optimizer = 0.0
        if tech.optimizer == "adamw" and tech.sharding == "ddp" and not tech.ep:
            # torch's AdamW on CUDA is the foreach kernel: it takes sqrt(exp_avg_sq) of all tensors at once
            # (one copy of the parameters); on CPU the per-tensor loop holds 2 copies of the largest tensor.
            p.buffers += wt * psi if kernels == "cuda" else 2 * wt * max(numels)
        if tech.sharding == "ddp" and n > 1 and not tech.ep:
            p.buffers += min(wt * psi, 25 * MiB * 2)  # DDP's gradient buckets (25 MB)
    if tech.act_offload:  # the saved activations moved to the host (shared/techniques/activation_offload.py)
        moved = offloaded_activation_bytes(spec, act, batch, seq, tech.act_offload, precision, weights16)
        p.activations -= moved
        p.host += moved
        p.host_activations += moved
    if tech.checkpointing:
        p.activations += act.layer  # one block recomputed at a time in backward
    if tech.splits_sequence:
        p.notes.append(f"the global batch is one device's {batch} sequences, each split over the {n} devices (the "
                       "data-parallel rows train n times as many per step)")
    p.buffers += act.transient
    return p


def predict_cpu_run(spec: ModelSpec, tech: Technique, precision: str, num_processes: int, batch: int,
                    seq: int | None, runtime_bytes: float = CPU_RUNTIME_BYTES) -> dict[str, float]:
    """A recipe run on CPU, per process, in results.json's terms: the model-state fields, the activations the
    checkpointing recipe's probe measures, and the peak RSS (runtime + the training peak)."""
    p = predict(spec, tech, precision, num_processes, batch, seq, kernels="cpu")
    act = activation_bytes(spec, batch, seq, precision, False, kernels="cpu")
    ckpt = activation_bytes(spec, batch, seq, precision, True, kernels="cpu")
    if tech.optimizer in TORCHAO_STATES:
        runtime_bytes += TORCHAO_STEP_RUNTIME_BYTES
    return {"param_bytes": p.weights, "grad_bytes": p.grads, "optimizer_state_bytes": p.optimizer,
            "activation_bytes_without_checkpointing": act.saved, "activation_bytes_with_checkpointing": ckpt.saved,
            "training_peak_bytes": p.device_peak, "peak_memory_bytes": p.device_peak + runtime_bytes}


# ---------------------------------------------------------------- the command line


def parse_bytes(text: str, binary: bool = False) -> float:
    """A size as written: KiB / MiB / GiB / TiB are powers of 2; KB / MB / GB / TB are powers of 10 unless `binary`,
    where they are read as the vendors and nvidia-smi mean them on a memory device: an "80GB" card holds 80 GiB
    (nvidia-smi reports its capacity in MiB, 81,559 for an H100 80GB)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 80GB, 24GiB, 512MiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if binary and unit in "KMGT":
        unit += "I"
    return value * scale[unit]


def parse_memory(text: str) -> float:
    """--gpu_memory, --reserve, --host_memory: GB read as GiB (parse_bytes' binary reading)."""
    return parse_bytes(text, binary=True)


def fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / MiB:.1f} MiB"


CONFIGS = Path(__file__).resolve().parents[2] / "accelerate_configs"  # shared/tools/ -> the checkout
# What the user fills in a printed command: no default is right on another machine.
PLACEHOLDERS = {
    "NVME_DIR": "a directory on a local NVMe drive (DeepSpeed writes its swap files there)",
    "MACHINE_RANK": "0 on the machine whose address is MAIN_IP, 1, 2, ... on the others",
    "MAIN_IP": "the address of machine 0, reachable from every machine",
}


def config_file(tech: Technique, num_gpus: int) -> str:
    return tech.config or ("single_process.yaml" if num_gpus == 1 else "multi_gpu.yaml")


def config_launch(config: str) -> tuple[int, int]:
    """(num_processes, num_machines) an accelerate config launches when the command line does not override them."""
    import yaml

    path = CONFIGS / config
    conf = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    return int(conf.get("num_processes", 1)), int(conf.get("num_machines", 1))


@dataclass(frozen=True)
class ModelFacts:
    """What the recipes check once the model is built (shared/core/rules.py's built rules), from the spec."""

    model_type: str = ""
    heads: int = 0
    kv_heads: int = 0
    mlp_width: int = 0
    experts: int = 0
    ep_dispatch: bool | None = None
    tp_plans: tuple[str, ...] = ()
    tp_plan_source: str = ""
    logit_transform: str = ""
    outside_linear: str = ""

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelFacts:
        return cls(spec.model_type, spec.heads, spec.kv_heads, spec.intermediate, spec.experts, spec.ep_dispatch,
                   spec.tp_plans, "own" if spec.tp_split_numel >= 0 else "ours", spec.logit_transform,
                   spec.outside_linear)


def compat_run(tech: Technique, precision: str, num_processes: int, task: str = "", seq_len: int = 0,
               facts: ModelFacts | None = None) -> rules.Run:
    """The technique as shared/core/rules.py's rule table describes a run: what the recipe would check at start-up
    (task and seq_len: for the rules that read them; the recipes' default packing, concat, for a causal LM), and with
    `facts` what it checks once the model is built, for the technique that checks it: heads and widths that a
    tensor- or sequence-parallel group splits, experts that expert parallel splits, weights outside nn.Linear that
    quantization would leave as they are, a logit transform the chunked loss would skip."""
    sharding = tech.sharding if tech.sharding != "ddp" else ("ddp" if num_processes > 1 else "none")
    flags = {"load_in": f"--load_in {tech.load_in}", "quant_storage": "--bnb_4bit_quant_storage", "lora": "--lora",
             "dora": "--use_dora", "optimizer": f"--optim {tech.optimizer}", "chunked_loss": "--chunked_loss"}
    built: dict[str, object] = {}
    if facts is not None:
        tp = (num_processes if tech.tp < 0 else tech.tp) if tech.tp else 0
        if tp:
            built.update(model_type=facts.model_type, tp_plans=facts.tp_plans, heads=facts.heads,
                         kv_heads=facts.kv_heads, mlp_width=facts.mlp_width, tp_degree=tp,
                         tp_plan_source=facts.tp_plan_source)
        if tech.splits_sequence:
            built.update(heads=facts.heads, kv_heads=facts.kv_heads, sp_degree=num_processes)
        if tech.ep:
            built.update(model_type=facts.model_type, experts=facts.experts, ep_degree=num_processes,
                         ep_dispatch=facts.ep_dispatch)
        if tech.load_in != "full":
            built.update(model_type=facts.model_type, outside_linear=facts.outside_linear,
                         linear_only=f"quantizes (bitsandbytes, --load_in {tech.load_in})")
        if tech.loss_chunk:
            built.update(logit_transform=facts.logit_transform)
    return rules.Run(recipe=tech.recipe, support=recipes_support().get(tech.recipe), sharding=sharding,
                     launched=sharding, offload=tech.offload,
                     num_processes=num_processes, precision="no" if precision == "fp32" else precision,
                     load_in=tech.load_in, quant_storage=tech.quant_storage, lora=tech.adapters, dora=tech.dora,
                     optimizer=tech.optimizer, task=task, seq_len=seq_len,
                     packing="concat" if task == "causal-lm" else "none", tensor_parallel_size=max(0, tech.tp),
                     chunked_loss=bool(tech.loss_chunk), activation_offload=tech.act_offload,
                     compile="regional" if tech.compile else "none",
                     flags=flags if tech.recipe == "combined" else {}, **built)


def command(tech: Technique, precision: str, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> str:
    """The `accelerate launch` line that runs this technique as planned; placeholders in PLACEHOLDERS' names."""
    config = config_file(tech, args.num_gpus)
    processes, machines = config_launch(config)
    parts = ["accelerate launch", f"--config_file accelerate_configs/{config}"]
    if args.num_gpus != processes:  # the configs' own counts are examples (2 processes; multi_gpu.yaml 8)
        parts.append(f"--num_processes {args.num_gpus}")
    nodes = math.ceil(args.num_gpus / args.gpus_per_node)
    if nodes != machines:
        parts.append(f"--num_machines {nodes} --machine_rank MACHINE_RANK --main_process_ip MAIN_IP")
    parts.append(f"recipes/{tech.recipe}.py --task {args.task}")
    parts.append(f"--model_name_or_path {args.model_name_or_path}" if args.model_name_or_path
                 else f"--model_preset {args.model_preset}")
    parts.append(f"--per_device_train_batch_size {args.per_device_batch_size}")
    if args.task != "image-classification":
        parts.append(f"--max_seq_length {args.seq_len}")
    if precision != "fp32" and "--mixed_precision" not in tech.args:
        parts.append(f"--mixed_precision {precision}")
    if getattr(args, "weights_dtype", "fp32") != "fp32":  # the recipes' default is fp32 masters
        parts.append(f"--weights_dtype {args.weights_dtype}")
    parts.extend(tech.args)
    if tech.hsdp:  # shards inside a node, replicas across the nodes
        parts.append(f"--dp_shard_size {args.gpus_per_node}")
    if tech.offload == "nvme":  # the YAML cannot carry the path (Accelerate drops it): the recipe takes it as a flag
        parts.append("--nvme_path NVME_DIR")
    return " ".join([*parts, *extra])


NO_RECIPE = "no recipe: "  # a modelled layout no recipe in this checkout runs yet
CANNOT = "cannot run: "  # the rule table (or the model's shape) refuses it


def plan(spec: ModelSpec, args: argparse.Namespace) -> list[tuple[Prediction, list[str]]]:
    """Every (technique, precision) with the reasons it does not fit or cannot run (empty: it fits)."""
    usable = args.gpu_memory - args.reserve
    n = args.num_gpus
    per_node = getattr(args, "gpus_per_node", None) or n
    rows = []
    # A 16-bit checkpoint trains in 16 bits either way: its rows are --mixed_precision bf16 (DeepSpeed's and FSDP's
    # fp32 masters need it), or, for a recipe with its one precision, as loaded.
    free = ["bf16"] if spec.weight_bytes == 2 else ["fp32", "bf16"]
    facts = ModelFacts.of(spec)
    refused_inputs = input_refusals(spec, args)
    for tech in search_space(spec, n, per_node):
        if spec.weight_bytes == 2 and tech.name == "mixed_precision":
            continue  # weights already 16-bit: --mixed_precision bf16 is the baseline's bf16 row, listed once
        for precision in ([tech.precision] if tech.precision else free):
            if tech.sharding != "ddp" and n == 1 and tech.offload == "none":
                continue  # sharding over one device divides nothing
            if tech.loss_chunk and spec.task != "causal-lm":
                continue  # no vocabulary logits to chunk
            if tech.splits_sequence and (n == 1 or spec.task != "causal-lm"):
                continue  # nothing to split, or no causal-LM sequence to split
            if tech.tp and n < (2 if tech.tp < 0 else 2 * tech.tp):
                continue  # no group to split over; groups of 2 x data parallel needs 4 devices
            if tech.ep and n == 1:
                continue
            pred = predict(spec, tech, precision, n, args.per_device_batch_size, args.seq_len,
                           kernels=args.kernels, lora_r=args.lora_r, gpus_per_node=per_node)
            if tech.recipe == "activation_checkpointing":
                _least_recompute_that_fits(spec, pred, usable, args)
            why = []
            if not has_recipe(tech):
                why.append(NO_RECIPE + _no_recipe_reason(tech))
            if tech.recipe in recipes_support():  # its own start-up check: a command it would refuse is no plan
                why += [CANNOT + r for r in _refusals(tech, precision, n, spec.task, args.seq_len, facts)]
                why += [CANNOT + r for r in refused_inputs]
                if tech.paged and args.kernels != "cuda":
                    why.append(CANNOT + "--paged needs a CUDA device (unified memory); recipes/optim_8bit.py refuses "
                               "it elsewhere. Fix: drop --paged (plain AdamW8bit holds the same state on the device)")
            if pred.device_peak > usable:
                big = max((("weights", pred.weights), ("gradients", pred.grads), ("optimizer state", pred.optimizer),
                           ("activations", pred.activations), ("buffers", pred.buffers)), key=lambda kv: kv[1])
                why.append(f"needs {fmt(pred.device_peak)} per device, {fmt(usable)} usable; largest: {big[0]} "
                           f"{fmt(big[1])}")
            host_need = (pred.host + args.runtime_memory) * per_node
            if args.host_memory and host_need > args.host_memory:
                why.append(f"needs {fmt(host_need)} of host memory, {fmt(args.host_memory)} available")
            if pred.nvme and args.nvme_memory is not None and pred.nvme * per_node > args.nvme_memory:
                why.append(f"needs {fmt(pred.nvme * per_node)} on NVMe, {fmt(args.nvme_memory)} available")
            rows.append((pred, why))
    return rows


def input_refusals(spec: ModelSpec, args: argparse.Namespace) -> list[str]:
    """What every recipe refuses in the command's own values, whichever technique runs it (shared/core/models.py
    check_positions): tokens past the position embeddings would crash the first forward."""
    if getattr(args, "refused_inputs", None) is not None:  # resolve() ran the recipes' own checks
        return list(args.refused_inputs)
    out = []
    if spec.max_positions and spec.seq_tokens is None and args.seq_len > spec.max_positions:
        out.append(f"--max_seq_length {args.seq_len} exceeds the model's {spec.max_positions} positions (every recipe "
                   f"refuses it at start-up). Fix: --seq_len {spec.max_positions} or less")
    return out


def short_reason(text: str, limit: int = 100) -> str:
    """One short clause of a refusal, for the listing: the rule's reason without the combination it restates, its
    parenthesised evidence and its fix (--explain prints it whole)."""
    text = text.removeprefix(CANNOT).removeprefix(NO_RECIPE).split(". Fix:")[0]
    head, sep, tail = text.partition(": ")
    if sep and len(head) <= 60:  # "--optim X under FSDP: why": the row's name already says the combination
        text = tail
    while (shorter := re.sub(r"\s*\([^()]*\s[^()]*\)", "", text)) != text:  # keeps "(25)", drops explanations
        text = shorter
    text = text.split("; ")[0].strip()
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _least_recompute_that_fits(spec: ModelSpec, pred: Prediction, usable: float, args: argparse.Namespace) -> None:
    """Checkpoint fewer blocks, or selectively, when that fits too: less recompute for the memory there is."""
    b, seq = args.per_device_batch_size, args.seq_len
    w16 = spec.weight_bytes == 2
    full = activation_bytes(spec, b, seq, pred.precision, True, args.kernels, weights16=w16)
    rest = pred.device_peak - (full.saved + full.layer)  # what the checkpointing setting does not change
    fits = [o for o in recompute_options(spec, b, seq, pred.precision, args.kernels, weights16=w16)
            if o.every and o.activations <= usable - rest]  # every=0 is the baseline's row, not this recipe's
    if fits and fits[0].recompute < 1:
        choice = fits[0]
        pred.activations += choice.activations - (full.saved + full.layer)
        pred.recompute, pred.args = choice.recompute, choice.flags
        pred.notes.append(f"{' '.join(choice.flags)}: the least recompute that fits (about {choice.recompute:.0%} "
                          "of full checkpointing's); docs/checkpointing.md")


def _fastest_fit(spec: ModelSpec, args: argparse.Namespace, keep: Callable[[Technique], bool],
                 rows_of: Callable[[argparse.Namespace], list] | None = None) -> Prediction | None:
    fits = [p for p, why in (rows_of or functools.partial(plan, spec))(args) if not why and keep(p.technique)]
    return (rank(fits) or [None])[0]


def _largest_batch(spec: ModelSpec, args: argparse.Namespace, keep: Callable[[Technique], bool],
                   rows_of: Callable[[argparse.Namespace], list] | None = None, lo: int = 1
                   ) -> tuple[argparse.Namespace, Prediction] | None:
    """The largest per-device batch from lo up to the asked one at which a kept technique fits (memory grows with
    it)."""
    hi, best = args.per_device_batch_size, None
    while lo <= hi:
        mid = (lo + hi) // 2
        changed = argparse.Namespace(**{**vars(args), "per_device_batch_size": mid})
        found = _fastest_fit(spec, changed, keep, rows_of)
        if found:
            best, lo = (changed, found), mid + 1
        else:
            hi = mid - 1
    return best


MAX_GPUS = 1024


def nearest_fits(spec: ModelSpec, args: argparse.Namespace, full_only: bool = False
                 ) -> list[tuple[str, Prediction, argparse.Namespace]]:
    """When nothing fits (full_only: no full fine-tuning): for each kind of change, the nearest configuration that
    fits, as (the change, its prediction, the planner's arguments with the change made)."""
    batch = args.per_device_batch_size
    out = []
    memo: dict[tuple[int, int, int], list] = {}

    def rows_of(changed: argparse.Namespace) -> list:  # the searches below ask for the same shapes again
        key = (changed.per_device_batch_size, changed.num_gpus, changed.gpus_per_node)
        if key not in memo:
            memo[key] = plan(spec, changed)
        return memo[key]

    def smaller(changed: argparse.Namespace) -> str:
        b = changed.per_device_batch_size
        return "" if b == batch else f"--per_device_train_batch_size {b} instead of {batch}"

    def allowed(t: Technique) -> bool:
        return not (full_only and t.adapters)

    kinds: list[tuple[str, Callable[[Technique], bool]]] = [
        ("a smaller batch", lambda t: not t.checkpointing and t.offload == "none" and not t.adapters),
        ("activation checkpointing", lambda t: t.checkpointing and t.offload == "none" and allowed(t)),
        ("offload", lambda t: t.offload != "none" and allowed(t)),
    ]
    for kind, keep in kinds:
        found = _largest_batch(spec, args, keep, rows_of)
        if found:
            changed, pred = found
            words = [] if kind == "a smaller batch" else [f"{kind} ({pred.technique.name})"]
            out.append((" and ".join(w for w in (*words, smaller(changed)) if w), pred, changed))
    # More GPUs shrink only sharded states (ZeRO, FSDP): the fewest GPUs at which a sharded run fits a larger batch
    # than any change above does.
    best_batch = max((changed.per_device_batch_size for _, _, changed in out), default=0)
    n = args.num_gpus * 2
    while n <= MAX_GPUS and best_batch < batch:
        # One node grows with the GPUs; a multi-node job keeps its nodes' size and adds nodes.
        per_node = n if args.gpus_per_node == args.num_gpus else args.gpus_per_node
        more = argparse.Namespace(**{**vars(args), "num_gpus": n, "gpus_per_node": per_node})
        sharded = lambda t: t.sharding != "ddp" and allowed(t)  # noqa: E731
        at_least = argparse.Namespace(**{**vars(more), "per_device_batch_size": best_batch + 1})
        if _fastest_fit(spec, at_least, sharded, rows_of):  # one look before the search
            changed, pred = _largest_batch(spec, more, sharded, rows_of, lo=best_batch + 1)
            words = f"{n} GPUs instead of {args.num_gpus} ({pred.technique.name})"
            out.append((" and ".join(w for w in (words, smaller(changed)) if w), pred, changed))
            break
        n *= 2
    return out


def build_parser() -> argparse.ArgumentParser:
    from ..core.args import PRESETS

    p = argparse.ArgumentParser(prog="python -m shared.tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None,
                   help="Hub id or local directory; unset: --model_preset. Offline, a hub id of --list_models is read "
                        "from its built-in config.")
    p.add_argument("--model_preset", default="tiny", choices=PRESETS)
    p.add_argument("--task", default=None, choices=("text-classification", "causal-lm", "image-classification"),
                   help="Default: from the model type (gpt2 and the decoders: causal-lm, bert: text-classification, "
                        "vit: image).")
    p.add_argument("--vocab_size", type=int, default=None, help="Override the config's vocabulary.")
    p.add_argument("--num_labels", type=int, default=None)
    p.add_argument("--num_gpus", type=int, default=1, help="Devices (processes) in total.")
    p.add_argument("--gpus_per_node", type=int, default=None, help="Default: --num_gpus (one node).")
    p.add_argument("--gpu_memory", type=parse_memory, default=parse_memory("80GB"),
                   help="Per device, the card's capacity as sold and as nvidia-smi shows it: 80GB and 80GiB are both "
                        "read as 80 GiB (2^30 bytes each; an H100 80GB reports 81,559 MiB). MB / MiB, TB / TiB alike.")
    p.add_argument("--reserve", type=parse_memory, default=parse_memory("1GiB"),
                   help="Per device, not available to tensors: CUDA context, allocator fragmentation (GB = GiB).")
    p.add_argument("--host_memory", type=parse_memory, default=None,
                   help="Per node, as `free -g` shows it (GB = GiB); unset: not checked.")
    p.add_argument("--nvme_memory", type=parse_bytes, default=None,
                   help="Per node, as drives are sold: 1TB = 10^12 bytes (TiB: 2^40); unset: not checked.")
    p.add_argument("--runtime_memory", type=parse_memory, default=CPU_RUNTIME_BYTES,
                   help="Host memory of one training process before any model state (Python, torch, data).")
    p.add_argument("--weights_dtype", default="fp32", choices=("fp32", "bf16", "auto"),
                   help="The recipes' --weights_dtype (issue 33): fp32 (default) loads a 16-bit checkpoint as fp32 "
                        "master weights, trained under bf16 autocast with --mixed_precision bf16; bf16 trains the "
                        "weights in bf16 with no fp32 masters (and bf16 AdamW moments); auto: the checkpoint's dtype.")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--kernels", default="cuda", choices=("cuda", "cpu"),
                   help="Which kernels' saved tensors to count (attention, dropout masks): see docs/planner.md.")
    p.add_argument("--disable_dropout", action="store_true")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--top", type=int, default=8,
                   help="Rows shown per list (fits, does not fit), best first; 0: all.")
    p.add_argument("--explain", default=None, metavar="ROW",
                   help="One row in full (NAME or NAME:PRECISION as listed): its bytes, every rule it breaks with the "
                        "rule's fix, its command.")
    p.add_argument("--list_models", action="store_true", help="Print the built-in hub ids and stop.")
    return p


def resolve(argv: list[str] | None, prog: str = "python -m shared.tools.plan") -> tuple[argparse.Namespace, ModelSpec]:
    """The flags checked and the model's spec: what every planner command (this one, shared/tools/ladder.py) starts
    from."""
    quiet.silence_known_noise()  # before transformers loads torchao: its CUDA-only kernels' messages
    parser = build_parser()
    parser.prog = prog
    args = parser.parse_args(argv)
    for flag in ("num_gpus", "seq_len", "per_device_batch_size", "lora_r"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.top < 0:
        raise SystemExit(f"--top must be 0 (all) or more, got {args.top}")
    args.gpus_per_node = args.gpus_per_node or args.num_gpus
    if args.gpu_memory <= args.reserve:
        raise SystemExit(f"--gpu_memory {fmt(args.gpu_memory)} leaves nothing after --reserve {fmt(args.reserve)}.")
    config, args.task, source = load_config(args.model_name_or_path, args.model_preset, args.task, args.vocab_size,
                                            args.num_labels, args.trust_remote_code)
    args.refused_inputs = recipe_input_refusals(config, args.task, args.model_name_or_path or args.model_preset,
                                                args.seq_len)
    return args, with_weights_dtype(model_spec(config, args.task, source, args.disable_dropout), args.weights_dtype)


def recipe_input_refusals(config, task: str, name: str, seq_len: int) -> list[str]:
    """What every recipe refuses in the model and the command's own values before any work, by the recipes' own
    checks (shared/core/models.py, shared/core/datacheck.py): tokens past the position embeddings, a bidirectional
    encoder as a causal LM, a sequence with no room for text (the tokenizer's special tokens come on top)."""
    from ..core import datacheck
    from ..core.errors import InputError
    from ..core.models import check_fits_task, check_positions

    checks = [lambda: check_fits_task(config, task, name)]
    if task != "image-classification":  # images have fixed positions: --seq_len is not used
        checks += [lambda: check_positions(config, seq_len), lambda: datacheck.check_seq_length(seq_len, 0, task)]
    out = []
    for check in checks:
        try:
            check()
        except InputError as err:
            out.append(f"{str(err).rstrip('.')} (every recipe refuses it at start-up)")
    return out


def with_weights_dtype(spec: ModelSpec, weights_dtype: str) -> ModelSpec:
    """The spec as the recipes' --weights_dtype loads it: fp32 masters, bf16, or the checkpoint's own dtype (auto)."""
    import dataclasses

    bytes_ = {"fp32": 4, "bf16": 2}.get(weights_dtype, spec.checkpoint_bytes)
    return dataclasses.replace(spec, weight_bytes=bytes_, weights_dtype=weights_dtype)


def main(argv: list[str] | None = None) -> list[tuple[Prediction, list[str]]]:
    if "--list_models" in (argv if argv is not None else sys.argv[1:]):
        print("\n".join(sorted(KNOWN_CONFIGS, key=str.lower)))
        return []
    args, spec = resolve(argv)
    rows = plan(spec, args)
    if args.explain:
        explain(rows, args.explain, args, spec)
        return rows
    _print_header(spec, args)
    fits = [r for r in rows if not r[1]]
    full = [p for p, _ in fits if not p.technique.adapters]
    _print_fits(f"Fits, full fine-tuning ({len(full)}), fastest first (speed: relative step time, a prior):", full,
                args)
    adapters = [p for p, _ in fits if p.technique.adapters]
    _print_fits(f"Fits, LoRA / QLoRA adapters on a frozen base ({len(adapters)}), fastest first:", adapters, args)
    _print_unfit(rows, args)
    refused = input_refusals(spec, args)
    if refused:  # no change of batch, GPUs or technique makes the command acceptable
        print(f"\nNo command: {refused[0]}")
    elif not fits:
        nearest = nearest_fits(spec, args)
        if nearest:
            print("\nNothing fits as asked. The nearest configurations that fit, and the change each needs:")
            for change, pred, changed in nearest:
                print(f"  {change}: {fmt(pred.device_peak)} per device in {pred.prec}")
                _print_command(pred, changed)
        else:
            smallest = min((p for p, _ in plan(spec, argparse.Namespace(**{**vars(args), "per_device_batch_size": 1,
                                                                            "num_gpus": MAX_GPUS}))),
                           key=lambda p: p.device_peak)
            print(f"\nNothing fits, not even at batch 1 on {MAX_GPUS} GPUs with checkpointing or offload: the "
                  f"smallest need is {fmt(smallest.device_peak)} per device ({smallest.technique.name}). Use "
                  "devices with more memory (--gpu_memory), a shorter --seq_len, or a smaller model.")
    elif not full:
        nearest = nearest_fits(spec, args, full_only=True)
        if nearest:
            print("\nNo full fine-tuning fits as asked (the adapters above do). The nearest that fit:")
            for change, pred, changed in nearest:
                print(f"  {change}: {fmt(pred.device_peak)} per device in {pred.prec}")
                _print_command(pred, changed)
    return rows


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.1f}K"


def _print_header(spec: ModelSpec, args: argparse.Namespace) -> None:
    seq = spec.seq_tokens or args.seq_len
    moe = (f", {_count(spec.active_params)} active per token ({spec.experts} experts, {spec.experts_per_token} per "
           "token)" if spec.experts else "")
    print(f"model: {spec.name}  task: {args.task}  parameters: {_count(spec.num_params)}{moe} "
          f"({spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads"
          + (f", {spec.kv_heads} key/value heads" if spec.kv_heads and spec.kv_heads != spec.heads else "")
          + f", vocab {spec.vocab})")
    print(f"hardware: {args.num_gpus} device(s) of {fmt(args.gpu_memory)} ({fmt(args.reserve)} reserved)"
          + (f", {args.gpus_per_node} per node" if args.gpus_per_node != args.num_gpus else "")
          + f"; batch {args.per_device_batch_size} x {seq} tokens per device; kernels: {args.kernels}")
    if spec.weight_bytes == 2:
        print(f"weights: --weights_dtype {spec.weights_dtype}: trained in bf16 with no fp32 master copy (AdamW's "
              "moments in bf16 too) on DDP, tensor-parallel and FSDP-without-mixed-precision rows; FSDP with "
              "--mixed_precision bf16 and DeepSpeed keep fp32 masters")
    elif spec.checkpoint_bytes == 2:
        print(f"weights: published in 16 bits, loaded as fp32 master weights (--weights_dtype {spec.weights_dtype}); "
              "the bf16 rows train them under bf16 autocast. --weights_dtype bf16: no fp32 masters")
    if spec.max_positions and spec.seq_tokens is None and args.seq_len > spec.max_positions:
        print(f"WARNING: --seq_len {args.seq_len} exceeds the model's {spec.max_positions} positions: the recipes "
              f"refuse it (pass --seq_len {spec.max_positions} or less)")


TABLE = (f"{'technique':<36}{'prec':<6}{'weights':>11}{'grads':>11}{'optim':>11}{'activ':>11}{'buffers':>11}"
         f"{'PEAK/dev':>11}{'host/proc':>11}{'speed':>7}")


def _launch_key(t: Technique) -> tuple:
    """How a row is launched and what it trains: one row of each is listed (--top 0: all)."""
    return (t.sharding, t.offload, t.offload_params, t.tp, t.splits_sequence, t.ep, t.hsdp, t.load_in, t.lora)


def rank(preds: list[Prediction]) -> list[Prediction]:
    """Fastest first; between rows of one speed (to 1%), the fewer techniques combined, then the smaller peak."""
    return sorted(preds, key=lambda p: (round(p.speed, 2), p.parts, p.device_peak))


def _print_fits(title: str, preds: list[Prediction], args: argparse.Namespace) -> None:
    """The fastest fit of each launch (sharding, offload, parallel layout), fastest first; --top 0: every fit."""
    ranked = rank(preds)
    if args.top:
        seen: set[tuple] = set()
        ranked = [p for p in ranked if not (_launch_key(p.technique) in seen or seen.add(_launch_key(p.technique)))]
        ranked = ranked[:args.top]
    more = (f"; the fastest of each launch shown, {len(ranked)} (--top 0: all)" if len(ranked) < len(preds) else "")
    print(f"\n{title[:-1]}{more}:" if more else f"\n{title}")
    if not preds:
        return
    print(TABLE)
    noted: set[str] = set()
    for pred in ranked:
        t = pred.technique
        print(f"{t.name:<36}{pred.prec:<6}{fmt(pred.weights):>11}{fmt(pred.grads):>11}"
              f"{fmt(pred.optimizer):>11}{fmt(pred.activations):>11}{fmt(pred.buffers):>11}"
              f"{fmt(pred.device_peak):>11}{fmt(pred.host):>11}{pred.speed:>7.2f}")
        _print_command(pred, args, skip_notes=noted)
        noted.update(pred.notes)


def _print_unfit(rows: list[tuple[Prediction, list[str]]], args: argparse.Namespace) -> None:
    """The rows that do not fit (nearest first), those that cannot run (one short reason each, grouped), and the
    modelled layouts without a recipe in this checkout."""
    import textwrap

    pending = [(p, why) for p, why in rows if why and why[0].startswith(NO_RECIPE)]
    cannot = [(p, why) for p, why in rows if any(w.startswith(CANNOT) for w in why) and (p, why) not in pending]
    unfit = sorted(((p, why) for p, why in rows if why and not any(w.startswith((CANNOT, NO_RECIPE)) for w in why)),
                   key=lambda r: r[0].device_peak)
    shown = unfit[:args.top] if args.top else unfit
    more = f"; the {len(shown)} nearest shown (--top 0: all)" if len(shown) < len(unfit) else ""
    print(f"\nDoes not fit ({len(unfit)}), nearest first{more}:")
    for pred, why in shown:
        print(f"  {pred.technique.name:<36}{pred.prec:<6}{'; '.join(why)}")
    print(f"\nCannot run ({len(cannot)}): one short reason each; the rule in full and its fix: --explain ROW")
    groups: dict[str, list[str]] = {}
    for pred, why in cannot:
        groups.setdefault(short_reason(next(w for w in why if w.startswith(CANNOT))), []).append(pred.row)
    for reason, names in groups.items():
        print(f"  {CANNOT}{reason}:")
        many = args.top and len(names) > 3 * args.top  # a refusal of (nearly) every row: a few names and the count
        listed = ", ".join(names[:args.top] if many else names) + (f" and {len(names) - args.top} more (--top 0: "
                                                                   "all)" if many else "")
        print(textwrap.fill(listed, width=118, initial_indent="      ", subsequent_indent="      "))
    if pending:
        print(f"\nModelled, no recipe in this checkout ({len(pending)}): no command to print")
        for pred, why in pending:
            need = next((w for w in why if w.startswith("needs")), f"fits: {fmt(pred.device_peak)} per device")
            refused = next((w for w in why if w.startswith(CANNOT)), "")
            print(f"  {pred.technique.name:<36}{pred.prec:<6}"
                  f"{CANNOT + short_reason(refused) if refused else need}; {short_reason(why[0])}")


def explain(rows: list[tuple[Prediction, list[str]]], row: str, args: argparse.Namespace, spec: ModelSpec) -> None:
    """--explain ROW: the row's figures, every reason in full (the rule table's words and fixes), its command."""
    import difflib

    found = [(p, why) for p, why in rows if row in (p.row, p.technique.name)]
    if not found:
        names = sorted({p.row for p, _ in rows})
        close = difflib.get_close_matches(row, names, n=5, cutoff=0.4)
        raise SystemExit(f"--explain {row!r}: no such row for this model and hardware. Pass NAME or NAME:PRECISION "
                         f"as listed" + (f", e.g. {', '.join(close)}" if close else "") + ".")
    usable = args.gpu_memory - args.reserve
    for pred, why in found:
        t = pred.technique
        print(f"{pred.row}: recipes/{t.recipe or '(none)'}.py under accelerate_configs/{config_file(t, args.num_gpus)}"
              + (f", flags {' '.join(t.args)}" if t.args else ""))
        for label, value in (("weights", pred.weights), ("gradients", pred.grads), ("optimizer state",
                             pred.optimizer), ("activations", pred.activations), ("buffers", pred.buffers)):
            print(f"  {label:<16}{fmt(value):>12}")
        print(f"  {'peak per device':<16}{fmt(pred.device_peak):>12}  of {fmt(usable)} usable (the sum of the "
              "terms: an upper bound, as backward frees activations while gradients appear and the optimizer's "
              "temporaries come after both)")
        host = fmt(pred.host + args.runtime_memory)
        print(f"  {'host per process':<16}{host:>12}  (runtime {fmt(args.runtime_memory)} included)"
              + (f"; NVMe {fmt(pred.nvme)}" if pred.nvme else ""))
        print(f"  speed {pred.speed:.2f} (relative step time, a prior); trainable parameters {_count(pred.trainable)}")
        print("  verdict: " + ("fits" if not why else "does not fit or cannot run:"))
        for reason in why:
            print(f"    - {reason}")
        for note in pred.notes:
            print(f"  note: {note}")
        if has_recipe(t):
            print(f"  command{' (refused as it is)' if any(w.startswith(CANNOT) for w in why) else ''}:")
            _print_command(pred, args)


def _print_command(pred: Prediction, args: argparse.Namespace, skip_notes: set[str] | None = None) -> None:
    """The command under a planned row, what to fill in it, and what the checkout lacks to run it (skip_notes: the
    notes already printed above it)."""
    t = pred.technique
    line = command(t, pred.precision, args, pred.args)
    root = CONFIGS.parent
    missing = [f for f in (f"recipes/{t.recipe}.py", f"accelerate_configs/{config_file(t, args.num_gpus)}")
               if not (root / f).exists()]
    print(f"    {line}" + (f"   [not in this checkout: {', '.join(missing)}]" if missing else ""))
    for name, meaning in PLACEHOLDERS.items():
        if name in line.split():
            print(f"    fill in {name}: {meaning}")
    for note in pred.notes:
        if note not in (skip_notes or ()):
            print(f"    note: {note}")


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)


__all__ = ["ModelSpec", "Technique", "TECHNIQUES", "COMBINED", "Prediction", "predict", "activation_bytes",
           "decoder_layer_bytes", "Recompute", "recompute_options", "least_recompute", "adam_state_bytes",
           "zero_model_state_bytes", "nf4_bytes", "int8_bytes", "load_config", "model_spec", "plan", "command",
           "nearest_fits", "search_space", "short_reason", "explain", "main", "KNOWN_CONFIGS"]
