"""Memory planner: which recipe and launch config fits a model on given hardware, predicted from the model's config.

    python -m shared.tools.plan --model_name_or_path gpt2-xl --num_gpus 8 --gpu_memory 80GB --seq_len 1024 \\
        --per_device_batch_size 8

The model is built on the meta device (no weights are allocated or downloaded). For every technique combination the
planner predicts bytes per device (weights, gradients, optimizer state, activations, working buffers) and on the
host (offloaded states, runtime), ranks what fits by expected speed and prints the `accelerate launch` command of the
recipe and config that runs it, as it runs: the process count, only recipes that accept it (shared/core/rules.py), and
placeholders (NVME_DIR, ...) to fill. When nothing fits it names the nearest changes that would (a smaller batch,
activation checkpointing, offload, more GPUs). The formulas, and what was checked against measurement, are in
docs/planner.md.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core import quiet, rules

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
    family: str  # bert | gpt2 | vit | generic: which activation accounting applies
    tensor_numels: list[int]  # every parameter tensor once (tied weights once)
    linear_weights: list[tuple[int, int, int]]  # (in, out, numel) of Linear / Conv1D weights bnb would quantize
    head_weight_numel: int  # the output head's weight (lm_head / classifier): kept in 16 bits when quantizing
    lora_targets: list[tuple[int, int]]  # (in, out) of the modules LoRA adapts: PEFT's "all-linear", as the recipes
    head_numel: int  # parameters of the head PEFT trains beside the adapters (modules_to_save)
    layer_params: int  # one transformer block
    block_linear_numel: int  # Linear / Conv1D weights inside the transformer blocks
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

    @property
    def num_params(self) -> int:
        return sum(self.tensor_numels)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_numels)


# Published configs of a few well-known hub models, used when the id is not in the local HF cache (this project's CI
# is offline, and a hub lookup that cannot succeed retries for half a minute). Values from each config.json.
KNOWN_CONFIGS: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", {}),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25)),
    "bert-base-uncased": ("bert", {}),
    "bert-large-uncased": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                        intermediate_size=4096)),
    "google/vit-base-patch16-224": ("vit", {}),
    "google/vit-large-patch16-224": ("vit", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                 intermediate_size=4096)),
}
TASK_OF_MODEL_TYPE = {"gpt2": "causal-lm", "bert": "text-classification", "vit": "image-classification"}
# PEFT's default LoRA target modules for these families (peft.utils.constants).


def builtin_vocab_size(task: str, preset: str) -> int:
    """The vocabulary the recipes give a preset on the built-in data (shared/core/tasks.py): the local word tokenizer's,
    raised to BERT's 30522 for the base preset."""
    if task == "image-classification":
        return 30522
    from ..core import data

    n = len(data.build_word_tokenizer(data.builtin_split(task, "train")["text"], task))
    return n if preset == "tiny" else max(n, 30522)


def load_config(name: str | None, preset: str, task: str | None, vocab_size: int | None, num_labels: int | None,
                trust_remote_code: bool = False):
    """(config, task, source) from a preset, a local directory or a hub id; the offline fallback is KNOWN_CONFIGS."""
    from transformers import AutoConfig, BertConfig, GPT2Config, ViTConfig

    from ..core.models import preset_config

    if name is None:
        task = task or "text-classification"
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
            if name in KNOWN_CONFIGS:
                kind, dims = KNOWN_CONFIGS[name]
                config = {"gpt2": GPT2Config, "bert": BertConfig, "vit": ViTConfig}[kind](**dims)
                source = f"{name} (built-in copy of its published config.json)"
    if config is None:
        try:
            config, source = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), name
        except (OSError, ValueError) as err:
            raise SystemExit(f"Could not read the config of {name!r} ({err.__class__.__name__}: "
                             f"{str(err).splitlines()[0][:200]}). Pass a local directory holding config.json, "
                             f"a reachable hub id, one of {sorted(KNOWN_CONFIGS)}, or --model_preset.") from None
    task = task or TASK_OF_MODEL_TYPE.get(config.model_type)
    if task is None:
        raise SystemExit(f"Cannot tell the task of model type {config.model_type!r}: pass --task.")
    if vocab_size:
        config.vocab_size = vocab_size
    if num_labels:
        config.num_labels = num_labels
    return config, task, source


