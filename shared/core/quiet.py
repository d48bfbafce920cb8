"""Third-party messages known to be harmless on this stack, silenced narrowly: by logger or warning category and by
message, each with the reason. Anything else, from the same libraries too, still shows."""

from __future__ import annotations

import logging
import re
import warnings

# (logger name, message pattern, why it is harmless)
_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("DeepSpeed", r"^Setting accelerator to CPU",
     "DeepSpeed announces its CPU accelerator on a machine without GPUs; that is the machine it is on"),
    ("torchao", r"^Failed to load .*_C_(mxfp8|cutlass_90a)",
     "torchao's CUDA-only kernels (MX-FP8, Hopper CUTLASS) do not load without a GPU; nothing here uses them there"),
    ("torchao.kernel.intmm", r"Detected no triton",
     "Triton kernels are GPU-only; the CPU paths torchao takes here need none"),
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch.compile",
     "torchao 0.18 registers its enums with torch 2.13's pytree the older way; a deprecation for torchao's authors"),
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community",
     "the optional `kernels` package speeds up bitsandbytes' CPU 4-bit matmul; the built-in path computes the same"),
)
# (category, message pattern, why it is harmless)
_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"fan_in_fan_out is set to False but the target module is `Conv1D`",
     "PEFT sets fan_in_fan_out itself for GPT-2's Conv1D layers, as the message goes on to say"),
    (UserWarning, r"OptimState(4bit|8bit|Fp8) does not implement _stable_hash_for_caching",
     "torchao's optimizer-state subclasses lack a cache hash: torch.compile still caches their compiled step"),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_known_noise() -> None:
    """Install the filters (idempotent). Call before the libraries are first used: their loggers keep the filter."""
    for name, pattern, _why in _LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    for category, pattern, _why in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
