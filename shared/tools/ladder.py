"""The technique ladder: the techniques a user adds one by one until a model fits, each rung stacked on the one
before, as recipes/combined.py flags; what each rung costs in memory, predicted by the planner (shared/tools/plan.py)
and run by benchmarks/ladder.py. `python -m shared.tools.ladder --model_name_or_path M --gpu_memory 80GB`
(the planner's flags) prints it for a model and GPU."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..core import rules
from . import catalogue  # every technique's rules; the recipes' SUPPORT
from .plan import (
    LAUNCHES,
    TORCHAO_STATES,
    ModelSpec,
    Prediction,
    Technique,
    fmt,
    predict,
    resolve,
    torchao_adam_state_bytes,
)

OFFLOAD_FLAG = "--activation_offloading"  # recipes/combined.py's (shared/techniques/activation_offload.py)


@dataclass(frozen=True)
class Rung:
    """One step up: the recipes/combined.py flags it changes (None: removed), on the rung before unless `on` names
    another; `config` an accelerate_configs/ file for 2 processes (None: one process)."""

    name: str
    adds: str
    flags: dict[str, str | None] = field(default_factory=dict)
    config: str | None = None
    on: str = ""


# The start: fp32, one padded sample per line (--packing none), no clipping (the optimizer step in backward cannot
# clip: every rung runs without, so that losses compare).
BASE_FLAGS = {"--task": "causal-lm", "--packing": "none", "--max_grad_norm": "0", "--mixed_precision": "no"}
RUNGS: tuple[Rung, ...] = (
    Rung("baseline", "fp32, AdamW, one padded sample per sequence"),
    Rung("bf16", "bf16 autocast (fp32 master weights)", {"--mixed_precision": "bf16"}),
    Rung("packing", "documents packed into full sequences", {"--packing": "concat"}),
    Rung("chunked_loss", "the loss 64 tokens at a time", {"--chunked_loss": "", "--loss_chunk_size": "64"}),
    Rung("selective_ckpt", "selective activation checkpointing",
         {"--gradient_checkpointing": "", "--checkpointing_policy": "selective"}),
    Rung("full_ckpt", "full activation checkpointing", {"--checkpointing_policy": "full"}),
    Rung("adamw_8bit", "bitsandbytes 8-bit AdamW", {"--optim": "adamw_bnb_8bit"}),
    Rung("adamw_4bit", "torchao 4-bit AdamW", {"--optim": "adamw_torchao_4bit"}),
    Rung("optim_in_bwd", "optimizer step in backward", {"--optimizer_in_backward": ""}),
    Rung("act_offload", "activation offloading (checkpointed)", {OFFLOAD_FLAG: "checkpointed"}),
    Rung("lora", "LoRA r=8 on all linears", {"--lora": ""}),
    Rung("qlora", "QLoRA: NF4 base weights", {"--load_in": "4bit"}),
    # Sharding, 2 processes: on the whole stack (refused: DeepSpeed owns the optimizer step), then on the last full
    # fine-tuning rung DeepSpeed can run (its own fp32 AdamW partitions replace the low-bit and in-backward ones).
    Rung("zero2_stack", "ZeRO-2 on the whole stack", config="zero2.yaml"),
    Rung("zero2", "ZeRO-2 (2 processes)", config="zero2.yaml", on="full_ckpt"),
    Rung("zero3", "ZeRO-3 (2 processes)", config="zero3.yaml", on="full_ckpt"),
    Rung("zero3_offload", "ZeRO-3 + CPU offload (2 processes)", config="zero3_offload.yaml", on="full_ckpt"),
)


def stacked(rung: str) -> dict[str, str]:
    """The combined.py flags of a rung: BASE_FLAGS and every change up to it."""
    names = [r.name for r in RUNGS]
    target = RUNGS[names.index(rung)]
    chain: list[Rung] = []
    r = target
    while True:
        chain.append(r)
        i = names.index(r.name)
        if r.on:
            r = RUNGS[names.index(r.on)]
        elif i == 0:
            break
        else:
            r = RUNGS[i - 1]
    flags = dict(BASE_FLAGS)
    for r in reversed(chain):
        for k, v in r.flags.items():
            if v is None:
                flags.pop(k, None)
            else:
                flags[k] = v
    return flags


def argv(flags: dict[str, str]) -> list[str]:
    return [t for k, v in flags.items() for t in ((k, v) if v != "" else (k,))]


def technique(flags: dict[str, str], config: str | None) -> tuple[Technique, str]:
    """The planner's Technique and precision for a rung's flags."""
    launch = {k: v for k, v in LAUNCHES[config.removesuffix(".yaml")].items() if k != "config"} if config else {}
    optim = flags.get("--optim", "adamw")
    tech = Technique(
        "ladder", "combined", config, checkpointing="--gradient_checkpointing" in flags, optimizer=optim,
        load_in=flags.get("--load_in", "full"), lora="--lora" in flags,
        loss_chunk=int(flags.get("--loss_chunk_size", 1024)) if "--chunked_loss" in flags else 0,
        act_offload=flags.get(OFFLOAD_FLAG, ""), selective=flags.get("--checkpointing_policy") == "selective",
        compile="--torch_compile" in flags, **launch)
    return tech, "bf16" if flags.get("--mixed_precision") == "bf16" else "fp32"


def run_of(flags: dict[str, str], config: str | None) -> rules.Run:
    """The rule table's Run for a rung, as recipes/combined.py would build it."""
    tech, precision = technique(flags, config)
    sharding = tech.sharding if config else "none"
    return rules.Run(
        recipe="combined", support=catalogue.recipes_support()["combined"], sharding=sharding, launched=sharding,
        offload=tech.offload,
        num_processes=2 if config else 1, precision="no" if precision == "fp32" else precision,
        load_in=tech.load_in, lora=tech.lora, optimizer=tech.optimizer, in_backward="--optimizer_in_backward" in flags,
        checkpointing=tech.checkpointing, checkpoint_policy=flags.get("--checkpointing_policy", "full"),
        chunked_loss=bool(tech.loss_chunk), activation_offload=tech.act_offload, task="causal-lm",
        packing=flags["--packing"],
        max_grad_norm=float(flags["--max_grad_norm"]),
        flags={"load_in": f"--load_in {tech.load_in}", "lora": "--lora", "optimizer": f"--optim {tech.optimizer}",
               "in_backward": "--optimizer_in_backward", "quant_storage": "--bnb_4bit_quant_storage",
               "activation_offload": f"{OFFLOAD_FLAG} {tech.act_offload}", "checkpointing": "--gradient_checkpointing"})


