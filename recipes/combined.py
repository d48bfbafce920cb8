"""Techniques combined: sharding, offload and precision come from the launch config; activation checkpointing
(full or selective), the chunked loss, an 8-bit or 4-bit optimizer stepped after or in backward, LoRA and int8 /
4-bit (NF4) base weights from flags; benchmarks/ladder.py stacks them one by one (docs/ladder.md). Which
combinations train, and which are refused before training (why): benchmarks/compat_sweep.py, docs/results/compat.md.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/combined.py --task causal-lm \
        --lora --gradient_checkpointing --mixed_precision bf16
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/combined.py --load_in 4bit --lora
    accelerate launch --config_file accelerate_configs/zero2_offload.yaml recipes/combined.py --gradient_checkpointing
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/combined.py --lora --mixed_precision bf16
Each technique on its own, explained: recipes/activation_checkpointing.py, optim_8bit.py, qlora.py, zero.py, fsdp.py.
"""

import contextlib
import functools
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DeepSpeedPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, one_of, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import AUTO_CLASSES, HEAD_NAMES
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import SHARDINGS, Support, offload_of, sharding_of
from shared.core.tasks import load_task
from shared.techniques import deepspeed_setup, fsdp_launch
from shared.techniques.activation_offload import ActivationOffloader
from shared.techniques.chunked_loss import ChunkedLoss
from shared.techniques.deepspeed_setup import (
    add_deepspeed_args,
    deepspeed_summary,
    gathered_parameters,
    launched_deepspeed_config,
    patch_zero_step_to_count_states,
    schedule_the_optimizer_that_steps,
    zero3_init,
)
from shared.techniques.optim_8bit import check_paged  # noqa: F401  (--optim adamw_bnb_8bit's rules)
from shared.techniques.optim_in_backward import OptimizerInBackward
from shared.techniques.optim_low_bit import compile_each_shard_apart
from shared.techniques.probes import forward_kept_bytes
from shared.techniques.quant import (
    COMPUTE_DTYPES,
    check_linear_only,
    checkpoint_trainable_only,
    head_names,
    no_cpu_4bit_repacking,
    quantized_weight_bytes,
)
from shared.techniques.selective_checkpointing import checkpoint_kwargs

RECIPE = "combined"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(fsdp=fsdp_launch.STEPS,  # an FSDP launch: its settings checked, FSDP2 on CPU
                  deepspeed=deepspeed_setup.STEPS,  # a DeepSpeed launch: its agreed settings
                  shardings=SHARDINGS)


