"""What the quantization and pruning recipes share: which layers stay in full precision, the dtype dequantized weights
compute in, and measurements (bytes of quantized weights, size on disk, LoRA gradients, sparsity). The techniques
themselves (BitsAndBytesConfig, get_peft_model, QATConfig, prune calls) stay in the recipes."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ..core import rules
from ..core.errors import InputError
from ..core.models import HEAD_NAMES, transformer_layers
from ..core.rules import Rule

# Accelerate's mixed_precision -> the dtype a run computes in: bitsandbytes dequantizes to it (bnb_4bit_compute_dtype).
COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def head_names(model: nn.Module) -> list[str]:
    """Short names of the model's task head modules (BERT/ViT `classifier`, GPT-2 `lm_head`, Llama `score`)."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules()
                   if name.rsplit(".", 1)[-1] in HEAD_NAMES})


def _tensors_of(obj: object) -> list[torch.Tensor]:
    """A bitsandbytes weight and what dequantizes it (4-bit QuantState: absmax, nested absmax, code; 8-bit: SCB)."""
    out = [obj] if isinstance(obj, torch.Tensor) else []
    for attr in ("quant_state", "state2", "SCB", "CB"):
        sub = getattr(obj, attr, None)
        if sub is not None:
            out += _tensors_of(sub)
    for attr in ("absmax", "code", "offset"):
        t = getattr(obj, attr, None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


def quantized_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the bitsandbytes-quantized Linear weights (with their scales), and of the same weights in bf16."""
    seen: set[tuple] = set()
    stored = bf16 = layers = 0
    for module in model.modules():
        if type(module).__name__ not in ("Linear4bit", "Linear8bitLt"):
            continue
        layers += 1
        w = module.weight
        bf16 += module.in_features * module.out_features * 2
        for t in _tensors_of(w) + _tensors_of(getattr(module, "state", None)):
            t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard: this process's part
            try:
                key, size = (str(t.device), t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
            except RuntimeError:  # a gathered FSDP parameter whose storage was freed again: count its shape
                key, size = (str(t.device), id(t)), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                stored += size
    return {"quantized_layers": layers, "quantized_weight_bytes": stored, "same_weights_bf16_bytes": bf16}


def lora_grad_report(model: nn.Module) -> dict[str, int]:
    """After a backward: how many LoRA A/B matrices got no gradient, or an all-zero one."""
    report = {"lora_params": 0, "lora_no_grad": 0, "lora_A_zero_grad": 0, "lora_B_zero_grad": 0}
    for name, p in model.named_parameters():
        if "lora_" not in name or not p.requires_grad:
            continue
        report["lora_params"] += 1
        if p.grad is None:
            report["lora_no_grad"] += 1
        elif not p.grad.abs().sum().item():
            report["lora_A_zero_grad" if "lora_A" in name else "lora_B_zero_grad"] += 1
    return report


def dir_bytes(path: str | Path) -> int:
    """Size on disk of the weight files in a directory (safetensors / torch pickles), not configs or tokenizers."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def linear_sparsity(model: nn.Module) -> dict[str, float]:
    """Fraction of exact zeros in each nn.Linear weight (after pruning: what was really removed)."""
    return {name: (m.weight == 0).float().mean().item() for name, m in model.named_modules()
            if isinstance(m, nn.Linear)}


def weights_outside_linear(model: nn.Module) -> str:
    """The transformer blocks' weights (2-D and up) that no nn.Linear or Conv1D holds, in words ("" when there are
    none): Mixtral's stacked experts ([experts, out, in] parameters of one module) and its router. A technique that
    finds its layers as nn.Linear (quantization, pruning, FP8) would leave them as they are. Before prepare (ZeRO-3
    partitions the parameters to 0 elements)."""
    from transformers.pytorch_utils import Conv1D

    blocks = transformer_layers(model)
    held = {id(p) for m in blocks.modules() if isinstance(m, (nn.Linear, Conv1D)) for p in m.parameters(False)}
    outside: dict[str, int] = {}
    total = 0
    for name, p in blocks.named_parameters():
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 (zero.Init) partitioned it to an empty tensor
        if len(shape) >= 2:
            total += math.prod(shape)
            if id(p) not in held:
                key = name.split(".", 1)[1]  # without the block's index: one entry for every block
                outside[key] = outside.get(key, 0) + math.prod(shape)
    if not outside:
        return ""
    return f"{', '.join(sorted(outside))} ({sum(outside.values()) / total:.0%} of the blocks' weights)"


def check_linear_only(model: nn.Module, recipe: str, does: str) -> None:
    """Refuse (shared/core/rules.py) a model whose blocks keep weights outside nn.Linear layers when the recipe
    `does` something to those layers only: it would silently leave the rest (a mixture of experts' experts)."""
    rules.check_built(recipe, model_type=getattr(model.config, "model_type", ""), linear_only=does,
                      outside_linear=weights_outside_linear(model))


def check_lora_targets(model: nn.Module, targets: str) -> None:
    """--lora_target_modules names that match no layer of the model: PEFT would stop with NoMatchingPeftModuleError
    when some match none, and quietly adapt fewer layers than named when others match. Refused before loading."""
    if targets == "all-linear":
        return
    names = [n for n, m in model.named_modules() if n]
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    missing = [t for t in targets.split(",") if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import difflib

        near = {t: difflib.get_close_matches(t, leaves, 1) for t in missing}
        hint = "; ".join(f"{t}: did you mean {m[0]}?" for t, m in near.items() if m)
        raise InputError(f"--lora_target_modules: {', '.join(missing)} match(es) no layer of "
                         f"{type(model).__name__}{' (' + hint + ')' if hint else ''}. Its Linear layers are "
                         f"{leaves[:12]}; pass some of them, or all-linear.")


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Swap GPT-2's Conv1D (a Linear with its weight stored transposed) for nn.Linear, in place: quantization
    libraries (torchao quantize_, torch dynamic quantization) only recognise nn.Linear. The math is unchanged; the
    state dict then holds [out, in] weights, so it is saved with torch.save, not reloaded by from_pretrained."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.weight.shape[0], child.nf, device=child.weight.device,
                                   dtype=child.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def serialized_bytes(state_dict: dict) -> int:
    """Bytes of torch.save(state_dict): the size a checkpoint of it takes on disk."""
    import io

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getbuffer().nbytes


def no_cpu_4bit_repacking(model: nn.Module) -> list[str]:
    """bitsandbytes' fast CPU path for 4-bit layers in evaluation (AVX512-BF16 machines) repacks each weight in place
    at the first eval-mode forward. Two traps follow: it needs each layer's output size to divide by 32 and its input
    size by the quantization block (64), else it crashes (a hidden-40 model trained, then failed at evaluation); and
    a training step after it fails ("a view of a leaf Variable ... in-place operation": an evaluation or a measuring
    pass before training breaks the run). A model that trains keeps every 4-bit layer on the plain dequantizing
    path, the same math; returns their names."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
            kept.append(name)
    return kept


def _frozen_fingerprint(model: nn.Module) -> str:
    """A hash of the frozen parameters' bytes (a quantized base's packed codes as they are): equal iff the base a
    resumed run rebuilt is the one the adapters were trained on."""
    import hashlib

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                digest.update(name.encode())
                digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def checkpoint_trainable_only(accelerator, model: nn.Module) -> None:
    """Make save_state / load_state keep only the parameters that train (the adapters, a trained head); the frozen
    base is rebuilt from its source by the run that resumes, and checked to be the same.

    Why: a bitsandbytes 4-bit base's state dict holds its quantization state under extra keys (weight.absmax,
    quant_map, quant_state.bitsandbytes__nf4, ...) that load_state_dict refuses, so a checkpoint of the whole model
    never resumed (measured: every 4-bit QLoRA resume failed); it also rewrote the whole base at every checkpoint.
    For the prepared model of a plain or DDP run (ZeRO and FSDP save their own shards, untouched here).
    """
    import json

    from accelerate.utils import DistributedType
    from safetensors.torch import load_file

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return
    base = _frozen_fingerprint(accelerator.unwrap_model(model))  # once (the base never changes), by its own names

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        for m, state in zip(models, weights, strict=True):
            if m is model:
                trainable = {n for n, p in m.named_parameters() if p.requires_grad}
                for key in [k for k in state if k not in trainable]:
                    del state[key]
        if accelerator.is_main_process:
            (Path(output_dir) / "frozen_base.json").write_text(json.dumps({"sha256": base}))

    def load_hook(models: list, input_dir: str) -> None:
        marker = Path(input_dir) / "frozen_base.json"
        if not marker.exists() or json.loads(marker.read_text()).get("sha256") != base:
            raise InputError(f"{input_dir} was not trained on this base model (its frozen weights differ, or it holds "
                             "a whole model): resume with the --model_name_or_path, --load_in and seed of the run "
                             "that saved it, or drop --resume_from_checkpoint.")
        state = load_file(str(Path(input_dir) / "model.safetensors"), device=str(accelerator.device))
        missing = {n for n, p in model.named_parameters() if p.requires_grad} - set(state)
        unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if missing or unexpected:
            raise InputError(f"{input_dir} holds other trainable parameters than this run's (missing "
                             f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}): resume with the same "
                             "--lora_r, --lora_target_modules and task as the run that saved it.")
        models.remove(model)  # loaded here: Accelerate would load the whole model's state, strictly

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.load_in != "full" and not r.lora,
         lambda r: f"{r.flag('load_in')}: quantized base weights are frozen and cannot train",
         lambda r: f"add {r.flag('lora')} (adapters train on top of them), or load full weights"),
    Rule(lambda r: r.dora and not r.lora,
         lambda r: f"{r.flag('dora')} makes the LoRA adapters DoRA adapters, and {r.flag('lora')} trains none",
         lambda r: f"add {r.flag('lora')}, or drop {r.flag('dora')}"),
    # benchmarks/compat_sweep.py: every ZeRO-3 cell of DoRA on a 4-bit base crashed in the first
    # backward, with or without checkpointing and offload; LoRA on the same base trains there.
    Rule(lambda r: r.dora and r.load_in != "full" and r.sharding == "zero3",
         lambda r: f"{r.flag('dora')} on a {r.load_in.replace('bit', '-bit')} base under zero3: DeepSpeed's backward "
                   "hooks meet a bitsandbytes weight they never partitioned (AttributeError: 'Params4bit' object has "
                   "no attribute 'ds_status')",
         lambda r: f"use FSDP (accelerate_configs/fsdp.yaml) or ZeRO-1/2 for DoRA, or drop {r.flag('dora')} "
                   "(LoRA on this base trains under ZeRO-3)"),
    Rule(lambda r: r.load_in == "8bit" and r.sharded_params,
         lambda r: f"{r.flag('load_in')} under {r.sharding}: int8 bitsandbytes weights cannot be sharded",
         lambda r: f"use 4-bit weights with {r.flag('quant_storage')} bfloat16, or ZeRO-1/2 / DDP"),
    Rule(lambda r: r.load_in == "4bit" and r.sharded_params and r.quant_storage == "uint8",
         lambda r: f"{r.flag('load_in')} under {r.sharding}: parameters are sharded per floating dtype, and "
                   "4-bit weights are packed in uint8 by default",
         lambda r: f"pass {r.flag('quant_storage')} bfloat16 (the model's dtype), or use ZeRO-1/2 / DDP"),
    Rule(lambda r: r.spread_devices and r.num_processes > 1,
         lambda r: f"{r.flag('spread_devices')} spreads one model over several devices, which cannot train "
                   f"data-parallel in {r.num_processes} processes (each needs its whole copy)",
         lambda r: "drop the flag (one copy per process), or launch a single process"),
    Rule(lambda r: r.spread_devices and r.sharded_params,
         lambda r: f"{r.flag('spread_devices')} under {r.sharding}, which places the shards itself",
         lambda r: "drop the flag"),
    Rule(lambda r: r.merge_unsaved,
         lambda r: f"{r.flag('merge_unsaved')} merges the saved adapter, and --no_save_model skips saving it",
         lambda r: "drop one of them"),
    Rule(lambda r: r.group_size > 0 and any(f % r.group_size for f in r.in_features),
         lambda r: f"--group_size {r.group_size} must divide the in_features of every Linear layer in the "
                   f"transformer blocks ({sorted(set(r.in_features))})",
         lambda r: "pass a divisor, e.g. 32", built=True),
    # Mixtral's experts are 3-D parameters, no nn.Linear (found by benchmarks/decoder_presets.py)
    Rule(lambda r: bool(r.linear_only and r.outside_linear),
         lambda r: f"recipes/{r.recipe}.py {r.linear_only} the nn.Linear layers of the transformer blocks, and the "
                   f"{r.model_type or 'model'} blocks' {r.outside_linear} are not nn.Linear layers (a mixture of "
                   "experts' stacked expert weights and router): they would silently stay as they are",
         lambda r: "use a dense model (--model_preset tiny-llama, or a Llama / Mistral / GPT-2 checkpoint), or train "
                   "the mixture of experts in full precision: recipes/baseline.py, zero.py, fsdp.py, or "
                   "recipes/combined.py --lora (PEFT's LoRA adapts the experts too)", built=True),
)
rules.register(*RULES, fields=dict(
    load_in="full", quant_storage="uint8", lora=False, dora=False, spread_devices=False, merge_unsaved=False,
    group_size=0, in_features=(), linear_only="", outside_linear="", model_type=""))