def predict_rung(spec: ModelSpec, flags: dict[str, str], config: str | None, batch: int, seq: int,
                 kernels: str = "cuda", lora_r: int = 8) -> Prediction:
    """plan.predict for the rung, with what its Technique has no field for: the selective checkpointing policy, and
    the optimizer step in backward on top of a low-bit optimizer (each gradient freed once its parameter stepped)."""
    tech, precision = technique(flags, config)
    n = 2 if config else 1
    p = predict(spec, tech, precision, n, batch, seq, kernels=kernels, lora_r=lora_r)  # the selective policy too
    trainable = spec.tensor_numels
    if tech.adapters:
        trainable = [lora_r * d for i, o in [*spec.lora_targets, *spec.lora_param_targets] for d in (i, o)]
        trainable += [spec.head_numel] if spec.head_numel else []
        if tech.optimizer in TORCHAO_STATES:  # predict() gives the adapters torch AdamW's state
            p.optimizer = torchao_adam_state_bytes(trainable, tech.optimizer)
    if "--optimizer_in_backward" in flags:  # at most one parameter's gradient alive
        wt = spec.weight_bytes if not tech.adapters else 4
        p.grads = wt * max(trainable)
        if tech.optimizer == "adamw" and not config and kernels == "cuda":  # one parameter steps at a time: no
            p.buffers -= wt * spec.num_params  # foreach temporaries over the whole model (predict's AdamW buffer)
        p.notes.append("optimizer step in backward: one parameter's gradient at a time")
    return p