def add_args(p):
    p.add_argument("--gradient_checkpointing", action="store_true", help="Recompute activations in backward.")
    p.add_argument("--checkpointing_policy", default="full", choices=("full", "selective"),
                   help="With --gradient_checkpointing. selective: keep the matmul and attention outputs too, "
                        "recompute only the cheap ops (recipes/activation_checkpointing.py).")
    p.add_argument("--optim", default="adamw", **one_of("adamw", "adamw_bnb_8bit", "adamw_torchao_4bit"),
                   help="adamw_bnb_8bit: bitsandbytes' AdamW8bit; adamw_torchao_4bit: torchao's AdamW4bit.")
    p.add_argument("--optimizer_in_backward", action="store_true",
                   help="Step each parameter in its gradient hook and free the gradient (optimizer_in_backward.py).")
    p.add_argument("--measure_activations", action="store_true",
                   help="Count the bytes the first forward leaves alive for backward (results: activation_bytes).")
    p.add_argument("--activation_offloading", default=None, choices=("all", "checkpointed"),
                   help="Saved activations to the host (recipes/activation_offloading.py); checkpointed: the inputs of "
                        "the blocks --gradient_checkpointing checkpoints.")
    p.add_argument("--lora", action="store_true", help="Train LoRA adapters (PEFT) on a frozen base model.")
    p.add_argument("--use_dora", action="store_true", help="With --lora: DoRA adapters (PEFT use_dora).")
    p.add_argument("--lora_r", type=COUNT, default=8)
    p.add_argument("--lora_alpha", type=COUNT, default=16)
    p.add_argument("--load_in", default="full", choices=("full", "8bit", "4bit"),
                   help="Base weights: full precision, or quantized by bitsandbytes (needs --lora).")
    p.add_argument("--chunked_loss", action="store_true",
                   help="causal-lm: the loss over chunks of tokens, the head inside each chunk and recomputed in "
                        "backward, so the full logits never exist (recipes/chunked_loss.py).")
    p.add_argument("--loss_chunk_size", type=COUNT, default=1024, help="Tokens per chunk, with --chunked_loss.")
    p.add_argument("--bnb_4bit_quant_storage", default="uint8", choices=("uint8", "bfloat16", "float16", "float32"),
                   help="Dtype the packed 4-bit weights are stored in; ZeRO-3 / FSDP need the model's dtype.")
    add_deepspeed_args(p)


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    ds_config = launched_deepspeed_config(args)  # the launch config chose DeepSpeed: its stage and offload, checked
    plugin = None
    if ds_config:
        # zero.Init builds a full-precision model already partitioned; a quantized one is loaded whole, then split.
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config,
                                 zero3_init_flag=zero3_init(ds_config) and args.load_in == "full")
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(
        args, RECIPE, SUPPORT, deepspeed_config=ds_config, load_in=args.load_in,
        quant_storage=args.bnb_4bit_quant_storage, lora=args.lora, dora=args.use_dora, optimizer=args.optim,
        in_backward=args.optimizer_in_backward,
        checkpointing=args.gradient_checkpointing, checkpoint_policy=args.checkpointing_policy,
        chunked_loss=args.chunked_loss, task=args.task,  # only a causal LM has vocabulary logits to chunk
        activation_offload=args.activation_offloading or "",
        flags={"load_in": f"--load_in {args.load_in}", "quant_storage": "--bnb_4bit_quant_storage",
               "lora": "--lora", "dora": "--use_dora", "optimizer": f"--optim {args.optim}",
               "in_backward": "--optimizer_in_backward",
               "activation_offload": f"--activation_offloading {args.activation_offloading}",
               "checkpointing": "--gradient_checkpointing"})
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
        fsdp_plugin=launch.fsdp_plugin,  # an FSDP launch config's settings, checked (shared/techniques/fsdp_launch.py)
        deepspeed_plugin=plugin,  # None: the launch config's sharding (DDP, FSDP) or none
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    # The technique's library, imported once the launch is known to be valid: --help and a refused launch
    # need not wait for its import (seconds).
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    sharded = launch.run.sharded_params  # ZeRO-3 or FSDP: they place the (quantized) shards themselves
    task = load_task(launch, accelerator)

    if args.load_in != "full":
        check_linear_only(task.model, RECIPE, f"quantizes (bitsandbytes, --load_in {args.load_in})")  # experts
        # Quantized base weights (bitsandbytes), loaded from a checkpoint: the given one, or the preset written out.
        base_dir = args.model_name_or_path or str(Path(launch.output_dir) / "base_model")
        if not args.model_name_or_path:
            with gathered_parameters(task.model):  # ZeRO-3 built it partitioned: gather the whole weights to write them
                if accelerator.is_main_process:
                    task.model.save_pretrained(base_dir)
            accelerator.wait_for_everyone()
        storage = getattr(torch, args.bnb_4bit_quant_storage)
        bnb_config = BitsAndBytesConfig(
            load_in_4bit=args.load_in == "4bit", load_in_8bit=args.load_in == "8bit",
            bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=COMPUTE_DTYPES[accelerator.mixed_precision], bnb_4bit_quant_storage=storage,
            llm_int8_skip_modules=list(HEAD_NAMES))  # task heads stay in full precision
        task.model = AUTO_CLASSES[args.task].from_pretrained(
            base_dir, config=task.model.config, quantization_config=bnb_config,
            # ZeRO-3 / FSDP place the shards themselves; otherwise each process holds its copy on its device.
            device_map=None if sharded else {"": accelerator.device}, dtype=storage if sharded else None,
            trust_remote_code=args.trust_remote_code)
        no_cpu_4bit_repacking(task.model)  # its in-place CPU repacking breaks training (shared/techniques/quant.py)
        task.model = prepare_model_for_kbit_training(
            task.model, use_gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs=checkpoint_kwargs(args.checkpointing_policy))
    elif args.gradient_checkpointing:
        task.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(
            args.checkpointing_policy))
    if args.lora:
        task.model = get_peft_model(task.model, LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, target_modules="all-linear", use_dora=args.use_dora,
            modules_to_save=[h for h in head_names(task.model) if h != "lm_head"] or None))  # new heads train fully

    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optim_cls = torch.optim.AdamW
    if args.optim == "adamw_bnb_8bit":
        import bitsandbytes as bnb

        optim_cls = bnb.optim.AdamW8bit
    elif args.optim == "adamw_torchao_4bit":
        from torchao.optim import AdamW4bit as optim_cls

        if launch.run.sharding == "fsdp":  # its compiled step on FSDP2's uneven shards (techniques/optim_low_bit.py)
            compile_each_shard_apart()
    if args.optimizer_in_backward:  # one optimizer per parameter, stepped by its gradient hook, which frees it
        optim_cls = functools.partial(OptimizerInBackward, optimizer_cls=optim_cls)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps, optimizer_cls=optim_cls)
    for param in optimizer.params if args.optimizer_in_backward else ():
        param.register_post_accumulate_grad_hook(optimizer.step_param)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    if plugin is not None:
        schedule_the_optimizer_that_steps(model, scheduler)  # else, after a resume with offload, the LR freezes
    if args.lora:  # checkpoints keep the adapters: a frozen (quantized) base is rebuilt from its source
        checkpoint_trainable_only(accelerator, model)
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits
    if plugin is not None:
        meter.extras.update(deepspeed_summary(accelerator, model))
        patch_zero_step_to_count_states(meter, model, optimizer)  # ZeRO frees gradients inside its own step
    if args.activation_offloading:  # the model's forwards run under the hooks (techniques/activation_offload.py)
        offloader = ActivationOffloader(accelerator.unwrap_model(model), args.activation_offloading).attach()
    chunked = None
    if args.chunked_loss:
        chunked = ChunkedLoss(args.loss_chunk_size, max_tokens=launch.per_device_train_batch_size * args.max_seq_length,
                              task=task)  # a mixture of experts: its router's loss is added
        measured, batches = chunked.measure_first_batch(accelerator, model, batches)  # plain vs chunked bytes
        meter.extras.update(measured, loss_chunks=chunked.num_chunks)

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        measure = args.measure_activations and step == start_step  # the bytes forward keeps for backward
        with forward_kept_bytes(model, batch) if measure else contextlib.nullcontext() as kept:
            if chunked is not None:  # its head runs outside the model's forward, where prepare's autocast is not
                with accelerator.autocast():
                    loss = chunked(model, batch, num_items)
            else:
                loss = task.loss(model, batch, num_items)
        meter.extras.update({"activation_bytes": kept["bytes"]} if measure else {})
        accelerator.backward(loss)  # under DeepSpeed also clips (gradient_clipping) and steps the optimizer
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        if not args.optimizer_in_backward:  # else each parameter stepped in backward
            optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    if args.activation_offloading:
        offloader.close()
        meter.extras.update(offloader.ledger.summary(), activation_offloading=args.activation_offloading)
    extras = {"sharding": sharding_of(accelerator), "offload": offload_of(accelerator), "lora": args.lora,
              "use_dora": args.use_dora, "chunked_loss": args.chunked_loss,
              "gradient_checkpointing": args.gradient_checkpointing, "load_in": args.load_in,
              "checkpointing_policy": args.checkpointing_policy, "optimizer_in_backward": args.optimizer_in_backward,
              **(optimizer.optimizer.grad_bytes_report() if args.optimizer_in_backward else {}),
              **quantized_weight_bytes(model),  # ZeRO-3 numels live in ds_numel: its parameters are partitioned
              "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad),
              "total_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
