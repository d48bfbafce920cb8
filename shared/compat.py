"""Which technique combinations train, and which stop before training with their reason and a way out.

Every rule here was found by running the combination (benchmarks/compat.py, docs/results/compat.md): a refusal
replaces a crash deep inside a library, or a run that would silently train something else.
"""

from __future__ import annotations

import argparse

from accelerate.utils import DistributedType


def sharding_of(accelerator) -> str:
    """none | ddp | zero1 | zero2 | zero3 | fsdp: how this run spreads the model state over processes."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return "fsdp"
    return "ddp" if accelerator.num_processes > 1 else "none"


def offload_of(accelerator) -> str:
    """none | cpu | nvme: where optimizer state (and, under ZeRO-3 / FSDP, parameters) are offloaded."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        devices = {(zero.get(part) or {}).get("device", "none") for part in ("offload_optimizer", "offload_param")}
        return "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
    if kind == DistributedType.FSDP:
        from torch.distributed.fsdp import CPUOffloadPolicy

        return "cpu" if isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy) else "none"
    return "none"


def check_combination(args: argparse.Namespace, accelerator) -> None:
    """Stop (SystemExit, naming the problem and the fix) on a combination that cannot train as asked."""
    sharding, offload = sharding_of(accelerator), offload_of(accelerator)
    quantized = args.load_in != "full"
    if quantized and not args.lora:
        raise SystemExit(f"--load_in {args.load_in}: quantized base weights are frozen and cannot train. Add --lora "
                         "(adapters train on top of them), or use --load_in full.")
    if quantized and sharding in ("zero3", "fsdp") and args.load_in == "8bit":
        raise SystemExit(f"--load_in 8bit under {sharding}: int8 bitsandbytes weights cannot be sharded. Use "
                         "--load_in 4bit --bnb_4bit_quant_storage bfloat16, or ZeRO-1/2 / DDP.")
    if args.load_in == "4bit" and sharding in ("zero3", "fsdp") and args.bnb_4bit_quant_storage == "uint8":
        raise SystemExit(f"--load_in 4bit under {sharding}: parameters are sharded per floating dtype, and 4-bit "
                         "weights are packed in uint8 by default. Pass --bnb_4bit_quant_storage bfloat16 (or the "
                         "model's dtype), or use ZeRO-1/2 / DDP.")
    if args.optim == "adamw_8bit" and sharding.startswith("zero") and offload != "none":
        # Accelerate swaps any optimizer for DeepSpeedCPUAdam under ZeRO offload: 32-bit state, not the 8-bit asked.
        raise SystemExit(f"--optim adamw_8bit with ZeRO {offload} offload: the offloaded step runs DeepSpeedCPUAdam "
                         "(32-bit state in host memory), so the 8-bit optimizer would silently not be used. Drop "
                         "--optim adamw_8bit (offload already moves the state off the device), or drop the offload.")
    if args.optim == "adamw_8bit" and sharding == "fsdp":
        raise SystemExit("--optim adamw_8bit under FSDP: bitsandbytes' optimizer kernels do not take FSDP2's sharded "
                         "DTensor parameters (NotImplementedError in optimizer_update). Use ZeRO-1/2 or DDP with the "
                         "8-bit optimizer, or torch AdamW under FSDP.")