def ladder(spec: ModelSpec, batch: int, seq: int, kernels: str = "cuda",
           lora_r: int = 8) -> list[tuple[Rung, dict[str, str], Prediction, list[str]]]:
    """Every rung: its flags, the prediction, and the rule table's refusals (empty: it trains)."""
    out = []
    for rung in RUNGS:
        flags = stacked(rung.name)
        out.append((rung, flags, predict_rung(spec, flags, rung.config, batch, seq, kernels, lora_r),
                    rules.refusals(run_of(flags, rung.config))))
    return out


# What the first two rungs are when the weights are trained in bf16 (--weights_dtype bf16, or auto on a bf16
# checkpoint): no fp32 anywhere, so "fp32" and "fp32 master weights" would be false.
BF16_WEIGHTS_LABELS = {"baseline": "bf16 weights as loaded, AdamW (no fp32 masters)",
                       "bf16": "bf16 autocast on bf16 weights (no fp32 masters)"}


def rung_label(rung: Rung, spec: ModelSpec) -> str:
    """What the rung adds, in words true for the model's weights dtype."""
    return BF16_WEIGHTS_LABELS.get(rung.name, rung.adds) if spec.weight_bytes == 2 else rung.adds


def print_ladder(spec: ModelSpec, args: argparse.Namespace) -> None:
    """The ladder for the user's model and GPU: per rung, what it adds and the bytes per device."""
    usable = args.gpu_memory - args.reserve
    print(f"Technique ladder for {spec.name}: {args.per_device_batch_size} x {args.seq_len} tokens per device, "
          f"{fmt(args.gpu_memory)} per GPU ({fmt(usable)} usable); each rung adds one technique to the one before "
          "(recipes/combined.py flags; the ZeRO rungs: 2 GPUs)")
    if spec.weight_bytes == 2:
        print(f"weights: --weights_dtype {spec.weights_dtype}: bf16 weights, gradients and AdamW moments, no fp32 "
              "masters (the ZeRO rungs: DeepSpeed keeps its own fp32 partitions)")
    print(f"{'rung':<15}{'adds':<50}{'weights':>10}{'grads':>10}{'optim':>10}{'activ':>10}{'buffers':>10}"
          f"{'peak':>11}{'speed':>7}  fits")
    for rung, _, p, refused in ladder(spec, args.per_device_batch_size, args.seq_len, args.kernels, args.lora_r):
        adds = rung_label(rung, spec)
        if refused:
            print(f"{rung.name:<15}{adds:<50}refused: {refused[0][:150]}")
            continue
        fits = "yes" if p.device_peak <= usable else "no"
        print(f"{rung.name:<15}{adds:<50}{fmt(p.weights):>10}{fmt(p.grads):>10}{fmt(p.optimizer):>10}"
              f"{fmt(p.activations):>10}{fmt(p.buffers):>10}{fmt(p.device_peak):>11}{p.speed:>7.2f}  {fits}")
    print("weights + grads + optim + activ + buffers = peak (buffers: the optimizer's temporaries, the logits at the "
          "loss, gathered shards)")
    dtype = f" --weights_dtype {spec.weights_dtype}" if spec.weights_dtype not in ("fp32", "auto") else ""
    print("Run a rung: accelerate launch [--config_file accelerate_configs/<config>] recipes/combined.py <its flags>"
          f"{dtype}; measured on CPU: benchmarks/ladder.py (docs/ladder.md)")


def main(argv: list[str] | None = None) -> None:
    args, spec = resolve(argv, prog="python -m shared.tools.ladder")
    print_ladder(spec, args)


if __name__ == "__main__":
    main()
