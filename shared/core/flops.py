"""Model FLOPs of a training step, and MFU: the convention of PaLM (appendix B) and torchtitan.

Per token, a forward and backward pass costs 6 FLOPs per weight it multiplies by (2 forward, 4 backward) plus the
attention scores and their weighted sum, 12 * layers * hidden * seq (counted whole: a causal mask is not subtracted,
as PaLM and torchtitan do). Recomputation (activation checkpointing) is not counted: MFU counts the model's FLOPs,
not the hardware's. Weights applied once per sample (BERT's pooler and classifier, ViT's classifier on [CLS]) count
once per sample, not per token; a tied LM head counts (it is a matmul over the vocabulary at every position).
Checked against torch's FlopCounterMode on a real step of each family (tests/test_flops.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .models import HEAD_NAMES, transformer_layers

# Dense bf16 peak FLOP/s of a device, by a substring of torch.cuda.get_device_name(); the vendors' data sheets
# (no sparsity). H200 has H100's SXM tensor cores: the same peak, more and faster memory.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,
    "A100": 312.0e12,
    "L40S": 362.05e12,
    "L4": 121.0e12,
    "A10G": 70.0e12,
}


def _weights(m: nn.Module) -> int:
    # From the layer's shape, not its weight tensor: a 4-bit weight is packed, a ZeRO-3 one is an empty partition.
    if isinstance(m, nn.Linear):
        return m.in_features * m.out_features
    if isinstance(m, Conv1D):
        return m.nx * m.nf
    if isinstance(m, nn.Conv2d):
        return m.in_channels * m.out_channels * m.kernel_size[0] * m.kernel_size[1] // m.groups
    return 0


def _matmul_weights(module: nn.Module) -> int:
    return sum(_weights(m) for m in module.modules())


def training_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """FLOPs of one forward + backward per token of a `seq_len`-token sample (ViT: patches + [CLS])."""
    config = model.config
    blocks = transformer_layers(model)
    per_token = _matmul_weights(blocks)
    heads = [getattr(model, name) for name in HEAD_NAMES if isinstance(getattr(model, name, None), nn.Module)]
    per_sample, patches = 0, 0.0
    if getattr(config, "model_type", "") == "vit":
        # The patch convolution runs once per patch ([CLS] has none), and 4 FLOPs per weight: the pixels need no
        # gradient, so its backward computes the weight's only.
        patches = 4.0 * _matmul_weights(model.vit.embeddings) * (seq_len - 1) / seq_len
    pooler = getattr(getattr(model, "bert", None), "pooler", None)
    if pooler is not None:
        per_sample += _matmul_weights(pooler)
    for head in heads:
        if head is model.get_output_embeddings():
            per_token += _matmul_weights(head)  # the vocabulary head at every position, tied or not
        else:
            per_sample += _matmul_weights(head)
    attention = 12 * len(blocks) * config.hidden_size * seq_len
    return 6.0 * per_token + patches + attention + 6.0 * per_sample / seq_len


def run_flops(model: nn.Module, seq_len: int, tokens_per_second: float, num_devices: int,
              device: torch.device) -> dict[str, float | None]:
    """results.json's `model_flops_per_token`, `achieved_flops_per_device` and `mfu` (None off the peak table).
    `seq_len`: the batches' length (--max_seq_length; shorter padded batches make the attention term an upper
    bound)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", "") == "vit":
        seq_len = (config.image_size // config.patch_size) ** 2 + 1
    try:
        per_token = training_flops_per_token(model, seq_len)
    except (ValueError, AttributeError, TypeError):  # no stack of transformer blocks (a pipeline stage)
        return {"model_flops_per_token": None, "achieved_flops_per_device": None, "mfu": None}
    achieved = per_token * tokens_per_second / num_devices
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return {"model_flops_per_token": per_token, "achieved_flops_per_device": achieved,
            "mfu": achieved / peak if peak else None}


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak, or None when it is not in the table (a CPU, an unknown GPU)."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
