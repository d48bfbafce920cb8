"""Local model directories for the quantization tests, wider than the tiny preset.

The tiny preset's Linear layers (64 wide) are too small to measure quantization savings on: bitsandbytes keeps 32-bit
optimizer state for tensors under 4096 elements, and each 4-bit layer carries ~1.3 KB of fixed constants (its NF4 and
nested-quantization code books). At width 256 both are a fraction of a percent, as in real models.
"""

from __future__ import annotations

from pathlib import Path

from transformers import BertConfig, GPT2Config, ViTConfig

from shared.core import data
from shared.core.models import AUTO_CLASSES


def make_model_dir(root: Path, task: str, hidden: int = 256, layers: int = 2) -> Path:
    """A randomly initialised model (and tokenizer for text) saved like a pretrained checkpoint; reused if present."""
    out = Path(root) / f"{task}-h{hidden}-l{layers}"
    if (out / "config.json").exists():
        return out
    dims = dict(num_hidden_layers=layers, num_attention_heads=hidden // 64, intermediate_size=4 * hidden)
    tokenizer = None
    if task == "image-classification":
        config = ViTConfig(hidden_size=hidden, image_size=32, patch_size=8, num_labels=4, **dims)
    else:
        texts = data.builtin_split(task, "train")["text"]
        tokenizer = data.build_word_tokenizer(texts, task)
        if task == "text-classification":
            config = BertConfig(hidden_size=hidden, max_position_embeddings=128, vocab_size=len(tokenizer),
                                pad_token_id=tokenizer.pad_token_id, **dims)
        else:
            config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=hidden // 64, n_positions=128,
                                vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    AUTO_CLASSES[task].from_config(config).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
