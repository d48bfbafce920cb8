"""Model FLOPs for MFU (shared/core/flops.py) against torch's own count: FlopCounterMode over a real forward and
backward of each family. Eager attention, so that the attention matmuls are ops it counts (it has no formula for
CPU's fused sdpa kernel, which a default ViT uses here)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

from shared.core.flops import peak_flops, training_flops_per_token
from shared.core.models import preset_config

CLASSES = {"causal-lm": AutoModelForCausalLM, "text-classification": AutoModelForSequenceClassification,
           "image-classification": AutoModelForImageClassification}


@pytest.mark.parametrize("task", list(CLASSES))
def test_flops_per_token_equal_torchs_count_of_a_training_step(task):
    torch.manual_seed(0)
    config = preset_config(task, "tiny")
    config._attn_implementation = "eager"
    model = CLASSES[task].from_config(config)
    batch = 3
    if task == "image-classification":
        inputs = {"pixel_values": torch.randn(batch, 3, config.image_size, config.image_size)}
        seq = (config.image_size // config.patch_size) ** 2 + 1
    else:
        seq = 24
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, seq))}
    with FlopCounterMode(display=False) as counter:
        model(**inputs).logits.float().sum().backward()
    measured = counter.get_total_flops()
    predicted = training_flops_per_token(model, seq) * batch * seq
    print(f"{task}: FlopCounterMode {measured:,}, shared.core.flops {predicted:,.0f}")
    assert predicted == pytest.approx(measured, rel=1e-3)
    # the attention term is there: a longer sequence costs more per token
    assert training_flops_per_token(model, 2 * seq) > training_flops_per_token(model, seq)


def test_peak_table_names_the_devices():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756.0e12  # the more specific name wins
    assert peak_flops("cpu") is None