def model_spec(config, task: str, name: str, disable_dropout: bool = False) -> ModelSpec:
    """Build the model on the meta device (nothing allocated) and read what the formulas need from it."""
    import torch
    from torch import nn
    from transformers.modeling_utils import set_zero3_state
    from transformers.pytorch_utils import Conv1D

    from ..core.models import AUTO_CLASSES, HEAD_NAMES, transformer_layers  # the heads bnb leaves unquantized

    # Outside ZeRO-3's zero.Init, which transformers enters for every model built while a ZeRO-3 run is set up (the
    # preflight of one): under it these meta tensors would be partitioned to 1-D shards of the real shapes, and
    # its weight initialization copies out of them.
    with torch.device("meta"), set_zero3_state():
        model = AUTO_CLASSES[task].from_config(config)
    family = config.model_type if config.model_type in ("bert", "gpt2", "vit") else "generic"
    params = list(model.named_parameters())  # tied weights appear once
    linear, lora, head_weight, head, conv = [], [], 0, 0, 0
    block = transformer_layers(model)[0]
    block_ids = {id(m) for layer in transformer_layers(model) for m in layer.modules()}
    block_linear = 0
    for mname, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            conv += module.weight.numel()
            continue
        if isinstance(module, nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif isinstance(module, Conv1D):
            fan_in, fan_out = module.weight.shape
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
    if disable_dropout:
        hidden_dropout = attention_dropout = embedding_dropout = 0.0
    seq_tokens = None
    if family == "vit":
        seq_tokens = (cfg.image_size // cfg.patch_size) ** 2 + 1
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


def adam_state_bytes(numels: list[int], eight_bit: bool = False, step_tensor: bool = True) -> float:
    """AdamW's state over the trainable tensors. 32-bit: exp_avg and exp_avg_sq in fp32 (8 B/param) plus torch's
    4-byte `step` tensor per parameter tensor. bitsandbytes 8-bit: uint8 moments (2 B/param) and two fp32 absmax
    per block of 256; tensors under 4096 elements keep 32-bit state (min_8bit_size)."""
    total = 0.0
    for n in numels:
        if eight_bit and n >= 4096:
            total += 2 * n + 2 * 4 * math.ceil(n / 256) + 4
        else:
            total += 8 * n + (4 if step_tensor else 0)
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
                     selective: bool = False, loss_chunk: int = 0) -> Activations:
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
    Checkpointing (HF, non-reentrant): a block keeps only its input (E h residual); in backward one block at a
    time is recomputed, so `layer` is added back at peak. `checkpoint_every` K: only blocks K, 2K, ... are
    checkpointed (L // K of them), the others keep all of the above. `selective` (op-level, recipes/
    activation_checkpointing.py's keep_matmuls): a checkpointed block keeps its input and its matmul and attention
    outputs: QKV 3 E h, out-projection E h, MLP-in E I, MLP-out E h (Linear outputs' dtype), and the attention
    output, E h + the log-sum-exp b a s fp32 (flash) or the scores b a s^2 + E h (math kernel).
    """
    s = spec.seq_tokens or seq
    if s is None:
        raise ValueError("seq_len is needed for this model")
    b, h, i_, a, n_layers = batch, spec.hidden, spec.intermediate, spec.heads, spec.layers
    e = b * s
    half = precision in ("bf16", "fp16")
    res_b = 4  # residual stream / LayerNorm inputs: fp32 under autocast
    lin_b = 2 if half else 4
    attn_b = 4 if (not half or kernels == "cpu") else 2

    def mask_b(dtype_bytes: int) -> int:
        return 1 if kernels == "cuda" else dtype_bytes

    math_attention = kernels == "cpu" and spec.attention_dropout > 0
    per_layer = 2 * e * h * res_b + 4 * e * 4  # LayerNorm inputs + stats
    per_layer += 2 * e * h * lin_b + e * i_ * lin_b  # QKV-in, MLP-in, MLP-out inputs
    per_layer += (4 if spec.activation == "gelu_new" else 1) * e * i_ * lin_b
    if math_attention:
        per_layer += 3 * e * h * attn_b + e * h * lin_b + 3 * b * a * s * s * attn_b
    else:
        # the flash kernels take 16-bit inputs as they are: q, k, v, out in the Linear outputs' dtype
        per_layer += 4 * e * h * lin_b + b * a * s * 4
    if spec.hidden_dropout > 0:
        per_layer += 2 * e * h * mask_b(lin_b)
    if half and spec.family != "gpt2":
        per_layer += 2 * e * h * lin_b  # measured: separate q/k/v projections keep 2 more 16-bit E h under autocast

    # autocast's 16-bit weight copies: of the blocks' Linear layers, and of the layers outside them (head, pooler,
    # patch convolution) which checkpointing does not recompute
    block16 = 2 * spec.block_linear_numel if half else 0.0
    outer16 = 2 * (spec.all_linear_numel - spec.block_linear_numel) if half else 0.0

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
        kept += 5 * e * h * lin_b + e * i_ * lin_b
        kept += (b * a * s * s + e * h) * attn_b if math_attention else e * h * lin_b + b * a * s * 4
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


# Selective checkpointing recomputes LayerNorm, GELU, adds and reshapes, not the matmuls: a prior for its extra step
# time as a share of full checkpointing's, from one noisy BERT-base reading (x1.10 vs x1.36 on a shared 2-core CPU);
# not yet measured on a quiet machine or a GPU (docs/checkpointing.md).
SELECTIVE_RECOMPUTE = 0.3


def recompute_options(spec: ModelSpec, batch: int, seq: int | None, precision: str = "fp32",
                      kernels: str = "cuda") -> list[Recompute]:
    """Every distinct setting, least recompute first: none, full on L // K blocks for K = L .. 1, selective."""
    n_layers = spec.layers
    none = activation_bytes(spec, batch, seq, precision, False, kernels)
    options = [Recompute(0, False, none.saved, 0.0)]
    for every in range(n_layers, 0, -1):
        if every < n_layers and n_layers // every == n_layers // (every + 1):
            continue  # the same number of blocks as a larger K: as much recompute, no less memory
        act = activation_bytes(spec, batch, seq, precision, True, kernels, every)
        options.append(Recompute(every, False, act.saved + act.layer, (n_layers // every) / n_layers))
    act = activation_bytes(spec, batch, seq, precision, True, kernels, 1, selective=True)
    options.append(Recompute(1, True, act.saved + act.layer, SELECTIVE_RECOMPUTE))
    return sorted(options, key=lambda o: (o.recompute, o.activations))


def least_recompute(spec: ModelSpec, batch: int, seq: int | None, budget: float, precision: str = "fp32",
                    kernels: str = "cuda") -> Recompute | None:
    """The setting that recomputes least among those whose activations fit in `budget` bytes; None: none fits."""
    return next((o for o in recompute_options(spec, batch, seq, precision, kernels) if o.activations <= budget), None)


def sequence_parallel_activations(spec: ModelSpec, batch: int, seq: int, n: int, precision: str = "fp32",
                                  kernels: str = "cuda") -> Activations:
    """Per process under Ulysses sequence parallel over n processes (recipes/sequence_parallel.py).

    Every per-token tensor holds the chunk's seq/n tokens; attention keeps q, k, v and out of the whole sequence for
    heads/n, the same bytes as seq/n tokens of all heads (and the flash kernels' log-sum-exp, b a/n s). So: one
    process's activations at seq/n, plus in each block the all-to-all's output, kept as the out-projection's input
    (E/n h, Linear dtype), and the loss's log-softmax of every position of the chunk (the whole sequence's drops its
    last). The math kernel (CPU, attention dropout) keeps b a/n s^2 per score tensor, not b a (s/n)^2.
    """
    chunk = seq // n
    act = activation_bytes(spec, batch, chunk, precision, False, kernels)
    lin_b = 2 if precision in ("bf16", "fp16") else 4
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
    recipe: str  # a key of shared/core/rules.py's RECIPES
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


TECHNIQUES: list[Technique] = [
    Technique("baseline", "baseline", None),
    Technique("mixed_precision", "mixed_precision", None, precision="bf16", args=("--mixed_precision", "bf16")),
    Technique("activation_checkpointing", "activation_checkpointing", None, checkpointing=True),
    Technique("optim_8bit", "optim_8bit", None, optimizer="adamw_bnb_8bit"),
    Technique("optim_4bit", "optim_low_bit", None, optimizer="adamw_torchao_4bit",
              args=("--optim", "adamw_torchao_4bit")),
    Technique("optim_fp8", "optim_low_bit", None, optimizer="adamw_torchao_fp8", args=("--optim", "adamw_torchao_fp8")),
    Technique("optimizer_in_backward", "optimizer_in_backward", None, optimizer="adamw_in_backward"),
    Technique("zero1", "zero", "zero1.yaml", sharding="zero1"),
    Technique("zero2", "zero", "zero2.yaml", sharding="zero2"),
    Technique("zero3", "zero", "zero3.yaml", sharding="zero3", speed=1.15),
    Technique("zero2_offload", "zero3_offload", "zero2_offload.yaml", sharding="zero2", offload="cpu", speed=1.6),
    Technique("zero3_offload", "zero3_offload", "zero3_offload.yaml", sharding="zero3", offload="cpu",
              offload_params=True, speed=2.5),
    Technique("zero3_nvme", "zero3_offload", "zero3_nvme.yaml", sharding="zero3", offload="nvme", offload_params=True,
              speed=4.0),
    Technique("fsdp", "fsdp", "fsdp.yaml", sharding="fsdp", speed=1.15),
    Technique("fsdp_offload", "fsdp", "fsdp_offload.yaml", sharding="fsdp", offload="cpu", offload_params=True,
              speed=2.5),
    Technique("qlora_8bit", "qlora", None, precision="bf16", load_in="8bit", args=("--load_in", "8bit"), speed=1.6),
    Technique("qlora_4bit", "qlora", None, precision="bf16", load_in="4bit", args=("--load_in", "4bit"), speed=1.2),
    # DoRA's step: 1.33x LoRA's (benchmarks/dora.py, docs/dora.md)
    Technique("qlora_4bit_dora", "qlora", None, precision="bf16", load_in="4bit", dora=True,
              args=("--load_in", "4bit", "--use_dora"), speed=1.6),
    Technique("chunked_loss", "chunked_loss", None, loss_chunk=1024),
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


@dataclass
class Prediction:
    technique: Technique
    precision: str
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0  # gathered shards, optimizer temporaries, logits at the loss
    host: float = 0.0  # per process, offloaded states
    nvme: float = 0.0  # per process
    trainable: int = 0
    notes: list[str] = field(default_factory=list)
    recompute: float = 1.0  # under checkpointing: the share of the blocks' forward recomputed (Recompute)
    args: tuple[str, ...] = ()  # the recipe flags the planner chose (the checkpointing setting)

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

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
        return t.speed * PRECISION_SPEED[self.precision] * recompute


# ---------------------------------------------------------------- tensor parallel, and tensor x data parallel


def tensor_parallel_bytes(spec: ModelSpec, tp: int, dp: int = 1, shard_vocab: bool = False) -> dict[str, float]:
    """Per-device fp32 parameter, gradient and AdamW-state bytes of recipes/tensor_parallel.py on a (dp, tp) mesh.

    Megatron's split (shared/techniques/tensor_parallel.py PLANS): every block's Linear weights and its column-wise
    biases (q, k, v and the MLP's up projection) hold 1/tp; the row-wise biases, norms, embeddings and head are whole on
    each process of a TP group (--shard_vocab: the [vocab, hidden] embedding, tied to the head, 1/tp too). dp > 1: FSDP2
    then splits everything by dp (evenly: its padding is under a row per tensor)."""
    split = spec.block_linear_numel + spec.layers * (3 * spec.hidden + spec.intermediate)
    if shard_vocab:
        split += spec.vocab * spec.hidden
    per_device = (split / tp + (spec.num_params - split)) / dp
    return {"param_bytes": 4 * per_device, "grad_bytes": 4 * per_device,
            "optimizer_state_bytes": 8 * per_device + 4 * spec.num_tensors}  # exp_avg, exp_avg_sq; a 4-byte step


def predict(spec: ModelSpec, tech: Technique, precision: str, num_devices: int, batch: int, seq: int | None,
            kernels: str = "cuda", lora_r: int = 8) -> Prediction:
    """Bytes per device (and per process on the host / NVMe) of one training step with this technique."""
    n = num_devices
    p = Prediction(tech, precision)
    numels = spec.tensor_numels
    psi = spec.num_params
    half = precision in ("bf16", "fp16")
    deepspeed = tech.sharding.startswith("zero")
    stage = int(tech.sharding[-1]) if deepspeed else (3 if tech.sharding == "fsdp" else 0)
    act = (sequence_parallel_activations(spec, batch, seq, n, precision, kernels) if tech.splits_sequence
           else activation_bytes(spec, batch, seq, precision, tech.checkpointing, kernels, loss_chunk=tech.loss_chunk))

    if tech.load_in != "full":  # QLoRA: quantized frozen base, 16-bit rest, fp32 LoRA adapters trained
        qbytes = sum(nf4_bytes(num) if tech.load_in == "4bit" else int8_bytes(num, out)
                     for _, out, num in spec.linear_weights)
        other = psi - sum(num for _, _, num in spec.linear_weights)
        adapters = [lora_r * (i + o) for i, o in spec.lora_targets]
        magnitudes = [o for _, o in spec.lora_targets] if tech.dora else []  # DoRA: one per adapted output
        trainable = [*adapters, *magnitudes, *([spec.head_numel] if spec.head_numel else [])]
        p.trainable = sum(trainable)
        p.weights = qbytes + 2 * other + 4 * p.trainable
        p.grads = 4 * p.trainable
        p.optimizer = adam_state_bytes(trainable, eight_bit=tech.optimizer == "adamw_bnb_8bit")
        p.activations = act.saved - act.weight_copies + 2 * sum(num for _, _, num in spec.linear_weights) / 16
        p.notes.append(f"{'DoRA' if tech.dora else 'LoRA'} r={lora_r} on {len(spec.lora_targets)} modules ("
                       "all-linear); activations counted as full fine-tuning's (an upper bound"
                       + ("; DoRA's weight norms, one dequantized weight at a time, are not counted)" if tech.dora
                          else ")"))
    elif tech.tp:
        # Megatron's split: the block matrices 1/tp, the rest whole in a group; FSDP2 then divides all by dp.
        tp = n if tech.tp < 0 else tech.tp
        states = tensor_parallel_bytes(spec, tp, max(1, n // tp))
        p.trainable = psi
        p.weights, p.grads, p.optimizer = (states[k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
        p.activations = act.saved  # counted whole: an upper bound (the heads and the MLP's inner width are 1/tp)
        p.notes.append(f"tensor parallel {tp} x data parallel {max(1, n // tp)}; activations counted unsplit")
        if n // tp > 1:
            p.buffers += 2 * 4 * spec.layer_params / tp  # FSDP2 gathers a block's TP shard, and prefetches the next
    elif deepspeed:
        # DeepSpeed keeps 16-bit (or fp32) weights and gradients, and inside the optimizer an fp32 copy of its
        # partition beside m and v: K=12 in fp32 too (ZeRO clones the partition even when the model is fp32;
        # measured: optimizer state 1.50x the 8 bytes/param of AdamW alone, ZeRO-2, 2 processes). Plus, in mixed
        # precision, as its own estimator counts, an fp32 gradient partition for the optimizer.
        w = 2 if half else 4
        k = 12
        p.trainable = psi
        shard_w, shard_g, shard_o = (n if stage >= 3 else 1), (n if stage >= 2 else 1), n
        p.weights = w * psi / shard_w
        p.grads = w * psi / shard_g + (4 * psi / n if half else 0)
        p.optimizer = k * psi / shard_o
        p.activations = act.saved - act.weight_copies  # DeepSpeed casts the model itself: no autocast copies
        if stage == 3:
            p.buffers += 2 * w * max(spec.layer_params, max(numels))  # gathered block + the prefetched one
        if tech.offload != "none":
            off = p.optimizer + (4 * psi / n if half else 0)
            p.optimizer, p.grads = 0.0, p.grads - (4 * psi / n if half else 0)
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
            p.grads = w * psi  # ZeRO-Offload keeps the 16-bit gradients on the device
    else:
        # Accelerate: fp32 weights, fp32 gradients, torch AdamW; autocast keeps 16-bit weight copies (in activations)
        p.trainable = psi
        shard = n if tech.sharding == "fsdp" else 1
        p.weights = 4 * psi / shard
        p.grads = 4 * psi / shard
        eight = tech.optimizer == "adamw_bnb_8bit"
        if tech.optimizer in TORCHAO_STATES:
            p.optimizer = torchao_adam_state_bytes(numels, tech.optimizer) / shard
        else:
            p.optimizer = adam_state_bytes(numels, eight_bit=eight) / shard
        if tech.optimizer == "adamw_in_backward":  # each gradient is freed in its hook once its parameter has stepped
            p.grads = 4 * max(numels)
        p.activations = act.saved
        if tech.sharding == "fsdp":
            p.activations -= act.weight_copies  # FSDP's mixed precision gathers 16-bit blocks instead
            p.buffers += 2 * (2 if half else 4) * max(spec.layer_params, max(numels))
        if tech.offload_params:
            p.host += p.weights + p.grads + p.optimizer
            p.weights = p.grads = p.optimizer = 0.0
        if tech.optimizer == "adamw" and tech.sharding == "ddp":
            # torch's AdamW on CUDA is the foreach kernel: it takes sqrt(exp_avg_sq) of all tensors at once
            # (one fp32 copy of the parameters); on CPU the per-tensor loop holds 2 copies of the largest tensor.
            p.buffers += 4 * psi if kernels == "cuda" else 8 * max(numels)
        if tech.sharding == "ddp" and n > 1:
            p.buffers += min(4 * psi, 25 * MiB * 2)  # DDP's gradient buckets (25 MB)
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


def parse_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 80GB, 24GiB, 512MB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return value * scale[unit]


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


def compat_run(tech: Technique, precision: str, num_processes: int, task: str = "", seq_len: int = 0
               ) -> rules.Run:
    """The technique as shared/core/rules.py's rule table describes a run: what the recipe would check at start-up
    (task and seq_len: for the rules that read them; the recipes' default packing, concat, for a causal LM)."""
    sharding = tech.sharding if tech.sharding != "ddp" else ("ddp" if num_processes > 1 else "none")
    return rules.Run(recipe=tech.recipe, sharding=sharding, launched=sharding, offload=tech.offload,
                      num_processes=num_processes, precision="no" if precision == "fp32" else precision,
                      load_in=tech.load_in, lora=tech.load_in != "full", dora=tech.dora, optimizer=tech.optimizer,
                      task=task, seq_len=seq_len, packing="concat" if task == "causal-lm" else "none",
                      tensor_parallel_size=max(0, tech.tp))


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
    parts.extend(tech.args)
    if tech.offload == "nvme":  # the YAML cannot carry the path (Accelerate drops it): the recipe takes it as a flag
        parts.append("--nvme_path NVME_DIR")
    return " ".join([*parts, *extra])


def plan(spec: ModelSpec, args: argparse.Namespace) -> list[tuple[Prediction, list[str]]]:
    """Every (technique, precision) with the reasons it does not fit or cannot run (empty: it fits)."""
    usable = args.gpu_memory - args.reserve
    rows = []
    for tech in TECHNIQUES:
        for precision in ([tech.precision] if tech.precision else ["fp32", "bf16"]):
            if tech.sharding != "ddp" and args.num_gpus == 1 and tech.offload == "none":
                continue  # sharding over one device divides nothing
            if tech.loss_chunk and spec.task != "causal-lm":
                continue  # no vocabulary logits to chunk
            if tech.splits_sequence and (args.num_gpus == 1 or spec.task != "causal-lm"):
                continue  # nothing to split, or no causal-LM sequence to split
            if tech.tp and args.num_gpus < (2 if tech.tp < 0 else 2 * tech.tp):
                continue  # no group to split over; groups of 2 x data parallel needs 4 devices
            pred = predict(spec, tech, precision, args.num_gpus, args.per_device_batch_size, args.seq_len,
                           kernels=args.kernels, lora_r=args.lora_r)
            if tech.recipe == "activation_checkpointing":
                _least_recompute_that_fits(spec, pred, usable, args)
            # The recipe's own start-up check: a command it would refuse is not a plan (e.g. fsdp.py in 1 process).
            run = compat_run(tech, precision, args.num_gpus, spec.task, args.seq_len)
            why = [f"cannot run: {r}" for r in rules.refusals(run)]
            if tech.splits_sequence and spec.heads % args.num_gpus:  # checked by the recipe once the model loads
                why.append(f"cannot run: the model's {spec.heads} heads do not split over {args.num_gpus} devices")
            tp = args.num_gpus if tech.tp < 0 else tech.tp
            if tech.tp and (spec.heads % tp or spec.intermediate % tp):  # the recipe's own check, once it loads
                why.append(f"cannot run: the model's {spec.heads} heads and MLP width {spec.intermediate} do not "
                           f"split over a tensor-parallel group of {tp}")
            if pred.device_peak > usable:
                big = max((("weights", pred.weights), ("gradients", pred.grads), ("optimizer state", pred.optimizer),
                           ("activations", pred.activations), ("buffers", pred.buffers)), key=lambda kv: kv[1])
                why.append(f"needs {fmt(pred.device_peak)} per device, {fmt(usable)} usable; largest: {big[0]} "
                           f"{fmt(big[1])}")
            host_need = (pred.host + args.runtime_memory) * args.gpus_per_node
            if args.host_memory and host_need > args.host_memory:
                why.append(f"needs {fmt(host_need)} of host memory, {fmt(args.host_memory)} available")
            if pred.nvme and args.nvme_memory is not None and pred.nvme * args.gpus_per_node > args.nvme_memory:
                why.append(f"needs {fmt(pred.nvme * args.gpus_per_node)} on NVMe, {fmt(args.nvme_memory)} available")
            rows.append((pred, why))
    return rows


def _least_recompute_that_fits(spec: ModelSpec, pred: Prediction, usable: float, args: argparse.Namespace) -> None:
    """Checkpoint fewer blocks, or selectively, when that fits too: less recompute for the memory there is."""
    b, seq = args.per_device_batch_size, args.seq_len
    full = activation_bytes(spec, b, seq, pred.precision, True, args.kernels)
    rest = pred.device_peak - (full.saved + full.layer)  # what the checkpointing setting does not change
    fits = [o for o in recompute_options(spec, b, seq, pred.precision, args.kernels)
            if o.every and o.activations <= usable - rest]  # every=0 is the baseline's row, not this recipe's
    if fits and fits[0].recompute < 1:
        choice = fits[0]
        pred.activations += choice.activations - (full.saved + full.layer)
        pred.recompute, pred.args = choice.recompute, choice.flags
        pred.notes.append(f"{' '.join(choice.flags)}: the least recompute that fits (about {choice.recompute:.0%} "
                          "of full checkpointing's); docs/checkpointing.md")


def _fastest_fit(spec: ModelSpec, args: argparse.Namespace, keep: Callable[[Technique], bool]) -> Prediction | None:
    fits = [p for p, why in plan(spec, args) if not why and keep(p.technique)]
    return min(fits, key=lambda p: (p.speed, p.device_peak), default=None)


def _largest_batch(spec: ModelSpec, args: argparse.Namespace, keep: Callable[[Technique], bool]
                   ) -> tuple[argparse.Namespace, Prediction] | None:
    """The largest per-device batch up to the asked one at which a kept technique fits (memory grows with it)."""
    lo, hi, best = 1, args.per_device_batch_size, None
    while lo <= hi:
        mid = (lo + hi) // 2
        changed = argparse.Namespace(**{**vars(args), "per_device_batch_size": mid})
        found = _fastest_fit(spec, changed, keep)
        if found:
            best, lo = (changed, found), mid + 1
        else:
            hi = mid - 1
    return best


MAX_GPUS = 1024


def nearest_fits(spec: ModelSpec, args: argparse.Namespace) -> list[tuple[str, Prediction, argparse.Namespace]]:
    """When nothing fits: for each kind of change, the nearest configuration that fits, as (the change, its
    prediction, the planner's arguments with the change made)."""
    batch = args.per_device_batch_size
    out = []

    def smaller(changed: argparse.Namespace) -> str:
        b = changed.per_device_batch_size
        return "" if b == batch else f"--per_device_train_batch_size {b} instead of {batch}"

    kinds: list[tuple[str, Callable[[Technique], bool]]] = [
        ("a smaller batch", lambda t: not t.checkpointing and t.offload == "none" and t.load_in == "full"),
        ("activation checkpointing", lambda t: t.checkpointing),
        ("offload", lambda t: t.offload != "none"),
    ]
    for kind, keep in kinds:
        found = _largest_batch(spec, args, keep)
        if found:
            changed, pred = found
            words = [] if kind == "a smaller batch" else [f"{kind} ({pred.technique.name})"]
            out.append((" and ".join(w for w in (*words, smaller(changed)) if w), pred, changed))
    # More GPUs shrink only sharded states (ZeRO, FSDP): the fewest GPUs at which a sharded run fits a larger batch
    # than any change above does.
    best_batch = max((changed.per_device_batch_size for _, _, changed in out), default=0)
    n = args.num_gpus * 2
    while n <= MAX_GPUS:
        # One node grows with the GPUs; a multi-node job keeps its nodes' size and adds nodes.
        per_node = n if args.gpus_per_node == args.num_gpus else args.gpus_per_node
        found = _largest_batch(spec, argparse.Namespace(**{**vars(args), "num_gpus": n, "gpus_per_node": per_node}),
                               lambda t: t.sharding != "ddp")
        if found and found[0].per_device_batch_size > best_batch:
            changed, pred = found
            words = f"{n} GPUs instead of {args.num_gpus} ({pred.technique.name})"
            out.append((" and ".join(w for w in (words, smaller(changed)) if w), pred, changed))
            break
        n *= 2
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shared.tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="Hub id or local directory; unset: --model_preset.")
    p.add_argument("--model_preset", default="tiny", choices=("tiny", "base"))
    p.add_argument("--task", default=None, choices=("text-classification", "causal-lm", "image-classification"),
                   help="Default: from the model type (gpt2: causal-lm, bert: text-classification, vit: image).")
    p.add_argument("--vocab_size", type=int, default=None, help="Override the config's vocabulary.")
    p.add_argument("--num_labels", type=int, default=None)
    p.add_argument("--num_gpus", type=int, default=1, help="Devices (processes) in total.")
    p.add_argument("--gpus_per_node", type=int, default=None, help="Default: --num_gpus (one node).")
    p.add_argument("--gpu_memory", type=parse_bytes, default=parse_bytes("80GB"), help="Per device, e.g. 80GB.")
    p.add_argument("--reserve", type=parse_bytes, default=parse_bytes("1GiB"),
                   help="Per device, not available to tensors: CUDA context, allocator fragmentation.")
    p.add_argument("--host_memory", type=parse_bytes, default=None, help="Per node; unset: not checked.")
    p.add_argument("--nvme_memory", type=parse_bytes, default=None, help="Per node; unset: not checked.")
    p.add_argument("--runtime_memory", type=parse_bytes, default=CPU_RUNTIME_BYTES,
                   help="Host memory of one training process before any model state (Python, torch, data).")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--per_device_batch_size", type=int, default=8)
    p.add_argument("--lora_r", type=int, default=8)
    p.add_argument("--kernels", default="cuda", choices=("cuda", "cpu"),
                   help="Which kernels' saved tensors to count (attention, dropout masks): see docs/planner.md.")
    p.add_argument("--disable_dropout", action="store_true")
    p.add_argument("--trust_remote_code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> list[tuple[Prediction, list[str]]]:
    quiet.silence_known_noise()  # before transformers loads torchao: its CUDA-only kernels' messages
    args = build_parser().parse_args(argv)
    for flag in ("num_gpus", "seq_len", "per_device_batch_size", "lora_r"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    args.gpus_per_node = args.gpus_per_node or args.num_gpus
    if args.gpu_memory <= args.reserve:
        raise SystemExit(f"--gpu_memory {fmt(args.gpu_memory)} leaves nothing after --reserve {fmt(args.reserve)}.")
    config, args.task, source = load_config(args.model_name_or_path, args.model_preset, args.task, args.vocab_size,
                                            args.num_labels, args.trust_remote_code)
    spec = model_spec(config, args.task, source, args.disable_dropout)
    rows = plan(spec, args)
    seq = spec.seq_tokens or args.seq_len
    print(f"model: {source}  task: {args.task}  parameters: {spec.num_params / 1e6:,.1f}M "
          f"({spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads, vocab {spec.vocab})")
    print(f"hardware: {args.num_gpus} device(s) of {fmt(args.gpu_memory)} ({fmt(args.reserve)} reserved); "
          f"batch {args.per_device_batch_size} x {seq} tokens per device; kernels: {args.kernels}")
    fits = sorted((r for r in rows if not r[1]), key=lambda r: (r[0].speed, r[0].device_peak))
    print(f"\nFits ({len(fits)}), fastest first (speed: relative step time, a prior, not a measurement):")
    header = f"{'technique':<26}{'prec':<6}{'weights':>11}{'grads':>11}{'optim':>11}{'activ':>11}{'buffers':>11}" \
             f"{'PEAK/dev':>11}{'host/proc':>11}{'speed':>7}"
    print(header)
    for pred, _ in fits:
        t = pred.technique
        print(f"{t.name:<26}{pred.precision:<6}{fmt(pred.weights):>11}{fmt(pred.grads):>11}"
              f"{fmt(pred.optimizer):>11}{fmt(pred.activations):>11}{fmt(pred.buffers):>11}"
              f"{fmt(pred.device_peak):>11}{fmt(pred.host):>11}{pred.speed:>7.2f}")
        _print_command(pred, args)
    print(f"\nDoes not fit or cannot run ({len(rows) - len(fits)}):")
    for pred, why in rows:
        if why:
            print(f"  {pred.technique.name:<26}{pred.precision:<6}{'; '.join(why)}")
    if not fits:
        nearest = nearest_fits(spec, args)
        if nearest:
            print("\nNothing fits as asked. The nearest configurations that fit, and the change each needs:")
            for change, pred, changed in nearest:
                print(f"  {change}: {fmt(pred.device_peak)} per device in {pred.precision}")
                _print_command(pred, changed)
        else:
            smallest = min((p for p, _ in plan(spec, argparse.Namespace(**{**vars(args), "per_device_batch_size": 1,
                                                                            "num_gpus": MAX_GPUS}))),
                           key=lambda p: p.device_peak)
            print(f"\nNothing fits, not even at batch 1 on {MAX_GPUS} GPUs with checkpointing or offload: the "
                  f"smallest need is {fmt(smallest.device_peak)} per device ({smallest.technique.name}). Use "
                  "devices with more memory (--gpu_memory), a shorter --seq_len, or a smaller model.")
    return rows


def _print_command(pred: Prediction, args: argparse.Namespace) -> None:
    """The command under a planned row, what to fill in it, and what the checkout lacks to run it."""
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
        print(f"    note: {note}")


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)


__all__ = ["ModelSpec", "Technique", "TECHNIQUES", "Prediction", "predict", "activation_bytes", "Recompute",
           "recompute_options", "least_recompute", "adam_state_bytes",
           "zero_model_state_bytes", "nf4_bytes", "int8_bytes", "load_config", "model_spec", "plan", "command",
           "nearest_fits", "main"]
