"""QLoRA: the base model is loaded quantized by bitsandbytes (4-bit NF4 by default, or int8) and frozen; only small
LoRA adapters (PEFT) train, in the run's precision. Base weights take ~0.26x (4-bit) or ~0.5x (8-bit) their bf16
bytes, and optimizer state and gradients exist for the adapters only.

--load_in 4bit   NF4 with double quantization (the quantization scales are themselves quantized); compute dtype =
                 the run's precision (fp32, or bf16 / fp16 with --mixed_precision).
--load_in 8bit   LLM.int8() weights.
Gradient checkpointing is on by default (non-reentrant), so the frozen blocks keep only their inputs for backward.
The adapter is saved to <output_dir>/adapter; --merge also writes <output_dir>/merged, a plain full-precision model
(the adapter folded into the original, unquantized weights).
--use_dora trains DoRA adapters (a magnitude vector per adapted weight beside the LoRA direction): docs/dora.md.
With no --model_name_or_path the tiny preset model is saved to <output_dir>/base_model first and quantized from there,
standing in for a pretrained checkpoint.
    accelerate launch recipes/qlora.py --task causal-lm --merge
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/qlora.py   # DDP: one copy per process
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, number, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import AUTO_CLASSES, HEAD_NAMES
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import SHARDINGS, Support
from shared.core.tasks import load_task
from shared.techniques import deepspeed_setup, fsdp_launch
from shared.techniques.deepspeed_setup import gathered_parameters
from shared.techniques.quant import (
    COMPUTE_DTYPES,
    check_linear_only,
    check_lora_targets,
    checkpoint_trainable_only,
    head_names,
    lora_grad_report,
    no_cpu_4bit_repacking,
    quantized_weight_bytes,
)

RECIPE = "qlora"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(fsdp=fsdp_launch.STEPS,  # an FSDP launch: its settings checked, FSDP2 on CPU
                  deepspeed=deepspeed_setup.STEPS,  # a DeepSpeed launch: its agreed settings
                  shardings=SHARDINGS)


def add_args(p):
    p.add_argument("--load_in", default="4bit", choices=("4bit", "8bit"), help="Base weights, by bitsandbytes.")
    p.add_argument("--bnb_4bit_quant_type", default="nf4", choices=("nf4", "fp4"))
    p.add_argument("--no_double_quant", action="store_true", help="Keep the 4-bit scales in fp32.")
    p.add_argument("--bnb_4bit_quant_storage", default="uint8", choices=("uint8", "bfloat16", "float16", "float32"),
                   help="Dtype the packed 4-bit weights are stored in. ZeRO-3 / FSDP shard parameters of the model's "
                        "dtype only: set it to that dtype (e.g. bfloat16) there.")
    p.add_argument("--device_map", default="process", choices=("process", "auto"),
                   help="process: each process holds its whole quantized copy on its own device (DDP or 1 process). "
                        "auto: spread one copy over all visible devices (1 process only).")
    p.add_argument("--lora_r", type=COUNT, default=8)
    p.add_argument("--lora_alpha", type=COUNT, default=16)
    p.add_argument("--lora_dropout", type=number(float, low=0, below=1), default=0.05)
    p.add_argument("--use_dora", action="store_true",
                   help="DoRA (PEFT use_dora): each adapted weight is split into a magnitude per output, which "
                        "trains, and a direction that LoRA updates.")
    p.add_argument("--lora_target_modules", default="all-linear",
                   help="Comma-separated module names, or all-linear (every Linear but the output layer).")
    p.add_argument("--no_gradient_checkpointing", action="store_true")
    p.add_argument("--merge", action="store_true",
                   help="Also write a merged full-precision model to <output_dir>/merged.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(
        args, RECIPE, SUPPORT, load_in=args.load_in, lora=True,
        quant_storage=args.bnb_4bit_quant_storage, spread_devices=args.device_map == "auto",
        merge_unsaved=args.merge and args.no_save_model,
        flags={"load_in": f"--load_in {args.load_in}", "quant_storage": "--bnb_4bit_quant_storage",
               "spread_devices": "--device_map auto", "merge_unsaved": "--merge"})
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        kwargs_handlers=launch.kwargs_handlers,  # a timeout for collectives; gloo on a CPU-only machine
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    # The technique's library, imported once the launch is known to be valid: --help and a refused launch
    # need not wait for its import (seconds).
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    sharded = launch.run.sharded_params  # ZeRO-3 or FSDP: they place the (quantized) shards themselves
    task = load_task(launch, accelerator)
    check_linear_only(task.model, RECIPE, f"quantizes (bitsandbytes, {args.load_in})")  # experts not nn.Linear
    check_lora_targets(task.model, args.lora_target_modules)  # before PEFT, even under --preflight
    out = Path(launch.output_dir)

    # The base checkpoint to quantize: the given one, or the preset model written out once.
    base_dir = args.model_name_or_path or str(out / "base_model")
    if not args.model_name_or_path:
        with gathered_parameters(task.model):  # ZeRO-3 built it partitioned: write the whole weights
            if accelerator.is_main_process:
                task.model.save_pretrained(base_dir)
                task.save_preprocessing(base_dir)
        accelerator.wait_for_everyone()
    config = task.model.config
    del task.model

    # The technique, part 1: load the base quantized by bitsandbytes, frozen, one whole copy per process.
    compute_dtype = COMPUTE_DTYPES[accelerator.mixed_precision]  # the dtype the dequantized matmuls run in
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=args.load_in == "4bit",
        load_in_8bit=args.load_in == "8bit",
        bnb_4bit_quant_type=args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=not args.no_double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=getattr(torch, args.bnb_4bit_quant_storage),
        llm_int8_skip_modules=list(HEAD_NAMES),  # task heads stay in full precision
    )
    if sharded:  # ZeRO-3 / FSDP place the shards; the storage dtype is the dtype of the rest of the model
        device_map, dtype = None, getattr(torch, args.bnb_4bit_quant_storage)
    else:
        device_map, dtype = ("auto" if args.device_map == "auto" else {"": accelerator.device}), None
    model = AUTO_CLASSES[args.task].from_pretrained(
        base_dir, config=config, quantization_config=bnb_config, device_map=device_map, dtype=dtype,
        trust_remote_code=args.trust_remote_code)
    no_cpu_4bit_repacking(model)  # bitsandbytes' in-place CPU repacking breaks training (shared/techniques/quant.py)
    weight_bytes = quantized_weight_bytes(model)
    # Freezes the base, casts norms and heads to fp32 for stable training, and turns on gradient checkpointing.
    # Non-reentrant checkpointing passes gradients through frozen blocks by itself; the reentrant kind would need
    # the inputs made to require grad (prepare_model_for_kbit_training then calls enable_input_require_grads).
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=not args.no_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False})

    # The technique, part 2: LoRA adapters on the quantized Linear layers; a new classification head trains fully.
    target = args.lora_target_modules
    lora_config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, use_dora=args.use_dora,
        target_modules=target if target == "all-linear" else target.split(","),
        modules_to_save=[h for h in head_names(model) if h != "lm_head"] or None,  # lm_head is pretrained, tied
    )
    model = get_peft_model(model, lora_config)
    task.model = model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, model, max_steps)  # trainable (adapter) parameters only

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    checkpoint_trainable_only(accelerator, model)  # checkpoints keep the adapters; the base is rebuilt from base_dir
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits
    grad_checks = []

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        loss = task.loss(model, batch, num_items)
        accelerator.backward(loss)
        if len(grad_checks) < 2:  # LoRA B starts at zero: B gets gradients at once, A from the second backward
            grad_checks.append(lora_grad_report(model))
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    extras = {"bnb_4bit_quant_type": args.bnb_4bit_quant_type if args.load_in == "4bit" else None,
              "load_in": args.load_in, "double_quant": args.load_in == "4bit" and not args.no_double_quant,
              "bnb_compute_dtype": str(compute_dtype).removeprefix("torch."),
              "gradient_checkpointing": not args.no_gradient_checkpointing, "use_dora": args.use_dora,
              "trainable_params": trainable, "total_params": total,
              "trainable_param_names": [n for n, p in accelerator.unwrap_model(model).named_parameters()
                                        if p.requires_grad],
              "lora_grads_first_backward": grad_checks[0] if grad_checks else None,
              "lora_grads_second_backward": grad_checks[1] if len(grad_checks) > 1 else None,
              **weight_bytes,
              "quantized_to_bf16_weight_ratio": weight_bytes["quantized_weight_bytes"]
              / max(1, weight_bytes["same_weights_bf16_bytes"])}

    # The adapter (and a trained head) is what this run produces; the quantized base is not saved.
    if not args.no_save_model:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out / "adapter")
            task.save_preprocessing(str(out / "adapter"))
            extras["adapter_dir"] = str(out / "adapter")
            if args.merge:
                # Fold the adapter into the original full-precision weights, not into the quantized ones.
                base = AUTO_CLASSES[args.task].from_pretrained(base_dir, config=config,
                                                                trust_remote_code=args.trust_remote_code)
                merged = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload()
                merged.save_pretrained(out / "merged")
                task.save_preprocessing(str(out / "merged"))
                extras["merged_dir"] = str(out / "merged")
        accelerator.wait_for_everyone()
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras, save=False)  # the adapter, above


if __name__ == "__main__":
    main()
