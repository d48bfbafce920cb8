"""Quantization-aware training (torchao): fine-tune with fake-quantized Linear layers (int8 dynamic activations,
int4 or int8 weights, rounded in forward, straight-through in backward) so the weights learn to live on the
quantization grid, then convert to a real quantized model. Reported side by side: the fp32 model it started from,
post-training quantization (PTQ) of that same model with the same scheme, the fake-quantized model after QAT,
and the converted model; plus sizes on disk. QAT starts from a trained model:
    accelerate launch recipes/baseline.py --output_dir outputs/base
    accelerate launch recipes/qat.py --model_name_or_path outputs/base --weight_bits 4
The Linear layers of the transformer blocks are quantized; embeddings, norms and the task head stay fp32.
The converted model is saved as <output_dir>/quantized_model.pt (after
`import torchao`, torch.load(..., weights_only=True) reads it).
On CPU torchao stores int4 weights unpacked, one per int8 byte, so int4 is no smaller on disk than int8 here.
"""

import copy
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core import rules
from shared.core.args import COUNT, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import transformer_layers
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.quant import check_linear_only, conv1d_to_linear, serialized_bytes

RECIPE = "qat"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(instead="a single process or DDP (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml)")


def add_args(p):
    p.add_argument("--weight_bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group_size", type=COUNT, default=32, help="Weights per quantization scale.")


def prefixed(metrics: dict, prefix: str) -> dict:
    return {f"{prefix}_{k.removeprefix('eval_')}": v for k, v in metrics.items()}


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, learning_rate=1e-4)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT)
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
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig
    task = load_task(launch, accelerator)
    model = conv1d_to_linear(task.model)  # GPT-2's Conv1D layers become nn.Linear, which torchao quantizes
    check_linear_only(model, RECIPE, "fake-quantizes (then quantizes)")  # refuses experts that are not nn.Linear
    blocks = next(name for name, m in model.named_modules() if m is transformer_layers(model))
    in_blocks = lambda m, fqn: isinstance(m, nn.Linear) and fqn.startswith(blocks + ".")  # noqa: E731
    rules.check_built(group_size=args.group_size, in_features=tuple(
        m.in_features for m in transformer_layers(model).modules() if isinstance(m, nn.Linear)))

    # The technique: int8 dynamic activations and int4/int8 grouped weights, first fake-quantized, then real.
    scheme = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if args.weight_bits == 4 else torch.int8, weight_granularity=PerGroup(args.group_size))
    start_model = copy.deepcopy(model)  # kept for the comparison: fp32, then post-training quantized
    fp32_bytes = serialized_bytes(model.state_dict())
    quantize_(model, QATConfig(scheme, step="prepare"), filter_fn=in_blocks)

    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, model, max_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_model.to(accelerator.device)
    extras = {"weight_bits": args.weight_bits, "group_size": args.group_size,
              **prefixed(task.evaluate(start_model, eval_dl, accelerator), "fp32_start"),
              **prefixed(task.evaluate(model, eval_dl, accelerator), "before_qat_fake_quant")}
    quantize_(start_model, scheme, filter_fn=in_blocks)  # PTQ: the same scheme, no training
    extras.update(prefixed(task.evaluate(start_model, eval_dl, accelerator), "ptq"))
    del start_model
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        loss = task.loss(model, batch, num_items)
        accelerator.backward(loss)
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    extras.update(prefixed(task.evaluate(model, eval_dl, accelerator), "fake_quant"))
    # Convert: the fake-quantized layers become real int8-activation / intN-weight layers (finish evaluates them).
    quantize_(accelerator.unwrap_model(model), QATConfig(scheme, step="convert"), filter_fn=in_blocks)
    extras["quantized_layers"] = sum(type(m.weight).__name__ != "Parameter" and "Tensor" in type(m.weight).__name__
                                     for m in accelerator.unwrap_model(model).modules() if isinstance(m, nn.Linear))
    extras["fp32_state_dict_bytes"] = fp32_bytes
    if not args.no_save_model and accelerator.is_main_process:  # the converted model, saved here and not by finish
        path = Path(launch.output_dir) / "quantized_model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(accelerator.unwrap_model(model).state_dict(), path)
        task.save_preprocessing(launch.output_dir)
        extras["quantized_model_bytes_on_disk"] = path.stat().st_size
    extras["quantized_state_dict_bytes"] = serialized_bytes(accelerator.unwrap_model(model).state_dict())
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras, save=False)


if __name__ == "__main__":
    main()
